"""SPMD gradient accumulation in planning (issue 15): Constraints(microbatches=m) prices one
micro-batch's activations; under a budget the planner takes the fewest micro-batches that fit."""
import math

import jax
import numpy as np
import optax
import pytest

import models
from nnscaler_jax import Constraints, Plan, auto_parallel
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.errors import NoFitError
from nnscaler_jax.plan.policies import batch_dims
from nnscaler_jax.planner import microbatch_candidates


@pytest.fixture(scope="module")
def gpt():
    module, make_args, _ = models.get("gpt", "tiny", batch_size=16)
    args = make_args(abstract=True)
    return module, args


def plan_of(mesh, module, args, policy="dp", **constraints):
    return auto_parallel(mesh, Constraints(**constraints), policy=policy)(module).make_plan(*args)


def test_microbatches_divide_activations_not_state(mesh, gpt):
    module, args = gpt
    one, four = plan_of(mesh, module, args), plan_of(mesh, module, args, microbatches=4)
    assert (one.microbatches, four.microbatches) == (1, 4)
    assert four.cost.memory_bytes_per_device < one.cost.memory_bytes_per_device
    # the same FLOPs; each micro-batch reduces the weights' gradients again (data parallel:
    # all of the plan's communication; measured with XLA:GPU under ZeRO-3, every gather and
    # reduction runs once per micro-batch)
    assert four.cost.compute_time_s == pytest.approx(one.cost.compute_time_s)
    pm = auto_parallel(mesh, policy="dp")(module)
    pm.make_plan(*args)
    grads = sum(v.nbytes for v in pm.graph.variables)  # each all-reduced over 'data'
    extra = four.cost.comm_bytes - one.cost.comm_bytes  # 3 more micro-batches' reductions
    assert 3 * grads <= extra <= 3 * one.cost.comm_bytes
    # the variables' state is the same; the rest shrinks 4 x

    cm = CostModel.for_axes(dict(one.mesh))
    b1, b4 = cm.memory_breakdown(one, pm.graph), cm.memory_breakdown(four, pm.graph)
    assert b4["params"] == b1["params"] and b4["optimizer"] == b1["optimizer"]
    assert b4["activations"] == pytest.approx(b1["activations"] / 4, rel=1e-6)


def test_budget_makes_the_planner_accumulate(mesh, gpt):
    module, args = gpt
    full = plan_of(mesh, module, args).cost.memory_bytes_per_device
    budget = int(full * 0.7)
    with pytest.raises(NoFitError):  # the whole batch at once does not fit ...
        plan_of(mesh, module, args, max_memory_per_device=budget, microbatches=1)
    plan = plan_of(mesh, module, args, max_memory_per_device=budget)
    assert plan.microbatches > 1 and plan.cost.memory_bytes_per_device <= budget
    # ... and it takes the fewest that fit
    fewer = [m for m in microbatch_candidates_for(mesh, module, args) if m < plan.microbatches]
    for m in fewer:
        assert plan_of(mesh, module, args, microbatches=m).cost.memory_bytes_per_device > budget
    assert Plan.from_json(plan.to_json()).microbatches == plan.microbatches


def microbatch_candidates_for(mesh, module, args):
    pm = auto_parallel(mesh, policy="dp")(module)
    pm.make_plan(*args)
    return microbatch_candidates(pm.graph, mesh)


def test_candidates_keep_the_data_axes_dividing(mesh, gpt):
    module, args = gpt
    # batch 16 over data=2: micro-batches of 8, 4, 2 sequences (m = 2, 4, 8)
    assert microbatch_candidates_for(mesh, module, args) == [2, 4, 8]


def test_nothing_fits_says_the_smallest(mesh, gpt):
    module, args = gpt
    with pytest.raises(NoFitError, match="no plan fits|needs an estimated"):
        plan_of(mesh, module, args, max_memory_per_device=1000)


def test_search_under_budget_may_split_instead(mesh, gpt):
    module, args = gpt
    full = plan_of(mesh, module, args).cost.memory_bytes_per_device
    plan = plan_of(mesh, module, args, policy="auto", max_memory_per_device=int(full * 0.7))
    assert plan.cost.memory_bytes_per_device <= int(full * 0.7)


def test_the_search_splits_the_batch_only_as_far_as_a_microbatch_goes(mesh):
    """GPT tiny, batch 16 in 4 micro-batches of 4 rows on 2 x 4 devices: the whole batch
    splits 8 ways, a micro-batch at most 4; the search offers only what divides a micro-batch
    (it split the batch 8 ways, and the step refused the plan), and the step runs it."""
    spec = models.get("gpt", "tiny", batch_size=16)
    pm = auto_parallel(mesh, Constraints(microbatches=4), policy="auto")(spec.module)
    args = spec.make_args()
    plan = pm.make_plan(*args)
    axes, by_id = dict(plan.mesh), {p.op: p for p in plan.ops}
    for op, dim, size in batch_dims(pm.graph):
        ways = math.prod(axes[a] for a, d in by_id[op.id].split if d == dim)
        assert (size // 4) % ways == 0, (op.module_path, op.primitive, dim, ways)
    step = pm.train_step(spec.loss_fn, optax.sgd(1e-2))
    state = step.init(spec.init(jax.random.PRNGKey(0)), *args)
    _, metrics = step(state, *args)
    assert np.isfinite(float(metrics["loss"]))
