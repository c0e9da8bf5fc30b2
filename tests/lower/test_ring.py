"""Ring and zigzag attention against single-device attention: forward and gradients, float32."""

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec
from meshes import make_mesh

from nnscaler_jax.lower import ring
from nnscaler_jax.lower.ring import ring_attention, ring_cost, zigzag_permute, zigzag_unpermute

RTOL, ATOL = 1e-5, 1e-6  # float32, fixed
B, S, H, D = 2, 64, 4, 8


def reference(q, k, v, causal):
    """softmax(q k^T / sqrt(d) + causal mask) v on one device; kv heads repeated for GQA."""
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((q.shape[1],) * 2, bool)), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def inputs(kv_heads=H):
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(kq, (B, S, H, D)), jax.random.normal(kk, (B, S, kv_heads, D)),
            jax.random.normal(kv, (B, S, kv_heads, D)))


def loss(f):
    """A scalar whose gradient weighs every output position differently."""
    w = jnp.sin(jnp.arange(B * S * H * D, dtype=jnp.float32)).reshape(B, S, H, D)
    return lambda q, k, v: (f(q, k, v) * w).sum()


def mesh_1d():
    return make_mesh((8,), ("seq",), axis_types=(AxisType.Auto,))


def mesh_2d():
    return make_mesh((2, 4), ("data", "seq"), axis_types=(AxisType.Auto,) * 2)


def placed(mesh, xs):
    """Batch split over ``data`` when the mesh has it (the plan's data parallelism)."""
    spec = PartitionSpec("data") if "data" in mesh.axis_names else PartitionSpec()
    return tuple(jax.device_put(x, NamedSharding(mesh, spec)) for x in xs)


def check(mesh, causal, layout, kv_heads=H, grad="ring"):
    one = inputs(kv_heads)
    xs = placed(mesh, one)
    f = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, axis="seq", causal=causal,
                                       layout=layout, grad=grad)
    r = lambda q, k, v: reference(q, k, v, causal)
    np.testing.assert_allclose(jax.jit(f)(*xs), jax.jit(r)(*one), rtol=RTOL, atol=ATOL)
    got = jax.jit(jax.grad(loss(f), (0, 1, 2)))(*xs)
    want = jax.jit(jax.grad(loss(r), (0, 1, 2)))(*one)
    for name, a, b in zip("qkv", got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=f"d{name}")


@pytest.mark.parametrize("layout", ["ring", "zigzag"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("make", [mesh_1d, mesh_2d], ids=["seq8", "data2xseq4"])
def test_equals_one_device(make, causal, layout):
    check(make(), causal, layout)


@pytest.mark.parametrize("layout", ["ring", "zigzag"])
def test_grouped_query(layout):
    check(mesh_2d(), True, layout, kv_heads=2)


def test_autodiff_gradients_equal_one_device():
    check(mesh_1d(), True, "zigzag", kv_heads=2, grad="autodiff")


def test_ring_vjp_equals_autodiff():
    mesh = mesh_2d()
    xs = placed(mesh, inputs(2))
    grads = [jax.jit(jax.grad(loss(lambda q, k, v, g=g: ring_attention(
        q, k, v, mesh=mesh, axis="seq", layout="zigzag", grad=g)), (0, 1, 2)))(*xs)
        for g in ("ring", "autodiff")]
    for a, b in zip(*grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("layout", ["ring", "zigzag"])
def test_wrong_rotation_direction_is_caught(monkeypatch, layout):
    """Blocks sent to j - 1 while the step assumes j + 1: causal masks land on the wrong blocks.
    (Non-causal attention visits every block either way, so only causal can tell.)"""
    monkeypatch.setattr(ring, "_ring_perm", lambda n: [(j, (j - 1) % n) for j in range(n)])
    mesh = mesh_1d()
    xs = inputs()
    got = ring_attention(*xs, mesh=mesh, axis="seq", causal=True, layout=layout)
    assert not np.allclose(got, reference(*xs, True), rtol=RTOL, atol=ATOL)


def test_zigzag_permute_places_chunks():
    n, x = 4, jnp.arange(2 * 4 * 3)
    y = zigzag_permute(x, n, 0).reshape(n, 2, 3)  # device i's two chunks
    for i in range(n):
        assert y[i, 0].tolist() == list(range(3 * i, 3 * i + 3))
        j = 2 * n - 1 - i
        assert y[i, 1].tolist() == list(range(3 * j, 3 * j + 3))
    x = jnp.arange(2 * 16 * 3).reshape(2, 16, 3)
    np.testing.assert_array_equal(zigzag_unpermute(zigzag_permute(x, 4, 1), 4, 1), x)


def _ppermuted_operands(jaxpr) -> int:
    """Operands sent by ppermute in a jaxpr, loops counted by their trip count."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ppermute":
            total += len(eqn.invars)
        times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        kinds = (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)
        subs = [p for p in eqn.params.values() if isinstance(p, kinds)]
        subs += [b for p in eqn.params.values() if isinstance(p, tuple) for b in p
                 if isinstance(b, kinds)]
        for sub in subs:
            total += times * _ppermuted_operands(getattr(sub, "jaxpr", sub))
    return total


@pytest.mark.parametrize("layout", ["ring", "zigzag"])
def test_cost_counts_the_program_ppermutes(layout):
    """ring_cost's ppermutes are the ones the forward traces: K and V each n - 1 times, and
    zigzag's exchanges into and out of its order."""
    mesh, n = mesh_1d(), 8
    jaxpr = jax.make_jaxpr(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, axis="seq",
                                                          layout=layout))(*inputs())
    cost = ring_cost(S, H, D, B, n, 4, True, layout=layout)
    assert cost["ppermutes"] == 2 * (n - 1)
    assert _ppermuted_operands(jaxpr.jaxpr) == cost["ppermutes"] + cost["exchanges"]
    assert cost["exchanges"] == (8 if layout == "zigzag" else 0)  # q, k, v in, out back: 2 each


def test_cost_closed_form():
    b, s, h, d, n = 2, 4096, 32, 128, 8
    full = 4 * b * h * d * s * s // n
    assert ring_cost(s, h, d, b, n, 2, causal=False) == {
        "flops": full, "bytes_per_ppermute": b * (s // n) * h * d * 2, "ppermutes": 2 * (n - 1),
        "exchanges": 0}
    assert ring_cost(s, h, d, b, n, 2, causal=True)["flops"] == full  # the last device's n blocks
    zigzag = ring_cost(s, h, d, b, n, 2, causal=True, layout="zigzag")["flops"]
    assert zigzag * 4 * n == full * (2 * n + 1)  # 2n + 1 pairs of (s / 2n)^2: about half
    assert ring_cost(s, h, d, b, n, 2, False, kv_heads=8)["bytes_per_ppermute"] == \
        b * (s // n) * 8 * d * 2


def test_errors_name_the_problem():
    mesh = mesh_1d()
    q, k, v = inputs()
    with pytest.raises(ValueError, match="layout='spiral'"):
        ring_attention(q, k, v, mesh=mesh, axis="seq", layout="spiral")
    with pytest.raises(ValueError, match="'model' is not a mesh axis"):
        ring_attention(q, k, v, mesh=mesh, axis="model")
    with pytest.raises(ValueError, match="does not divide into 16 chunks"):
        ring_attention(q[:, :40], k[:, :40], v[:, :40], mesh=mesh, axis="seq", layout="zigzag")
    with pytest.raises(ValueError, match="kv heads dividing"):
        ring_attention(q, k[:, :, :3], v[:, :, :3], mesh=mesh, axis="seq")


def test_compiled_step_never_gathers():
    """On (data 2, seq 4) the forward + backward only permutes K / V blocks (and their
    gradients) of [batch / 2, seq / 4] between neighbours: no all-gather, batch stays split."""
    mesh = mesh_2d()
    sharding = NamedSharding(mesh, PartitionSpec("data", "seq"))
    x = jax.ShapeDtypeStruct((B, S, H, D), jnp.float32, sharding=sharding)
    f = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, axis="seq").sum()
    hlo = jax.jit(jax.grad(f, (0, 1, 2)), out_shardings=(sharding,) * 3).lower(x, x, x) \
        .compile().as_text()
    assert "all-gather" not in hlo and "all-to-all" not in hlo
    permutes = re.findall(r"= f32\[([\d,]+)\][^=]*collective-permute(?:-start)?\(", hlo)
    assert permutes and set(permutes) == {f"{B // 2},{S // 4},{H},{D}"}


def test_under_an_explicit_mesh_context():
    """Under ``jax.set_mesh`` of an Explicit mesh, with batch typed as split over data: same
    numbers, and the output keeps q's typed sharding."""
    mesh = make_mesh((2, 4), ("data", "seq"), axis_types=(AxisType.Explicit,) * 2)
    one = inputs(2)
    xs = tuple(jax.device_put(x, NamedSharding(mesh, PartitionSpec("data"))) for x in one)
    f = lambda q, k, v: ring_attention(q, k, v, mesh=mesh, axis="seq", layout="zigzag")
    with jax.set_mesh(mesh):
        out = jax.jit(f)(*xs)
        got = jax.jit(jax.grad(loss(f), (0, 1, 2)))(*xs)
    assert tuple(jax.typeof(out).sharding.spec) == ("data", None, None, None)
    np.testing.assert_allclose(out, jax.jit(lambda *a: reference(*a, True))(*one),
                               rtol=RTOL, atol=ATOL)
    want = jax.jit(jax.grad(loss(lambda *a: reference(*a, True)), (0, 1, 2)))(*one)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def test_flash_kernel_pairs_compute_the_ring():
    """Each chunk pair through Pallas' flash kernels (interpret mode: no GPU here; 128-row
    chunks, grouped-query heads), a causal ring of 2 (full, diagonal and skipped pairs):
    forward and gradients equal single-device attention."""
    mesh = jax.make_mesh((2,), ("seq",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (1, 256, 4, 16))
    k, v = (jax.random.normal(x, (1, 256, 2, 16)) for x in keys[1:])
    body = functools.partial(ring.ring_attention_local, axis="seq", n=2, causal=True,
                             kernel=True, interpret=True)
    spec = PartitionSpec(None, "seq")
    f = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
    np.testing.assert_allclose(f(q, k, v), reference(q, k, v, True), rtol=RTOL, atol=1e-5)
    w = jnp.sin(jnp.arange(q.size, dtype=jnp.float32)).reshape(q.shape)
    for a, b in zip(jax.grad(lambda *x: (f(*x) * w).sum(), (0, 1, 2))(q, k, v),
                    jax.grad(lambda *x: (reference(*x, True) * w).sum(), (0, 1, 2))(q, k, v),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-5)
