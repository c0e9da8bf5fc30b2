"""Calls users make that flax takes and the wrappers must take too: ``init(..., method=)``, a
single rng key, an nnx wrapper inside the user's own ``jax.jit`` / ``jax.grad``, eager
``jax.grad`` on variables stored elsewhere, the wrapper API on decorated instances and the hint
for a ``(x, y)`` batch. Every result is checked against the plain module."""

from __future__ import annotations

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from meshes import make_mesh

from nnscaler_jax import Constraints, Plan, PlanError, auto_parallel
from nnscaler_jax.errors import ConstraintError, NoFitError
from nnscaler_jax.ir.graph import Graph

pytestmark = pytest.mark.slow  # compiles and runs programs over the mesh

RTOL, ATOL = 1e-5, 1e-6


def _close(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=RTOL, atol=ATOL)


def _x(shape=(8, 16), seed=1):
    return np.asarray(jax.random.normal(jax.random.key(seed), shape))


class AE(nn.Module):
    def setup(self):
        self.enc = nn.Dense(32)
        self.dec = nn.Dense(16)

    def __call__(self, x):
        return self.dec(nn.relu(self.enc(x)))

    def decode(self, z):
        return self.dec(z)


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(16, name="fc2")(nn.relu(nn.Dense(64, name="fc1")(x)))


class Drop(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dropout(0.5, deterministic=False)(nn.Dense(8)(x))


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(16, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.fc2 = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.fc2(nnx.relu(self.bn(self.fc1(x))))


# ---- linen: init(method=), rngs=<one key> ------------------------------------------------------


@pytest.mark.parametrize("method", ["decode", AE.decode])
def test_init_and_make_plan_with_method(mesh, method):
    """``pm.init(rngs, z, method=...)`` gives ``module.init``'s variables (only the decoder's),
    and ``pm.apply`` / ``pm.make_plan`` take the same method."""
    m, z, key = AE(), _x((8, 32)), jax.random.key(0)
    pm = auto_parallel(mesh, policy="megatron")(m)
    v = pm.init(key, z, method=method)
    ref = m.init(key, z, method=method)
    _close(v, ref)
    assert set(v["params"]) == {"dec"}
    _close(pm.apply(v, z, method=method), m.apply(ref, z, method=method))
    assert isinstance(auto_parallel(mesh, policy="dp")(m).make_plan(z, method=method), Plan)


def test_make_plan_with_a_method_the_call_does_not_take(mesh):
    """Abstract variables come from ``__call__`` when it takes the args, else from the method:
    the plan is the one ``apply`` with ``init(..., method=)``'s variables runs."""

    class Pair(nn.Module):
        def setup(self):
            self.dec = nn.Dense(16)

        def __call__(self, x, y):
            return self.dec(x) + y

        def decode(self, z):
            return self.dec(z)

    m, z = Pair(), _x((8, 32))
    pm = auto_parallel(mesh, policy="megatron")(m)
    plan = pm.make_plan(z, method="decode")
    ref = m.init(jax.random.key(0), z, method="decode")
    _close(pm.apply(ref, z, method="decode"), m.apply(ref, z, method="decode"))
    assert pm.plan == plan


@pytest.mark.parametrize("key", [jax.random.key(3), jax.random.PRNGKey(3)],
                         ids=["typed", "raw"])
def test_apply_and_init_take_a_single_rng_key(mesh, key):
    """A single key is ``{'params': key}`` (dropout falls back to it), as in ``module.apply``."""
    m, x = Drop(), _x((8, 4))
    v = m.init(jax.random.key(0), x)
    pm = auto_parallel(mesh, policy="dp")(m)
    _close(pm.apply(v, x, rngs=key), m.apply(v, x, rngs=key))
    _close(pm.init(key, x), m.init(key, x))
    assert isinstance(pm.make_plan(x, variables=v, rngs=key), Plan)


# ---- nnx wrapper inside the user's jax.jit / jax.grad -----------------------------------------


@pytest.mark.parametrize("first_call", ["eager", "in_jit"])
def test_nnx_wrapper_closed_over_in_jax_jit_and_grad(mesh, first_call):
    """A call that assigns no state (BatchNorm in eval mode) works closed over in ``jax.jit``
    and ``jax.grad``, as the plain module does, even when it is the wrapper's first call."""
    a = NnxMLP(nnx.Rngs(0))
    b = nnx.clone(a)
    a.eval()
    b.eval()
    x = jnp.asarray(_x())
    pm = auto_parallel(mesh, policy="megatron")(a)
    if first_call == "eager":
        _close(pm(x), b(x))
    _close(jax.jit(lambda x: pm(x))(x), jax.jit(lambda x: b(x))(x))
    loss = lambda f: (lambda x: jnp.sum(f(x) ** 2))
    _close(jax.grad(loss(pm))(x), jax.grad(loss(b))(x))
    _close(jax.jit(jax.grad(loss(pm)))(x), jax.grad(loss(b))(x))
    _close(nnx.state(a), nnx.state(b))  # nothing written back


def test_nnx_wrapper_writes_back_only_assigned_state(mesh):
    """In train mode the call assigns the batch statistics (written back, as the plain module
    does) and not the parameters: they keep the objects the wrapper laid out."""
    a = NnxMLP(nnx.Rngs(0))
    b = nnx.clone(a)
    x = jnp.asarray(_x())
    pm = auto_parallel(mesh, policy="megatron")(a)
    pm.lay_out(x)
    kernel = a.fc1.kernel.get_value()
    _close(pm(x), b(x))
    _close(nnx.state(a, nnx.BatchStat), nnx.state(b, nnx.BatchStat))
    assert a.fc1.kernel.get_value() is kernel


# ---- eager jax.grad on variables committed to another layout ----------------------------------


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_eager_grad_with_variables_stored_elsewhere(axis_type):
    """Eager ``jax.grad`` through ``pm.apply`` on params replicated by ``device_put`` (not the
    plan's layout) or laid out by another plan: the unwrapped module's gradients. (On an
    Explicit mesh under ``jax.set_mesh``: eager ``jax.grad`` of the plain module needs it too.)"""
    mesh = make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)
    m, x = MLP(), _x()
    v = m.init(jax.random.key(0), x)
    pm = auto_parallel(mesh, policy="megatron")(m)
    other = auto_parallel(mesh, policy="dp")(m).init(jax.random.key(0), x)
    loss = lambda p, apply: jnp.mean(apply({"params": p}, x) ** 2)
    val, ref = jax.value_and_grad(loss)(v["params"], m.apply)
    ctx = (lambda: jax.set_mesh(mesh)) if axis_type == AxisType.Explicit else contextlib.nullcontext
    for params in (jax.device_put(v, NamedSharding(mesh, P()))["params"], other["params"]):
        with ctx():
            g = jax.grad(loss)(params, pm.apply)
            val2, g2 = jax.value_and_grad(loss)(params, pm.apply)
        _close(g, ref)
        _close(g2, ref)
        np.testing.assert_allclose(val2, val, rtol=RTOL)


# ---- decorated classes: the wrapper's API -----------------------------------------------------


def test_decorated_instances_have_the_wrapper_api(mesh):
    x, y = _x(), _x((8, 8), seed=2)

    @auto_parallel(mesh, policy="dp")
    class L(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(x)

    @auto_parallel(mesh, policy="dp")
    class N(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(16, 8, rngs=rngs)

        def __call__(self, x):
            return self.fc(x)

    loss = lambda out, x, y: jnp.mean((out - y) ** 2)
    lin = L()
    assert isinstance(lin.make_plan(x), Plan)
    v = lin.init(jax.random.key(0), x)
    lin.apply(v, x)
    assert isinstance(lin.plan, Plan) and isinstance(lin.graph, Graph)
    step = lin.train_step(loss, optax.sgd(0.1), inputs=1)
    _, metrics = step(step.init(v, x, y), x, y)
    ref = loss(nn.Dense(8).apply({"params": v["params"]["Dense_0"]}, x), x, y)
    np.testing.assert_allclose(metrics["loss"], ref, rtol=RTOL)

    n = N(nnx.Rngs(0))
    plain = nnx.Linear(16, 8, rngs=nnx.Rngs(0))
    assert isinstance(n.make_plan(x), Plan)
    _close(n(x), plain(x))
    assert isinstance(n.plan, Plan) and isinstance(n.graph, Graph)
    step = n.train_step(loss, optax.sgd(0.1), inputs=1)
    _, metrics = step(step.init(None, x, y), x, y)
    np.testing.assert_allclose(metrics["loss"], loss(plain(x), x, y), rtol=RTOL)


# ---- train_step on an (x, y) batch without inputs= ------------------------------------------


def test_train_step_without_inputs_suggests_inputs_1(mesh):
    m, x, y = MLP(), _x(), _x(seed=2)
    pm = auto_parallel(mesh, policy="dp")(m)
    step = pm.train_step(lambda o, x, y: jnp.mean((o - y) ** 2), optax.sgd(0.1))
    with pytest.raises(PlanError, match=r"(?s)takes 2 positional") as info:
        step.init(pm.init(jax.random.key(0), x), x, y)
    # the cause and the fix first, the shapes counted rather than listed
    first = str(info.value).splitlines()[:2]
    assert "inputs=None" in first[0] and "inputs=1" in first[1], first
    assert "2 x (8, 16) float32" in str(info.value)


class _Dropped(nn.Module):
    @nn.compact
    def __call__(self, x, deterministic=True):
        x = nn.Dropout(0.1)(nn.Dense(16)(x), deterministic=deterministic)
        return nn.Dense(16)(x)


@pytest.mark.parametrize("stages", [None, 2], ids=["spmd", "pipelined"])
def test_both_steps_say_a_missing_dropout_key_and_the_fix(stages):
    """One module adapter for both steps: a module drawing dropout without the step's key
    fails with the same fix (``rng=`` at init, or a deterministic call), and with the key
    the step trains."""
    m, x, y = _Dropped(), _x(), _x(seed=2)
    v = m.init(jax.random.key(0), x)
    loss = lambda o, x, y: jnp.mean((o - y) ** 2)
    if stages is None:
        pm = auto_parallel(make_mesh((2, 4), ("data", "model")), policy="dp")(m)
    else:
        pm = auto_parallel(make_mesh((2, 4), ("stage", "data")),
                           Constraints(pipeline_stages=stages, microbatches=2))(m)
    kw = {"inputs": 1, "module_kwargs": {"deterministic": False}}
    with pytest.raises(PlanError, match=r"needs PRNG") as info:
        pm.train_step(loss, optax.sgd(0.1), **kw).init(v, x, y)
    text = str(info.value)
    assert text.startswith("train_step:") and "rng=jax.random.key(0)" in text, text
    assert "rng_streams (now ('dropout',))" in text and "module_kwargs" in text, text
    step = pm.train_step(loss, optax.sgd(0.1), **kw)
    _, metrics = step(step.init(v, x, y, rng=jax.random.key(1)), x, y)
    assert np.isfinite(metrics["loss"])


def test_a_tracing_error_counts_many_shapes_instead_of_listing_them(mesh):
    class Deep(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(40):
                x = nn.Dense(16)(x)
            return x

    x = _x()
    pm = auto_parallel(mesh, policy="dp")(Deep())
    variables = pm.init(jax.random.key(0), x)
    with pytest.raises(PlanError, match=r"Deep: the call failed while tracing: TypeError") as e:
        pm.apply(variables, x, x)
    assert len(str(e.value)) < 400, str(e.value)
    assert "40 x (16, 16) float32" in str(e.value)


def test_a_saved_plan_is_held_to_the_constraints_given_with_it(mesh):
    x = np.ones((8, 16), np.float32)
    pm = auto_parallel(mesh, policy="dp")(MLP())
    pm.init(jax.random.key(0), x)
    saved = pm.plan
    with pytest.raises(ConstraintError, match=r"zero=3\) contradicts the saved plan's ZeRO"):
        auto_parallel(mesh, Constraints(zero=3), plan=saved)(MLP()).make_plan(x)
    with pytest.raises(NoFitError, match="the saved plan needs an estimated") as e:
        auto_parallel(mesh, Constraints(max_memory_per_device="1KiB"), plan=saved)(
            MLP()).make_plan(x)
    assert e.value.smallest_bytes == saved.cost.memory_bytes_per_device
    same = auto_parallel(mesh, Constraints(zero=saved.zero), plan=saved)(MLP()).make_plan(x)
    assert same.to_json() == saved.to_json()


def test_the_nnx_wrapper_reads_and_sets_the_modules_attributes(mesh):
    class Scaled(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(16, 8, rngs=rngs)
            self.temperature = 1.0

        def __call__(self, x):
            return self.fc(x) / self.temperature

    x = np.ones((8, 16), np.float32)
    pm = auto_parallel(mesh)(Scaled(nnx.Rngs(0)))
    first = np.asarray(pm(x))
    assert pm.fc is pm.module.fc and pm.temperature == 1.0
    pm.temperature = 2.0  # on the module, as on the plain one: the next call uses it
    assert pm.module.temperature == 2.0 and "temperature" not in vars(pm)
    np.testing.assert_allclose(np.asarray(pm(x)), first / 2, rtol=1e-6)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        pm.nothing  # noqa: B018
