"""Split dims in words: what each ``(mesh axis, identifier)`` split of a plan is.

A plan records annotation identifiers only (``m0``, ``d1``: a plan holds no shapes). With the
graph it was made for, each identifier's dim class (:func:`nnscaler_jax.ir.dims.
graph_dim_classes`) is named from the graph:

- ``batch``: axis 0 of the example arguments; ``sequence``: axis 1 of integer (token) ones;
- ``heads``: the batch dims of a matmul inside an attention module (``attn``, ``attention``);
- ``vocab`` / ``hidden``: the axes of an ``embedding`` table;
- ``hidden`` (the model width) / ``mlp hidden``: the output features of one weight matmul that
  another contracts, reduced by something else (layer norms) or not (an MLP's inner dim);
- ``features`` / ``height``, ``width``, ``channels``: the other axes of float example arguments;

else ``dim i (size)``, the axis of the op's output that holds it. A split of a dim that leaves
the op's outputs reads ``... -> partial sums``.
"""

from __future__ import annotations

import re
from typing import Any

from nnscaler_jax.ir.anno import DimKind
from nnscaler_jax.ir.dims import graph_dim_classes
from nnscaler_jax.ir.graph import Graph, Op, Role

__all__ = ["VALUE", "dim_words"]

VALUE = "+"  # nnscaler_jax.plan.plan.VALUE (not imported: plan.py imports the views)
PlanLike = Any  # a Plan / OpPlan (duck-typed, as in nnscaler_jax.plan.view)
OpLike = Any



def _weights(graph: Graph) -> set[int]:
    """Tensors computed from variables (and constants) only: weights after casts and reshapes."""
    ids = {t.id for t in graph.variables}
    for op in graph.walk():
        ins = [t for t in op.inputs if t.role is not Role.CONST]
        if ins and all(t.id in ids for t in ins):
            ids.update(t.id for t in op.outputs)
    return ids


def _class_names(graph: Graph, classes: Any) -> dict[Any, str]:
    """A word per dim class that the graph gives a name: the example inputs' batch / sequence /
    features, attention heads, the embedding's vocab / hidden, the model width and MLP hidden
    dims (see :func:`_weight_classes`)."""
    names: dict[Any, str] = {}

    def claim(t: Any, axis: int, word: str) -> None:
        c = classes.cls(t.id, axis)
        if c is not None and c not in names:
            names[c] = word

    inputs = [t for t in graph.inputs if t.role is Role.INPUT and t.ndim >= 1]
    for t in inputs:
        claim(t, 0, "batch")
        if t.ndim == 2 and "int" in t.dtype:
            claim(t, 1, "sequence")
    ops = [op for op in graph.walk() if op.annotated and not op.regions]
    for op in ops:
        if op.primitive == "dot_general" and re.search(r"att", op.module_path, re.IGNORECASE):
            for name, t, i in _positions(op):
                if name.startswith("b"):
                    claim(t, i, "heads")
    for v in graph.variables:
        if v.name.rsplit("/", 1)[-1] == "embedding" and v.ndim == 2:
            claim(v, 0, "vocab")
            claim(v, 1, "hidden")
    for c, word in _weight_classes(graph, ops, classes).items():
        names.setdefault(c, word)
    for t in inputs:
        words = {2: ("features",), 3: ("sequence", "features"),
                 4: ("height", "width", "channels")}.get(t.ndim, ())
        for i, word in enumerate(words, start=1):
            claim(t, i, word)
    return names


def _weight_classes(graph: Graph, ops: list[Op], classes: Any) -> dict[Any, str]:
    """Classes that are the output features of one weight matmul and contracted by another:
    ``hidden`` (the model width) when something other than a matmul reduces them (layer
    norms), else ``mlp hidden`` (an MLP's inner dim, as Megatron splits it)."""
    weights = _weights(graph)
    free: set = set()
    contracted: set = set()
    reduced: set = set()
    for op in ops:
        dot = op.primitive in ("dot_general", "conv_general_dilated")
        anno = op.annotation
        out_names = {n for o in anno.outputs for n in o.names()}
        for name, t, i in _positions(op):
            c = classes.cls(t.id, i)
            if c is None or name in out_names or t in op.outputs:
                if dot and t.id in weights and name in out_names:
                    free.add(c)
                continue
            if dot and t.id in weights:
                contracted.add(c)
            elif not dot and anno.kinds().get(name) is DimKind.REDUCE:
                reduced.add(c)
    return {c: "hidden" if c in reduced else "mlp hidden" for c in free & contracted}


def _positions(op: Op) -> list[tuple[str, Any, int]]:
    """``(identifier, tensor, axis)`` for every splittable position of ``op``'s annotation."""
    anno = op.annotation
    return [(ax.dims[0].name, t, i)
            for operand, t in zip(anno.operands, op.inputs + op.outputs, strict=True)
            for i, ax in enumerate(operand.axes or ())]


def _word(op: Op, ident: str, classes: Any, names: dict[Any, str]) -> str:
    anno = op.annotation
    outs = [(t, operand) for operand, t in zip(anno.outputs, op.outputs, strict=True)]
    ins = [(t, operand) for operand, t in zip(anno.inputs, op.inputs, strict=True)]
    at = next(((t, o.axis_of(ident)) for t, o in outs + ins if o.axis_of(ident) is not None),
              None)
    if at is None:
        return ident
    t, axis = at
    size = t.shape[axis]
    word = names.get(classes.cls(t.id, axis))
    text = f"{word} ({size})" if word else f"dim {axis} ({size})"
    if all(o.axis_of(ident) is None for _, o in outs):
        text += " -> partial sums"
    return text


_DOT_ROLES = {"b": "matmul batch dim", "m": "matmul rows", "n": "matmul columns",
              "k": "contracted: partial sums"}


def _plain_word(op: OpLike, ident: str) -> str:
    """What the plan alone says of an identifier: itself, and its role in a matmul."""
    role = _DOT_ROLES.get(ident[:1]) if op.primitive == "dot_general" else None
    return f"{ident} ({role})" if role else ident


def dim_words(plan: PlanLike, graph: Graph | None = None) -> dict[tuple[int, str], str]:
    """``(op id, identifier) -> words`` for every split of ``plan``.

    With ``graph`` (the graph the plan was made for: ``pm.graph``), the identifier's dim class
    named from the graph (``'batch (8)'``, ``'heads (4)'``, ``'mlp hidden (128) -> partial
    sums'``, else ``'dim 2 (64)'``: the axis of the op's output holding it). Without, the
    identifier and, for a matmul, its role (``'n0 (matmul columns)'``): a plan does not record
    shapes. The value-split pseudo-identifier ``+`` is ``'partial sums'``.

    >>> from nnscaler_jax.plan.plan import OpPlan, Plan
    >>> plan = Plan((("model", 4),), "x", (OpPlan(0, "dot_general", "fc", (("model", "n0"),)),))
    >>> dim_words(plan)
    {(0, 'n0'): 'n0 (matmul columns)'}
    """
    out: dict[tuple[int, str], str] = {}
    by_id = {op.id: op for op in graph.walk()} if graph is not None else {}
    classes = graph_dim_classes(graph) if graph is not None else None
    names = _class_names(graph, classes) if graph is not None else {}
    for p in plan.ops:
        for _, ident in p.split:
            op = by_id.get(p.op)
            if ident == VALUE:
                out[(p.op, ident)] = "partial sums"
            elif op is None or not op.annotated or (op.primitive, op.module_path) != (
                    p.primitive, p.module_path):  # not the graph the plan was made for
                out[(p.op, ident)] = _plain_word(p, ident)
            else:
                out[(p.op, ident)] = _word(op, ident, classes, names)
    return out
