"""Undecided ops follow their neighbours: partition an op like the layout of its inputs."""

from __future__ import annotations

import math

from nnscaler_jax.ir.anno import parse_anno
from nnscaler_jax.ir.graph import Graph
from nnscaler_jax.layout import Layout
from nnscaler_jax.plan.layouts import op_layouts, split_for_layout
from nnscaler_jax.plan.plan import OpPlan

__all__ = ["propagate"]


def _divisible(op, split, mesh_axes) -> bool:
    anno = parse_anno(op.anno)
    sizes = anno.bind([t.shape for t in op.inputs], [t.shape for t in op.outputs])
    for name in {d for _, d in split}:
        ways = math.prod(mesh_axes[a] for a, d in split if d == name)
        if sizes.get(name, 0) % ways:
            return False
    return True


def propagate(graph: Graph, decisions: dict[int, OpPlan],
              mesh_axes: dict[str, int]) -> dict[int, OpPlan]:
    """Complete ``decisions`` with one ``OpPlan`` per op.

    An undecided op takes the partition under which its first input with a known, non-
    replicated layout keeps that layout (partial sums count as reduced); if none fits, it is
    replicated. Ops are visited in program order, region bodies after their op.
    """
    out = dict(decisions)
    ops = list(graph.walk())
    if all(op.id in out for op in ops):
        return out  # nothing to follow (a searched plan decides every op)
    known: dict[int, Layout] = {}
    for op in ops:
        if op.id not in out:
            split: tuple = ()
            for k, t in enumerate(op.inputs):
                lay = known.get(t.id)
                if lay is None or not lay.split_axes:
                    continue
                cand = split_for_layout(op, k, Layout(lay.dims))
                if cand and _divisible(op, cand, mesh_axes):
                    split = cand
                    break
            out[op.id] = OpPlan(op.id, op.primitive, op.module_path, split)
        _, outs = op_layouts(op, out[op.id])
        for t, lay in zip(op.outputs, outs, strict=True):
            known[t.id] = lay
    return out
