"""Relayout helpers shared by the plan walk and the search tables: partial sums dropped, the
gradient a reader hands back, ZeRO-3 storage axes, and the price of one relayout path.

>>> from nnscaler_jax.layout import Layout
>>> partial_grad_axes(Layout.replicated(2), (("data", "b0"), ("model", "k0+")))
('data', 'model')
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.graph import Tensor
from nnscaler_jax.layout import Layout, comm_path
from nnscaler_jax.layout.rvd import interned
from nnscaler_jax.mesh.topology import MeshSpec
from nnscaler_jax.plan.layouts import partial_grad_axes
from nnscaler_jax.plan.zero import zero3_layout

__all__ = ["Split", "drop_partial", "grad_source", "partial_grad_axes", "reduced_layout",
           "relayout_parts", "relayout_price", "storage_layout"]

Split = tuple[tuple[str, str], ...]


@lru_cache(maxsize=65536)
def drop_partial(lay: Layout) -> Layout:
    """``lay`` without its partial-sum axes (the layout a reduction over them leaves)."""
    return interned(Layout(lay.dims)) if lay.partial else lay


@lru_cache(maxsize=65536)
@lru_cache(maxsize=65536)
def grad_source(want: Layout, split: Split) -> Layout:
    """The layout of the gradient a consumer hands back for an operand it read as ``want``
    (memoised: the whole-plan pricing asks for it per edge and per gradient, every probe)."""
    return Layout(want.dims, partial_grad_axes(want, split))


@lru_cache(maxsize=64)
def _sizes(mesh: MeshSpec) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))


def storage_layout(mesh: MeshSpec, v: Tensor, lay: Layout, axes: Sequence[str]) -> Layout:
    """How a plan whose storage was not sharded is priced under ZeRO-3: variable ``v`` kept as
    ``lay``, its data-parallel ``axes`` (those its readers split, ``lay`` not) added one at a
    time (:func:`~nnscaler_jax.plan.zero.zero3_layout`, ``joint=False``)."""
    return zero3_layout(v.shape, lay, axes, _sizes(mesh), joint=False)


def relayout_price(src: Layout, dst: Layout, shape: tuple[int, ...], size: int,
                   mesh: MeshSpec) -> tuple[float, int]:
    """``(seconds, bytes)`` of the cheapest path ``src -> dst``; unreachable: ``(inf, 0)``
    (:func:`relayout_parts`' first two, from its cache)."""
    return relayout_parts(src, dst, shape, size, mesh)[:2]


@lru_cache(maxsize=65536)
def relayout_parts(src: Layout, dst: Layout, shape: tuple[int, ...], size: int,
                   mesh: MeshSpec) -> tuple[float, int, tuple[tuple[str, int], ...]]:
    """:func:`relayout_price` with its bytes by collective kind (``(kind, bytes)``; the local
    steps, slices and value chunks, left out), from one path; unreachable: ``(inf, 0, ())``."""
    try:
        p = comm_path(src, dst, shape, size, mesh)
    except Exception:  # noqa: BLE001 - an unreachable layout is priced as infinitely slow
        return math.inf, 0, ()
    return p.time_s, p.bytes, tuple((s.kind, s.bytes) for s in p.steps
                                    if s.kind not in ("slice", "value_chunk"))


def reduced_layout(src: Layout, want: Layout | None, shape: Sequence[int], itemsize: int,
                   mesh: MeshSpec) -> Layout:
    """Where a value holding partial sums (``src``) is reduced to: the first layout without
    partial sums on the cheapest path to ``want`` (what its first consumer reads; None: no
    consumer, reduced to ``src``'s dims by an all-reduce).

    >>> from nnscaler_jax.mesh.topology import DEFAULT_LINK, MeshSpec
    >>> mesh = MeshSpec(("data", "model"), (2, 4), (DEFAULT_LINK,) * 2)
    >>> str(reduced_layout(Layout.of(2, partial=("model",)), None, (64, 64), 4, mesh))
    'R'
    """
    if not src.partial:
        return src
    plain = Layout(src.dims)
    if want is None:
        return plain
    want = Layout(want.dims) if want.partial else want
    try:
        path = comm_path(src, want, tuple(int(s) for s in shape), int(itemsize), mesh)
    except PlanError:
        return plain
    return next((s.dst for s in path.steps if not s.dst.partial), want)
