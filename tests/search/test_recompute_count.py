"""How ours picks the number of recomputed layers (search/recompute.py) against a stand-in for
the layout search: memory falling with the count, a result per count that fits. The count is
a level (``level_groups``): a selectively recomputed layer counts 1, a fully recomputed one 2,
so every layer fully recomputed is level ``TOP = 2 * LAYERS``. It finds the
fewest layers that fit in fewer searches than a bisection when memory is linear in the count,
bisects when the plans fill the budget, and finds the boundary of any monotone memory curve."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nnscaler_jax.capture.trace import trace
from nnscaler_jax.errors import NoFitError
from nnscaler_jax.ir.remat import is_selective
from nnscaler_jax.search.recompute import (
    Best,
    Outpriced,
    _plan_memory,
    choose_recompute,
    level_groups,
)

LAYERS = 40
TOP = 2 * LAYERS
BUDGET = 100.0


class Layer(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(4)(x))


class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(LAYERS):
            x = Layer(name=f"l_{i}")(x)
        return x


@pytest.fixture(scope="module")
def graph():
    return trace(Stack(), jax.ShapeDtypeStruct((2, 4), jnp.float32))


@dataclasses.dataclass(frozen=True)
class Result:
    layers: int
    step_s: float
    bytes: float


def _search(need, plan_bytes=None, step=lambda k: 1.0 + 0.01 * k, beats=None):
    """``run(groups)`` with ``need(k)`` bytes at ``k`` layers (NoFitError over the budget), the
    fitting plan's bytes ``plan_bytes(k)`` (default ``need(k)``) and step ``step(k)`` (given
    ``beat=``, Outpriced when not faster); records the counts run (and ``beats``)."""
    tried: list[int] = []

    def run(groups, beat=None):
        k = sum(1 if is_selective(g) else 2 for g in groups)  # the level
        tried.append(k)
        if beats is not None:
            beats.append(beat)
        if need(k) > BUDGET:
            raise NoFitError("over", smallest_bytes=need(k), budget_bytes=BUDGET)
        if beat is not None and step(k) >= beat:
            raise Outpriced(f"{step(k)} >= {beat}")
        used = need(k) if plan_bytes is None else plan_bytes(k)
        return Result(k, step(k), used)

    return run, tried


def _choose(graph, run):
    return choose_recompute(run, graph, (), (), price=lambda r: r.step_s,
                            memory=lambda r: r.bytes)


def _bisection_runs(boundary: int) -> int:
    """Searches of the plain bisection: none, all, then halving (0, TOP)."""
    lo, hi, runs = 0, TOP, 2
    while hi - lo > 1:
        mid, runs = (lo + hi) // 2, runs + 1
        lo, hi = (lo, mid) if mid >= boundary else (mid, hi)
    return runs


@pytest.mark.parametrize("boundary", [3, 11, 26, 38])
def test_linear_memory_needs_fewer_searches_than_bisection(graph, boundary):
    per = 5.0
    run, tried = _search(lambda k: BUDGET + per * (boundary - k) - per / 2)
    got = _choose(graph, run)
    assert got.layers == boundary
    assert len(tried) <= 5 and len(tried) < _bisection_runs(boundary), tried
    assert tried[:2] == [0, TOP]  # none, then all (Alpa's switch: the error if it fails)


@pytest.mark.parametrize("boundary", [11, 26])
def test_failing_counts_without_a_figure_extend_the_fitting_side(graph, boundary):
    """A count that does not fit may say nothing of how far it is (the search proved no choice
    fits though the tables' lower bound does: ``smallest_bytes`` None); the line through the
    two fewest counts that fit, extended to the budget, still beats bisection."""
    per = 5.0

    def need(k):
        return BUDGET + per * (boundary - k) - per / 2

    run, tried = _search(need)

    def quiet(groups, **kw):  # the failures carry no estimate
        try:
            return run(groups, **kw)
        except NoFitError:
            raise NoFitError("over", smallest_bytes=None, budget_bytes=BUDGET) from None

    assert _choose(graph, quiet).layers == boundary
    assert len(tried) < _bisection_runs(boundary), tried


def test_plans_that_fill_the_budget_make_it_bisect(graph):
    run, tried = _search(lambda k: BUDGET + 5.0 * (30 - k) - 1, plan_bytes=lambda k: BUDGET)
    assert _choose(graph, run).layers == 30
    lo, hi, want = 0, TOP, [0, TOP]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        want.append(mid)
        lo, hi = (lo, mid) if mid >= 30 else (mid, hi)
    assert tried == want


@pytest.mark.parametrize("seed", range(12))
def test_any_monotone_memory_finds_the_boundary(graph, seed):
    """Random decreasing memory curves (steps, plateaus, cliffs): the fewest layers that fit,
    within about twice the bisection's searches."""
    rng = np.random.default_rng(seed)
    drops = rng.exponential(1.0, TOP) * (rng.random(TOP) < 0.6)
    drops[rng.integers(0, TOP)] += rng.uniform(0, 200)
    curve = 300.0 - np.concatenate([[0.0], np.cumsum(drops)])
    curve = BUDGET + (curve - curve[-1]) * rng.uniform(0.1, 3.0) - rng.uniform(0.5, 5.0)
    boundary = int(np.argmax(curve <= BUDGET))
    run, tried = _search(lambda k: float(curve[k]))
    got = _choose(graph, run)
    assert got.layers == boundary
    assert len(tried) <= 2 * _bisection_runs(boundary) + 1, tried


def test_the_fastest_that_fits_wins_and_alpa_stops_at_all(graph):
    run, tried = _search(lambda k: BUDGET + 5.0 * (20 - k) - 2)
    step = {TOP: 0.5}  # all recomputed happens to be the fastest plan here

    def price(r):
        return step.get(r.layers, r.step_s)

    assert choose_recompute(run, graph, (), (), price=price,
                            memory=lambda r: r.bytes).layers == TOP
    run, tried = _search(lambda k: BUDGET + 5.0 * (20 - k) - 2)
    assert choose_recompute(run, graph, (), ()).layers == TOP and tried == [0, TOP]


def test_every_probe_only_has_to_beat_the_best(graph):
    """Each probe of the count search gets ``beat=`` the best step found so far. A count that
    fits but cannot beat it (Outpriced) steers the search above it, as one that does not fit
    does, and the search ends on the best plan."""
    beats: list = []
    step = lambda k: 2.0 + 0.01 * (k - 30) ** 2  # fastest at 30; 26..29 fit but are slower
    run, tried = _search(lambda k: BUDGET + 5.0 * (26 - k) - 1, plan_bytes=lambda k: BUDGET,
                         step=step, beats=beats)
    got = _choose(graph, run)
    assert got.layers == 30
    assert beats[:2] == [None, None] and None not in beats[2:], beats  # none, all; then probes
    outpriced = [k for k, b in zip(tried, beats, strict=True)
                 if b is not None and 26 <= k and step(k) >= b]
    assert outpriced, tried
    after = tried[tried.index(outpriced[0]) + 1:]
    assert after and all(k > outpriced[0] for k in after), tried
    # a faster probe is kept
    beats.clear()
    run, tried = _search(lambda k: BUDGET + 5.0 * (26 - k) - 1, plan_bytes=lambda k: BUDGET,
                         beats=beats)
    assert _choose(graph, run).layers == 26 and beats[-1] == pytest.approx(1.27)


def test_searches_sharing_a_best_only_have_to_beat_each_others_plans(graph):
    """Two count searches (ours: with and without co-sharding, at once) share one
    :class:`Best`: the second's probes, every layer recomputed included, get ``beat=`` the
    first's plan, so a search that cannot beat it ends Outpriced after one probe (Swin at its
    8-GPU preset on V100s: the plain search's probes stopped in seconds, the search took
    20.9 s instead of 38.7 s)."""
    best = Best()
    run, _ = _search(lambda k: BUDGET + 5.0 * (26 - k) - 1, step=lambda k: 1.0 + 0.001 * k)
    fast = choose_recompute(run, graph, (), (), price=lambda r: r.step_s,
                            memory=lambda r: r.bytes, best=best)
    assert fast.layers == 26 and best.step_s == fast.step_s
    beats: list = []
    run, tried = _search(lambda k: BUDGET + 5.0 * (26 - k) - 1, beats=beats)  # 1.26 s and up
    with pytest.raises(Outpriced):
        choose_recompute(run, graph, (), (), price=lambda r: r.step_s,
                         memory=lambda r: r.bytes, best=best)
    assert tried == [0, TOP] and beats == [None, fast.step_s]
    # a search that can beat it does, and lowers the shared best
    run, _ = _search(lambda k: BUDGET + 5.0 * (26 - k) - 1, step=lambda k: 0.5 + 0.001 * k)
    assert choose_recompute(run, graph, (), (), price=lambda r: r.step_s,
                            memory=lambda r: r.bytes, best=best).layers == 26
    assert best.step_s == pytest.approx(0.526)


def test_default_memory_reads_the_priced_plan():
    from nnscaler_jax import Plan

    cost = type("Cost", (), {"memory_bytes_per_device": 123})()
    plan = dataclasses.replace(Plan(mesh=(("data", 2),), ops=(), fingerprint=""), cost=cost)
    assert _plan_memory((plan, object())) == 123.0
    assert _plan_memory(plan) == 123.0
    assert _plan_memory(("not a plan",)) is None


def test_levels_go_selective_then_full():
    """Level k recomputes the first k layers selectively, then past every layer selective the
    first k - n fully: each level keeps less than the one before and reruns more."""
    cands = ("a", "b", "c")
    assert level_groups(cands, 0) == ()
    assert level_groups(cands, 2) == ("a:dots", "b:dots")
    assert level_groups(cands, 3) == ("a:dots", "b:dots", "c:dots")
    assert level_groups(cands, 5) == ("a", "b", "c:dots")
    assert level_groups(cands, 6) == ("a", "b", "c")
    for k in range(7):
        assert sum(1 if is_selective(g) else 2 for g in level_groups(cands, k)) == k


def test_the_border_of_selective_and_full_is_probed_first(graph):
    """After every layer fully recomputed, the next probe is every layer selective (level n),
    not the interpolated level: a level past it reruns whole layers and may be outpriced by
    another search's plan, which said nothing of the selective levels below (Swin at its
    8-GPU preset on V100s: level 79 outpriced by a co-sharded 4.76 s plan ended the plain
    search, and every layer selective, 4.51 s, was never tried)."""
    best = Best()

    def need(k):  # steep over the selective half, then almost flat: fits from level 20
        return 300.0 - 10.0 * k if k <= 20 else 100.0 - 0.025 * (k - 20)

    def step(k):  # selective levels rerun little, full ones a whole layer each
        return 1.0 + 0.01 * k if k <= LAYERS else 2.0 + 0.1 * (k - LAYERS)

    run, tried = _search(need, step=step)

    def beside(groups, beat=None):  # the co-sharded search beside it finds 1.9 s meanwhile
        out = run(groups, beat=beat)
        if len(tried) == 2:
            best.offer(1.9)
        return out

    got = choose_recompute(beside, graph, (), (), price=lambda r: r.step_s,
                           memory=lambda r: r.bytes, best=best)
    assert got.layers == 20 and got.step_s == pytest.approx(1.2)
    assert tried[:3] == [0, TOP, LAYERS], tried
