"""Region ops (``scan``, ``while``, ``cond``): which outer tensor axes hold the same data as
which body tensor axes, and which tensors are a weight carried into a body or cast."""

from __future__ import annotations

from collections.abc import Mapping

from nnscaler_jax.ir.graph import DataflowMemo, Graph, Op, Tensor, follow_weight

__all__ = ["region_links", "weight_origins"]

_MEMO = DataflowMemo(4)


def region_links(op: Op) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Pairs (outer tensor axis, body tensor axis) that hold the same data in a region op.

    Scan: consts and carries map axis to axis, stacked inputs / outputs skip their leading
    length axis. While: cond and body consts, carries. Cond: operands after the index and
    outputs, for every branch.
    """
    links: list[tuple[tuple[int, int], tuple[int, int]]] = []

    def tie(outer: Tensor, inner: Tensor, skip: int = 0) -> None:
        links.extend(((outer.id, i + skip), (inner.id, i)) for i in range(inner.ndim))

    p = op.params
    if op.primitive == "scan":
        (body,) = op.regions
        nc, ncarry = p["num_consts"], p["num_carry"]
        for k, (o, b) in enumerate(zip(op.inputs, body.inputs, strict=True)):
            tie(o, b, 0 if k < nc + ncarry else 1)
        for k, (o, b) in enumerate(zip(op.outputs, body.outputs, strict=True)):
            tie(o, b, 0 if k < ncarry else 1)
    elif op.primitive == "while":
        cond, body = op.regions
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        ins = list(op.inputs)
        for o, b in zip(ins[:cn], cond.inputs[:cn], strict=True):
            tie(o, b)
        for o, b in zip(ins[cn:cn + bn], body.inputs[:bn], strict=True):
            tie(o, b)
        for o, b in zip(ins[cn + bn:], body.inputs[bn:], strict=True):
            tie(o, b)
        for o, b in zip(op.outputs, body.outputs, strict=True):
            tie(o, b)
    elif op.primitive == "cond":
        for branch in op.regions:
            for o, b in zip(op.inputs[1:], branch.inputs, strict=True):
                tie(o, b)
            for o, b in zip(op.outputs, branch.outputs, strict=True):
                tie(o, b)
    return links


def weight_origins(graph: Graph) -> Mapping[int, int]:
    """Tensor id -> the id of the variable it is computed from alone: the variables, their
    casts and reshapes (:func:`~nnscaler_jax.ir.graph.follow_weight`) and a region body's
    inputs tied to them (:func:`region_links`), in program order. ZeRO's gradient axes and
    the cost model's storage and gradient pricing read it (once per dataflow)."""
    def build() -> Mapping[int, int]:
        origin = {v.id: v.id for v in graph.variables}
        for op in graph.walk():
            if not op.regions:
                follow_weight(op, origin)
                continue
            outer = {t.id for t in op.inputs}
            try:
                links = region_links(op)
            except ValueError:  # a body unlike its op's operands: its reads unseen
                links = []
            for (o, _i), (inner, _j) in links:
                if o in outer and o in origin:
                    origin.setdefault(inner, origin[o])
        return origin

    return _MEMO.get(graph, None, build)
