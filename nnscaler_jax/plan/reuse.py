"""Reusing a saved plan: the same model, and splits that divide this graph's sizes.

A plan's fingerprint (:func:`~nnscaler_jax.plan.plan.graph_fingerprint`) hashes the graph's
structure, not its sizes, so a plan made at batch 8 applies at batch 16 (or another sequence
length) wherever its splits still divide. :func:`check_reuse` checks the mesh shape and the
structure (:meth:`~nnscaler_jax.plan.plan.Plan.check_graph`, saying what differs), then the sizes:
every op's split (several mesh axes on one identifier multiply, and so do co-sharding chunks),
every variable's storage spec and the pipeline's micro-batch count.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from typing import Any

from nnscaler_jax.errors import PlanError, PlanFormatError
from nnscaler_jax.ir.anno import parse_anno
from nnscaler_jax.ir.attention import fusable_blocks, with_fused_attention
from nnscaler_jax.ir.coshard import block_of
from nnscaler_jax.ir.graph import Graph, Op, Role
from nnscaler_jax.plan.plan import VALUE, OpPlan, Plan, graph_fingerprint

__all__ = ["check_reuse", "module_part", "renumbered", "saved_plan"]

REPLAN = "re-plan for these inputs (policy=... or make_plan() without plan=)"


def module_part(plan: Plan, graph: Graph) -> Plan | None:
    """A training step's plan (``pm.train_step``'s: the module and its loss as one graph) as a
    plan of the module's own call ``graph`` (``init``, ``apply``): the step's graph begins with
    the module's ops, in the same order, primitives and module paths (their ids shift by the
    loss's own inputs), so the plan's first ops, renumbered, are the module's. None when
    ``graph`` is not such a part of the plan's graph, or the variables differ."""
    return _renumbered(plan, graph, prefix=True)


def renumbered(plan: Plan, graph: Graph) -> Plan | None:
    """``plan`` of another graph of the same ops (primitives and module paths, in the same
    order within each module, its variables named alike: the same program traced again, e.g.
    at another batch size) as a plan of ``graph``; None when ``graph`` is not such a graph.
    ``graph`` may have more ops (a module's plan on a graph with its loss): they keep no
    plan (whole on every device, as the lowering runs an op without one)."""
    return _renumbered(plan, graph, prefix=False)


def _renumbered(plan: Plan, graph: Graph, prefix: bool) -> Plan | None:
    fingerprint = graph_fingerprint(graph)
    if plan.fused_attention:  # the plan's blocks fused: this graph's too, to match them
        graph = with_fused_attention(graph, fusable_blocks(graph))
    ops = list(graph.walk())
    if prefix:
        if len(ops) >= len(plan.ops) or any(
                (p.primitive, p.module_path) != (op.primitive, op.module_path)
                for p, op in zip(plan.ops, ops, strict=False)):
            return None
        ids = {p.op: op.id for p, op in zip(plan.ops, ops, strict=False)}
    else:  # (the same ops, perhaps in another topological order: matched per module)
        mine = dict(zip(_occurrences(ops), ops, strict=True))
        theirs = _occurrences(plan.ops)
        if not set(theirs) <= set(mine):
            return None
        ids = {p.op: mine[k].id for k, p in zip(theirs, plan.ops, strict=True)}
    if not {n for n, _ in plan.variables} <= {t.name for t in graph.variables}:
        return None
    return replace(plan, fingerprint=fingerprint,
                   ops=tuple(replace(p, op=ids[p.op]) for p in plan.ops[:len(ops)]),
                   order=tuple((ids[a], ids[b]) for a, b in plan.order
                               if a in ids and b in ids),
                   coshard=tuple((ids[c[0]], *c[1:]) for c in plan.coshard if c[0] in ids),
                   fused_attention=tuple(ids[i] for i in plan.fused_attention if i in ids),
                   ring_layouts=tuple((ids[i], x) for i, x in plan.ring_layouts if i in ids),
                   cost=None if prefix else plan.cost)


def _occurrences(ops: list[Any]) -> list[tuple[str, str, int]]:
    """Per op, ``(module path, primitive, how many such ops of its module came before)``."""
    seen: dict[tuple[str, str], int] = {}
    out = []
    for op in ops:
        key = (op.module_path, op.primitive)
        out.append((*key, seen.get(key, 0)))
        seen[key] = seen.get(key, 0) + 1
    return out


def check_reuse(plan: Plan, graph: Graph, mesh_axes: dict[str, int]) -> None:
    """Raise ``PlanFormatError`` unless ``plan`` applies to ``graph`` on ``mesh_axes``: the
    same mesh shape and model (:meth:`Plan.check_graph`), and every split, stored variable and
    the pipeline's micro-batch count divides this graph's sizes."""
    plan.check_graph(graph, mesh_axes)
    try:
        graph = with_fused_attention(graph, plan.fused_attention, dict(plan.ring_layouts))
    except PlanError as e:
        raise _corrupted(str(e)) from None
    ops = {op.id: op for op in graph.walk()}
    _check_entries(plan, graph, ops, mesh_axes)
    for p in plan.ops:
        if p.split or p.chunks:
            _check_op(ops[p.op], p, mesh_axes)
    _check_variables(plan, graph, mesh_axes)
    _check_microbatches(plan, graph)
    _check_coshard(plan, graph)


def _check_coshard(plan: Plan, graph: Graph) -> None:
    """Every co-sharded block grows from an op of this graph along a dim it can run in
    chunks, and its chunk count divides that dim here."""
    for seed, dim, k in plan.coshard:
        try:
            block = block_of(graph, seed, dim)
        except PlanError as e:
            raise _corrupted(str(e).removeprefix("co-sharding: ")) from None
        if k < 2 or block.size % k:
            op = next(o for o in graph.ops if o.id == seed)
            raise PlanFormatError(
                f"the plan co-shards the block at '{op.module_path or '<top>'}' (op {seed} "
                f"'{op.primitive}') in {k} chunks along '{dim}', of size {block.size} in this "
                f"graph: {k} does not divide it. {REPLAN[0].upper()}{REPLAN[1:]}",
                op=op.primitive, module_path=op.module_path)


def _corrupted(what: str, **fields: Any) -> PlanFormatError:
    return PlanFormatError(f"saved plan is corrupted: {what}. It is not the Plan.to_json() "
                           "of a plan for this model (edited by hand?). "
                           f"{REPLAN[0].upper()}{REPLAN[1:]}", **fields)


def _check_entries(plan: Plan, graph: Graph, ops: dict[int, Op],
                   mesh_axes: dict[str, int]) -> None:
    """Raise ``PlanFormatError`` for entries no plan of this graph has (a plan JSON edited by
    hand, or pieced together from several): unknown op ids, ops listed twice or under another
    primitive / module path, splits over mesh axes the mesh lacks (or one axis twice), chunk
    counts below 1, variables the graph lacks, order pairs of unknown ops, a ZeRO stage outside
    0-3, pipeline settings that are not positive."""
    seen: set[int] = set()
    for p in plan.ops:
        op = ops.get(p.op)
        if op is None:
            raise _corrupted(f"op {p.op} ('{p.primitive}' at '{p.module_path or '<top>'}') is "
                             f"not an op of this graph (ids {min(ops, default=0)}.."
                             f"{max(ops, default=0)})", op=p.primitive,
                             module_path=p.module_path)
        if p.op in seen:
            raise _corrupted(f"op {p.op} is listed twice", op=op.primitive,
                             module_path=op.module_path)
        seen.add(p.op)
        if (p.primitive, p.module_path) != (op.primitive, op.module_path):
            raise _corrupted(f"op {p.op} is '{p.primitive}' at '{p.module_path or '<top>'}' in "
                             f"the plan, '{op.primitive}' at '{op.module_path or '<top>'}' in "
                             "this graph", op=op.primitive, module_path=op.module_path)
        axes = [a for a, _ in p.split]
        for a in axes:
            if a not in mesh_axes:
                raise _corrupted(f"op {p.op} '{op.primitive}' at '{op.module_path or '<top>'}' "
                                 f"is split over mesh axis '{a}', which the mesh {mesh_axes} "
                                 "lacks", op=op.primitive, module_path=op.module_path, axis=a)
            if axes.count(a) > 1:
                raise _corrupted(f"op {p.op} '{op.primitive}' at '{op.module_path or '<top>'}' "
                                 f"is split over mesh axis '{a}' twice ({list(p.split)})",
                                 op=op.primitive, module_path=op.module_path, axis=a)
        if p.chunks and p.chunks[1] < 1:
            raise _corrupted(f"op {p.op} '{op.primitive}' at '{op.module_path or '<top>'}' runs "
                             f"in {p.chunks[1]} chunks", op=op.primitive,
                             module_path=op.module_path)
    names = {t.name for t in graph.variables}
    for name, spec in plan.variables:
        if name not in names:
            raise _corrupted(f"variable '{name}' is not a variable of this model")
        for e in spec:
            for a in (e,) if isinstance(e, str) else tuple(e or ()):
                if a not in mesh_axes:
                    raise _corrupted(f"variable '{name}' is stored split over mesh axis '{a}', "
                                     f"which the mesh {mesh_axes} lacks", axis=a)
    for a, b in plan.order:
        if a not in ops or b not in ops:
            raise _corrupted(f"the op order ({a}, {b}) names an op this graph lacks")
    if plan.zero not in (0, 1, 2, 3):
        raise _corrupted(f"ZeRO stage {plan.zero} (0, 1, 2 or 3)")
    pipe = plan.pipeline
    if pipe is not None and min(pipe.stages, pipe.microbatches, pipe.virtual) < 1:
        raise _corrupted(f"pipeline of {pipe.stages} stages, {pipe.microbatches} micro-batches "
                         f"and {pipe.virtual} chunks per stage (each at least 1)")


def _check_op(op: Op, p: OpPlan, mesh_axes: dict[str, int]) -> None:
    """Every dim ``p`` splits is still splittable in ``op``'s annotation and divides."""
    anno = parse_anno(op.anno)
    sizes = anno.bind([t.shape for t in op.inputs], [t.shape for t in op.outputs],
                      op=op.primitive, module_path=op.module_path)
    axes_of: dict[str, list[str]] = {}
    for a, d in p.split:
        if d != VALUE:
            axes_of.setdefault(d, []).append(a)
    if p.chunks:
        axes_of.setdefault(p.chunks[0], [])
    for d, axes in axes_of.items():
        k = p.chunks[1] if p.chunks and p.chunks[0] == d else 1
        ways = math.prod(mesh_axes[a] for a in axes) * k
        if d not in anno.splittable():
            raise _op_error(op, axes, f"splits dim '{d}', which this graph's annotation "
                            f"'{op.anno}' does not let it split", f"{REPLAN[0].upper()}{REPLAN[1:]}")
        if sizes[d] % ways:
            over = " x ".join([f"'{a}' ({mesh_axes[a]})" for a in axes] +
                              ([f"{k} chunks"] if k > 1 else []))
            over += f" = {ways} ways" if len(axes) + (k > 1) > 1 else ""
            lo = sizes[d] // ways * ways
            near = f"{lo} or {lo + ways}" if lo else f"{ways}"
            raise _op_error(
                op, axes, f"splits dim '{d}' ({_where(op, anno, d)}) over mesh axis {over}, "
                f"but its size here is {sizes[d]}, which {ways} does not divide",
                f"Either {REPLAN}, or use a size that {ways} divides (e.g. {near})")


def _where(op: Op, anno: Any, dim: str) -> str:
    """'axis 0 of input 0 (6, 16)': where identifier ``dim`` sits in ``op``'s operands."""
    tensors = op.inputs + op.outputs
    for k, operand in enumerate(anno.operands):
        i = operand.axis_of(dim)
        if i is not None:
            kind, j = ("input", k) if k < len(op.inputs) else ("output", k - len(op.inputs))
            return f"axis {i} of {kind} {j}, shape {tensors[k].shape}"
    return "not in its operands"


def _op_error(op: Op, axes: list[str], what: str, fix: str) -> PlanFormatError:
    return PlanFormatError(
        f"saved plan: op {op.id} '{op.primitive}' at '{op.module_path or '<top>'}' {what}. {fix}",
        op=op.primitive, module_path=op.module_path, axis=",".join(axes) or None,
        shapes=tuple(t.shape for t in op.inputs))


def _check_variables(plan: Plan, graph: Graph, mesh_axes: dict[str, int]) -> None:
    shapes = {t.name: t.shape for t in graph.variables}
    for name, spec in plan.variables:
        shape = shapes.get(name)
        for i, e in enumerate(spec if shape is not None else ()):
            axes = (e,) if isinstance(e, str) else tuple(e or ())
            ways = math.prod(mesh_axes.get(a, 1) for a in axes)
            if axes and i >= len(shape):
                raise _corrupted(f"variable '{name}' of shape {shape} is stored with dim {i} "
                                 f"split over mesh axes {list(axes)}, but it has {len(shape)} "
                                 "dims", axis=",".join(axes), shapes=(shape,))
            if axes and shape[i] % ways:
                size = shape[i]
                raise PlanFormatError(
                    f"saved plan: variable '{name}' of shape {shape} is stored with dim {i} "
                    f"split over mesh axes {list(axes)} ({ways} ways), but that dim's size here "
                    f"is {size}, which {ways} does not divide. {REPLAN[0].upper()}{REPLAN[1:]}",
                    axis=",".join(axes), shapes=(shape,))


def _check_microbatches(plan: Plan, graph: Graph) -> None:
    m = plan.pipeline.microbatches if plan.pipeline is not None else 1
    batch = next((t.shape[0] for t in graph.inputs if t.role is Role.INPUT and t.shape), None)
    if m > 1 and batch is not None and batch % m:
        raise PlanFormatError(
            f"saved plan: the pipeline splits the batch into {m} micro-batches, but the batch "
            f"here is {batch}, which {m} does not divide. Use a batch {m} divides, or {REPLAN}",
            shapes=tuple(t.shape for t in graph.inputs if t.role is Role.INPUT))


def saved_plan(plan: Any) -> Plan | None:
    """A ``Plan`` from what ``auto_parallel(plan=...)`` accepts: a Plan, its JSON text, that
    text parsed as a dict, or the path of a file holding it."""
    if plan is None or isinstance(plan, Plan):
        return plan
    if isinstance(plan, dict):
        plan = json.dumps(plan)
    if isinstance(plan, os.PathLike) or (isinstance(plan, str)
                                         and not plan.lstrip().startswith("{")):
        try:
            with open(plan, encoding="utf-8") as f:
                plan = f.read()
        except OSError as e:
            raise PlanFormatError(f"auto_parallel(plan={str(plan)!r}): not JSON text and no "
                                  f"readable file ({e.strerror}); pass a Plan, its to_json() "
                                  "text, that text as a dict or a path to a saved plan") from e
    if isinstance(plan, str | bytes):
        return Plan.from_json(plan)
    raise PlanFormatError(f"auto_parallel(plan=...) takes a Plan, its to_json() text, that "
                          f"text parsed as a dict or a path to a saved plan, got "
                          f"{type(plan).__name__}")
