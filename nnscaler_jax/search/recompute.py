"""Recompute as a search decision: which layers give their activations back to fit the budget.

The search solves the layouts for a given set of recompute groups (module paths wrapped in remat
boundaries, :mod:`nnscaler_jax.ir.remat`; the cost tables then keep only each boundary's inputs
and add its forward again). Recompute only trades time for memory, so it is chosen when the
budget needs it:

1. the groups the constraints force (``Rule(module=..., recompute=True)``), nothing else;
2. if no plan fits, every candidate layer recomputed (Alpa's one global remat switch: the
   ``"alpa"`` planner stops here);
3. ours (``"auto"``): bisection over how many layers (identical layers: which ones does not
   matter, how many does), each step a full layout search; of the plans that fit, the fastest
   (fewer recomputed layers save time, but the layouts the search can afford change with the
   memory they free, so the fewest is not always the fastest).

Candidates are the model's repeated blocks at their finest level (``h_3``, Swin's
``layers_2/blocks_7``, T5's ``encoder/block_3``: :func:`nnscaler_jax.ir.layers.block_paths`),
else its top modules; a block any ``Rule(recompute=False)`` touches is never recomputed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from nnscaler_jax.errors import NoFitError
from nnscaler_jax.ir.graph import Graph
from nnscaler_jax.ir.layers import block_paths
from nnscaler_jax.ir.remat import in_group

__all__ = ["choose_recompute", "recompute_candidates"]


def recompute_candidates(graph: Graph, forced: Sequence[str],
                         forbidden: Sequence[str]) -> tuple[str, ...]:
    """The groups the search may add: repeated blocks (or top modules) in program order, less
    those a forced group already covers and those a forbidden one touches."""
    names = block_paths(op.module_path for op in graph.ops) or list(dict.fromkeys(
        op.module_path.split("/")[0] for op in graph.ops if op.module_path))
    out = []
    for name in names:
        paths = {op.module_path for op in graph.ops if in_group(op.module_path, name)}
        if any(in_group(p, f) for p in paths for f in forbidden):
            continue
        if paths and all(any(in_group(p, f) for f in forced) for p in paths):
            continue
        out.append(name)
    return tuple(out)


def choose_recompute(run: Callable[[tuple[str, ...]], Any], graph: Graph,
                     forced: Sequence[str], forbidden: Sequence[str], *,
                     price: Callable[[Any], float] | None = None) -> Any:
    """``run(groups)`` for the recompute groups the budget needs (see the module docs).

    Args:
        run: plans with those groups recomputed; raises ``NoFitError`` when nothing fits.
        price: a result's estimated step seconds: bisect over the number of layers and return
            the fastest result that fits (ours); None: all or nothing (Alpa's switch).

    Raises:
        NoFitError: nothing fits even with every candidate layer recomputed.
    """
    forced = tuple(forced)
    try:
        return run(forced)
    except NoFitError:
        cands = recompute_candidates(graph, forced, forbidden)
        if not cands:
            raise
    results: dict[int, Any] = {}
    try:
        results[len(cands)] = run(forced + cands)
    except NoFitError as e:
        raise NoFitError(
            f"{e} Recomputing every layer ({cands[0]} .. {cands[-1]}, {len(cands)} groups) does "
            "not fit either.", smallest_bytes=e.smallest_bytes,
            budget_bytes=e.budget_bytes) from None
    lo, hi = 0, len(cands)
    while price is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            results[mid] = run(forced + cands[:mid])
            hi = mid
        except NoFitError:
            lo = mid
    if price is None:
        return results[len(cands)]
    return min(results.values(), key=price)
