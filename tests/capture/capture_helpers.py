"""Helpers for the capture tests (a uniquely named module, imported by the tests)."""

from __future__ import annotations

import string

from nnscaler_jax.ir.anno import Anno, Axis, Dim, Operand, parse_anno
from nnscaler_jax.ir.graph import Graph, Op


def canon(anno: str | Anno) -> str:
    """The annotation with identifiers renamed a, b, c... in order of first appearance."""
    a = parse_anno(anno) if isinstance(anno, str) else anno
    fresh = iter(string.ascii_lowercase)
    names: dict[str, str] = {}

    def dim(d: Dim) -> Dim:
        if d.fixed is not None:
            return d
        if d.name not in names:
            names[d.name] = next(fresh)
        return Dim(names[d.name], d.kind)

    def operand(o: Operand) -> Operand:
        if o.axes is None:
            return o
        return Operand(tuple(Axis(tuple(dim(d) for d in ax.dims)) for ax in o.axes))

    return str(Anno(tuple(map(operand, a.inputs)), tuple(map(operand, a.outputs))))


def check_annotations_bind(graph: Graph) -> None:
    """Every op's annotation parses and binds to its tensors' shapes (regions included)."""
    for op in graph.walk():
        shapes = lambda ts: [t.shape for t in ts]
        try:
            op.annotation.bind(shapes(op.inputs), shapes(op.outputs))
        except Exception as e:
            raise AssertionError(f"annotation of {op} does not bind: {e}") from e


def unannotated(graph: Graph) -> list[str]:
    """``primitive @module_path in [shapes] -> [shapes]`` of every op without a rule."""
    return sorted({
        f"{op.primitive} @{op.module_path or '<top>'} params={dict(op.params)} "
        f"in={[t.shape for t in op.inputs]} out={[t.shape for t in op.outputs]}"
        for op in graph.walk() if not op.annotated
    })


def ops_of(graph: Graph, primitive: str) -> list[Op]:
    return [op for op in graph.walk() if op.primitive == primitive]


