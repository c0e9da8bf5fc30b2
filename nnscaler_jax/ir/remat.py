"""Recompute as a plan decision: groups of ops (module paths) wrapped in remat boundaries.

A plan's ``recompute`` lists *groups*: module path globs (``'h_3'``, ``'blk*/mlp'``). Every
top-level op whose module path is the group or lies under it belongs to it; each contiguous run
of one group's ops (per top module, so ``'h_*'`` gives one run per layer) becomes a
``checkpoint`` boundary, exactly what ``jax.checkpoint`` / ``nn.remat`` in the user's code
would have produced. So the one mechanism that already handles the user's remat prices and runs
the plan's: the search tables and the cost model keep only a boundary's inputs and add its
forward again (``search/tables.py``, ``cost/plan_walk.py``), the lowering replays it under
``jax.checkpoint`` (``lower/replay.py``).

>>> import jax, jax.numpy as jnp, flax.linen as nn
>>> from nnscaler_jax import trace
>>> class Two(nn.Module):
...     @nn.compact
...     def __call__(self, x):
...         return nn.Dense(4, name="l_1")(jnp.tanh(nn.Dense(4, name="l_0")(x)))
>>> g = with_recompute(trace(Two(), jnp.ones((2, 4))), ("l_*",))
>>> [(b.kind, len(b.inputs), len(b.outputs)) for b in g.boundaries]
[('checkpoint', 3, 1), ('checkpoint', 3, 1)]
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Sequence
from dataclasses import replace
from types import SimpleNamespace

from nnscaler_jax.ir.graph import Boundary, Graph, Role

__all__ = ["RECOMPUTE_EQN", "in_group", "recompute_runs", "with_recompute"]

#: The equation standing in for a plan's remat boundary (what ``jax.checkpoint`` is bound with).
RECOMPUTE_EQN = SimpleNamespace(params={"prevent_cse": True, "policy": None},
                                primitive=SimpleNamespace(name="checkpoint"))


@functools.lru_cache(maxsize=1 << 16)
def in_group(path: str, group: str) -> bool:
    """Whether module path ``path`` is ``group`` (a glob) or lies under it (memoised: a
    model has few module paths, and the recompute search asks about each many times)."""
    return bool(path) and (fnmatch.fnmatchcase(path, group)
                           or fnmatch.fnmatchcase(path, group.rstrip("/") + "/*"))


def _key(path: str, groups: Sequence[str]) -> tuple[int, str] | None:
    for i, g in enumerate(groups):
        if in_group(path, g):
            return i, path.split("/")[0]
    return None


def recompute_runs(graph: Graph, groups: Sequence[str]) -> list[list[int]]:
    """Indices into ``graph.ops`` of each recomputed run: contiguous ops of one group and one
    top module; a run never cuts an existing boundary (its ops are left out instead)."""
    by_path: dict[str, tuple[int, str] | None] = {}  # ops of one module share their key
    keys = [by_path[op.module_path] if op.module_path in by_path else
            by_path.setdefault(op.module_path, _key(op.module_path, groups))
            for op in graph.ops]
    runs: list[list[int]] = []
    for i, k in enumerate(keys):
        if k is None:
            continue
        if runs and keys[runs[-1][-1]] == k and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    members: dict[int, set[int]] = {}
    for i, op in enumerate(graph.ops):
        if op.boundary:
            members.setdefault(op.boundary[0], set()).add(i)
    out = []
    for run in runs:
        inside = set(run)
        cut = {i for i in run if graph.ops[i].boundary
               and not members[graph.ops[i].boundary[0]] <= inside}
        part: list[int] = []
        for i in run:
            if i in cut:
                if part:
                    out.append(part)
                part = []
            else:
                part.append(i)
        if part:
            out.append(part)
    return out


def with_recompute(graph: Graph, groups: Sequence[str]) -> Graph:
    """``graph`` with one ``checkpoint`` boundary per recomputed run of ``groups`` (op ids,
    tensors and existing boundaries unchanged; the new boundary is the outermost)."""
    runs = recompute_runs(graph, groups) if groups else []
    if not runs:
        return graph
    ops = list(graph.ops)
    next_id = max((b.id for b in graph.boundaries), default=-1) + 1
    reads_after: dict[int, int] = {}  # tensor id -> last op index reading it
    for i, op in enumerate(ops):
        for t in op.inputs:
            reads_after[t.id] = i
    outputs = {t.id for t in graph.outputs}
    new: list[Boundary] = []
    for run in runs:
        produced = {t.id for i in run for t in ops[i].outputs}
        ins: dict[int, object] = {}
        for i in run:
            for t in ops[i].inputs:
                if t.id not in produced and t.role is not Role.CONST:
                    ins.setdefault(t.id, t)
        last = run[-1]
        outs = [t for i in run for t in ops[i].outputs
                if reads_after.get(t.id, -1) > last or t.id in outputs]
        new.append(Boundary(next_id, "checkpoint", tuple(ins.values()), tuple(outs),
                            RECOMPUTE_EQN))
        for i in run:
            ops[i] = replace(ops[i], boundary=(next_id,) + ops[i].boundary)
        next_id += 1
    return graph.derive(tuple(ops), graph.boundaries + tuple(new))
