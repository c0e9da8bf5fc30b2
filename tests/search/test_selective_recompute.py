"""Selective recompute (a group ``'h_0:dots'``, ``Rule(recompute="selective")``): a remat
boundary whose ``jax.checkpoint`` policy keeps the matmul outputs but the attention scores.
Priced by what the policy saves (the user's ``nn.remat(policy=...)`` too), chosen by ours when
the budget needs less than full recompute, never by the Alpa-style planner (one global remat
switch), and run under that policy with the single-device numbers."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from meshes import make_mesh
from one_device import assert_like_one_device

import models
from nnscaler_jax import Constraints, Plan, auto_parallel
from nnscaler_jax.capture.trace import capture_spec, trace
from nnscaler_jax.constraints import Rule
from nnscaler_jax.cost import CostModel
from nnscaler_jax.cost.fusion import fused_bytes
from nnscaler_jax.errors import ConstraintError, NoFitError, PlanError
from nnscaler_jax.ir.remat import is_selective, no_growing_dots_saveable, with_recompute
from nnscaler_jax.planner import make_plan

B, D, H = 8, 16, 32
AXES = {"data": 2, "model": 4}


class TanhDense(nn.Dense):
    def __call__(self, x):
        return jnp.tanh(super().__call__(x))


class Chain(nn.Module):
    """tanh(x W0) then tanh(. W1), each layer under the selective policy with ``remat``."""
    remat: bool = False

    @nn.compact
    def __call__(self, x):
        cls = nn.remat(TanhDense, policy=no_growing_dots_saveable) if self.remat else TanhDense
        return cls(D, use_bias=False, name="l_1")(cls(H, use_bias=False, name="l_0")(x))


def _gpt(**kw):
    cfg = {"seq_len": 32, "n_positions": 32, "d_model": 64, "n_layers": 3, "vocab_size": 128,
           "batch_size": 8} | kw
    return models.get("gpt", "tiny", **cfg)


def test_closed_form_memory_and_time():
    """Two tanh(x W) layers, data-parallel over 2. Selectively recomputed, each layer keeps
    its matmul's output (tanh rebuilds from it: B/2 x H, then B/2 x D floats) besides its
    input, and runs only tanh again; fully recomputed, it keeps its input alone and reruns
    both ops. The user's ``nn.remat(policy=no_growing_dots_saveable)`` is priced the same as
    the plan's selective groups on the plain module."""
    x = jax.ShapeDtypeStruct((B, D), jnp.float32)
    g = trace(Chain(), x)
    cm = CostModel.for_axes({"data": 2})
    plan = make_plan(g, {"data": 2}, policy="dp")
    sel = dataclasses.replace(plan, recompute=("l_*:dots",))
    full = dataclasses.replace(plan, recompute=("l_*",))
    kept, mid, low = (cm.memory_breakdown(p, g) for p in (plan, sel, full))
    f = 4 * (B // 2)  # bytes per feature of one device's rows
    assert kept["activations"] == f * (H + D)  # the tanh outputs
    assert low["activations"] == f * (D + H)  # x and l_0's output (the layers' inputs)
    assert mid["activations"] == f * (D + H) + f * (H + D)  # + both matmul outputs
    assert mid["transient"] <= low["transient"]
    traffic = fused_bytes(g)

    def forward(prims):
        return sum(cm.forward_time(op, plan.op_plan(op.id).split, traffic)
                   for op in g.ops if op.module_path and op.primitive in prims)

    base = cm.plan_cost(plan, g).compute_time_s
    assert cm.plan_cost(sel, g).compute_time_s == pytest.approx(base + forward({"tanh"}),
                                                                rel=1e-9)
    assert cm.plan_cost(full, g).compute_time_s == pytest.approx(
        base + forward({"tanh", "dot_general"}), rel=1e-9)
    # the user's own policy, captured from nn.remat, is priced as the plan's selective groups
    user = trace(Chain(remat=True), x)
    mine = make_plan(user, {"data": 2}, policy="dp")
    assert cm.memory_breakdown(mine, user) == mid
    assert cm.plan_cost(mine, user).compute_time_s == pytest.approx(
        cm.plan_cost(sel, g).compute_time_s, rel=1e-9)
    boundaries = with_recompute(g, sel.recompute).boundaries
    assert [b.eqn.params["policy"] for b in boundaries] == [no_growing_dots_saveable] * 2


@pytest.mark.parametrize("planner", ["auto", "alpa"])
def test_search_tables_price_selective_groups_as_the_plan(planner):
    """The ILP's memory and objective of a graph with selective groups are the plan's full
    pricing (kept matmul outputs, the rest of the block rebuilt in its backward)."""
    from nnscaler_jax.search.ilp import search

    for name, groups in (("gpt", ("h_0:dots", "h_1:dots")),
                         ("swin", ("layers_0/blocks_0:dots", "layers_1/blocks_1:dots"))):
        graph = with_recompute(capture_spec(models.get(name, "tiny")).graph, groups)
        cm = CostModel.for_axes(AXES)
        plan, report = search(graph, AXES, cost_model=cm, planner=planner)
        cost = cm.plan_cost(plan, graph)
        assert report.memory_bytes == cost.memory_bytes_per_device
        assert report.objective_s == pytest.approx(cost.step_time_s, rel=1e-6)


def _smallest(graph, recompute) -> float:
    with pytest.raises(NoFitError) as e:
        make_plan(graph, AXES, constraints=Constraints(
            max_memory_per_device=1, rules=(Rule(module="*", recompute=recompute),)))
    return e.value.smallest_bytes


def test_the_search_recomputes_selectively_when_that_is_enough():
    """GPT with 128 tokens (the scores dominate its activations). At 90% of the free plan's
    memory ours meets the budget with layouts alone; at 73% it recomputes layers selectively
    and none fully (cheaper than full recompute); at 25% in one micro-batch some fully. The
    Alpa-style planner recomputes every layer fully whenever it recomputes, so it is slower at
    73%. (At 25% with micro-batches allowed, two of them and co-sharding beat full recompute
    since a recomputed layer's relayouts are priced as running again: 6.69 ms against
    7.49 ms.)"""
    graph = capture_spec(_gpt(seq_len=128, n_positions=128, n_heads=4)).graph
    free = make_plan(graph, AXES).cost
    every = make_plan(graph, AXES, constraints=Constraints(
        rules=(Rule(module="h_*", recompute="selective"),)))
    assert every.recompute == ("h_*:dots",)
    assert every.cost.memory_bytes_per_device < free.memory_bytes_per_device

    def budgeted(share, policy="auto", microbatches=None):
        return make_plan(graph, AXES, policy=policy, constraints=Constraints(
            max_memory_per_device=int(share * free.memory_bytes_per_device),
            microbatches=microbatches))

    assert budgeted(0.9).recompute == ()
    mild, alpa = budgeted(0.73), budgeted(0.73, "alpa")
    assert mild.recompute and all(is_selective(g) for g in mild.recompute), mild.recompute
    assert alpa.recompute == ("h_0", "h_1", "h_2")
    assert free.step_time_s < mild.cost.step_time_s < alpa.cost.step_time_s
    tight = budgeted(0.25, microbatches=1)
    assert any(not is_selective(g) for g in tight.recompute), tight.recompute
    assert tight.microbatches == 1
    assert "selective" in str(mild)
    assert Plan.from_json(mild.to_json()).recompute == mild.recompute


def test_selective_rules_are_checked():
    with pytest.raises(ConstraintError, match="'selective'"):
        Rule(module="h_*", recompute="some")
    graph = capture_spec(_gpt(n_layers=2)).graph
    with pytest.raises(PlanError, match="selective recompute .* SPMD plans only"):
        make_plan(graph, {"stage": 2, "data": 4}, constraints=Constraints(
            pipeline_stages=2, rules=(Rule(module="h_*", recompute="selective"),)))


@pytest.mark.slow
def test_a_selective_plan_runs_and_matches_one_device():
    """Through auto_parallel with a budget selective recompute meets best: the program runs
    the layers under jax.checkpoint with the selective policy; forward and gradients equal the
    plain module's."""
    spec = _gpt(seq_len=128, n_positions=128, n_heads=4)
    (tokens,) = spec.make_args()
    free = make_plan(capture_spec(spec).graph, AXES).cost.memory_bytes_per_device
    mesh = make_mesh((2, 4), ("data", "model"))
    pm = auto_parallel(mesh, Constraints(max_memory_per_device=int(0.73 * free)))(spec.module)
    v = pm.init(jax.random.key(0), tokens)
    assert pm.plan.recompute and all(is_selective(g) for g in pm.plan.recompute)
    jaxpr = str(jax.make_jaxpr(pm.apply)(v, tokens))
    assert "no_growing_dots_saveable" in jaxpr
    assert_like_one_device(pm, spec.module, v, (tokens,))


def test_recompute_reruns_only_what_the_backward_needs():
    """A fully recomputed GPT layer reruns neither its MLP's output projection nor the bias and
    residual adds after it: their outputs only reach the next layer (which reads the layer's
    output, kept as its input), so XLA drops that rerun as dead code. Selectively, the
    projection's output is not kept either."""
    from nnscaler_jax.cost.residuals import residual_readers
    from nnscaler_jax.ir.remat import remat_roles

    graph = capture_spec(_gpt()).graph
    for groups in (("h_0",), ("h_0:dots",)):
        g = with_recompute(graph, groups)
        roles = remat_roles(g, residual_readers(g))
        by_id = {op.id: op for op in g.ops}
        dropped = sorted((by_id[o].module_path, by_id[o].primitive) for o in roles.dropped)
        proj = ("h_0/mlp/c_proj", "dot_general")
        if groups == ("h_0",):
            assert proj in dropped
        else:
            assert not any(ks for o, ks in roles.kept.items()
                           if (by_id[o].module_path, by_id[o].primitive) == proj)
        assert {p for p, _ in dropped} <= {"h_0/mlp/c_proj", "h_0"}, dropped
        assert ("h_0", "add") in dropped  # the residual add
