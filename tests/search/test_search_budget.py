"""The search under a memory budget: the exact least memory (feasibility without HiGHS) and the
dominated strategies dropped before the ILP (search/reduce.py), checked by brute force on
random tables with memory, transients and gradient syncs."""

import itertools
from dataclasses import dataclass

import numpy as np
import pytest

from nnscaler_jax.errors import NoFitError
from nnscaler_jax.search.ilp import PROBE_GAP, _solve_reduced, solve
from nnscaler_jax.search.recompute import Outpriced
from nnscaler_jax.search.reduce import least_memory, prune_dominated
from nnscaler_jax.search.tables import CostTables, Edge, SyncSet


def _tables(seed: int, n: int = 7, blocks: bool = False) -> CostTables:
    """Random groups (a tree plus one cycle) with memory and transients; every group gets a
    copy of its strategy 0 that costs more time, keeps more bytes and has a larger transient
    (dominated), and group 1 one that costs more time but keeps fewer bytes (not dominated).
    ``blocks``: two recomputed blocks too, each with residuals and an edge whose bytes are
    the block's (an operand its matmul gathers again)."""
    rng = np.random.default_rng(seed)
    sizes = [int(k) for k in rng.integers(2, 4, n)]
    unary = [rng.uniform(0, 10, k) for k in sizes]
    mem = [rng.uniform(1, 10, k) for k in sizes]
    tr = [rng.uniform(0, 3, k) for k in sizes]
    pairs = [(int(rng.integers(0, v)), v) for v in range(1, n)] + [(0, n - 1)]
    full = {p: rng.uniform(0, 5, (sizes[p[0]], sizes[p[1]])) for p in pairs}

    def copy_of_0(g: int, dt: float, dm: float, dtr: float) -> None:
        unary[g] = np.append(unary[g], unary[g][0] + dt)
        mem[g] = np.append(mem[g], mem[g][0] + dm)
        tr[g] = np.append(tr[g], tr[g][0] + dtr)
        for (u, v), m in full.items():
            if u == g:
                full[u, v] = np.vstack([m, m[:1]])
            elif v == g:
                full[u, v] = np.hstack([m, m[:, :1]])

    for g in range(n):
        copy_of_0(g, 1.0, 1.0, 0.5)
    copy_of_0(1, 1.0, -0.5, 0.0)
    k = [len(u) for u in unary]
    edges = [Edge(u, v, np.arange(k[u]), np.arange(k[v]), m) for (u, v), m in full.items()]
    readers = []
    for g in (2, 4, 5):  # the dominated copy hands its gradient back as strategy 0 does
        cls = rng.integers(-1, 2, k[g])
        cls[-1] = cls[0]
        readers.append((g, -1, cls[None, :]))
    syncs = [SyncSet(np.array([2.0, 3.0]), tuple(readers))]
    remat = []
    if blocks:
        remat = [((1, rng.uniform(0, 4, k[1])), (3, rng.uniform(0, 4, k[3]))),
                 ((2, rng.uniform(0, 4, k[2])),)]
        for u, v, b in ((1, 3, 0), (0, 2, 1)):
            edges.append(Edge.compressed(u, v, np.zeros((k[u], k[v])),
                                         rng.uniform(0, 3, (k[u], k[v])), block=b))
    return CostTables(unary, [np.zeros(j) for j in k], mem, edges, syncs, tr, remat)


def _choices(tables: CostTables):
    return itertools.product(*[range(len(c)) for c in tables.compute])


def _best_under(tables: CostTables, budget: float) -> float:
    fits = [tables.objective(c) for c in _choices(tables) if tables.memory_of(c) <= budget]
    return min(fits) if fits else np.inf


@pytest.mark.parametrize("seed", range(6))
def test_least_memory_is_the_brute_force_minimum(seed):
    tables = _tables(seed)
    assert least_memory(tables) == pytest.approx(min(tables.memory_of(c)
                                                     for c in _choices(tables)), rel=1e-12)
    # with recomputed blocks (residuals, operands gathered again) a lower bound
    blocks = _tables(seed, blocks=True)
    assert least_memory(blocks) <= min(blocks.memory_of(c) for c in _choices(blocks))


@pytest.mark.parametrize("blocks", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_pruning_keeps_the_optimum_under_every_budget(seed, blocks):
    """Exact under every budget: the reduction, the dominance pruning and the ILP's memory
    rows (with ``blocks``: a recomputed block's residuals and the edge bytes it gathers
    again, in its transient row) give the brute-force optimum."""
    tables = _tables(seed, blocks=blocks)
    pruned, kept = prune_dominated(tables)
    if not blocks:  # (the blocks' random bytes need not make the copies dominated)
        assert sum(map(len, kept)) <= sum(map(len, tables.compute)) - len(tables.compute)
    every = sorted(tables.memory_of(c) for c in _choices(tables))
    for budget in np.quantile(every, [0.05, 0.3, 0.6, 1.0]):
        want = _best_under(tables, budget)
        got = _best_under(pruned, budget)
        assert got == pytest.approx(want, rel=1e-12)
        sol, _ = _solve_reduced(tables, float(budget), 60, "auto")
        assert sol.objective_s == pytest.approx(want, rel=1e-9)
        assert sol.memory_bytes <= budget
        assert solve(pruned, max_memory=float(budget)).objective_s == pytest.approx(want,
                                                                                  rel=1e-9)


def test_a_budget_below_the_least_memory_fails_before_the_ilp(monkeypatch):
    from nnscaler_jax.search import ilp

    tables = _tables(0)
    least = least_memory(tables)
    monkeypatch.setattr(ilp, "milp", lambda *a, **k: pytest.fail("HiGHS ran"))
    with pytest.raises(NoFitError) as e:
        _solve_reduced(tables, least * 0.999, 60, "auto")
    assert e.value.smallest_bytes == pytest.approx(least)


def test_a_slower_strategy_that_keeps_fewer_bytes_is_kept():
    """Time alone would drop strategy 1 (slower whatever the neighbour picks); under a budget
    it keeps fewer bytes, so only strategy 2 (slower and larger) goes."""
    edge = Edge(0, 1, np.arange(3), np.arange(2), np.array([[0.0, 1.0], [0.5, 1.5], [0.0, 1.0]]))
    tables = CostTables([np.array([1.0, 2.0, 3.0]), np.array([0.0, 0.0])], [np.zeros(3),
                        np.zeros(2)], [np.array([5.0, 2.0, 6.0]), np.array([1.0, 1.0])], [edge],
                        [], [np.zeros(3), np.zeros(2)])
    _, kept = prune_dominated(tables)
    assert kept[0].tolist() == [0, 1] and kept[1].tolist() == [0]
    sol, _ = _solve_reduced(tables, 3.0, 60, "auto")
    assert sol.choice == (1, 0)


def test_re_solves_under_a_lowered_budget_get_a_bounded_time_limit():
    """A plan over the budget once fully priced is solved again under a lowered budget; each
    re-solve is limited to RESOLVE_FACTOR x the first solve's seconds (at least the floor)."""
    from types import SimpleNamespace

    from nnscaler_jax.search.ilp import RESOLVE_FACTOR, RESOLVE_FLOOR_S, _meet_budget

    real = iter([12.0, 11.0, 9.0])  # bytes of each plan as priced in full
    cm = SimpleNamespace(plan_cost=lambda plan, graph: SimpleNamespace(
        memory_bytes_per_device=next(real)))
    calls = []

    def solved(cap, limit):
        calls.append((cap, limit))
        return SimpleNamespace(memory_bytes=cap), 0

    @dataclass(frozen=True)
    class FakePlan:
        name: str
        cost: object = None

    first = SimpleNamespace(memory_bytes=8.0)
    plan, sol = _meet_budget(FakePlan("plan"), first, 10.0, solved, cm, None,
                             lambda s: FakePlan("again"), 3.0)
    assert plan.name == "again" and sol.memory_bytes == calls[-1][0]
    assert plan.cost.memory_bytes_per_device == 9.0  # the full pricing travels with the plan
    assert [c for c, _ in calls] == [6.0, 5.0]  # lowered by each round's excess
    assert {t for _, t in calls} == {max(RESOLVE_FLOOR_S, RESOLVE_FACTOR * 3.0)}


@pytest.mark.parametrize("share", [0.7, 0.47])
def test_a_budgeted_plan_carries_its_own_full_pricing(share):
    """The budgeted search prices its plan in full (to check the budget); that price is the
    plan's cost, the same as pricing the finished plan again (recompute groups included).
    (0.47: the tightest share that fits since co-sharded blocks' loop stacks are priced as
    the block reads its inputs; at 0.45 a plan co-sharding three blocks fitted by 86 bytes.)"""
    import models
    from nnscaler_jax import Constraints
    from nnscaler_jax.capture.trace import capture_spec
    from nnscaler_jax.cost.model import CostModel
    from nnscaler_jax.plan.plan import Plan
    from nnscaler_jax.search.entry import plan_spmd

    axes = {"data": 2, "model": 4}
    graph = capture_spec(models.get("gpt", "tiny")).graph
    cm = CostModel.for_axes(axes)
    free = plan_spmd(graph, axes, cost_model=cm).plan.cost.memory_bytes_per_device
    cons = Constraints(max_memory_per_device=int(free * share))
    plan = plan_spmd(graph, axes, constraints=cons, cost_model=cm).plan
    assert plan.cost.memory_bytes_per_device <= free * share
    assert plan.cost == cm.plan_cost(plan, graph)
    if share < 0.5:
        assert plan.recompute or plan.coshard  # the budget needs memory back
    # made for the model's graph (the search's draft has the boundaries): a saved copy of it
    # runs on the same model (was refused as "made for another model")
    Plan.from_json(plan.to_json()).check_graph(graph, axes)


@pytest.mark.parametrize("blocks", [True, False], ids=["recomputed-blocks", "plain"])
def test_a_bound_to_beat_stops_only_solves_that_cannot_beat_it(blocks):
    """``solve(beat=)`` under a budget, with recomputed blocks or without: it gives up
    (Outpriced) only when the brute-force optimum is no faster than ``beat`` (HiGHS' cutoff
    option prunes every plan; the plan it may still return from before the bound applied is
    no faster), and otherwise a plan faster than ``beat`` within ``PROBE_GAP`` of the optimum;
    some solves do give up (without blocks, the solver gave up on none before the cutoff)."""
    gave_up = 0
    for seed in range(4):
        tables = _tables(seed, blocks=blocks)
        pruned, _ = prune_dominated(tables)
        every = sorted(tables.memory_of(c) for c in _choices(tables))
        for budget in np.quantile(every, [0.05, 0.3, 0.6]):
            want = _best_under(tables, budget)
            for beat in (want * 0.9, want, want * 1.1):
                try:
                    got = solve(pruned, max_memory=float(budget), beat=float(beat))
                except Outpriced:
                    gave_up += 1
                    assert want >= beat * (1 - 1e-9)
                else:  # the optimum, or a plan within the probes' gap of it
                    assert want * (1 - 1e-9) <= got.objective_s <= want * (1 + PROBE_GAP)
                    assert got.objective_s < beat
    assert gave_up
