"""What the command line says besides its tables: each warning once per run, as a note in its
own terms (not attributed to ``<frozen runpy>`` or jax's internals); the library's warning of dims
left replicated points at the user's call, the training step's too; hints in the command line's
flags (:func:`nnscaler_jax.cli.common.cli_terms`)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import pytest

from nnscaler_jax.cli.common import cli_terms

ROOT = str(Path(__file__).resolve().parents[2])
REPLICATED = "op dims replicated"


@pytest.mark.slow
def test_the_replicated_dims_warning_prints_once_per_run_as_a_note():
    """mlp at batch 2 on 8 data-parallel devices: the module planned when the variables are
    laid out, the step (the module and its loss, 14 dims) when it is set up and again when it
    is traced (another batch layout); one note, the step's, in the command line's terms."""
    proc = subprocess.run(
        [sys.executable, "-m", "nnscaler_jax", "train", "--model", "mlp", "--mesh", "8",
         "--batch-size", "2", "--policy", "dp", "--steps", "1"],
        capture_output=True, text=True, timeout=240, cwd=ROOT, check=False,
        env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = proc.stderr
    assert err.count(REPLICATED) == 1, err
    assert "nnscaler-jax train: warning: policy 'dp' left 14 op dims replicated" in err
    assert "<frozen runpy>" not in err and "jax/_src" not in err
    assert "nnscaler-jax plan --ops lists them" in err and "str(plan)" not in err


def test_the_library_warning_points_at_the_users_calls():
    """From Python, the warning names the user's line: the ``init`` call, and the step's call
    when the step plans again (not jax's ``api_util.py``, which traces it)."""
    import optax

    import models
    from nnscaler_jax import auto_parallel

    spec = models.get("mlp", "tiny", batch_size=2)
    mesh = jax.make_mesh((8,), ("data",))
    batch = jax.device_put(spec.make_args(abstract=False),
                           jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        pm = auto_parallel(mesh, policy="dp")(spec.module)
        variables = pm.init(jax.random.key(0), *batch)
        step = pm.train_step(spec.loss_fn, optax.adamw(1e-3))
        step(step.init(variables, *batch), *batch)
    ours = [w for w in seen if REPLICATED in str(w.message)]
    assert ours and all(w.filename == __file__ for w in ours), [
        (w.filename, w.lineno) for w in ours]


@pytest.mark.parametrize("text, mesh, said", [
    (("Constraints(pipeline_stages=2) needs a mesh axis 'stage' (or 'pipe') of size 2; the "
      "mesh has {'data': 2, 'model': 4}. E.g. jax.make_mesh((2, 2), ('stage', 'data'))"), "2x4",
     ("--pipeline 2 needs a mesh axis 'stage' (or 'pipe') of size 2; the mesh has {'data': 2, "
      "'model': 4}. E.g. --mesh 2x4 --axes stage,data")),
    ("megatron needs a model axis; E.g. jax.make_mesh((2, 4), ('data', 'model')).", "8",
     "megatron needs a model axis; E.g. --mesh 2x4 --axes data,model."),
    ("Use policy='auto' (it searches within the budget), Constraints(zero=3), more devices",
     "2x4", "Use --policy auto (it searches within the budget), --zero 3, more devices"),
    ("this plan is for mesh {'data': 8}, not {'data': 2}; re-plan for this mesh", "2",
     "re-plan for this mesh (nnscaler-jax plan --mesh ... --out FILE)"),
    ("needs an estimated 30383.58 MiB per device, over the default budget (0.50 MiB)", "8",
     "needs an estimated 29.67 GiB per device, over the default budget (0.50 MiB)"),
])
def test_library_advice_in_the_command_lines_flags(text, mesh, said):
    assert said in cli_terms(text, argparse.Namespace(mesh=mesh))
