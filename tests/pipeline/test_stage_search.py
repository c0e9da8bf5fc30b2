"""Each tensor-parallel cut stage planned by the search, as flat plans are (issue: one pipeline
runtime): under a budget Megatron-style stage pricing cannot meet, the planner plans each
stage's part (the ops of its chunks) with the search, co-sharding and recompute included, and
the runtime runs those plans through the one Lowering.

Swin tiny on 2 stages x model 4, 1F1B, 4 micro-batches: at 150,000 bytes a device (the stage
pricing's smallest is ~241 KB, every layer recomputed) both stages' MLP blocks (``fc1`` and
what follows it along the tokens) are co-sharded in 2 chunks, priced slower than the plan
without a budget; the chunk programs run them as chunk loops, and one SGD step equals one
device's (float32, rtol 1e-4). With 8 x 8 windows (the attention scores then outgrow the
blocks' inputs; at 4 x 4 they do not, and co-sharding them would save nothing) and the cut at
``layers_1``, 200,000 bytes make the first stage co-shard its two blocks whole along the
micro-batch rows: window attention and MLP, nnScaler's Swin plan; it runs one program per
stage, or (asked) in one program, each device chunking its own blocks (``Lowering(manual=
True)``).
"""

import jax
import numpy as np
import optax
import pytest
from meshes import make_mesh
from one_device import updated

import models
from nnscaler_jax import Constraints, Plan, PlanError, auto_parallel
from nnscaler_jax.cli.compare import plan_features
from nnscaler_jax.ir.coshard import block_of

RTOL, ATOL = 1e-4, 1e-6
BUDGET = 150_000


def _swin(budget, pivots=(), batch=8, mesh=((2, 4), ("stage", "model")), executor=None,
          **config):
    spec = models.get("swin", "tiny", batch_size=batch, **config)
    cons = Constraints(pipeline_stages=2, microbatches=4, schedule="1f1b",
                       max_memory_per_device=budget, pipeline_pivots=pivots,
                       pipeline_executor=executor)
    pm = auto_parallel(make_mesh(*mesh), cons, policy="auto")(spec.module)
    return spec, pm


def _step(spec, pm):
    """The batch, optimizer, pipelined step and its initial state."""
    args, opt = spec.make_args(), optax.sgd(1e-2)
    step = pm.train_step(spec.loss_fn, opt)
    return args, opt, step, step.init(spec.init(jax.random.PRNGKey(0)), *args)


def _trains_like_one_device(spec, step, state, args, opt):
    params = spec.init(jax.random.PRNGKey(0))["params"]
    state, metrics = step(state, *args)
    loss, grads = jax.jit(jax.value_and_grad(
        lambda p: spec.loss_fn(spec.module.apply({"params": p}, *args), *args)))(params)
    want = updated(opt, params, grads)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=RTOL)
    got = step.params(state)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                            jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=RTOL, atol=ATOL,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_cosharded_stages_train_like_one_device():
    spec, pm = _swin(BUDGET)
    args, opt, step, state = _step(spec, pm)
    plan = pm.plan
    stage_plans = plan.pipeline.stage_plans
    assert len(stage_plans) == 2 and all(sp.coshard for sp in stage_plans)
    assert plan.cost.memory_bytes_per_device <= BUDGET
    free = _swin(None)[1].make_plan(*args)  # (what the chunks run again is priced)
    assert plan.cost.step_time_s > free.cost.step_time_s
    # what the runtime runs is what the planner priced: the same blocks, in the same chunks
    assert [sorted((d, k) for _, d, k in sp.coshard) for sp in step.stage_plans] == \
        [sorted((d, k) for _, d, k in sp.coshard) for sp in stage_plans]
    cosharded = plan_features(plan)["cosharded"]
    assert {row[0].split("/")[0] for row in cosharded} == {"layers_0", "layers_1"}
    assert all(row[3] == 2 for row in cosharded)
    assert "co-shards layers_0/blocks_0" in str(plan)
    # the stage's forward runs its co-sharded blocks as chunk loops (Swin has no loop itself)
    forward = {name: low.as_text() for _, name, low in step.program.block_programs(opt)
               if name.startswith("F")}
    assert all("stablehlo.while" in text for text in forward.values())
    # the plan's JSON keeps the stage plans (the runtime of a saved plan runs them too)
    again = Plan.from_json(plan.to_json()).pipeline.stage_plans
    assert [sp.coshard for sp in again] == [sp.coshard for sp in stage_plans]

    _trains_like_one_device(spec, step, state, args, opt)


@pytest.mark.slow
@pytest.mark.parametrize("executor", [None, "in-graph"])
def test_window_attention_and_mlp_cosharded_in_the_first_stage(executor):
    """nnScaler's Swin plan (its first blocks co-sharded on tensor-parallel stages), one
    program per stage or (asked) one program, each device chunking its own blocks."""
    spec, pm = _swin(200_000, pivots=("layers_1",), window_size=8, executor=executor)
    args, opt, step, state = _step(spec, pm)
    assert type(step.program).__name__ == ("CutProgram" if executor else "MpmdProgram")
    plan = pm.plan
    assert plan.pipeline.stage_of == (("layers_1", 1),)
    assert plan.cost.memory_bytes_per_device <= 200_000
    first = plan.pipeline.stage_plans[0]
    assert sorted(d for _, d, _ in first.coshard) == ["b0", "b0"]
    # each block is a whole Swin block: its window attention and its MLP, in 2 chunks of rows
    ran = step.program.stage_plans[0]
    ops = {op.id: op for op in ran.graph.ops}
    assert len(ran.plan.coshard) == 2
    for seed, dim, _ in ran.plan.coshard:
        block = block_of(ran.graph, seed, dim)
        paths = {ops[i].module_path.split("/", 2)[-1] for i in block.ops}
        assert {"attn/q", "attn", "attn/proj", "fc1", "fc2"} <= paths, paths
    cosharded = plan_features(plan)["cosharded"]
    assert sorted(row[0] for row in cosharded) == ["layers_0/blocks_0/attn",
                                                   "layers_0/blocks_1/attn"]
    assert all(row[3] == 2 for row in cosharded)
    _trains_like_one_device(spec, step, state, args, opt)


@pytest.mark.slow
def test_stages_with_data_parallel_devices_chunk_one_shards_microbatch():
    """2 stages x data 2 x model 2, batch 16 in 4 micro-batches: a data shard's micro-batch
    has 2 rows. The second stage's part reads the first's activations (no example inputs),
    its batch dims found through them: its MLP blocks run in 2 chunks of those rows, not in
    the 8 the whole batch allowed."""
    spec, pm = _swin(260_000, batch=16, mesh=((2, 2, 2), ("stage", "data", "model")))
    args, opt, step, state = _step(spec, pm)
    plan = pm.plan
    assert plan.cost.memory_bytes_per_device <= 260_000
    cosharded = plan_features(plan)["cosharded"]
    assert cosharded and all(row[3] == 2 for row in cosharded), cosharded
    _trains_like_one_device(spec, step, state, args, opt)


def test_without_a_budget_the_stages_are_not_searched():
    """No budget: the stage pricing fits as it is, and the runtime plans its stages itself."""
    spec, pm = _swin(None)
    plan = pm.make_plan(*spec.make_args())
    assert plan.pipeline.stage_plans == ()
    assert plan_features(plan)["cosharded"] == []


def test_a_budget_nothing_meets_says_so():
    spec, pm = _swin(40_000)
    with pytest.raises(PlanError, match="smallest estimate"):
        pm.make_plan(*spec.make_args())
