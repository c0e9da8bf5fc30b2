"""`planner.py`: ``make_plan`` / ``plan_and_report`` on abstract meshes: the mesh forms agree,
saved plans are checked and reused (at other sizes too, re-priced), the policy default under
pipeline stages, ZeRO recorded."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from meshes import make_mesh

import models
from nnscaler_jax import Constraints, trace
from nnscaler_jax.capture.trace import capture_spec
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.errors import NoFitError, PlanError, PlanFormatError
from nnscaler_jax.mesh.topology import LinkCost
from nnscaler_jax.planner import make_plan, plan_and_report

AXES = {"data": 2, "model": 4}


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16, name="fc2")(nn.relu(nn.Dense(32, name="fc1")(x)))


@pytest.fixture(scope="module")
def graph():
    return trace(Net(), jax.ShapeDtypeStruct((8, 16), jnp.float32))


def test_a_dict_an_abstract_mesh_and_a_mesh_give_one_plan(graph):
    plans = [make_plan(graph, m, policy="megatron") for m in (
        AXES, jax.sharding.AbstractMesh((2, 4), ("data", "model")),
        make_mesh((2, 4), ("data", "model")))]
    assert plans[0] == plans[1] == plans[2]
    assert plans[0].mesh == (("data", 2), ("model", 4)) and plans[0].policy == "megatron"


def test_the_plan_comes_priced_by_the_given_cost_model(graph):
    plan = make_plan(graph, AXES, policy="dp")
    assert plan.cost == CostModel.for_axes(AXES).plan_cost(plan, graph)
    slow = CostModel.for_axes(AXES, links=LinkCost(1e-3, 1e-6))
    priced = make_plan(graph, AXES, policy="dp", cost_model=slow)
    assert priced.cost.comm_time_s > plan.cost.comm_time_s  # same plan, slower links
    assert priced.ops == plan.ops


def test_a_saved_plan_is_checked_and_reused_at_other_sizes(graph):
    saved = make_plan(graph, AXES, policy="dp")
    again = make_plan(graph, AXES, plan=saved, policy="megatron")
    assert again == saved and again.policy == "dp" and again.cost == saved.cost
    with pytest.raises(PlanFormatError, match="mesh"):
        make_plan(graph, {"data": 8}, plan=saved)
    # another batch size the data axis divides: the same splits, priced at the new sizes
    half = trace(Net(), jax.ShapeDtypeStruct((4, 16), jnp.float32))
    reused = make_plan(half, AXES, plan=saved)
    assert reused == saved and reused.ops == saved.ops
    assert reused.cost == CostModel.for_axes(AXES).plan_cost(saved, half) != saved.cost
    # one it does not divide: named, with the op, the size and the axis
    odd = trace(Net(), jax.ShapeDtypeStruct((3, 16), jnp.float32))
    with pytest.raises(PlanFormatError, match=r"'data' \(2\), but its size here is 3") as info:
        make_plan(odd, AXES, plan=saved)
    assert info.value.axis == "data" and info.value.module_path in ("fc1", "fc2", "")
    other = trace(nn.Dense(16), jax.ShapeDtypeStruct((8, 16), jnp.float32))
    with pytest.raises(PlanFormatError, match="another model.*ops"):
        make_plan(other, AXES, plan=saved)


def test_plan_and_report_times_planning_and_a_policy_function_names_the_plan(graph):
    def mine(draft, mesh):
        return draft.finish()

    planned = plan_and_report(graph, AXES, policy=mine)
    assert planned.plan.policy == "mine" and planned.seconds >= 0
    assert all(p.split == () for p in planned.plan.ops)
    assert planned.report is None  # no search ran


def test_zero_is_recorded_on_any_policy(graph):
    plan = make_plan(graph, AXES, policy="megatron", constraints=Constraints(zero=3))
    assert plan.zero == 3
    kernel = plan.variable_spec("params/fc1/kernel")
    assert "model" in kernel and any(e == "data" or (isinstance(e, tuple) and "data" in e)
                                     for e in kernel)
    assert make_plan(graph, AXES, policy="dp", constraints=Constraints(zero=1)).zero == 1


def test_pipeline_stages_without_a_policy_are_data_parallel_inside():
    spec = models.get("gpt", "tiny", batch_size=8)
    g = capture_spec(spec).graph
    plan = make_plan(g, {"stage": 2, "data": 2}, policy=None,
                     constraints=Constraints(pipeline_stages=2, microbatches=2))
    assert plan.policy == "dp" and plan.stages == 2
    assert plan.pipeline.microbatches == 2
    # reused at batch 16: the same stages and schedule, priced as the runtime runs them there
    g16 = capture_spec(models.get("gpt", "tiny", batch_size=16)).graph
    again = make_plan(g16, {"stage": 2, "data": 2}, plan=plan)
    assert again == plan and again.pipeline == plan.pipeline
    assert again.cost.compute_time_s > plan.cost.compute_time_s


@pytest.mark.parametrize("policy", ["dp", "megatron", "zero3"])
def test_a_built_in_policy_over_the_memory_budget_is_refused(policy):
    """The built-ins accepted max_memory_per_device=1 without a word."""
    from nnscaler_jax.planner import make_plan as plan_of

    spec = models.get("mlp", "tiny")
    graph = capture_spec(spec).graph
    fits = plan_of(graph, {"data": 2, "model": 4}, policy=policy)
    need = fits.cost.memory_bytes_per_device
    assert plan_of(graph, {"data": 2, "model": 4}, policy=policy,
                   constraints=Constraints(max_memory_per_device=need)) == fits
    with pytest.raises(PlanError, match="over Constraints\\(max_memory_per_device=1\\)"):
        plan_of(graph, {"data": 2, "model": 4}, policy=policy,
                constraints=Constraints(max_memory_per_device=1))


def test_a_pipelined_plan_is_held_to_the_budget_per_stage_not_as_a_whole():
    """Under a budget, the whole-model plan of a pipelined mesh is searched without it: the
    pipeline prices its own memory per stage (and recomputes every stage), so the search does
    not add recompute groups for a whole model that no device holds (it did: ('h_0', 'h_1')
    at these budgets, in 11-17 s of planning), and the budget still binds the pipeline."""
    graph = capture_spec(models.get("gpt", "tiny", batch_size=16)).graph
    mesh = {"stage": 2, "data": 4}
    plan = make_plan(graph, mesh, policy="auto", constraints=Constraints(
        pipeline_stages="auto", max_memory_per_device=350_000))
    assert plan.pipeline is not None and plan.cost.memory_bytes_per_device <= 350_000
    assert plan.recompute == () and plan.coshard == ()
    with pytest.raises(NoFitError) as e:  # the stage DP's own budget check
        make_plan(graph, mesh, policy="auto", constraints=Constraints(
            pipeline_stages="auto", max_memory_per_device=200_000))
    assert e.value.smallest_bytes > 200_000 and "no schedule x micro-batch count" in str(e.value)


@pytest.mark.parametrize("name", ["swin", "evoformer"])
def test_numbered_layers_the_stack_runtime_cannot_run_are_priced_as_a_cut(name):
    """Swin's stages (different widths) and Evoformer's blocks (two tracks in) are numbered
    like a layer stack, but the identical-layer runtime refuses them and the step cuts them at
    module boundaries: planning prices the cut program, with a tensor-parallel policy as
    tensor-parallel stages (one program per stage, pipeline/mpmd.py; it used to price them as
    a Megatron stack, a plan the step then refused), else data-parallel inside."""
    graph = capture_spec(models.get(name, "tiny", batch_size=8)).graph
    mesh = {"stage": 2, "data": 2, "model": 2}
    tp = make_plan(graph, mesh, policy="megatron",
                   constraints=Constraints(pipeline_stages="auto"))
    assert "cut at module boundaries over 2 stages x 2 data-parallel x 2 tensor-parallel " \
        "(model)" in tp.pipeline.report
    plan = make_plan(graph, mesh, policy="dp", constraints=Constraints(pipeline_stages="auto"))
    assert "cut at module boundaries over 2 stages x 4 data-parallel," in plan.pipeline.report
