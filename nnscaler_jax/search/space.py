"""The strategy space: per op, which annotated dim every mesh axis splits; shrunk honestly.

A *strategy* of an op is a tuple of ``(mesh axis, identifier)`` pairs (an ``OpPlan.split``; see
:mod:`~nnscaler_jax.search.strategies`): each mesh axis splits one splittable identifier of the
op's annotation or nothing. The space shrinks in three honest ways:

- **followers** (Alpa): an op whose annotation holds all its splittable dims in one input
  produced by another op (elementwise ops, reshapes, transposes, reductions) takes the layout its
  producer gives that input; it shares the producer's decision (one *follower group*);
- **repeated layers**: subtrees of the module tree that are copies (``h_0`` ~ ``h_1``: the same
  ops, primitives, annotations and shapes in the same order) share one decision per position;
  an ``nn.scan`` body is already one copy; likewise **siblings**, ops of one class reading the
  same value (the query / key / value projections of one input), share one decision
  (:mod:`~nnscaler_jax.search.sharing`);
- **rules** (``Constraints.rules``): strategies a rule forbids are removed.

>>> from nnscaler_jax.search.space import enumerate_splits
>>> enumerate_splits({"m": 4, "k": 6}, ["m", "k"], {"data": 2, "model": 2})[:4]
((), (('model', 'm'),), (('model', 'k'),), (('data', 'm'),))
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from nnscaler_jax.constraints import Rule
from nnscaler_jax.cost.compute import grad_sources
from nnscaler_jax.ir.coshard import COSHARD
from nnscaler_jax.ir.graph import DataflowMemo, Graph, Op
from nnscaler_jax.plan.policies import batch_dims
from nnscaler_jax.search.sharing import follower_groups, layer_keys, op_classes, shared_buckets
from nnscaler_jax.search.strategies import (
    Split,
    allowed_splits,
    check_rules,
    enumerate_splits,
    op_sizes,
    op_splits,
    pinned_readers,
)

__all__ = ["FGroup", "Group", "SearchSpace", "Split", "build_space", "check_rules",
           "enumerate_splits", "first_uses", "op_splits", "run_sizes", "walk_graphs"]


@dataclass(frozen=True)
class FGroup:
    """A follower group: a leader op and the ops following it, one decision for all.

    Attributes:
        ops: op ids, leader first.
        splits: per member, its split under each strategy of the group (index = strategy).
        key: isomorphism key (equal keys: copies of one layer), or None when unique.
        split_ids: per member, an id of its strategy list (equal ids: equal lists).
    """

    ops: tuple[int, ...]
    splits: tuple[tuple[Split, ...], ...]
    key: int | None = None
    split_ids: tuple[int, ...] = ()

    @property
    def n(self) -> int:
        return len(self.splits[0])


@dataclass(frozen=True)
class Group:
    """One ILP variable: follower groups that share a decision (copies of a layer)."""

    fgroups: tuple[FGroup, ...]
    label: str

    @property
    def n(self) -> int:
        return self.fgroups[0].n

    @property
    def n_ops(self) -> int:
        return sum(len(f.ops) for f in self.fgroups)


@dataclass(frozen=True)
class SearchSpace:
    """The shrunk strategy space of a graph on a mesh.

    Attributes:
        graph / mesh_axes: what was planned.
        groups: the ILP variables.
        where: op id -> (group index, follower-group index, member index).
        ops: number of ops.
        log10_full: log10 of the size of the unshrunk space (every op its full strategy set).
        removed: (rule, strategies it removed over all ops).
        weights: op id -> how many times it runs per step (scan trip counts).
        op_class: op id -> class id; ops of one class have equal primitives, annotations,
            shapes, dtypes, roles, gradient sources and matching rules (so equal costs under
            equal splits).
        shared: copies of a layer share a decision (ours); the cost tables then price one
            representative per class of identical work instead of every op.
        fixed: op id -> the split a policy fixed by hand before the search (kept).
        grad_sources: tensor id -> :func:`~nnscaler_jax.cost.compute.grad_sources` bits.
        derived: what is computed from the space alone (the cost tables' edge list), shared
            by its copies for the recompute probes of one graph (see :func:`build_space`).
    """

    graph: Graph = field(repr=False)
    mesh_axes: dict[str, int]
    groups: tuple[Group, ...]
    where: dict[int, tuple[int, int, int]] = field(repr=False)
    ops: int = 0
    log10_full: float = 0.0
    removed: tuple[tuple[str, int], ...] = ()
    weights: dict[int, float] = field(default_factory=dict, repr=False)
    op_class: dict[int, int] = field(default_factory=dict, repr=False)
    shared: bool = False
    fixed: dict[int, Split] = field(default_factory=dict, repr=False)
    grad_sources: dict[int, int] = field(default_factory=dict, repr=False)
    derived: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def log10_size(self) -> float:
        return sum(math.log10(g.n) for g in self.groups)

    def split_of(self, op_id: int, choice: Sequence[int]) -> Split:
        g, f, m = self.where[op_id]
        return self.groups[g].fgroups[f].splits[m][choice[g]]

    def summary(self) -> str:
        sizes = [g.n for g in self.groups]
        lines = [(f"search space: {self.ops} ops -> {len(self.groups)} groups "
                 f"(strategies per group: min {min(sizes, default=0)}, max "
                 f"{max(sizes, default=0)}), size 10^{self.log10_size:.1f} "
                 f"(unshrunk 10^{self.log10_full:.1f})")]
        for rule, n in self.removed:
            lines.append(f"  {rule} removed {n} strategies")
        return "\n".join(lines)


def walk_graphs(graph: Graph, weight: float = 1.0) -> Iterable[tuple[Graph, float, Op | None]]:
    """(graph, runs per step, the op owning it) for the top graph and every region body."""
    yield graph, weight, None
    for op in graph.ops:
        for region in op.regions:
            trips = float(op.params.get("length", 1)) if op.primitive == "scan" else 1.0
            for g, w, owner in walk_graphs(region, weight * trips):
                yield g, w, owner if owner is not None else op


def first_uses(graph: Graph) -> dict[int, tuple[int, int]]:
    """variable tensor id -> (op id, input index) of its first reader in walk order (the
    layout the variable is stored in, see ``primitives._consumer_storage``)."""
    want = {t.id for t in graph.variables}
    out: dict[int, tuple[int, int]] = {}
    for op in graph.walk():
        for k, t in enumerate(op.inputs):
            if t.id in want and t.id not in out:
                out[t.id] = (op.id, k)
    return out


def build_space(graph: Graph, mesh_axes: Mapping[str, int], rules: Sequence[Rule] = (), *,
                followers: bool = True, share_layers: bool = True,
                fixed: Mapping[int, Split] | None = None,
                pinned: Mapping[int, tuple] | None = None, microbatches: int = 1
                ) -> SearchSpace:
    """The strategy space of ``graph`` on a mesh with ``mesh_axes`` sizes.

    Args:
        graph: the annotated graph.
        mesh_axes: mesh axis name -> size (an abstract mesh is enough).
        rules: ``Constraints.rules``; contradictory rules raise ``PlanError`` naming both.
        followers: merge followers into their producer's group (Alpa does).
        share_layers: copies of a layer share one decision (ours; Alpa does not).
        fixed: op id -> split decided by hand (a policy's partial plan): the op keeps exactly
            that strategy, leads its own follower group, and shares no decision with copies
            that are not fixed the same way.
        pinned: variable tensor id -> mesh axes per dim (Flax partitioning metadata, a
            policy's ``store_variable``): the variable's first reader (its storage) must split
            each dim over exactly those axes (size-1 axes ignored).
        microbatches: the graph's batch runs as this many micro-batches (gradient
            accumulation, a pipeline stage's micro-batch): a split of a batch dim must divide
            one micro-batch's rows (:func:`~nnscaler_jax.plan.policies.batch_dims`).
    """
    mesh_axes = dict(mesh_axes)
    fixed = {k: tuple(v) for k, v in (fixed or {}).items()}
    rules = tuple(rules)
    check_rules(graph, mesh_axes, rules)
    # the space reads no boundaries: the recompute probes of one graph share it (op order is
    # in the key: the first reader of a variable, the order of a layer's ops)
    key = (tuple(op.id for op in graph.walk()), tuple(mesh_axes.items()), rules, followers,
           share_layers, tuple(fixed.items()), tuple((pinned or {}).items()), microbatches)
    space = _SPACES.get(graph, key, lambda: _build(graph, mesh_axes, rules, followers,
                                                   share_layers, fixed, pinned, microbatches))
    return space if space.graph is graph else replace(space, graph=graph)


_SPACES = DataflowMemo(size=2)


def run_sizes(graph: Graph, microbatches: int = 1) -> dict[int, dict[str, int]]:
    """op id -> ``{identifier: its size where the op runs}``, for the identifiers whose size
    there is not the graph's: a batch dim (:func:`~nnscaler_jax.plan.policies.batch_dims`)
    holds one micro-batch's rows when the batch runs as ``microbatches`` micro-batches, and
    the dim a co-sharded block chunks holds one chunk (a split of it must divide that)."""
    out: dict[int, dict[str, int]] = {}
    if microbatches > 1:
        for op, dim, size in batch_dims(graph):
            if size % microbatches == 0:
                out[op.id] = {dim: size // microbatches}
    blocks = {b.id: b.eqn.params for b in graph.boundaries if b.kind == COSHARD}
    for op in graph.walk() if blocks else ():
        for b in op.boundary:
            if b in blocks and op.id in blocks[b]["idents"]:
                dim, k = blocks[b]["idents"][op.id], blocks[b]["chunks"]
                size = out.get(op.id, {}).get(dim, op_sizes(op).get(dim, 0))
                # (a size no chunk divides: 1, which no split divides)
                out.setdefault(op.id, {})[dim] = size // k if size % k == 0 else 1
    return out


def _build(graph: Graph, mesh_axes: dict[str, int], rules: tuple[Rule, ...], followers: bool,
           share_layers: bool, fixed: dict[int, Split], pinned: Mapping[int, tuple] | None,
           microbatches: int) -> SearchSpace:
    ops = list(graph.walk())
    by_id = {op.id: op for op in ops}
    uses = first_uses(graph)
    pin_ops = pinned_readers(graph, pinned or {}, uses, by_id, mesh_axes)
    grads = grad_sources(graph)
    sizes = run_sizes(graph, microbatches)
    op_class = op_classes(ops, set(uses.values()), rules, grads, fixed, pin_ops, sizes)
    weights: dict[int, float] = {}
    for g, w, _ in walk_graphs(graph):
        for op in g.ops:
            weights[op.id] = w
    # ours computes each class of identical ops once (same primitive, annotation, shapes, rules)
    allowed, log10_full, removed = allowed_splits(ops, op_class, mesh_axes, rules, pin_ops,
                                                  fixed, share_layers, sizes)
    ruled = {op.id for op in ops for r in rules if r.matches(op)} | set(fixed) | set(pin_ops)
    fg_ops, fg_splits, fg_lids = follower_groups(
        [g for g, _, _ in walk_graphs(graph)], allowed, op_class, ruled, mesh_axes,
        followers=followers, share_layers=share_layers, run_sizes=sizes)
    # isomorphism keys (also memoize costs of copies when not shared) interned to small ints
    # (cheap to hash: the cost tables key their memos on them)
    keys = layer_keys(ops, op_class)
    iso: dict[tuple, int] = {}
    fgroups = []
    for ids, splits, lids in zip(fg_ops, fg_splits, fg_lids, strict=True):
        key = None
        if all(i in keys for i in ids):
            key = iso.setdefault(tuple(keys[i] for i in ids), len(iso))
        fgroups.append(FGroup(tuple(ids), tuple(splits), key, tuple(lids)))
    buckets = shared_buckets([(by_id[fg.ops[0]], fg.key) for fg in fgroups], op_class, ruled,
                             share_layers)
    groups, where = _groups(fgroups, buckets, by_id)
    return SearchSpace(graph, mesh_axes, groups, where, len(ops), log10_full,
                       tuple((r, n) for r, n in removed.items()), weights, op_class,
                       share_layers, fixed, grads)


def _groups(fgroups: Sequence[FGroup], buckets: Iterable[list[int]], by_id: Mapping[int, Op]
            ) -> tuple[tuple[Group, ...], dict[int, tuple[int, int, int]]]:
    """The ILP variables (one per bucket of follower groups deciding as one) and ``where``."""
    groups = []
    where: dict[int, tuple[int, int, int]] = {}
    for gi, members in enumerate(buckets):
        fgs = tuple(fgroups[i] for i in members)
        lead = by_id[fgs[0].ops[0]]
        label = f"{lead.module_path or '<top>'}:{lead.primitive}"
        if len(fgs) > 1:
            label += f" x{len(fgs)}"
        groups.append(Group(fgs, label))
        for fi, fg in enumerate(fgs):
            for mi, op_id in enumerate(fg.ops):
                where[op_id] = (gi, fi, mi)
    return tuple(groups), where
