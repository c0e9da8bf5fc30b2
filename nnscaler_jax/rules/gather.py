"""``gather`` and the ``scatter`` family, from their dimension numbers.

gather (``operand, indices -> out``; the index vector is the last axis of ``indices``):

- an operand axis that is indexed (in ``start_index_map``) is frozen: the vocabulary of an embedding;
- an operand axis taken whole (slice size = axis size, not collapsed) is shared with its output
  offset axis: the embedding width;
- an operand batching axis is shared with its indices batching axis and output batch axis;
- the batch axes of ``indices`` are shared with the output batch axes; the index vector is a fixed
  size; every other axis is frozen.

scatter (``operand, indices, updates -> out``; ``out`` has the operand's shape): the same on the
operand / updates window side. The scatter (index batch) axes of ``indices`` and ``updates`` are
frozen: a shard of the updates combined with the whole operand is not a partial sum of the result
(``operand + sum of both halves`` counts the operand twice), so they cannot be ``+``.

>>> import jax
>>> from jax.lax import GatherDimensionNumbers
>>> f32 = lambda *s: jax.core.ShapedArray(s, "float32")
>>> i32 = lambda *s: jax.core.ShapedArray(s, "int32")
>>> dn = GatherDimensionNumbers(offset_dims=(2,), collapsed_slice_dims=(0,), start_index_map=(0,))
>>> gather({"dimension_numbers": dn, "slice_sizes": (1, 8)}, [f32(10, 8), i32(2, 3, 1)], [f32(2, 3, 8)])
'v0^ e1, b0 b1 1 -> b0 b1 e1'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nnscaler_jax.rules._build import AnnotationRule, anno, operand, shape_of

__all__ = ["gather", "rules", "scatter"]


def gather(params: Mapping[str, Any], in_avals: Sequence[Any],
           out_avals: Sequence[Any]) -> str | None:
    """Annotation of ``gather`` from ``GatherDimensionNumbers`` and ``slice_sizes``."""
    so, si, sout = (shape_of(a) for a in (in_avals[0], in_avals[1], out_avals[0]))
    if so is None or si is None or sout is None or not si:
        return None
    dn = params["dimension_numbers"]
    sizes = params["slice_sizes"]
    op_batch = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batch = tuple(getattr(dn, "start_indices_batching_dims", ()))
    opnd: list[str] = [""] * len(so)
    idx: list[str] = [""] * len(si)
    out: list[str] = [""] * len(sout)
    idx[-1] = str(si[-1])  # index vector
    batch_pos = [i for i in range(len(sout)) if i not in dn.offset_dims]
    idx_dims = list(range(len(si) - 1))
    if len(batch_pos) != len(idx_dims):
        return None
    for p, q in zip(idx_dims, batch_pos, strict=True):
        idx[p] = out[q] = f"b{p}"
    for od, ib in zip(op_batch, idx_batch, strict=True):
        opnd[od] = f"b{ib}"
    offset_src = [d for d in range(len(so))
                  if d not in dn.collapsed_slice_dims and d not in op_batch]
    if len(offset_src) != len(dn.offset_dims):
        return None
    for d, q in zip(offset_src, dn.offset_dims, strict=True):
        if d not in dn.start_index_map and sizes[d] == so[d]:
            opnd[d] = out[q] = f"e{d}"
        else:
            opnd[d], out[q] = f"v{d}^", f"w{d}^"
    for d in range(len(so)):
        if not opnd[d]:
            opnd[d] = f"v{d}^"
    return anno([operand(opnd), operand(idx)], [operand(out)])


def scatter(params: Mapping[str, Any], in_avals: Sequence[Any],
            out_avals: Sequence[Any]) -> str | None:
    """Annotation of ``scatter``, ``scatter-add`` etc. from ``ScatterDimensionNumbers``."""
    if len(in_avals) != 3 or len(out_avals) != 1:
        return None  # variadic scatter
    so, si, su = (shape_of(a) for a in in_avals)
    if so is None or si is None or su is None or not si:
        return None
    dn = params["dimension_numbers"]
    op_batch = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batch = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
    opnd: list[str] = [""] * len(so)
    idx: list[str] = [""] * len(si)
    upd: list[str] = [""] * len(su)
    idx[-1] = str(si[-1])
    scatter_pos = [i for i in range(len(su)) if i not in dn.update_window_dims]
    idx_dims = list(range(len(si) - 1))
    if len(scatter_pos) != len(idx_dims):
        return None
    batch_of = dict(zip(idx_batch, op_batch, strict=True))  # indices dim -> operand dim
    for p, q in zip(idx_dims, scatter_pos, strict=True):
        if p in batch_of:
            idx[p] = upd[q] = opnd[batch_of[p]] = f"b{p}"
        else:
            idx[p], upd[q] = f"i{p}^", f"u{q}^"
    window_src = [d for d in range(len(so))
                  if d not in dn.inserted_window_dims and d not in op_batch]
    if len(window_src) != len(dn.update_window_dims):
        return None
    for d, q in zip(window_src, dn.update_window_dims, strict=True):
        if d not in dn.scatter_dims_to_operand_dims and su[q] == so[d]:
            opnd[d] = upd[q] = f"e{d}"
        else:
            opnd[d], upd[q] = f"v{d}^", f"w{q}^"
    for d in range(len(so)):
        if not opnd[d]:
            opnd[d] = f"v{d}^"
    return anno([operand(opnd), operand(idx), operand(upd)], [operand(opnd)])


def rules() -> dict[str, AnnotationRule]:
    """The gather / scatter rule table."""
    table: dict[str, AnnotationRule] = {"gather": gather}
    for name in ("scatter", "scatter-add", "scatter_add", "scatter-sub", "scatter-mul",
                 "scatter-min", "scatter-max"):
        table[name] = scatter
    return table
