"""Exact elimination of chain groups before the ILP (search/reduce.py): same optimum, smaller ILP."""

import itertools

import numpy as np
import pytest

import models
from nnscaler_jax.capture.trace import capture_spec
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.search import search
from nnscaler_jax.search.ilp import _solve_reduced, solve
from nnscaler_jax.search.reduce import reduce_tables
from nnscaler_jax.search.space import build_space
from nnscaler_jax.search.tables import CostTables, Edge, SyncSet


def _edge(rng, u, v, sizes):
    cost = rng.uniform(0, 5, (sizes[u], sizes[v]))
    return Edge(u, v, np.arange(sizes[u]), np.arange(sizes[v]), cost)


def _random_tables(seed, n=9, memory=False, sync=False):
    """A random group graph: a spanning tree (chains, leaves) plus two extra edges (cycles)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 5, n)
    pairs = [(int(rng.integers(0, v)), v) for v in range(1, n)]
    pairs += [(0, n - 1), (1, n - 2)]
    edges = [_edge(rng, u, v, sizes) for u, v in pairs]
    syncs = []
    if sync:  # one sync shared by two groups (a pairwise term), one by three (kept whole)
        for readers in ((2, 5), (1, 3, 6)):
            syncs.append(SyncSet(np.array([3.0, 4.0]), tuple(
                (g, -1, rng.integers(-1, 2, (1, sizes[g]))) for g in readers)))
    mem = [rng.uniform(0, 10, k) if memory else np.zeros(k) for k in sizes]
    return CostTables([rng.uniform(0, 10, k) for k in sizes], [np.zeros(k) for k in sizes],
                      mem, edges, syncs, [np.zeros(k) for k in sizes])


def _brute(tables):
    best = min(itertools.product(*[range(len(c)) for c in tables.compute]),
               key=tables.objective)
    return tables.objective(best)


@pytest.mark.parametrize("seed", range(8))
def test_elimination_keeps_the_optimum(seed):
    tables = _random_tables(seed, sync=seed % 2 == 1)
    red = reduce_tables(tables)
    assert red.eliminated > 0
    sol, eliminated = _solve_reduced(tables, None, 60, "auto")
    assert eliminated == red.eliminated
    assert sol.objective_s == pytest.approx(_brute(tables), rel=1e-9)
    assert sol.objective_s == pytest.approx(solve(tables).objective_s, rel=1e-9)


def test_sync_readers_and_memory_coupled_groups_are_kept():
    tables = _random_tables(3, memory=True, sync=True)
    kept = set(reduce_tables(tables).kept)
    assert {1, 3, 6} <= kept  # readers of the sync shared by three groups
    assert not {2, 5} <= kept  # a two-group sync is an edge: one end at least eliminated
    kept = reduce_tables(tables, memory_budget=True).kept
    varying = {g for g, m in enumerate(tables.memory) if len(set(m.tolist())) > 1}
    assert varying and varying <= set(kept)  # their memory differs by strategy: coupled
    budget = float(np.median([tables.memory_of(c) for c in itertools.product(
        *[range(len(c)) for c in tables.compute])]))
    sol, _ = _solve_reduced(tables, budget, 60, "auto")
    full = solve(tables, max_memory=budget)
    assert sol.memory_bytes <= budget
    assert sol.objective_s == pytest.approx(full.objective_s, rel=1e-9)


def test_search_eliminates_chains_of_gpt_and_keeps_the_ilp_optimum():
    graph = capture_spec(models.get("gpt", "tiny")).graph
    axes = {"data": 2, "model": 4}
    _, report = search(graph, axes)
    assert report.eliminated > report.groups // 2, report
    from nnscaler_jax.search.tables import build_tables

    tables = build_tables(build_space(graph, axes), CostModel.for_axes(axes))
    assert report.objective_s == pytest.approx(solve(tables).objective_s, rel=1e-9)
    assert f"{report.eliminated} groups eliminated exactly" in str(report)


@pytest.mark.parametrize("seed", range(6))
def test_bucket_elimination_finds_the_optimum(seed):
    """What elimination of degree <= 2 leaves (cycles) is minimised out by bucket elimination
    when no gradient sync couples three groups: the brute-force optimum, read back exactly."""
    from nnscaler_jax.search.reduce import solve_by_elimination

    tables = _random_tables(100 + seed, n=8)
    tables.edges.append(_edge(np.random.default_rng(seed), 2, 6, [len(c) for c in
                                                                tables.compute]))
    choice = solve_by_elimination(tables)
    assert choice is not None
    assert tables.objective(choice) == pytest.approx(_brute(tables), rel=1e-12)
    # gradient syncs over three groups, or a term cap, hand the problem to the ILP
    assert solve_by_elimination(_random_tables(seed, sync=True)) is None
    # a problem no strategy dominates in (every pair prefers to differ), over the term cap
    k, n = 3, 4
    potts = [Edge(u, v, np.arange(k), np.arange(k), 1 - np.eye(k))
             for u, v in itertools.combinations(range(n), 2)]
    even = CostTables([np.zeros(k)] * n, [np.zeros(k)] * n, [np.zeros(k)] * n, potts, [],
                      [np.zeros(k)] * n)
    assert solve_by_elimination(even, max_entries=8) is None
    assert even.objective(solve_by_elimination(even)) == pytest.approx(_brute(even))


@pytest.mark.parametrize("seed", range(8))
def test_dead_end_elimination_keeps_every_optimum(seed):
    """Dominated strategies (worse than another one whatever the neighbours pick) are dropped
    before bucket elimination; on dense random problems with ties the optimum is the brute
    force's and a strategy tied with another is never dropped together with it."""
    from nnscaler_jax.search.reduce import dead_end_elimination, solve_by_elimination

    rng = np.random.default_rng(seed)
    n = 6
    sizes = rng.integers(2, 5, n)
    unary = [rng.uniform(0, 4, k) for k in sizes]
    unary[0] = np.append(unary[0], unary[0][0])  # strategy 0 of group 0, twice
    sizes[0] += 1
    edges = []
    for u, v in itertools.combinations(range(n), 2):  # a complete graph: no chains to fold
        cost = rng.uniform(0, 1, (sizes[u], sizes[v]))
        if u == 0:
            cost[-1] = cost[0]
        edges.append(Edge(u, v, np.arange(sizes[u]), np.arange(sizes[v]), cost))
    tables = CostTables(unary, [np.zeros(k) for k in sizes], [np.zeros(k) for k in sizes],
                        edges, [], [np.zeros(k) for k in sizes])
    kept = dead_end_elimination([tables.unary(g) for g in range(n)],
                                [(e.src, e.dst, e.full) for e in edges])
    assert sum(map(len, kept)) < sum(sizes)  # something was dominated
    assert (0 in kept[0]) == (sizes[0] - 1 in kept[0])  # the twins stay or go together
    choice = solve_by_elimination(tables)
    assert tables.objective(choice) == pytest.approx(_brute(tables), rel=1e-12)
    best = _brute(tables)
    for c in itertools.product(*[range(k) for k in sizes]):
        if tables.objective(c) <= best * (1 + 1e-12):  # every optimum survives the pruning
            assert all(c[g] in kept[g] for g in range(n))
