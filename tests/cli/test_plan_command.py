"""``nnscaler-jax plan`` (nnscaler_jax/cli/commands.py) against ``train``: the same options make
the same plan, and what ``train`` refuses ``plan`` refuses with the same message; ``--budget``
on both; the per-module summary by default (``--ops``: every op); sizes in the unit that fits;
``--json`` one object on stdout for every command."""

from __future__ import annotations

import json
import re

import pytest


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


# ---- plan refuses what train refuses -------------------------------------------------------------

PIPELINED = ["--model", "gpt", "--mesh", "2x4", "--axes", "stage,data", "--pipeline", "2",
             "--schedule", "1f1b"]


@pytest.mark.parametrize("extra, needle", [
    # batch 2 on a data axis of 4: no micro-batch count the runtime can run
    ([], ("pipeline: no schedule the runtime can execute for 2 layers on 2 stages x 4 "
          "data-parallel ways with batch 2")),
    # no stage axis: the hint in the command line's flags
    (["--axes", "data,model"], "--pipeline 2 needs a mesh axis 'stage'"),
])
def test_plan_refuses_what_train_refuses_with_the_same_message(cli, extra, needle):
    code, out, plan_err = cli(["plan", *PIPELINED, *extra])
    assert code == 2 and needle in plan_err, plan_err
    assert "micro-batches" not in out  # no schedule printed as if it ran
    code, _, train_err = cli(["train", *PIPELINED, *extra, "--steps", "1"])
    assert code == 2 and needle in train_err
    assert plan_err.split(": ", 2)[2] == train_err.split(": ", 2)[2]  # one message, one check


def test_the_pipeline_hint_is_in_the_command_lines_terms(cli):
    code, _, err = cli(["train", "--model", "gpt", "--mesh", "2x4", "--pipeline", "2"])
    assert code == 2 and "Traceback" not in err
    assert "--mesh 2x4 --axes stage,data" in err
    assert "jax.make_mesh" not in err and "Constraints(" not in err


def test_plan_prints_the_pipeline_train_runs(cli):
    """A batch the data axis and micro-batches divide: the plan's own schedule and micro-batch
    count (what train runs), not a picture of ``2 x stages`` micro-batches."""
    code, out, err = cli(["plan", *PIPELINED, "--batch-size", "8", "--json"])
    assert code == 0, err
    res = _last_json(out)
    pipe = res["pipeline"]
    assert pipe["stages"] == 2 and pipe["schedule"] == "1f1b"
    assert pipe["microbatches"] == res["plan"]["pipeline"]["microbatches"] == 2
    code, out, _ = cli(["plan", *PIPELINED, "--batch-size", "8"])
    assert "schedule 1f1b: 2 stages x 2 micro-batches" in out


def test_plan_takes_the_pipeline_executor(cli):
    """``--executor per-stage``: the plan runs one program per stage (its JSON, its text);
    tensor-parallel cut stages run per stage by default, in one program when asked."""
    code, out, err = cli(["plan", *PIPELINED, "--batch-size", "8", "--executor", "per-stage",
                          "--json"])
    assert code == 0, err
    res = _last_json(out)
    assert res["pipeline"]["executor"] == res["plan"]["pipeline"]["executor"] == "per-stage"
    for extra, want in (([], "per-stage"), (["--executor", "in-graph"], "in-graph")):
        code, out, err = cli(["plan", "--model", "t5", "--mesh", "2x2x2", "--axes",
                              "stage,data,model", "--policy", "megatron", "--pipeline", "2",
                              "--batch-size", "16", "--json"] + extra)
        assert code == 0, err
        assert _last_json(out)["plan"]["pipeline"].get("executor", "in-graph") == want


def test_plan_takes_the_overlap_flag(cli):
    """``--overlap on|off``: the plan's pipeline overlaps its transfers or not (its JSON, its
    text); asked of tensor-parallel cut stages, refused in the command line's terms."""
    for flag, want in (("on", True), ("off", False)):
        code, out, err = cli(["plan", *PIPELINED, "--batch-size", "8", "--overlap", flag,
                              "--json"])
        assert code == 0, err
        assert _last_json(out)["plan"]["pipeline"].get("overlap", False) is want
    code, out, _ = cli(["plan", *PIPELINED, "--batch-size", "8", "--overlap", "on"])
    assert "transfers overlapped with the next step" in out
    code, out, err = cli(["plan", "--model", "t5", "--mesh", "2x2x2", "--axes",
                          "stage,data,model", "--policy", "megatron", "--pipeline", "2",
                          "--batch-size", "16", "--overlap", "on"])
    assert code == 2 and "Traceback" not in err
    assert "--overlap on" in err and "Drop --overlap" in err


@pytest.mark.slow
def test_train_runs_the_pipeline_plan_printed(cli):
    code, out, err = cli(["plan", *PIPELINED, "--batch-size", "8", "--json"])
    assert code == 0, err
    planned = _last_json(out)
    code, out, err = cli(["train", *PIPELINED, "--batch-size", "8", "--steps", "1", "--json"])
    assert code == 0, err
    trained = _last_json(out)
    assert trained["plan"]["microbatches"] == planned["pipeline"]["microbatches"]
    assert trained["plan"]["stages"] == planned["pipeline"]["stages"]
    assert trained["predicted_step_s"] == pytest.approx(planned["cost"]["step_time_s"])
    # the pipelined step's memory, measured and predicted (it printed none)
    mem = trained["memory"]
    assert mem["predicted"]["peak"] == planned["cost"]["memory_bytes_per_device"]
    assert mem["measured"]["params"] == pytest.approx(mem["predicted"]["params"], rel=0.01)


# ---- --budget on plan and train ------------------------------------------------------------------


def test_plan_takes_a_budget_and_refuses_a_plan_over_it(cli):
    code, out, err = cli(["plan", "--model", "mlp", "--policy", "dp", "--json"])
    assert code == 0, err
    need = _last_json(out)["cost"]["memory_bytes_per_device"]
    code, _, err = cli(["plan", "--model", "mlp", "--policy", "dp", "--budget",
                         str(need - 1)])
    assert code == 2 and "over" in err and "Traceback" not in err
    # the search finds a plan within the budget dp misses
    code, out, err = cli(["plan", "--model", "mlp", "--budget", str(need - 1), "--json"])
    assert code == 0, err
    assert _last_json(out)["cost"]["memory_bytes_per_device"] <= need - 1


def test_train_takes_a_budget(cli):
    code, _, err = cli(["train", "--model", "mlp", "--policy", "dp", "--budget", "1KiB",
                         "--steps", "1"])
    assert code == 2 and "over --budget 1024" in err and "Traceback" not in err
    code, _, err = cli(["train", "--model", "mlp", "--budget", "lots", "--steps", "1"])
    assert code == 2 and "bad --budget 'lots'" in err


# ---- the summary by default ----------------------------------------------------------------------


def test_plan_prints_one_row_per_module(cli):
    """GPT-3 175B's 96 identical layers read as one group row (3,178 lines before)."""
    code, out, err = cli(["plan", "--model", "gpt", "--preset", "gpt3-175b", "--policy",
                           "megatron"])
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) < 60 and any(line.startswith("h_* (x96)") for line in lines)
    assert "GiB" in lines[-2] and "MiB" not in lines[-2]  # the estimate in the unit that fits


def test_plan_ops_prints_every_op(cli):
    argv = ["plan", "--model", "gpt", "--mesh", "2x4", "--policy", "megatron"]
    summary, ops = (cli(a)[1] for a in (argv, [*argv, "--ops"]))
    assert "h_* (x2)" in summary and "h_1/mlp/c_fc" not in summary
    assert "h_0/mlp/c_fc" in ops and "h_1/mlp/c_fc" in ops
    assert len(ops.splitlines()) > len(summary.splitlines())


# ---- sizes and --json ----------------------------------------------------------------------------


@pytest.mark.slow
def test_compare_prints_gib_sized_figures_in_gib(cli):
    code, out, err = cli(["compare", "--model", "gpt", "--preset", "gpt3-1.3b", "--cluster",
                           "v100-32g-8x", "--planners", "dp,megatron"])
    assert code == 0, err
    dp = next(line for line in out.splitlines() if line.startswith("dp "))
    # the estimate (29 GiB, over the V100's budget) in GiB, the note's library message too
    assert re.search(r">= 29\.\d\d GiB", dp) and "MiB" not in dp, dp


@pytest.mark.parametrize("argv", [
    ["graph", "--model", "mlp"],
    ["plan", "--model", "mlp", "--policy", "dp"],
    ["compare", "--model", "mlp", "--planners", "dp"],
    ["verify", "--model", "mlp", "--policy", "dp"],
    ["train", "--model", "mlp", "--policy", "dp", "--steps", "1"],
])
def test_json_is_one_object_on_stdout_with_ok(cli, argv):
    code, out, err = cli([*argv, "--json"])
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1 and _last_json(out)["ok"] is True
