"""Elementwise ops: every axis of the output shared with the inputs.

jax 0.10 lets elementwise operands be rank-0 (weak-typed literals, ``clamp``'s bounds) or have size-1
axes broadcast against the output (``mul f32[3] f32[1]``); those become ``()`` and ``1``.

>>> import jax
>>> f32 = lambda *s: jax.core.ShapedArray(s, "float32")
>>> elementwise({}, [f32(4, 6), f32(1, 6), f32()], [f32(4, 6)])
'd0 d1, 1 d1, () -> d0 d1'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nnscaler_jax.rules._build import AnnotationRule, Fresh, anno, operand, shape_of

__all__ = ["ELEMENTWISE", "bitcast_convert_type", "elementwise", "identity", "rules"]

_UNARY = """
neg sign floor ceil round is_finite exp exp2 log log1p expm1 tanh logistic sin cos tan asin acos
atan sinh cosh asinh acosh atanh sqrt rsqrt cbrt abs not imag real conj integer_pow square
erf erfc erf_inv lgamma digamma bessel_i0e bessel_i1e population_count clz
convert_element_type reduce_precision copy copy_p stop_gradient zeros_like name
"""
_BINARY = """
add sub mul div rem pow max min atan2 nextafter and or xor eq ne lt le gt ge eq_to le_to lt_to
shift_left shift_right_logical shift_right_arithmetic complex mulhi add_any igamma igammac
igamma_grad_a polygamma zeta random_gamma_grad
"""
_NARY = "select_n clamp regularized_incomplete_beta random_gamma"

ELEMENTWISE: frozenset[str] = frozenset((_UNARY + _BINARY + _NARY).split())
"""Names of the primitives annotated by :func:`elementwise`."""


def elementwise(params: Mapping[str, Any], in_avals: Sequence[Any],
                out_avals: Sequence[Any]) -> str | None:
    """Shared identifiers on every axis; rank-0 operands ``()``; broadcast size-1 axes ``1``."""
    out_shape = shape_of(out_avals[0])
    if out_shape is None or any(shape_of(o) != out_shape for o in out_avals):
        return None
    ids = Fresh("d").many(len(out_shape))
    ins = []
    for aval in in_avals:
        shape = shape_of(aval)
        if shape is None:
            return None
        if not shape and out_shape:
            ins.append("()")
            continue
        if len(shape) != len(out_shape):
            return None
        axes = []
        for name, size, full in zip(ids, shape, out_shape, strict=True):
            if size == full:
                axes.append(name)
            elif size == 1:
                axes.append("1")
            else:
                return None
        ins.append(operand(axes))
    return anno(ins, [operand(ids)] * len(out_avals))


def identity(params: Mapping[str, Any], in_avals: Sequence[Any],
             out_avals: Sequence[Any]) -> str | None:
    """Input ``i`` is output ``i`` (``optimization_barrier``, ``device_put``, ``pvary``...)."""
    if len(in_avals) != len(out_avals):
        return None
    fresh = Fresh("d")
    ins, outs = [], []
    for a, b in zip(in_avals, out_avals, strict=True):
        sa, sb = shape_of(a), shape_of(b)
        if sa is None or sa != sb:
            ins.append("?" if sa is None else operand([fresh.frozen() for _ in sa]))
            outs.append("?" if sb is None else operand([fresh.frozen() for _ in sb]))
            continue
        ids = fresh.many(len(sa))
        ins.append(operand(ids))
        outs.append(operand(ids))
    return anno(ins, outs)


def bitcast_convert_type(params: Mapping[str, Any], in_avals: Sequence[Any],
                         out_avals: Sequence[Any]) -> str | None:
    """Same shape: elementwise; a width change adds/removes a trailing fixed-size axis."""
    si, so = shape_of(in_avals[0]), shape_of(out_avals[0])
    if si is None or so is None:
        return None
    if si == so:
        return elementwise(params, in_avals, out_avals)
    n = min(len(si), len(so))
    if si[:n] != so[:n] or abs(len(si) - len(so)) != 1:
        return None
    ids = Fresh("d").many(n)
    return anno([operand(ids + [str(s) for s in si[n:]])], [operand(ids + [str(s) for s in so[n:]])])


def rules() -> dict[str, AnnotationRule]:
    """The elementwise rule table."""
    table: dict[str, AnnotationRule] = dict.fromkeys(ELEMENTWISE, elementwise)
    for name in ("optimization_barrier", "device_put", "pvary", "sharding_constraint",
                 "random_clone", "reshard"):
        table[name] = identity
    table["bitcast_convert_type"] = bitcast_convert_type
    return table
