"""Recompute as a search decision: which layers give their activations back to fit the budget.

The search solves the layouts for a given set of recompute groups (module paths wrapped in remat
boundaries, :mod:`nnscaler_jax.ir.remat`; the cost tables then keep only each boundary's inputs
and add its forward again). Recompute only trades time for memory, so it is chosen when the
budget needs it:

1. the groups the constraints force (``Rule(module=..., recompute=True)``), nothing else;
2. if no plan fits, every candidate layer recomputed (Alpa's one global remat switch: the
   ``"alpa"`` planner stops here);
3. ours (``"auto"``): a search for the lowest *level* that fits (identical layers: which ones
   does not matter, how many does), each step a full layout search. Level ``k`` of ``n``
   candidates (:func:`level_groups`) recomputes the first ``k`` selectively (their matmul
   outputs kept, :data:`~nnscaler_jax.ir.remat.SELECTIVE`) up to ``n``, then every one
   selectively and the first ``k - n`` fully: memory falls and time grows with the level.
   Level ``n`` (every layer selective, the border of the two halves) is probed first; then,
   memory falling about linearly with the count, the next count interpolates the memory known on both sides of
   the boundary to the budget (the smallest estimate of the count that did not fit, the plan of
   the one that did), bisecting when that says nothing (a plan filling the budget) or does not
   converge; of the plans that fit, the fastest (fewer recomputed layers save time, but the
   layouts the search can afford change with the memory they free, so the fewest is not
   always the fastest). Every probe only has to beat the fastest found, by this search or one
   running beside it (:class:`Best`): its run may stop early with :class:`Outpriced` (the
   ILP's objective is bounded by it, and HiGHS proves quickly that nothing is faster: Swin's
   8-GPU preset, a 22-layer co-sharded probe 0.8 s instead of 23.7 s). A count that cannot
   beat it steers the search like one that does not fit: fewer recomputed layers free less
   memory, so their layouts cost at least as much (a heuristic; the last probe's stop is
   exact). Swin's 8-GPU preset on V100s: 20.9 s instead of 38.7 s, the same plan.

Candidates are the model's repeated blocks at their finest level (``h_3``, Swin's
``layers_2/blocks_7``, T5's ``encoder/block_3``: :func:`nnscaler_jax.ir.layers.block_paths`),
else its top modules; a block any ``Rule(recompute=False)`` touches is never recomputed.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

from nnscaler_jax.errors import NoFitError
from nnscaler_jax.ir.graph import Graph
from nnscaler_jax.ir.layers import block_paths
from nnscaler_jax.ir.remat import in_group, selective
from nnscaler_jax.plan.plan import Plan

__all__ = ["Best", "Outpriced", "choose_recompute", "level_groups", "recompute_candidates"]


class Outpriced(Exception):
    """A probe's plan cannot beat ``beat``, the best step found so far (see
    :func:`choose_recompute`): raised by its run once a lower bound on its step says so, before
    the rest of its search."""


class Best:
    """The fastest step found so far, shared by count searches that run at once (ours: with
    and without co-sharding, :func:`nnscaler_jax.search.entry.plan_spmd`), so that each
    probe only has to beat the best plan of either."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.step_s: float | None = None

    def offer(self, step_s: float) -> None:
        with self._lock:
            if self.step_s is None or step_s < self.step_s:
                self.step_s = step_s


def recompute_candidates(graph: Graph, forced: Sequence[str],
                         forbidden: Sequence[str]) -> tuple[str, ...]:
    """The groups the search may add: repeated blocks (or top modules) in program order, less
    those a forced group already covers and those a forbidden one touches."""
    modules = list(dict.fromkeys(op.module_path for op in graph.ops))
    names = block_paths(modules) or list(dict.fromkeys(
        p.split("/")[0] for p in modules if p))
    out = []
    for name in names:
        paths = {p for p in modules if in_group(p, name)}
        if any(in_group(p, f) for p in paths for f in forbidden):
            continue
        if paths and all(any(in_group(p, f) for f in forced) for p in paths):
            continue
        out.append(name)
    return tuple(out)


def choose_recompute(run: Callable[[tuple[str, ...]], Any], graph: Graph,
                     forced: Sequence[str], forbidden: Sequence[str], *,
                     price: Callable[[Any], float] | None = None,
                     memory: Callable[[Any], float | None] | None = None,
                     best: Best | None = None) -> Any:
    """``run(groups)`` for the recompute groups the budget needs (see the module docs).

    Args:
        run: ``run(groups, beat=None)`` plans with those groups recomputed; raises
            ``NoFitError`` when nothing fits. With ``price``, each probe of the count search
            gets ``beat=`` the best step found, and may raise :class:`Outpriced` when it cannot
            beat it (the search's ILP bounds its objective by ``beat``: an infeasible problem
            proves it); the search then goes on above that count, or ends after the last.
        price: a result's estimated step seconds: search the number of layers and return the
            fastest result that fits (ours); None: all or nothing (Alpa's switch).
        memory: a result's estimated bytes per device, which guides the search (default: the
            ``cost`` of the :class:`~nnscaler_jax.plan.plan.Plan` the result is or starts with;
            None when unknown: the search bisects).
        best: the best step shared with other searches (with ``price``): every probe,
            every layer recomputed included, has to beat it.

    Raises:
        NoFitError: nothing fits even with every candidate layer recomputed.
        Outpriced: (with ``best``) every layer recomputed cannot beat another search's plan.
    """
    forced = tuple(forced)
    try:
        return run(forced)
    except NoFitError as e:
        cands = recompute_candidates(graph, forced, forbidden)
        if not cands:
            raise
        first = e
    results: dict[int, Any] = {}
    n = len(cands)
    best = best or Best()  # (offered to only with price: Alpa's switch runs with beat=None)
    try:
        results[n] = run(forced + cands, beat=best.step_s)
    except NoFitError as e:
        raise NoFitError(
            f"{e} Recomputing every layer ({cands[0]} .. {cands[-1]}, {len(cands)} groups) does "
            "not fit either.", smallest_bytes=e.smallest_bytes,
            budget_bytes=e.budget_bytes) from None
    if price is None:
        return results[len(cands)]
    memory = memory or _plan_memory
    best.offer(price(results[n]))
    top = 2 * n  # levels: k <= n, the first k selective; k > n, all selective, k - n of them full
    results[top] = results.pop(n)
    search = _CountSearch(top, first.budget_bytes, first.smallest_bytes, memory(results[top]))
    # the border of the two halves first: full recompute costs far more time per level than
    # selective, so a probe past it that cannot beat the best says nothing of the levels
    # below it (Swin's 8-GPU preset on V100s: level 79 outpriced by a co-sharded 4.76 s plan
    # ended the search, and every layer selective, 4.47 s, was never tried)
    k = n if top > 1 else search.next()
    while k is not None:
        try:
            results[k] = run(forced + level_groups(cands, k), beat=best.step_s)
            best.offer(price(results[k]))
        except Outpriced:
            search.failed(k, None)  # fewer layers would not beat it either (the docs)
        except NoFitError as e:
            search.failed(k, e.smallest_bytes)
        else:
            search.fitted(k, memory(results[k]))
        k = search.next()
    return min(results.values(), key=price)


def level_groups(cands: Sequence[str], k: int) -> tuple[str, ...]:
    """The recompute groups of level ``k`` of the count search over ``cands`` (``0 <= k <=
    2 len(cands)``): the first ``k`` candidates recomputed selectively (their matmul outputs
    kept, :data:`~nnscaler_jax.ir.remat.SELECTIVE`) up to ``len(cands)``, then every candidate
    selective and the first ``k - len(cands)`` fully. Memory falls and time grows with ``k``:
    a selective layer keeps more than a full one and reruns less.

    >>> level_groups(("a", "b"), 1), level_groups(("a", "b"), 3)
    (('a:dots',), ('a', 'b:dots'))
    """
    n = len(cands)
    if k <= n:
        return tuple(selective(c) for c in cands[:k])
    return tuple(cands[:k - n]) + tuple(selective(c) for c in cands[k - n:])


def _plan_memory(result: Any) -> float | None:
    """The estimated bytes per device of a result that is (or starts with) a priced plan."""
    plan = result[0] if isinstance(result, tuple) and result else result
    cost = plan.cost if isinstance(plan, Plan) else None
    return None if cost is None else float(cost.memory_bytes_per_device)


class _CountSearch:
    """The boundary between layer counts that do not fit (``lo``) and that fit (``hi``):
    linear interpolation of the memory known at both ends to the budget (regula falsi); when
    the failing end's estimate is no guide (a lower bound under the budget: the search's
    tables cannot tell how much more a choice keeps), the line through the two fewest counts
    that fit, extended to the budget; bisection when the ends do not say where (a missing
    estimate, a fitting plan within
    :data:`FULL` of the budget: it filled the budget, its memory does not say how much less
    recompute would need) or the last two probes did not halve the interval (the memory is far
    from linear in the count: at most about twice the bisection's probes)."""

    def __init__(self, n: int, budget: float | None, lo_bytes: float | None,
                 hi_bytes: float | None) -> None:
        self.lo, self.hi, self.budget = 0, n, budget
        self.lo_bytes, self.hi_bytes = lo_bytes, hi_bytes
        self.slow = 0  # probes in a row that did not halve the interval
        self.fits: dict[int, float] = {} if hi_bytes is None else {n: hi_bytes}

    def next(self) -> int | None:
        """The next count to try, None when ``hi`` is the fewest that fits."""
        lo, hi = self.lo, self.hi
        if hi - lo <= 1:
            return None
        b, y_lo, y_hi = self.budget, self.lo_bytes, self.hi_bytes
        x = None
        if self.slow >= 2 or b is None or y_hi is None or not y_hi <= b * (1 - FULL):
            pass
        elif y_lo is not None and b < y_lo:
            x = lo + (y_lo - b) / (y_lo - y_hi) * (hi - lo)
        elif len(self.fits) >= 2:  # the failing end says nothing: extend the fitting side
            (k1, m1), (k2, m2) = sorted(self.fits.items())[:2]
            if m1 > m2:
                x = k1 - (b - m1) / (m1 - m2) * (k2 - k1)
        if x is None:
            return (lo + hi) // 2
        return min(max(math.ceil(x), lo + 1), hi - 1)

    def failed(self, k: int, smallest: float | None) -> None:
        self._moved(k - self.lo)
        self.lo, self.lo_bytes = k, smallest

    def fitted(self, k: int, used: float | None) -> None:
        self._moved(self.hi - k)
        self.hi, self.hi_bytes = k, used
        if used is not None:
            self.fits[k] = used

    def _moved(self, by: int) -> None:
        self.slow = self.slow + 1 if 2 * by < self.hi - self.lo else 0


FULL = 0.005
"""A plan whose memory is within this fraction of the budget filled it (see ``_CountSearch``)."""
