"""The in-graph pipeline programs' one parameter layout: each chunk's pieces packed in rows.

A program run in one jitted step over the stage axis (:mod:`~nnscaler_jax.pipeline.in_graph`)
stores what each chunk alone reads as that chunk's *pieces*: the cut program's
(:mod:`~nnscaler_jax.pipeline.cut_program`) are the parameter leaves (or collections) only the
chunk reads, the identical-layer program's (:mod:`~nnscaler_jax.pipeline.stacked`) each layer
leaf stacked over the chunk's layers (``[layers per chunk, ...]``: the same pieces in every
chunk). A chunk's pieces are packed into one zero-padded vector per dtype
(:func:`~nnscaler_jax.pipeline.chunks.pack`), or per group and dtype (the identical-layer
program's: a row per layer leaf, since XLA has no views into a buffer and a piece sliced out of
a wider row is a copy at every read), the chunks' vectors stacked ``[stages, virtual, width]``
over the stage axis (chunk ``c = v * S + s`` at ``(s, v)``), so a device stores its own stage's
only; the leaves several chunks read are kept apart, whole (the program's ``shared``).

On tensor-parallel stages each piece is stored as its stage's plan says (a
:class:`~nnscaler_jax.layout.Layout` over the tensor axes): a row holds every device's blocks
one device after another (``[S, V, T x width]`` over ``P(stage, None, tensor axes)``, ``T``
the devices of a stage's tensor axes), so each device holds its own blocks; a block replicated
over a tensor axis is stored on each of its devices (:meth:`PackedRows.norm_weights` counts it
once). A chunk reads its pieces as its device's blocks (:meth:`PackedRows.blocks`: inside a
``shard_map`` manual over every axis) or, GSPMD partitioning the stage's ops, whole pieces laid
out over the tensor axes (:meth:`PackedRows.pieces`: a ``shard_map`` over the tensor axes reads
each device's blocks as one array, no data moves).

>>> import jax, jax.numpy as jnp
>>> mesh = jax.make_mesh((2,), ("stage",), devices=jax.devices()[:2])
>>> rows = PackedRows(mesh, "stage", (), 2, 1, [[jax.ShapeDtypeStruct((2, 3), "float32")],
...                                               [jax.ShapeDtypeStruct((4,), "float32")]])
>>> rows.width, rows.to_rows([[jnp.ones((2, 3))], [jnp.ones(4)]])["float32"].shape
({'float32': 6}, (2, 1, 6))
>>> [[x.shape for x in p] for p in rows.from_rows(rows.to_rows([[jnp.ones((2, 3))],
...                                                             [jnp.ones(4)]]))]
[[(2, 3)], [(4,)]]
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnscaler_jax.layout import Layout
from nnscaler_jax.lower.manual import assemble, block
from nnscaler_jax.mesh.axes import mesh_axes
from nnscaler_jax.mesh.topology import MeshSpec
from nnscaler_jax.pipeline.chunks import pack, packing, unpack, widths

__all__ = ["PackedRows"]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _copies(x: Any, n: int) -> Any:
    """``x``, a block stored on each of ``n`` devices that a ``shard_map`` output names
    replicated: the transpose of such an output hands each device ``1 / n`` of the whole
    cotangent; each copy's gradient is the whole one (the copies stay equal)."""
    return x


def _copies_fwd(x: Any, n: int) -> tuple[Any, None]:
    return x, None


def _copies_bwd(n: int, _: None, ct: Any) -> tuple[Any]:
    return (ct * n,)


_copies.defvjp(_copies_fwd, _copies_bwd)


class PackedRows:
    """Chunks' pieces packed in rows ``{key: [stages, virtual, T x width]}``, a row per dtype
    (or per group and dtype).

    Args:
        mesh: the program's mesh.
        axis: its stage axis.
        tp_axes: the tensor-parallel axes inside stages (``()``: pieces whole).
        stages, virtual: the schedule's stages and chunks per stage.
        avals: per chunk ``c``, its pieces' shapes and dtypes (whole).
        layouts: per chunk, each piece's layout over the tensor axes (None: whole on every
            device); none given: every piece whole.
        groups: per chunk, each piece's group: a row per group and dtype (keyed
            ``'<group>:<dtype>'``; the identical-layer program's pieces each a group of its
            own, so a chunk reads each from its own row as the leaf's own array would be
            read, not sliced out of a wider one); none given: a row per dtype (keyed by it).

    Attributes:
        packs: per chunk, the :class:`~nnscaler_jax.pipeline.chunks.Packing` of one device's
            blocks.
        width: per row key, the widest chunk's (one device's part of a row).
        dtypes: per row key, its dtype.
        devices: the coordinates over ``tp_axes`` of a stage's devices, in their blocks' order
            in a row (major to minor).
    """

    def __init__(self, mesh: Any, axis: str, tp_axes: tuple[str, ...], stages: int,
                 virtual: int, avals: Sequence[Sequence[Any]],
                 layouts: Sequence[Sequence[Layout | None]] | None = None,
                 groups: Sequence[Sequence[str]] | None = None):
        self.mesh, self.axis, self.tp_axes = mesh, axis, tuple(tp_axes)
        self.stages, self.virtual = stages, virtual
        self.sizes = mesh_axes(mesh)
        self.avals = [list(a) for a in avals]
        self.layouts = ([list(lays) for lays in layouts] if layouts is not None
                        else [[None] * len(a) for a in self.avals])
        self.devices = [dict(zip(self.tp_axes, at, strict=True)) for at in
                        itertools.product(*[range(self.sizes[a]) for a in self.tp_axes])]
        spec = MeshSpec.from_mesh(mesh)
        keys = [[f"{g}:{np.dtype(a.dtype).name}" for g, a in zip(gs, av, strict=True)]
                for gs, av in zip(groups, self.avals, strict=True)] if groups else None
        self.packs = [packing([jax.ShapeDtypeStruct(
            tuple(a.shape) if lay is None else lay.local_shape(a.shape, spec), a.dtype)
            for a, lay in zip(av, lays, strict=True)], keys[c] if keys else None)
            for c, (av, lays) in enumerate(zip(self.avals, self.layouts, strict=True))]
        self.width = widths(self.packs)
        self.dtypes = {k: dt for pk in self.packs for k, dt in pk.dtypes.items()}
        self.dtypes.update({k: k for k in self.width if k not in self.dtypes})

    @property
    def sharding(self) -> NamedSharding:
        """Where the rows live: over the stage axis, their blocks over the tensor axes."""
        if not self.tp_axes:
            return NamedSharding(self.mesh, P(self.axis))
        return NamedSharding(self.mesh, P(self.axis, None, self.tp_axes))

    def shapes(self, dtype: Any = None) -> dict[str, jax.ShapeDtypeStruct]:
        """The rows' shapes (``dtype``: every row's, e.g. float32 for an optimizer's
        moments; default its own)."""
        S, V, T = self.stages, self.virtual, len(self.devices)
        return {k: jax.ShapeDtypeStruct((S, V, T * w), dtype or self.dtypes[k])
                for k, w in self.width.items()}

    def _where(self, c: int) -> tuple[int, int]:
        return c % self.stages, c // self.stages

    def to_rows(self, pieces: Sequence[Sequence[Any]]) -> dict[str, Any]:
        """Per chunk its whole pieces -> the rows (traceable: static slices)."""
        rows: list[list[Any]] = [[None] * self.virtual for _ in range(self.stages)]
        for c, (ps, lays, pk) in enumerate(zip(pieces, self.layouts, self.packs, strict=True)):
            vecs = [pack([x if lay is None else block(x, lay, at, self.sizes)
                          for x, lay in zip(ps, lays, strict=True)], pk, self.width,
                         self.dtypes)
                    for at in self.devices]
            s, v = self._where(c)
            rows[s][v] = {dt: jnp.concatenate([vec[dt] for vec in vecs]) for dt in self.width}
        return {dt: jnp.stack([jnp.stack([r[dt] for r in row]) for row in rows])
                for dt in self.width}

    def from_rows(self, rows: dict[str, Any]) -> list[list[Any]]:
        """The inverse of :meth:`to_rows`: per chunk its whole pieces (each assembled from
        its devices' blocks)."""
        T, out = len(self.devices), []
        for c, (lays, pk) in enumerate(zip(self.layouts, self.packs, strict=True)):
            s, v = self._where(c)
            parts = [unpack({dt: x[s, v].reshape(T, -1)[t] for dt, x in rows.items()}, pk)
                     for t in range(T)]
            out.append([parts[0][i] if lay is None or not lay.split_axes else assemble(
                lambda at, i=i, parts=parts: parts[self.devices.index(
                    {a: at.get(a, 0) for a in self.tp_axes})][i], lay, self.sizes)
                for i, lay in enumerate(lays)])
        return out

    def blocks(self, row: dict[str, Any], c: int = 0) -> list[Any]:
        """Chunk ``c``'s pieces as the device's blocks, from its part of the chunk's row
        (``{dtype: [width]}``, inside a ``shard_map`` manual over the tensor axes)."""
        return unpack(row, self.packs[c])

    def pieces(self, row: dict[str, Any], c: int = 0) -> list[Any]:
        """Chunk ``c``'s whole pieces, each laid out over the tensor axes as stored, from
        the chunk's row (``{dtype: [T x width]}`` over the tensor axes, left to GSPMD)."""
        T = len(self.devices)
        return self.whole([row[dt].reshape(T, -1)[:, off:off + math.prod(shape)]
                           for dt, off, shape in self.packs[c].slots], c)

    def whole(self, blocks: list[Any], c: int = 0) -> list[Any]:
        """Chunk ``c``'s whole pieces, each laid out over the tensor axes as stored, from
        their blocks ``[T, block size]`` (every device's, in row order; over the tensor axes,
        left to GSPMD): each device reads its blocks in a ``shard_map`` over those axes (no
        data moves)."""
        shapes = [shape for _, _, shape in self.packs[c].slots]
        if not self.tp_axes:
            return [b.reshape(shape) for b, shape in zip(blocks, shapes, strict=True)]
        lays = [lay or Layout.replicated(a.ndim) for a, lay in
                zip(self.avals[c], self.layouts[c], strict=True)]
        # (a block replicated over tensor axes: the output's transpose divides its cotangent)
        copies = [self._copies(lay) for lay in lays]

        def local(bs):
            return [_copies(b.reshape(shape), n) if n > 1 else b.reshape(shape)
                    for b, shape, n in zip(bs, shapes, copies, strict=True)]

        return jax.shard_map(local, in_specs=([P(self.tp_axes)] * len(blocks),),
                             out_specs=[lay.to_pspec() for lay in lays],
                             axis_names=set(self.tp_axes), check_vma=False)(list(blocks))

    @functools.cached_property
    def norm_weights(self) -> dict[str, np.ndarray]:
        """Per row element, one over the devices of its stage storing it (a global norm of
        values in this layout counts each element of the pieces once; padding 0), float32."""
        T = len(self.devices)
        out = {dt: np.zeros((self.stages, self.virtual, T * w), np.float32)
               for dt, w in self.width.items()}
        for c, (lays, pk) in enumerate(zip(self.layouts, self.packs, strict=True)):
            s, v = self._where(c)
            for lay, (dt, off, shape) in zip(lays, pk.slots, strict=True):
                for t in range(T):
                    start = t * self.width[dt] + off
                    out[dt][s, v, start:start + math.prod(shape)] = 1.0 / self._copies(lay)
        return out

    def _copies(self, lay: Layout | None) -> int:
        """On how many devices of a stage each block of a piece laid out as ``lay`` is
        stored (the tensor axes it is not split over)."""
        return math.prod(self.sizes[a] for a in self.tp_axes
                         if lay is None or a not in lay.split_axes)
