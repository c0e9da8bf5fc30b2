"""Decisions ops share, so the search has fewer variables than ops:

- **op classes**: ops with equal primitives, annotations, shapes, dtypes, roles, gradient
  sources and matching rules cost the same under the same split (one pricing per class);
- **repeated layers**: subtrees of the module tree that are copies (``h_0`` ~ ``h_1``: the same
  ops, signatures and order) share one decision per position (:func:`layer_keys`);
- **followers** (Alpa): an op whose annotation holds all its splittable dims in one input
  produced by another op takes the layout its producer gives that input (:func:`follower_groups`);
- **siblings**: leaders of one class reading the same value at the same operand (q / k / v of
  one input) share a decision, as do copies of a layer (:func:`shared_buckets`, ours).
"""

from __future__ import annotations

import math
import re
from collections.abc import Hashable, Iterable, Mapping, Sequence
from functools import lru_cache

from nnscaler_jax.constraints import Rule
from nnscaler_jax.cost.relayout import Split
from nnscaler_jax.ir.attention import FUSED
from nnscaler_jax.ir.graph import Graph, Op, Role
from nnscaler_jax.layout import Layout
from nnscaler_jax.plan.layouts import op_layouts
from nnscaler_jax.plan.plan import OpPlan
from nnscaler_jax.search.strategies import anno_of, op_sizes, splittable_of

__all__ = ["follower_groups", "layer_keys", "op_classes", "shared_buckets"]


_NUMBERED = re.compile(r"^(.*?)_?(\d+)$")


def _op_signature(op: Op, first_use: set[tuple[int, int]], rules: Sequence[Rule],
                  grads: Mapping[int, int]) -> tuple:
    ins = tuple((t.shape, t.dtype, t.role.value, (op.id, k) in first_use, grads.get(t.id, 0))
                for k, t in enumerate(op.inputs))
    return (op.primitive, op.anno, op.annotated, ins, tuple(t.shape for t in op.outputs),
            tuple(i for i, r in enumerate(rules) if r.matches(op)))


@lru_cache(maxsize=65536)
def _numbered_prefixes(module_path: str) -> tuple[str, ...]:
    """The prefixes of ``module_path`` ending in a numbered component (``a/h_3``, ...)."""
    parts = module_path.split("/") if module_path else []
    return tuple("/".join(parts[: i + 1]) for i, comp in enumerate(parts)
                 if _NUMBERED.match(comp))


def layer_keys(ops: Sequence[Op], signatures: Mapping[int, Hashable]) -> dict[int, tuple]:
    """op id -> ``(class, position)`` for ops inside a repeated module subtree.

    A numbered module component (``h_3``, ``blocks_12``, ``layer4``) roots a subtree; subtrees
    with the same base name and the same ops (signatures, relative paths, order) form a class
    when there are at least two of them. The outermost repeated subtree of an op decides its
    key, so sub-layers of one layer (``dense_0`` / ``dense_1``) never merge with each other.
    """
    subtree: dict[str, list[Op]] = {}
    for op in ops:
        for prefix in _numbered_prefixes(op.module_path):
            subtree.setdefault(prefix, []).append(op)
    klass: dict[str, tuple] = {}
    count: dict[tuple, int] = {}
    for prefix, members in subtree.items():
        base = _NUMBERED.match(prefix.rsplit("/", 1)[-1]).group(1)
        sig = hash(tuple((op.module_path[len(prefix):], signatures[op.id]) for op in members))
        klass[prefix] = (base, len(members), sig)
        count[klass[prefix]] = count.get(klass[prefix], 0) + 1
    out: dict[int, tuple] = {}
    for prefix, members in sorted(subtree.items(), key=lambda kv: kv[0].count("/")):
        k = klass[prefix]
        if count[k] < 2:
            continue
        for pos, op in enumerate(members):
            out.setdefault(op.id, (k, pos))
    return out


def op_classes(ops: Sequence[Op], first_use: set[tuple[int, int]], rules: Sequence[Rule],
               grads: Mapping[int, int], fixed: Mapping[int, Split],
               pin_ops: Mapping[int, list],
               run_sizes: Mapping[int, Mapping[str, int]] | None = None) -> dict[int, int]:
    """op id -> class id: equal signatures (and equal hand-fixed splits, pins and sizes where
    they run, ``run_sizes``), equal ids."""
    run_sizes = run_sizes or {}
    sigs = {op.id: _op_signature(op, first_use, rules, grads) + (
        fixed.get(op.id), tuple(pin_ops.get(op.id, ())),
        tuple(sorted(run_sizes.get(op.id, {}).items()))) for op in ops}
    interned: dict[tuple, int] = {}
    return {i: interned.setdefault(sig, len(interned)) for i, sig in sigs.items()}


def _follow_split(src: Layout, op: Op, j: int, sizes: Mapping[str, int],
                  mesh_axes: Mapping[str, int]) -> Split:
    """The split of ``op`` whose input ``j`` keeps the dim-splits of ``src`` that ``op`` can."""
    anno = anno_of(op.anno)
    operand = anno.inputs[j]
    names = set(splittable_of(op.anno))
    pairs: list[tuple[str, str]] = []
    for pos, axes in enumerate(src.dims):
        if not axes or operand.axes is None:
            continue
        name = operand.axes[pos].dims[0].name
        if name not in names:
            continue
        keep = list(axes)
        while keep and sizes[name] % math.prod(mesh_axes[a] for a in keep):
            keep.pop()
        pairs += [(a, name) for a in keep]
    return tuple(pairs)


def _leader_input(op: Op, producer: Mapping[int, Op], sizes: Mapping[str, int],
                  mesh_axes: Mapping[str, int]) -> int | None:
    """The input whose layout decides ``op`` (all its splittable dims live there), if any. A
    fused attention op decides for itself: its split chooses how it runs (its heads, or ring
    attention on its sequence), not what its producer left."""
    if not op.annotated or op.regions or not op.inputs or op.primitive == FUSED:
        return None
    anno = anno_of(op.anno)
    smallest = min((n for n in mesh_axes.values() if n > 1), default=0)
    live = [d for d in splittable_of(op.anno) if smallest and sizes.get(d, 0) >= smallest
            and any(sizes[d] % n == 0 for n in mesh_axes.values() if n > 1)]
    best = None
    for j, (operand, t) in enumerate(zip(anno.inputs, op.inputs, strict=True)):
        if t.id not in producer or operand.axes is None:
            continue
        held = {ax.dims[0].name for ax in operand.axes}
        if all(d in held for d in live) and (best is None or
                                             t.nbytes > op.inputs[best].nbytes):
            best = j
    return best


def follower_groups(graphs: Iterable[Graph], allowed: Mapping[int, tuple[Split, ...]],
                    op_class: Mapping[int, int], ruled: set[int], mesh_axes: Mapping[str, int],
                    *, followers: bool, share_layers: bool,
                    run_sizes: Mapping[int, Mapping[str, int]] | None = None
                    ) -> tuple[list[list[int]], list[list[tuple[Split, ...]]], list[list[int]]]:
    """Follower groups, built in program order per graph: per group its op ids (leader first),
    per member its split under each strategy of the group, and per member an id of that
    strategy list (equal lists, equal ids: interned as they are made, each list hashed once;
    the follow memo and the cost tables key on them). Ops in ``ruled`` (a rule matches, fixed
    or pinned) lead their own group. ``share_layers``: memoise per class (ours).
    ``run_sizes``: op id -> identifier sizes where it runs, when not the graph's."""
    run_sizes = run_sizes or {}
    sizes_of = lambda op: {**op_sizes(op), **run_sizes.get(op.id, {})}
    fg_ops: list[list[int]] = []
    fg_splits: list[list[tuple[Split, ...]]] = []
    fg_lids: list[list[int]] = []
    lists: dict[tuple, int] = {}
    class_lid: dict[int, int] = {}
    member: dict[int, tuple[int, int]] = {}
    lead_memo: dict[tuple, int | None] = {}
    follow_memo: dict[tuple, tuple[tuple[Split, ...], int]] = {}
    for g in graphs:
        producer = g.producer
        for op in g.ops:
            j = None
            if followers and op.id not in ruled:
                if share_layers:
                    lk = (op_class[op.id], tuple(t.id in producer for t in op.inputs))
                    if lk not in lead_memo:
                        lead_memo[lk] = _leader_input(op, producer, sizes_of(op), mesh_axes)
                    j = lead_memo[lk]
                else:
                    j = _leader_input(op, producer, sizes_of(op), mesh_axes)
            if j is None:
                member[op.id] = (len(fg_ops), 0)
                fg_ops.append([op.id])
                fg_splits.append([allowed[op.id]])
                cls = op_class[op.id]
                lid = class_lid.get(cls) if share_layers else None  # allowed: per class
                if lid is None:
                    lid = class_lid[cls] = lists.setdefault(allowed[op.id], len(lists))
                fg_lids.append([lid])
                continue
            t = op.inputs[j]
            prod = producer[t.id]
            f, m = member[prod.id]
            k = [o.id for o in prod.outputs].index(t.id)
            fk = (op_class[prod.id], k, op_class[op.id], j, fg_lids[f][m])
            hit = follow_memo.get(fk) if share_layers else None
            if hit is not None:
                mine, lid = hit
            else:
                mine = _followed(prod, k, fg_splits[f][m], op, j, mesh_axes, sizes_of(op))
                lid = lists.setdefault(mine, len(lists))
                if share_layers:
                    follow_memo[fk] = (mine, lid)
            member[op.id] = (f, len(fg_ops[f]))
            fg_ops[f].append(op.id)
            fg_splits[f].append(mine)
            fg_lids[f].append(lid)
    return fg_ops, fg_splits, fg_lids


def _followed(prod: Op, k: int, prod_splits: tuple[Split, ...], op: Op, j: int,
              mesh_axes: Mapping[str, int], sizes: Mapping[str, int]) -> tuple[Split, ...]:
    """Per strategy of producer ``prod``, the split of ``op`` (its identifiers' ``sizes``)
    reading its output ``k`` as input ``j`` as the producer leaves it."""
    out = []
    for s in prod_splits:
        _, outs = op_layouts(prod, OpPlan(prod.id, prod.primitive, prod.module_path, s))
        out.append(_follow_split(outs[k], op, j, sizes, mesh_axes))
    return tuple(out)


def shared_buckets(leaders: Sequence[tuple[Op, int | None]], op_class: Mapping[int, int],
                   ruled: set[int], share_layers: bool) -> list[list[int]]:
    """Follower groups (given by their leader op and isomorphism key) that decide as one, as
    lists of indices: copies of one layer (equal keys) and, ours, sibling leaders of one class
    reading the same value at the same operand (the q / k / v projections of one input)."""
    parent = list(range(len(leaders)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    if share_layers:
        first: dict[object, int] = {}
        for i, (lead, key) in enumerate(leaders):
            keys = [key] if key is not None else []
            keys += [(op_class[lead.id], j, t.id) for j, t in enumerate(lead.inputs)
                     if t.role is Role.VALUE and t.ndim and lead.id not in ruled]
            for k in keys:
                parent[root(i)] = root(first.setdefault(k, i))
    buckets: dict[int, list[int]] = {}
    for i in range(len(leaders)):
        buckets.setdefault(root(i), []).append(i)
    return list(buckets.values())
