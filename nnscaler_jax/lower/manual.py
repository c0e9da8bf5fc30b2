"""Values as each device's pieces: the plan's relayouts written as explicit collectives.

A :class:`~nnscaler_jax.lower.replay.Lowering` with ``manual=True`` runs inside a ``shard_map``
manual over every axis the plan splits: each value is the device's block of the layout it was
made in (:class:`~nnscaler_jax.layout.Layout`), every op runs on its blocks
(:func:`~nnscaler_jax.lower.local.bind_local`), and a value read in another layout moves there
by the collectives here, one step of the priced path at a time. Nothing is left to GSPMD, so
such a program can run inside one ``lax.switch`` branch of a pipeline stage while other stages
run other branches (GSPMD's resharding there may emit a ``collective-permute`` over every
device, which waits for devices that never reach it).

Gradients follow one convention: **a value's cotangent is whole in the value's layout** (every
device holds the complete cotangent of its block; a replicated value's cotangent is the same on
every device of the axes it is replicated over). Each collective below carries its transpose
under that convention (``jax.custom_vjp``; jax's own transposes of ``all_gather`` and ``psum``
assume the other one, partial cotangents), and :func:`grad_reduced` sums the cotangent of an
operand read whole by an op split over an axis (the gradient comes back partial over it: the
axes :func:`~nnscaler_jax.plan.layouts.partial_grad_axes` names), as Megatron's ``f`` operator
does before a column-parallel matmul.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from nnscaler_jax.errors import PlanError
from nnscaler_jax.layout import Layout

__all__ = ["assemble", "block", "grad_reduced", "relayout"]


def _own(x: Any, axis: str, n: int, dim: int) -> Any:
    """The device's block of ``x`` along ``dim`` over ``axis`` (``n`` devices)."""
    size = x.shape[dim] // n
    return lax.dynamic_slice_in_dim(x, lax.axis_index(axis) * size, size, axis=dim)


def _all(x: Any, axis: str, n: int, dim: int) -> Any:
    """``x``'s blocks along ``dim`` over ``axis``, gathered."""
    del n
    return lax.all_gather(x, axis, axis=dim, tiled=True)


def _collective(fwd: Callable, cot: Callable, n_static: int) -> Callable:
    """``fwd(x, *static)`` whose cotangent is ``cot(g, *static)`` (the whole-cotangent
    convention), not jax's transpose of ``fwd``."""
    f = jax.custom_vjp(fwd, nondiff_argnums=tuple(range(1, 1 + n_static)))
    f.defvjp(lambda x, *static: (fwd(x, *static), None),
             lambda *a: (cot(a[-1], *a[:n_static]),))
    return f


#: ``x`` split over ``axis`` (minor-most on ``dim``) -> gathered; cotangent: the own block.
_gather = _collective(_all, _own, 3)
#: ``x`` replicated over ``axis`` -> its block (``axis`` minor-most on ``dim``); cotangent: the
#: blocks gathered.
_slice = _collective(_own, _all, 3)
#: Partial sums over ``axis`` -> the device's block of their sum along ``dim``; cotangent: the
#: blocks' gathered (each summand's cotangent is the sum's).
_reduce_scatter = _collective(
    lambda x, axis, n, dim: lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True),
    _all, 3)
#: Partial sums over ``axes`` -> their sum, replicated; cotangent: the same.
_reduce = _collective(lambda x, axes: lax.psum(x, axes), lambda g, axes: g, 1)
#: ``x`` as it is, its cotangent summed over ``axes``: an operand read whole by an op split
#: over them gets a part of its gradient on each device.
grad_reduced = _collective(lambda x, axes: x, lambda g, axes: lax.psum(g, axes), 1)


def relayout(x: Any, src: Layout, dst: Layout, sizes: dict[str, int]) -> Any:
    """The device's block of ``x`` (``src``) as its block of ``dst`` (partial sums in ``dst``
    are kept only where ``src`` has them too).

    Partial sums leave first (reduce-scattered onto the dim ``dst`` splits over that axis,
    else summed); then, dim by dim, the axes ``dst`` does not keep are gathered (minor first)
    and the ones it adds are sliced (major first). An axis moving between dims is gathered
    whole and sliced (an all-to-all's result, at a gather's memory)."""
    if src == dst:
        return x
    dims = [list(d) for d in src.dims]
    where = {a: i for i, d in enumerate(dst.dims) for a in d}
    for a in src.partial:
        if a in dst.partial:
            continue
        d = where.get(a)
        if d is not None and tuple(dims[d]) == dst.dims[d][:len(dims[d])] \
                and dst.dims[d][len(dims[d])] == a:
            x = _reduce_scatter(x, a, sizes[a], d)
            dims[d].append(a)
        else:
            x = _reduce(x, (a,))
    extra = [a for a in dst.partial if a not in src.partial]
    if extra:
        raise PlanError(f"manual relayout {src} -> {dst}: a value made whole cannot become "
                        f"partial sums over {extra}")
    for d, want in enumerate(dst.dims):
        keep = 0
        while keep < min(len(dims[d]), len(want)) and dims[d][keep] == want[keep]:
            keep += 1
        for a in reversed(dims[d][keep:]):
            x = _gather(x, a, sizes[a], d)
        del dims[d][keep:]
    for d, want in enumerate(dst.dims):
        for a in want[len(dims[d]):]:
            x = _slice(x, a, sizes[a], d)
            dims[d].append(a)
    return x


def _block_index(lay: Layout, dim: int, coords: dict[str, int], sizes: dict[str, int]
                 ) -> tuple[int, int]:
    """``(block, blocks)``: which of its blocks along ``dim`` the device at ``coords`` holds."""
    k, ways = 0, 1
    for a in lay.dims[dim]:
        k, ways = k * sizes[a] + coords.get(a, 0), ways * sizes[a]
    return k, ways


def block(x: Any, lay: Layout, coords: dict[str, int], sizes: dict[str, int]) -> Any:
    """The block of the whole value ``x`` (``lay``) the device at mesh ``coords`` holds
    (static slices: traceable)."""
    idx = []
    for d, n in enumerate(x.shape):
        k, ways = _block_index(lay, d, coords, sizes)
        idx.append(slice(k * (n // ways), (k + 1) * (n // ways)))
    return x[tuple(idx)]


def assemble(block_at: Callable[[dict[str, int]], Any], lay: Layout, sizes: dict[str, int],
             concatenate: Callable = jnp.concatenate) -> Any:
    """The whole value from its blocks (``block_at(coords)``: the block of the device at those
    mesh coordinates; the devices a block is replicated over are asked at index 0)."""
    def rec(d: int, coords: dict[str, int]) -> Any:
        if d == lay.ndim:
            return block_at(coords)
        axes = lay.dims[d]
        parts = []
        for at in itertools.product(*[range(sizes[a]) for a in axes]):
            parts.append(rec(d + 1, {**coords, **dict(zip(axes, at, strict=True))}))
        return parts[0] if len(parts) == 1 else concatenate(parts, axis=d)
    return rec(0, {})
