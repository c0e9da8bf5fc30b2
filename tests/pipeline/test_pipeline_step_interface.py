"""The pipelined step behind the same interface as the SPMD one (issue 17): a batch split over an
Explicit mesh's data axis, ``step.plan``, ``step.memory(state)``."""
import re

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import models
from nnscaler_jax import Constraints, auto_parallel

pytestmark = pytest.mark.slow


def test_explicit_data_split_batch_plan_and_memory():
    mesh = jax.make_mesh((2, 4), ("stage", "data"))  # Explicit axis types
    module, make_args, loss_fn = models.get("gpt", "tiny", batch_size=8)
    args = make_args(rng=jax.random.key(1))
    variables = module.init(jax.random.key(0), *args)
    plain = float(loss_fn(module.apply(variables, *args), *args))
    split = tuple(jax.device_put(a, NamedSharding(mesh, P("data"))) for a in args)
    pm = auto_parallel(mesh, Constraints(pipeline_stages=2, microbatches=2,
                                         schedule="1f1b"))(module)
    step = pm.train_step(loss_fn, optax.adam(1e-3))
    state = step.init(variables, *split)
    state, metrics = step(state, *split)  # (was a reshape ShardingTypeError)
    np.testing.assert_allclose(float(metrics["loss"]), plain, rtol=1e-5)
    assert step.plan.pipeline.stages == 2
    from nnscaler_jax.pipeline.program import PipelineRuntime

    assert isinstance(step.program, PipelineRuntime)  # the declared runtime interface
    mem = step.memory(state)
    full = sum(x.nbytes for x in jax.tree.leaves(variables["params"]))
    # the layers are split over the 2 stages, the embeddings and head replicated
    assert mem["params"] < full and mem["grads"] == mem["params"]
    assert mem["optimizer"] == pytest.approx(2 * mem["params"], rel=0.01)  # Adam's moments
    # the plan's estimate of the same kinds (the tied token embedding, read by the first
    # layers and the head, is one shared leaf: priced once)
    predicted = step.predicted_memory()
    for kind in ("params", "grads", "optimizer"):
        assert mem[kind] == pytest.approx(predicted[kind], rel=0.01), (kind, mem, predicted)
    assert predicted["peak"] == step.plan.cost.memory_bytes_per_device
    assert predicted["peak"] >= max(predicted[k] for k in ("params", "optimizer",
                                                            "activations"))


@pytest.mark.parametrize("name,kw", [("gpt", {}), ("t5", {})])
def test_the_step_runs_inside_the_callers_explicit_mesh_context(name, kw):
    """``with jax.set_mesh(mesh):`` around init and step, as jax's Explicit-sharding docs
    write it: the micro-batch program was traced under that context, its values typed on the
    caller's mesh, and binding them inside the runtime's shard_map failed ("context mesh ...
    should match the aval mesh") for the stacked (GPT) and the cut (T5) runtime alike."""
    mesh = jax.make_mesh((2, 4), ("stage", "data"))  # Explicit axis types
    spec = models.get(name, "tiny", batch_size=8, **kw)
    args = spec.make_args()
    variables = spec.init(jax.random.key(0))
    plain = float(spec.loss_fn(spec.module.apply(variables, *args), *args))
    pm = auto_parallel(mesh, Constraints(pipeline_stages=2, microbatches=2,
                                         schedule="1f1b"))(spec.module)
    step = pm.train_step(spec.loss_fn, optax.sgd(0.1))
    with jax.set_mesh(mesh):
        state = step.init(variables, *args)
        state, metrics = step(state, *args)
    np.testing.assert_allclose(float(metrics["loss"]), plain, rtol=1e-5)


def test_a_batch_unlike_the_one_the_step_was_built_for_is_a_plan_error():
    """The last, smaller batch of an epoch, or the labels left out: a PlanError naming the
    shapes step.init traced for (was a raw reshape TypeError / zip ValueError)."""
    from nnscaler_jax import PlanError

    mesh = jax.make_mesh((2, 4), ("stage", "data"))
    spec = models.get("t5", "tiny", batch_size=16)
    pm = auto_parallel(mesh, Constraints(pipeline_stages=2, microbatches=2,
                                         schedule="1f1b"))(spec.module)
    step = pm.train_step(spec.loss_fn, optax.sgd(0.1))
    args = spec.make_args()
    state = step.init(spec.init(jax.random.key(0)), *args)
    small = models.get("t5", "tiny", batch_size=8).make_args()
    for batch in (small, args[:1]):
        with pytest.raises(PlanError, match=r"built \(step.init\) for a batch of 2 arrays "
                                            r"shaped \[\(16, 16\), \(16, 8\)\]"):
            step(state, *batch)


def test_both_steps_are_train_steps_and_validate_options_alike():
    """One declared interface (``nnscaler_jax.train.TrainStep``): the SPMD and the pipelined
    step implement it, and refuse the same bad options with the same message."""
    from nnscaler_jax import PlanError
    from nnscaler_jax.train import TrainStep

    module, _, loss_fn = models.get("gpt", "tiny", batch_size=8)
    flat = auto_parallel(jax.make_mesh((2, 4), ("data", "model")))(module)
    piped = auto_parallel(jax.make_mesh((2, 4), ("stage", "data")),
                          Constraints(pipeline_stages=2, microbatches=2))(module)
    steps = [pm.train_step(loss_fn, optax.sgd(0.1)) for pm in (flat, piped)]
    assert [type(s).__name__ for s in steps] == ["SpmdStep", "PipelineStep"]
    assert all(isinstance(s, TrainStep) for s in steps)
    with pytest.raises(TypeError):
        TrainStep(flat, loss_fn, optax.sgd(0.1))  # abstract
    for pm in (flat, piped):
        for bad, said in (({"inputs": True}, "inputs=True must be a positive int"),
                          ({"module_kwargs": ["train"]}, "must be a dict"),
                          ({"microbatch": 2}, "not ['microbatch']")):
            with pytest.raises(PlanError, match=re.escape(said)):
                pm.train_step(loss_fn, optax.sgd(0.1), **bad)
        with pytest.raises(PlanError, match="before the first step"):
            pm.train_step(loss_fn, optax.sgd(0.1)).lower({}, np.zeros((8, 16), np.int32))
