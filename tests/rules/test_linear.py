"""`rules/linear.py`: the primitives a value-split chain may run through are really linear in the
inputs the table says, checked numerically on partial sums (numpy-sized arrays, eager jax)."""

from __future__ import annotations

import numpy as np
import pytest
from jax import lax

from nnscaler_jax.rules import has_rule
from nnscaler_jax.rules.linear import VALUE_SPLIT_LINEAR

RNG = np.random.default_rng(0)


def _x(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


# primitive -> (function of its operands, example operands)
CASES = {
    "add": (lax.add, (_x(3, 4), _x(3, 4))),
    "sub": (lax.sub, (_x(3, 4), _x(3, 4))),
    "add_any": (lax.add, (_x(3, 4), _x(3, 4))),
    "neg": (lax.neg, (_x(3, 4),)),
    "convert_element_type": (lambda a: lax.convert_element_type(a, np.float16), (_x(3, 4),)),
    "reshape": (lambda a: lax.reshape(a, (4, 3)), (_x(3, 4),)),
    "transpose": (lambda a: lax.transpose(a, (1, 0)), (_x(3, 4),)),
    "broadcast_in_dim": (lambda a: lax.broadcast_in_dim(a, (2, 3, 4), (1, 2)), (_x(3, 4),)),
    "reduce_sum": (lambda a: lax.reduce_sum(a, (1,)), (_x(3, 4),)),
    "copy": (lambda a: lax.copy_p.bind(a), (_x(3, 4),)),
    "copy_p": (lambda a: lax.copy_p.bind(a), (_x(3, 4),)),
    "squeeze": (lambda a: lax.squeeze(a, (0,)), (_x(1, 4),)),
    "expand_dims": (lambda a: lax.expand_dims(a, (0,)), (_x(3, 4),)),
    "mul": (lax.mul, (_x(3, 4), _x(3, 4))),
    "dot_general": (lambda a, b: lax.dot_general(a, b, (((1,), (0,)), ((), ()))),
                    (_x(3, 4), _x(4, 5))),
    "div": (lax.div, (_x(3, 4), _x(3, 4) + 3.0)),
}


def _close(a, b, tol=1e-4):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                               rtol=tol, atol=tol)


def test_every_entry_is_a_known_mode_with_a_rule_and_a_numeric_case():
    assert set(VALUE_SPLIT_LINEAR.values()) <= {"all", "one", "first"}
    assert set(CASES) == set(VALUE_SPLIT_LINEAR)
    # every entry the capture can meet has an annotation rule ("expand_dims" is no jax
    # primitive: lax.expand_dims binds broadcast_in_dim, so that entry is never looked up)
    for name in set(VALUE_SPLIT_LINEAR) - {"expand_dims"}:
        assert has_rule(name), name


@pytest.mark.parametrize("name", sorted(VALUE_SPLIT_LINEAR))
def test_partial_sums_in_give_partial_sums_out(name):
    """f(ins split into two partial sums per the mode) == sum of f over the two pieces."""
    fn, args = CASES[name]
    mode = VALUE_SPLIT_LINEAR[name]
    parts = [(_x(*a.shape), None) for a in args]
    parts = [(p, a - p) for (p, _), a in zip(parts, args)]
    whole = fn(*args)
    tol = 1e-2 if name == "convert_element_type" else 1e-4  # to float16: its rounding
    if mode == "all":  # every input partial on the same axis
        _close(whole, fn(*(p for p, _ in parts)) + fn(*(q for _, q in parts)), tol)
    else:
        positions = range(len(args)) if mode == "one" else [0]
        for i in positions:  # one input partial, the others whole (replicated)
            lo = [parts[i][0] if j == i else a for j, a in enumerate(args)]
            hi = [parts[i][1] if j == i else a for j, a in enumerate(args)]
            _close(whole, fn(*lo) + fn(*hi), tol)


@pytest.mark.parametrize(("name", "fn", "args"), [
    ("mul", lax.mul, (_x(3, 4), _x(3, 4))),
    ("dot_general", lambda a, b: a @ b, (_x(3, 4), _x(4, 5))),
])
def test_bilinear_ops_are_not_linear_in_both_at_once(name, fn, args):
    """Why ``one`` and not ``all``: (a1 + a2)(b1 + b2) != a1 b1 + a2 b2."""
    assert VALUE_SPLIT_LINEAR[name] == "one"
    (a, b), (a1, b1) = args, (_x(*args[0].shape), _x(*args[1].shape))
    with pytest.raises(AssertionError):
        _close(fn(a, b), fn(a1, b1) + fn(a - a1, b - b1))


def test_div_is_linear_in_the_numerator_only():
    a, b, b1 = _x(3, 4), _x(3, 4) + 3.0, _x(3, 4) + 3.0
    with pytest.raises(AssertionError):
        _close(lax.div(a, b), lax.div(a, b1) + lax.div(a, b - b1))


@pytest.mark.parametrize("name", ["exp", "tanh", "max", "reduce_max", "integer_pow", "log"])
def test_nonlinear_ops_are_not_listed(name):
    assert name not in VALUE_SPLIT_LINEAR
