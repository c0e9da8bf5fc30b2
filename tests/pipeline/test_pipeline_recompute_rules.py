"""Recompute rules in pipelined plans (``nnscaler_jax.pipeline.rules``): per module path, a layer
recomputed on its own inside its chunk's backward whatever the budget (``Rule(recompute=True)``)
or never (``recompute=False``), priced by the stage pricing and run by the pipelined step."""
import dataclasses

import jax
import numpy as np
import optax
import pytest
from meshes import make_mesh
from one_device import updated

import models
from nnscaler_jax import Constraints, Plan, PlanError, Rule, auto_parallel
from nnscaler_jax.capture.trace import capture_spec
from nnscaler_jax.cli.compare import plan_features
from nnscaler_jax.errors import NoFitError
from nnscaler_jax.pipeline.rules import layer_flags
from nnscaler_jax.planner import make_plan

AXES = {"stage": 2, "data": 4}
# (transfers after each step: an overlapping row holds two more values, and a budget one byte
# under it would be met by the other row, not by recomputing)
STAGES = {"pipeline_stages": 2, "microbatches": 4, "schedule": "1f1b", "pipeline_overlap": False}


def test_rules_select_whole_layers():
    layers, paths = ["h_0", "h_1"], ["wte", "h_0/attn/q", "h_0/mlp", "h_1/mlp", "ln_f"]
    assert layer_flags(layers, paths, [Rule(module="h_1", recompute=False)]) == {"h_1": False}
    with pytest.raises(PlanError, match="'h_0/mlp', which is not a whole layer"):
        layer_flags(layers, paths, [Rule(module="h_*/mlp", recompute=True)])
    with pytest.raises(PlanError, match="selects 'wte'"):  # (no module: every op)
        layer_flags(layers, paths, [Rule(recompute=True)])
    with pytest.raises(PlanError, match="disagree on layer 'h_1'"):
        layer_flags(layers, paths, [Rule(module="h_*", recompute=True),
                                    Rule(module="h_1", recompute=False)])


@pytest.fixture(scope="module")
def gpt():
    spec = models.get("gpt", "tiny", batch_size=64, n_layers=8)
    return spec, capture_spec(spec).graph


def test_a_stack_of_identical_layers_takes_rules_over_every_layer(gpt):
    _, graph = gpt
    free = make_plan(graph, AXES, constraints=Constraints(**STAGES))
    assert free.pipeline.recompute == "chunk"
    forced = make_plan(graph, AXES, constraints=Constraints(
        **STAGES, rules=(Rule(module="h_*", recompute=True),)))
    assert forced.pipeline.recompute == "layer"  # without any budget asking for it
    assert forced.cost.memory_bytes_per_device < free.cost.memory_bytes_per_device
    assert forced.cost.step_time_s > free.cost.step_time_s
    # a budget only recomputing every layer meets, with a rule forbidding it
    tight = Constraints(**STAGES, max_memory_per_device=free.cost.memory_bytes_per_device - 1)
    assert make_plan(graph, AXES, constraints=tight).pipeline.recompute == "layer"
    with pytest.raises(NoFitError, match="recompute mode of schedule '1f1b' on 2 stages fits"
                       ".* smallest estimate is") as no_fit:
        make_plan(graph, AXES, constraints=Constraints(
            **STAGES, max_memory_per_device=tight.max_memory_per_device,
            rules=(Rule(module="h_*", recompute=False),)))
    assert no_fit.value.smallest_bytes == free.cost.memory_bytes_per_device
    with pytest.raises(PlanError, match="not all 8 alike"):  # one program on every stage
        make_plan(graph, AXES, constraints=Constraints(
            **STAGES, rules=(Rule(module="h_3", recompute=True),)))


def test_cut_chunks_price_each_layer_a_rule_selects(gpt):
    _, graph = gpt
    cut = dict(STAGES, pipeline_pivots=("h_*",))  # the cut program: layers may differ
    free = make_plan(graph, AXES, constraints=Constraints(**cut))
    some = make_plan(graph, AXES, constraints=Constraints(
        **cut, rules=(Rule(module="h_[0246]", recompute=True),)))
    every = make_plan(graph, AXES, constraints=Constraints(
        **cut, rules=(Rule(module="h_*", recompute=True),)))
    assert free.pipeline.recompute == some.pipeline.recompute == "chunk"
    mem = [p.cost.memory_bytes_per_device for p in (free, some, every)]
    step = [p.cost.step_time_s for p in (free, some, every)]
    assert mem[0] > mem[1] > mem[2] and step[0] < step[1] < step[2]
    # the plan carries the rules' layers (a saved plan runs them), and says so
    assert some.pipeline.recomputed() == ["h_0", "h_2", "h_4", "h_6"]
    assert Plan.from_json(some.to_json()).pipeline == some.pipeline
    assert "4 layers recomputed (h_0, h_2, h_4, h_6)" in str(some)
    assert plan_features(some)["recompute"] == ["h_0", "h_2", "h_4", "h_6"]
    assert "every layer recomputed" in str(every)
    # forbidding half the layers: 'layer' recomputes only the others, between the two
    tight = free.cost.memory_bytes_per_device - 1
    layer = make_plan(graph, AXES, constraints=Constraints(**cut, max_memory_per_device=tight))
    half = make_plan(graph, AXES, constraints=Constraints(
        **cut, max_memory_per_device=tight, rules=(Rule(module="h_[0246]", recompute=False),)))
    assert layer.pipeline.recompute == half.pipeline.recompute == "layer"
    assert layer.cost.memory_bytes_per_device < half.cost.memory_bytes_per_device < tight


@pytest.mark.slow
def test_the_cut_step_checkpoints_the_layers_a_rule_selects_and_trains_like_one_device():
    spec = models.get("gpt", "tiny", batch_size=8, n_layers=4)
    params = spec.init(jax.random.PRNGKey(0))["params"]
    args, opt = spec.make_args(), optax.sgd(0.1)
    full = lambda p: spec.loss_fn(spec.module.apply({"params": p}, *args), *args)
    loss, grads = jax.jit(jax.value_and_grad(full))(params)
    want = updated(opt, params, grads)
    barriers = {}
    for rules in ((), (Rule(module="h_[02]", recompute=True),)):
        pm = auto_parallel(make_mesh((2, 4), ("stage", "data")), Constraints(
            pipeline_stages=2, microbatches=2, schedule="1f1b", pipeline_pivots=("h_*",),
            rules=rules))(spec.module)
        step = pm.train_step(spec.loss_fn, opt)
        state = step.init({"params": params}, *args)
        # jax.checkpoint leaves an optimization barrier per recomputed layer in the backward
        barriers[rules] = step.lower(state, *args).as_text().count("optimization_barrier")
        state, metrics = step(state, *args)
        np.testing.assert_allclose(float(metrics["loss"]), float(loss), rtol=1e-5)
        for x, y in zip(jax.tree.leaves(step.params(state)), jax.tree.leaves(want),
                        strict=True):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-6)
    assert barriers[()] == 0 and barriers[rules] > 0, barriers


def test_each_refused_module_glob_names_the_one_that_works_in_a_pipelined_swin():
    """A user's recompute rule on a pipelined Swin (the issue's path: ``'layers_0/*'`` refused
    as part of a layer, then ``'layers_0'`` as matching no op, and nothing said that
    ``'layers_0*'`` works): each refusal names the glob that works, and it does. The plan reads
    the micro-batches its schedule runs."""
    graph = capture_spec(models.get("swin", "tiny", batch_size=32)).graph
    rule = lambda glob: Constraints(**STAGES, rules=(Rule(module=glob, recompute=True),))
    with pytest.raises(PlanError, match=r"not a whole layer.*Use Rule\(module='layers_0\*', "
                       r"recompute=True\) for the layer that holds it"):
        make_plan(graph, AXES, constraints=rule("layers_0/*"))
    with pytest.raises(PlanError, match=r"matches no op \('layers_0' has no ops of its own.*use "
                       r"module='layers_0\*' \(or 'layers_0/\*'\)\)"):
        make_plan(graph, AXES, constraints=rule("layers_0"))
    plan = make_plan(graph, AXES, constraints=rule("layers_0*"))
    assert plan.pipeline.recomputed() == ["layers_0", "layers_0/blocks_1"]
    assert plan.microbatches == plan.pipeline.microbatches == 4
    assert Plan.from_json(plan.to_json()).microbatches == 4
    other = dataclasses.replace(plan, pipeline=dataclasses.replace(plan.pipeline, microbatches=8))
    assert other.microbatches == 8  # never stale
