"""`lower/local.py`: binding one op on local pieces of its operands, with the shape params a
jaxpr spells globally rewritten to the local shapes the annotation implies."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from nnscaler_jax.capture.jaxpr import InputInfo, graph_from_jaxpr
from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.graph import Role
from nnscaler_jax.lower.local import bind_eqn, bind_local, local_out_shapes

RNG = np.random.default_rng(0)


def _op(fn, *args, prim):
    closed = jax.make_jaxpr(fn)(*args)
    g, _ = graph_from_jaxpr(closed, [InputInfo(Role.INPUT)] * len(args))
    (op,) = [op for op in g.ops if op.primitive == prim]
    return op


def _ident(op, operand, axis):
    return op.annotation.operands[operand].axes[axis].dims[0].name


def test_local_out_shapes_divide_split_axes():
    op = _op(lambda a, b: a @ b, jnp.ones((8, 4)), jnp.ones((4, 6)), prim="dot_general")
    m, n = _ident(op, 0, 0), _ident(op, 1, 1)
    assert local_out_shapes(op, {}) == [(8, 6)]
    assert local_out_shapes(op, {m: 2, n: 3}) == [(4, 2)]
    assert local_out_shapes(op, {_ident(op, 0, 1): 4}) == [(8, 6)]  # k: not in the output
    with pytest.raises(PlanError, match="does not split 4 ways"):
        local_out_shapes(op, {n: 4})


def test_bind_eqn_is_the_primitive_on_whole_values():
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    op = _op(jnp.tanh, x, prim="tanh")
    (y,) = bind_eqn(op.eqn, [x])
    np.testing.assert_allclose(y, np.tanh(x), rtol=1e-6)
    # nothing split more than one way: the equation as it is
    for ways in ({}, {_ident(op, 0, 0): 1}):
        (again,) = bind_local(op, [x], ways)
        np.testing.assert_array_equal(again, y)


def test_a_reshape_on_a_row_block_gets_local_new_sizes():
    x = RNG.standard_normal((8, 12)).astype(np.float32)
    op = _op(lambda a: a.reshape(8, 3, 4), x, prim="reshape")
    rows = _ident(op, 0, 0)
    (whole,) = bind_eqn(op.eqn, [x])
    (block,) = bind_local(op, [x[4:]], {rows: 2})  # the second of two row blocks
    assert block.shape == (4, 3, 4)
    np.testing.assert_array_equal(block, whole[4:])


def test_a_broadcast_on_a_block_gets_its_local_shape():
    x = RNG.standard_normal((6,)).astype(np.float32)
    op = _op(lambda a: lax.broadcast_in_dim(a, (6, 5), (0,)), x, prim="broadcast_in_dim")
    (whole,) = bind_eqn(op.eqn, [x])
    (block,) = bind_local(op, [x[:3]], {_ident(op, 0, 0): 2})
    np.testing.assert_array_equal(block, whole[:3])


def test_ops_without_shape_params_bind_on_pieces_unchanged():
    x = RNG.standard_normal((4, 6)).astype(np.float32)
    op = _op(lambda a: a * 2.0, x, prim="mul")
    (block,) = bind_local(op, [x[:, :3], np.float32(2.0)], {_ident(op, 0, 1): 2})
    np.testing.assert_allclose(block, x[:, :3] * 2.0)


@pytest.mark.parametrize(("fn", "prim"), [
    (lambda a: a[:, 1:3], "slice"),
    (lambda a: jnp.concatenate([a, a], 0), "concatenate"),
    (lambda a: lax.scan(lambda c, _: (c * 2.0, None), a, None, length=2)[0], "scan"),
])
def test_ops_whose_params_spell_global_shapes_are_refused_on_pieces(fn, prim):
    x = jnp.ones((4, 6))
    op = _op(fn, x, prim=prim)
    first = _ident(op, 0, 0) if op.annotation.operands[0].axes else "a"
    with pytest.raises(PlanError, match="cannot run on local pieces"):
        bind_local(op, [x[:2]], {first: 2})
    bind_local(op, [x], {first: 1})  # unsplit: fine


def test_a_lookup_of_rows_split_on_their_features_gets_local_slice_sizes():
    """``table[idx]`` with the table split on its features (Swin's relative position bias on
    its heads, an embedding split on its hidden dim): each piece looks up its own features
    (the slice sizes the piece's); split on the rows it indexes, it is refused."""
    table = RNG.standard_normal((10, 16)).astype(np.float32)
    idx = RNG.integers(0, 10, (8, 4)).astype(np.int32)
    op = _op(lambda t, i: t[i], table, idx, prim="gather")
    idx = idx[..., None]  # (as the gather reads them: one index per lookup)
    rows, feats = _ident(op, 0, 0), _ident(op, 0, 1)
    (whole,) = bind_eqn(op.eqn, [table, idx])
    for k in range(4):  # each of 4 feature pieces
        (piece,) = bind_local(op, [table[:, 4 * k:4 * (k + 1)], idx], {feats: 4})
        np.testing.assert_array_equal(piece, whole[..., 4 * k:4 * (k + 1)])
    with pytest.raises(PlanError, match="cannot run on local pieces"):
        bind_local(op, [table[:5], idx], {rows: 2})
