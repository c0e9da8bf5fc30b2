"""Co-sharding as a search decision: which blocks run chunk by chunk, and in how many chunks.

A co-sharded block (:mod:`nnscaler_jax.ir.coshard`: attention scores, softmax and what follows
them along the query dim; a wide MLP along the tokens) keeps only its inputs for the backward
pass and holds one chunk of its intermediates at a time, for one more forward of the block and
a per-kernel floor on small chunks. Recomputing a whole layer keeps less still but runs the
whole layer again; co-sharding targets the large intermediates only. So ours (``"auto"``), when
the budget needs memory back, solves both ways: layouts and recompute (the bisection of
:mod:`nnscaler_jax.search.recompute`) without co-sharding, and the same with every layer's
block co-sharded, and keeps the faster plan that fits. The Alpa-style planner and the baselines
never co-shard (Alpa's space has no such decision).

The chunk count of a block is the smallest that brings one chunk of its largest intermediate,
spread over the mesh, under a sixteenth of the budget (a chunk must divide every device's part
of the dim), else the largest such count up to 64.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from nnscaler_jax.ir.coshard import chunk_counts, coshard_candidates
from nnscaler_jax.ir.graph import Graph
from nnscaler_jax.ir.remat import in_group
from nnscaler_jax.search.space import run_sizes

__all__ = ["coshard_choice"]

_SHARE = 16   # one chunk's largest intermediate: at most budget / _SHARE
_MAX_CHUNKS = 64


def coshard_choice(graph: Graph, mesh_axes: Mapping[str, int], budget: float | None,
                   forbidden: Sequence[str] = (), microbatches: int = 1
                   ) -> tuple[tuple[int, str, int], ...]:
    """``(seed op id, identifier, chunks)`` of every block worth co-sharding (one per repeated
    layer, none in a module a ``Rule(recompute=False)`` selects); empty without a budget.
    With ``microbatches``, a block along the batch chunks one micro-batch's rows."""
    if budget is None:
        return ()
    devices = math.prod(mesh_axes.values())
    rows = run_sizes(graph, microbatches)
    out = []
    for cand in coshard_candidates(graph, ways=devices):
        if any(in_group(cand.seed_path, f) or in_group(cand.layer, f) for f in forbidden):
            continue
        # a micro-batch's rows are few: the chunks may leave fewer ways to split them (the
        # search's space divides the block's dim by its chunks, run_sizes)
        size = rows.get(cand.seed, {}).get(cand.dim)
        counts = chunk_counts(cand.size, devices, _MAX_CHUNKS) if size is None \
            else chunk_counts(size, 1, _MAX_CHUNKS)
        if not counts:
            continue
        fits = [k for k in counts if cand.largest_bytes / (devices * k) <= budget / _SHARE]
        out.append((cand.seed, cand.dim, fits[0] if fits else counts[-1]))
    return tuple(out)
