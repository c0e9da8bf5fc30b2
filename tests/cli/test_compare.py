"""`nnscaler-jax compare` under a memory budget: with ``--cluster`` the device's memory less the
reserve is every planner's budget, ``--budget`` overrides it, a planner that finds nothing within
it reports ``fits: false`` and its smallest estimate (the command still exits 0), and each entry
lists the plan's features. Paper-scale models run on abstract shapes (nothing compiles)."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import optax
import pytest
from meshes import make_mesh

import models
from nnscaler_jax import auto_parallel
from nnscaler_jax.capture.trace import capture_spec
from nnscaler_jax.cli import main
from nnscaler_jax.cli.compare import best_over_meshes, plan_features, smallest_estimate
from nnscaler_jax.cost.devices import DEFAULT_RESERVE_FRACTION
from nnscaler_jax.errors import NoFitError
from nnscaler_jax.plan.plan import OpPlan, PipelineSettings, Plan

KEYS = {"fits", "step_time_s", "memory_bytes_per_device", "comm_bytes", "search_s", "features"}
FEATURES = {"recompute", "cosharded", "microbatches", "stages", "fused_attention"}
V100_BUDGET = 32 * 2**30 - int(32 * 2**30 * DEFAULT_RESERVE_FRACTION)


def _run(capsys, *argv):
    code = main(["compare", *argv])
    out = capsys.readouterr().out
    return code, out, json.loads(out.strip().splitlines()[-1]) if "--json" in argv else None


def test_the_cluster_memory_is_the_default_budget(capsys):
    """GPT-3 1.3B on 2x4 V100-32GB: dp (~72 GiB) does not fit 28.8 GiB, Megatron and the
    search do; --budget 100GiB lets dp through."""
    code, _, res = _run(capsys, "--model", "gpt", "--preset", "gpt3-1.3b", "--mesh", "2x4",
                        "--cluster", "v100-32g-8x", "--planners", "dp,megatron,auto", "--json")
    assert code == 0 and res["budget_bytes"] == V100_BUDGET and "V100-32G" in res["budget"]
    p = res["planners"]
    for r in p.values():
        assert set(r) >= KEYS
    dp = p["dp"]
    assert dp["fits"] is False and dp["memory_bytes_per_device"] > V100_BUDGET
    assert dp["step_time_s"] is None and dp["features"] is None and "needs" in dp["error"]
    for name in ("megatron", "auto"):
        assert p[name]["fits"] is True and p[name]["memory_bytes_per_device"] <= V100_BUDGET
        assert set(p[name]["features"]) == FEATURES and p[name]["features"]["stages"] == 1
        assert p[name]["step_time_s"] > 0 and p[name]["search_s"] >= 0
    code, _, res = _run(capsys, "--model", "gpt", "--preset", "gpt3-1.3b", "--mesh", "2x4",
                        "--cluster", "v100-32g-8x", "--planners", "dp", "--budget", "100GiB",
                        "--json")
    assert code == 0 and res["budget_bytes"] == 100 * 2**30 and res["budget"] == "--budget"
    assert res["planners"]["dp"]["fits"] is True
    # the whole batch at once; the smallest estimate without the budget was dp with gradient
    # accumulation over the most micro-batches the batch allows, still over 28.8 GiB
    assert res["planners"]["dp"]["memory_bytes_per_device"] > dp["memory_bytes_per_device"]
    assert res["planners"]["dp"]["features"]["microbatches"] == 1


def test_a_budget_nothing_fits_reports_the_smallest_estimate(capsys):
    """--budget 1KB on the tiny GPT: every planner reports fits false with its smallest estimate
    (the searches' from the exception), and the table says so; the command exits 0."""
    code, _, res = _run(capsys, "--model", "gpt", "--mesh", "2x4", "--planners", "dp,auto",
                        "--budget", "1KB", "--json")
    assert code == 0 and res["budget_bytes"] == 1000
    for r in res["planners"].values():
        assert set(r) >= KEYS and r["fits"] is False and r["memory_bytes_per_device"] > 1000
    search, dp = res["planners"]["auto"], res["planners"]["dp"]
    assert search["memory_bytes_per_device"] < dp["memory_bytes_per_device"]
    code, out, _ = _run(capsys, "--model", "gpt", "--mesh", "2x4", "--planners", "dp,megatron",
                        "--budget", "300KB")
    assert code == 0
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.split()}
    assert "fits" in lines["planner"] and "features" in lines["planner"]
    assert lines["dp"].split()[1] == "NO" and lines["megatron"].split()[1] == "yes"
    assert "memory budget per device 292.97 KiB (--budget)" in out


def test_no_cluster_no_budget_on_cpu(capsys):
    code, _, res = _run(capsys, "--model", "mlp", "--mesh", "2x4", "--planners", "megatron",
                        "--json")
    assert code == 0 and res["budget_bytes"] is None
    assert res["planners"]["megatron"]["fits"] is True


@pytest.mark.parametrize("argv, needle", [
    (["--budget", "12XB"], "bad --budget '12XB'"),
    (["--budget", "-1"], "bad --budget"),
    (["--cluster", "dgx"], "v100-32g-8x"),   # the presets are listed
])
def test_bad_budget_or_cluster_is_a_usage_error(capsys, argv, needle):
    assert main(["compare", "--model", "mlp", "--mesh", "2x4", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_features_of_a_plan():
    """Co-sharded ops as [module path, primitive, dim, chunks] (none for a pipelined plan: its
    runtime does not run the SPMD part's co-sharding), the pipeline's micro-batches and stages,
    the recompute groups when the plan has them."""
    ops = (OpPlan(0, "dot_general", "blk0/attn/qk", (("model", "h"),), chunks=("h", 6)),
           OpPlan(1, "dot_general", "blk0/mlp/fc1", (("model", "n"),)))
    plan = Plan(mesh=(("stage", 2), ("model", 4)), fingerprint="x", ops=ops,
                pipeline=PipelineSettings(stages=2, microbatches=8, schedule="1f1b"))
    f = plan_features(plan)
    assert f["cosharded"] == []
    assert plan_features(Plan(mesh=(("model", 4),), fingerprint="x", ops=ops))["cosharded"] == [
        ["blk0/attn/qk", "dot_general", "h", 6]]
    assert f["microbatches"] == 8 and f["stages"] == 2
    assert f["recompute"] == list(getattr(plan, "recompute", ()) or ())
    flat = Plan(mesh=(("model", 4),), fingerprint="x", ops=ops[1:])
    assert plan_features(flat) == {"recompute": [], "cosharded": [], "microbatches": 1,
                                   "stages": 1, "fused_attention": []}
    json.dumps(f)
    if "recompute" in {x.name for x in dataclasses.fields(Plan)}:  # the search's groups
        again = dataclasses.replace(flat, recompute=("h_0", "h_1/*"))
        assert plan_features(again)["recompute"] == ["h_0", "h_1/*"]


def test_smallest_estimate_from_the_exception_or_the_message():
    assert smallest_estimate(NoFitError("x", smallest_bytes=123.0)) == 123
    assert smallest_estimate(ValueError("... the smallest estimate is ~2.5 GiB.")) == \
        int(2.5 * 2**30)
    assert smallest_estimate(ValueError("policy 'dp': the plan needs an estimated 1.50 MiB per "
                                        "device")) == int(1.5 * 2**20)
    assert smallest_estimate(ValueError("unrelated")) is None


@pytest.fixture(scope="module")
def gpt16():
    return capture_spec(models.get("gpt", "tiny", batch_size=16)).graph


def test_pipelines_let_the_search_use_stages_when_they_are_faster_within_the_budget(gpt16):
    """--pipelines: the flat 2x4 mesh and every stage x data (x model) shape of its 8 devices
    under one budget; at 380 kB per device the flat search fits only by recomputing / micro-
    batching, and 2 stages x 4 data-parallel ways is the fastest fitting shape. Shapes the
    runtime cannot run (8 stages of a 2-layer GPT) are candidates with an error, not a crash."""
    plan, e = best_over_meshes("auto", gpt16, {"data": 2, "model": 4}, None, 380_000)
    by_mesh = {tuple(c["mesh"].items()): c for c in e["candidates"]}
    assert set(by_mesh) == {(("data", 2), ("model", 4)), (("stage", 2), ("model", 4)),
                            (("stage", 2), ("data", 4)), (("stage", 4), ("data", 2)),
                            (("stage", 8),)}
    fitting = [c for c in e["candidates"] if c["fits"]]
    fastest = min(fitting, key=lambda c: c["step_time_s"])
    assert e["fits"] is True and e["mesh"] == fastest["mesh"] == {"stage": 2, "data": 4}
    flat = by_mesh[(("data", 2), ("model", 4))]
    assert flat["fits"] is True and flat["step_time_s"] > e["step_time_s"]
    assert e["memory_bytes_per_device"] <= 380_000 and e["features"]["stages"] == 2
    assert plan.pipeline is not None and plan.stages == 2 and dict(plan.mesh) == e["mesh"]
    # a pipelined candidate names the stage DP's schedule and micro-batches, the flat one none
    chosen = by_mesh[(("stage", 2), ("data", 4))]
    assert (chosen["schedule"], chosen["microbatches"]) == (plan.pipeline.schedule,
                                                            plan.pipeline.microbatches)
    assert "schedule" not in flat
    assert "cut points" in by_mesh[(("stage", 8),)]["error"]
    # nothing fits: the smallest estimate over every shape (the flat search's, here)
    _, none = best_over_meshes("auto", gpt16, {"data": 2, "model": 4}, None, 1000)
    assert none["fits"] is False and none["memory_bytes_per_device"] == min(
        c["memory_bytes_per_device"] for c in none["candidates"] if c["fits"] is False)


def test_pipelines_flag_in_the_json_and_the_table(capsys):
    """Planners other than the searches plan the flat mesh only; the entry says which mesh."""
    code, _, res = _run(capsys, "--model", "mlp", "--mesh", "2x4", "--planners", "dp",
                        "--pipelines", "--json")
    assert code == 0
    dp = res["planners"]["dp"]
    assert dp["mesh"] == {"data": 2, "model": 4} and len(dp["candidates"]) == 1
    assert set(dp) >= KEYS


@pytest.mark.slow
def test_the_pipelined_plan_it_chooses_trains_like_one_device(gpt16):
    """The chosen shape is a plan a user runs: saved, passed as ``plan=`` on a mesh of that
    shape, its pipelined train_step (no Constraints needed) equals one SGD step on one device
    (float32, rtol 1e-4). A saved pipelined plan was refused by train_step before."""
    plan, e = best_over_meshes("auto", gpt16, {"data": 2, "model": 4}, None, 380_000)
    mesh = make_mesh(tuple(e["mesh"].values()), tuple(e["mesh"]))
    spec = models.get("gpt", "tiny", batch_size=16)
    (tokens,) = spec.make_args(rng=jax.random.key(1))
    params = spec.module.init(jax.random.key(0), tokens)["params"]
    pm = auto_parallel(mesh, plan=Plan.from_json(plan.to_json()))(spec.module)
    step = pm.train_step(spec.loss_fn, optax.sgd(0.1))
    state, metrics = step(step.init({"params": params}, tokens), tokens)
    assert step.plan.pipeline == plan.pipeline and step.plan.stages == 2

    def loss(p):
        return spec.loss_fn(spec.module.apply({"params": p}, tokens), tokens)

    value, grads = jax.value_and_grad(loss)(params)
    np.testing.assert_allclose(metrics["loss"], value, rtol=1e-4)
    want = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    for (path, got), ref in zip(jax.tree_util.tree_flatten_with_path(step.params(state))[0],
                                jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))


def test_attention_fused_from_the_command_line(capsys, tmp_path):
    """``--attention fused``: compare's plans fuse every block (Llama-3-8B at 128K on H100s: the
    step far below the unfused plan's), ``plan --out`` saves it, ``train --plan`` refuses the
    flag again (the saved plan runs as made)."""
    args = ("--model", "llama", "--preset", "llama3-8b-128k", "--mesh", "2x4", "--cluster",
            "h100-80g-8x", "--planners", "auto", "--precision", "bfloat16", "--json")
    _, _, fused = _run(capsys, *args, "--attention", "fused")
    _, _, plain = _run(capsys, *args)
    f, p = fused["planners"]["auto"], plain["planners"]["auto"]
    assert f["fits"] and len(f["features"]["fused_attention"]) == 32
    assert not p["features"]["fused_attention"]
    assert f["step_time_s"] < p["step_time_s"] / 3
    # batch 1: each block's work splits over all 8 devices only by heads or by the sequence
    hows = {how for _, how in f["features"]["fused_attention"]}
    assert all("data" in how and "model" in how for how in hows), hows
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "gpt", "--preset", "tiny", "--mesh", "2x4", "--attention",
                 "fused", "--out", str(out), "--json"]) == 0
    assert json.loads(out.read_text())["fused_attention"]
    capsys.readouterr()
    assert main(["train", "--model", "gpt", "--preset", "tiny", "--mesh", "2x4", "--steps", "1",
                 "--plan", str(out), "--attention", "fused"]) == 2
    assert "--attention fused" in capsys.readouterr().err
