"""The ILP's cost tables as data: per group and strategy, per edge and strategy pair, shared
gradient syncs; and the objective / memory of one choice (one strategy index per group).

Built by :func:`nnscaler_jax.search.tables.build_tables`, solved by :mod:`nnscaler_jax.search.ilp`
and :mod:`nnscaler_jax.search.reduce`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["CostTables", "Edge", "GatherSet", "SyncSet"]


@dataclass(frozen=True)
class Edge:
    """Resharding between two groups: ``cost[rows[a], cols[b]]`` seconds when group ``src``
    takes strategy ``a`` and group ``dst`` strategy ``b`` (rows / cols: layout classes), and
    ``memory[rows[a], cols[b]]`` bytes the pair keeps for the backward (an operand gathered
    on its way to a matmul that saves it; None: none). ``block >= 0``: the bytes are instead
    part of recomputed block ``CostTables.remat[block]``'s transient (the matmul is in the
    block: the gathered copy is rebuilt when its forward runs again and lives next to its
    cotangent, ``cost.residuals.REGATHERED_COPIES`` x the copy's bytes); such an edge costs
    nothing (its relayout's seconds are on the edge the pricing keeps)."""

    src: int
    dst: int
    rows: np.ndarray
    cols: np.ndarray
    cost: np.ndarray
    memory: np.ndarray | None = None
    block: int = -1

    @property
    def full(self) -> np.ndarray:
        """Costs indexed [strategy of src, strategy of dst]."""
        return self.cost[np.ix_(self.rows, self.cols)]

    @property
    def full_memory(self) -> np.ndarray | None:
        """Bytes indexed [strategy of src, strategy of dst] (None: none)."""
        return None if self.memory is None else self.memory[np.ix_(self.rows, self.cols)]

    @classmethod
    def compressed(cls, src: int, dst: int, mat: np.ndarray,
                   memory: np.ndarray | None = None, block: int = -1) -> Edge:
        """The edge of a full (strategies of ``src``) x (strategies of ``dst``) cost matrix
        (and bytes matrix), strategies with equal rows / columns sharing one layout class."""
        if memory is not None and not np.any(memory):
            memory = None
        k = mat.shape[1]
        rows_u, rows = _unique_rows(mat if memory is None else np.hstack([mat, memory]))
        nr = len(rows_u)
        stacked = rows_u if memory is None else np.vstack([rows_u[:, :k], rows_u[:, k:]])
        cols_u, cols = _unique_rows(stacked.T)
        both = np.ascontiguousarray(cols_u.T)
        return cls(src, dst, rows, cols, both[:nr],
                   None if memory is None else np.ascontiguousarray(both[nr:]), block)

    def memory_at(self, a: int, b: int) -> float:
        """Bytes kept when ``src`` takes strategy ``a`` and ``dst`` strategy ``b``."""
        return 0.0 if self.memory is None else float(self.memory[self.rows[a], self.cols[b]])


def _unique_rows(mat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct rows in order of first appearance, row -> index of its distinct row): what
    ``np.unique(mat, axis=0, return_inverse=True)`` gives up to the order, without its sort of
    structured views (the search compresses thousands of small matrices)."""
    index: dict[bytes, int] = {}
    first: list[int] = []
    inv = np.empty(len(mat), dtype=np.intp)
    for i, row in enumerate(np.ascontiguousarray(mat)):
        k = index.setdefault(row.tobytes(), len(index))
        if k == len(first):
            first.append(i)
        inv[i] = k
    return mat[first], inv


class _Classes:
    """Terms paid once per class that any reader picks. ``readers``: ``(reader group,
    producer group or -1, class[producer strategy, reader strategy])``, -1 for none; without a
    producer group the matrix has one row (the class is the reader's strategy's alone)."""

    readers: tuple[tuple[int, int, np.ndarray], ...]

    def classes(self, choice) -> set[int]:
        return {int(m[choice[p] if p >= 0 else 0, choice[r]])
                for r, p, m in self.readers} - {-1}

    def groups(self) -> set[int]:
        return {g for r, p, _m in self.readers for g in (r, p) if g >= 0}

    def reindexed(self, index) -> tuple[tuple[int, int, np.ndarray], ...]:
        """The readers with their groups renumbered by ``index``."""
        return tuple((index[r], index[p] if p >= 0 else -1, m) for r, p, m in self.readers)

    def subset(self, alive) -> tuple[tuple[int, int, np.ndarray], ...]:
        """The readers over strategies ``alive[g]`` of each group only."""
        return tuple((r, p, m[np.ix_(alive[p], alive[r])] if p >= 0 else m[:, alive[r]])
                     for r, p, m in self.readers)


@dataclass(frozen=True)
class SyncSet(_Classes):
    """Seconds paid once per class: ``cost[c]`` once any reader picks class ``c``. One
    tensor's gradient reductions (a class: the layout and axes a reader hands its gradient
    back in; no producer group), or one value's relayouts into several readers (a class: a
    (producer layout, reader layout) pair: XLA's SPMD partitioner reshards an instruction once
    per target sharding, so readers reading a value alike share one relayout, its gradient's
    way back included). ``readers`` as :class:`_Classes`'."""

    cost: np.ndarray
    readers: tuple[tuple[int, int, np.ndarray], ...]

    def value(self, choice) -> float:
        return float(sum(self.cost[c] for c in self.classes(choice)))


@dataclass(frozen=True)
class GatherSet(_Classes):
    """One tensor's copies grown on the way into readers in several groups that keep them for
    their transposes: ``bytes[c]`` once any reader picks class ``c`` (a layout, and for a
    matmul a second class of the same bytes: its cotangent), so readers gathering the tensor
    to one layout keep one copy, as ``plan_cost`` does. ``readers`` as :class:`_Classes`'
    (-1: no growth, a copy is kept only when the reader's layout holds more than the
    producer's). ``block >= 0``: the copies are recomputed block ``CostTables.remat[block]``'s
    transient, else kept bytes."""

    bytes: np.ndarray
    readers: tuple[tuple[int, int, np.ndarray], ...]
    block: int = -1

    def value(self, choice) -> float:
        return float(sum(self.bytes[c] for c in self.classes(choice)))


@dataclass
class CostTables:
    """Per group: ``compute`` / ``comm`` seconds and ``memory`` bytes per strategy; edges;
    seconds paid once per class (gradient syncs, relayouts several readers share)."""

    compute: list[np.ndarray]
    comm: list[np.ndarray]
    memory: list[np.ndarray]
    edges: list[Edge]
    syncs: list[SyncSet]
    transient: list[np.ndarray] | None = None  # per group: largest output of a member
    # per recomputed block: (group, residual bytes per strategy) of its ops, live at once
    # (and the edges whose ``block`` is its index: operands its matmuls gather)
    remat: list[tuple[tuple[int, np.ndarray], ...]] = field(default_factory=list)
    gathers: list[GatherSet] = field(default_factory=list)  # copies several groups gather

    def block_transient(self, choice) -> float:
        """The largest recomputed block's residual bytes under ``choice`` (0: none)."""
        per = [sum(float(v[choice[g]]) for g, v in blk) for blk in self.remat]
        for e in self.edges:
            if e.block >= 0:
                per[e.block] += e.memory_at(choice[e.src], choice[e.dst])
        for gs in self.gathers:
            if gs.block >= 0:
                per[gs.block] += gs.value(choice)
        return max(per, default=0.0)

    def memory_of(self, choice) -> float:
        """Kept bytes (groups' and edges') plus the largest transient (as ``plan_cost``'s
        peak)."""
        kept = sum(float(self.memory[g][c]) for g, c in enumerate(choice))
        kept += sum(e.memory_at(choice[e.src], choice[e.dst]) for e in self.edges
                    if e.block < 0)
        kept += sum(gs.value(choice) for gs in self.gathers if gs.block < 0)
        peak = self.block_transient(choice)
        if self.transient:
            peak = max(peak, max((float(self.transient[g][c]) for g, c in enumerate(choice)),
                                 default=0.0))
        return kept + peak

    def unary(self, g: int) -> np.ndarray:
        return self.compute[g] + self.comm[g]

    def objective(self, choice) -> float:
        total = sum(float(self.unary(g)[c]) for g, c in enumerate(choice))
        total += sum(float(e.cost[e.rows[choice[e.src]], e.cols[choice[e.dst]]])
                     for e in self.edges)
        return total + sum(s.value(choice) for s in self.syncs)
