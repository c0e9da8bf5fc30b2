"""Recompute as a plan decision: groups of ops (module paths) wrapped in remat boundaries.

A plan's ``recompute`` lists *groups*: module path globs (``'h_3'``, ``'blk*/mlp'``). Every
top-level op whose module path is the group or lies under it belongs to it; each contiguous run
of one group's ops (per top module, so ``'h_*'`` gives one run per layer) becomes a
``checkpoint`` boundary, exactly what ``jax.checkpoint`` / ``nn.remat`` in the user's code
would have produced. So the one mechanism that already handles the user's remat prices and runs
the plan's: the search tables and the cost model keep only a boundary's inputs and add its
forward again (``search/tables.py``, ``cost/plan_walk.py``), the lowering replays it under
``jax.checkpoint`` (``lower/replay.py``).

A group ending in :data:`SELECTIVE` (``'h_3:dots'``) is recomputed *selectively*: its boundary
runs under the policy :func:`no_growing_dots_saveable` (Megatron-LM's selective activation
recompute), so the outputs of its matmuls are kept (projections, MLP, attention's weighted
sum) except those larger than their operands (the attention scores), and only the rest
(elementwise ops, norms, softmax, the scores' matmul) runs again. Any boundary's policy, the
user's ``nn.remat(policy=...)`` too, is priced by what it saves (:func:`remat_roles`).

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
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import jax

from nnscaler_jax.ir.graph import REMAT_KINDS, Boundary, Graph, Op, Role

__all__ = [
    "NO_ROLES",
    "RECOMPUTE_EQN",
    "SELECTIVE",
    "SELECTIVE_EQN",
    "RematRoles",
    "group_glob",
    "in_group",
    "is_selective",
    "no_growing_dots_saveable",
    "recompute_runs",
    "remat_roles",
    "selective",
    "with_recompute",
]

#: The equation standing in for a plan's remat boundary (what ``jax.checkpoint`` is bound with).
RECOMPUTE_EQN = SimpleNamespace(params={"prevent_cse": True, "policy": None},
                                primitive=SimpleNamespace(name="checkpoint"))

#: The suffix of a selectively recomputed group (:func:`no_growing_dots_saveable` decides what
#: it keeps).
SELECTIVE = ":dots"


def no_growing_dots_saveable(prim: Any, *avals: Any, **params: Any) -> bool:
    """The ``jax.checkpoint`` policy of a selectively recomputed group: a matmul's output is
    saved unless it is batched and larger than both its operands. So projections and MLPs
    (``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``) and attention's weighted sum
    ``P V`` keep their outputs, while the attention scores ``Q K^T`` (and everything that is
    not a matmul: softmax, norms, activations) run again in the backward; Megatron-LM's
    selective activation recompute, keeping ``P V`` (its backward needs only ``P``, rebuilt
    anyway, and ``V``).

    >>> import jax.numpy as jnp
    >>> from jax import lax
    >>> q = jax.ShapeDtypeStruct((2, 64, 8), jnp.float32)   # heads, tokens, head dim
    >>> p = jax.ShapeDtypeStruct((2, 64, 64), jnp.float32)
    >>> scores = (((2,), (2,)), ((0,), (0,)))                # q k^T: 2 x 64 x 64
    >>> weighted = (((2,), (1,)), ((0,), (0,)))              # p v: 2 x 64 x 8
    >>> no_growing_dots_saveable(lax.dot_general_p, q, q, dimension_numbers=scores)
    False
    >>> no_growing_dots_saveable(lax.dot_general_p, p, q, dimension_numbers=weighted)
    True
    """
    if prim is not jax.lax.dot_general_p:
        return False
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    if not lb and not rb:
        return True
    lhs, rhs = avals[0].shape, avals[1].shape
    free_l = [d for i, d in enumerate(lhs) if i not in lc and i not in lb]
    free_r = [d for i, d in enumerate(rhs) if i not in rc and i not in rb]
    out = math.prod(lhs[i] for i in lb) * math.prod(free_l) * math.prod(free_r)
    return out <= max(math.prod(lhs), math.prod(rhs))


#: The equation of a selectively recomputed group's boundary.
SELECTIVE_EQN = SimpleNamespace(
    params={"prevent_cse": True, "policy": no_growing_dots_saveable},
    primitive=SimpleNamespace(name="checkpoint"))


def selective(group: str) -> str:
    """The selectively recomputed form of module path glob ``group``.

    >>> selective("h_3"), is_selective("h_3:dots"), group_glob("h_3:dots")
    ('h_3:dots', True, 'h_3')
    """
    return group if is_selective(group) else group + SELECTIVE


def is_selective(group: str) -> bool:
    """Whether recompute group ``group`` keeps its matmul outputs (:data:`SELECTIVE`)."""
    return group.endswith(SELECTIVE)


def group_glob(group: str) -> str:
    """The module path glob of recompute group ``group`` (without :data:`SELECTIVE`)."""
    return group[:-len(SELECTIVE)] if is_selective(group) else group


@functools.lru_cache(maxsize=1 << 16)
def in_group(path: str, group: str) -> bool:
    """Whether module path ``path`` is ``group`` (a glob) or lies under it (memoised: a
    model has few module paths, and the recompute search asks about each many times).
    A selective group (:data:`SELECTIVE`) covers what its glob covers."""
    group = group_glob(group)
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
        group = groups[_key(ops[run[0]].module_path, groups)[0]]
        new.append(Boundary(next_id, "checkpoint", tuple(ins.values()), tuple(outs),
                            SELECTIVE_EQN if is_selective(group) else RECOMPUTE_EQN))
        for i in run:
            ops[i] = replace(ops[i], boundary=(next_id,) + ops[i].boundary)
        next_id += 1
    return graph.derive(tuple(ops), graph.boundaries + tuple(new))


def _saves(policy: Any, op: Op) -> bool:
    """Whether a ``jax.checkpoint`` policy saves ``op``'s outputs (asked as JAX asks it: the
    primitive, the operands' avals and the equation's params); a policy that cannot be asked
    about a captured op (no equation) saves nothing, as offloading keeps nothing on device."""
    eqn = op.eqn
    if eqn is None or not hasattr(eqn, "invars") or not hasattr(eqn, "primitive"):
        return False
    try:
        got = policy(eqn.primitive, *[v.aval for v in eqn.invars], **eqn.params)
    except Exception:  # noqa: BLE001 - a policy that does not know this op: saves nothing
        return False
    return got is True or type(got).__name__ == "SaveableType"


@dataclass(frozen=True)
class RematRoles:
    """What each op inside a remat boundary does in the backward (:func:`remat_roles`).

    Attributes:
        kept: ops the boundary's ``jax.checkpoint`` policy saves (the user's or a
            :data:`SELECTIVE` group's): op id -> the indices of its outputs the boundary keeps
            for its backward. Such an op runs once, as if not recomputed.
        dropped: recomputed ops the backward does not need (their outputs feed only ops after
            the boundary, such as a layer's last matmul, bias and residual adds): they are not
            run again (JAX / XLA drop dead code).
    """

    kept: Mapping[int, frozenset[int]]
    dropped: frozenset[int]


NO_ROLES = RematRoles({}, frozenset())


def remat_roles(graph: Graph, readers: Mapping[tuple[int, int], Iterable[int]]
                | Callable[[], Mapping[tuple[int, int], Iterable[int]]] | None = None
                ) -> RematRoles:
    """The ops of ``graph``'s remat boundaries a policy keeps, and the recomputed ones the
    backward does not need. The outermost remat boundary of an op is its block; its policy
    decides what is saved (asked as JAX asks it: primitive, operand avals, params); an op in a
    co-sharded block is never saved (its chunk loop recomputes everything).

    ``readers`` (``(op id, output index)`` of a residual -> the ops whose transposes read it,
    :func:`nnscaler_jax.cost.residuals.residual_readers`, or a function making it, called only
    when the graph has a remat boundary): a recomputed op is needed when an op of its own block
    reads one of its outputs for its backward, or a needed one rebuilds from it; a saved op
    keeps such outputs. None: every recomputed op is needed (nothing is dropped)."""
    bounds: dict[int, Boundary] = {}

    def collect(g: Graph) -> None:
        for b in g.boundaries:
            bounds[b.id] = b
        for op in g.ops:
            for r in op.regions:
                collect(r)

    collect(graph)
    if not any(b.kind in REMAT_KINDS for b in bounds.values()):
        return NO_ROLES
    block: dict[int, int] = {}  # op id -> its outermost remat boundary
    saved: set[int] = set()
    ops: dict[int, Op] = {}
    for op in graph.walk():
        remat = [bounds[b] for b in op.boundary if b in bounds and bounds[b].kind in REMAT_KINDS]
        if not remat:
            continue
        ops[op.id], block[op.id] = op, remat[0].id
        policy = (getattr(remat[0].eqn, "params", None) or {}).get("policy")
        if policy is not None and not op.regions and \
                all(b.kind in ("checkpoint", "remat", "remat2") for b in remat) and \
                _saves(policy, op):
            saved.add(op.id)
    if callable(readers):
        readers = readers()
    out: dict[int, set[int]] = {o: set() for o in saved}
    own: set[int] = set()  # recomputed ops with a residual their block's backward reads
    for (o, k), who in (readers or {}).items():
        if o in block and any(block.get(r) == block[o] for r in who):
            if o in saved:
                out[o].add(k)
            else:
                own.add(o)
    producer = {t.id: (op.id, k) for op in ops.values() for k, t in enumerate(op.outputs)}
    stack = sorted(own) if readers is not None else [o for o in ops if o not in saved]
    needed = set(stack)
    while stack:  # the recomputed ops the needed ones rebuild from; the saved ones they read
        o = stack.pop()
        for t in ops[o].inputs:
            src = producer.get(t.id)
            if src is None or block[src[0]] != block[o]:
                continue
            if src[0] in saved:
                out[src[0]].add(src[1])
            elif src[0] not in needed:
                needed.add(src[0])
                stack.append(src[0])
    dropped = frozenset(o for o, op in ops.items()
                        if o not in saved and o not in needed and not op.regions)
    return RematRoles({o: frozenset(ks) for o, ks in out.items()}, dropped)
