"""Recompute as a plan decision: closed-form memory and time on a small graph, the searches
choosing it exactly when the budget needs it (ours: the fewest layers; Alpa-style: all or
nothing), rules forcing / forbidding it, and plans that run and match one device."""

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
from nnscaler_jax.errors import ConstraintError, NoFitError
from nnscaler_jax.ir.remat import with_recompute
from nnscaler_jax.planner import make_plan

B, D, H = 8, 16, 32
AXES = {"data": 2, "model": 4}


class Layer(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(self.width)(x))


class Chain(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Layer(D, name="l_1")(Layer(H, name="l_0")(x))


def _gpt(**kw):
    cfg = {"seq_len": 32, "n_positions": 32, "d_model": 64, "n_layers": 4,
           "vocab_size": 128, "batch_size": 8}
    cfg.update(kw)
    return models.get("gpt", "tiny", **cfg)


@pytest.fixture(scope="module")
def gpt_graph():
    return capture_spec(_gpt()).graph


def _smallest_without_recompute(graph) -> float:
    """The search's smallest estimate when no layer may be recomputed."""
    with pytest.raises(NoFitError) as e:
        make_plan(graph, AXES, constraints=Constraints(
            max_memory_per_device=1, rules=(Rule(module="*", recompute=False),)))
    return e.value.smallest_bytes


def test_closed_form_memory_and_time():
    """Two tanh layers, data-parallel over 2: kept activations are both tanh outputs
    (B/2 x H and B/2 x D floats); recomputed, each layer keeps only its input (x, then l_0's
    output), the largest layer's residuals are live again while its backward runs, with its
    output's cotangent (it arrives before the layer's backward starts), and every op of both
    layers runs its forward once more."""
    g = trace(Chain(), jax.ShapeDtypeStruct((B, D), jnp.float32))
    cm = CostModel.for_axes({"data": 2})
    plan = make_plan(g, {"data": 2}, policy="dp")
    redo = dataclasses.replace(plan, recompute=("l_*",))
    kept, again = cm.memory_breakdown(plan, g), cm.memory_breakdown(redo, g)
    assert kept["activations"] == 4 * (B // 2) * (H + D)
    assert again["activations"] == 4 * (B // 2) * (D + H)  # x (B/2 x D) and l_0's out
    assert again["transient"] == max(kept["transient"], 2 * 4 * (B // 2) * H)
    traffic = fused_bytes(g)  # the recomputed forward reads and writes as the first one
    forward = sum(cm.forward_time(op, plan.op_plan(op.id).split if plan.op_plan(op.id)
                                  else (), traffic) for op in g.ops if op.module_path)
    assert cm.plan_cost(redo, g).compute_time_s == pytest.approx(
        cm.plan_cost(plan, g).compute_time_s + forward, rel=1e-9)
    assert [b.kind for b in with_recompute(g, redo.recompute).boundaries] == ["checkpoint"] * 2


def test_recompute_runs_never_cut_the_users_remat(gpt_graph):
    remat = capture_spec(_gpt(remat=True)).graph
    user = {b.id for b in remat.boundaries}
    g = with_recompute(remat, ("h_*",))
    new = [b for b in g.boundaries if b.id not in user]
    assert len(new) == 4
    for op in g.ops:
        if op.boundary and op.boundary[-1] in user:  # the user's remat stays innermost
            assert op.boundary[0] in {b.id for b in new}


def test_the_search_recomputes_only_when_the_budget_needs_it():
    """Ours recomputes the fewest layers that fit, the Alpa-style planner all of them; neither
    does when the budget does not need it. (Three layers: the test takes 10 s; with four, the
    Alpa-style ILP, one variable per op, took 92 s to prove its optimum under the budget.)"""
    gpt_graph = capture_spec(_gpt(n_layers=3)).graph
    free = make_plan(gpt_graph, AXES)
    assert free.recompute == ()
    roomy = make_plan(gpt_graph, AXES, constraints=Constraints(
        max_memory_per_device=free.cost.memory_bytes_per_device))
    assert roomy.recompute == ()
    # just under the least memory without recompute: with 4 micro-batches recomputing every
    # layer saves only a few hundred bytes more, and a little lower (0.99) the Alpa-style
    # tables miss the operands a later reader gathers (ilp._meet_budget) and find nothing
    budget = int(_smallest_without_recompute(gpt_graph)) - 1
    ours = make_plan(gpt_graph, AXES, constraints=Constraints(max_memory_per_device=budget))
    alpa = make_plan(gpt_graph, AXES, policy="alpa",
                     constraints=Constraints(max_memory_per_device=budget))
    assert ours.recompute  # the fastest of the layer counts that fit
    assert alpa.recompute == ("h_0", "h_1", "h_2")  # Alpa's one global switch
    for p in (ours, alpa):
        assert p.cost.memory_bytes_per_device <= budget
        assert p.cost.step_time_s > free.cost.step_time_s
    assert "recompute (activations recomputed in the backward): h_0" in str(ours)
    assert Plan.from_json(ours.to_json()).recompute == ours.recompute


def test_rules_force_and_forbid_recompute(gpt_graph):
    forced = make_plan(gpt_graph, AXES, policy="dp", constraints=Constraints(
        rules=(Rule(module="h_1", recompute=True),)))
    assert forced.recompute == ("h_1",)
    tight = int(_smallest_without_recompute(gpt_graph) * 0.95)
    with pytest.raises(NoFitError, match="no plan fits"):
        make_plan(gpt_graph, AXES, constraints=Constraints(
            max_memory_per_device=tight, rules=(Rule(module="h_*", recompute=False),)))
    with pytest.raises(ConstraintError, match="module paths, not primitives"):
        make_plan(gpt_graph, AXES, constraints=Constraints(
            rules=(Rule(primitive="dot_general", recompute=True),)))


def test_a_recompute_rule_never_makes_the_estimate_worse(gpt_graph):
    """A user adds recompute to save memory: under ``policy="auto"`` a rule that pays is kept
    (GPT's layers), one that does not (a single Dense whose output the next op keeps) is
    dropped with a warning saying so, the plan no larger than without it."""
    layers = Constraints(rules=(Rule(module="h_*", recompute=True),))
    free, ruled = make_plan(gpt_graph, AXES), make_plan(gpt_graph, AXES, constraints=layers)
    assert ruled.recompute == ("h_*",)
    assert ruled.cost.memory_bytes_per_device < free.cost.memory_bytes_per_device
    mlp = capture_spec(models.get("mlp", "tiny")).graph
    free = make_plan(mlp, AXES)
    with pytest.warns(UserWarning, match=r"recompute rules for fc\* did not pay.*planned "
                      "without them"):
        ruled = make_plan(mlp, AXES, constraints=Constraints(
            rules=(Rule(module="fc*", recompute=True),)))
    assert ruled.recompute == ()
    assert ruled.cost.memory_bytes_per_device <= free.cost.memory_bytes_per_device


@pytest.mark.parametrize("policy", ["auto", "alpa"])
def test_nothing_fits_even_recomputing_everything(gpt_graph, policy, monkeypatch):
    """Both searches say so from the tables' lower bound, before HiGHS (which may not prove
    it within its time limit at scale: the Alpa-style T5-8 without recompute ran 265 s)."""
    from nnscaler_jax.search import ilp

    monkeypatch.setattr(ilp, "milp", lambda *a, **k: pytest.fail("HiGHS ran"))
    with pytest.raises(NoFitError, match="Recomputing every layer") as e:
        make_plan(gpt_graph, AXES, policy=policy,
                  constraints=Constraints(max_memory_per_device=10_000))
    assert e.value.smallest_bytes > 10_000 and e.value.budget_bytes == 10_000


@pytest.mark.slow
@pytest.mark.parametrize("remat", [False, True])
def test_a_recomputing_plan_runs_and_matches_one_device(remat):
    """Through auto_parallel, recompute chosen by the search under a budget that needs it (or
    forced by a rule around the model's own nn.remat): the program runs the layers under
    jax.checkpoint, forward and gradients equal the plain module's."""
    spec = _gpt(remat=remat)
    (tokens,) = spec.make_args()
    mesh = make_mesh((2, 4), ("data", "model"))
    if remat:
        cons = Constraints(rules=(Rule(module="h_*", recompute=True),))
    else:
        need = _smallest_without_recompute(capture_spec(spec).graph)
        cons = Constraints(max_memory_per_device=int(need * 0.95))
    pm = auto_parallel(mesh, cons)(spec.module)
    v = pm.init(jax.random.key(0), tokens)
    assert pm.plan.recompute
    n_user = str(jax.make_jaxpr(spec.module.apply)(v, tokens)).count("remat")
    assert str(jax.make_jaxpr(pm.apply)(v, tokens)).count("remat") > n_user
    assert_like_one_device(pm, spec.module, v, (tokens,))


def test_baselines_recompute_every_block(gpt_graph):
    """DeepSpeed-style (ZeRO-3 + activation checkpointing) and Megatron-LM-style (tensor
    parallel + full recompute) as those systems train."""
    ds = make_plan(gpt_graph, AXES, policy="deepspeed")
    mlm = make_plan(gpt_graph, AXES, policy="megatron-lm")
    blocks = ("h_0", "h_1", "h_2", "h_3")
    assert ds.recompute == blocks and ds.zero == 3
    assert mlm.recompute == blocks
    assert [p.split for p in mlm.ops] == [p.split for p in make_plan(
        gpt_graph, AXES, policy="megatron").ops]
    plain = make_plan(gpt_graph, AXES, policy="zero3").cost
    assert ds.cost.memory_bytes_per_device < plain.memory_bytes_per_device
    assert ds.cost.step_time_s > plain.step_time_s


def test_recompute_probes_share_what_ignores_boundaries(gpt_graph):
    """A graph with recompute boundaries added keeps its model graph's dataflow: the search
    space and the residuals are computed once for all the probes; a graph changed any other
    way (``dataclasses.replace``) gets its own."""
    from nnscaler_jax.cost.residuals import residual_outputs
    from nnscaler_jax.search.space import build_space

    probe = with_recompute(gpt_graph, ("h_0", "h_2"))
    assert probe.dataflow is gpt_graph and probe.boundaries != gpt_graph.boundaries
    base, shared = build_space(gpt_graph, AXES), build_space(probe, AXES)
    assert shared.graph is probe and shared.groups is base.groups
    assert residual_outputs(probe) is residual_outputs(gpt_graph)
    other = dataclasses.replace(gpt_graph)
    assert other.dataflow is other
    fresh = build_space(other, AXES)
    assert fresh.groups is not base.groups and fresh.groups == base.groups
    assert fresh.where == shared.where and residual_outputs(other) == residual_outputs(probe)
