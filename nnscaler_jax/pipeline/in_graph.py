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
``lax.switch`` on the chunk, stages data-parallel inside). :class:`InGraphRuntime` is what they
share: the stored layout's shardings, the jitted step, the initial state, the step's XLA
options.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnscaler_jax.errors import PlanError
from nnscaler_jax.pipeline.program import PipelineRuntime, micro_leaves
from nnscaler_jax.pipeline.update import cached_view, initial_state, jitted_step, place_as

__all__ = ["OVERLAP_OPTIONS", "InGraphRuntime", "compiler_options", "exchange", "send_if"]


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
    _setup`, their step table as ``tables``) and give the parameter layout
    (:meth:`to_pipeline`, ``_store``: how parameters and optimizer state mirroring them are
    stored) and :meth:`grads` (the ``shard_map`` running the table); the step, the state and
    the shardings are this class's.
    """

    axis: str
    tables: Any

    @property
    @abc.abstractmethod
    def _store(self) -> Callable[[Any], Any]:
        """``tree -> tree``: params, or optimizer state mirroring them, laid out as stored
        (:func:`~nnscaler_jax.pipeline.update.mirror_store`)."""

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
                                                                              self.mesh))

    def init_state(self, params: Any, optimizer: Any, collections: Any = None) -> dict:
        """``{'params': to_pipeline(params), 'opt_state': optimizer.init(...)}``, laid out as
        the step returns them, and ``'collections'`` (:meth:`collections_state`) when the
        program carries any."""
        colls = self.collections_state(collections)  # (refused before any layout work)
        return initial_state(self.to_pipeline(params), optimizer, self.mesh, collections=colls,
                             store=self._store, view=self._view(optimizer))

    def microbatches(self, batch: tuple, key: Any, scale: Any) -> tuple[list, list, Any]:
        """The ``shard_map``'s batch arguments: the batch's leaves as ``[M, D, b, ...]`` (and
        the micro-batches' keys: :func:`~nnscaler_jax.pipeline.program.micro_leaves`) placed
        split over the data axes, their specs, and the loss's cotangent per micro-batch
        (``scale / M``: the backward's seed)."""
        data = self.data_axes if self.data_axes else None
        shaped = micro_leaves(self, batch, key)
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

    def collections_state(self, collections: Any) -> Any:
        """The state's ``'collections'`` of the module's ``collections`` (None: none kept)."""
        if collections:
            raise PlanError(f"{type(self).__name__} carries no mutable collections: the step "
                            "runs a model with them in the cut runtime (CutProgram)")
        return None
