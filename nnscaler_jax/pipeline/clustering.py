"""Alpa's layer clustering (``cluster_jaxpr_by_cost``, OSDI'22 section 5.2) on our graph.

The top-level ops, in program order, are cut into ``L`` layers by a DP minimising the bytes of
activations crossing the cuts, with every layer's FLOPs at most ``(1 + eps)`` x the average (the
smallest ``eps`` of a ladder that admits a clustering). Alpa's inter-operator pass
(:func:`nnscaler_jax.pipeline.inter_op.alpa_pipeline_search`) then places stage boundaries
between these layers. Unlike :mod:`nnscaler_jax.pipeline.stages` it needs no layer stack: any
graph clusters.
"""

from __future__ import annotations

import numpy as np

from nnscaler_jax.cost.compute import op_flops
from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.graph import Graph

__all__ = ["cluster_layers"]


def _cut_bytes(graph: Graph) -> np.ndarray:
    """``cut[k]``: bytes of op outputs produced before op ``k`` and read at or after it."""
    n = len(graph.ops)
    pos = {t.id: i for i, op in enumerate(graph.ops) for t in op.outputs}
    last: dict[int, int] = {}
    for i, op in enumerate(graph.ops):
        for t in op.inputs:
            if t.id in pos:
                last[t.id] = i
    for t in graph.outputs:
        if t.id in pos:
            last[t.id] = n
    diff = np.zeros(n + 2)
    for op in graph.ops:
        for t in op.outputs:
            if t.id in last and last[t.id] > pos[t.id]:
                diff[pos[t.id] + 1] += t.nbytes
                diff[last[t.id] + 1] -= t.nbytes
    return np.cumsum(diff)[: n + 1]


def _range_min(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Min and argmin of ``values[lo[k]:hi[k]]`` per k (sparse table; empty ranges: inf)."""
    n = len(values)
    tables, args = [values.copy()], [np.arange(n)]
    w = 1
    while 2 * w <= n:
        a, b = tables[-1], args[-1]
        left, right = a[:-w], a[w:]
        pick = right < left
        tables.append(np.where(pick, right, left))
        args.append(np.where(pick, b[w:], b[:-w]))
        w *= 2
    length = np.maximum(hi - lo, 1)
    lev = np.floor(np.log2(length)).astype(int)
    out = np.full(len(lo), np.inf)
    arg = np.zeros(len(lo), dtype=int)
    for level in np.unique(lev):
        sel = np.nonzero(lev == level)[0]
        span = 1 << int(level)
        t, g = tables[level], args[level]
        i1, i2 = lo[sel], hi[sel] - span
        ok = (hi[sel] > lo[sel]) & (i1 < len(t)) & (i2 >= 0)
        i1c, i2c = np.clip(i1, 0, len(t) - 1), np.clip(i2, 0, len(t) - 1)
        pick = t[i2c] < t[i1c]
        out[sel] = np.where(ok, np.where(pick, t[i2c], t[i1c]), np.inf)
        arg[sel] = np.where(pick, g[i2c], g[i1c])
    return out, arg


def cluster_layers(graph: Graph, layers: int,
                   eps_ladder: tuple[float, ...] = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 1e9)
                   ) -> tuple[tuple[int, int], ...]:
    """Alpa's layer clustering: ``layers`` contiguous op ranges ``(start, end)`` of
    ``graph.ops`` minimising the activation bytes crossing the cuts, each layer's FLOPs within
    ``(1 + eps)`` x the average for the smallest ``eps`` of the ladder that admits one."""
    n = len(graph.ops)
    if not 1 <= layers <= n:
        raise PlanError(f"cluster_layers: {layers} layers for {n} ops")
    flops = np.array([op_flops(op) for op in graph.ops], dtype=float)
    cum = np.concatenate([[0.0], np.cumsum(flops)])
    cut = _cut_bytes(graph)
    cut[0] = 0.0
    ends = np.arange(n + 1)
    for eps in eps_ladder:
        cap = (1 + eps) * cum[-1] / layers
        # smallest j with cum[k] - cum[j] <= cap
        lo = np.searchsorted(cum, cum - cap - 1e-9 * max(cum[-1], 1.0), side="left")
        f = np.full(n + 1, np.inf)
        f[0] = 0.0
        back = []
        for _ in range(layers):
            g, arg = _range_min(f + cut, lo, ends)   # j in [lo[k], k)
            f = g
            back.append(arg)
        if np.isfinite(f[n]):
            bounds, k = [], n
            for arg in reversed(back):
                j = int(arg[k])
                bounds.append((j, k))
                k = j
            return tuple(reversed(bounds))
    raise PlanError(f"cluster_layers: no clustering of {n} ops into {layers} layers")
