"""Pipelined training step for any model: heterogeneous stages cut at module boundaries.

The micro-batch training program ``loss_fn(module.apply({'params': p}, *batch), *batch)`` is
traced once and cut into ``stages x virtual`` chunks where the plan's ``stage_of`` says
(:func:`nnscaler_jax.pipeline.cut.chunk_starts`, :func:`nnscaler_jax.pipeline.chunks.
cut_program`). Chunk ``c = v * stages + s`` runs on stage ``s``; chunks may differ in everything:
ops, parameters, and the values they pass on (several activations, or values forwarded through
intermediate chunks to a later one).

- **Parameters**: each chunk's own parameter leaves are flattened into one zero-padded vector
  per dtype, stacked ``[stages, virtual, width]`` and sharded over the stage axis, so a device
  stores only its stage's parameters (the padding's gradient is 0, so optax keeps it 0). Leaves
  several chunks read (tied embeddings) are replicated, their gradients summed over stages.
- **Boundaries**: the values crossing a boundary travel packed in one flat vector per dtype, as
  wide as the widest boundary; cotangents likewise (floating dtypes only).
- **Step**: inside one ``jax.shard_map`` a ``lax.fori_loop`` walks the schedule's step table
  (:func:`nnscaler_jax.pipeline.loop_tables.loop_tables`, as the identical-layer runtime);
  ``lax.switch`` on the chunk index runs the device's chunk: forward, or backward as ``jax.vjp``
  of the chunk recomputed from its saved input; ``lax.ppermute`` moves the packed vectors to the
  neighbours. Gradients are averaged over the data axes and the optax update runs in the same
  jitted step. Stages are data-parallel inside (tensor-parallel stages run one program per
  stage: :mod:`nnscaler_jax.pipeline.mpmd`).
- **Collections** (BatchNorm statistics): each leaf is laid out like the parameters of the
  chunk reading it (``state['collections']``), updated by that chunk's forwards in micro-batch
  order and averaged over the data axes at the end of the step (:mod:`nnscaler_jax.pipeline.
  mutable`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnscaler_jax.errors import PlanError
from nnscaler_jax.pipeline import schedule as sch
from nnscaler_jax.pipeline.chunks import pack, packing, unpack, widths
from nnscaler_jax.pipeline.cut import cut_traced, tp_error
from nnscaler_jax.pipeline.cut_blocks import local_step
from nnscaler_jax.pipeline.in_graph import InGraphRuntime
from nnscaler_jax.pipeline.loop_tables import loop_tables
from nnscaler_jax.pipeline.mutable import require_forward_order, schedule_error, shared_error
from nnscaler_jax.pipeline.program import (
    ModuleCall,
    micro_leaves,
)
from nnscaler_jax.pipeline.recycle import traced_program
from nnscaler_jax.pipeline.update import (
    mirror_store,
    place_as,
)

__all__ = ["CutProgram"]


def _floating(dt: str) -> bool:
    return jnp.issubdtype(np.dtype(dt), jnp.inexact)


class CutProgram(InGraphRuntime):
    """A pipelined training program of a model cut into heterogeneous chunks.

    An :class:`~nnscaler_jax.pipeline.in_graph.InGraphRuntime`: :meth:`to_pipeline` /
    :meth:`from_pipeline` move parameters between the module's tree and the pipeline layout
    ``{'shared': [leaves], 'stages': {dtype: [stages, virtual, width]}}``, :meth:`grads` gives
    the loss and gradients, :meth:`train_step` the jitted optax step.
    """

    def __init__(self, module: Any, loss_fn: Callable, mesh: Any, sched: sch.Schedule,
                 params: Any, batch: tuple, *, stage_of: tuple, policy: Any = None,
                 rules: tuple = (), call: ModuleCall | None = None, recompute: str = "chunk",
                 layer_rules: tuple = (), budget: float | None = None,
                 stage_plans: tuple = (), overlap: bool = False):
        del rules, budget, stage_plans  # (stages data-parallel inside; recompute: layer_rules)
        self.layer_rules = dict(layer_rules)  # layer -> recomputed on its own (rules.py)
        self._setup(module, loss_fn, mesh, sched, batch, policy=policy, recompute=recompute)
        if self.tp_axes:
            raise tp_error(self.tp_axes)
        if sched.recycles and sched.all_device:
            raise PlanError(f"schedule {sched.name!r} has both recycling passes ('N') and "
                            "all-device blocks ('E' / 'H' / 'W'); the runtime runs one or the "
                            "other: use nf1b or interlaced")
        call = call or ModuleCall.plain(module, params)
        if sched.recycles and call.collections:
            raise schedule_error(sched, [jax.tree_util.keystr(k) for k, _ in
                                         jax.tree_util.tree_leaves_with_path(call.collections)])
        closed, abstract = traced_program(self, params, batch, call)
        if self.coll_avals:
            if sched.all_device:
                raise schedule_error(sched, self.coll_paths)
            require_forward_order(sched)
        self._cut(closed, abstract, stage_of)
        self.g_width = {k: n for k, n in self.c_width.items() if _floating(k)} or {"float32": 1}
        self.tables = loop_tables(sched, "FBNEHWG", overlap=overlap)

    def _cut(self, closed: Any, abstract: list, stage_of: tuple) -> None:
        """Cut the traced program at ``stage_of``'s segments and lay out what each chunk owns:
        parameters (``owned``, ``p_pack``; the rest ``shared``), collections (``coll_owned``,
        ``coll_pack``) and the values crossing boundaries (``c_pack``)."""
        sched, C = self.schedule, self.schedule.chunks
        np_, nc = len(abstract), len(self.coll_avals)
        self.seg0 = int(sched.all_device)  # the embedding segment comes first (interlaced)
        cut, self.layer_starts = cut_traced(
            closed, np_ + nc, type(self.module).__name__, stage_of, sched,
            layer_rules=self.layer_rules, recompute=self.recompute, made_first=self.x_vars,
            carried=[(np_ + k, 1 + k) for k in range(nc)])
        self.cut = cut
        # chunk c is segment c + seg0; the embedding / head segments' parameters are shared
        owned = cut.owned[self.seg0:self.seg0 + C]
        self.owned = tuple(tuple(j for j in own if j < np_) for own in owned)
        self.coll_owned = tuple(tuple(j - np_ for j in own if j >= np_) for own in owned)
        outside = [j for k, own in enumerate(cut.owned)
                   if not self.seg0 <= k < self.seg0 + C for j in own]
        self.shared = tuple(sorted(cut.shared + tuple(outside)))
        late = [k for c, own in enumerate(self.coll_owned) for k in own
                if cut.out_made[1 + k] > c + self.seg0]
        bad = [j - np_ for j in self.shared if j >= np_] + late
        if bad:
            raise shared_error([self.coll_paths[k] for k in bad])
        self.param_avals = abstract
        self.p_pack = [packing([abstract[j] for j in own]) for own in self.owned]
        self.p_width = widths(self.p_pack)
        self.coll_pack = [packing([self.coll_avals[k] for k in own]) for own in self.coll_owned]
        self.coll_width = widths(self.coll_pack)
        jx = cut.jaxpr.jaxpr
        self.coll_in, self.coll_out = jx.invars[np_:np_ + nc], jx.outvars[1:1 + nc]
        self.c_pack = [packing([v.aval for v in b]) for b in cut.bounds]
        self.r_pack = packing([v.aval for v in jx.outvars[1:]]) if self.x_vars else None
        self.c_width = widths(self.c_pack + [self.r_pack] * bool(self.x_vars)) or {"float32": 1}

    # ---- parameter layout --------------------------------------------------------------------

    def _where(self, c: int) -> tuple[int, int]:
        return c % self.schedule.stages, c // self.schedule.stages

    def to_pipeline(self, params: Any) -> dict:
        """Module params -> ``{'shared': [...], 'stages': {dtype: [S, V, width]}}`` on the mesh."""
        return self._stack(jax.tree.leaves(params), self.owned, self.p_pack, self.p_width,
                           self.shared)

    def from_pipeline(self, pp: dict) -> Any:
        """The inverse of :meth:`to_pipeline` (a module params tree)."""
        out = self._unstack(pp, self.owned, self.p_pack, self.shared, len(self.param_avals))
        return jax.tree.unflatten(self.params_tree, out)

    def collections_to_pipeline(self, colls: Any) -> dict:
        """The collections' plain tree -> ``{'shared': [], 'stages': {dtype: [S, V, width]}}``:
        each leaf where the chunk reading it keeps its parameters."""
        return self._stack(jax.tree.leaves(colls), self.coll_owned, self.coll_pack,
                           self.coll_width, ())

    def collections_from_pipeline(self, pc: dict) -> Any:
        """The inverse of :meth:`collections_to_pipeline`."""
        out = self._unstack(pc, self.coll_owned, self.coll_pack, (), len(self.coll_avals))
        return jax.tree.unflatten(self.coll_tree, out)

    def _stack(self, leaves: list, owned: tuple, packs: list, width: dict,
               shared: tuple) -> dict:
        """``leaves[owned[c]]`` packed into chunk ``c``'s row, ``leaves[shared]`` replicated."""
        to_layout, _ = self._packed(owned, packs, width, shared, len(leaves))
        with jax.default_device(jax.devices("cpu")[0]):  # packed on the host, as before: not
            pp = to_layout([np.asarray(x) for x in leaves])  # the whole model on one device
        rep, st = self.shardings()
        return {"shared": [jax.device_put(x, rep) for x in pp["shared"]],
                "stages": {dt: jax.device_put(x, st) for dt, x in pp["stages"].items()}}

    def _unstack(self, pp: dict, owned: tuple, packs: list, shared: tuple, n: int) -> list:
        """The leaves :meth:`_stack` laid out in ``pp``."""
        _, to_module = self._packed(owned, packs, {}, shared, n)
        out = to_module({"shared": pp["shared"],
                         "stages": {dt: np.asarray(x) for dt, x in pp["stages"].items()}})
        return [jnp.asarray(x) for x in out]

    def _packed(self, owned: tuple, packs: list, width: dict, shared: tuple,
                n: int) -> tuple[Callable, Callable]:
        """Traceable ``(to_layout, to_module)``: ``n`` leaves <-> ``{'shared': [...],
        'stages': {dtype: [S, V, width]}}`` (chunk ``c``'s leaves ``owned[c]`` packed as
        ``packs[c]`` in row ``(c % S, c // S)``)."""
        S, V = self.schedule.stages, self.schedule.virtual

        def to_layout(leaves: list) -> dict:
            rows = [[None] * V for _ in range(S)]
            for c, (own, pk) in enumerate(zip(owned, packs, strict=True)):
                s, v = self._where(c)
                rows[s][v] = pack([leaves[j] for j in own], pk, width)
            return {"shared": [leaves[j] for j in shared],
                    "stages": {dt: jnp.stack([jnp.stack([r[dt] for r in row]) for row in rows])
                               for dt in width}}

        def to_module(pp: dict) -> list:
            out: list[Any] = [None] * n
            for j, x in zip(shared, pp["shared"], strict=True):
                out[j] = x
            for c, (own, pk) in enumerate(zip(owned, packs, strict=True)):
                s, v = self._where(c)
                row = {dt: x[s, v] for dt, x in pp["stages"].items()}
                for j, x in zip(own, unpack(row, pk), strict=True):
                    out[j] = x
            return out

        return to_layout, to_module

    def layout(self, avals: list) -> tuple[Callable, Callable]:
        """Traceable ``(to_layout, to_module)`` between parameter leaves shaped as ``avals``
        and the packed layout of :meth:`to_pipeline` (the optimizer probe's miniatures)."""
        packs = [packing([avals[j] for j in own]) for own in self.owned]
        return self._packed(self.owned, packs, widths(packs), self.shared, len(avals))

    def mini_shapes(self) -> list[tuple[int, ...]]:
        """Per parameter leaf, its miniature's shape in the optimizer probe (2 per dim)."""
        return [(2,) * len(a.shape) for a in self.param_avals]

    def stage_bytes(self) -> list[int]:
        """Per stage, the bytes of its own parameters (without padding or shared leaves)."""
        out = [0] * self.schedule.stages
        for c, own in enumerate(self.owned):
            out[self._where(c)[0]] += sum(int(np.prod(self.param_avals[j].shape, dtype=np.int64))
                                          * np.dtype(self.param_avals[j].dtype).itemsize
                                          for j in own)
        return out

    # ---- the step ----------------------------------------------------------------------------

    def _local(self, shared: list, stages: dict, batch: list, colls: dict,
               seed: Any) -> tuple:
        """Per-device body of the shard_map (:func:`~nnscaler_jax.pipeline.cut_blocks.
        local_step`)."""
        return local_step(self, shared, stages, batch, colls, seed)

    def grads(self, pp: dict, batch: tuple, key: Any = None,
              colls: dict | None = None, *, scale: Any = 1.0) -> tuple:
        """Mean loss over the batch and its gradients (of ``scale x`` the loss, float16's loss
        scaling) in the pipeline layout (traceable);
        ``key``: the step's key, when the program was traced with rng streams; ``colls``: the
        collections in the pipeline layout (:meth:`collections_to_pipeline`), when the
        program has any: then also their new values, ``(loss, grads, new collections)``."""
        data = self.data_axes if self.data_axes else None
        shaped = micro_leaves(self, batch, key)  # [M, D, b, ...] (+ keys [M, D])
        cst = {} if colls is None else colls["stages"]
        shared_spec = [P()] * len(pp["shared"])
        stage_spec = {k: P(self.axis) for k in pp["stages"]}
        coll_spec = {k: P(self.axis) for k in cst}
        batch_spec = [P(None, data)] * len(shaped)
        fn = jax.shard_map(self._local, mesh=self.mesh,
                           in_specs=(shared_spec, stage_spec, batch_spec, coll_spec, P()),
                           out_specs=(P(), shared_spec, stage_spec, coll_spec), check_vma=False)
        rep, st = self.shardings()
        loss, gs, gst, new = fn([place_as(x, rep) for x in pp["shared"]],
                                {k: place_as(x, st) for k, x in pp["stages"].items()},
                                [place_as(x, NamedSharding(self.mesh, sp))
                                 for x, sp in zip(shaped, batch_spec, strict=True)],
                                {k: place_as(x, st) for k, x in cst.items()},
                                jnp.asarray(scale, jnp.float32) / self.schedule.microbatches)
        grads = {"shared": gs, "stages": gst}
        if colls is None:
            return loss, grads
        return loss, grads, {"shared": [], "stages": new}

    @functools.cached_property
    def _store(self) -> Callable[[Any], Any]:
        """``tree -> tree``: params, or optimizer state mirroring them, laid out as stored: the
        stages' packed rows split over the stage axis, the rest replicated
        (:func:`~nnscaler_jax.pipeline.update.mirror_store`)."""
        rep, st = self.shardings()
        S, V = self.schedule.stages, self.schedule.virtual
        shapes = {"stages": {k: jax.ShapeDtypeStruct((S, V, w), np.float32)
                             for k, w in self.p_width.items()}}
        return mirror_store(shapes, {"stages": {k: st for k in self.p_width}}, rep)

    def collections_state(self, collections: Any) -> dict | None:
        """The collections in the pipeline layout (:meth:`collections_to_pipeline`) when the
        program has any."""
        return self.collections_to_pipeline(collections) if self.coll_avals else None
