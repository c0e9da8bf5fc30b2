"""Shape ops: broadcast, transpose, squeeze, slicing, padding, concatenation, reversal, iota.

An axis that an op moves data along (sliced, padded, concatenated, reversed) is frozen ``^`` on both
sides; an axis the op leaves alone is one shared identifier.

>>> import jax
>>> f32 = lambda *s: jax.core.ShapedArray(s, "float32")
>>> broadcast_in_dim({"shape": (2, 4, 6), "broadcast_dimensions": (1, 2)}, [f32(4, 1)], [f32(2, 4, 6)])
'd1 1 -> d0 d1 d2'
>>> transpose({"permutation": (1, 0)}, [f32(4, 6)], [f32(6, 4)])
'd0 d1 -> d1 d0'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nnscaler_jax.rules._build import AnnotationRule, Fresh, anno, operand, shape_of

__all__ = ["rules"]

Params = Mapping[str, Any]
Avals = Sequence[Any]


def _shapes(avals: Avals) -> list[tuple[int, ...]] | None:
    shapes = [shape_of(a) for a in avals]
    return None if any(s is None for s in shapes) else shapes  # type: ignore[return-value]


def broadcast_in_dim(params: Params, in_avals: Avals, out_avals: Avals) -> str | None:
    """Operand axis ``i`` is output axis ``broadcast_dimensions[i]``; broadcast size-1 axes ``1``."""
    shapes = _shapes(in_avals[:1] + list(out_avals))
    if shapes is None:
        return None
    si, so = shapes
    ids = Fresh("d").many(len(so))
    lhs = []
    for size, d in zip(si, params["broadcast_dimensions"], strict=True):
        lhs.append(ids[d] if size == so[d] else "1")
    extra = ["?"] * (len(in_avals) - 1)  # dynamic-shape operands, if any
    return anno([operand(lhs)] + extra, [operand(ids)])


def transpose(params: Params, in_avals: Avals, out_avals: Avals) -> str | None:
    """Output axis ``i`` is input axis ``permutation[i]``."""
    perm = params["permutation"]
    ids = [f"d{i}" for i in range(len(perm))]
    return anno([operand(ids)], [operand([ids[p] for p in perm])])


def squeeze(params: Params, in_avals: Avals, out_avals: Avals) -> str | None:
    """Squeezed axes are ``1``."""
    rank = len(shape_of(in_avals[0]) or ())
    dims = {d % rank for d in params["dimensions"]}
    ids = [f"d{i}" for i in range(rank)]
    return anno([operand(["1" if i in dims else n for i, n in enumerate(ids)])],
                [operand([n for i, n in enumerate(ids) if i not in dims])])


def _kept_or_frozen(keep: Sequence[bool], fresh: Fresh) -> tuple[list[str], list[str]]:
    """Per axis: one shared id when kept, else a frozen id on each side."""
    lhs, rhs = [], []
    for k in keep:
        if k:
            name = fresh()
            lhs.append(name)
            rhs.append(name)
        else:
            lhs.append(fresh.frozen())
            rhs.append(fresh.frozen())
    return lhs, rhs


def slice_(params: Params, in_avals: Avals, out_avals: Avals) -> str | None:
    """Axes taken whole (start 0, full limit, stride 1) are shared; the others frozen."""
    shapes = _shapes(in_avals)
    if shapes is None:
        return None
    si = shapes[0]
    strides = params["strides"] or (1,) * len(si)
    keep = [s == 0 and e == n and st == 1
            for s, e, st, n in zip(params["start_indices"], params["limit_indices"], strides, si,
                                   strict=True)]
    lhs, rhs = _kept_or_frozen(keep, Fresh("d"))
    return anno([operand(lhs)], [operand(rhs)])


def dynamic_slice(params: Params, in_avals: Avals, out_avals: Avals) -> str | None:
    """Axes sliced whole are shared; sliced axes frozen; the start indices are scalars ``()``."""
    si = shape_of(in_avals[0])
    if si is None:
        return None
    keep = [n == s for n, s in zip(si, params["slice_sizes"], strict=True)]
    lhs, rhs = _kept_or_frozen(keep, Fresh("d"))
    idx = [operand([]) if shape_of(a) == () else "?" for a in in_avals[1:]]
    return anno([operand(lhs)] + idx, [operand(rhs)])


def dynamic_update_slice(params: Params, in_avals: Avals, out_avals: Avals) -> str | None:
    """Axes the update covers whole are shared by operand, update and output; others frozen."""
    shapes = _shapes(in_avals[:2])
    if shapes is None:
        return None
    so, su = shapes
    fresh = Fresh("d")
    op, up = [], []
    for n, u in zip(so, su, strict=True):
        if n == u:
            name = fresh()
            op.append(name)
            up.append(name)
        else:
            op.append(fresh.frozen())
            up.append(fresh.frozen())
    idx = [operand([]) if shape_of(a) == () else "?" for a in in_avals[2:]]
    return anno([operand(op), operand(up)] + idx, [operand(op)])


def pad(params: Params, in_avals: Avals, out_avals: Avals) -> str | None:
    """Unpadded axes shared, padded axes frozen; the padding value is a scalar ``()``."""
    keep = [tuple(int(x) for x in cfg) == (0, 0, 0) for cfg in params["padding_config"]]
    lhs, rhs = _kept_or_frozen(keep, Fresh("d"))
    return anno([operand(lhs), "()"], [operand(rhs)])


def concatenate(params: Params, in_avals: Avals, out_avals: Avals) -> str | None:
    """Every axis but ``dimension`` shared; the concatenated axis frozen (own id per operand)."""
    so = shape_of(out_avals[0])
    if so is None:
        return None
    dim = int(params["dimension"]) % len(so)
    fresh = Fresh("d")
    ids = fresh.many(len(so))

    def with_frozen() -> str:
        axes = list(ids)
        axes[dim] = fresh.frozen()
        return operand(axes)

    return anno([with_frozen() for _ in in_avals], [with_frozen()])


def split(params: Params, in_avals: Avals, out_avals: Avals) -> str | None:
    """The mirror of ``concatenate``: the split ``axis`` frozen."""
    si = shape_of(in_avals[0])
    if si is None:
        return None
    dim = int(params["axis"]) % len(si)
    fresh = Fresh("d")
    ids = fresh.many(len(si))

    def with_frozen() -> str:
        axes = list(ids)
        axes[dim] = fresh.frozen()
        return operand(axes)

    return anno([with_frozen()], [with_frozen() for _ in out_avals])


def rev(params: Params, in_avals: Avals, out_avals: Avals) -> str | None:
    """Reversed axes frozen (same id on both sides), the others shared."""
    rank = len(shape_of(in_avals[0]) or ())
    dims = {d % rank for d in params["dimensions"]}
    ids = [f"d{i}^" if i in dims else f"d{i}" for i in range(rank)]
    return anno([operand(ids)], [operand(ids)])


def iota(params: Params, in_avals: Avals, out_avals: Avals) -> str | None:
    """No inputs; the counting ``dimension`` frozen, the others free (the values repeat)."""
    so = shape_of(out_avals[0])
    if so is None or in_avals:
        return None
    dim = params["dimension"]
    return " -> " + operand([f"d{i}^" if i == dim else f"d{i}" for i in range(len(so))])


def tile(params: Params, in_avals: Avals, out_avals: Avals) -> str | None:
    """Axes repeated once shared, repeated axes frozen."""
    lhs, rhs = _kept_or_frozen([r == 1 for r in params["reps"]], Fresh("d"))
    return anno([operand(lhs)], [operand(rhs)])


def stack(params: Params, in_avals: Avals, out_avals: Avals) -> str | None:
    """All operands share ids; the new ``axis`` has the fixed size ``len(operands)``."""
    so = shape_of(out_avals[0])
    if so is None:
        return None
    axis = int(params["axis"]) % len(so)
    ids = Fresh("d").many(len(so) - 1)
    out = ids[:axis] + [str(len(in_avals))] + ids[axis:]
    return anno([operand(ids)] * len(in_avals), [operand(out)])


def unstack(params: Params, in_avals: Avals, out_avals: Avals) -> str | None:
    """The mirror of ``stack``."""
    si = shape_of(in_avals[0])
    if si is None:
        return None
    axis = int(params["axis"]) % len(si)
    ids = Fresh("d").many(len(si) - 1)
    inp = ids[:axis] + [str(len(out_avals))] + ids[axis:]
    return anno([operand(inp)], [operand(ids)] * len(out_avals))


def rules() -> dict[str, AnnotationRule]:
    """The shape-op rule table."""
    return {
        "broadcast_in_dim": broadcast_in_dim,
        "transpose": transpose,
        "squeeze": squeeze,
        "slice": slice_,
        "dynamic_slice": dynamic_slice,
        "dynamic_update_slice": dynamic_update_slice,
        "pad": pad,
        "concatenate": concatenate,
        "split": split,
        "rev": rev,
        "iota": iota,
        "tile": tile,
        "stack": stack,
        "unstack": unstack,
    }
