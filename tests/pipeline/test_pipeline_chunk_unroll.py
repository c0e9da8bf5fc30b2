"""A chunk's layers run unrolled in 'chunk' recompute mode (pipeline/stacked.py ``_chunk``).

Unrolled, XLA fuses across the layers as in one program; a rolled ``lax.scan`` over the layers
stacks every residual jax's partial evaluation names (GPT's 1F1B step: 80 -> 57 MB of XLA temp;
here GPT tiny with 8 layers, 907 KB unrolled against 1.25 MB rolled on XLA:CPU).

The property checked is structural, not a timing or a byte count: the number of ``while``
loops in the step's lowered StableHLO (jax's own output, before any XLA pass). The same step
built with ``lax.scan``'s ``unroll`` dropped (``jax.lax.scan`` patched to ignore it) is the
rolled baseline: every chunk forward (and its recompute / vjp in the backward) then adds a
loop over the layers. The unrolled step must have fewer loops than that baseline; dropping
``unroll=True`` from the runtime makes both the same.
"""

import jax
import optax
import pytest
from meshes import make_mesh

import models
from nnscaler_jax import Constraints, auto_parallel

pytestmark = pytest.mark.slow  # traces and lowers the pipelined step over the mesh


def _lowered_whiles(spec, variables, tokens):
    mesh = make_mesh((2, 4), ("stage", "data"))
    pm = auto_parallel(mesh, Constraints(pipeline_stages=2, microbatches=2,
                                         schedule="1f1b"))(spec.module)
    step = pm.train_step(spec.loss_fn, optax.sgd(0.1))
    state = step.init(variables, tokens)
    assert step.plan.pipeline.recompute == "chunk"  # (the mode that unrolls)
    return step.lower(state, tokens).as_text().count("stablehlo.while")


def test_chunk_layers_are_unrolled(monkeypatch):
    spec = models.get("gpt", "tiny", n_layers=8, batch_size=16)
    (tokens,) = spec.make_args()
    variables = spec.init(jax.random.key(0))
    unrolled = _lowered_whiles(spec, variables, tokens)
    real = jax.lax.scan

    def rolled(f, init, xs=None, length=None, **kw):
        kw.pop("unroll", None)
        return real(f, init, xs, length, **kw)

    monkeypatch.setattr(jax.lax, "scan", rolled)
    baseline = _lowered_whiles(spec, variables, tokens)
    assert unrolled < baseline, (unrolled, baseline)
