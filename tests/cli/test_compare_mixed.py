"""`nnscaler-jax compare --cluster a100-80g-4x+v100-32g-4x`: pipelines over several device
kinds by ours (``auto``), the Metis-style planner and the heterogeneity-unaware one, each
stage's in-stage plan made for its own kind. Paper sizes on abstract shapes."""

from __future__ import annotations

import json

import pytest

from nnscaler_jax.cli import main

MIXED = "a100-80g-4x+v100-32g-4x"


def _run(capsys, *argv):
    code = main(["compare", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_gpt3_6_7b_on_four_a100s_and_four_v100s(capsys):
    """The issue's command: ours fits every kind's memory, >= 1.3x faster than the unaware
    plan and faster than the Metis-style one; the JSON names the stages' kinds, layers and
    in-stage plans."""
    code, out, _ = _run(capsys, "--model", "gpt", "--preset", "gpt3-6.7b", "--mesh", "8",
                        "--cluster", MIXED, "--precision", "float16",
                        "--planners", "auto,uniform,metis", "--json")
    assert code == 0
    res = json.loads(out.strip().splitlines()[-1])
    assert res["cluster"] == MIXED and set(res["budget_bytes"]) == {"a100-80g-4x", "v100-32g-4x"}
    p = res["planners"]
    for name, r in p.items():
        assert r["fits"] is True, (name, r)
        for st in r["stages"]:
            assert st["memory_bytes"] <= st["budget_bytes"]
            assert st["kind"] in ("A100-80G", "V100-32G") and st["policy"]
            assert st["layers"][0] and st["tp"] * st["dp"] == st["devices"][1] - \
                st["devices"][0] + 1
    ours = p["auto"]
    assert {st["kind"] for st in ours["stages"]} == {"A100-80G", "V100-32G"}
    assert all(st["policy"] == "auto" for st in ours["stages"])
    assert {st["policy"] for st in p["metis"]["stages"]} == {"megatron"}
    assert p["uniform"]["step_time_s"] >= 1.3 * ours["step_time_s"]
    assert p["metis"]["step_time_s"] > ours["step_time_s"]
    assert ours["features"]["stages"] == len(ours["stages"])
    code, out, _ = _run(capsys, "--model", "gpt", "--preset", "gpt3-6.7b", "--mesh", "8",
                        "--cluster", MIXED, "--precision", "float16", "--planners", "auto")
    assert code == 0 and "A100-80G x4" in out and "V100-32G x4" in out and "h_" in out


def test_a_larger_batch_runs_the_groups_side_by_side(capsys):
    """GPT-3 1.3B at ``--batch-size 64``: ours runs the A100s and the V100s side by side on
    uneven shares (the A100s more rows), faster than both baselines' pipelines; the table
    says each group's rows. A batch below 1 is a usage error."""
    argv = ["--model", "gpt", "--preset", "gpt3-1.3b", "--mesh", "8", "--cluster", MIXED,
            "--precision", "float16", "--batch-size", "64"]
    code, out, _ = _run(capsys, *argv, "--planners", "auto,metis", "--json")
    assert code == 0
    res = json.loads(out.strip().splitlines()[-1])
    ours, metis = res["planners"]["auto"], res["planners"]["metis"]
    assert res["global_batch"] == 64 and ours["fits"]
    a100, v100 = ours["shares"]
    assert a100 + v100 == 64 and a100 > 2 * v100
    assert [st["kind"] for st in ours["stages"]] == ["A100-80G", "V100-32G"]
    assert ours["features"]["schedule"] == "groups" and metis["shares"] is None
    assert metis["step_time_s"] > ours["step_time_s"]
    code, out, _ = _run(capsys, *argv, "--planners", "auto")
    assert code == 0 and f"{a100} rows" in out and f"{v100} rows" in out
    code, _, err = _run(capsys, *argv[:-1], "0", "--planners", "auto")
    assert code == 2 and "--batch-size 0 must be at least 1" in err


@pytest.mark.parametrize("argv, needle", [
    (["--planners", "auto,megatron"], "planners auto, metis, uniform (not megatron)"),
    (["--mesh", "2x2"], "has 4 devices, --cluster a100-80g-4x+v100-32g-4x 8"),
    (["--pipelines"], "several kinds"),
])
def test_what_a_mixed_cluster_does_not_take_is_a_usage_error(capsys, argv, needle):
    args = {"--mesh": "8", "--planners": "auto"}
    flags = [a for a in argv if a == "--pipelines"]
    valued = [a for a in argv if a not in flags]
    for k, v in zip(valued[::2], valued[1::2], strict=True):
        args[k] = v
    flat = [x for k, v in args.items() for x in (k, v)] + flags
    code, _, err = _run(capsys, "--model", "gpt", "--cluster", MIXED, *flat)
    assert code == 2 and needle in err, err


def test_plan_takes_one_kind_and_bad_groups_are_usage_errors(capsys):
    assert main(["plan", "--model", "gpt", "--mesh", "8", "--cluster", MIXED]) == 2
    assert "planned by compare" in capsys.readouterr().err
    code, _, err = _run(capsys, "--model", "gpt", "--mesh", "8", "--cluster",
                        "a100-80g-4x+tpu-4x")
    assert code == 2 and "not <device>-<n>x" in err


def test_xla_compiles_each_stage_for_its_kind(capsys):
    """``--xla`` on a mixed cluster: every planner's stages compiled by XLA:GPU, each for its
    own kind, judged against that kind's budget (GPT tiny: nothing near a budget)."""
    from nnscaler_jax.mesh.gpu import xla_gpu_missing

    if xla_gpu_missing() is not None:
        pytest.skip(xla_gpu_missing())
    code, out, _ = _run(capsys, "--model", "gpt", "--mesh", "8", "--cluster", MIXED,
                        "--planners", "auto,metis", "--xla", "--json")
    assert code == 0
    res = json.loads(out.strip().splitlines()[-1])
    for name, r in res["planners"].items():
        x = r["xla"]
        assert x["fits"] is True and len(x["stages"]) == len(r["stages"]), name
        for got, st in zip(x["stages"], r["stages"], strict=True):
            assert got["kind"] == st["kind"] and st["kind"].split("-")[0] in got["device"]
            assert got["budget_bytes"] == st["budget_bytes"] and got["peak_bytes"] > 0
