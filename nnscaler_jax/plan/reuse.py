"""Reusing a saved plan: the same model, and splits that divide this graph's sizes.

A plan's fingerprint (:func:`~nnscaler_jax.plan.plan.graph_fingerprint`) hashes the graph's
structure, not its sizes, so a plan made at batch 8 applies at batch 16 (or another sequence
length) wherever its splits still divide. :func:`check_reuse` checks the mesh shape and the
structure (:meth:`~nnscaler_jax.plan.plan.Plan.check_graph`, saying what differs), then the sizes:
every op's split (several mesh axes on one identifier multiply, and so do co-sharding chunks),
every variable's storage spec and the pipeline's micro-batch count.
"""

from __future__ import annotations

import math
from typing import Any

from nnscaler_jax.errors import PlanFormatError
from nnscaler_jax.ir.anno import parse_anno
from nnscaler_jax.ir.graph import Graph, Op, Role
from nnscaler_jax.plan.plan import VALUE, OpPlan, Plan

__all__ = ["check_reuse"]

REPLAN = "re-plan for these inputs (policy=... or make_plan() without plan=)"


def check_reuse(plan: Plan, graph: Graph, mesh_axes: dict[str, int]) -> None:
    """Raise ``PlanFormatError`` unless ``plan`` applies to ``graph`` on ``mesh_axes``: the
    same mesh shape and model (:meth:`Plan.check_graph`), and every split, stored variable and
    the pipeline's micro-batch count divides this graph's sizes."""
    plan.check_graph(graph, mesh_axes)
    ops = {op.id: op for op in graph.walk()}
    for p in plan.ops:
        if p.split or p.chunks:
            _check_op(ops[p.op], p, mesh_axes)
    _check_variables(plan, graph, mesh_axes)
    _check_microbatches(plan, graph)


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
                            f"'{op.anno}' does not let it split", f"Re-plan: {REPLAN}")
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
            if axes and (i >= len(shape) or shape[i] % ways):
                size = shape[i] if i < len(shape) else "missing"
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
