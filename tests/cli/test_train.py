"""``nnscaler-jax train`` (nnscaler_jax/cli/train.py): losses across a checkpoint and a resume
onto another mesh, two processes against one, the user errors, and the human output.

The training runs call the command in-process (``main([...])``, the 8 CPU devices of conftest);
only ``--processes`` starts real processes (under a hard timeout).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_run import run_cli

from nnscaler_jax.cli.main import _parser
from nnscaler_jax.cli.train import child_argv

ROOT = str(Path(__file__).resolve().parents[2])
GPT = ["train", "--model", "gpt", "--preset", "tiny", "--seed", "3", "--batch-size", "8"]


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def six_steps() -> dict:
    """The uninterrupted reference: 6 steps of GPT tiny on the 2 x 4 mesh, one process."""
    code, out, err = run_cli([*GPT, "--mesh", "2x4", "--steps", "6", "--json"])
    assert code == 0, err
    return _last_json(out)


# ---- the reference run's JSON ------------------------------------------------------------------


@pytest.mark.slow
def test_json_fields(six_steps):
    res = six_steps
    assert res["start_step"] == 0 and res["steps"] == 6 and len(res["losses"]) == 6
    assert all(np.isfinite(res["losses"]))
    assert res["step_time_s"] > 0 and res["first_step_s"] > 0 and res["predicted_step_s"] > 0
    assert res["unit"] == "token" and res["units_per_step"] == 8 * 16  # batch 8, seq 16
    assert res["tokens_per_s"] == pytest.approx(128 / res["step_time_s"])
    assert res["flops_per_step"] > 0
    assert res["mfu"] is None and "no peak FLOP/s known" in res["mfu_basis"]  # CPU
    mem = res["memory"]
    for kind in ("params", "grads", "optimizer"):  # the plan prices what the state holds
        assert mem["measured"][kind] == pytest.approx(mem["predicted"][kind], rel=0.05)
    assert res["plan"]["policy"] == "auto" and res["plan"]["zero"] == 0
    assert res["plan"]["microbatches"] == 1 and res["plan"]["precision"] is None
    assert res["checkpoint"] is None and res["processes"] == 1 and res["devices"] == 8


def test_precision_sets_the_zoo_layers_dtype():
    """``--precision bf16`` on the zoo's GPT (whose layers default to ``dtype=float32``): the
    layers compute in bfloat16 (no float32-matmul warning), the plan records it, and the JSON
    carries the allocator's peak (null on CPU, which keeps no statistics)."""
    code, out, err = run_cli([*GPT, "--mesh", "2x4", "--steps", "2", "--precision", "bf16",
                           "--json"])
    assert code == 0, err
    assert "still compute in float32" not in err  # (the package's warnings print as notes)
    res = _last_json(out)
    assert res["plan"]["precision"] == "bfloat16" and all(np.isfinite(res["losses"]))
    assert res["memory"]["device_peak"] is None


# ---- checkpoint, then resume onto another mesh ----------------------------------------------------


@pytest.mark.slow
def test_resume_on_another_mesh_continues_the_uninterrupted_losses(six_steps, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    code, out, err = run_cli([*GPT, "--mesh", "2x4", "--steps", "3", "--checkpoint-dir", ckpt,
                           "--json"])
    assert code == 0, err
    first = _last_json(out)
    assert first["checkpoint"] == {"dir": ckpt, "last_saved_step": 3, "resumed_from": None,
                                   "settings": None}
    np.testing.assert_allclose(first["losses"], six_steps["losses"][:3], rtol=1e-6)

    # a second fresh run into the same directory would overwrite it: refused
    code, _, err = run_cli([*GPT, "--mesh", "2x4", "--steps", "3", "--checkpoint-dir", ckpt])
    assert code == 2 and "already holds checkpoints (steps [1, 2, 3])" in err

    code, out, err = run_cli([*GPT, "--mesh", "4x2", "--steps", "6", "--resume",
                           "--checkpoint-dir", ckpt, "--json"])
    assert code == 0, err
    res = _last_json(out)
    assert res["start_step"] == 3 and res["steps"] == 6 and len(res["losses"]) == 3
    # another mesh sums the gradients in another order: measured 1.1e-7 relative at step 5
    np.testing.assert_allclose(res["losses"], six_steps["losses"][3:], rtol=1e-4)
    assert res["checkpoint"]["last_saved_step"] == 6 and res["checkpoint"]["resumed_from"] == 3

    from nnscaler_jax.train.checkpoint import Checkpointer

    with Checkpointer(ckpt) as saved:  # the meta has every loss so far, both runs'
        meta = saved.info().meta
    assert meta["model"] == "gpt" and meta["seed"] == 3
    np.testing.assert_allclose(meta["losses"], first["losses"] + res["losses"])


@pytest.mark.slow
def test_a_pipelined_runs_checkpoint_resumes_under_the_spmd_plan(six_steps, tmp_path):
    """The checkpoint holds the module's trees, not the pipeline runtime's layout: a run
    with 2 stages resumes with none (and would with other stages) on the uninterrupted
    losses."""
    ckpt = str(tmp_path / "ckpt")
    code, out, err = run_cli([*GPT, "--mesh", "2x4", "--axes", "stage,data", "--pipeline", "2",
                              "--microbatches", "2", "--steps", "3", "--checkpoint-dir", ckpt,
                              "--json"])
    assert code == 0, err
    first = _last_json(out)
    assert first["plan"]["stages"] == 2
    np.testing.assert_allclose(first["losses"], six_steps["losses"][:3], rtol=1e-4)
    code, out, err = run_cli([*GPT, "--mesh", "2x4", "--axes", "data,model", "--pipeline", "1",
                              "--microbatches", "1", "--steps", "6", "--resume",
                              "--checkpoint-dir", ckpt, "--json"])
    assert code == 0, err
    res = _last_json(out)
    assert res["start_step"] == 3 and res["plan"].get("stages", 1) == 1
    np.testing.assert_allclose(res["losses"], six_steps["losses"][3:], rtol=1e-4)


def test_resume_keeps_the_checkpoints_plan_settings_and_says_what_changed(tmp_path):
    """A resumed run plans as the checkpoint's run did (not with the default policy): the
    settings not given again are kept, and stderr names them; one given again is this run's,
    and stderr says what it changed."""
    ckpt = str(tmp_path / "ckpt")
    first = ["train", "--model", "mlp", "--mesh", "2x4", "--policy", "megatron", "--zero", "1",
             "--lr", "0.01"]
    code, _, err = run_cli([*first, "--steps", "1", "--checkpoint-dir", ckpt, "--json"])
    assert code == 0, err

    code, out, err = run_cli(["train", "--model", "mlp", "--mesh", "2x4", "--steps", "2",
                           "--resume", "--checkpoint-dir", ckpt, "--json"])
    assert code == 0, err
    res = _last_json(out)
    assert res["plan"]["policy"] == "megatron" and res["plan"]["zero"] == 1
    assert ("resuming with the checkpoint's settings: --policy megatron, --zero 1, --lr 0.01"
            in err)
    assert res["checkpoint"]["settings"] == {
        "kept": {"policy": "megatron", "zero": 1, "lr": 0.01}, "changed": {}}

    code, out, err = run_cli(["train", "--model", "mlp", "--mesh", "4x2", "--steps", "3",
                           "--resume", "--checkpoint-dir", ckpt, "--policy", "dp", "--json"])
    assert code == 0, err
    res = _last_json(out)
    assert res["plan"]["policy"] == "dp" and res["plan"]["zero"] == 1
    assert ("this run changes the checkpoint's settings: --policy megatron -> dp, "
            "--mesh 2x4 -> 4x2") in err
    assert res["checkpoint"]["settings"]["changed"]["policy"] == {"checkpoint": "megatron",
                                                                  "now": "dp"}


def test_resume_settings_of_a_checkpoint_written_before_they_were_kept():
    """Older checkpoints' meta has the policy, batch size and lr at the top level."""
    from nnscaler_jax.cli.train import resume_settings

    args = _parser().parse_args(["train", "--model", "gpt", "--resume", "--checkpoint-dir", "d",
                                 "--plan", "p.json"])
    args, report = resume_settings(args, {"mesh": "2x4", "policy": "megatron", "lr": 0.01,
                                          "batch_size": None})
    # a --plan given now is this run's plan: the checkpoint's policy is not mixed into it
    assert args.policy is None and args.plan == "p.json" and args.lr == 0.01
    assert report == {"kept": {"lr": 0.01},
                      "changed": {"policy": {"checkpoint": "megatron", "now": None},
                                  "plan": {"checkpoint": None, "now": "p.json"}}}


# ---- two processes -------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_processes_train_what_one_process_trains(six_steps):
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-m", "nnscaler_jax", *GPT, "--mesh", "2x4",
                           "--steps", "6", "--processes", "2", "--json"],
                          capture_output=True, text=True, timeout=240, env=env, cwd=ROOT,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = _last_json(proc.stdout)
    assert res["processes"] == 2 and res["devices"] == 8 and res["start_step"] == 0
    assert proc.stdout.count('"losses"') == 1  # only process 0 prints its JSON
    # Same plan, same numbers: only where a reduction's operands are summed can differ. Over
    # the 2 x 4 mesh each process holds one 'data' row, so the 'model' all-reduces stay inside
    # a process (as in one process) and the cross-process (gloo) ones have two operands, whose
    # sum has one order: measured bit-equal. A plan that splits a dim over both axes (8 ways,
    # e.g. --batch-size 2 here) sums 8 operands in another order over gloo than inside one XLA
    # CPU client: measured 2.3e-7 relative (a few float32 ulps; Adam keeps it there over 6
    # steps). rtol 1e-6 allows that, and nothing more.
    assert res["losses"][0] == six_steps["losses"][0]
    np.testing.assert_allclose(res["losses"], six_steps["losses"], rtol=1e-6)


@pytest.mark.slow
def test_two_processes_train_a_pipelined_model_and_one_resumes_its_checkpoint(tmp_path):
    """GPT tiny on 2 stages x 4 data over two processes, a stage each (the transfers between
    stages cross processes, over gloo): the losses one process trains, and the checkpoint the
    two wrote resumes in one process as if never interrupted (measured bit-equal; rtol 1e-6
    as above). Laying the parameters out on the host used jax.devices('cpu')[0], process 0's
    device, in every process: process 1 failed."""
    ckpt = str(tmp_path / "ckpt")
    pipe = ["train", "--model", "gpt", "--mesh", "2x4", "--pipeline", "2", "--axes",
            "stage,data", "--batch-size", "16", "--json"]
    proc = subprocess.run([sys.executable, "-m", "nnscaler_jax", *pipe, "--steps", "3",
                           "--processes", "2", "--checkpoint-dir", ckpt],
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = _last_json(proc.stdout)
    assert two["processes"] == 2 and two["plan"]["stages"] == 2
    assert two["plan"]["executor"] == "in-graph"
    code, out, err = run_cli([*pipe, "--steps", "5"])
    assert code == 0, err[-2000:]
    whole = _last_json(out)["losses"]
    np.testing.assert_allclose(two["losses"], whole[:3], rtol=1e-6)
    code, out, err = run_cli([*pipe, "--steps", "5", "--checkpoint-dir", ckpt, "--resume"])
    assert code == 0, err[-2000:]
    res = _last_json(out)
    assert res["start_step"] == 3 and res["processes"] == 1
    np.testing.assert_allclose(res["losses"], whole[3:], rtol=1e-6)


@pytest.mark.slow
def test_two_processes_run_tensor_parallel_cut_stages_in_one_program():
    """T5 tiny, Megatron stages (2 stages x 2 data x 2 model) over two processes: the
    per-stage runtime cannot move values between processes (the run failed at its first
    step), so the stages run in one program, each device's blocks, their collectives inside
    one stage's branch crossing processes over gloo; the losses are one process's (per
    stage, its default there)."""
    t5 = ["train", "--model", "t5", "--mesh", "2x2x2", "--axes", "stage,data,model",
          "--policy", "megatron", "--pipeline", "2", "--batch-size", "8", "--steps", "2",
          "--json"]
    proc = subprocess.run([sys.executable, "-m", "nnscaler_jax", *t5, "--processes", "2"],
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = _last_json(proc.stdout)
    code, out, err = run_cli(t5)
    assert code == 0, err[-2000:]
    one = _last_json(out)
    assert (two["plan"]["executor"], one["plan"]["executor"]) == ("in-graph", "per-stage")
    np.testing.assert_allclose(two["losses"], one["losses"], rtol=1e-6)


@pytest.mark.slow
def test_an_nnx_model_trains_pipelined_and_resumes_under_the_spmd_plan(tmp_path):
    """gpt_nnx on 2 stages x 4 data: the pipelined step runs nnx modules (its dropout keyed),
    and its checkpoint (the module's trees) resumes under the SPMD plan, which keys the
    module's streams from the run's key too (it was "written by another model")."""
    ckpt = str(tmp_path / "ckpt")
    nnx_gpt = ["train", "--model", "gpt_nnx", "--mesh", "2x4", "--batch-size", "16", "--json",
               "--checkpoint-dir", ckpt]
    code, out, err = run_cli([*nnx_gpt, "--pipeline", "2", "--axes", "stage,data",
                              "--steps", "2"])
    assert code == 0, err[-2000:]
    res = _last_json(out)
    assert res["plan"]["stages"] == 2 and len(res["losses"]) == 2
    assert all(np.isfinite(res["losses"]))
    code, out, err = run_cli([*nnx_gpt, "--pipeline", "1", "--axes", "data,model",
                              "--steps", "3", "--resume"])
    assert code == 0, err[-2000:]
    res = _last_json(out)
    assert res["start_step"] == 2 and res["plan"].get("stages", 1) == 1
    assert len(res["losses"]) == 1 and np.isfinite(res["losses"][0])  # (step 3 of 3)


# ---- errors a user causes ------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["train", "--model", "nope"], "unknown model 'nope'"),
    (["train", "--model", "gpt", "--mesh", "2y4"], "bad mesh '2y4'"),
    (["train", "--model", "gpt", "--resume"], "--resume needs --checkpoint-dir"),
    (["train", "--model", "gpt", "--steps", "-1"], "--steps -1 must be at least 0"),
    (["train", "--model", "gpt", "--mesh", "2x4", "--processes", "3"],
     "K must divide the size"),
    (["train", "--model", "gpt", "--precision", "int3"], "precision"),
])
def test_usage_errors_are_one_line_and_exit_2(argv, message):
    code, out, err = run_cli([*argv, "--json"])
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert _last_json(out)["ok"] is False


@pytest.mark.parametrize("make", [lambda p: p, lambda p: p / "missing"])
def test_resume_without_a_checkpoint_exits_2(tmp_path, make):
    code, _, err = run_cli(["train", "--model", "gpt", "--resume", "--checkpoint-dir",
                         str(make(tmp_path))])
    assert code == 2 and "no checkpoint to restore" in err and "Traceback" not in err


@pytest.mark.slow
def test_resume_from_another_models_checkpoint_exits_2_with_the_checkpoint_error(tmp_path):
    ckpt = str(tmp_path / "mlp")
    assert run_cli(["train", "--model", "mlp", "--mesh", "8", "--steps", "1",
                 "--checkpoint-dir", ckpt, "--json"])[0] == 0
    code, _, err = run_cli([*GPT, "--mesh", "2x4", "--steps", "2", "--resume",
                         "--checkpoint-dir", ckpt])
    assert code == 2 and "Traceback" not in err
    assert f"checkpoint step 1 in {ckpt} was written by another model" in err
    assert "Fix: restore with the model that wrote it" in err


# ---- the human output ----------------------------------------------------------------------------


@pytest.mark.slow
def test_human_output_has_a_line_per_step_and_a_summary(tmp_path):
    code, out, err = run_cli(["train", "--model", "mlp", "--mesh", "2x4", "--steps", "3",
                           "--checkpoint-dir", str(tmp_path / "c"), "--every", "2"])
    assert code == 0, err
    lines = out.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [s.split()[1] for s in steps] == ["1/3", "2/3", "3/3"]
    assert "(compiling)" in steps[0] and "[checkpoint]" in steps[1]  # --every 2
    assert all("loss " in s and "predicted" in s and "examples/s" in s for s in steps)
    assert "MFU n/a" in steps[-1]
    assert any(line.startswith("trained steps 1..3: loss") for line in lines)
    assert any(line.startswith("memory per device, measured / predicted") for line in lines)
    assert f"checkpoint: {tmp_path / 'c'} (last saved step 3)" in out  # the last step too
    assert not out.strip().splitlines()[-1].startswith("{")  # no JSON without --json


def test_child_argv_round_trips_without_processes_and_devices():
    parser = _parser()
    argv = ["train", "--model", "gpt", "--mesh", "2x4", "--steps", "6", "--lr", "0.003",
            "--checkpoint-dir", "/tmp/x", "--resume", "--zero", "1", "--json"]
    args = parser.parse_args([*argv, "--processes", "2", "--devices", "8"])
    child = child_argv(args)
    assert "--processes" not in child and "--devices" not in child
    again = vars(parser.parse_args(child))
    assert {k: v for k, v in again.items() if k not in ("processes", "devices")} == \
        {k: v for k, v in vars(args).items() if k not in ("processes", "devices")}
