"""Mixed precision in the pipelined step: bfloat16 / float16 compute, float32 master weights;
float16 with the SPMD step's dynamic loss scaling.

Each chunk casts the float32 parameters it reads to bfloat16 itself (the cut program makes a
parameter's cast where it is read, so a stage still stores only its own parameters and no
16-bit weight crosses a boundary); activations cross stages in bfloat16; parameters and
optimizer state stay float32. The step is compared with one device running the same casts:
bfloat16 keeps 8 mantissa bits, so reduction orders (micro-batches, data shards) move each
gradient by a few rounding steps: measured at most 2.1% per parameter (the bf16 program itself
is 1-2% from float32); 5% is the bound, on parameters whose gradient is not rounding noise (the
attention key bias's true gradient is 0).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from meshes import make_mesh

import models
from nnscaler_jax import Constraints, PlanError, auto_parallel

BF16_GRAD_RTOL = 5e-2  # see the module docstring
FP16_GRAD_RTOL = 1e-2  # float16's 11 bits: measured at most 0.31% (cut and per-stage programs)
LR = 0.1


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_bfloat16_pipeline_matches_the_same_casts_on_one_device(schedule):
    # zb-h1: the split backward's G reads the float32 parameters and the kept bf16 values
    spec = models.get("gpt", "tiny", batch_size=16, dtype=jnp.bfloat16)
    params = spec.init(jax.random.PRNGKey(0))["params"]
    args = spec.make_args()
    pm = auto_parallel(make_mesh((2, 4), ("stage", "data")),
                       Constraints(pipeline_stages=2, microbatches=4, schedule=schedule,
                                   precision="bfloat16"))(spec.module)
    opt = optax.sgd(LR)
    step = pm.train_step(spec.loss_fn, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no matmul left in float32
        state = step.init({"params": params}, *args)
    prog = step.program
    # each stage owns its layer's parameters (casts made where read), bf16 crosses stages
    assert all(len(own) > 10 for own in prog.owned)
    assert {str(v.aval.dtype) for b in prog.cut.bounds for v in b} == {"bfloat16"}
    state, metrics = step(state, *args)
    loss, grads = _scaled_grads(spec, params, args, jnp.bfloat16, 1.0)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-3)
    _assert_sgd_step(step.params(state), params, grads, BF16_GRAD_RTOL)


@pytest.mark.slow
def test_an_nnx_model_trains_in_bfloat16_on_tensor_parallel_stages():
    """An nnx GPT computing in bfloat16 (its layers' dtype, float32 parameters), 2 stages x
    Megatron inside (one program per stage), 1F1B, ``precision='bfloat16'``: no matmul left
    in float32, bfloat16 crossing the stages, one SGD step like one device running the same
    casts, and the float32 master weights written back into the module (``step.update``)."""
    from flax import nnx

    spec = models.get("gpt_nnx", "tiny", batch_size=16, dtype=jnp.bfloat16)
    module, args = spec.module, spec.make_args()
    graphdef, params, rest = nnx.split(nnx.clone(module), nnx.Param, ...)
    pm = auto_parallel(make_mesh((2, 2, 2), ("stage", "data", "model")),
                       Constraints(pipeline_stages=2, microbatches=4, schedule="1f1b",
                                   precision="bfloat16"), policy="megatron")(module)
    step = pm.train_step(spec.loss_fn, optax.sgd(LR))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no matmul left in float32
        state = step.init(None, *args)
    state, metrics = step(state, *args)
    prog = step.program
    assert type(prog).__name__ == "MpmdProgram" and len(step.stage_plans) == 2
    assert {str(v.aval.dtype) for b in prog.cut.bounds for v in b} == {"bfloat16"}

    def one_device(p, *b):
        out = nnx.merge(graphdef, _cast(p, jnp.bfloat16), rest)(*_cast(b, jnp.bfloat16))
        return spec.loss_fn(out.astype(jnp.float32), *b)

    loss, grads = jax.jit(jax.value_and_grad(one_device))(params, *args)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-3)
    step.update(state)
    _assert_sgd_step(nnx.state(module, nnx.Param), params, grads, BF16_GRAD_RTOL)


def _scaled_grads(spec, params, args, dtype, scale):
    """One device's gradients of the same casts, the loss scaled by ``scale`` (float16's
    cotangents scaled as the step's) and the gradients divided by it."""
    def one_device(p, *b):
        out = spec.module.apply({"params": _cast(p, dtype)}, *_cast(b, dtype))
        return spec.loss_fn(jax.tree.map(lambda x: x.astype(jnp.float32), out), *b) * scale

    loss, grads = jax.jit(jax.value_and_grad(one_device))(params, *args)
    return loss / scale, jax.tree.map(lambda g: g / scale, grads)


def _assert_sgd_step(got, params, grads, rtol):
    """``got`` is one SGD step from ``params`` along ``grads``, within ``rtol`` per parameter
    whose gradient is not rounding noise; float32 master weights."""
    assert {x.dtype for x in jax.tree.leaves(got)} == {jnp.dtype("float32")}
    floor = 1e-3 * max(float(jnp.linalg.norm(g)) for g in jax.tree.leaves(grads))
    for (path, x), p0, g in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                                jax.tree.leaves(params), jax.tree.leaves(grads), strict=True):
        if float(jnp.linalg.norm(g)) < floor:
            continue  # rounding noise around a zero gradient
        g_pipe = (np.asarray(p0) - np.asarray(x)) / LR
        err = np.linalg.norm(g_pipe - np.asarray(g)) / np.linalg.norm(np.asarray(g))
        assert err <= rtol, (jax.tree_util.keystr(path), err)


def _cast(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                        else x, tree)


@pytest.mark.slow
@pytest.mark.parametrize("mesh,policy", [(((2, 4), ("stage", "data")), None),
                                         (((2, 2, 2), ("stage", "data", "model")), "megatron")],
                         ids=["cut", "tensor-parallel-stages"])
def test_float16_pipeline_scales_the_loss_like_one_device(mesh, policy):
    """float16 in both cut runtimes (one program; one per stage, tensor-parallel inside), with
    eager 1F1B's pairs (a forward and a backward in one time step): the
    last chunk's backward is seeded with the loss scale, the gradients unscaled before the
    update, the scale doubled after ``growth_interval`` finite steps."""
    spec = models.get("gpt", "tiny", batch_size=16, dtype=jnp.float16)
    params = spec.init(jax.random.PRNGKey(0))["params"]
    args = spec.make_args()
    pm = auto_parallel(make_mesh(*mesh), Constraints(pipeline_stages=2, microbatches=4,
                                                     schedule="eager-1f1b", precision="float16"),
                       policy=policy)(spec.module)
    step = pm.train_step(spec.loss_fn, optax.sgd(LR), growth_interval=1)
    state = step.init({"params": params}, *args)
    assert float(state["loss_scale"]) == 2.0 ** 15
    state, metrics = step(state, *args)
    assert bool(metrics["finite"]) and float(metrics["loss_scale"]) == 2.0 ** 15
    assert float(state["loss_scale"]) == 2.0 ** 16  # growth_interval=1: doubled at once
    loss, grads = _scaled_grads(spec, params, args, jnp.float16, 2.0 ** 15)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-3)
    _assert_sgd_step(step.params(state), params, grads, FP16_GRAD_RTOL)
    # a scale float16 cannot hold the cotangents of: nothing is updated, the scale halves
    before = jax.tree.map(np.asarray, step.params(state))
    state["loss_scale"] = jnp.float32(2.0 ** 40)
    state, metrics = step(state, *args)
    assert not bool(metrics["finite"]) and float(state["loss_scale"]) == 2.0 ** 39
    assert int(state["good_steps"]) == 0
    jax.tree.map(np.testing.assert_array_equal, step.params(state), before)


def test_growth_interval_is_checked():
    spec = models.get("gpt", "tiny", batch_size=8)
    pm = auto_parallel(make_mesh((2, 4), ("stage", "data")),
                       Constraints(pipeline_stages=2, precision="float16"))(spec.module)
    with pytest.raises(PlanError, match="growth_interval=0 must be a positive int"):
        pm.train_step(spec.loss_fn, optax.sgd(0.1), growth_interval=0)
