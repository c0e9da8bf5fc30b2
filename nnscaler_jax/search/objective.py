"""The ILP's cost tables as data: per group and strategy, per edge and strategy pair, shared
gradient syncs; and the objective / memory of one choice (one strategy index per group).

Built by :func:`nnscaler_jax.search.tables.build_tables`, solved by :mod:`nnscaler_jax.search.ilp`
and :mod:`nnscaler_jax.search.reduce`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["CostTables", "Edge", "SyncSet"]


@dataclass(frozen=True)
class Edge:
    """Resharding between two groups: ``cost[rows[a], cols[b]]`` seconds when group ``src``
    takes strategy ``a`` and group ``dst`` strategy ``b`` (rows / cols: layout classes)."""

    src: int
    dst: int
    rows: np.ndarray
    cols: np.ndarray
    cost: np.ndarray

    @property
    def full(self) -> np.ndarray:
        """Costs indexed [strategy of src, strategy of dst]."""
        return self.cost[np.ix_(self.rows, self.cols)]

    @classmethod
    def compressed(cls, src: int, dst: int, mat: np.ndarray) -> Edge:
        """The edge of a full (strategies of ``src``) x (strategies of ``dst``) cost matrix,
        strategies with equal rows / columns sharing one layout class."""
        rows_u, rows = _unique_rows(mat)
        cols_u, cols = _unique_rows(rows_u.T)
        return cls(src, dst, rows, cols, np.ascontiguousarray(cols_u.T))


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


@dataclass(frozen=True)
class SyncSet:
    """One tensor's gradient reductions: ``cost[c]`` seconds once any reader hands its gradient
    back in layout class ``c``; ``readers``: (group, class per strategy, -1 for none)."""

    cost: np.ndarray
    readers: tuple[tuple[int, np.ndarray], ...]

    def value(self, choice) -> float:
        used = {int(cls[choice[g]]) for g, cls in self.readers} - {-1}
        return float(sum(self.cost[c] for c in used))


@dataclass
class CostTables:
    """Per group: ``compute`` / ``comm`` seconds and ``memory`` bytes per strategy; edges;
    deduplicated gradient syncs."""

    compute: list[np.ndarray]
    comm: list[np.ndarray]
    memory: list[np.ndarray]
    edges: list[Edge]
    syncs: list[SyncSet]
    transient: list[np.ndarray] | None = None  # per group: largest output of a member

    def memory_of(self, choice) -> float:
        """Kept bytes plus the largest transient (as ``plan_cost``'s peak)."""
        kept = sum(float(self.memory[g][c]) for g, c in enumerate(choice))
        if not self.transient:
            return kept
        return kept + max((float(self.transient[g][c]) for g, c in enumerate(choice)),
                          default=0.0)

    def unary(self, g: int) -> np.ndarray:
        return self.compute[g] + self.comm[g]

    def objective(self, choice) -> float:
        total = sum(float(self.unary(g)[c]) for g, c in enumerate(choice))
        total += sum(float(e.cost[e.rows[choice[e.src]], e.cols[choice[e.dst]]])
                     for e in self.edges)
        return total + sum(s.value(choice) for s in self.syncs)
