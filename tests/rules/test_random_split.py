"""Random bits split like a broadcast from a scalar, so dropout no longer replicates the model.

``random_bits`` from a counter-based key (threefry under ``jax_threefry_partitionable``, the
default) draws bit ``i`` from the key and the counter ``i``: the drawn axes are free (ids in no
input) and GSPMD draws a shard's bits in place. Checked on the annotation (and frozen when the
flag is off, for rbg keys and for the key ops), on the compiled program (no collective), and
through the public API: ``nn.Dropout`` / ``nnx.Dropout`` models planned with ``dp``, ``megatron``
and ``auto`` split the batch (or the heads) through the dropout mask and compute the same
outputs, masks and gradients as the single-device program.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from meshes import make_mesh
from rule_helpers import eqn_anno, walk

import models
from nnscaler_jax import PlanError, auto_parallel
from nnscaler_jax.ir.anno import DimKind
from nnscaler_jax.lower.hlo import hlo_collectives
from nnscaler_jax.lower.verify import max_rel_diff
from nnscaler_jax.primitives import op_assign, op_trans

RTOL = 1e-5
DROPOUT = {"params": jax.random.key(0), "dropout": jax.random.key(1)}


def _annos(fn, *args, prim):
    eqns = [e for e in walk(jax.make_jaxpr(fn)(*args).jaxpr) if e.primitive.name == prim]
    assert eqns, f"no {prim}"
    return [eqn_anno(e) for e in eqns]


def _kinds(operand):
    return [ax.dims[0].kind for ax in operand.axes]


def _bits(key, shape=(4, 6)):
    return jax.random.bits(key, shape)


# ---------------------------------------------------------------------------- the annotation


def test_random_bits_split_like_a_broadcast_from_a_scalar():
    assert jax.config.jax_threefry_partitionable  # jax's default
    (a,) = _annos(_bits, jax.random.key(0), prim="random_bits")
    (key,), (out,) = a.inputs, a.outputs
    assert key.axes == ()  # a scalar key
    assert _kinds(out) == [DimKind.SPATIAL] * 2
    assert sorted(a.splittable()) == sorted(out.names())  # output ids in no input
    assert a.bind([()], [(4, 6)]) == dict(zip(out.names(), (4, 6), strict=True))
    # what the annotation claims: split over the mesh, each device draws its slice of the same
    # bits in place (no collective)
    mesh = make_mesh((2, 4), ("data", "model"))
    k = jax.random.key(5)
    fn = jax.jit(lambda k: _bits(k, (8, 16)), out_shardings=NamedSharding(mesh, P("data", "model")))
    compiled = fn.lower(k).compile()
    assert hlo_collectives(compiled.as_text(), mesh) == []
    np.testing.assert_array_equal(compiled(k), _bits(k, (8, 16)))


@pytest.mark.parametrize("draw", [
    lambda k: jax.random.uniform(k, (4, 6)),
    lambda k: jax.random.bernoulli(k, 0.5, (4, 6)),
    lambda k: jax.random.normal(jax.random.fold_in(k, 3), (4, 6)),
])
def test_distributions_draw_splittable_bits(draw):
    for a in _annos(draw, jax.random.key(0), prim="random_bits"):
        assert len(a.splittable()) == 2


def test_batched_keys_stay_frozen_the_drawn_axes_split():
    keys = jax.random.split(jax.random.key(0), 3)  # nn.scan split_rngs: a (L,) key array
    (a,) = _annos(jax.vmap(lambda k: _bits(k, (6,))), keys, prim="random_bits")
    assert _kinds(a.inputs[0]) == [DimKind.FROZEN]
    assert _kinds(a.outputs[0]) == [DimKind.FROZEN, DimKind.SPATIAL]


def test_frozen_without_partitionable_threefry():
    with jax.threefry_partitionable(False):  # the rule reads the flag when it annotates
        assert not jax.config.jax_threefry_partitionable
        (a,) = _annos(_bits, jax.random.key(0), prim="random_bits")
    assert a.splittable() == []
    assert all(d.kind is DimKind.FROZEN for o in a.operands for ax in o.axes for d in ax.dims)
    (a,) = _annos(_bits, jax.random.key(0), prim="random_bits")  # flag back on
    assert len(a.splittable()) == 2


def test_rbg_keys_frozen_philox_keys_split_either_way():
    (a,) = _annos(_bits, jax.random.key(0, impl="rbg"), prim="random_bits")
    assert a.splittable() == []  # XLA's RngBitGenerator: a shard's bits are not a slice
    for flag in (True, False):
        with jax.threefry_partitionable(flag):
            (a,) = _annos(_bits, jax.random.key(0, impl="philox2x32"), prim="random_bits")
        assert len(a.splittable()) == 2  # philox always hashes each bit's counter


# ---------------------------------------------------------------------------- the public API


@pytest.fixture(scope="module")
def gpt():
    spec = models.get("gpt", "tiny-dropout")
    args = spec.make_args()
    variables = jax.jit(spec.module.init)(DROPOUT, *args)
    return spec, args, variables


def _loss_grad(spec, apply, args, rngs):
    return jax.jit(jax.grad(lambda v: spec.loss_fn(apply(v, *args, rngs=rngs), *args)))


def _batch_split(out):
    spec = tuple(out.sharding.spec)
    return bool(spec) and "data" in str(spec[0])


def _check_same_as_plain(gpt, policy):
    """Plan ``policy``; outputs and gradients equal the plain module's with the same key.

    Returns the wrapper, the mesh, the output, the splits of the ``random_bits`` ops and the
    compiled gradient program's HLO text."""
    spec, args, v = gpt
    mesh = make_mesh((2, 4), ("data", "model"))
    rngs = {"dropout": jax.random.key(2)}
    pm = auto_parallel(mesh, policy=policy)(spec.module)
    out = pm.apply(v, *args, rngs=rngs)
    ref = spec.module.apply(v, *args, rngs=rngs)
    assert max_rel_diff(out, ref)[0] <= RTOL, max_rel_diff(out, ref)
    other = spec.module.apply(v, *args, rngs={"dropout": jax.random.key(3)})
    assert max_rel_diff(other, ref)[0] > 1e-2  # the masks matter: same masks, not luck
    grad_prog = _loss_grad(spec, pm.apply, args, rngs).lower(v).compile()
    diff = max_rel_diff(grad_prog(v), _loss_grad(spec, spec.module.apply, args, rngs)(v))
    assert diff[0] <= RTOL, diff
    drawn = [p.split for p in pm.plan.ops if p.primitive == "random_bits"]
    assert drawn  # the dropout masks are planned ops
    return pm, mesh, out, drawn, grad_prog.as_text()


@pytest.mark.slow
def test_dp_splits_the_batch_through_dropout(gpt):
    _, mesh, out, drawn, grad_hlo = _check_same_as_plain(gpt, "dp")
    assert _batch_split(out), out.sharding
    assert all(split == (("data", "d0"),) for split in drawn), drawn  # masks drawn per shard
    reduced = [c for c in hlo_collectives(grad_hlo, mesh) if c.kind == "all_reduce"]
    assert any("data" in c.axes for c in reduced), reduced  # gradients summed over the batch


@pytest.mark.slow
def test_megatron_splits_the_batch_through_dropout(gpt):
    pm, _, out, drawn, _ = _check_same_as_plain(gpt, "megatron")
    assert _batch_split(out), out.sharding
    assert all("data" in dict(split) for split in drawn), drawn
    assert any("model" in dict(p.split) for p in pm.plan.ops)


@pytest.mark.slow
def test_auto_search_may_split_dropout(gpt):
    pm, _, _, drawn, _ = _check_same_as_plain(gpt, "auto")
    assert any(p.split for p in pm.plan.ops)
    assert any(drawn), drawn  # some mask is drawn split (frozen bits could not be)


class _DropoutMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(8, 32, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.fc2 = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.fc2(self.drop(nnx.relu(self.fc1(x))))


@pytest.mark.slow
def test_nnx_dropout_under_dp_splits_the_batch():
    mesh = make_mesh((2, 4), ("data", "model"))
    net = _DropoutMLP(nnx.Rngs(0, dropout=1))
    ref = nnx.clone(net)  # the same parameters and the same dropout rng state
    x = jax.random.normal(jax.random.key(3), (8, 8))
    pm = auto_parallel(mesh, policy="dp")(net)
    outs = []
    for _ in range(2):  # the rng stream advances alike: the second call's mask matches too
        out, want = pm(x), ref(x)
        assert _batch_split(out), out.sharding
        assert max_rel_diff(out, want)[0] <= RTOL, max_rel_diff(out, want)
        outs.append(np.asarray(out))
    assert not np.allclose(outs[0], outs[1])  # two different masks
    assert all(p.split for p in pm.plan.ops if p.primitive == "random_bits")


@pytest.mark.slow
def test_co_sharded_random_bits_is_a_plan_error():
    """A hand-written plan that co-shards a mask (k chunks per device) is refused with a
    PlanError at lowering: bits drawn on a chunk would not be the chunk of the bits."""

    class Drop(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dropout(0.5, deterministic=False)(nn.Dense(8)(x))

    def policy(graph, mesh):
        for op in graph.ops:
            if op.primitive == "random_bits":
                op_assign(graph, op_trans(graph, op, "d0", 4), "data")  # 2 chunks per device
        return graph.finish()

    mesh = make_mesh((2, 4), ("data", "model"))
    x = jax.numpy.ones((8, 8))
    v = Drop().init(jax.random.key(0), x)
    pm = auto_parallel(mesh, policy=policy)(Drop())
    with pytest.raises(PlanError, match="random_bits"):
        pm.apply(v, x, rngs={"dropout": jax.random.key(1)})
