"""`lower/manual.py` and ``Lowering(manual=True)``: a plan run on each device's blocks inside one
``shard_map`` manual over every axis, its relayouts explicit collectives, equals the plain
program (forward and gradients), and runs inside a ``lax.switch`` branch that other devices do
not take (the tensor-parallel pipeline stage's setting)."""

from __future__ import annotations

import dataclasses
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P
from meshes import make_mesh

import models
from nnscaler_jax import PlanError, auto_parallel, trace
from nnscaler_jax.ir.coshard import coshard_candidates
from nnscaler_jax.layout import Layout
from nnscaler_jax.lower.hlo import hlo_collectives
from nnscaler_jax.lower.manual import relayout
from nnscaler_jax.lower.replay import Lowering
from nnscaler_jax.mesh.axes import auto_view
from nnscaler_jax.primitives import Draft

SIZES = {"data": 2, "model": 4}


@pytest.fixture(scope="module")
def mesh():
    return auto_view(make_mesh((2, 4), ("data", "model")))


_LAYOUTS = [Layout.replicated(2), Layout.of(2, {0: "data"}), Layout.of(2, {1: "model"}),
            Layout.of(2, {0: "data", 1: "model"}), Layout.of(2, {0: ("data", "model")}),
            Layout.of(2, {1: ("model", "data")}), Layout.of(2, {0: "model"}, partial=("data",)),
            Layout.of(2, {}, partial=("data", "model")),
            Layout.of(2, {1: "data"}, partial=("model",))]


def _blocks(x, lay):
    """Each device's block of ``x`` (the partial sums: the value on the devices at index 0 of
    the partial axes, zeros elsewhere), as a ``[2, 4, ...]`` array over (data, model)."""
    out = np.zeros((2, 4) + Layout(lay.dims).local_shape(x.shape, _spec()), x.dtype)
    for d, m in itertools.product(range(2), range(4)):
        at = {"data": d, "model": m}
        idx = []
        for n, axes in zip(x.shape, lay.dims, strict=True):
            k, ways = 0, 1
            for a in axes:
                k, ways = k * SIZES[a] + at[a], ways * SIZES[a]
            idx.append(slice(k * (n // ways), (k + 1) * (n // ways)))
        first = all(at[a] == 0 for a in lay.partial)
        out[d, m] = x[tuple(idx)] if first else 0
    return out


def _spec():
    from nnscaler_jax.mesh.topology import MeshSpec
    return MeshSpec.from_mesh(type("M", (), {"axis_names": ("data", "model"),
                                             "shape": SIZES})())


@pytest.mark.parametrize("src,dst", [(s, d) for s in _LAYOUTS for d in _LAYOUTS
                                     if not d.partial or d.partial == s.partial])
def test_a_relayout_gives_each_device_its_block_and_whole_cotangents(mesh, src, dst):
    x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) / 7.0
    w = np.cos(np.arange(8 * 16, dtype=np.float32)).reshape(8, 16)

    def body(b, wb):
        b, wb = b[0, 0], wb[0, 0]
        y, vjp = jax.vjp(lambda v: relayout(v, src, dst, SIZES), b)
        (g,) = vjp(wb)
        return y[None, None], g[None, None]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("data", "model"),) * 2,
                               out_specs=(P("data", "model"),) * 2, check_vma=False))
    y, g = fn(_blocks(x, src), _blocks(w, Layout(dst.dims)))
    np.testing.assert_allclose(np.asarray(y), _blocks(x, dst), rtol=1e-6)
    # the cotangent of the sum of <y, w> is w, whole in src's layout (partial sums: every
    # summand's cotangent is the sum's)
    np.testing.assert_allclose(np.asarray(g), _blocks(w, Layout(src.dims)), rtol=1e-6)


class Net(nn.Module):
    """remat(fc1) -> fc2 -> relu (a custom_jvp call) -> layer norm -> fc3."""

    @nn.compact
    def __call__(self, x):
        h = nn.remat(nn.Dense)(32, name="fc1")(x)
        h = jax.nn.relu(nn.Dense(16, name="fc2")(jnp.tanh(h)))
        return nn.Dense(8, name="fc3")(nn.LayerNorm(name="ln")(h))


def _manual(pm, variables, *args, outer=None, hlo=None):
    """``pm``'s planned program run by ``Lowering(manual=True)`` in one ``shard_map`` over the
    mesh: ``(loss, grads)`` of the sum of squares of its outputs, and the plain program's
    (``hlo``: a list its compiled text is appended to)."""
    pm.apply(variables, *args)
    prog = pm._last
    graph, flat = prog.captured.graph, prog.captured.traceable.flat_inputs
    low = Lowering(graph, prog.plan, pm.mesh, manual=True)
    mesh = low.mesh
    specs = tuple(low.input_layout(t).to_pspec() for t in graph.inputs)
    nv = sum(t.role.name == "VARIABLE" for t in graph.inputs)

    def loss(*vals):
        outs = low(*vals)
        env = {t.id: o for t, o in zip(graph.outputs, outs, strict=True)}
        whole = [low.read_as(env, t, Layout.replicated(t.ndim)) for t in graph.outputs]
        return sum(jnp.sum(jnp.square(o)) for o in whole if jnp.issubdtype(o.dtype, jnp.inexact))

    def body(*vals):
        return jax.value_and_grad(loss, argnums=tuple(range(nv)))(*vals)

    if outer is None:
        fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(), specs[:nv]),
                           check_vma=False)
    else:  # stage 0 runs the program, stage 1 other collectives over 'model'
        def switched(*vals):
            def other(*vals):  # (XLA:CPU's collective-permute waits for every device)
                return (lax.psum(vals[0].sum(), "model"),
                        tuple(lax.all_gather(v, "model", tiled=True)[:v.shape[0]]
                              for v in vals[:nv]))
            return lax.switch(lax.axis_index("stage"), [body, other], *vals)
        fn = jax.shard_map(switched, mesh=outer, in_specs=specs,
                           out_specs=(P(), specs[:nv]), check_vma=False)
    placed = [jax.device_put(x, jax.sharding.NamedSharding(outer or mesh, s))
              for x, s in zip(flat, specs, strict=True)]
    jitted = jax.jit(fn)
    got = jitted(*placed)
    if hlo is not None:
        hlo.append(jitted.lower(*placed).as_text(dialect="hlo"))

    def plain(*vals):
        outs = jax.tree.leaves(prog.captured.traceable.fn(*vals))
        return sum(jnp.sum(jnp.square(o)) for o in outs if jnp.issubdtype(o.dtype, jnp.inexact))

    ref = jax.jit(jax.value_and_grad(plain, argnums=tuple(range(nv))))(*flat)
    return got, ref


def _check(got, ref, rtol):
    """Loss and gradients within ``rtol`` (small entries: of the largest gradient entry; a
    bias before a layer norm has a gradient of rounding noise)."""
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(ref[0]), rtol=rtol)
    scale = max(float(np.abs(np.asarray(r)).max()) for r in ref[1])
    for g, r in zip(got[1], ref[1], strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=rtol, atol=rtol * scale)


def test_a_megatron_plan_on_blocks_equals_the_plain_program():
    mesh = make_mesh((2, 4), ("data", "model"))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 16)), jnp.float32)
    variables = Net().init(jax.random.key(0), x)
    got, ref = _manual(auto_parallel(mesh, policy="megatron")(Net()), variables, x)
    _check(got, ref, 1e-5)


@pytest.mark.parametrize("name", ["gpt"])  # (T5, Swin: tests/pipeline/test_pipeline_tp_cut.py)
def test_transformer_megatron_plans_on_blocks_equal_the_plain_program(name):
    spec = models.get(name, "tiny", batch_size=4)
    args = spec.make_args()
    variables = spec.init(jax.random.key(0))
    mesh = make_mesh((2, 4), ("data", "model"))
    got, ref = _manual(auto_parallel(mesh, policy="megatron")(spec.module), variables, *args)
    _check(got, ref, 1e-4)


def test_on_blocks_an_elementwise_custom_derivative_runs_on_the_blocks():
    """``jax.nn.relu`` (a ``custom_jvp`` call) on fc2's split output runs on each device's
    block (it ran whole: its input gathered, its output sliced back), and its own derivative
    rule still holds where ``max``'s would not (rows of zeros: fc2's pre-activations exactly
    0, where relu's gradient is 0 and ``max(x, 0)``'s 1/2)."""
    mesh = make_mesh((2, 4), ("data", "model"))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 16)), jnp.float32)
    x = x.at[::2].set(0.0)
    variables = Net().init(jax.random.key(0), x)
    hlo: list[str] = []
    got, ref = _manual(auto_parallel(mesh, policy="megatron")(Net()), variables, x, hlo=hlo)
    _check(got, ref, 1e-5)
    # as lowered (XLA drops a gather whose result is sliced back, not in every program): the
    # one all-gather is the harness's loss reading the outputs whole (over 'data'); relu run
    # whole added its input's gather and its cotangent's
    kinds = [k.kind for k in hlo_collectives(hlo[0], auto_view(mesh))]
    assert kinds.count("all_gather") == 1 and "all_reduce" in kinds, kinds


def test_on_blocks_a_plan_runs_in_one_stages_branch():
    """The plan's collectives (over 'model' only) in one ``lax.switch`` branch, another
    branch's on the other stage: no device waits for one that never reaches them."""
    sub = auto_view(make_mesh((1, 4), ("stage", "model")))
    outer = auto_view(make_mesh((2, 4), ("stage", "model")))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(8, 16)), jnp.float32)
    variables = Net().init(jax.random.key(1), x)
    got, ref = _manual(auto_parallel(sub, policy="megatron")(Net()), variables, x, outer=outer)
    _check(got, ref, 1e-5)


def test_on_blocks_a_co_sharded_op_is_refused_before_it_runs(mesh):
    """An op co-sharded alone is a ``shard_map`` region of its own: refused when the
    lowering is made, naming the op and the fix (co-sharded blocks run:
    tests/pipeline/test_stage_search.py)."""
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    graph = trace(Net(), x)
    d = Draft(graph, dict(SIZES))
    d.decide(graph.op("fc2"), {"data": "m0", "model": "n0"}, chunks=("m0", 2))
    with pytest.raises(PlanError, match=r"'dot_general' at 'fc2' is co-sharded.*per-stage"):
        Lowering(graph, d.finish(), mesh, manual=True)


class Scaled(nn.Module):
    """A learnable scalar times a column-parallel activation (CLIP's logit scale)."""

    @nn.compact
    def __call__(self, x):
        s = self.param("s", lambda k: jnp.asarray(1.5, jnp.float32))
        return nn.Dense(8, name="fc2")(jnp.tanh(nn.Dense(32, name="fc1")(x)) * s)


def test_on_blocks_a_scalar_read_by_a_split_op_gets_its_whole_gradient():
    """Each device's op makes a part of the scalar's cotangent: summed over the axes the op
    splits (it was one device's share, 0.10 of the gradient)."""
    mesh = make_mesh((2, 4), ("data", "model"))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 16)), jnp.float32)
    got, ref = _manual(auto_parallel(mesh, policy="megatron")(Scaled()),
                       Scaled().init(jax.random.key(0), x), x)
    _check(got, ref, 1e-5)


class Attend(nn.Module):
    """Its input read by a column-parallel matmul first, then by the residual add."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(64, name="fc1", use_bias=False)(x)
        p = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", h, h), axis=-1)
        return x + nn.Dense(16, name="fc2", use_bias=False)(jnp.einsum("bqk,bkd->bqd", p, h))


class TwoAttends(nn.Module):
    @nn.compact
    def __call__(self, x):
        return Attend(name="blk_1")(Attend(name="blk_0")(x))


def test_on_blocks_a_co_sharded_blocks_readers_sum_their_own_gradients():
    """A co-sharded block's input read by a split matmul and by a residual add: each reader's
    cotangent is summed over the axes it splits, not the first reader's (the residual's was
    summed over 'model' too: blk_0's gradients 1.6x)."""
    mesh = make_mesh((2, 4), ("data", "model"))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(4, 8, 16)), jnp.float32)
    variables = TwoAttends().init(jax.random.key(1), x)
    pm = auto_parallel(mesh, policy="megatron")(TwoAttends())
    pm.apply(variables, x)
    prog = pm._last
    (c,) = [c for c in coshard_candidates(prog.captured.graph) if c.layer == "blk_1"]
    prog.plan = dataclasses.replace(prog.plan, coshard=((c.seed, c.dim, 2),))
    pm.apply = lambda *a, **k: None  # (the planned program as changed above)
    got, ref = _manual(pm, variables, x)
    _check(got, ref, 1e-5)
