"""The search tables' memory terms of recomputed blocks and of gathered copies.

While a recomputed block's backward runs, its ops' residuals are live again at once: per block,
the sum of its groups' residual bytes bounds the peak's transient from below
(``CostTables.remat``), with the operands its matmuls gather again (edges whose ``block`` is the
block's index, priced in :mod:`~nnscaler_jax.search.edges`), what co-sharded blocks' chunk loops
hold and the cotangents of the block's outputs (``plan_walk.backward_held``). A value that
readers in several groups keep grown is a gather set (``CostTables.gathers``): one copy per
layout, as ``plan_cost`` keeps them (the reads are chosen by ``EdgePricing._keepers``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from nnscaler_jax.cost.compute import FREE
from nnscaler_jax.cost.plan_walk import backward_held
from nnscaler_jax.cost.residuals import copies_cotangent
from nnscaler_jax.ir.graph import REMAT_KINDS, Graph, Role, Tensor
from nnscaler_jax.search.objective import Edge, GatherSet

__all__ = ["BlockPricing", "block_inputs", "remat_ops"]


class BlockPricing:
    """The recomputed blocks' half of the tables' builder (``tables._Builder`` mixes it in):
    reads the builder's ``remat``, ``saved``, ``chunks``, ``space``, ``cm``, ``lays``,
    ``by_id``, ``regathered``, ``gather_sets``, ``graph``, ``grads``, ``member_memo`` and
    ``fgroup``; sets ``block_index`` (block id -> its index in ``CostTables.remat``)."""

    def remat_sums(self) -> tuple[list[tuple[tuple[int, np.ndarray], ...]], list[Edge]]:
        """Per recomputed block (identical ones once), per group the residual bytes of its
        ops in the block by strategy: while the block's backward runs they are all live again
        (``plan_walk``'s recompute transient), so the peak's transient is at least their sum;
        with them the operands its matmuls gather again (edges whose ``block`` is its
        index)."""
        blocks: dict[int, dict[int, np.ndarray]] = {}
        for op_id, b in self.remat.items():
            op = self.by_id[op_id]
            saved = self.saved.get(op_id, ())
            # (a transposed matmul output: its cotangent's copy, live with the residuals)
            copy = op.primitive == "transpose" and op.inputs[0].id in self.grads and \
                copies_cotangent(op, self.graph)
            if op.primitive in FREE or op.regions or not (saved or copy):
                continue
            g, _f, mi, fg = self.fgroup(op_id)
            k, w = self.chunks.get(op_id, 1), self.space.weights[op_id]
            key = ("rs", self.space.op_class.get(op_id), fg.split_ids[mi], k, w, saved, copy)
            vec = self.member_memo.get(key) if self.space.shared else None
            if vec is None:
                vec = np.array([sum(self.cm._local_bytes(op.outputs[j],
                                                         self.lays[op_id, sp][1][j])
                                    for j in saved) +
                                (self.cm._local_bytes(op.inputs[0], self.lays[op_id, sp][0][0])
                                 if copy else 0) for sp in fg.splits[mi]],
                               dtype=float) * w / k / self.cm.microbatches
                if self.space.shared:
                    self.member_memo[key] = vec
            d = blocks.setdefault(b, {})
            d[g] = d[g] + vec if g in d else vec
        self._loop_stacks(blocks)
        out: dict[tuple, tuple[tuple[tuple[int, np.ndarray], ...], list]] = {}
        index: dict[tuple, int] = {}  # (identical blocks share one index)
        sets = {b for _t, b in self.gather_sets if b >= 0}
        self.block_index: dict[int, int] = {}
        for b in blocks.keys() | self.regathered.keys() | sets:
            d = dict(blocks.get(b, {}))
            pairs = []  # the operands its matmuls gather again: per group, or group pair
            for key, m in self.regathered.get(b, {}).items():
                if isinstance(key, tuple):
                    pairs.append((key, m))
                else:
                    d[key] = d[key] + m if key in d else m
            items = tuple(sorted(d.items()))
            pairs.sort(key=lambda p: p[0])
            sig = (tuple((g, v.tobytes()) for g, v in items),
                   tuple((k, m.tobytes()) for k, m in pairs),
                   b if b in sets else -1)  # (a block with a gather set: its own)
            self.block_index[b] = index.setdefault(sig, len(index))
            out.setdefault(sig, (items, pairs))  # identical blocks once
        remat, edges = [], []
        for i, (items, pairs) in enumerate(out.values()):
            remat.append(items)
            edges += [Edge.compressed(u, v, np.zeros_like(m), m, block=i)
                      for (u, v), m in pairs if np.any(m)]
        return remat, edges

    def _loop_stacks(self, blocks: dict[int, dict[int, np.ndarray]]) -> None:
        """Adds to ``blocks`` what co-sharded blocks' chunk loops hold during their backward
        and the cotangents of recompute groups' outputs (``plan_walk.backward_held``): a loop's
        input by the strategy of the block's op that reads it first (the loop holds it as that
        op reads it), an output by its producer's (an example input, produced by none, at its
        replicated bytes)."""
        producer = self.graph.producer
        for outer, held in backward_held(self.graph, self.grads):
            d, fixed, last = blocks.setdefault(outer, {}), 0.0, None
            for t, copies, reader in held:
                op, side = producer.get(t.id), 1
                if reader in self.space.where:
                    op, side = self.by_id[reader], 0
                elif op is None and t.role is Role.VARIABLE:  # a weight's summed cotangent:
                    # as the weight is laid out, by its reader's strategy
                    op, side = next((c for c in self.graph.consumers.get(t.id, ())
                                     if c.id in self.space.where), None), 0
                if op is None or op.id not in self.space.where:
                    fixed += t.nbytes * copies / self.cm.microbatches
                    continue
                g, _f, mi, fg = last = self.fgroup(op.id)
                j = [o.id for o in (op.outputs, op.inputs)[1 - side]].index(t.id)
                vec = np.array([self.cm._local_bytes(t, self.lays[op.id, sp][side][j])
                                for sp in fg.splits[mi]]) * copies / self.cm.microbatches
                d[g] = d[g] + vec if g in d else vec
            if fixed and last is not None:  # (its outputs are produced inside it)
                d[last[0]] = d[last[0]] + fixed

    def gathers(self) -> list[GatherSet]:
        """The gather sets (:meth:`_keepers`), recomputed blocks by their index in the
        tables' ``remat`` (``block_index``, set by :meth:`remat_sums`)."""
        out = []
        micro = self.cm.microbatches
        for (tid, b), keepers in self.gather_sets.items():
            producer, k = self.graph.writers[tid]
            p_id, t = producer.id, producer.outputs[k]
            gp, _f, mp, fgp = self.fgroup(p_id)
            have = [self.cm._local_bytes(t, self.lays[p_id, sp][1][k]) for sp in fgp.splits[mp]]
            classes: dict[tuple, int] = {}
            sizes: list[float] = []
            readers = []
            for (o_id, j), copies in keepers.items():
                gr, _f, mr, fgr = self.fgroup(o_id)
                scale = self.space.weights[o_id] / micro / self.chunks.get(o_id, 1)
                for level in range(copies):  # a matmul's copy and its cotangent
                    rows = [[-1] * len(fgr.splits[mr]) for _ in range(len(have))]
                    for s, sp in enumerate(fgr.splits[mr]):
                        want = self.lays[o_id, sp][0][j]
                        grown = self.cm._local_bytes(t, want)
                        c = classes.setdefault((want, level), len(classes))
                        if c == len(sizes):
                            sizes.append(0.0)
                        sizes[c] = max(sizes[c], grown * scale)
                        for a, h in enumerate(have):
                            if grown > h:
                                rows[a][s] = c
                    m = np.array(rows, dtype=np.int64)
                    if gp == gr:  # one decision: only equal strategies meet
                        readers.append((gr, -1, np.diagonal(m).copy()[None, :]))
                    else:
                        readers.append((gr, gp, m))
            out.append(GatherSet(np.array(sizes), tuple(readers),
                                 self.block_index.get(b, -1) if b >= 0 else -1))
        return out


def remat_ops(kinds: Mapping[int, tuple[str, tuple[Tensor, ...]]],
              graph: Graph) -> dict[int, int]:
    """Ops inside a remat (``checkpoint``) boundary, region bodies included: op id -> its
    (first) remat boundary's id (``kinds``: :func:`~nnscaler_jax.cost.plan_walk.boundary_kinds`)."""
    out = {}
    for op in graph.walk():
        remat = [b for b in op.boundary if kinds.get(b, ("",))[0] in REMAT_KINDS]
        if remat:
            out[op.id] = remat[0]
    return out


def block_inputs(kinds: Mapping[int, tuple[str, tuple[Tensor, ...]]],
                 remat: Mapping[int, int]) -> set[int]:
    """Ids of the values and example inputs a recomputed block reads from outside: the block
    keeps them for its backward (``plan_walk`` keeps them at the end of its walk)."""
    return {t.id for b in set(remat.values()) for t in kinds[b][1]
            if t.role in (Role.VALUE, Role.INPUT)}
