"""Hand-written expected annotations for the equations of small real programs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from nnscaler_jax.rules.reshape import reshape_anno

NHWC = ("NHWC", "HWIO", "NHWC")


def _one(eqns_of, anno_of, fn, *args, prim):
    found = eqns_of(fn, *args, prim=prim)
    assert found, f"no {prim} in the jaxpr"
    return [str(anno_of(e)).strip() for e in found]


def test_matmul(eqns_of, anno_of) -> None:
    got = _one(eqns_of, anno_of, lambda a, b: a @ b, jnp.ones((4, 8)), jnp.ones((8, 3)),
               prim="dot_general")
    assert got == ["m0 k0+, k0+ n0 -> m0 n0"]


def test_batched_einsum(eqns_of, anno_of) -> None:
    q, k = jnp.ones((2, 5, 3, 4)), jnp.ones((2, 7, 3, 4))
    got = _one(eqns_of, anno_of, lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k), q, k,
               prim="dot_general")
    assert got == ["b0 m0 b1 k0+, b0 n0 b1 k0+ -> b0 b1 m0 n0"]


def test_dot_contracting_elsewhere(eqns_of, anno_of) -> None:
    f = lambda a, b: lax.dot_general(a, b, (((0,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)
    got = _one(eqns_of, anno_of, f, jnp.ones((8, 4), jnp.bfloat16), jnp.ones((3, 8), jnp.bfloat16),
               prim="dot_general")
    assert got == ["k0+ m0, n0 k0+ -> m0 n0"]


def test_conv_nhwc_and_its_gradients(eqns_of, anno_of) -> None:
    f = lambda x, w: lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=NHWC).sum()
    x, w = jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 16))
    got = _one(eqns_of, anno_of, jax.grad(f, argnums=(0, 1)), x, w, prim="conv_general_dilated")
    assert got == [
        "n s0^ s1^ c+, w0^ w1^ c+ o -> n t0^ t1^ o",  # forward
        "c+ s0^ s1^ n, c+ w0^ w1^ o -> t0^ t1^ n o",  # kernel gradient: contracts the batch
        "n s0^ s1^ c+, w0^ w1^ o c+ -> n t0^ t1^ o",  # input gradient
    ]


def test_depthwise_conv_and_its_gradients(eqns_of, anno_of) -> None:
    f = lambda x, w: lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=NHWC, feature_group_count=3).sum()
    x, w = jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 1, 6))
    got = _one(eqns_of, anno_of, jax.grad(f, argnums=(0, 1)), x, w, prim="conv_general_dilated")
    assert got == [
        "n s0^ s1^ g, w0^ w1^ 1 (g o) -> n t0^ t1^ (g o)",
        "c+ s0^ s1^ g, c+ w0^ w1^ (g o) -> t0^ t1^ 1 (g o)",  # batch_group_count = 3
        "n s0^ s1^ (g c+), w0^ w1^ g c+ -> n t0^ t1^ g",
    ]


def test_pointwise_conv_splits_spatially(eqns_of, anno_of) -> None:
    f = lambda x, w: lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=NHWC)
    got = _one(eqns_of, anno_of, f, jnp.ones((2, 8, 8, 3)), jnp.ones((1, 1, 3, 4)),
               prim="conv_general_dilated")
    assert got == ["n s0 s1 c+, 1 1 c+ o -> n s0 s1 o"]


def test_embedding_gather_and_scatter_add(eqns_of, anno_of) -> None:
    ids = jnp.array([[1, 2, 3], [4, 5, 6]])
    f = lambda t: jnp.take(t, ids, axis=0).sum()
    table = jnp.ones((10, 8))
    assert _one(eqns_of, anno_of, f, table, prim="gather") == ["v0^ e1, b0 b1 1 -> b0 b1 e1"]
    # The index batch of scatter-add is frozen: operand + a shard of the updates is no partial sum.
    assert _one(eqns_of, anno_of, jax.grad(f), table, prim="scatter-add") == [
        "v0^ e1, i0^ i1^ 1, u0^ u1^ e1 -> v0^ e1"]


def test_reduce_sum_vs_reduce_max(eqns_of, anno_of) -> None:
    x = jnp.ones((4, 6))
    assert _one(eqns_of, anno_of, lambda x: x.sum(1), x, prim="reduce_sum") == ["d0 d1+ -> d0"]
    assert _one(eqns_of, anno_of, lambda x: x.max(1), x, prim="reduce_max") == ["d0 d1^ -> d0"]
    assert _one(eqns_of, anno_of, lambda x: x.argmax(0), x, prim="argmax") == ["d0^ d1 -> d1"]
    assert _one(eqns_of, anno_of, lambda x: jnp.cumsum(x, 1), x, prim="cumsum") == ["d0 d1^ -> d0 d1^"]


def test_broadcast_in_dim(eqns_of, anno_of) -> None:
    got = _one(eqns_of, anno_of, lambda x: jnp.broadcast_to(x[:, None, :1], (4, 5, 6)),
               jnp.ones((4, 6)), prim="broadcast_in_dim")
    assert got == ["d0 d2 -> d0 d1 d2", "d0 1 1 -> d0 d1 d2"]
    assert _one(eqns_of, anno_of, lambda s: jnp.full((2, 3), s), 1.0,
                prim="broadcast_in_dim") == ["() -> d0 d1"]


def test_transpose(eqns_of, anno_of) -> None:
    got = _one(eqns_of, anno_of, lambda x: x.transpose(2, 0, 1), jnp.ones((2, 3, 4)),
               prim="transpose")
    assert got == ["d0 d1 d2 -> d2 d0 d1"]


def test_elementwise_scalars_and_size1_broadcast(eqns_of, anno_of) -> None:
    got = _one(eqns_of, anno_of, lambda x, y: lax.mul(x, y) * 2.0, jnp.ones((3, 4)),
               jnp.ones((1, 4)), prim="mul")
    assert got == ["d0 d1, 1 d1 -> d0 d1", "d0 d1, () -> d0 d1"]
    assert _one(eqns_of, anno_of, lambda x: lax.clamp(0.0, x, 1.0), jnp.ones((3, 4)),
                prim="clamp") == ["(), d0 d1, () -> d0 d1"]


def test_slicing_padding_concat(eqns_of, anno_of) -> None:
    x = jnp.ones((4, 6))
    assert _one(eqns_of, anno_of, lambda x: x[:, 1:3], x, prim="slice") == ["d0 d1^ -> d0 d2^"]
    assert _one(eqns_of, anno_of, lambda x: jnp.pad(x, ((0, 0), (1, 1))), x, prim="pad") == [
        "d0 d1^, () -> d0 d2^"]
    assert _one(eqns_of, anno_of, lambda x: jnp.concatenate([x, x], 1), x,
                prim="concatenate") == ["d0 d2^, d0 d3^ -> d0 d4^"]
    assert _one(eqns_of, anno_of, lambda x: jnp.flip(x, 1), x, prim="rev") == ["d0 d1^ -> d0 d1^"]
    assert _one(eqns_of, anno_of, lambda: lax.broadcasted_iota(jnp.int32, (4, 6), 1),
                prim="iota") == ["-> d0 d1^"]


@pytest.mark.parametrize(("src", "dst", "want"), [
    ((2, 4, 12), (2, 4, 3, 4), "d0 d1 (d2 d3) -> d0 d1 d2 d3"),      # split heads
    ((2, 4, 3, 4), (2, 4, 12), "d0 d1 d2 d3 -> d0 d1 (d2 d3)"),      # merge heads
    ((6, 4), (2, 12), "(d0 d1) d2 -> d0 (d1 d2)"),                   # mixed
    ((4, 6), (8, 3), "d0 (d1 d2) -> (d0 d1) d2"),                    # mixed
    ((6, 4), (4, 6), "f0^ f1^ -> f2^ f3^"),                          # impossible: frozen
    ((2, 6, 4), (2, 4, 6), "d0 f0^ f1^ -> d0 f2^ f3^"),              # frozen segment only
    ((1, 6), (2, 1, 3), "1 (d0 d1) -> d0 1 d1"),                     # size-1 dims
    ((1, 1), (), "1 1 -> ()"),
    ((), (1, 1), "() -> 1 1"),
])
def test_reshape_factoring(src, dst, want) -> None:
    assert reshape_anno(src, dst) == want


def test_reshape_from_jaxpr(eqns_of, anno_of) -> None:
    got = _one(eqns_of, anno_of, lambda x: x.reshape(2, 4, 2, 4), jnp.ones((2, 4, 8)),
               prim="reshape")
    assert got == ["d0 d1 (d2 d3) -> d0 d1 d2 d3"]
