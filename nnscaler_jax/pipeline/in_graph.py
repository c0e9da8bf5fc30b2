"""The in-graph executor: every stage of a pipelined step in one jitted program over the mesh.

A pipelined plan runs on one of two executors behind
:class:`~nnscaler_jax.pipeline.program.PipelineRuntime`: this one, and the host-dispatched one
(:class:`~nnscaler_jax.pipeline.mpmd.MpmdProgram`: one jitted program per stage and block,
Python walking the schedule). Here one ``jax.shard_map`` over the stage and data axes runs a
``lax.fori_loop`` over the schedule's step table (:func:`~nnscaler_jax.pipeline.loop_tables.
loop_tables`); at each time step a device runs its block (by ``lax.axis_index`` on the stage
axis) and the step's results move to the neighbouring stages with ``lax.ppermute``
(:func:`exchange`); the gradients are accumulated in the loop, averaged over the data axes,
and the optax update runs in the same jitted, donated step (:func:`~nnscaler_jax.pipeline.
update.jitted_step`).

Two programs run on it, as the chunks they evaluate differ:
:class:`~nnscaler_jax.pipeline.stacked.PipelineProgram` (a stack of identical layers: every
chunk runs the one layer template over its stacked parameters, no branch on the chunk, so the
tensor-parallel axes can stay GSPMD's inside the ``shard_map``) and
:class:`~nnscaler_jax.pipeline.cut_program.CutProgram` (chunks cut at module boundaries, run by
``lax.switch`` on the chunk, tensor-parallel stages on each device's blocks).
:class:`InGraphRuntime` is what they share: the one parameter layout (each chunk's pieces
packed in its row, :mod:`~nnscaler_jax.pipeline.packed`; the programs say what a chunk's pieces
are), the one step loop (:meth:`InGraphRuntime._local`: the tables' blocks, the buffers of
in-flight activations and cotangents, the forward and backward lanes of a paired step, the
mutable collections, the transfers and the gradient sums), which reads a program's chunks
through one interface (``act`` / ``cot``: what a forward sends on and a backward sends back;
:meth:`~InGraphRuntime.chunk_forward`, :meth:`~InGraphRuntime.chunk_backward`, and
:meth:`~InGraphRuntime.more_blocks` for the blocks other than ``F`` / ``B``), the stored
layout's shardings, the jitted step, the initial state, the step's XLA options.
"""

from __future__ import annotations

import abc
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnscaler_jax.errors import PlanError
from nnscaler_jax.layout import Layout
from nnscaler_jax.mesh.axes import mesh_axes
from nnscaler_jax.pipeline.loop_tables import CODES
from nnscaler_jax.pipeline.mutable import average
from nnscaler_jax.pipeline.packed import PackedRows
from nnscaler_jax.pipeline.program import PipelineRuntime, on_host, spread_sharding
from nnscaler_jax.pipeline.update import (
    cached_view,
    initial_state,
    jitted_step,
    mirror_store,
    place_as,
)

__all__ = ["OVERLAP_OPTIONS", "InGraphRuntime", "compiler_options", "exchange", "send_if",
           "zeros"]


def zeros(avals: dict) -> dict:
    """Zeros shaped as ``avals`` (key -> ``ShapeDtypeStruct``): an empty buffer entry."""
    return {k: jnp.zeros(a.shape, a.dtype) for k, a in avals.items()}


def _zl() -> Any:
    return jnp.zeros((), jnp.float32)


def _zeros_like(tree: Any) -> Any:
    return jax.tree.map(jnp.zeros_like, tree)


def send_if(needed: Any, vec: Any, axis: str, perm: list) -> Any:
    """``vec`` sent along ``perm`` when some stage receives it at this step (``needed`` is the
    same on every device, so all take one branch of the ``cond`` around the collective)."""
    return lax.cond(needed, lambda v: jax.tree.map(lambda x: lax.ppermute(x, axis, perm), v),
                    lambda v: v, vec)


def exchange(tb: Any, sends: Any, now: tuple, pending: tuple, axis: str, stages: int
             ) -> tuple[tuple, tuple]:
    """A time step's transfers: ``(received, pending)``. ``now``: the step's results for the
    next and the previous stage (activation, cotangent); ``sends``: the step's row of
    ``tb.sends``. With ``tb.overlap`` the step sends ``pending`` (the previous step's
    results), at every step and outside any branch: nothing the step's blocks compute feeds
    it, so XLA runs the ``ppermute`` beside them (a collective inside a ``cond`` ends
    inside it); ``now`` becomes pending. Else the step sends ``now`` where some stage
    receives it (and ``pending`` is empty)."""
    perms = ([(i, (i + 1) % stages) for i in range(stages)],
             [(i, (i - 1) % stages) for i in range(stages)])
    if tb.overlap:
        got = tuple(jax.tree.map(lambda x, k=k: lax.ppermute(x, axis, perms[k]), pending[k])
                    for k in range(2))
        return got, now
    return tuple(send_if(sends[k], now[k], axis, perms[k]) for k in range(2)), ()


OVERLAP_OPTIONS = {"xla_gpu_experimental_parallel_collective_overlap_limit": 2}
"""XLA:GPU's options for a step whose transfers overlap (:func:`exchange`): both
``ppermute``\\ s in flight at once. With XLA's default (one), its scheduler starts the
second after the first is done: one direction's transfer overlaps a block, the other none
(seen in the compiled loop of a 4-stage 1F1B on compile-only H100s)."""


def compiler_options(tb: Any, mesh: Any) -> dict | None:
    """The XLA options of a step running ``tb`` on ``mesh``: :data:`OVERLAP_OPTIONS` for an
    overlapping step on GPUs, else None."""
    gpu = getattr(mesh.devices.flat[0], "platform", "cpu") == "gpu"
    return dict(OVERLAP_OPTIONS) if tb.overlap and gpu else None


class InGraphRuntime(PipelineRuntime):
    """A pipelined program run in one jitted step over the whole mesh.

    Subclasses set up the step (:meth:`~nnscaler_jax.pipeline.program.PipelineRuntime.
    _setup`, their step table as ``tables``), say what each chunk's pieces of the parameters
    are (:meth:`_rows_for`, :meth:`_pieces`, :meth:`_leaves`, ``shared``: the leaves kept
    apart) and give :meth:`grads` (the ``shard_map`` running the table); the parameter layout
    (:mod:`~nnscaler_jax.pipeline.packed`: ``{'shared': [leaves], 'stages': {row key:
    [stages, virtual, width]}}``), the step, the state and the shardings are this class's.

    Attributes:
        rows: the parameters' :class:`~nnscaler_jax.pipeline.packed.PackedRows`.
        shared: the parameter leaves stored whole apart from the rows.
        leaf_layout: a leaf stored in the rows -> its layout over the tensor axes (where
            split).
    """

    axis: str
    tables: Any
    rows: PackedRows
    shared: tuple[int, ...] = ()
    leaf_layout: dict[int, Layout]
    scanned: frozenset = frozenset()  # leaves whose leading dim the layout cuts (nn.scan)

    # ---- parameter layout --------------------------------------------------------------------

    @abc.abstractmethod
    def _rows_for(self, avals: list) -> PackedRows:
        """The rows of parameter leaves shaped as ``avals`` (the program's, or the optimizer
        probe's miniatures)."""

    @abc.abstractmethod
    def _pieces(self, leaves: list) -> list[list]:
        """Per chunk, its pieces of the parameter ``leaves`` (traceable)."""

    @abc.abstractmethod
    def _leaves(self, pieces: list[list], shared: list, n: int) -> list:
        """The ``n`` parameter leaves from the chunks' ``pieces`` and the ``shared`` leaves
        (the inverse of :meth:`_pieces`)."""

    def shared_shardings(self) -> list[NamedSharding]:
        """Where the shared leaves are stored (replicated)."""
        return [self.shardings()[0]] * len(self.shared)

    def layout(self, avals: list) -> tuple[Callable, Callable]:
        """Traceable ``(to_layout, to_module)`` between parameter leaves shaped as ``avals``
        and the layout ``{'shared': [...], 'stages': rows}`` (:meth:`to_pipeline`'s, or the
        optimizer probe's miniatures')."""
        rows = self.rows if avals is self.param_avals else self._rows_for(avals)

        def to_layout(leaves: list) -> dict:
            return {"shared": [leaves[j] for j in self.shared],
                    "stages": rows.to_rows(self._pieces(leaves))}

        def to_module(pp: dict) -> list:
            return self._leaves(rows.from_rows(pp["stages"]), list(pp["shared"]), len(avals))

        return to_layout, to_module

    def layout_shardings(self) -> dict:
        """The shardings of :meth:`to_pipeline`'s tree."""
        return {"shared": self.shared_shardings(),
                "stages": {dt: self.rows.sharding for dt in self.rows.width}}

    def to_pipeline(self, params: Any) -> dict:
        """Module params -> ``{'shared': [...], 'stages': {row key: [S, V, width]}}`` on the
        mesh: laid out on the host where the leaves are all in this process (no device holds
        more than its share), else in one jitted program on the mesh."""
        to_layout = self.layout(self.param_avals)[0]
        leaves = jax.tree.leaves(params)
        out = self.layout_shardings()
        pp = on_host(to_layout, leaves)
        if pp is None:
            # (a leaf laid out over the mesh's devices stays as it is laid out)
            leaves = [jax.device_put(x, self._on_mesh(x)) for x in leaves]
            with jax.set_mesh(self.mesh):  # (the caller's context mesh may be Explicit)
                pp = jax.jit(to_layout, out_shardings=out)(leaves)
        # (new buffers: the step donates the shared leaves, which may be the caller's own)
        return jax.tree.map(lambda x, sh: jax.device_put(x, sh, may_alias=False), pp, out)

    def _on_mesh(self, x: Any) -> NamedSharding:
        """Where :meth:`to_pipeline` reads ``x`` from: its own layout where it lies on this
        mesh (its axes and devices, whatever their types), else replicated."""
        sh, mesh = getattr(x, "sharding", None), self.mesh
        same = (isinstance(sh, NamedSharding) and sh.mesh.shape == mesh.shape
                and sh.mesh.axis_names == mesh.axis_names
                and (sh.mesh.devices == mesh.devices).all())
        return NamedSharding(self.mesh, sh.spec) if same else self.shardings()[0]

    def from_pipeline(self, pp: dict, spread: bool = False) -> Any:
        """The inverse of :meth:`to_pipeline` (a module params tree; ``spread``: each leaf
        over the mesh, :func:`~nnscaler_jax.pipeline.program.spread_sharding`), laid out on
        the host where the layout is all in this process."""
        to_module = self.layout(self.param_avals)[1]
        got = on_host(to_module, pp)
        if got is not None:
            leaves = [self.module_leaf(x, spread) for x in got]
        else:
            rep = self.shardings()[0]
            out = [spread_sharding(self.mesh, a.shape) if spread else rep
                   for a in self.param_avals]
            with jax.set_mesh(self.mesh):
                leaves = jax.jit(to_module, out_shardings=out)(pp)
        return jax.tree.unflatten(self.params_tree, leaves)

    def mini_shapes(self) -> list[tuple[int, ...]]:
        """Per parameter leaf, its miniature's shape in the optimizer probe: 2 per dim (on
        tensor-parallel stages 2 per block), a scanned stack of layers keeping its layer
        dim."""
        sizes, out = mesh_axes(self.mesh), []
        for j, a in enumerate(self.param_avals):
            lay = self.leaf_layout.get(j, Layout.replicated(len(a.shape)))
            shape = [2 * math.prod(sizes[x] for x in axes) for axes in lay.dims]
            out.append(tuple(a.shape[:1]) + tuple(shape[1:]) if j in self.scanned
                       else tuple(shape))
        return out

    @functools.cached_property
    def _store(self) -> Callable[[Any], Any]:
        """``tree -> tree``: params, or optimizer state mirroring them, laid out as stored
        (:func:`~nnscaler_jax.pipeline.update.mirror_store`): the rows over the stage axis
        (their blocks over the tensor axes), the shared leaves as :meth:`shared_shardings`."""
        f32 = lambda shape: jax.ShapeDtypeStruct(shape, np.float32)
        shapes = {"shared": [f32(self.param_avals[j].shape) for j in self.shared],
                  "stages": self.rows.shapes(np.float32)}
        return mirror_store(shapes, self.layout_shardings(), self.shardings()[0])

    def _view(self, optimizer: Any) -> Any:
        """The optimizer's view of the module's tree (None: it updates the layout as it is),
        over the axes the layout splits: :func:`~nnscaler_jax.pipeline.update.cached_view`."""
        return cached_view(self, optimizer, (self.axis, *self.tp_axes))

    def train_step(self, optimizer: Any, *, return_grads: bool = False,
                   scaling: Any = None) -> Callable:
        """A jitted ``step(state, batch) -> (state, metrics)`` with
        ``state = {'params': pipeline params, 'opt_state': ...}`` (see :meth:`init_state`) and
        ``metrics = {'loss': mean loss, 'grad_norm': global gradient norm}`` (and ``'grads'``,
        pipeline layout, with ``return_grads``; ``'loss_scale'`` and ``'finite'`` with
        ``scaling``, float16); a state with ``'collections'`` gets them updated."""
        return jitted_step(self.grads, optimizer, self.mesh, store=self._store,
                           view=self._view(optimizer), return_grads=return_grads,
                           scaling=scaling, compiler_options=compiler_options(self.tables,
                                                                              self.mesh),
                           norm=self.grad_norm)

    def grad_norm(self, grads: Any) -> Any:
        """The global norm of gradients in the stored layout (traceable): on tensor-parallel
        stages each row element weighted by one over the devices of its stage storing it."""
        import optax
        if not self.tp_axes:
            return optax.tree.norm(grads)
        weights = self.rows.norm_weights
        total = optax.tree.norm(grads["shared"], squared=True)
        for dt, g in grads["stages"].items():
            total += jnp.sum(weights[dt] * jnp.square(g.astype(jnp.float32)))
        return jnp.sqrt(total)

    def loss_and_grads(self, pp: Any, batch: tuple, key: Any = None,
                       colls: Any = None) -> tuple[Any, Any]:
        args = (pp, batch, key) + ((colls,) if colls is not None else ())
        with jax.set_mesh(self.mesh):
            loss, g, *_ = jax.jit(self.grads)(*args)
        return loss, g

    def init_state(self, params: Any, optimizer: Any, collections: Any = None) -> dict:
        """``{'params': to_pipeline(params), 'opt_state': optimizer.init(...)}``, laid out as
        the step returns them, and ``'collections'`` (:meth:`collections_state`) when the
        program carries any."""
        colls = self.collections_state(collections)  # (refused before any layout work)
        return initial_state(self.to_pipeline(params), optimizer, self.mesh, collections=colls,
                             store=self._store, view=self._view(optimizer))

    def microbatches(self, batch: tuple, key: Any, scale: Any) -> tuple[list, list, Any]:
        """The ``shard_map``'s batch arguments: the batch's leaves as ``[M, D, b, ...]`` (and
        the micro-batches' keys:
        :meth:`~nnscaler_jax.pipeline.program.PipelineRuntime.micro_leaves`) placed split over
        the data axes, their specs, and the loss's cotangent per micro-batch
        (``scale / M``: the backward's seed)."""
        data = self.data_axes if self.data_axes else None
        shaped = self.micro_leaves(batch, key)
        specs = [P(None, data)] * len(shaped)
        placed = [place_as(x, NamedSharding(self.mesh, sp))
                  for x, sp in zip(shaped, specs, strict=True)]
        return placed, specs, jnp.asarray(scale, jnp.float32) / self.schedule.microbatches

    def reduce_grads(self, loss: Any, g_shared: list, g_own: Any) -> tuple:
        """The step's ``(loss, shared gradients, own gradients)`` from one device's sums over
        its blocks, inside the ``shard_map``: the loss and the gradients of the leaves every
        stage stores (``shared``: a tied embedding gets each reading stage's part) summed over
        the stages, everything averaged over the data axes."""
        g_shared = [lax.psum(g, self.axis) for g in g_shared]
        loss = lax.psum(loss, self.axis)
        if self.data_axes:
            g_shared, g_own, loss = jax.tree.map(lambda g: lax.pmean(g, self.data_axes),
                                                 (g_shared, g_own, loss))
        return loss, g_shared, g_own

    # ---- the step loop: the chunk interface and the per-device body of the shard_map ------

    act: dict  # key -> ShapeDtypeStruct: what a forward sends on (an input-buffer entry)
    cot: dict  # key -> ShapeDtypeStruct: what a backward sends back (a cotangent entry)

    @abc.abstractmethod
    def chunk_forward(self, c: Any, args: tuple) -> tuple[dict, Any, dict]:
        """The forward of the device's chunk ``c`` (traced) on the block arguments ``args``
        (:meth:`_local`): ``(activation it sends, its loss or 0, its new collections)``."""

    @abc.abstractmethod
    def chunk_backward(self, c: Any, args: tuple, seed: Any, split: Any) -> tuple:
        """The backward of chunk ``c``: ``(parameter gradients, shared gradients, cotangent of
        its input, kept values)``, seeded by the loss's cotangent ``seed`` where the chunk
        computes the loss, else by ``args``' cotangent; ``split``: the schedule's split
        backwards (:meth:`backward_split`), then only the cotangent and the kept values (the
        weight gradients come in ``G``); None entries are zeros."""

    def backward_split(self, args: tuple) -> Any:
        """The chunks' split backwards (schedules with ``G`` blocks), traced on one block's
        arguments."""
        raise PlanError(f"{type(self).__name__} runs no split backward (schedule "
                        f"{self.schedule.name!r}); use a schedule without 'G' blocks")

    def more_blocks(self, c: Any, it: Any, args: tuple, seed: Any, split: Any
                    ) -> dict[int, Callable]:
        """The blocks other than ``F`` / ``B`` this program runs, by code
        (:data:`~nnscaler_jax.pipeline.loop_tables.CODES`): each returns
        :meth:`block_result`'s tuple."""
        del c, it, args, seed, split
        return {}

    def block_result(self, args: tuple, *, out: Any = None, gc: Any = None, gp: Any = None,
                     gsh: Any = None, loss: Any = None, new: Any = None, kept: Any = None
                     ) -> tuple:
        """One block's results ``(activation to send, cotangent to send, chunk param grads,
        shared grads, loss, new collections, kept values)``, zeros (the collections as read)
        where not given."""
        pv, shared, _, _, _, kv, k0 = args
        return (zeros(self.act) if out is None else out, zeros(self.cot) if gc is None else gc,
                _zeros_like(pv) if gp is None else gp, _zeros_like(shared) if gsh is None else gsh,
                _zl() if loss is None else loss, kv if new is None else new,
                _zeros_like(k0) if kept is None else kept)

    def _blocks(self, c: Any, it: Any, args: tuple, seed: Any, split: Any) -> list:
        """The ``lax.switch`` branches of one time step for the device's chunk ``c``, indexed
        by :data:`~nnscaler_jax.pipeline.loop_tables.CODES`."""
        M = self.schedule.microbatches

        def idle():
            return self.block_result(args)

        def fwd():
            out, loss, new = self.chunk_forward(c, args)
            return self.block_result(args, out=out, loss=loss / M, new=new)

        def bwd():
            gp, gsh, gc, kept = self.chunk_backward(c, args, seed, split)
            return self.block_result(args, gc=gc, gp=gp, gsh=gsh, kept=kept)

        out = [idle, fwd, bwd]
        for code, f in sorted(self.more_blocks(c, it, args, seed, split).items()):
            out += [idle] * (code + 1 - len(out))
            out[code] = f
        return out

    def _two_lanes(self, first: tuple, second: tuple, seed: Any, split: Any) -> tuple:
        """The blocks of a time step of a paired table, as :meth:`_blocks`' results: the
        first lane runs every kind but ``B`` (``first = (code, chunk, pass, args)``), the
        second the backward (``second = (on, chunk, args)``: a pair's, or the step's only
        block). A step holds one set of gradient results, as in an unpaired table, not one per
        lane: the parameter gradients come from the backward lane, or from the first lane's
        ``G`` where backwards are split (their ``B`` makes none); the first lane's shared
        gradients are kept where its blocks make some (``E`` / ``H`` / ``W``, ``G``)."""
        code, c, it, args = first
        on, cb, b_args = second
        keep_sh = self.schedule.all_device or split is not None
        keep_p = split is not None

        def lane(f):
            def run():
                out_f, out_b, dp, dsh, loss, new, _ = f()
                return out_f, out_b, dp if keep_p else {}, dsh if keep_sh else [], loss, new
            return run

        fs = self._blocks(c, it, args, seed, split)
        fs[CODES["B"]] = fs[0]  # (a backward runs in the second lane)
        out_f, out_b, dp_f, dsh, loss, new = lax.switch(code, [lane(f) for f in fs])
        br = self._blocks(cb, it, b_args, seed, split)
        _, out_bb, dp, dsh_b, _, _, kept = lax.cond(on, br[CODES["B"]], br[0])
        out_b = jax.tree.map(lambda x, y: jnp.where(on, x, y), out_bb, out_b)
        if keep_sh:
            dsh_b = [x + y for x, y in zip(dsh, dsh_b, strict=True)]
        return out_f, out_b, dp_f if keep_p else dp, dsh_b, loss, new, kept

    def _carry(self, stages: Any, shared: list, colls: dict, split: Any) -> tuple:
        """The step loop's carry at its start: the input and cotangent buffers, the gradient
        sums, the loss, the collections and what each ``F`` read of them (per chunk and
        micro-batch), the kept values of split backwards, the values on their way."""
        tb, M = self.tables, self.schedule.microbatches
        slots = lambda avals, n: {k: jnp.zeros((n,) + a.shape, a.dtype)
                                  for k, a in avals.items()}
        return (slots(self.act, tb.n_in), slots(self.cot, tb.n_g), _zeros_like(stages),
                _zeros_like(shared), _zl(), colls,
                {k: jnp.zeros((x.shape[0], M) + x.shape[1:], x.dtype) for k, x in colls.items()},
                {k: jnp.zeros((tb.n_s, n), k) for k, n in (split.width if split else {}).items()},
                (zeros(self.act), zeros(self.cot)) if tb.overlap else ())

    def _local(self, shared: list, stages: Any, batch: list, colls: dict, seed: Any) -> tuple:
        """Per-device body of the step's ``shard_map``: run the step table, return ``(loss,
        shared grads, stage grads, new stage collections)``; ``stages``: the stage's chunk
        parameters (a tree of ``[1, V, ...]`` leaves), ``colls``: its packed collections
        (``{dtype: [1, V, width]}``), ``seed``: the loss's cotangent per micro-batch
        (``scale / M``)."""
        S, tb = self.schedule.stages, self.tables
        s = lax.axis_index(self.axis)
        first = lambda tree: jax.tree.map(lambda x: x[0], tree)
        stages, colls = first(stages), first(colls)                 # [V, ...]
        batch = [x[:, 0] for x in batch]                             # [M, b, ...]
        split = None
        if self.schedule.split_backward:  # traced on one block's arguments
            split = self.backward_split((first(stages), shared, zeros(self.act),
                                         zeros(self.cot), first(batch), first(colls), seed))
        tabs = [jnp.asarray(a) for a in (tb.kind, tb.mb, tb.virt, tb.it, tb.in_slot, tb.g_slot,
                                         tb.rf_slot, tb.rb_slot, tb.keep_f, tb.keep_b,
                                         tb.keep_s, tb.s_slot)]
        sends = jnp.asarray(tb.sends)
        pair = [jnp.asarray(a) for a in (tb.b_kind, tb.b_mb, tb.b_virt, tb.b_in, tb.b_g)]
        pick = lambda tree, i: jax.tree.map(
            lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False), tree)
        at = lambda tree, i: jax.tree.map(lambda b: b[i], tree)
        keeps = [bool((k >= 0).any()) for k in (tb.keep_f, tb.keep_b)]

        def body(t, carry):
            inbuf, gbuf, g_st, g_sh, loss_acc, cst, snap, kbuf, pend = carry
            code, m, v, it, isl, gsl, rf, rb, kf, kb, ks, ssl = [a[t, s] for a in tabs]
            now, saved = pick(cst, v), pick(pick(snap, v), m)  # B / G read what their F read
            is_f, is_b = code == CODES["F"], (code == CODES["B"]) | (code == CODES["G"])
            # (the blocks read their buffer slots outside the branches: a branch holding a
            # whole buffer would be ordered before the step's receives, which write into it)
            block = lambda m, v, isl, gsl, kv: (
                pick(stages, v), shared, at(inbuf, isl), at(gbuf, gsl),
                [lax.dynamic_index_in_dim(x, m, keepdims=False) for x in batch], kv,
                at(kbuf, ssl))
            args = block(m, v, isl, gsl, {k: jnp.where(is_b, saved[k], x)
                                          for k, x in now.items()})
            if not tb.paired:
                out_f, out_b, dp, dsh, loss, new, kept = lax.switch(
                    code, self._blocks(v * S + s, it, args, seed, split))
                gv = v
            else:  # a forward lane and a backward lane (a pair runs both)
                bk, bm, bv, bi, bg = [a[t, s] for a in pair]
                sel = lambda a, b: jnp.where(bk > 0, b, a)
                bm, gv, bi, bg = sel(m, bm), sel(v, bv), sel(isl, bi), sel(gsl, bg)
                b_args = block(bm, gv, bi, bg, pick(pick(snap, gv), bm))
                out_f, out_b, dp, dsh, loss, new, kept = self._two_lanes(
                    (code, v * S + s, it, args),
                    ((code == CODES["B"]) | (bk > 0), gv * S + s, b_args), seed, split)
                gv = v if split is not None else gv  # (split: a G, in the first lane, has them)
            cst = {k: x.at[v].set(jnp.where(is_f, new[k], now[k])) for k, x in cst.items()}
            snap = {k: x.at[v, m].set(jnp.where(is_f, now[k], saved[k]))
                    for k, x in snap.items()}
            g_st = jax.tree.map(lambda g, d: g.at[gv].add(d), g_st, dp)
            g_sh = [g + d for g, d in zip(g_sh, dsh, strict=True)]
            (recv_f, recv_b), pend = exchange(tb, sends[t], (out_f, out_b), pend, self.axis, S)
            put = lambda slot, buf, new: lax.cond(
                slot >= 0, lambda b: {k: b[k].at[slot].set(new[k]) for k in b}, lambda b: b,
                buf)
            inbuf, gbuf = put(rf, inbuf, recv_f), put(rb, gbuf, recv_b)
            if keeps[0]:  # (only where the table keeps a block's own result: no copies else)
                inbuf = put(kf, inbuf, out_f)
            if keeps[1]:
                gbuf = put(kb, gbuf, out_b)
            if split is not None:
                kbuf = put(ks, kbuf, kept)
            return inbuf, gbuf, g_st, g_sh, loss_acc + loss, cst, snap, kbuf, pend

        carry = self._carry(stages, shared, colls, split)
        _, _, g_st, g_sh, loss, colls, _, _, _ = lax.fori_loop(0, tb.kind.shape[0], body, carry)
        loss, g_sh, g_st = self.reduce_grads(loss, g_sh, g_st)
        colls = average(colls, self.data_axes)
        add_stage = lambda tree: jax.tree.map(lambda x: x[None], tree)
        return loss, g_sh, add_stage(g_st), add_stage(colls)

    def collections_state(self, collections: Any) -> Any:
        """The state's ``'collections'`` of the module's ``collections`` (None: none kept)."""
        if collections:
            raise PlanError(f"{type(self).__name__} carries no mutable collections: the step "
                            "runs a model with them in the cut runtime (CutProgram)")
        return None
