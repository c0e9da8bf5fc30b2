"""Each tensor-parallel cut stage planned by the search, as flat plans are (issue: one pipeline
runtime): under a budget Megatron-style stage pricing cannot meet, the planner plans each
stage's part (the ops of its chunks) with the search, co-sharding and recompute included, and
the runtime runs those plans through the one Lowering.

Swin tiny on 2 stages x model 4, 1F1B, 4 micro-batches: at 150,000 bytes a device (the stage
pricing's smallest is ~241 KB, every layer recomputed) both stages' MLP blocks (``fc1`` and
what follows it along the tokens) are co-sharded in 2 chunks, priced slower than the plan
without a budget; the chunk programs run them as chunk loops, and one SGD step equals one
device's (float32, rtol 1e-4).
"""

import jax
import numpy as np
import optax
import pytest
from meshes import make_mesh

import models
from nnscaler_jax import Constraints, Plan, PlanError, auto_parallel
from nnscaler_jax.cli.compare import plan_features

RTOL, ATOL = 1e-4, 1e-6
BUDGET = 150_000


def _swin(budget):
    spec = models.get("swin", "tiny", batch_size=8)
    cons = Constraints(pipeline_stages=2, microbatches=4, schedule="1f1b",
                       max_memory_per_device=budget)
    pm = auto_parallel(make_mesh((2, 4), ("stage", "model")), cons, policy="auto")(spec.module)
    return spec, pm


@pytest.mark.slow
def test_cosharded_stages_train_like_one_device():
    spec, pm = _swin(BUDGET)
    params = spec.init(jax.random.PRNGKey(0))["params"]
    args = spec.make_args()
    opt = optax.sgd(1e-2)
    step = pm.train_step(spec.loss_fn, opt)
    state = step.init({"params": params}, *args)
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

    state, metrics = step(state, *args)
    loss, grads = jax.jit(jax.value_and_grad(
        lambda p: spec.loss_fn(spec.module.apply({"params": p}, *args), *args)))(params)
    want = optax.apply_updates(params, opt.update(grads, opt.init(params), params)[0])
    np.testing.assert_allclose(metrics["loss"], loss, rtol=RTOL)
    got = step.params(state)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                            jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=RTOL, atol=ATOL,
                                   err_msg=jax.tree_util.keystr(path))


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
