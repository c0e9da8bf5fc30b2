"""`rules/misc.py` on what tests/rules/test_programs.py does not run: FFTs and batched linear
algebra (leading batch axes shared, matrix / transformed axes frozen), top_k's axis, PRNG key ops.
The shared axes are checked numerically: the op on a block of them is that block of the op."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from rule_helpers import eqn_anno, walk

from nnscaler_jax.ir.anno import DimKind, parse_anno

RNG = np.random.default_rng(0)
_A = RNG.standard_normal((4, 4, 4))
SPD = (_A @ np.swapaxes(_A, -1, -2) + 4 * np.eye(4)).astype(np.float32)  # 4 SPD 4x4 matrices


def _annos(fn, *args, prim):
    eqns = [e for e in walk(jax.make_jaxpr(fn)(*args).jaxpr) if e.primitive.name == prim]
    assert eqns, f"no {prim}"
    return [parse_anno(str(eqn_anno(e))) for e in eqns]


def _split_and_frozen(a):
    """Per operand: the kinds of its axes' first dims ('' splittable, '^' frozen)."""
    return [[ax.dims[0].kind.value for ax in o.axes] for o in a.operands]


@pytest.mark.parametrize(("fn", "prim", "n_frozen"), [
    (jnp.fft.fft, "fft", 1),
    (jnp.fft.rfft2, "fft", 2),
    (jnp.fft.ifftn, "fft", 3),
])
def test_fft_freezes_the_transformed_trailing_axes(fn, prim, n_frozen):
    x = RNG.standard_normal((4, 4, 4)).astype(np.float32)
    (a,) = _annos(fn, x, prim=prim)
    for kinds in _split_and_frozen(a):
        assert kinds == [""] * (3 - n_frozen) + ["^"] * n_frozen
    a.bind([(4, 4, 4)], [tuple(np.shape(fn(x)))])


def test_fft_on_a_block_of_the_leading_axis_is_that_block():
    x = RNG.standard_normal((4, 8)).astype(np.float32)
    np.testing.assert_allclose(jnp.fft.fft(x[:2]), jnp.fft.fft(x)[:2], rtol=1e-5, atol=1e-5)
    # and the transformed axis really cannot be split
    assert not np.allclose(jnp.fft.fft(x[:, :4]), jnp.fft.fft(x)[:, :4], atol=1e-3)


@pytest.mark.parametrize(("fn", "prim"), [
    (jnp.linalg.cholesky, "cholesky"),
    (lambda a: jnp.linalg.qr(a)[0], "qr"),
    (lambda a: jax.lax.linalg.lu(a)[0], "lu"),
    (lambda a: jax.scipy.linalg.solve_triangular(a, a, lower=True), "triangular_solve"),
])
def test_batched_linalg_shares_the_batch_axis_only(fn, prim):
    for a in _annos(fn, SPD, prim=prim):
        batch = {o.axes[0].dims[0].name for o in a.operands}
        assert len(batch) == 1  # one identifier: every operand splits with the batch
        for kinds in _split_and_frozen(a):
            assert kinds[0] == "" and all(k == "^" for k in kinds[1:])
    out = fn(SPD)
    np.testing.assert_allclose(fn(SPD[2:]), out[2:], rtol=1e-4, atol=1e-4)


def test_top_k_freezes_the_selected_axis():
    x = RNG.standard_normal((3, 5, 6)).astype(np.float32)
    (a,) = _annos(lambda v: jax.lax.top_k(v, 2), x, prim="top_k")
    assert _split_and_frozen(a) == [["", "", "^"]] * 3
    assert a.bind([(3, 5, 6)], [(3, 5, 2), (3, 5, 2)])["d0"] == 3
    vals, _ = jax.lax.top_k(x, 2)
    np.testing.assert_array_equal(jax.lax.top_k(x[1:], 2)[0], vals[1:])


@pytest.mark.parametrize(("fn", "prim"), [
    (lambda k: jax.random.split(k, 4), "random_split"),
    (lambda k: jax.random.fold_in(k, 7), "random_fold_in"),
    (lambda k: jax.random.key_data(jax.random.split(k, 4)), "random_unwrap"),
    (lambda k: jax.random.bits(jax.random.wrap_key_data(jax.random.key_data(k)), (4, 3)),
     "random_wrap"),
    (lambda k: jax.random.bits(jax.random.key(0, impl="rbg"), (4, 3)), "random_bits"),
    (lambda k: jax.random.bits(jax.random.key(0, impl="unsafe_rbg"), (4, 3)), "random_bits"),
])
def test_key_ops_and_rbg_bits_are_replicate_only(fn, prim):
    """Key ops and rbg bits (XLA's RngBitGenerator) stay frozen; counter-based random_bits split
    (tests/rules/test_random_split.py)."""
    for a in _annos(fn, jax.random.key(0), prim=prim):
        assert a.splittable() == []
        assert all(d.kind is DimKind.FROZEN for o in a.operands for ax in o.axes or ()
                   for d in ax.dims)
