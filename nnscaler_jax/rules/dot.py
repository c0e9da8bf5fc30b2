"""``dot_general``: batch dims shared, contracting dims ``+``, free dims of each side.

The output's axes are the batch dims, then the free dims of the left operand, then those of the
right one (lax's order); ``preferred_element_type`` only changes the dtype.

>>> import jax
>>> f32 = lambda *s: jax.core.ShapedArray(s, "float32")
>>> dn = (((3,), (3,)), ((0, 2), (0, 2)))   # einsum('bqhd,bkhd->bhqk')
>>> dot_general({"dimension_numbers": dn}, [f32(2, 5, 3, 4), f32(2, 7, 3, 4)], [f32(2, 3, 5, 7)])
'b0 m0 b1 k0+, b0 n0 b1 k0+ -> b0 b1 m0 n0'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nnscaler_jax.rules._build import AnnotationRule, anno, operand, shape_of

__all__ = ["dot_general", "rules"]


def dot_general(params: Mapping[str, Any], in_avals: Sequence[Any],
                out_avals: Sequence[Any]) -> str | None:
    """Annotation of ``dot_general`` from its ``dimension_numbers``."""
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    ls, rs = shape_of(in_avals[0]), shape_of(in_avals[1])
    if ls is None or rs is None:
        return None
    lhs: list[str] = [""] * len(ls)
    rhs: list[str] = [""] * len(rs)
    out: list[str] = []
    for i, (a, b) in enumerate(zip(lb, rb, strict=True)):
        lhs[a] = rhs[b] = f"b{i}"
        out.append(f"b{i}")
    for i, (a, b) in enumerate(zip(lc, rc, strict=True)):
        lhs[a] = rhs[b] = f"k{i}+"
    for prefix, axes in (("m", lhs), ("n", rhs)):
        free = [j for j, name in enumerate(axes) if not name]
        for i, j in enumerate(free):
            axes[j] = f"{prefix}{i}"
            out.append(f"{prefix}{i}")
    return anno([operand(lhs), operand(rhs)], [operand(out)])


def rules() -> dict[str, AnnotationRule]:
    """The dot rule table."""
    return {"dot_general": dot_general}
