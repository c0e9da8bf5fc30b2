"""Cost tables of a search space: per group and strategy, per edge and strategy pair.

Everything is priced through :class:`~nnscaler_jax.cost.model.CostModel` exactly as
``CostModel.plan_cost`` prices a finished plan, so the ILP objective of a choice equals the plan's
predicted step time (plus, inside ``scan`` bodies, the per-iteration cost times the trip count,
and the relayouts between a ``scan`` op and its body):

- unary (one group's choice): compute ``op_time`` of every member; activation bytes; for the
  first reader of a model variable: gradient synchronisation, the variable's bytes in the layout
  it is stored in (how that reader reads it; ZeRO-3 also shards it over its data-parallel axes,
  ``plan.zero.zero3_layout(..., joint=False)`` as ``plan_cost`` prices it) and the
  relayout from storage; example inputs relayout from replicated; relayouts between members of
  one group (a follower dropping its producer's partial sums pays the all-reduce here);
- edges (two groups' choices): ``reshard_time`` of each tensor from the producer's output layout
  to the consumer's input layout (and later readers of a variable from its storage layout). A
  value read by one op, or by sibling ops deciding as one group (q / k / v of one input), folds
  the readers' gradient reduction into its edge: the gradient goes from the partial sums to the
  producer's layout in one path (a reduce-scatter where an all-reduce and a slice would cost
  twice as much), once for the siblings, as ``plan_cost`` takes it;
- relayout sets: a value read by several ops that decide apart is relaid out once per
  (producer layout, reader layout), its gradient's way back too, as XLA's SPMD partitioner
  reshards an instruction once per target sharding and ``plan_cost`` prices it: a
  :class:`~nnscaler_jax.search.objective.SyncSet` whose classes are those layout pairs (one
  continuous variable per class, at least 1 when a reader and the producer pick it);
- gradient syncs: ``grad_sync_time`` of every other operand a consumer splits over mesh axes it
  reads it replicated on (the data-parallel all-reduce of a weight, Megatron's backward
  all-reduce of an activation read by several ops). ``plan_cost`` reduces a tensor's gradient
  once per gradient layout, however many readers hand it back, so a tensor read by several ops
  gets one continuous variable per gradient layout, ``z >= s`` of every reader strategy
  producing it (linear; a lone reader's reduction and relayout are two steps here, one path in
  ``plan_cost``: random choices of the tiny models within 0.3% of it).

Ops inside a remat (``checkpoint``) boundary keep no activations and run their forward twice;
while a recomputed block's backward runs, its ops' residuals are live again at once: per block,
the sum of its groups' residual bytes bounds the peak's transient from below
(``CostTables.remat``), as ``plan_cost`` takes the block's transient, with the operands its
matmuls gather again when its forward reruns (edges whose ``block`` is the block's index;
:mod:`~nnscaler_jax.search.blocks`); the
relayouts into its recomputed ops run again too (their forward seconds twice on the edges, as
``plan_walk.relayout_reruns``). A tensor that readers in several groups keep gathered (for their
transposes, or again in a recomputed block) is a gather set (``CostTables.gathers``): one copy
per layout, as ``plan_cost`` keeps them.

Copies of a layer have equal costs; they are computed once (memoized by isomorphism key), for
the Alpa-style planner too, so the two planners differ only in their ILPs.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np

from nnscaler_jax.cost.compute import grad_tensors
from nnscaler_jax.cost.fusion import fused_bytes
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.cost.plan_walk import boundary_kinds
from nnscaler_jax.cost.relayout import drop_partial, partial_grad_axes
from nnscaler_jax.cost.residuals import (
    residual_forms,
    residual_outputs,
    residual_readers,
    residual_reads,
)
from nnscaler_jax.ir.coshard import chunks_of
from nnscaler_jax.ir.graph import Graph, Op, Role, Tensor
from nnscaler_jax.ir.regions import weight_origins
from nnscaler_jax.ir.remat import remat_roles
from nnscaler_jax.layout import Layout
from nnscaler_jax.plan.layouts import lift, op_layouts, scan_stored_inputs, sole_read_variables
from nnscaler_jax.plan.plan import OpPlan
from nnscaler_jax.plan.zero import zero3_layout
from nnscaler_jax.search.blocks import BlockPricing, block_inputs, remat_ops
from nnscaler_jax.search.edges import EdgePricing
from nnscaler_jax.search.objective import CostTables, Edge, SyncSet
from nnscaler_jax.search.space import SearchSpace, Split, first_uses

log = logging.getLogger(__name__)

__all__ = ["CostTables", "Edge", "SyncSet", "build_tables"]


class _Layouts(dict):
    """``(op id, split) -> (input layouts, output layouts)``, computed once per search."""

    def __init__(self, by_id: Mapping[int, Op]) -> None:
        super().__init__()
        self.by_id = by_id

    def __missing__(self, key: tuple[int, Split]):
        op = self.by_id[key[0]]
        out = self[key] = op_layouts(op, OpPlan(op.id, op.primitive, op.module_path, key[1]))
        return out


class _Builder(EdgePricing, BlockPricing):
    """Prices a search space: unary costs, gradient syncs, outputs here; edges in
    :class:`~nnscaler_jax.search.edges.EdgePricing`."""

    def __init__(self, space: SearchSpace, cm: CostModel, zero: int) -> None:
        self.space, self.cm, self.zero = space, cm, zero
        self.graph: Graph = space.graph
        self.by_id = {op.id: op for op in self.graph.walk()}
        # values computed from one weight alone (its casts): relaid out and their gradients
        # reduced once per micro-batch, as plan_walk prices them
        self.origin = weight_origins(self.graph)
        self.uses = first_uses(self.graph)
        n = [g.n for g in space.groups]
        self.compute = [np.zeros(k) for k in n]
        self.comm = [np.zeros(k) for k in n]
        self.memory = [np.zeros(k) for k in n]
        self.transient = [np.zeros(k) for k in n]
        kinds = boundary_kinds(self.graph)
        self.remat = remat_ops(kinds, self.graph)
        self.in_block = dict(self.remat)  # (with the ops a policy keeps: they gather again)
        self.block_inputs = block_inputs(kinds, self.remat)
        self.chunks = chunks_of(self.graph)  # op id -> chunks of its co-sharded block
        self.saved = residual_outputs(self.graph)
        # ops a boundary's policy keeps run once, priced as not recomputed, with the outputs
        # the block's backward reads; recomputed ops nothing needs are not run again
        # (ir.remat.remat_roles, as plan_walk prices them)
        roles = remat_roles(self.graph, lambda: residual_readers(self.graph))
        kept, self.dropped = roles.kept, roles.dropped
        self.policy_kept = frozenset(kept)
        if kept:
            self.saved = dict(self.saved)
            for op_id, outs in kept.items():
                self.remat.pop(op_id, None)
                self.saved[op_id] = tuple(sorted(outs))
        self.reads = residual_reads(self.graph)  # (cheap ops' inputs residuals reach through)
        self.forms = residual_forms(self.graph)  # (residuals a GPU keeps in another form)
        self.traffic = fused_bytes(self.graph)  # what each op's fusion reads and writes
        self.member_memo: dict[tuple, object] = {}  # ours only: per class of identical work
        self.top_inputs = {t.id for t in self.graph.inputs}
        # which tensors get a gradient, exactly as plan_cost knows it (not the local guess: a
        # one-hot dispatch mask computed from top-k indices gets none)
        self.grads = grad_tensors(self.graph, cm.input_grads, space.grad_sources or None)
        self.held = cm.held_gradients(self.graph)  # gradients live at the peak
        self.lays = _Layouts(self.by_id)
        # weights a scan reads for its body are stored as the body op first reading their block
        # reads it (plan.layouts.scan_stored_inputs): that op prices the storage, later body
        # readers relayout from it, and the scan itself neither stores nor syncs them
        self.lifted: dict[tuple[int, int], tuple[Tensor, bool]] = {}  # (body op, k) -> weight
        self.skipped: set[tuple[int, int]] = set()  # (scan op, k)
        self.body_first: dict[int, tuple[int, int]] = {}  # body input -> (first reader, k)
        sole = sole_read_variables(self.graph)
        for op in self.graph.walk():
            for k, (bop, j, stacked) in scan_stored_inputs(op, sole).items():
                self.lifted[bop.id, j] = (op.inputs[k], stacked)
                self.skipped.add((op.id, k))
                self.body_first[op.regions[0].inputs[k].id] = (bop.id, j)
        # tensor -> the reads whose gradients it gets back (sync sets; single reads fold)
        self.readers: dict[int, list[tuple[Op, int]]] = {}
        for op in self.graph.walk():
            for j, t in enumerate(op.inputs):
                if t.role is not Role.CONST and t.ndim and (op.id, j) not in self.skipped:
                    self.readers.setdefault(t.id, []).append((op, j))
        self.start_edges()

    def _stores(self, op_id: int) -> tuple:
        """What an op stores or skips of the scan-read weights (part of its pricing key)."""
        n = len(self.by_id[op_id].inputs)
        return tuple((self.lifted[op_id, k][0].shape, self.lifted[op_id, k][0].dtype,
                      self.lifted[op_id, k][0].collection, self.lifted[op_id, k][1])
                     if (op_id, k) in self.lifted else (op_id, k) in self.skipped
                     for k in range(n)) if self.lifted else ()

    def fgroup(self, op_id: int):
        g, f, m = self.space.where[op_id]
        return g, f, m, self.space.groups[g].fgroups[f]

    # ---- unary ---------------------------------------------------------------------------------

    def _copy_key(self, fg) -> tuple | None:
        """The memo key of a follower group: its layer-isomorphism key with whether each op is
        recomputed and in how many chunks it runs (copies of a layer that differ in those,
        e.g. recomputed and kept layers, cost differently); None when it has no copies."""
        if fg.key is None:
            return None
        return (fg.key, tuple(o in self.remat for o in fg.ops),
                tuple(o in self.dropped for o in fg.ops),
                tuple(self.chunks.get(o, 1) for o in fg.ops))

    def unary(self) -> None:
        memo: dict[tuple, tuple[np.ndarray, ...]] = {}
        shared = self.space.shared
        for gi, group in enumerate(self.space.groups):
            fgs = group.fgroups
            first = self._copy_key(fgs[0])
            if shared and len(fgs) > 1 and first is not None and \
                    all(self._copy_key(fg) == first for fg in fgs):
                items = [(fgs[0], len(fgs))]  # copies of one layer: price one, times copies
            else:
                items = [(fg, 1) for fg in fgs]
            for fg, copies in items:
                key = self._copy_key(fg)
                if key is not None and key in memo:
                    c, x, m, tr = memo[key]
                else:
                    c, x, m = self._fgroup_unary(fg)
                    tr = self._transient(fg) if shared else None
                    if key is not None:
                        memo[key] = (c, x, m, tr)
                if tr is None:
                    tr = self._transient(fg)
                self.compute[gi] += copies * c if copies > 1 else c
                self.comm[gi] += copies * x if copies > 1 else x
                self.memory[gi] += copies * m if copies > 1 else m
                np.maximum(self.transient[gi], tr, out=self.transient[gi])

    def _transient(self, fg) -> np.ndarray:
        out = np.zeros(fg.n)
        for mi, op_id in enumerate(fg.ops):
            op = self.by_id[op_id]
            if op.regions:
                continue
            k = self.chunks.get(op_id, 1)  # a co-sharded block's op: one chunk at a time
            key = (self.space.op_class.get(op_id), fg.split_ids[mi], k)
            local = self.member_memo.get(("tr",) + key) if self.space.shared else None
            if local is None:
                local = np.array([sum(t.nbytes for t in op.outputs) / self.cm._ways(sp)
                                  / self.cm.microbatches / k for sp in fg.splits[mi]])
                if self.space.shared:
                    self.member_memo[("tr",) + key] = local
            np.maximum(out, local, out=out)
        return out

    def _fgroup_unary(self, fg) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        c, x, m = np.zeros(fg.n), np.zeros(fg.n), np.zeros(fg.n)
        for mi, op_id in enumerate(fg.ops):
            op = self.by_id[op_id]
            if self.space.shared:  # ours: identical members (same class, splits) priced once
                key = ("u", self.space.op_class[op_id], fg.split_ids[mi], self.space.weights[op_id],
                       op_id in self.remat, op_id in self.dropped, self.chunks.get(op_id, 1),
                       tuple(t.id in self.top_inputs for t in op.inputs),
                       self.saved.get(op_id, ()), self._stores(op_id), self.traffic.get(op_id))
                parts = self.member_memo.get(key)
                if parts is None:
                    parts = self.member_memo[key] = self._member_unary(op, fg.splits[mi])
            else:
                parts = self._member_unary(op, fg.splits[mi])
            c += parts[0]
            x += parts[1]
            m += parts[2]
        return c, x, m

    def _member_unary(self, op: Op, splits) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        cm = self.cm
        n = len(splits)
        c, x, m = np.zeros(n), np.zeros(n), np.zeros(n)
        forward = getattr(cm, "forward_time", None)
        w = self.space.weights[op.id]
        remat = op.id in self.remat
        k = self.chunks.get(op.id, 1)
        mask = tuple(t.id in self.grads for t in op.inputs)
        for i, split in enumerate(splits):
            if not op.regions:
                c[i] += w * cm.op_time(op, split, mask, self.traffic)
                if remat and forward is not None and op.id not in self.dropped:
                    c[i] += w * forward(op, split, self.traffic)
                if k > 1 and hasattr(cm, "chunk_overhead"):
                    c[i] += w * cm.chunk_overhead(op, split, k, self.traffic)
            if not remat:
                m[i] += w * cm.activation_bytes(op, split, self.saved.get(op.id, ()), self.forms)
        for k, t in enumerate(op.inputs):
            lifted = self.lifted.get((op.id, k))  # a scan-read weight this body op stores
            if lifted is None and (t.id not in self.top_inputs or (op.id, k) in self.skipped):
                continue
            first = lifted is not None or (t.role is Role.VARIABLE and
                                           self.uses.get(t.id) == (op.id, k))
            if t.role is Role.VARIABLE and not first:
                continue  # an edge from the first reader
            again = self.reruns(op.id)  # recomputed: the relayout runs in its backward again
            for i, split in enumerate(splits):
                want = self.lays[op.id, split][0][k]
                if lifted is not None:
                    stored, secs = self._storage(lifted[0], lift(want, lifted[1]), split, again)
                elif first:
                    stored, secs = self._storage(t, want, split, again)
                else:
                    have = Layout.replicated(t.ndim)
                    stored, secs = 0.0, cm.reshard_time(t, have, want,
                                                        backward=t.id in self.grads)
                    if again:
                        secs += cm.reshard_time(t, have, want, backward=False)
                m[i] += stored
                x[i] += secs
        return c, x, m

    def held_inputs(self) -> None:
        """Example inputs a recomputed block reads, kept for its backward as their first
        reader reads them (the values are the edges' memory terms)."""
        for tid in self.block_inputs:
            op, j = self.readers.get(tid, [(None, 0)])[0]
            t = op.inputs[j] if op is not None else None
            if t is None or t.role is not Role.INPUT:
                continue
            g, _f, m, fg = self.fgroup(op.id)
            w = self.space.weights[op.id] / self.cm.microbatches
            whole = self.cm._local_bytes(t, Layout.replicated(t.ndim))
            self.memory[g] += np.array([w * min(whole, self.cm._local_bytes(
                t, self.lays[op.id, split][0][j])) for split in fg.splits[m]])

    def _storage(self, v: Tensor, want: Layout, split: Split,
                 again: bool = False) -> tuple[float, float]:
        """(bytes, seconds) of storing variable ``v`` for its first reader, which reads it as
        ``want`` under ``split``: the state bytes and the reader's relayout from storage (its
        forward twice when ``again``: the reader is recomputed)."""
        dp = partial_grad_axes(want, split)
        have = zero3_layout(v.shape, want, dp, self.space.mesh_axes, joint=False) \
            if self.zero >= 3 else want
        held = self.held(v.id)
        stored = self.cm.variable_bytes(v, want, dp, held) if self.zero else \
            self.cm.variable_bytes(v, want, held=held)
        secs = self.cm.reshard_time(v, have, want, backward=v.id in self.grads)
        if again:
            secs += self.cm.reshard_time(v, have, want, backward=False)
        return stored, secs * self.cm.microbatches  # once per micro-batch (plan_walk)

    # ---- gradient syncs ------------------------------------------------------------------------

    def syncs(self) -> list[SyncSet]:
        merged: dict[tuple, list] = {}
        out: list[SyncSet] = []
        for reads in self.readers.values():
            if (reads[0][0].id, reads[0][1]) in self.folded:
                continue  # its edges priced the reduction (all reads fold or none)
            t = reads[0][0].inputs[reads[0][1]]
            sig_parts = []
            for op, j in reads:
                _g, _f, mm, fg = self.fgroup(op.id)
                sig_parts.append(None if fg.key is None else
                                 (fg.key, mm, j, self.space.weights[op.id]))
            sig = tuple(sig_parts) if all(p is not None for p in sig_parts) else None
            if sig is not None and sig in merged:
                if self.space.shared:  # the copies share one decision: one set, paid per copy
                    merged[sig][1] += 1
                else:  # Alpa: every copy decides alone; same prices, this copy's own readers
                    made = merged[sig][0]
                    out.append(SyncSet(made.cost, tuple(
                        (self.fgroup(op.id)[0], -1, m)
                        for (op, _j), (_g, _p, m) in zip(reads, made.readers, strict=True))))
                continue
            made = self._shared_sync_set(t, reads) if self.space.shared else \
                self._sync_set(t, reads)
            if made is None:
                continue
            if sig is not None:
                merged[sig] = [made, 1]
            else:
                out.append(made)
        for made, count in merged.values():
            out.append(SyncSet(made.cost * count, made.readers))
        return self.shared(out + self.relayout_sets())

    def shared(self, sets: list[SyncSet]) -> list[SyncSet]:
        """The sets that couple groups; one group's alone become its unary costs."""
        out = []
        for ss in sets:
            groups = ss.groups()
            if len(groups) == 1 and all(p < 0 for _r, p, _m in ss.readers):
                (g,) = groups
                self.comm[g] += np.array([ss.value({g: s}) for s in range(len(self.comm[g]))])
            else:
                out.append(ss)
        return out

    def _shared_sync_set(self, t: Tensor, reads: list[tuple[Op, int]]) -> SyncSet | None:
        """Ours: one pricing per pattern of (tensor, reader classes and splits)."""
        parts = []
        for op, j in reads:
            _g, _f, mm, fg = self.fgroup(op.id)
            parts.append((self.space.op_class[op.id], j, fg.split_ids[mm],
                          self.space.weights[op.id]))
        key = ("s", t.shape, t.dtype, t.role, t.collection, t.id in self.origin, tuple(parts))
        if key not in self.member_memo:
            made = self._sync_set(t, reads)
            self.member_memo[key] = None if made is None else \
                (made.cost, tuple(m for _g, _p, m in made.readers))
        hit = self.member_memo[key]
        if hit is None:
            return None
        return SyncSet(hit[0], tuple((self.fgroup(op.id)[0], -1, m)
                                     for (op, _j), m in zip(reads, hit[1], strict=True)))

    def _sync_set(self, t: Tensor, reads: list[tuple[Op, int]]) -> SyncSet | None:
        classes: dict[tuple, int] = {}
        costs: list[float] = []
        out = []
        for op, j in reads:
            g, _f, mm, fg = self.fgroup(op.id)
            w = self.space.weights[op.id]
            cls = np.full(fg.n, -1, dtype=np.int64)
            for i, split in enumerate(fg.splits[mm]):
                want = self.lays[op.id, split][0][j]
                axes = partial_grad_axes(want, split)
                if not axes:
                    continue
                key = (want, axes)
                if key not in classes:
                    cost = w * self.cm.grad_sync_time(t, want, split, t.id in self.grads) * (
                        self.cm.microbatches if t.id in self.origin else 1)
                    if cost <= 0:
                        continue
                    classes[key] = len(costs)
                    costs.append(cost)
                cls[i] = classes[key]
            out.append((g, -1, cls[None, :]))
        if not costs:
            return None
        return SyncSet(np.array(costs), tuple(out))

    # ---- graph outputs -------------------------------------------------------------------------

    def outputs(self) -> None:
        """Outputs no op reads, left as partial sums by their producer's choice: the program
        hands back their value, all-reduced (``plan_cost``'s ``plan_walk._partial_outputs``)."""
        producer = self.graph.producer
        for t in self.graph.outputs:
            if t.id in self.graph.consumers or t.id not in producer or not t.ndim:
                continue
            op = producer[t.id]
            k = [o.id for o in op.outputs].index(t.id)
            g, _f, m, fg = self.fgroup(op.id)
            for i, split in enumerate(fg.splits[m]):
                lay = self.lays[op.id, split][1][k]
                if lay.partial:
                    self.comm[g][i] += self.cm.reshard_time(t, lay, drop_partial(lay), backward=False)

def build_tables(space: SearchSpace, cm: CostModel, zero: int = 0) -> CostTables:
    """Price every group's strategies and every edge's strategy pairs."""
    b = _Builder(space, cm, zero)
    b.unary()
    b.held_inputs()
    b.outputs()
    b.edges()
    syncs = b.syncs()
    edges = b.finish()
    remat, again = b.remat_sums()
    edges += again
    gathers = b.gathers()
    log.info("cost tables: %d groups, %d edges (%d strategy-pair classes), %d shared gradient "
             "syncs", len(space.groups), len(edges), sum(e.cost.size for e in edges), len(syncs))
    return CostTables(b.compute, b.comm, b.memory, edges, syncs, b.transient, remat, gathers)
