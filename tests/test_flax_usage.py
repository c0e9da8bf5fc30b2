"""Flax as people call it, through ``auto_parallel``: static flags (``train=True``,
``deterministic=False``, ``method=``, ``capture_intermediates=``, ``mutable=``), nnx mode
switches (``.eval()`` / ``.train()``) and Explicit meshes with the user's own ``jax.jit`` + optax
loss. Every result is checked against the plain module (forward, gradients, updated
``batch_stats``)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from meshes import make_mesh

from nnscaler_jax import PlanError, auto_parallel
from nnscaler_jax.capture.trace import trace

POLICIES = ["dp", "megatron", None]
RTOL, ATOL = 1e-5, 1e-6


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=RTOL, atol=ATOL)


class Net(nn.Module):
    """The Flax ImageNet example's calling convention: ``train`` switches BatchNorm and
    Dropout."""

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(32, name="fc1")(x)
        x = nn.BatchNorm(use_running_average=not train, name="bn")(x)
        x = nn.Dropout(0.5, deterministic=not train)(nn.relu(x))
        return nn.Dense(8, name="fc2")(x)

    def features(self, x, train: bool = False):
        w = self.variables["params"]["fc1"]["kernel"]
        return nn.relu(x @ w) * (2.0 if train else 1.0)


class Encoder(nn.Module):
    """transformers-style: ``deterministic`` keyword, an array attention mask keyword."""

    @nn.compact
    def __call__(self, x, attention_mask=None, deterministic: bool = True):
        h = nn.Dense(32)(x)
        if attention_mask is not None:
            h = h * attention_mask[:, None]
        return nn.Dense(8)(nn.Dropout(0.3)(h, deterministic=deterministic))


def _x(shape=(8, 16)):
    return jax.random.normal(jax.random.key(1), shape)


@pytest.mark.parametrize("policy", POLICIES)
def test_train_flag_with_batch_stats_and_dropout(mesh, policy):
    """``pm.apply(v, x, train=True, mutable=['batch_stats'], rngs=...)``: output, updated
    batch_stats and gradients equal the plain module's; ``train=False`` gets its own program."""
    m, x = Net(), _x()
    pm = auto_parallel(mesh, policy=policy)(m)
    v = pm.init(jax.random.key(0), x, train=False)
    rngs = {"dropout": jax.random.key(7)}
    out, upd = pm.apply(v, x, train=True, mutable=["batch_stats"], rngs=rngs)
    ref, ref_upd = m.apply(v, x, train=True, mutable=["batch_stats"], rngs=rngs)
    _close(out, ref)
    _close(upd, ref_upd)
    assert not np.allclose(upd["batch_stats"]["bn"]["mean"], v["batch_stats"]["bn"]["mean"])

    def loss(apply, params):
        y, _ = apply({"params": params, "batch_stats": v["batch_stats"]}, x, train=True,
                     mutable=["batch_stats"], rngs=rngs)
        return jnp.mean(y ** 2)

    _close(jax.grad(lambda p: loss(pm.apply, p))(v["params"]),
           jax.jit(jax.grad(lambda p: loss(m.apply, p)))(v["params"]))  # (the user's: eager)
    # eval mode: running averages, no dropout; positional flag too
    _close(pm.apply(v, x, train=False), m.apply(v, x, train=False))
    _close(pm.apply(v, x, False), m.apply(v, x, False))


def test_static_flags_select_programs_and_are_reused(mesh, plans):
    m, x = Net(), _x()
    pm = auto_parallel(mesh, policy="dp")(m)
    v = m.init(jax.random.key(0), x, train=False)
    rngs = {"dropout": jax.random.key(7)}
    for _ in range(2):
        pm.apply(v, x, train=False)
        pm.apply(v, x, train=True, mutable=["batch_stats"], rngs=rngs)
    assert len(plans) == 2
    pm.apply(v, x, train=False, method="features")
    pm.apply(v, x, train=True, method="features")
    assert len(plans) == 4
    _close(pm.apply(v, x, train=True, method="features"),
           m.apply(v, x, train=True, method="features"))


def test_deterministic_false_and_array_mask_keyword(mesh):
    m, x = Encoder(), _x()
    mask = (jnp.arange(8) % 3 != 0).astype(jnp.float32)
    pm = auto_parallel(mesh)(m)
    v = pm.init(jax.random.key(0), x, attention_mask=mask)
    rngs = {"dropout": jax.random.key(3)}
    _close(pm.apply(v, x, attention_mask=mask, deterministic=False, rngs=rngs),
           m.apply(v, x, attention_mask=mask, deterministic=False, rngs=rngs))
    _close(pm.apply(v, x, attention_mask=mask), m.apply(v, x, attention_mask=mask))
    assert pm.make_plan(x, variables=v, attention_mask=mask, deterministic=False,
                        rngs=rngs) is pm.plan


def test_capture_intermediates(mesh):
    m, x = Net(), _x()
    pm = auto_parallel(mesh, policy="megatron")(m)
    v = m.init(jax.random.key(0), x, train=False)
    out, inter = pm.apply(v, x, train=False, capture_intermediates=True)
    ref, ref_inter = m.apply(v, x, train=False, capture_intermediates=True)
    _close(out, ref)
    _close(inter, ref_inter)
    assert "fc1" in inter["intermediates"]


def test_init_with_dropout_stream_and_train_flag(mesh):
    """``init`` with a dropout stream and ``train=True``: same variables as ``module.init``."""
    m, x = Net(), _x()
    keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    _close(auto_parallel(mesh)(m).init(keys, x, train=True), m.init(keys, x, train=True))


def test_unhashable_option_is_a_plan_error(mesh):
    m, x = Net(), _x()
    pm = auto_parallel(mesh, policy="dp")(m)
    v = m.init(jax.random.key(0), x, train=False)
    with pytest.raises(PlanError, match=r"kwargs/train.*set.*hashable"):
        pm.apply(v, x, train={1, 2})


def test_trace_with_a_keyword_flag():
    class Switch(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            y = nn.Dense(3)(x)
            return y * 2.0 if train else y

    x = jax.ShapeDtypeStruct((2, 8), jnp.float32)
    on, off = trace(Switch(), x, train=True), trace(Switch(), x)
    assert [op.primitive for op in on.ops].count("mul") == 1
    assert "mul" not in [op.primitive for op in off.ops]


# ---- nnx --------------------------------------------------------------------------------------


class NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.fc1 = nnx.Linear(16, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.fc2 = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x, *, scale: float = 1.0):
        return self.fc2(self.drop(nnx.relu(self.bn(self.fc1(x))))) * scale


def _nnx_pair():
    a = NnxNet(nnx.Rngs(0, dropout=1))
    return a, nnx.clone(a)


@pytest.mark.parametrize("policy", POLICIES)
def test_nnx_eval_and_train_switch(mesh, policy):
    """Called once in training mode, then ``pm.eval()`` / ``model.eval()`` / ``pm.train()``:
    each call matches the plain module in the same mode, batch_stats included."""
    a, b = _nnx_pair()
    x = _x()
    pm = auto_parallel(mesh, policy=policy)(a)
    _close(pm(x), b(x))
    _close(a.bn.mean[...], b.bn.mean[...])
    pm.eval()
    b.eval()
    _close(pm(x), b(x))
    _close(a.bn.mean[...], b.bn.mean[...])
    pm.train()
    b.train()
    _close(pm(x, scale=2.0), b(x, scale=2.0))
    a.eval()  # the wrapped module's own switch
    b.eval()
    _close(pm(x), b(x))
    _close(nnx.state(a, nnx.BatchStat), nnx.state(b, nnx.BatchStat))


def test_nnx_grad_in_train_mode_after_eval(mesh):
    a, b = _nnx_pair()
    x = _x()
    pm = auto_parallel(mesh, policy="dp")(a)
    pm.eval()
    b.eval()
    pm(x)
    b(x)
    pm.train()
    b.train()
    g = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(pm)
    ref = nnx.grad(lambda m: jnp.mean(m(x) ** 2))(b)
    _close(jax.tree.leaves(nnx.state(g, nnx.Param)), jax.tree.leaves(nnx.state(ref, nnx.Param)))


# ---- Explicit meshes ------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_explicit_mesh_user_jit_optax_loss(policy):
    """Inputs placed ``P('data')`` on an Explicit mesh; the user's jitted optax loss on
    ``pm.apply``'s logits traces (batch over data, features replicated) and its value and
    gradients equal the plain module's."""
    import models

    mesh = make_mesh((2, 4), ("data", "model"))  # Explicit axis types (jax.make_mesh default)
    spec = models.get("gpt", "tiny")
    (tokens,) = spec.make_args(8)
    labels = jnp.roll(tokens, 1, axis=1)
    t_sh, l_sh = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (tokens, labels))
    pm = auto_parallel(mesh, policy=policy)(spec.module)
    v = pm.init(jax.random.key(0), t_sh)

    def loss(apply, v, t, lab):
        return optax.softmax_cross_entropy_with_integer_labels(apply(v, t), lab).mean()

    with jax.set_mesh(mesh):
        logits = jax.jit(pm.apply)(v, t_sh)
        assert jax.typeof(logits).sharding.spec == P("data", None, None)
        val, g = jax.jit(jax.value_and_grad(lambda v: loss(pm.apply, v, t_sh, l_sh)))(v)
    v0 = jax.tree.map(np.asarray, v)
    ref, ref_g = jax.jit(jax.value_and_grad(
        lambda v: loss(spec.module.apply, v, tokens, labels)))(v0)
    _close(val, ref)
    _close(g, ref_g)


def test_untyped_inputs_inside_an_explicit_context_mesh():
    """``with jax.set_mesh(mesh):`` around calls with plain (untyped) arrays: the program runs
    as under Explicit types (was a with_sharding_constraint assertion, then a context-mesh
    mismatch on the graph's constants)."""
    import models

    mesh = make_mesh((2, 4), ("data", "model"))
    spec = models.get("gpt", "tiny")
    (tokens,) = spec.make_args(8)
    pm = auto_parallel(mesh)(spec.module)
    v = pm.init(jax.random.key(0), tokens)
    ref = spec.module.apply(jax.tree.map(np.asarray, v), tokens)
    with jax.set_mesh(mesh):
        _close(pm.apply(v, tokens), ref)
        _close(jax.jit(pm.apply)(v, tokens), ref)
