"""The rows of the search's ILP (:func:`nnscaler_jax.search.ilp.solve`): one strategy per
group, the edges' pair variables tied to both ends, shared gradient syncs, and the memory budget
(groups' and edge pairs' kept bytes plus the peak transient ``T``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from nnscaler_jax.search.objective import CostTables, GatherSet, SyncSet

__all__ = ["SCALE", "Rows", "class_rows", "edge_rows", "memory_rows", "sync_rows"]

SCALE = 1e6  # seconds -> microseconds inside the solver (HiGHS tolerances are absolute-ish)


class Rows:
    """The ILP's constraint matrix in COO form, one row at a time, and its variables' costs."""

    def __init__(self, nv: int) -> None:
        self.nv = nv  # variables so far
        self.r = 0  # rows so far
        self.rows: list[int] = []
        self.cols: list = []
        self.vals: list = []
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.c_parts: list[np.ndarray] = []

    def add(self, cols: list, vals: list, lo: float, hi: float) -> None:
        """One constraint ``lo <= sum(vals * x[cols]) <= hi``."""
        self.rows += [self.r] * len(cols)
        self.cols += cols
        self.vals += vals
        self.lb.append(lo)
        self.ub.append(hi)
        self.r += 1

    def variables(self, cost: np.ndarray) -> int:
        """New continuous variables costing ``cost`` (microseconds); the index of the first."""
        base = self.nv
        self.nv += len(cost)
        self.c_parts.append(cost)
        return base


def _progress(iterable, total: int, desc: str):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm ships with the dev environment
        return iterable
    return tqdm(iterable, total=total, desc=desc, disable=None, leave=False)


def edge_rows(lp: Rows, tables: CostTables, off: np.ndarray,
              desc: str) -> list[tuple[int, np.ndarray | None]]:
    """Per edge a pair variable per (layout class, layout class), tied to both ends: each row x
    sums to the source strategies in class x, each column y to the destination strategies in
    class y (the last column is implied). A recomputed block's edge (``block >= 0``, bytes
    only) reads the pair variables of the edge between the same groups when their classes
    tell its bytes apart (they do in the zoo's graphs: no variables of its own, and HiGHS
    solves Swin's 16-GPU preset's hardest probe in 15 s instead of 37 s with a bound variable
    per class), else gets its own. Returns per edge ``(first pair variable, bytes per pair
    variable or None)``."""
    out: list[tuple[int, np.ndarray | None]] = [(-1, None)] * len(tables.edges)
    shared: dict[tuple[int, int], tuple] = {}
    blocks_last = sorted(range(len(tables.edges)), key=lambda i: tables.edges[i].block >= 0)
    for i in _progress(blocks_last, len(tables.edges), desc):
        e = tables.edges[i]
        if e.block >= 0 and e.memory is None:
            continue  # no bytes
        on = _on_pairs(e, shared) if e.block >= 0 else None
        if on is not None:
            out[i] = on
            continue
        nr, nc = e.cost.shape
        base = lp.variables(e.cost.ravel() * SCALE)
        out[i] = (base, e.memory)
        if e.block < 0:
            shared[e.src, e.dst] = (e, base)
        idx = base + np.arange(nr * nc).reshape(nr, nc)
        ties = [(idx[x], np.nonzero(e.rows == x)[0] + off[e.src]) for x in range(nr)]
        ties += [(idx[:, y], np.nonzero(e.cols == y)[0] + off[e.dst]) for y in range(nc - 1)]
        for pair_vars, members in ties:
            lp.add(list(pair_vars) + members.tolist(),
                   [1.0] * len(pair_vars) + [-1.0] * len(members), 0.0, 0.0)
    return out


def _on_pairs(e, shared: dict) -> tuple[int, np.ndarray] | None:
    """``e``'s bytes on the pair variables of the (earlier) edge between the same groups:
    ``(its first pair variable, bytes per its class pair)``; None when there is none or its
    classes do not tell ``e``'s bytes apart."""
    flip = (e.src, e.dst) not in shared
    hit = shared.get((e.dst, e.src) if flip else (e.src, e.dst))
    if hit is None:
        return None
    r, base = hit
    full = e.full_memory.T if flip else e.full_memory  # [r.src strategy, r.dst strategy]
    # each class's first strategy (classes are numbered 0.. in order of first appearance)
    by_class = full[np.ix_(np.unique(r.rows, return_index=True)[1],
                           np.unique(r.cols, return_index=True)[1])]
    if not np.array_equal(by_class[np.ix_(r.rows, r.cols)], full):
        return None
    return base, by_class


def sync_rows(lp: Rows, tables: CostTables, off: np.ndarray) -> None:
    """Per sync set (gradient syncs, shared relayouts) its classes' variables, costing their
    seconds once (:func:`class_rows`)."""
    for ss in tables.syncs:
        class_rows(lp, ss, ss.cost * SCALE, off)


def class_rows(lp: Rows, cs: SyncSet | GatherSet, cost: np.ndarray, off: np.ndarray) -> int:
    """A class set's variables ``y_c`` (continuous, in [0, 1], costing ``cost``), each at
    least 1 when a reader picks class ``c``: without a producer group ``y_c >= sum of the
    reader's strategies in class c``; with one, per set ``S`` of reader strategies with equal
    columns (most share their layout) and class ``c``, ``y_c >= sum_S x_rs + sum_a x_pa - 1``
    over the producer strategies ``a`` with ``class[a, s] == c`` (a row per strategy ``s``
    instead made T5-8's Alpa-style ILP 845k rows of relayout sets, 34k so). Returns the first
    variable's index."""
    base = lp.variables(cost)
    for r, p, m in cs.readers:
        if p < 0:
            row = m[0]
            for c in np.unique(row[row >= 0]):
                members = (np.nonzero(row == c)[0] + off[r]).tolist()
                lp.add([base + int(c)] + members, [1.0] + [-1.0] * len(members), 0.0, np.inf)
            continue
        cols, which = np.unique(m, axis=1, return_inverse=True)
        for k in range(cols.shape[1]):
            col = cols[:, k]
            rs = (np.nonzero(which.ravel() == k)[0] + off[r]).tolist()
            for c in np.unique(col[col >= 0]):
                ps = (np.nonzero(col == c)[0] + off[p]).tolist()
                lp.add([base + int(c)] + rs + ps, [1.0] + [-1.0] * (len(rs) + len(ps)),
                       -1.0, np.inf)
    return base


def memory_rows(lp: Rows, tables: CostTables, off: np.ndarray, max_memory: float,
                memory_offset: float, pairs: Sequence[tuple[int, np.ndarray | None]]) -> float:
    """Kept bytes (groups' and edge pairs', gather sets' classes: :func:`class_rows`) + T <=
    M, T (the last variable) >= the chosen transient of each group and the residuals of each
    recomputed block with the bytes its edges' pairs (and its gather sets) gather again
    (``pairs``: :func:`edge_rows`); the bytes are scaled by the largest kept bytes
    (returned)."""
    n = [len(c) for c in tables.compute]
    cols, vals = list(range(int(off[-1]))), [np.concatenate(tables.memory) if n else np.zeros(0)]
    held: list[tuple[list, list]] = [([], []) for _ in tables.remat]  # per block: pairs, bytes
    for e, (base, mem) in zip(tables.edges, pairs, strict=True):
        if mem is not None:
            into = (cols, vals) if e.block < 0 else held[e.block]
            into[0].extend(range(base, base + mem.size))
            into[1].append(mem.ravel())
    for gs in tables.gathers:  # y_c >= [a reader picks class c]: its bytes once
        base = class_rows(lp, gs, np.zeros(len(gs.bytes)), off)
        into = (cols, vals) if gs.block < 0 else held[gs.block]
        into[0].extend(range(base, base + len(gs.bytes)))
        into[1].append(np.asarray(gs.bytes, dtype=float))
    mem = np.concatenate(vals)
    scale = max(float(np.abs(mem).max(initial=0.0)), 1.0)
    tvar = lp.variables(np.zeros(1))
    lp.add(cols + [tvar], (mem / scale).tolist() + [1.0],
           -np.inf, (max_memory - memory_offset) / scale)
    terms = [((g, tables.transient[g]),) for g in range(len(n))] if tables.transient else []
    for blk, (pair_cols, pair_vals) in zip(terms + list(tables.remat),
                                           [([], [])] * len(terms) + held, strict=True):
        # T >= a group's transient; a block's residuals and the operands it gathers again
        cols = [int(off[g]) + i for g, v in blk for i in range(len(v))] + pair_cols
        vals = np.concatenate([v for _, v in blk] + pair_vals + [np.zeros(0)])
        if np.any(vals):
            lp.add([tvar] + cols, [1.0] + (-vals / scale).tolist(), 0.0, np.inf)
    return scale
