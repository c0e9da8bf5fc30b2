"""The rows of the search's ILP (:func:`nnscaler_jax.search.ilp.solve`): one strategy per
group, the edges' pair variables tied to both ends, shared gradient syncs, and the memory budget
(groups' and edge pairs' kept bytes plus the peak transient ``T``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from nnscaler_jax.search.objective import CostTables

__all__ = ["SCALE", "Rows", "edge_rows", "memory_rows", "sync_rows"]

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


def edge_rows(lp: Rows, tables: CostTables, off: np.ndarray, desc: str) -> list[int]:
    """Per edge a pair variable per (layout class, layout class), tied to both ends: each row x
    sums to the source strategies in class x, each column y to the destination strategies in
    class y (the last column is implied). Returns each edge's first pair variable."""
    bases = []
    for e in _progress(tables.edges, len(tables.edges), desc):
        if e.block >= 0:  # memory only: bounded through its ends (memory_rows)
            bases.append(-1)
            continue
        nr, nc = e.cost.shape
        base = lp.variables(e.cost.ravel() * SCALE)
        bases.append(base)
        idx = base + np.arange(nr * nc).reshape(nr, nc)
        ties = [(idx[x], np.nonzero(e.rows == x)[0] + off[e.src]) for x in range(nr)]
        ties += [(idx[:, y], np.nonzero(e.cols == y)[0] + off[e.dst]) for y in range(nc - 1)]
        for pair_vars, members in ties:
            lp.add(list(pair_vars) + members.tolist(),
                   [1.0] * len(pair_vars) + [-1.0] * len(members), 0.0, 0.0)
    return bases


def sync_rows(lp: Rows, tables: CostTables, off: np.ndarray) -> None:
    """Per shared gradient sync, ``z_c >= sum of a reader's strategies handing back class c``."""
    for ss in tables.syncs:
        base = lp.variables(ss.cost * SCALE)
        for g, cls in ss.readers:
            for c in np.unique(cls[cls >= 0]):
                members = np.nonzero(cls == c)[0] + off[g]
                lp.add([base + int(c)] + members.tolist(), [1.0] + [-1.0] * len(members),
                       0.0, np.inf)


def memory_rows(lp: Rows, tables: CostTables, off: np.ndarray, max_memory: float,
                 memory_offset: float, pair_vars: Sequence[int]) -> float:
    """Kept bytes (groups' and edge pairs') + T <= M, T (the last variable) >= the chosen
    transient of each group and the residuals of each recomputed block; the bytes are scaled
    by the largest kept bytes (returned)."""
    n = [len(c) for c in tables.compute]
    cols, vals = list(range(int(off[-1]))), [np.concatenate(tables.memory) if n else np.zeros(0)]
    regathered: list[list[tuple[int, float]]] = [[] for _ in tables.remat]
    for e, base in zip(tables.edges, pair_vars, strict=True):
        if e.memory is not None and e.block < 0:
            cols += range(base, base + e.memory.size)
            vals.append(e.memory.ravel())
    mem = np.concatenate(vals)
    scale = max(float(np.abs(mem).max(initial=0.0)), 1.0)
    for e in tables.edges:  # a block's regathered bytes: z >= its bytes at the ends' choices
        if e.memory is not None and e.block >= 0:
            regathered[e.block].append(_block_bytes(lp, e, off, scale))
    tvar = lp.variables(np.zeros(1))
    lp.add(cols + [tvar], (mem / scale).tolist() + [1.0],
           -np.inf, (max_memory - memory_offset) / scale)
    terms = [((g, tables.transient[g]),) for g in range(len(n))] if tables.transient else []
    zs = [[]] * len(terms) + regathered
    for blk, held in zip(terms + list(tables.remat), zs, strict=True):
        # T >= a group's transient; a block's residuals and the operands it gathers again
        cols = [int(off[g]) + i for g, v in blk for i in range(len(v))]
        vals = [v for _, v in blk]
        if held or any(np.any(v) for v in vals):
            lp.add([tvar] + cols + [z for z, _ in held],
                   [1.0] + (-np.concatenate(vals or [np.zeros(0)]) / scale).tolist()
                   + [-top for _, top in held], 0.0, np.inf)
    return scale


def _block_bytes(lp: Rows, e, off: np.ndarray, scale: float) -> tuple[int, float]:
    """``(z, top)``: ``top . z >= e``'s bytes (scaled) at its ends' strategies, without pair
    variables: per class ``y`` of the destination, ``top . z >= sum_a M[a, y] s_src,a -
    max_a M[a, y] (1 - sum_{b in y} s_dst,b)`` (exact at integer choices; ``z`` costs nothing,
    so it sits at the bound; in [0, 1] as the solver bounds every variable but ``T``)."""
    z = lp.variables(np.zeros(1))
    top_all = max(float(e.memory.max()) / scale, 1e-12)
    full = e.memory[e.rows] / scale / top_all  # [src strategy, dst class], at most 1
    for y in range(full.shape[1]):
        col, top = full[:, y], float(full[:, y].max())
        if top <= 0:
            continue
        members = np.nonzero(e.cols == y)[0] + off[e.dst]
        lp.add([z] + (off[e.src] + np.arange(len(col))).tolist() + members.tolist(),
               [1.0] + (-col).tolist() + [-top] * len(members), -top, np.inf)
    rows = e.memory[:, e.cols] / scale / top_all  # [src class, dst strategy]
    for x in range(rows.shape[0]):  # and per class of the source (a tighter relaxation)
        row, top = rows[x], float(rows[x].max())
        if top <= 0:
            continue
        members = np.nonzero(e.rows == x)[0] + off[e.src]
        lp.add([z] + (off[e.dst] + np.arange(len(row))).tolist() + members.tolist(),
               [1.0] + (-row).tolist() + [-top] * len(members), -top, np.inf)
    return z, top_all
