"""Pipelined training step for any model: heterogeneous stages cut at module boundaries.

The micro-batch training program ``loss_fn(module.apply({'params': p}, *batch), *batch)`` is
traced once and cut into ``stages x virtual`` chunks where the plan's ``stage_of`` says
(:func:`nnscaler_jax.pipeline.cut.chunk_starts`, :func:`nnscaler_jax.pipeline.chunks.
cut_program`). Chunk ``c = v * stages + s`` runs on stage ``s``; chunks may differ in everything:
ops, parameters, and the values they pass on (several activations, or values forwarded through
intermediate chunks to a later one).

- **Parameters**: each chunk's own parameter leaves are its pieces in the in-graph programs'
  layout (:mod:`~nnscaler_jax.pipeline.packed`): flattened into one zero-padded vector per
  dtype, stacked ``[stages, virtual, width]`` and sharded over the stage axis, so a device
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

**The blocks.** :class:`CutProgram` traces the micro-batch program and cuts it
into *segments*: the pipelined chunks ``0 .. C-1`` and, for schedules with all-device blocks
(``interlaced``), an embedding segment before chunk 0 and a head segment (head + loss) after
the last chunk. The step loop is the in-graph executor's
(:meth:`~nnscaler_jax.pipeline.in_graph.InGraphRuntime._local`); this program gives it the
chunk interface (:meth:`CutProgram.chunk_forward` / :meth:`CutProgram.chunk_backward`, by
``lax.switch`` on the chunk) and the blocks only cut programs run
(:meth:`CutProgram.more_blocks`). By the table's block code a device runs one of

- ``F``: its chunk's forward (the last chunk adds the loss unless a head segment follows);
- ``B``: ``jax.vjp`` of the chunk recomputed from its saved input: parameter gradients and the
  cotangent of its input, seeded by the next chunk's (or the head's, or the loss's);
- ``B`` / ``G`` of a split backward (``zb-h1``, :mod:`~nnscaler_jax.pipeline.split_backward`):
  ``B`` the input's cotangent only, keeping what the weight gradients read in a buffer of the
  schedule's pending ``G`` s; ``G`` the chunk's weight gradients from it;
- ``N``: a forward without gradient (recycling, ``nf1b``): the model's outputs of the last
  chunk go back to chunk 0 as its inputs for the next pass (pass 0 reads the batch; ``F`` reads
  the last pass's), nothing is kept for a backward;
- ``E`` / ``H`` / ``W``: the embedding forward, the head's forward + loss + backward, the
  embedding backward, each on the stage holding its data (stage 0; the last chunk's stage;
  stage 0).

After each step the activations go to the next stage and the cotangents to the previous one
with ``lax.ppermute``, each only at the steps where some stage receives one (the tables say
which), so a step without transfers in one direction does not wait on that collective.

Gradients of parameters several segments read (tied embeddings) are summed over the stages,
the loss is counted on the stage that computes it, both averaged over the data axes.

Collections (:mod:`nnscaler_jax.pipeline.mutable`): the loop carries the stage's packed
collections ``[virtual, width]``; ``F`` reads its chunk's and replaces them with the new values
its segment returns, keeping the ones it read for its ``B`` (``[virtual, M, width]``), which
reads those and drops what it makes; the other blocks leave them alone.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.sharding import PartitionSpec as P

from nnscaler_jax.capture.module_call import ModuleCall
from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.graph import Role
from nnscaler_jax.layout import Layout
from nnscaler_jax.lower.eqns import NO_CONSTRAINTS
from nnscaler_jax.lower.manual import relayout
from nnscaler_jax.mesh.axes import mesh_axes
from nnscaler_jax.pipeline import schedule as sch
from nnscaler_jax.pipeline.chunks import pack, packing, run_chunk, unpack, widths
from nnscaler_jax.pipeline.cut import cut_traced, tp_error
from nnscaler_jax.pipeline.in_graph import InGraphRuntime
from nnscaler_jax.pipeline.in_stage import plan_in_stage, stage_parts
from nnscaler_jax.pipeline.loop_tables import CODES, loop_tables
from nnscaler_jax.pipeline.mutable import (
    require_forward_order,
    schedule_error,
    shared_error,
)
from nnscaler_jax.pipeline.packed import PackedRows
from nnscaler_jax.pipeline.program import on_host
from nnscaler_jax.pipeline.recycle import traced_program
from nnscaler_jax.pipeline.split_backward import split_backward
from nnscaler_jax.pipeline.update import place_as

__all__ = ["CutProgram", "run_segment"]


# ---- the blocks and the per-device loop ------------------------------------------------------


def _value(env: dict, v: Any) -> Any:
    return v.val if isinstance(v, jcore.Literal) else env[v]


def run_segment(prog: Any, seg: int, pvec: dict, shared: list, cin: dict, batch: list,
                fresh: Any = True, kvec: dict | None = None) -> tuple[dict, Any, dict]:
    """Segment ``seg``'s forward: ``(packed values it passes on, loss or 0, its chunk's new
    collections)`` (``kvec``: the chunk's packed collections, ``prog.coll_rows``).

    The last segment passes on the model's outputs packed for recycling (``prog.r_pack``) or
    zeros. Chunk 0 of a recycling program reads the module inputs from the batch when
    ``fresh`` (a bool, traced or not), else unpacked from ``cin`` (the last pass's outputs).
    """
    cut = prog.cut
    cj = cut.jaxpr
    invars, n_x = cj.jaxpr.invars, len(prog.x_vars)
    params = [(invars[j], x) for j, x in zip(prog.shared, shared, strict=True)]
    c = seg - prog.seg0
    chunk = 0 <= c < prog.schedule.chunks
    own = prog.coll_owned[c] if chunk else ()
    if chunk:
        params += zip([invars[j] for j in prog.owned[c]], prog.rows.blocks(pvec, c),
                      strict=True)
        params += zip([prog.coll_in[k] for k in own], prog.coll_rows.blocks(kvec or {}, c),
                      strict=True)
    if seg > 0:
        xin = unpack(cin, prog.c_pack[seg - 1])
    elif n_x:  # the module's inputs: the batch (first pass) or the recycled outputs
        prev, first = unpack(cin, prog.r_pack), batch[:n_x]  # (the module's leading inputs)
        if isinstance(fresh, bool):
            xin = first if fresh else prev
        else:
            xin = [jnp.where(fresh, b, p) for b, p in zip(first, prev, strict=True)]
    else:
        xin = []
    env = run_chunk(cut, seg, params, batch, xin, x_vars=prog.x_vars,
                    layer_starts=prog.layer_starts, recompute_layers=prog.recompute == "layer",
                    evaluate=prog.evaluator(c))
    new = pack([_value(env, prog.coll_out[k]) for k in own],
               prog.coll_rows.packs[c] if chunk else packing([]), prog.coll_rows.width)
    if seg < cut.chunks - 1:
        out = pack([env[v] for v in cut.bounds[seg]], prog.c_pack[seg], prog.c_width)
        return out, jnp.zeros((), jnp.float32), new
    loss, *outs = cj.jaxpr.outvars
    if n_x:
        out = pack(prog.whole(outs, [_value(env, v) for v in outs]), prog.r_pack,
                   prog.c_width)
    else:
        out = {dt: jnp.zeros((n,), dt) for dt, n in prog.c_width.items()}
    return out, jnp.asarray(_value(env, loss), jnp.float32), new


def _floats(prog: Any, vec: dict) -> list[str]:
    return [k for k in vec if k in prog.g_width]


def _vjp(prog: Any, seg: int, pvec: dict, shared: list, cin: dict, gout: dict, batch: list,
         seed: Any, fresh: bool, kvec: dict) -> tuple:
    """``(param grads, shared grads, cotangent of the packed input, loss / M)`` of segment
    ``seg``, seeded by the loss's cotangent ``seed`` (``scale / M``) where it computes the loss
    (else None: by ``gout``); the segment reads the collections ``kvec`` and its new ones are
    dropped."""
    fl = _floats(prog, cin)
    rest = {k: x for k, x in cin.items() if k not in fl}

    def f(pv, sh, cf):
        out, loss, _ = run_segment(prog, seg, pv, sh, {**rest, **cf}, batch, fresh, kvec)
        return {k: out[k] for k in fl}, loss

    (_, loss), vjp = jax.vjp(f, pvec, shared, {k: cin[k] for k in fl})
    M = prog.schedule.microbatches
    gy = {k: jnp.zeros_like(cin[k]) if seed is not None else gout[k] for k in fl}
    gp, gsh, gc = vjp((gy, jnp.asarray(0.0 if seed is None else seed, jnp.float32)))
    gc = {k: gc.get(k, jnp.zeros((n,), k)) for k, n in prog.g_width.items()}
    return gp, gsh, gc, loss / M


class _Split:
    """The split backwards of a cut program's chunks (``G`` blocks): per chunk its
    :class:`~nnscaler_jax.pipeline.split_backward.BackwardSplit` and the packing of its kept
    values, and the kept-values buffer's width per dtype (the widest chunk's)."""

    def __init__(self, prog: Any, args: tuple):
        C, last_seg, seg0 = prog.schedule.chunks, prog.cut.chunks - 1, prog.seg0

        def backward(c, pv, sh, cin, gout, bm, kv, seed):
            gp, gsh, gc, _ = _vjp(prog, c + seg0, pv, sh, cin, gout, bm,
                                  seed if c + seg0 == last_seg else None, True, kv)
            return (gp, gsh), gc

        # G reads the parameters, the micro-batch, the collections F read and the seed as
        # they are (unchanged over the step); the input and its cotangent through B
        self.parts = [split_backward(partial(backward, c), args, available=(0, 1, 4, 5, 6))
                      for c in range(C)]
        self.packs = [packing(p.kept_avals) for p in self.parts]
        self.width = widths(self.packs)

    def input_grads(self, c: int, args: tuple, seed: Any) -> tuple[dict, dict]:
        gc, kept = self.parts[c].input_grads(*args[:6], seed)
        return gc, pack(kept, self.packs[c], self.width)

    def weight_grads(self, c: int, args: tuple, seed: Any) -> tuple:
        pv, sh, _, _, bm, kv, kept = args
        return self.parts[c].weight_grads((pv, sh, None, None, bm, kv, seed),
                                          unpack(kept, self.packs[c]))


# ---- the program -----------------------------------------------------------------------------


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
        self.layer_rules = dict(layer_rules)  # layer -> recomputed on its own (rules.py)
        self._setup(module, loss_fn, mesh, sched, batch, policy=policy, recompute=recompute)
        if self.tp_axes and sched.all_device:
            raise tp_error(self.tp_axes, sched.name)
        if sched.recycles and sched.all_device:
            raise PlanError(f"schedule {sched.name!r} has both recycling passes ('N') and "
                            "all-device blocks ('E' / 'H' / 'W'); the runtime runs one or the "
                            "other: use nf1b or interlaced")
        call = call or ModuleCall.plain(module, params)
        if sched.recycles and call.collections:
            raise schedule_error(sched, [jax.tree_util.keystr(k) for k, _ in
                                         jax.tree_util.tree_leaves_with_path(call.collections)])
        closed, abstract = traced_program(self, params, batch, call)
        if self.coll_avals and self.tp_axes:
            raise tp_error(self.tp_axes, sched.name, self.coll_paths)
        if self.coll_avals:
            if sched.all_device:
                raise schedule_error(sched, self.coll_paths)
            require_forward_order(sched)
        self.leaf_layout: dict[int, Layout] = {}  # owned leaf -> its blocks' layout (TP)
        self._cut(closed, abstract, stage_of)
        self.stage_plans: tuple = ()
        if self.tp_axes:
            self._plan_stages(closed, policy, rules, budget, stage_plans)
        self.g_width = {k: n for k, n in self.c_width.items() if _floating(k)} or {"float32": 1}
        self.tables = loop_tables(sched, "FBNEHWG", overlap=overlap)

    def _cut(self, closed: Any, abstract: list, stage_of: tuple) -> None:
        """Cut the traced program at ``stage_of``'s segments and lay out what each chunk owns:
        parameters (``owned``, ``rows``; the rest ``shared``), collections (``coll_owned``,
        ``coll_rows``) and the values crossing boundaries (``c_pack``)."""
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
        self.rows = self._rows_for(abstract)
        self.coll_rows = PackedRows(self.mesh, self.axis, (), sched.stages, sched.virtual,
                                    [[self.coll_avals[k] for k in own]
                                     for own in self.coll_owned])
        jx = cut.jaxpr.jaxpr
        self.coll_in, self.coll_out = jx.invars[np_:np_ + nc], jx.outvars[1:1 + nc]
        self.c_pack = [packing([v.aval for v in b]) for b in cut.bounds]
        self.r_pack = packing([v.aval for v in jx.outvars[1:]]) if self.x_vars else None
        self.c_width = widths(self.c_pack + [self.r_pack] * bool(self.x_vars)) or {"float32": 1}

    # ---- parameter layout --------------------------------------------------------------------

    def _plan_stages(self, closed: Any, policy: Any, rules: tuple, budget: float | None,
                     given: tuple) -> None:
        """Tensor-parallel stages: each stage's in-stage plan (:func:`~nnscaler_jax.pipeline.
        in_stage.plan_in_stage`, its chunks run on each device's blocks), where each value
        its chunks read is made (another stage's layout, carried across as those blocks;
        leaves several stages read come whole), and the packings of the blocks: each owned
        leaf's as its stage's plan stores it, each boundary value's as it is made."""
        S, C = self.schedule.stages, self.schedule.chunks
        self.stage_plans = tuple(plan_in_stage(
            closed, self.param_paths, len(self.param_avals), self.mesh, self.axis, policy,
            root=type(self.module).__name__, rules=rules, manual=True,
            stages=stage_parts(self.cut, tuple(c % S for c in range(C)), self.schedule,
                               budget, given)))
        lows = [sp.constraints.lowering for sp in self.stage_plans]
        made = {t.id: low.layouts[t.id] for low in lows for op in low.graph.walk()
                for t in op.outputs if t.id in low.layouts}
        index = {f"params/{p}": j for j, p in enumerate(self.param_paths)}
        shared = set(self.shared)
        for low in lows:
            for t in low.graph.inputs:
                if index.get(t.name) in shared:
                    low.layouts[t.id] = Layout.replicated(t.ndim)
                elif t.role is not Role.VARIABLE and t.id in made:
                    low.layouts[t.id] = made[t.id]
        self._spec = lows[0].mesh_spec
        for c, own in enumerate(self.owned):
            for j in own:
                spec = self.stage_plans[c % S].var_specs[j]
                self.leaf_layout[j] = Layout.from_pspec(spec, len(self.param_avals[j].shape))
        self.rows = self._rows_for(self.param_avals)  # (as the plans store them)
        self._made = made
        local = lambda v: jax.ShapeDtypeStruct(
            (self._made_layout(v) or Layout.replicated(v.aval.ndim))
            .local_shape(v.aval.shape, self._spec), v.aval.dtype)
        self.c_pack = [packing([local(v) for v in b]) for b in self.cut.bounds]
        self.c_width = widths(self.c_pack + [self.r_pack] * bool(self.x_vars)) \
            or {"float32": 1}

    def whole(self, vars_: list, values: list) -> list:
        """The model's outputs recycled to chunk 0 (``nf1b``), whole: on tensor-parallel
        stages gathered from the blocks they were made in (chunk 0 reads the module's inputs
        whole)."""
        if not self.tp_axes:
            return values
        sizes = mesh_axes(self.mesh)
        out = []
        for v, x in zip(vars_, values, strict=True):
            lay = self._made_layout(v)
            out.append(x if lay is None or not lay.split_axes else
                       relayout(x, lay, Layout.replicated(lay.ndim), sizes))
        return out

    def _made_layout(self, v: Any) -> Layout | None:
        """The layout of the blocks jaxpr variable ``v`` is made in on tensor-parallel
        stages (None: no op of the plans makes it)."""
        t = self.stage_plans[0].constraints.sources.tensors.get(v)
        return None if t is None else self._made.get(t.id)

    def evaluator(self, c: int) -> Callable:
        """How chunk ``c``'s equations run: as they are (stages data-parallel inside), or on
        each device's blocks under its stage's plan (tensor-parallel stages)."""
        if not self.stage_plans or not 0 <= c < self.schedule.chunks:
            return NO_CONSTRAINTS.evaluate
        return self.stage_plans[c % self.schedule.stages].evaluate

    def _rows_for(self, avals: list) -> PackedRows:
        return PackedRows(self.mesh, self.axis, self.tp_axes, self.schedule.stages,
                          self.schedule.virtual, [[avals[j] for j in own] for own in self.owned],
                          [[self.leaf_layout.get(j) for j in own] for own in self.owned])

    def _pieces(self, leaves: list) -> list[list]:
        return [[leaves[j] for j in own] for own in self.owned]

    def _leaves(self, pieces: list[list], shared: list, n: int) -> list:
        out: list[Any] = [None] * n
        for j, x in zip(self.shared, shared, strict=True):
            out[j] = x
        for own, ps in zip(self.owned, pieces, strict=True):
            for j, x in zip(own, ps, strict=True):
                out[j] = x
        return out

    def _where(self, c: int) -> tuple[int, int]:
        return c % self.schedule.stages, c // self.schedule.stages

    def collections_to_pipeline(self, colls: Any) -> dict:
        """The collections' plain tree -> ``{'shared': [], 'stages': {dtype: [S, V, width]}}``:
        each leaf where the chunk reading it keeps its parameters."""
        rows = self.coll_rows
        got = self._on_host(lambda ls: rows.to_rows([[ls[k] for k in own]
                                                     for own in self.coll_owned]),
                            jax.tree.leaves(colls))
        return {"shared": [], "stages": {dt: jax.device_put(x, rows.sharding)
                                         for dt, x in got.items()}}

    def collections_from_pipeline(self, pc: dict, spread: bool = False) -> Any:
        """The inverse of :meth:`collections_to_pipeline`."""
        def leaves(stages):
            out: list[Any] = [None] * len(self.coll_avals)
            for own, ps in zip(self.coll_owned, self.coll_rows.from_rows(stages), strict=True):
                for k, x in zip(own, ps, strict=True):
                    out[k] = x
            return out

        got = self._on_host(leaves, pc["stages"])
        return jax.tree.unflatten(self.coll_tree, [self.module_leaf(x, spread) for x in got])

    @staticmethod
    def _on_host(fn: Callable, tree: Any) -> Any:
        got = on_host(fn, tree)
        if got is None:
            raise PlanError("the cut program lays its mutable collections out on the host, "
                            "and these arrays are not all in this process (several "
                            "processes); pass every process the whole collections (e.g. "
                            "module.init on each)")
        return got

    def stage_bytes(self) -> list[int]:
        """Per stage, the bytes of its own parameters (without padding or shared leaves)."""
        out = [0] * self.schedule.stages
        for c, own in enumerate(self.owned):
            out[self._where(c)[0]] += sum(int(np.prod(self.param_avals[j].shape, dtype=np.int64))
                                          * np.dtype(self.param_avals[j].dtype).itemsize
                                          for j in own)
        return out

    # ---- the step ----------------------------------------------------------------------------

    @property
    def act(self) -> dict:
        """An activation-buffer entry: the packed boundary values, ``{dtype: (width,)}``."""
        return {k: jax.ShapeDtypeStruct((n,), k) for k, n in self.c_width.items()}

    @property
    def cot(self) -> dict:
        """A cotangent-buffer entry: their floating part packed, ``{dtype: (width,)}``."""
        return {k: jax.ShapeDtypeStruct((n,), k) for k, n in self.g_width.items()}

    def _fresh(self, c: int) -> bool:
        """Chunk ``c``'s F / B read the batch, not the last recycling pass's outputs."""
        return c > 0 or not self.x_vars

    def chunk_forward(self, c: Any, args: tuple) -> tuple[dict, Any, dict]:
        """Chunk ``c``'s segment forward (:func:`run_segment`), by ``lax.switch`` on ``c``;
        chunk 0 of a recycling program reads the last pass's outputs."""
        fwds = [partial(lambda c, *a: run_segment(self, c + self.seg0, *a[:3], a[4],
                                                  self._fresh(c), a[5]), c)
                for c in range(self.schedule.chunks)]
        return lax.switch(c, fwds, *args)

    def chunk_backward(self, c: Any, args: tuple, seed: Any, split: Any) -> tuple:
        """Chunk ``c``'s segment backward (:func:`_vjp`, or ``split``'s input cotangent)."""
        C, last_seg, seg0 = self.schedule.chunks, self.cut.chunks - 1, self.seg0
        if split is not None:  # the input's cotangent; the weight gradients in G
            gc, kept = lax.switch(c, [partial(split.input_grads, c, seed=seed)
                                      for c in range(C)], args)
            return None, None, gc, kept
        bwds = [partial(lambda c, *a: _vjp(self, c + seg0, *a[:5],
                                           seed if c + seg0 == last_seg else None,
                                           self._fresh(c), a[5]), c)
                for c in range(C)]
        gp, gsh, gc, _ = lax.switch(c, bwds, *args)
        return gp, gsh, gc, None

    def backward_split(self, args: tuple) -> _Split:
        return _Split(self, args)

    def more_blocks(self, c: Any, it: Any, args: tuple, seed: Any, split: Any
                    ) -> dict[int, Callable]:
        """``N`` (recycling pass ``it``: chunk 0 reads the batch on pass 0), ``E`` / ``H`` /
        ``W`` (the embedding and head segments) and ``G`` (a split backward's weight
        gradients), as the schedule has them."""
        pv, shared, cin, gout, bm, _, _ = args
        C, last_seg = self.schedule.chunks, self.cut.chunks - 1
        result = partial(self.block_result, args)
        out: dict[int, Callable] = {}
        if self.x_vars:
            nfwds = [partial(lambda c, *a: run_segment(self, c + self.seg0, *a[:3], a[4],
                                                       (it == 0) if c == 0 else True,
                                                       a[5])[0], c)
                     for c in range(C)]
            out[CODES["N"]] = lambda: result(out=lax.switch(c, nfwds, *args))
        if self.seg0:
            def head():
                _, gsh, gc, loss = _vjp(self, last_seg, pv, shared, cin, gout, bm, seed, True,
                                        {})
                return result(gc=gc, gsh=gsh, loss=loss)

            def embed_bwd():
                _, gsh, _, _ = _vjp(self, 0, pv, shared, cin, gout, bm, None, True, {})
                return result(gsh=gsh)

            out[CODES["E"]] = lambda: result(out=run_segment(self, 0, pv, shared, cin, bm)[0])
            out[CODES["H"]], out[CODES["W"]] = head, embed_bwd
        if split is not None:
            def wgrad():
                gp, gsh = lax.switch(c, [partial(split.weight_grads, c, seed=seed)
                                         for c in range(C)], args)
                return result(gp=gp, gsh=gsh)

            out[CODES["G"]] = wgrad
        return out

    def grads(self, pp: dict, batch: tuple, key: Any = None,
              colls: dict | None = None, *, scale: Any = 1.0) -> tuple:
        """Mean loss over the batch and its gradients (of ``scale x`` the loss, float16's loss
        scaling) in the pipeline layout (traceable);
        ``key``: the step's key, when the program was traced with rng streams; ``colls``: the
        collections in the pipeline layout (:meth:`collections_to_pipeline`), when the
        program has any: then also their new values, ``(loss, grads, new collections)``."""
        placed, batch_spec, seed = self.microbatches(batch, key, scale)
        cst = {} if colls is None else colls["stages"]
        shared_spec = [P()] * len(pp["shared"])
        stage_spec = {k: self.rows.sharding.spec for k in pp["stages"]}
        coll_spec = {k: P(self.axis) for k in cst}
        fn = jax.shard_map(self._local, mesh=self.mesh,
                           in_specs=(shared_spec, stage_spec, batch_spec, coll_spec, P()),
                           out_specs=(P(), shared_spec, stage_spec, coll_spec), check_vma=False)
        rep, st, ct = self.shardings()[0], self.rows.sharding, self.coll_rows.sharding
        loss, gs, gst, new = fn([place_as(x, rep) for x in pp["shared"]],
                                {k: place_as(x, st) for k, x in pp["stages"].items()},
                                placed, {k: place_as(x, ct) for k, x in cst.items()}, seed)
        grads = {"shared": gs, "stages": gst}
        if colls is None:
            return loss, grads
        return loss, grads, {"shared": [], "stages": new}

    def collections_state(self, collections: Any) -> dict | None:
        """The collections in the pipeline layout (:meth:`collections_to_pipeline`) when the
        program has any."""
        return self.collections_to_pipeline(collections) if self.coll_avals else None
