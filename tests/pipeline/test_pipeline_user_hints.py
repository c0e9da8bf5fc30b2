"""The pipelined step's hints name the fix, as the SPMD step's do.

A module that takes only ``x`` of a batch ``(x, y)`` fails when the step passes it the whole
batch (``inputs=None``); the pipelined step says so with the SPMD step's hint, ``inputs=1``,
keeping the original error's text, and with ``inputs=1`` it trains like one device.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from meshes import make_mesh

from nnscaler_jax import Constraints, PlanError, auto_parallel

WIDTH, LR = 16, 0.1


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(4):
            x = nn.relu(nn.Dense(WIDTH, name=f"h_{i}")(x))
        return nn.Dense(4, name="head")(x)


class _NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.h_0 = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.h_1 = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.head = nnx.Linear(WIDTH, 4, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.h_1(nnx.relu(self.h_0(x)))))


def _loss_fn(out, x, y):
    return jnp.mean((out - y) ** 2)


def _batch():
    x = jax.random.normal(jax.random.key(1), (32, WIDTH))
    return x, jax.random.normal(jax.random.key(2), (32, 4))


def _pm(module):
    mesh = make_mesh((2, 4), ("stage", "data"))
    return auto_parallel(mesh, Constraints(pipeline_stages=2, microbatches=2,
                                           schedule="1f1b"))(module)


def test_linen_module_of_x_given_x_y_hints_inputs_1():
    x, y = _batch()
    module = _MLP()
    params = module.init(jax.random.key(0), x)["params"]
    step = _pm(module).train_step(_loss_fn, optax.sgd(LR))
    with pytest.raises(PlanError) as info:
        step.init({"params": params}, x, y)
    text = str(info.value)
    assert "inputs=1" in text and "train_step passed all 2 batch arrays" in text
    assert "takes 2 positional arguments but 3 were given" in text  # the original error
    assert isinstance(info.value.__cause__, PlanError)  # chained to the tracing error
    assert isinstance(info.value.__cause__.__cause__, TypeError)


def test_nnx_module_of_x_given_x_y_hints_inputs_1():
    x, y = _batch()
    step = _pm(_NnxMLP(nnx.Rngs(0))).train_step(_loss_fn, optax.sgd(LR))
    with pytest.raises(PlanError, match=r"(?s)inputs=1.*positional arguments"):
        step.init(None, x, y)


@pytest.mark.slow  # compiles and runs the pipelined step over the mesh
def test_inputs_1_trains_like_one_device():
    x, y = _batch()
    module = _MLP()
    params = module.init(jax.random.key(0), x)["params"]
    step = _pm(module).train_step(_loss_fn, optax.sgd(LR), inputs=1)
    state = step.init({"params": params}, x, y)
    state, metrics = step(state, x, y)
    loss, grads = jax.value_and_grad(
        lambda p: _loss_fn(module.apply({"params": p}, x), x, y))(params)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
    ref = jax.tree.map(lambda p, g: p - LR * g, params, grads)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(step.params(state))[0],
                            jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))
