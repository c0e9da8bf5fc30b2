"""Exact reduction of the strategy ILP: eliminate groups of degree <= 2 before solving.

The ILP's objective is a sum of per-group (unary) costs and per-edge (pairwise) costs, so a
group ``v`` that touches at most two other groups can be minimised out exactly — variable
elimination, as a dynamic program over a chain does:

- **leaf** (one neighbour ``h``): ``unary_h[b] += min_a (unary_v[a] + E_vh[a, b])``; ``v``'s best
  answer to each choice of ``h`` is remembered;
- **series** (two neighbours ``h1``, ``h2``): a new edge ``E_h1h2[b, c] += min_a (unary_v[a] +
  E_vh1[a, b] + E_vh2[a, c])``, remembering ``v``'s best answer to each pair;
- **free** (no neighbour left): ``v`` takes its cheapest strategy.

Repeated to a fixed point this shrinks a transformer's group graph (residual-stream chains,
norms, projections) to the few groups that meet three or more others; the ILP solves only those,
and the eliminated groups are read back in reverse order. The optimum is unchanged. A gradient
sync shared by readers in two groups is a pairwise term (an edge) too; groups that other terms
couple are never eliminated: readers of a sync shared by three or more groups, and, under a
memory budget, groups whose memory or transient differs between strategies, the two ends of
an edge that keeps bytes (its memory term stays as it is) and the groups of a gather set.

What is left (cycles: attention's q / k / v meeting again, MoE's gates) has only unary and
pairwise terms unless a gradient sync couples three groups; :func:`solve_by_elimination` then
minimises it out too (min-sum bucket elimination, smallest new term first), falling back to the
ILP when a term would grow past ``max_entries``.

Nothing here is in Alpa's formulation (it solves the full ILP), so only our planner uses it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from nnscaler_jax.search.objective import CostTables, Edge, GatherSet, SyncSet

__all__ = ["Reduced", "dead_end_elimination", "least_memory", "prune_dominated",
           "reduce_tables", "solve_by_elimination"]


@dataclass(frozen=True)
class Reduced:
    """The ILP left after elimination and how to read the eliminated groups back.

    Attributes:
        tables: cost tables over the kept groups only (their unary costs include what the
            eliminated neighbours contributed).
        kept: original group index of each group of ``tables``.
        steps: elimination records, in order.
        memory_offset / transient_floor: constant memory of the eliminated groups (kept bytes,
            the largest transient) under a memory budget.
    """

    tables: CostTables
    kept: tuple[int, ...]
    steps: tuple[tuple, ...]
    memory_offset: float = 0.0
    transient_floor: float = 0.0

    @property
    def eliminated(self) -> int:
        return len(self.steps)

    def expand(self, choice: tuple[int, ...] | list[int], n: int) -> tuple[int, ...]:
        """The full choice (every original group) from a choice over the kept groups."""
        full = [-1] * n
        for g, c in zip(self.kept, choice, strict=True):
            full[g] = int(c)
        for step in reversed(self.steps):
            kind, v = step[0], step[1]
            if kind == "free":
                full[v] = step[2]
            elif kind == "leaf":
                full[v] = int(step[3][full[step[2]]])
            else:
                full[v] = int(step[4][full[step[2]], full[step[3]]])
        return tuple(full)


def _constant(x: np.ndarray | None) -> bool:
    return x is None or len(x) == 0 or bool(np.all(x == x[0]))


def reduce_tables(tables: CostTables, *, memory_budget: bool = False) -> Reduced:
    """Eliminate every group of degree <= 2 that only edges couple (see the module docs)."""
    n = len(tables.compute)
    unary, pair, syncs = _pairwise(tables)
    protected = {g for s in syncs for g in s.groups()}
    held: dict[tuple[int, int], np.ndarray] = {}  # (u < v) -> bytes of the edges that keep some
    if memory_budget:
        tr = tables.transient
        protected |= {g for g in range(n) if not _constant(tables.memory[g])
                      or (tr is not None and not _constant(tr[g]))}
        protected |= {g for blk in tables.remat for g, _ in blk}
        protected |= {g for gs in tables.gathers for g in gs.groups()}
        for e in tables.edges:
            if e.memory is not None:
                protected |= {e.src, e.dst}
                if e.block >= 0:  # a recomputed block's term: stays as it is (below)
                    continue
                u, v, m = (e.src, e.dst, e.full_memory) if e.src < e.dst else \
                    (e.dst, e.src, e.full_memory.T)
                held[(u, v)] = held[(u, v)] + m if (u, v) in held else m
    steps, alive = _eliminate(unary, pair, protected)
    kept = tuple(g for g in range(n) if alive[g])
    index = {g: i for i, g in enumerate(kept)}
    edges = [Edge.compressed(index[u], index[v], mat, held.get((u, v)))
             for (u, v), mat in pair.items()]
    if memory_budget:
        edges += [replace(e, src=index[e.src], dst=index[e.dst]) for e in tables.edges
                  if e.block >= 0 and e.memory is not None]
    syncs = [SyncSet(s.cost, s.reindexed(index)) for s in syncs]
    gone = [g for g in range(n) if not alive[g]]
    offset = floor = 0.0
    if memory_budget and gone:
        offset = float(sum(tables.memory[g][0] for g in gone))
        if tables.transient is not None:
            floor = float(max(tables.transient[g][0] for g in gone))
    reduced = CostTables(
        [unary[g] for g in kept], [np.zeros_like(unary[g]) for g in kept],
        [tables.memory[g] for g in kept], edges, syncs,
        None if tables.transient is None else [tables.transient[g] for g in kept],
        [tuple((index[g], v) for g, v in blk) for blk in tables.remat] if memory_budget else [],
        [GatherSet(gs.bytes, gs.reindexed(index), gs.block)
         for gs in tables.gathers] if memory_budget else [])
    return Reduced(reduced, kept, tuple(steps), offset, floor)


def _pairwise(tables: CostTables) -> tuple[list[np.ndarray], dict[tuple[int, int], np.ndarray],
                                             list[SyncSet]]:
    """The objective as unary costs, pairwise costs ``(u, v) with u < v -> (n_u, n_v)`` (edges,
    and gradient syncs shared by readers in at most two groups), and the syncs left (three or
    more groups)."""
    n = len(tables.compute)
    unary = [tables.unary(g).astype(float) for g in range(n)]
    pair: dict[tuple[int, int], np.ndarray] = {}
    for e in tables.edges:
        if e.block >= 0:  # memory only (a recomputed block's gathered operand)
            continue
        full = e.full
        u, v, mat = (e.src, e.dst, full) if e.src < e.dst else (e.dst, e.src, full.T)
        pair[(u, v)] = pair[(u, v)] + mat if (u, v) in pair else mat
    syncs = []
    for ss in tables.syncs:
        groups = sorted(ss.groups())
        if len(groups) > 2:
            syncs.append(ss)
            continue
        u, v = groups[0], groups[-1]
        terms = np.zeros((len(unary[u]), len(unary[v])))
        for a in range(terms.shape[0]):
            for b in range(terms.shape[1]):
                terms[a, b] = ss.value({u: a, v: b})
        if u == v:
            unary[u] = unary[u] + np.diagonal(terms)
        else:
            pair[(u, v)] = pair[(u, v)] + terms if (u, v) in pair else terms
    return unary, pair, syncs


def _eliminate(unary: list[np.ndarray], pair: dict[tuple[int, int], np.ndarray],
               protected: set[int]) -> tuple[list[tuple], list[bool]]:
    """Minimise out groups of degree <= 2 not ``protected``, to a fixed point (``unary`` and
    ``pair`` are updated in place): the elimination records and which groups are left."""
    n = len(unary)
    adj: list[set[int]] = [set() for _ in range(n)]
    for u, v in pair:
        adj[u].add(v)
        adj[v].add(u)

    def edge(u: int, v: int) -> np.ndarray:
        """Costs indexed [strategy of u, strategy of v]."""
        return pair[(u, v)] if u < v else pair[(v, u)].T

    def drop(u: int, v: int) -> None:
        pair.pop((u, v) if u < v else (v, u))
        adj[u].discard(v)
        adj[v].discard(u)

    steps: list[tuple] = []
    alive = [True] * n
    todo = [g for g in range(n) if g not in protected and len(adj[g]) <= 2]
    while todo:
        v = todo.pop()
        if not alive[v] or len(adj[v]) > 2:
            continue
        nbrs = sorted(adj[v])
        if not nbrs:
            steps.append(("free", v, int(np.argmin(unary[v]))))
        elif len(nbrs) == 1:
            (h,) = nbrs
            tot = unary[v][:, None] + edge(v, h)
            unary[h] = unary[h] + tot.min(axis=0)
            steps.append(("leaf", v, h, tot.argmin(axis=0)))
            drop(v, h)
        else:
            h1, h2 = nbrs
            tot = unary[v][:, None, None] + edge(v, h1)[:, :, None] + edge(v, h2)[:, None, :]
            steps.append(("series", v, h1, h2, tot.argmin(axis=0)))
            drop(v, h1)
            drop(v, h2)
            new = tot.min(axis=0)
            key = (h1, h2)  # h1 < h2 (sorted)
            pair[key] = pair[key] + new if key in pair else new
            adj[h1].add(h2)
            adj[h2].add(h1)
        alive[v] = False
        todo += [h for h in nbrs if alive[h] and h not in protected and len(adj[h]) <= 2]
    return steps, alive


def solve_by_elimination(tables: CostTables, max_entries: int = 2_000_000
                         ) -> tuple[int, ...] | None:
    """The optimal choice of a problem with only unary and pairwise terms, by min-sum bucket
    elimination (each step minimises one group out of every term that holds it, creating a term
    over its neighbours), or None when a term would exceed ``max_entries`` or gradient syncs
    couple groups (the ILP then solves it). Exact, like the ILP."""
    if tables.syncs:
        return None
    n = len(tables.compute)
    unary = [tables.unary(g).astype(float) for g in range(n)]
    pairs = [(e.src, e.dst, e.full) for e in tables.edges]
    kept = dead_end_elimination(unary, pairs)  # exact: only never-optimal strategies go
    size = [len(a) for a in kept]
    terms: list[tuple[tuple[int, ...], np.ndarray]] = [((g,), unary[g][kept[g]])
                                                        for g in range(n)]
    for u, v, m in pairs:
        terms.append(((u, v), m[np.ix_(kept[u], kept[v])]))
    nbr: list[set[int]] = [set() for _ in range(n)]
    for vs, _ in terms:
        for u in vs:
            nbr[u].update(w for w in vs if w != u)
    alive = set(range(n))
    steps: list[tuple[int, tuple[int, ...], np.ndarray]] = []
    while alive:
        v = min(alive, key=lambda g: (int(np.prod([size[u] for u in nbr[g]])), g))
        rest = tuple(sorted(nbr[v]))
        if np.prod([size[u] for u in rest], dtype=float) * size[v] > max_entries:
            return None
        axes = (v, *rest)
        total = np.zeros([size[u] for u in axes])
        keep = []
        for vs, arr in terms:
            if v not in vs:
                keep.append((vs, arr))
                continue
            order = sorted(range(len(vs)), key=lambda i: axes.index(vs[i]))
            moved = np.transpose(arr, order)
            shape = [size[u] if u in vs else 1 for u in axes]
            total = total + moved.reshape(shape)
        steps.append((v, rest, total.argmin(axis=0)))
        terms = keep + [(rest, total.min(axis=0))]
        alive.discard(v)
        for u in rest:  # the new term joins v's neighbours
            nbr[u].discard(v)
            nbr[u].update(w for w in rest if w != u)
    choice = [0] * n
    for v, rest, arg in reversed(steps):
        choice[v] = int(arg[tuple(choice[u] for u in rest)]) if rest else int(arg)
    return tuple(int(kept[g][c]) for g, c in enumerate(choice))


def dead_end_elimination(unary: list[np.ndarray], pairs: list[tuple[int, int, np.ndarray]]
                         ) -> list[np.ndarray]:
    """Strategies that can be in an optimal choice of a unary + pairwise problem (Goldstein's
    dead-end elimination, exact): strategy ``a`` of a group is dropped when another strategy
    ``b`` of it is better whatever the neighbours choose,
    ``U[a] - U[b] + sum over edges of min_s (E[a, s] - E[b, s]) > 0``; repeated until nothing
    changes, the minimum over the neighbours' strategies still alive. Every optimum keeps only
    strategies that survive, so minimising over them is exact. A margin of 64 ulps of the terms'
    magnitudes keeps rounding from dropping either of two equal strategies. Returns each
    group's surviving strategy indices (ascending).

    >>> u = [np.array([1.0, 0.0, 5.0]), np.array([0.0, 0.0])]
    >>> e = np.array([[0.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    >>> [a.tolist() for a in dead_end_elimination(u, [(0, 1, e)])]
    [[1], [0]]
    """
    n = len(unary)
    alive = [np.arange(len(u)) for u in unary]
    touching: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
    for u, v, m in pairs:
        touching[u].append((v, m))
        touching[v].append((u, m.T))
    changed = True
    while changed:
        changed = False
        for v in range(n):
            idx = alive[v]
            if len(idx) < 2:
                continue
            cur = unary[v][idx]
            d = cur[:, None] - cur[None, :]
            scale = float(np.abs(cur).max())
            for w, m in touching[v]:
                sub = m[np.ix_(idx, alive[w])]
                d += (sub[:, None, :] - sub[None, :, :]).min(axis=2)
                scale += float(np.abs(sub).max())
            np.fill_diagonal(d, -np.inf)
            drop = (d > 64 * np.finfo(float).eps * scale).any(axis=1)
            if drop.any():
                alive[v] = idx[~drop]
                changed = True
    return alive


def prune_dominated(tables: CostTables) -> tuple[CostTables, list[np.ndarray]]:
    """The tables without strategies no optimum under a memory budget picks: dead-end
    elimination (as :func:`dead_end_elimination`) where strategy ``b`` replaces ``a`` only if
    the bytes it keeps more, plus the most any transient grows (a group's, a recomputed
    block's: its residuals and the operands it gathers again), are at most zero, so swapping
    ``a`` for ``b`` in any choice that fits still fits (the peak is the kept bytes plus the
    largest transient) and costs less. A sync set a group reads into (or produces for) prices
    the swap at its worst (``b``'s class newly paid whatever the other end picks, ``a``'s never
    saved), and so does a gather set it is in (every copy of the set newly kept). Exact: every
    optimum survives.

    Returns:
        ``(pruned tables, kept strategy indices per group)``; a choice ``c`` over the pruned
        tables is ``kept[g][c[g]]`` over ``tables``.
    """
    n = len(tables.compute)
    unary = [tables.unary(g).astype(float) for g in range(n)]
    touching: list[list[tuple]] = [[] for _ in range(n)]  # (other end, cost, bytes, block)
    for e in tables.edges:
        full, mem = e.full, e.full_memory
        touching[e.src].append((e.dst, full, mem, e.block))
        touching[e.dst].append((e.src, full.T, None if mem is None else mem.T, e.block))
    reads: list[list[tuple]] = [[] for _ in range(n)]  # (cost, classes, other group, reader)
    for ss in tables.syncs:
        for r, p, m in ss.readers:
            reads[r].append((ss.cost, m, p, True))
            if p >= 0:
                reads[p].append((ss.cost, m, r, False))
    tr = tables.transient
    residuals: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]  # (block, bytes)
    for i, blk in enumerate(tables.remat):
        for g, r in blk:
            residuals[g].append((i, r))
    gathers: list[list[tuple[int, float]]] = [[] for _ in range(n)]  # (block, all copies)
    for gs in tables.gathers:
        for g in gs.groups():
            gathers[g].append((gs.block, float(gs.bytes.sum())))
    alive = [np.arange(len(u)) for u in unary]
    changed = True
    while changed:
        changed = False
        for v in range(n):
            idx = alive[v]
            if len(idx) < 2:
                continue
            drop = _dominated(v, idx, unary[v], touching[v], reads[v], alive,
                              tables.memory[v], None if tr is None else tr[v], residuals[v],
                              gathers[v])
            if drop.any():
                alive[v] = idx[~drop]
                changed = True
    return _subset(tables, alive), alive


def _dominated(v: int, idx: np.ndarray, unary: np.ndarray, touching, reads, alive,
               memory: np.ndarray, transient: np.ndarray | None, residuals,
               gathers) -> np.ndarray:
    """Which alive strategies ``idx`` of group ``v`` another alive one replaces (see
    :func:`prune_dominated`): ``d[a, b] > 0`` when ``b`` is cheaper whatever the rest picks
    and keeps no more bytes whatever the rest picks (its edges' bytes at their worst)."""
    cur = unary[idx]
    d = cur[:, None] - cur[None, :]
    scale = float(np.abs(cur).max())
    m = memory[idx].astype(float)
    more = np.zeros((len(idx), len(idx)))  # [a, b]: b's edges keep at most this much more
    grow: dict[int, np.ndarray] = {}  # block -> [a, b]: its transient grows at most this much
    for w, cost, kept, blk in touching:
        sub = cost[np.ix_(idx, alive[w])]
        d += (sub[:, None, :] - sub[None, :, :]).min(axis=2)
        scale += float(np.abs(sub).max())
        if kept is not None:
            k = kept[np.ix_(idx, alive[w])]
            worst = (k[None, :, :] - k[:, None, :]).max(axis=2)
            if blk < 0:
                more += worst
            else:
                grow[blk] = grow[blk] + worst if blk in grow else worst
    for cost, cls, other, reader in reads:  # the swap may start paying b's class
        # c[q, s]: the class under the other end's strategy q and this group's s
        c = cls[:, idx] if other < 0 else cls[np.ix_(alive[other], idx)] if reader else \
            cls[np.ix_(idx, alive[other])].T
        paid = np.where(c >= 0, cost[np.maximum(c, 0)], 0.0)
        d -= np.where(c[:, None, :] != c[:, :, None], paid[:, None, :], 0.0).max(axis=0)
        scale += float(np.abs(cost).max(initial=0.0))
    for blk, r in residuals:
        r = r[idx]
        grow[blk] = grow[blk] + (r[None, :] - r[:, None]) if blk in grow else \
            r[None, :] - r[:, None]
    for blk, total in gathers:  # the swap may start keeping all of a gather set's copies
        if blk < 0:
            more += total
        else:
            grow[blk] = grow[blk] + total if blk in grow else np.full_like(more, total)
    rise = np.zeros_like(more)  # the largest transient grows at most by the most one does
    for t in ([] if transient is None else [transient[idx][None, :] - transient[idx][:, None]]) \
            + list(grow.values()):
        np.maximum(rise, t, out=rise)
    fits = m[None, :] + more + rise <= m[:, None]
    d = np.where(fits, d, -np.inf)
    np.fill_diagonal(d, -np.inf)
    return (d > 64 * np.finfo(float).eps * scale).any(axis=1)


def _subset(tables: CostTables, alive: list[np.ndarray]) -> CostTables:
    """``tables`` over the strategies ``alive`` of each group only."""
    tr = tables.transient
    return CostTables(
        [c[a] for c, a in zip(tables.compute, alive, strict=True)],
        [c[a] for c, a in zip(tables.comm, alive, strict=True)],
        [m[a] for m, a in zip(tables.memory, alive, strict=True)],
        [Edge.compressed(e.src, e.dst, e.full[np.ix_(alive[e.src], alive[e.dst])],
                         None if e.memory is None else
                         e.full_memory[np.ix_(alive[e.src], alive[e.dst])], e.block)
         for e in tables.edges],
        [SyncSet(s.cost, s.subset(alive)) for s in tables.syncs],
        None if tr is None else [t[a] for t, a in zip(tr, alive, strict=True)],
        [tuple((g, v[alive[g]]) for g, v in blk) for blk in tables.remat],
        [GatherSet(gs.bytes, gs.subset(alive), gs.block) for gs in tables.gathers])


def least_memory(tables: CostTables) -> float:
    """A lower bound of the kept + largest transient bytes over all choices, exact when no edge
    keeps bytes and nothing is recomputed: for each candidate peak transient ``T`` (at least a
    recomputed block's fewest residual bytes), every group keeps its fewest bytes among the
    strategies whose transient stays within ``T``, every edge its fewest. No choice
    fits a budget below it (the ILP need not prove that); when edges keep bytes, one above it
    may still fit none."""
    if not tables.memory:
        return 0.0
    edges = sum(float(e.memory.min()) for e in tables.edges
                if e.memory is not None and e.block < 0)
    per = [sum(float(v.min()) for _, v in blk) for blk in tables.remat]
    for e in tables.edges:
        if e.memory is not None and e.block >= 0:
            per[e.block] += float(e.memory.min())
    block = max(per, default=0.0)
    tr = tables.transient
    if not tr:
        return block + edges + float(sum(float(m.min()) for m in tables.memory))
    peaks = np.unique(np.concatenate([*tr, [block]]))
    peaks = peaks[peaks >= block]  # no choice's transient is below its blocks' residuals
    total = peaks.astype(float) + edges
    for m, t in zip(tables.memory, tr, strict=True):
        order = np.argsort(t, kind="stable")
        fewest = np.minimum.accumulate(m[order].astype(float))
        at = np.searchsorted(t[order], peaks, side="right") - 1  # strategies within the peak
        total += np.where(at >= 0, fewest[np.maximum(at, 0)], np.inf)
    return float(total.min())
