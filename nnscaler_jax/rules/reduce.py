"""Reductions and scans.

- ``reduce_sum``: the reduced axes are ``+`` (splitting them leaves partial sums);
- ``reduce_max/min/prod/and/or/xor``, ``argmax/argmin``, the generic ``reduce``: reduced axes ``^``
  (partial maxima are not sums);
- ``cumsum/cumprod/cummax/cummin/cumlogsumexp``: the scanned axis ``^``, the others free.

>>> import jax
>>> f32 = lambda *s: jax.core.ShapedArray(s, "float32")
>>> reduce_sum({"axes": (1,)}, [f32(4, 6)], [f32(4)])
'd0 d1+ -> d0'
>>> reduce_frozen({"axes": (1,)}, [f32(4, 6)], [f32(4)])
'd0 d1^ -> d0'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nnscaler_jax.rules._build import AnnotationRule, Fresh, anno, operand, shape_of

__all__ = ["cumulative", "reduce_frozen", "reduce_generic", "reduce_sum", "rules"]


def _reduce(axes: Sequence[int], in_avals: Sequence[Any], out_avals: Sequence[Any],
            mark: str) -> str | None:
    shapes = [shape_of(a) for a in in_avals]
    if any(s is None for s in shapes):
        return None
    rank = len(shapes[0])
    axes = {int(a) % rank if rank else int(a) for a in axes}
    ids = Fresh("d").many(rank)
    ins = [f"{n}{mark}" if i in axes else n for i, n in enumerate(ids)]
    outs = [n for i, n in enumerate(ids) if i not in axes]
    return anno([operand(ins)] * len(in_avals), [operand(outs)] * len(out_avals))


def reduce_sum(params: Mapping[str, Any], in_avals: Sequence[Any],
               out_avals: Sequence[Any]) -> str | None:
    """``reduce_sum``: reduced axes are reduction dims ``+``."""
    return _reduce(params["axes"], in_avals, out_avals, "+")


def reduce_frozen(params: Mapping[str, Any], in_avals: Sequence[Any],
                  out_avals: Sequence[Any]) -> str | None:
    """``reduce_max`` and friends, ``argmax/argmin``: reduced axes frozen."""
    return _reduce(params["axes"], in_avals, out_avals, "^")


def reduce_generic(params: Mapping[str, Any], in_avals: Sequence[Any],
                   out_avals: Sequence[Any]) -> str | None:
    """The generic ``reduce`` (operands then as many scalar init values): reduced axes frozen."""
    n = len(out_avals)
    operands, inits = in_avals[:n], in_avals[n:]
    if any(shape_of(a) != () for a in inits) or len({shape_of(a) for a in operands}) != 1:
        return None
    text = _reduce(params["dimensions"], operands, out_avals, "^")
    if text is None:
        return None
    lhs, rhs = text.split(" -> ")
    return anno([lhs] + ["()"] * len(inits), [rhs])


def cumulative(params: Mapping[str, Any], in_avals: Sequence[Any],
               out_avals: Sequence[Any]) -> str | None:
    """``cumsum`` and friends: the scanned ``axis`` frozen."""
    shape = shape_of(in_avals[0])
    if shape is None:
        return None
    axis = int(params["axis"]) % len(shape)
    ids = [f"d{i}^" if i == axis else f"d{i}" for i in range(len(shape))]
    return anno([operand(ids)], [operand(ids)])


def rules() -> dict[str, AnnotationRule]:
    """The reduction rule table."""
    table: dict[str, AnnotationRule] = {"reduce_sum": reduce_sum, "reduce": reduce_generic}
    for name in ("reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                 "reduce_xor", "argmax", "argmin"):
        table[name] = reduce_frozen
    for name in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"):
        table[name] = cumulative
    return table
