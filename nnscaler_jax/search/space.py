"""The strategy space: per op, which annotated dim every mesh axis splits; shrunk honestly.

A *strategy* of an op is a tuple of ``(mesh axis, identifier)`` pairs (an ``OpPlan.split``): each
mesh axis splits one splittable identifier of the op's annotation or nothing; one identifier may
be split over several axes (major to minor in mesh-axis order) when their product divides it.
So on a 2-D mesh an op with ``D`` splittable dims has up to ``(D + 1)^2`` strategies.

The space shrinks in three honest ways:

- **followers** (Alpa): an op whose annotation holds all its splittable dims in one input
  produced by another op (elementwise ops, reshapes, transposes, reductions) takes the layout its
  producer gives that input; it shares the producer's decision (one *follower group*);
- **repeated layers**: subtrees of the module tree that are copies (``h_0`` ~ ``h_1``: the same
  ops, primitives, annotations and shapes in the same order) share one decision per position;
  an ``nn.scan`` body is already one copy; likewise **siblings**, ops of one class reading the
  same value (the query / key / value projections of one input), share one decision;
- **rules** (``Constraints.rules``): strategies a rule forbids are removed.

>>> from nnscaler_jax.search.space import enumerate_splits
>>> enumerate_splits({"m": 4, "k": 6}, ["m", "k"], {"data": 2, "model": 2})[:4]
((), (('model', 'm'),), (('model', 'k'),), (('data', 'm'),))
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from nnscaler_jax.constraints import Rule
from nnscaler_jax.cost.compute import grad_sources
from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.anno import parse_anno
from nnscaler_jax.ir.graph import Graph, Op, Role
from nnscaler_jax.layout import Layout
from nnscaler_jax.plan.layouts import op_layouts, scan_stored_inputs, sole_read_variables
from nnscaler_jax.plan.plan import OpPlan

__all__ = ["FGroup", "Group", "SearchSpace", "Split", "build_space", "check_rules",
           "enumerate_splits", "op_splits"]

Split = tuple[tuple[str, str], ...]


# ---- strategies of one op --------------------------------------------------------------------------


@lru_cache(maxsize=65536)
def _bind(anno_text: str, in_shapes: tuple, out_shapes: tuple) -> tuple[tuple[str, int], ...]:
    return tuple(anno_of(anno_text).bind(list(in_shapes), list(out_shapes)).items())


@lru_cache(maxsize=65536)
def anno_of(text: str):
    """The parsed annotation (cached: the search asks for the same strings many times)."""
    return parse_anno(text)


@lru_cache(maxsize=65536)
def splittable_of(text: str) -> tuple[str, ...]:
    """The splittable identifiers of an annotation (cached)."""
    return tuple(anno_of(text).splittable())


def op_sizes(op: Op) -> dict[str, int]:
    """Size of every identifier of ``op``'s annotation."""
    if not op.annotated:
        return {}
    return dict(_bind(op.anno, tuple(t.shape for t in op.inputs),
                      tuple(t.shape for t in op.outputs)))


def enumerate_splits(sizes: Mapping[str, int], names: Sequence[str],
                     mesh_axes: Mapping[str, int]) -> tuple[Split, ...]:
    """Every assignment mesh axis -> splittable identifier (or none) whose sizes divide.

    Axes of size 1 never split (their strategies would repeat others). Replicated first.
    """
    axes = [a for a, n in mesh_axes.items() if n > 1]
    choices = [[None] + [d for d in names if sizes.get(d, 0) % mesh_axes[a] == 0] for a in axes]
    out = []
    for combo in itertools.product(*choices):
        pairs = tuple((a, d) for a, d in zip(axes, combo, strict=True) if d is not None)
        ok = all(sizes[d] % math.prod(mesh_axes[a] for a, x in pairs if x == d) == 0
                 for d in {d for _, d in pairs})
        if ok:
            out.append(pairs)
    # Fewest splits first (replicated, then 1-axis, ...), stable within.
    out.sort(key=len)
    return tuple(out)


def op_splits(op: Op, mesh_axes: Mapping[str, int]) -> tuple[Split, ...]:
    """The full strategy set of ``op`` (replicate-only when unannotated)."""
    if not op.annotated:
        return ((),)
    return enumerate_splits(op_sizes(op), splittable_of(op.anno), mesh_axes)


# ---- rules -----------------------------------------------------------------------------------------


def _rule_allows(rule: Rule, split: Split) -> bool:
    if rule.replicate:
        return not split
    if rule.dims is not None and any(d not in rule.dims for _, d in split):
        return False
    return rule.axes is None or all(a in rule.axes for a, _ in split)


def _contradiction_error(a: Rule, b: Rule, op: Op, why: str) -> PlanError:
    return PlanError(
        f"{a} and {b} contradict on op '{op.primitive}' at '{op.module_path or '<top>'}' "
        f"(annotation '{op.anno}', input shapes {[t.shape for t in op.inputs]}): {why}. "
        "Narrow one rule's module glob / primitive, or merge them into one Rule.")


def check_rules(graph: Graph, mesh_axes: Mapping[str, int], rules: Sequence[Rule]) -> None:
    """Raise ``PlanError`` naming both rules when two rules on one op leave nothing to choose:
    one replicates while the other splits, or their dims / mesh axes are disjoint."""
    ops = list(graph.walk())
    for i, a in enumerate(rules):
        for b in rules[i + 1:]:
            for op in ops:
                if not (a.matches(op) and b.matches(op)):
                    continue
                if a.replicate != b.replicate and (a.dims or a.axes or b.dims or b.axes):
                    raise _contradiction_error(a, b, op, "one replicates, the other splits")
                if a.dims is not None and b.dims is not None and not set(a.dims) & set(b.dims):
                    raise _contradiction_error(
                        a, b, op, f"no dim is allowed by both ({list(a.dims)} vs {list(b.dims)})")
                if a.axes is not None and b.axes is not None and not set(a.axes) & set(b.axes):
                    raise _contradiction_error(
                        a, b, op, f"no mesh axis is allowed by both ({list(a.axes)} vs "
                        f"{list(b.axes)}; mesh {dict(mesh_axes)})")


# ---- repeated layers -------------------------------------------------------------------------------

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


# ---- groups ----------------------------------------------------------------------------------------


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
    """The input whose layout decides ``op`` (all its splittable dims live there), if any."""
    if not op.annotated or op.regions or not op.inputs:
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


def _pin_axes(spec: tuple, mesh_axes: Mapping[str, int]) -> tuple[tuple[str, ...], ...]:
    out = []
    for entry in spec:
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        for a in axes:
            if a not in mesh_axes:
                raise PlanError(f"partitioning names mesh axis '{a}' (spec {spec}), which is not "
                                f"in the mesh {dict(mesh_axes)}")
        out.append(tuple(a for a in axes if mesh_axes[a] > 1))
    return tuple(out)


def _unstack_pin(axes: tuple, stacked: bool, spec: tuple) -> tuple:
    """A stacked weight's pinned axes as its per-layer block's (the layer dim stays whole)."""
    if not stacked:
        return axes
    if axes and axes[0]:
        raise PlanError(f"partitioning {spec} splits the layer dim of an nn.scan stack over "
                        f"{axes[0]}; a scan runs its layers one after another, so that dim "
                        "cannot be split (use None for it, or pipeline_stages for layers)")
    return axes[1:]


def _pin_filter(op: Op, keep: tuple[Split, ...], pins, mesh_axes) -> tuple[Split, ...]:
    """The strategies of ``op`` reading each pinned operand split exactly as pinned."""
    def ok(split: Split) -> bool:
        ins, _ = op_layouts(op, OpPlan(op.id, op.primitive, op.module_path, split))
        return all(tuple(a for a in ins[k].dims[i] if mesh_axes[a] > 1) == axes
                   for k, spec in pins for i, axes in enumerate(spec))

    kept = tuple(s for s in keep if ok(s))
    if not kept:
        names = [op.inputs[k].name for k, _ in pins]
        raise PlanError(
            f"partitioning of {names} ({[spec for _, spec in pins]}) cannot be met by op "
            f"'{op.primitive}' at '{op.module_path or '<top>'}' (annotation '{op.anno}', input "
            f"shapes {[t.shape for t in op.inputs]}) under the other constraints: no strategy "
            "splits those dims over those mesh axes (sizes must divide). Change the metadata "
            "or the rules.")
    return kept


def build_space(graph: Graph, mesh_axes: Mapping[str, int], rules: Sequence[Rule] = (), *,
                followers: bool = True, share_layers: bool = True,
                fixed: Mapping[int, Split] | None = None,
                pinned: Mapping[int, tuple] | None = None) -> SearchSpace:
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
    """
    mesh_axes = dict(mesh_axes)
    fixed = {k: tuple(v) for k, v in (fixed or {}).items()}
    rules = tuple(rules)
    check_rules(graph, mesh_axes, rules)
    ops = list(graph.walk())
    uses = first_uses(graph)
    first = set(uses.values())
    pin_ops: dict[int, list[tuple[int, tuple]]] = {}
    by_id = {op.id: op for op in ops}
    sole = sole_read_variables(graph) if pinned else frozenset()
    for tid, spec in (pinned or {}).items():
        if tid in uses:
            op_id, k = uses[tid]
            axes = _pin_axes(spec, mesh_axes)
            lifted = scan_stored_inputs(by_id[op_id], sole).get(k)
            if lifted is not None:  # a scan stack's weight: its body reader stores it
                op_id, k, axes = lifted[0].id, lifted[1], _unstack_pin(axes, lifted[2], spec)
            pin_ops.setdefault(op_id, []).append((k, axes))
    grads = grad_sources(graph)
    sigs = {op.id: _op_signature(op, first, rules, grads) + (fixed.get(op.id),
                                                      tuple(pin_ops.get(op.id, ())))
            for op in ops}
    interned: dict[tuple, int] = {}
    op_class = {i: interned.setdefault(sig, len(interned)) for i, sig in sigs.items()}
    keys = layer_keys(ops, op_class)  # also memoizes costs of copies when not shared
    weights: dict[int, float] = {}
    for g, w, _ in walk_graphs(graph):
        for op in g.ops:
            weights[op.id] = w

    removed = {str(r): 0 for r in rules}
    full: dict[int, tuple[Split, ...]] = {}
    allowed: dict[int, tuple[Split, ...]] = {}
    log10_full = 0.0
    # Ours computes each class of identical ops once (same primitive, annotation, shapes, rules).
    per_class: dict[int, tuple] = {}
    for op in ops:
        cls = op_class[op.id]
        done = per_class.get(cls) if share_layers else None
        if done is None:
            splits = op_splits(op, mesh_axes)
            keep = splits
            cut = []
            for r in rules:
                if r.matches(op):
                    kept = tuple(s for s in keep if _rule_allows(r, s))
                    cut.append((str(r), len(keep) - len(kept)))
                    keep = kept
            keep = keep or ((),)
            if op.id in pin_ops:
                keep = _pin_filter(op, keep, pin_ops[op.id], mesh_axes)
            if op.id in fixed:
                keep = (fixed[op.id],)
            done = per_class[cls] = (splits, keep, tuple(cut))
        splits, keep, cut = done
        full[op.id] = splits
        log10_full += math.log10(len(splits))
        for r, n in cut:
            removed[r] += n
        allowed[op.id] = keep

    # Followers: op -> (follower group index, member index); built in program order per graph.
    fg_ops: list[list[int]] = []
    fg_splits: list[list[tuple[Split, ...]]] = []
    # members' strategy lists interned to small ints (equal lists, equal ids) as they are made,
    # each list hashed once: the follow memo and the cost tables key on them
    lists: dict[tuple, int] = {}
    fg_lids: list[list[int]] = []
    class_lid: dict[int, int] = {}
    member: dict[int, tuple[int, int]] = {}
    ruled = {op.id for op in ops for r in rules if r.matches(op)} | set(fixed) | set(pin_ops)
    lead_memo: dict[tuple, int | None] = {}
    follow_memo: dict[tuple, tuple[tuple[Split, ...], int]] = {}
    for g, _, _ in walk_graphs(graph):
        producer = g.producer
        for op in g.ops:
            j = None
            if followers and op.id not in ruled:
                if share_layers:
                    lk = (op_class[op.id], tuple(t.id in producer for t in op.inputs))
                    if lk not in lead_memo:
                        lead_memo[lk] = _leader_input(op, producer, op_sizes(op), mesh_axes)
                    j = lead_memo[lk]
                else:
                    j = _leader_input(op, producer, op_sizes(op), mesh_axes)
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
                sizes = op_sizes(op)
                out = []
                for s in fg_splits[f][m]:
                    _, outs = op_layouts(prod, OpPlan(prod.id, prod.primitive, prod.module_path,
                                                      s))
                    out.append(_follow_split(outs[k], op, j, sizes, mesh_axes))
                mine = tuple(out)
                lid = lists.setdefault(mine, len(lists))
                if share_layers:
                    follow_memo[fk] = (mine, lid)
            member[op.id] = (f, len(fg_ops[f]))
            fg_ops[f].append(op.id)
            fg_splits[f].append(mine)
            fg_lids[f].append(lid)

    fgroups = []
    # isomorphism keys and members' strategy lists interned to small ints (cheap to hash: the
    # cost tables key their memos on them)
    iso: dict[tuple, int] = {}
    for ids, splits, lids in zip(fg_ops, fg_splits, fg_lids, strict=True):
        key = None
        if all(i in keys for i in ids):
            key = iso.setdefault(tuple(keys[i] for i in ids), len(iso))
        fgroups.append(FGroup(tuple(ids), tuple(splits), key, tuple(lids)))

    # Groups: copies of one layer share a decision; so do sibling ops (ours): leaders of one
    # class reading the same value at the same operand (the q / k / v projections of one input).
    parent = list(range(len(fgroups)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    if share_layers:
        first: dict[object, int] = {}
        for i, fg in enumerate(fgroups):
            lead = by_id[fg.ops[0]]
            keys = [fg.key] if fg.key is not None else []
            keys += [(op_class[lead.id], j, t.id) for j, t in enumerate(lead.inputs)
                     if t.role is Role.VALUE and t.ndim and lead.id not in ruled]
            for k in keys:
                parent[root(i)] = root(first.setdefault(k, i))
    buckets: dict[int, list[int]] = {}
    for i in range(len(fgroups)):
        buckets.setdefault(root(i), []).append(i)
    groups = []
    where: dict[int, tuple[int, int, int]] = {}
    for gi, members in enumerate(buckets.values()):
        fgs = tuple(fgroups[i] for i in members)
        lead = by_id[fgs[0].ops[0]]
        label = f"{lead.module_path or '<top>'}:{lead.primitive}"
        if len(fgs) > 1:
            label += f" x{len(fgs)}"
        groups.append(Group(fgs, label))
        for fi, fg in enumerate(fgs):
            for mi, op_id in enumerate(fg.ops):
                where[op_id] = (gi, fi, mi)
    return SearchSpace(graph, mesh_axes, tuple(groups), where, len(ops), log10_full,
                       tuple((r, n) for r, n in removed.items()), weights, op_class,
                       share_layers, fixed, grads)
