"""Relayout helpers shared by the plan walk and the search tables: partial sums dropped, the
gradient a reader hands back, ZeRO-3 storage axes, and the price of one relayout path.

>>> from nnscaler_jax.layout import Layout
>>> partial_grad_axes(Layout.replicated(2), (("data", "b0"), ("model", "k0+")))
('data', 'model')
"""

from __future__ import annotations

import math
from functools import lru_cache

from nnscaler_jax.ir.graph import Tensor
from nnscaler_jax.layout import Layout, comm_path
from nnscaler_jax.layout.rvd import interned
from nnscaler_jax.mesh.topology import MeshSpec
from nnscaler_jax.plan.plan import VALUE

__all__ = ["Split", "add_storage_axis", "drop_partial", "grad_source", "partial_grad_axes",
           "relayout_price"]

Split = tuple[tuple[str, str], ...]


@lru_cache(maxsize=65536)
def drop_partial(lay: Layout) -> Layout:
    """``lay`` without its partial-sum axes (the layout a reduction over them leaves)."""
    return interned(Layout(lay.dims)) if lay.partial else lay


@lru_cache(maxsize=65536)
def partial_grad_axes(want: Layout, split: Split) -> tuple[str, ...]:
    """Axes a consumer splits (by a dim) while reading the operand replicated: its gradient
    comes back as partial sums over them (the operand's data-parallel axes)."""
    used = set(want.split_axes) | set(want.partial)
    return tuple(dict.fromkeys(a for a, d in split if d != VALUE and a not in used))


def grad_source(want: Layout, split: Split) -> Layout:
    """The layout of the gradient a consumer hands back for an operand it read as ``want``."""
    return Layout(want.dims, partial_grad_axes(want, split))


def add_storage_axis(mesh: MeshSpec, v: Tensor, lay: Layout, axis: str) -> Layout:
    """``lay`` with ``axis`` splitting the first dim of ``v`` it divides (ZeRO-3 storage over a
    data-parallel axis), else ``lay``."""
    p = mesh.size(axis)
    for i, n in enumerate(v.shape):
        ways = math.prod(mesh.size(a) for a in lay.dims[i])
        if n % (ways * p) == 0:
            return lay.replace_axis(axis, ("D", i))
    return lay


@lru_cache(maxsize=65536)
def relayout_price(src: Layout, dst: Layout, shape: tuple[int, ...], size: int,
                   mesh: MeshSpec) -> tuple[float, int]:
    """``(seconds, bytes)`` of the cheapest path ``src -> dst``; unreachable: ``(inf, 0)``."""
    try:
        p = comm_path(src, dst, shape, size, mesh)
    except Exception:  # noqa: BLE001 - an unreachable layout is priced as infinitely slow
        return math.inf, 0
    return p.time_s, p.bytes
