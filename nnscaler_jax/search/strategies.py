"""Strategies of one op: every way the mesh axes can split its annotated dims, narrowed by the
rules (``Constraints.rules``) and by pinned variables (Flax partitioning metadata, a policy's
``store_variable``), or fixed by hand.

A *strategy* of an op is a tuple of ``(mesh axis, identifier)`` pairs (an ``OpPlan.split``): each
mesh axis splits one splittable identifier of the op's annotation or nothing; one identifier may
be split over several axes (major to minor in mesh-axis order) when their product divides it.
So on a 2-D mesh an op with ``D`` splittable dims has up to ``(D + 1)^2`` strategies.

>>> from nnscaler_jax.search.strategies import enumerate_splits
>>> enumerate_splits({"m": 4, "k": 6}, ["m", "k"], {"data": 2, "model": 2})[:4]
((), (('model', 'm'),), (('model', 'k'),), (('data', 'm'),))
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from functools import lru_cache

from nnscaler_jax.constraints import Rule
from nnscaler_jax.cost.relayout import Split
from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.anno import parse_anno
from nnscaler_jax.ir.graph import Graph, Op
from nnscaler_jax.plan.layouts import op_layouts, scan_stored_inputs, sole_read_variables
from nnscaler_jax.plan.plan import OpPlan

__all__ = ["Split", "allowed_splits", "anno_of", "check_rules", "enumerate_splits", "op_sizes",
           "op_splits", "pin_axes", "pin_filter", "pinned_readers", "rule_allows", "splittable_of",
           "unstack_pin"]


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


def op_splits(op: Op, mesh_axes: Mapping[str, int],
              sizes: Mapping[str, int] | None = None) -> tuple[Split, ...]:
    """The full strategy set of ``op`` (replicate-only when unannotated); ``sizes``: the
    sizes some of its identifiers have where it runs (a micro-batch's rows), if not the
    graph's."""
    if not op.annotated:
        return ((),)
    return enumerate_splits({**op_sizes(op), **(sizes or {})}, splittable_of(op.anno),
                            mesh_axes)


# ---- rules and pins ------------------------------------------------------------------------------


def rule_allows(rule: Rule, split: Split) -> bool:
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


def pin_axes(spec: tuple, mesh_axes: Mapping[str, int]) -> tuple[tuple[str, ...], ...]:
    out = []
    for entry in spec:
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        for a in axes:
            if a not in mesh_axes:
                raise PlanError(f"partitioning names mesh axis '{a}' (spec {spec}), which is not "
                                f"in the mesh {dict(mesh_axes)}")
        out.append(tuple(a for a in axes if mesh_axes[a] > 1))
    return tuple(out)


def unstack_pin(axes: tuple, stacked: bool, spec: tuple) -> tuple:
    """A stacked weight's pinned axes as its per-layer block's (the layer dim stays whole)."""
    if not stacked:
        return axes
    if axes and axes[0]:
        raise PlanError(f"partitioning {spec} splits the layer dim of an nn.scan stack over "
                        f"{axes[0]}; a scan runs its layers one after another, so that dim "
                        "cannot be split (use None for it, or pipeline_stages for layers)")
    return axes[1:]


def pin_filter(op: Op, keep: tuple[Split, ...], pins, mesh_axes) -> tuple[Split, ...]:
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


def allowed_splits(ops: Sequence[Op], op_class: Mapping[int, int], mesh_axes: Mapping[str, int],
                   rules: Sequence[Rule], pin_ops: Mapping[int, list[tuple[int, tuple]]],
                   fixed: Mapping[int, Split], per_class: bool,
                   run_sizes: Mapping[int, dict[str, int]] | None = None
                   ) -> tuple[dict[int, tuple[Split, ...]], float, dict[str, int]]:
    """``(op id -> the strategies it may take, log10 of the unshrunk space, rule -> strategies it
    removed)``: rules, then pins, narrow each op's full set; a fixed op keeps its one split.
    ``per_class``: compute each class of identical ops (same primitive, annotation, shapes,
    rules) once (ours). ``run_sizes``: op id -> identifier sizes where it runs, when not the
    graph's (a micro-batch's rows: a split must divide them)."""
    removed = {str(r): 0 for r in rules}
    allowed: dict[int, tuple[Split, ...]] = {}
    log10_full = 0.0
    done_by_class: dict[int, tuple] = {}
    run_sizes = run_sizes or {}
    for op in ops:
        cls = op_class[op.id]  # (equal sizes where they run: op_classes)
        done = done_by_class.get(cls) if per_class else None
        if done is None:
            splits = op_splits(op, mesh_axes, run_sizes.get(op.id))
            keep = splits
            cut = []
            for r in rules:
                if r.matches(op):
                    kept = tuple(s for s in keep if rule_allows(r, s))
                    cut.append((str(r), len(keep) - len(kept)))
                    keep = kept
            keep = keep or ((),)
            if op.id in pin_ops:
                keep = pin_filter(op, keep, pin_ops[op.id], mesh_axes)
            if op.id in fixed:
                keep = (fixed[op.id],)
            done = done_by_class[cls] = (splits, keep, tuple(cut))
        splits, keep, cut = done
        log10_full += math.log10(len(splits))
        for r, n in cut:
            removed[r] += n
        allowed[op.id] = keep
    return allowed, log10_full, removed


def pinned_readers(graph: Graph, pinned: Mapping[int, tuple], uses: Mapping[int, tuple[int, int]],
                   by_id: Mapping[int, Op], mesh_axes: Mapping[str, int]
                   ) -> dict[int, list[tuple[int, tuple]]]:
    """op id -> ``(input index, mesh axes per dim)`` it must read split exactly so: the first
    reader (``uses``) of each pinned variable (a scan stack's weight: the body op storing it)."""
    pin_ops: dict[int, list[tuple[int, tuple]]] = {}
    sole = sole_read_variables(graph) if pinned else frozenset()
    for tid, spec in pinned.items():
        if tid in uses:
            op_id, k = uses[tid]
            axes = pin_axes(spec, mesh_axes)
            lifted = scan_stored_inputs(by_id[op_id], sole).get(k)
            if lifted is not None:  # a scan stack's weight: its body reader stores it
                op_id, k, axes = lifted[0].id, lifted[1], unstack_pin(axes, lifted[2], spec)
            pin_ops.setdefault(op_id, []).append((k, axes))
    return pin_ops
