"""``reshape``: factor the input and output shapes into common row-major atoms.

Size-1 axes are written ``1``. The remaining axes are cut into *segments* where the cumulative
products of both shapes meet; inside a segment the union of the cumulative products, when each
divides the next, defines atoms, and every axis is written as the group of its atoms
(``(B, S, H*D) -> (B, S, H, D)`` is ``d0 d1 (d2 d3) -> d0 d1 d2 d3``; ``(6, 4) -> (2, 12)`` is
``(d0 d1) d2 -> d0 (d1 d2)``). A segment without such atoms (``(6, 4) -> (4, 6)``) is frozen.

>>> reshape_anno((2, 3, 8), (2, 3, 2, 4))
'd0 d1 (d2 d3) -> d0 d1 d2 d3'
>>> reshape_anno((6, 4), (4, 6))
'f0^ f1^ -> f2^ f3^'
>>> reshape_anno((1, 6), (2, 1, 3))
'1 (d0 d1) -> d0 1 d1'
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from nnscaler_jax.rules._build import AnnotationRule, Fresh, anno, group, operand, shape_of

__all__ = ["reshape", "reshape_anno", "rules"]


def _cumprods(sizes: Sequence[int]) -> list[int]:
    out, p = [], 1
    for s in sizes:
        p *= s
        out.append(p)
    return out


def _segments(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Split two equal-product lists of sizes > 1 into minimal equal-product runs (by index)."""
    segs: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a):
        ia, jb = [i], [j]
        pa, pb = a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                pa *= a[i]
                ia.append(i)
                i += 1
            else:
                pb *= b[j]
                jb.append(j)
                j += 1
        segs.append((ia, jb))
    return segs


def _atoms(a: Sequence[int], b: Sequence[int]) -> tuple[list[list[int]], list[list[int]]] | None:
    """Atom sizes common to both factorisations: per axis of ``a`` / ``b``, its atom indices."""
    bounds = sorted(set(_cumprods(a)) | set(_cumprods(b)))
    prev = 1
    for x in bounds:
        if x % prev:
            return None
        prev = x
    index = {x: k for k, x in enumerate(bounds)}  # atom k ends at bounds[k]

    def axes(sizes: Sequence[int]) -> list[list[int]]:
        out, start = [], 0
        for end in _cumprods(sizes):
            out.append(list(range(start, index[end] + 1)))
            start = index[end] + 1
        return out

    return axes(a), axes(b)


def reshape_anno(in_shape: Sequence[int], out_shape: Sequence[int]) -> str:
    """The annotation of a row-major reshape ``in_shape -> out_shape``."""
    if math.prod(in_shape) != math.prod(out_shape) or 0 in in_shape:
        fresh = Fresh("f")
        return anno([operand([fresh.frozen() for _ in in_shape])],
                    [operand([fresh.frozen() for _ in out_shape])])
    ia = [i for i, s in enumerate(in_shape) if s != 1]
    ib = [j for j, s in enumerate(out_shape) if s != 1]
    lhs = ["1"] * len(in_shape)
    rhs = ["1"] * len(out_shape)
    names, frozen = Fresh("d"), Fresh("f")
    a = [in_shape[i] for i in ia]
    b = [out_shape[j] for j in ib]
    for seg_a, seg_b in _segments(a, b) if a else []:
        sa = [a[k] for k in seg_a]
        sb = [b[k] for k in seg_b]
        atoms = _atoms(sa, sb)
        if atoms is None:
            for k in seg_a:
                lhs[ia[k]] = frozen.frozen()
            for k in seg_b:
                rhs[ib[k]] = frozen.frozen()
            continue
        ids = names.many(1 + max(max(x) for x in atoms[0]))
        for k, atom_idx in zip(seg_a, atoms[0], strict=True):
            lhs[ia[k]] = group([ids[t] for t in atom_idx])
        for k, atom_idx in zip(seg_b, atoms[1], strict=True):
            rhs[ib[k]] = group([ids[t] for t in atom_idx])
    return anno([operand(lhs)], [operand(rhs)])


def reshape(params: Mapping[str, Any], in_avals: Sequence[Any],
            out_avals: Sequence[Any]) -> str | None:
    """``reshape`` (row-major; a ``dimensions`` permutation is planned replicated)."""
    si, so = shape_of(in_avals[0]), shape_of(out_avals[0])
    if si is None or so is None or params.get("dimensions") is not None:
        return None
    text = reshape_anno(si, so)
    extra = len(in_avals) - 1  # dynamic-shape operands, if any
    if extra:
        lhs, rhs = text.split(" -> ")
        text = anno([lhs] + ["?"] * extra, [rhs])
    return text


def rules() -> dict[str, AnnotationRule]:
    """The reshape rule table."""
    return {"reshape": reshape}
