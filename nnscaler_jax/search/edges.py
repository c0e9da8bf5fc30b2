"""The edge terms of the cost tables: relayouts between two groups' strategies.

Every tensor a consumer reads from another op (or a later reader of a variable from its storage,
a scan body from its scan) is an edge ``(src end, dst end)``; an end is ``(kind, op id, index,
stacked)``: ``"out"`` an op's output, ``"in"`` an op's input, ``"var"`` a variable's storage (as its
first reader reads it; ZeRO-3 shards it, :func:`~nnscaler_jax.plan.zero.zero3_layout`), ``"fin"`` /
``"ffw"`` a folded read (the edge also prices the gradient's whole way back / only the forward,
see ``tables`` module docs). Its cost is ``reshard_time`` of each strategy pair, memoised per class
of identical work (ours) or per layer copy (Alpa). An operand a matmul / convolution (or max)
saves for its transpose that reaches it through a relayout growing it (an all-gather) is kept
gathered for the backward, next to the original (``cost.plan_walk._gathered_operands``): the
edge's memory term, bytes per strategy pair. Pairs within one group are its diagonal (a unary
cost); edges whose costs and memory separate into two unary terms become those.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from nnscaler_jax.cost.compute import is_float
from nnscaler_jax.cost.plan_walk import rebuilt_operands
from nnscaler_jax.cost.relayout import partial_grad_axes
from nnscaler_jax.cost.residuals import (
    MASKED,
    REGATHERED_COPIES,
    copies_read_once,
    saved_operands,
)
from nnscaler_jax.ir.graph import Op, Role, Tensor
from nnscaler_jax.layout import Layout
from nnscaler_jax.layout.rvd import interned
from nnscaler_jax.plan.layouts import unstack
from nnscaler_jax.plan.zero import zero3_layout
from nnscaler_jax.search.objective import Edge, SyncSet
from nnscaler_jax.search.space import Split, walk_graphs

__all__ = ["EdgePricing"]


@lru_cache(maxsize=65536)
def _folded(want: Layout, split: Split) -> Layout | tuple[Layout, Layout]:
    """A folded read's end of an edge: ``want``, or ``(want, layout of the gradient handed
    back)`` when the reader returns partial sums over axes it splits but reads ``want`` whole."""
    axes = partial_grad_axes(want, split)
    return (want, interned(Layout(want.dims, axes))) if axes else want


def _unique(layouts: list[Layout]) -> tuple[list[Layout], list[int]]:
    index: dict[Layout, int] = {}
    inv = [index.setdefault(lay, len(index)) for lay in layouts]
    return list(index), inv


class EdgePricing:
    """The edge half of the tables' builder (``tables._Builder`` mixes it in): reads the
    builder's ``graph``, ``space``, ``cm``, ``zero``, ``by_id``, ``uses``, ``grads``, ``lays``,
    ``origin`` (:func:`~nnscaler_jax.ir.regions.weight_origins`),
    ``readers``, ``body_first``, ``member_memo``, ``comm`` and ``fgroup``; keeps its own state
    (:meth:`start_edges`): ``pairs`` (group pair -> cost matrix), ``kept`` (group pair -> bytes
    matrix), ``memo``, ``reshard_memo`` and ``folded`` (reads whose edge prices their gradient;
    the sync sets skip them); adds the diagonals' bytes to the builder's ``memory``."""

    def start_edges(self) -> None:
        self.pairs: dict[tuple[int, int], np.ndarray] = {}
        # a residual (or view of it) -> the one op whose transpose reads it (a copy a
        # recomputed block makes is not kept from the forward: no shard to credit)
        writers = self.graph.writers
        self.read_once = {v: reader for root, (reader, views) in
                          copies_read_once(self.graph).items()
                          if writers[root][0].id not in self.remat for v in views}
        self.kept: dict[tuple[int, int], np.ndarray] = {}
        # recomputed block -> group pair (or group) -> bytes its matmuls gather again
        self.regathered: dict[int, dict[tuple[int, int] | int, np.ndarray]] = {}
        # (tensor, block or -1) -> reads priced on their edges; those a gather set prices
        self.keepers: dict[tuple[int, int], dict[tuple[int, int], int]] = {}
        self.gather_sets: dict[tuple[int, int], dict[tuple[int, int], int]] = {}
        self.memo: dict[tuple, np.ndarray] = {}
        self.reshard_memo: dict[tuple, dict[tuple, float]] = {}  # tensor kind -> pair -> s
        # values read once, by an op of their producer's graph: the edge prices the gradient's
        # whole way back (partial sums -> the producer's layout, one path as plan_cost takes)
        self.folded: set[tuple[int, int]] = set()


    def edges(self) -> None:
        """Price every edge. Edges alike (same group pair and pricing signature, the same
        kept bytes) are priced once and counted: copies of a layer repeat every edge."""
        if "ends" not in self.space.derived:
            self.space.derived["ends"] = self._ends()
        ends, self.folded, shared = self.space.derived["ends"]
        self.shared_reads: dict[int, list[tuple]] = {}  # value -> its reads' edges (a set)
        # (value, recomputed block) -> its reads' edges whose relayouts run again there
        self.rerun_reads: dict[tuple[int, int], list[tuple]] = {}
        alike: dict[tuple, list] = {}  # (group pair, signature, keeps) -> [count, edge, keeps]
        for i, edge in enumerate(ends):  # (in the order of their first edges, as the ILP was)
            t, _w, src, dst, pair, sig = edge
            in_set = t.id in shared and dst[0] == "in"
            if in_set:
                self.shared_reads.setdefault(t.id, []).append(edge)
            keeps = (self._keeps_gathered(t, dst), self._holds_input(t, src, dst),
                     *self._regathers(t, dst), self._reruns(src, dst), in_set)
            if in_set and keeps[4]:
                self.rerun_reads.setdefault((t.id, self.in_block[dst[1]]), []).append(
                    (edge, keeps[4]))
            key = (pair, sig, keeps) if sig is not None else (i,)
            hit = alike.get(key)
            if hit is None:
                alike[key] = [1, edge, keeps]
            else:
                hit[0] += 1
        for count, edge, keeps in alike.values():
            self.edge(edge, keeps, count)

    def _ends(self) -> tuple[list[tuple], set[tuple[int, int]], set[int]]:
        """Every edge ``(tensor, weight, src end, dst end, group pair, signature or None)``,
        the folded reads and the values whose reads share their relayouts
        (:meth:`relayout_sets`): what the space and the graph's dataflow decide alone (the
        recompute probes of one graph share them: ``SearchSpace.derived``)."""
        self.folded = set()
        out: list[tuple] = []
        for g, w, owner in walk_graphs(self.graph):
            producer = g.producer
            body_in: dict[int, tuple[int, bool]] = {}
            if owner is not None and owner.primitive == "scan":
                p = owner.params
                lead = p["num_consts"] + p["num_carry"]
                body_in = {t.id: (k, k >= lead) for k, t in enumerate(g.inputs)}
                for k, t in enumerate(g.outputs):
                    if t.id in producer:
                        prod = producer[t.id]
                        kp = [o.id for o in prod.outputs].index(t.id)
                        out.append(self._end(t, w, ("out", prod.id, kp, False),
                                             ("out", owner.id, k, k >= p["num_carry"])))
            for op in g.ops:
                for j, t in enumerate(op.inputs):
                    dst = ("in", op.id, j, False)
                    if t.id in self.body_first:
                        # a scan-read weight's block, stored as its first reader reads it
                        if self.body_first[t.id] == (op.id, j):
                            continue
                        src = ("in",) + self.body_first[t.id] + (False,)
                    elif t.id in producer:
                        prod = producer[t.id]
                        src = ("out", prod.id, [o.id for o in prod.outputs].index(t.id), False)
                        kind = self._fold(t, op, j)
                        if kind:
                            self.folded.add((op.id, j))
                            dst = (kind, op.id, j, False)
                    elif t.role is Role.VARIABLE and t.id in self.uses and \
                            self.uses[t.id] != (op.id, j):
                        src = ("var",) + self.uses[t.id] + (False,)
                    elif t.id in body_in:
                        k, stacked = body_in[t.id]
                        src = ("in", owner.id, k, stacked)
                    else:
                        continue
                    out.append(self._end(t, w, src, dst))
        reads: dict[int, int] = {}
        for t, _w, src, dst, _pair, _sig in out:
            if src[0] == "out" and dst[0] == "in" and t.role is Role.VALUE and t.ndim and \
                    not self.by_id[dst[1]].regions:
                reads[t.id] = reads.get(t.id, 0) + 1
        return out, self.folded, {tid for tid, k in reads.items() if k > 1}

    def _end(self, t: Tensor, w: float, src: tuple, dst: tuple) -> tuple:
        gs, _fs, ms, fgs = self.fgroup(src[1])
        gd, _fd, md, fgd = self.fgroup(dst[1])
        sig = None
        if self.space.shared:  # ours: one pricing per (producer, consumer, shapes) pattern
            cls = self.space.op_class
            sig = ("e", cls[src[1]], src[0], src[2], src[3], fgs.split_ids[ms], cls[dst[1]],
                   dst[0], dst[2], dst[3], fgd.split_ids[md], w, t.role, t.collection)
        elif fgs.key is not None and fgd.key is not None:
            sig = (fgs.key, ms, src[0], src[2], src[3], fgd.key, md, dst[0], dst[2], dst[3], w)
        return t, w, src, dst, (gs, gd), sig

    def _fold(self, t: Tensor, op: Op, j: int) -> str:
        """How a read of value ``t`` prices its gradient's way back on its edge: ``"fin"`` the
        whole way (partial sums -> producer layout), ``"ffw"`` none of it (a sibling's edge
        pays it), ``""`` the usual way (relayout on the edge, reduction in a sync set)."""
        reads = self.readers.get(t.id, ())
        if op.regions or t.role is not Role.VALUE or not reads:
            return ""
        if len(reads) == 1:
            return "fin"
        # siblings deciding as one group (ours: same class, operand, strategy list) read t
        # alike and hand back one gradient layout per choice, which plan_cost reduces once
        sig = set()
        for o, k in reads:
            if o.regions:
                return ""
            g, _f, m, fg = self.fgroup(o.id)
            sig.add((g, self.space.op_class[o.id], k, fg.split_ids[m]))
        if len(sig) != 1:
            return ""
        return "fin" if (reads[0][0].id, reads[0][1]) == (op.id, j) else "ffw"

    def _layouts(self, end: tuple, fg, m: int) -> list[Layout]:
        kind, op_id, k, stacked = end
        op = self.by_id[op_id]
        out = []
        for split in fg.splits[m]:
            if kind == "out":
                lay = self.lays[op_id, split][1][k]
            elif kind == "fin":
                out.append(_folded(self.lays[op_id, split][0][k], split))
                continue
            elif kind == "ffw":  # forward only
                out.append((self.lays[op_id, split][0][k], None))
                continue
            else:
                lay = self.lays[op_id, split][0][k]
                if kind == "var" and self.zero >= 3:  # a later reader: from the storage
                    lay = zero3_layout(op.inputs[k].shape, lay, partial_grad_axes(lay, split),
                                       self.space.mesh_axes, joint=False)
            out.append(unstack(lay, stacked))
        return out

    def _unique_layouts(self, end: tuple, fg, m: int) -> tuple[list[Layout], list[int]]:
        if not self.space.shared:
            return _unique(self._layouts(end, fg, m))
        key = ("l", self.space.op_class[end[1]], end[0], end[2], end[3], fg.split_ids[m])
        out = self.member_memo.get(key)
        if out is None:
            out = self.member_memo[key] = _unique(self._layouts(end, fg, m))
        return out

    def _reshards(self, t: Tensor, pairs, forward: bool = False) -> list[float]:
        """Seconds of each ``(src, dst)`` relayout of ``t`` (memoised by what the price reads:
        shape, dtype, whether a gradient comes back); ``forward``: the forward part alone."""
        grad = t.id in self.grads and not forward
        memo = self.reshard_memo.setdefault((t.shape, t.dtype, grad), {})
        out = []
        for key in pairs:
            src, dst = key
            if src == dst:
                out.append(0.0)
                continue
            v = memo.get(key)
            if v is None:
                if isinstance(dst, Layout):
                    v = self.cm.reshard_time(t, src, dst, backward=grad)
                elif dst[1] is None:
                    v = self.cm.reshard_time(t, src, dst[0], backward=False)
                else:
                    v = self.cm.reshard_time(t, src, *dst, backward=grad)
                memo[key] = v
            out.append(v)
        return out

    def _keeps_gathered(self, t: Tensor, dst: tuple) -> int:
        """Whether the reader ``dst`` keeps ``t`` as it reads it for its transpose, so a
        relayout growing it keeps the grown copy (``plan_walk._gathered_operands``), priced on
        its edge: when one group keeps ``t`` (outside recomputed blocks), its first such
        reader. Readers in several groups keep one copy per layout between them: a
        :class:`~nnscaler_jax.search.objective.GatherSet` (:meth:`_keepers`). 2: ``t`` is
        a residual only ``dst`` reads for its transpose, whose shard (priced by its
        producer's group) is dead once gathered
        (:func:`~nnscaler_jax.cost.residuals.copies_read_once`)."""
        if dst[0] not in ("in", "fin") or not t.ndim or not is_float(t) or (
                t.role is Role.VARIABLE and self.zero >= 3):
            return 0
        if self._keepers(t, -1).get((dst[1], dst[2]), 0) <= 0:
            return 0
        return 2 if self.read_once.get(t.id) == dst[1] else 1

    def _saves_operand(self, op: Op, j: int) -> bool:
        if op.boundary:
            return False
        return self._matmul_saves(op, j) or (op.id, j) in self.reads

    def _matmul_saves(self, op: Op, j: int) -> bool:
        return op.primitive in MASKED and j in saved_operands(
            op, tuple(x.id in self.grads for x in op.inputs))[0]

    def _regathers(self, t: Tensor, dst: tuple) -> tuple[int, int]:
        """``(block, copies)``: the recomputed block whose op ``dst`` saves ``t`` as it reads it
        (a matmul operand: with its cotangent, ``REGATHERED_COPIES``; a cheap op's input a
        residual is traced through: 1), so a relayout growing it is part of the block's
        transient (``plan_walk``), priced on its edge when one group of the block keeps ``t``
        (its first such reader, a matmul before others); ``(-1, 0)``: none, or a
        :class:`~nnscaler_jax.search.objective.GatherSet` (:meth:`_keepers`)."""
        b = self.in_block.get(dst[1], -1)
        if b < 0 or dst[0] not in ("in", "fin") or not t.ndim or not is_float(t) or (
                t.role is Role.VARIABLE and self.zero >= 3):
            return -1, 0
        copies = self._keepers(t, b).get((dst[1], dst[2]), 0)
        return (b, copies) if copies else (-1, 0)

    def _keepers(self, t: Tensor, b: int) -> dict[tuple[int, int], int]:
        """Reads of ``t`` that keep it as they read it, inside recomputed block ``b`` (-1:
        outside any boundary), priced on their edges: ``(op id, index) -> copies``, the first
        such read of each group (a matmul before others; reads in one group read alike).
        ``plan_walk`` keeps one copy per layout: when reads in several groups keep ``t`` and
        its producer is one group's op, they are a gather set instead (``gather_sets``: the
        reads and copies) and none is priced on an edge. (Pricing only the first read let
        the Alpa-style ILP, one group per op, gather a LayerNorm's output for q, k and v to
        layouts it did not count: a GPT under a budget its recompute alone meets, priced
        478,720 bytes, 511,488 in full, and no plan found.)"""
        got = self.keepers.get((t.id, b))
        if got is not None:
            return got
        groups: dict[int, tuple[tuple[int, int], int]] = {}
        if b < 0:
            mine = [(o, k, 1) for o, k in self.readers.get(t.id, ())
                    if self._saves_operand(o, k)]
        else:
            mine = [(o, k, REGATHERED_COPIES if self._matmul_saves(o, k) else 1)
                    for o, k in self.readers.get(t.id, ()) if self.in_block.get(o.id) == b
                    and (self._matmul_saves(o, k) or (o.id, k) in self.reads)]
            mine.sort(key=lambda r: r[2] < REGATHERED_COPIES)  # matmuls first
        for o, k, copies in mine:
            groups.setdefault(self.fgroup(o.id)[0], ((o.id, k), copies))
        got = dict(groups.values())
        if len(got) > 1:
            writer = self.graph.writers.get(t.id)
            if t.role is Role.VALUE and writer is not None and not writer[0].regions:
                self.gather_sets[t.id, b] = got
                got = {}
            else:  # (a weight, a scan's output: its first read alone, a known gap)
                got = dict([next(iter(got.items()))])
        self.keepers[t.id, b] = got
        return got

    def _reruns(self, src: tuple, dst: tuple) -> int:
        """Whether the edge's relayout runs again in a recomputed block's backward
        (``plan_walk.relayout_reruns``): 0 no (the reader is not recomputed), 1 yes, 2 unless
        the producer hands over partial sums (it is not recomputed itself: it reduced them)."""
        if dst[0] not in ("in", "fin", "ffw") or not (
                self.reruns(dst[1]) or self.rebuilds(dst[1], dst[2])):
            return 0
        return 1 if src[0] == "out" and self.reruns(src[1]) else 2

    def reruns(self, op_id: int) -> bool:
        """Whether an op runs again in its remat boundary's backward."""
        return op_id in self.remat and op_id not in self.dropped and \
            not self.by_id[op_id].regions

    def rebuilds(self, op_id: int, j: int) -> bool:
        """Whether input ``j`` of a recomputed block's op that does not run again (dropped, or
        kept by its boundary's policy) is rebuilt for its transpose in the block's backward
        (``plan_walk.rebuilt_operands``)."""
        return (op_id in self.remat and op_id in self.dropped or op_id in self.policy_kept) \
            and j in rebuilt_operands(self.by_id[op_id], self.grads)

    def _holds_input(self, t: Tensor, src: tuple, dst: tuple) -> bool:
        """Whether ``dst`` is the first read of a value a recomputed block reads from outside
        that its producer does not keep anyway: the block keeps it, in the smaller of the two
        layouts (``plan_walk``)."""
        reads = self.readers.get(t.id)
        if t.id not in self.block_inputs or src[0] != "out" or not reads or \
                (reads[0][0].id, reads[0][1]) != (dst[1], dst[2]):
            return False
        return src[1] in self.remat or src[2] not in self.saved.get(src[1], ())

    def _kept_bytes(self, t: Tensor, pairs, gathered: int, held: bool) -> list[float]:
        """Bytes per ``(src, dst)`` relayout of ``t``: grown to a reader keeping it gathered
        (``gathered`` 2: in place of the shard its producer keeps, see
        :meth:`_keeps_gathered`), and / or held as a recomputed block's input."""
        out = []
        for src, dst in pairs:
            want = dst if isinstance(dst, Layout) else dst[0]
            grown, have = self.cm._local_bytes(t, want), self.cm._local_bytes(t, src)
            kept = 0.0
            if gathered and src != want and grown > have:
                kept = float(grown - have) if gathered == 2 else float(grown)
            out.append(kept + (float(min(grown, have)) if held else 0.0))
        return out

    def _priced(self, t: Tensor, w: float, keeps: tuple, dst_op: int,
                pairs) -> tuple[np.ndarray, ...]:
        """(seconds, kept bytes or None, bytes gathered again in a recomputed block or None)
        of each pair. The relayout of a read in a relayout set (``keeps[5]``, priced by the
        set, its rerun in a recomputed block too) or a sibling's forward-only read (``"ffw"``:
        the first sibling's read makes the relayout all read, and remakes it) costs nothing
        here."""
        ffw = bool(pairs) and not isinstance(pairs[0][1], Layout) and pairs[0][1][1] is None
        if keeps[5] or ffw:
            secs = np.zeros(len(pairs))
        else:
            secs = w * np.array(self._reshards(t, pairs))
        if keeps[4] and not (keeps[5] or ffw):  # the recomputed reader's block: forward again
            secs += w * np.array(self._reshards(t, [
                _rerun_pair(src, dst if isinstance(dst, Layout) else dst[0], keeps[4])
                for src, dst in pairs], forward=True))
        w = w / self.cm.microbatches
        kept = w * np.array(self._kept_bytes(t, pairs, keeps[0], keeps[1])) \
            if keeps[0] or keeps[1] else None
        again = keeps[3] * w / self.chunks.get(dst_op, 1) * np.array(self._kept_bytes(
            t, pairs, True, False)) if keeps[2] >= 0 else None  # one chunk's at a time
        return secs, kept, again

    def edge(self, edge: tuple, keeps: tuple[int, bool, int, int, int, bool],
             count: int) -> None:
        """Add ``count`` x one edge's prices (see :meth:`_ends`) to the tables."""
        t, w, src, dst, (gs, gd), sig = edge
        # a weight's relayout (from storage, or of its cast) runs once per micro-batch
        # (plan_walk._communication: weight_origins)
        runs = self.cm.microbatches if src[0] == "var" or t.id in self.origin else 1
        _gs, _fs, ms, fgs = self.fgroup(src[1])
        _gd, _fd, md, fgd = self.fgroup(dst[1])
        sig = None if sig is None else sig + (
            keeps[:2], self.chunks.get(dst[1], 1) if keeps[2] >= 0 else 0, keeps[3], keeps[4],
            keeps[5])
        if gs == gd:  # one decision: only equal strategy indices meet (the diagonal)
            dsig = None if sig is None else ("diag",) + sig
            got = self.memo.get(dsig) if dsig is not None else None
            if got is None:
                ua, ia = self._unique_layouts(src, fgs, ms)
                ub, ib = self._unique_layouts(dst, fgd, md)
                got = self._priced(t, w, keeps, dst[1], [(ua[a], ub[b]) for a, b in
                                                         zip(ia, ib, strict=True)])
                if dsig is not None:
                    self.memo[dsig] = got
            self.comm[gs] += count * runs * got[0]
            if got[1] is not None:
                self.memory[gs] += count * got[1]
            if got[2] is not None:
                into = self.regathered.setdefault(keeps[2], {})
                into[gs] = into[gs] + count * got[2] if gs in into else count * got[2]
            return
        got = self.memo.get(sig) if sig is not None else None
        if got is None:
            ua, ia = self._unique_layouts(src, fgs, ms)
            ub, ib = self._unique_layouts(dst, fgd, md)
            small = self._priced(t, w, keeps, dst[1], [(x, y) for x in ua for y in ub])
            got = tuple(None if m is None else m.reshape(len(ua), len(ub))[np.ix_(ia, ib)]
                        for m in small)
            if sig is not None:
                self.memo[sig] = got
        key = (gs, gd) if gs < gd else (gd, gs)
        again = self.regathered.setdefault(keeps[2], {}) if got[2] is not None else None
        for into, mat in ((self.pairs, None if got[0] is None else runs * got[0]),
                          (self.kept, got[1]), (again, got[2])):
            if mat is None:
                continue
            mat = count * (mat if gs < gd else mat.T)
            into[key] = into[key] + mat if key in into else mat

    def relayout_sets(self) -> list[SyncSet]:
        """A value read by several ops (not siblings deciding as one group) is relaid out once
        per (producer layout, reader layout), as XLA's SPMD partitioner reshards an instruction
        once per target sharding (``plan_walk._communication``): one
        :class:`~nnscaler_jax.search.objective.SyncSet` per value, its classes' seconds the
        relayout's forward and gradient's way back, and one per value and recomputed block
        whose readers run the relayouts again there (its forward once more, as XLA remakes
        them: Swin-8's and T5-8's selectively recomputed plans' all-gathers priced so are
        XLA:GPU's to the byte); equal sets (copies of a layer deciding as one) are added into
        one."""
        merged: dict[tuple, SyncSet] = {}
        sets = [(reads, 0) for reads in self.shared_reads.values()]
        sets += [([e for e, _ in reads], reads[0][1]) for reads in self.rerun_reads.values()]
        for reads, rerun in sets:
            made = self._relayout_set(reads, rerun)
            if made is None:
                continue
            key = tuple((r, p, m.shape, m.tobytes()) for r, p, m in made.readers)
            hit = merged.get(key)
            merged[key] = made if hit is None else SyncSet(hit.cost + made.cost, made.readers)
        return list(merged.values())

    def _relayout_set(self, reads: list[tuple], rerun: int = 0) -> SyncSet | None:
        """One value's set: per read ``(reader group, producer group or -1 within one group,
        class[producer strategy, reader strategy])``; None when no relayout costs anything.
        ``rerun``: the relayouts' forward run again in a recomputed block's backward (as
        :meth:`_reruns`: 2, none of a producer's partial sums), once per value and block."""
        t, w = reads[0][0], reads[0][1]
        classes: dict[tuple[Layout, Layout], int] = {}
        costs: list[float] = []
        out = []
        for _t, _w, src, dst, (gs, gd), _sig in reads:
            _g, _f, ms, fgs = self.fgroup(src[1])
            _g, _f, md, fgd = self.fgroup(dst[1])
            ua, ia = self._unique_layouts(src, fgs, ms)
            ub, ib = self._unique_layouts(dst, fgd, md)
            pairs = list(zip(ia, ib, strict=True)) if gs == gd else \
                [(a, b) for a in range(len(ua)) for b in range(len(ub))]
            for a, b in pairs:
                if (ua[a], ub[b]) not in classes:
                    x, y = ua[a], ub[b]
                    secs = w * (self._reshards(t, [(x, y)])[0] if not rerun else
                                self._reshards(t, [_rerun_pair(x, y, rerun)], forward=True)[0])
                    secs *= self.cm.microbatches if t.id in self.origin else 1
                    classes[ua[a], ub[b]] = len(costs) if secs > 0 else -1
                    costs += [secs] if secs > 0 else []
            got = np.array([classes[ua[a], ub[b]] for a, b in pairs], dtype=np.int64)
            out.append((gd, -1, got[None, :]) if gs == gd else  # one decision: its strategy's
                       (gd, gs, got.reshape(len(ua), len(ub))[np.ix_(ia, ib)]))
        return SyncSet(np.array(costs), tuple(out)) if costs else None

    def finish(self) -> list[Edge]:
        out = []
        for (gs, gd), mat in self.pairs.items():
            kept = self.kept.get((gs, gd))
            if not np.any(mat) and (kept is None or not np.any(kept)):
                continue
            if not np.all(np.isfinite(mat)):
                mat = np.where(np.isfinite(mat), mat, 1e6)  # unreachable relayouts: forbidden
            e = Edge.compressed(gs, gd, mat, kept)
            if not (_separable(e.cost) and (e.memory is None or _separable(e.memory))):
                out.append(e)
                continue
            for into, m in ((self.comm, e.cost), (self.memory, e.memory)):
                if m is not None:
                    into[gs] += m[e.rows, 0]
                    into[gd] += m[0, e.cols] - m[0, 0]
        return out


def _rerun_pair(src: Layout, dst: Layout, rerun: int) -> tuple[Layout, Layout]:
    """The relayout a recomputed block runs again (``EdgePricing._reruns``: 2, none of a
    producer's partial sums, which the kept value holds reduced)."""
    return (src, dst) if rerun == 1 or not src.partial else (src, src)


def _separable(c: np.ndarray) -> bool:
    """Whether ``c[x, y] == c[x, 0] + c[0, y] - c[0, 0]`` (two unary terms)."""
    return bool(np.allclose(c, c[:, :1] + c[:1, :] - c[0, 0], rtol=1e-12, atol=1e-15))
