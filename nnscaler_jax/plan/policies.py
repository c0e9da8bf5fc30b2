"""Built-in policies written with the primitives: ``dp``, ``zero3``, ``megatron``.

Each is a plain function ``policy(graph, mesh) -> Plan`` over a :class:`~nnscaler_jax.primitives.
Draft`. They find "the batch dim" and "the attention-head / MLP-hidden dims" through dim classes
(:func:`nnscaler_jax.ir.dims.graph_dim_classes`): the batch class holds axis 0 of every example
argument; the tensor-parallel classes are the classes that are the output features of one weight
matmul and the contracted features of another, and are never reduced otherwise (layer norms
reduce the residual stream), so ``fc1``'s output features and ``fc2``'s input features split
together (column- then row-parallel), and so do the heads of the q / k / v / output projections.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from typing import Any

from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.anno import parse_anno
from nnscaler_jax.ir.dims import DimClasses, graph_dim_classes
from nnscaler_jax.ir.graph import Graph, Op, Role, Tensor
from nnscaler_jax.mesh.axes import MODEL_AXES, data_axes, model_axes
from nnscaler_jax.plan.plan import Plan, Unsplit
from nnscaler_jax.plan.zero import zero3_storage
from nnscaler_jax.primitives import Draft, op_assign, op_trans

__all__ = ["BATCH_INPUTS", "batch_dims", "batch_led", "batch_unsplit", "dp", "megatron", "zero3"]


def _ident_classes(op: Op, classes: DimClasses) -> dict[str, Any]:
    """Identifier of ``op``'s annotation -> its dim class (via the first operand holding it)."""
    anno = parse_anno(op.anno)
    out: dict[str, Any] = {}
    for operand, t in zip(anno.operands, op.inputs + op.outputs, strict=True):
        for i, ax in enumerate(operand.axes or ()):
            name = ax.dims[0].name
            c = classes.cls(t.id, i)
            if c is not None and name not in out:
                out[name] = c
    return out


def _split(graph: Draft, subs: list[Any], dim: str, axes: list[str]) -> list[Any]:
    """op_trans every sub-op along ``dim`` over each of ``axes`` that divides it, op_assign the
    pieces along that axis; an axis that does not divide it is noted (``Draft.note_unsplit``).
    Returns the new sub-ops."""
    op = subs[0].op if hasattr(subs[0], "op") else subs[0]
    anno = parse_anno(op.anno)
    size = anno.bind([t.shape for t in op.inputs], [t.shape for t in op.outputs])[dim]
    done = 1
    for a in axes:
        n = graph.mesh_axes[a]
        if n == 1:
            continue
        if size % (done * n):
            graph.note_unsplit(op, dim, a, size // done)
            continue
        new = []
        for sub in subs:
            pieces = op_trans(graph, sub, dim, n)
            op_assign(graph, pieces, a)
            new += pieces
        subs, done = new, done * n
    return subs


#: ``Graph.meta`` key: ids of the inputs other than example arguments that lead with the batch
#: (a pipeline stage's part of a graph reads the activations of the stages before it).
BATCH_INPUTS = "batch_inputs"


def _batch_classes(graph: Graph, classes: DimClasses) -> set:
    """The classes of axis 0 of the example arguments, frozen or not: an op that may not split
    its batch dim (a dropout mask drawn from an ``rbg`` key, whose bits change when split)
    reads it whole, and the rest of the batch class still splits (excluding frozen classes
    left such a model with no batch at all: ``dp`` replicated everything, and micro-batches
    did not bound the splits)."""
    out = set()
    led = graph.meta.get(BATCH_INPUTS, ()) if isinstance(graph.meta, dict) else ()
    for t in graph.inputs:
        if (t.role is Role.INPUT or t.id in led) and t.ndim >= 1:
            c = classes.cls(t.id, 0)
            if c is not None:
                out.add(c)
    return out


def _weight_tensors(graph: Draft) -> set[int]:
    """Ids of tensors computed from model variables and constants only (region bodies too)."""
    from nnscaler_jax.ir.regions import region_links

    weights = {t.id for t in graph.graph.variables}
    consts = {t.id for op in graph.graph.walk() for t in op.inputs if t.role is Role.CONST}
    for op in graph.graph.walk():
        if op.regions:
            for (outer, _), (inner, _) in region_links(op):
                if outer in weights:
                    weights.add(inner)
        elif op.inputs and all(t.id in weights or t.id in consts for t in op.inputs) and \
                any(t.id in weights for t in op.inputs):
            weights.update(t.id for t in op.outputs)
    return weights


def _tp_classes(graph: Draft, classes: DimClasses, batch: set) -> set:
    """Megatron's split dims: a class that is a free (output) dim of one weight matmul and the
    contracted dim of another (MLP hidden; attention heads), never reduced by anything but a
    matmul (which rules out the residual stream, normalised by layer norms). One per weight."""
    weights = _weight_tensors(graph)
    free_w: set = set()
    contracted_w: set = set()
    reduced: set = set()
    for op in graph.graph.walk():
        if not op.annotated or op.regions:
            continue
        anno = parse_anno(op.anno)
        idents = _ident_classes(op, classes)
        out_names = {n for o in anno.outputs for n in o.names()}
        is_dot = op.primitive in ("dot_general", "conv_general_dilated")
        weight_ops = [o for o, t in zip(anno.inputs, op.inputs, strict=True) if t.id in weights]
        for name in anno.kinds():
            c = idents.get(name)
            if c is None or name in out_names:
                if is_dot and weight_ops and c is not None and any(
                        name in o.names() for o in weight_ops):
                    free_w.add(c)
                continue
            if is_dot and weight_ops and any(name in o.names() for o in weight_ops):
                contracted_w.add(c)
            elif not is_dot:
                reduced.add(c)
    cand = (free_w & contracted_w) - reduced - batch - set(classes.frozen)
    # a weight with several candidates (no layer norm rules out the residual stream) takes the
    # one in the fewest weights: a layer's MLP hidden or heads live in that layer's weights,
    # the residual stream runs through every layer's (ties: in dim order); biases choose
    # nothing (a row-parallel layer's bias is in the stream, replicated)
    spread: dict = {}
    for t in graph.graph.variables:
        for c in {classes.cls(t.id, i) for i in range(t.ndim)} & cand:
            spread[c] = spread.get(c, 0) + 1
    chosen: set = set()
    for t in sorted(graph.graph.variables, key=lambda t: -t.ndim):
        if t.ndim < 2:
            break
        mine = [classes.cls(t.id, i) for i in range(t.ndim)]
        if any(c in chosen for c in mine):
            continue
        ours = [c for c in mine if c in cand]
        if ours:
            chosen.add(min(ours, key=lambda c: spread[c]))
    return chosen


def _plan_by_classes(graph: Draft, data: list[str], model: list[str]) -> None:
    classes = graph_dim_classes(graph.graph)
    batch = _batch_classes(graph.graph, classes) if data else set()
    tp = _tp_classes(graph, classes, batch) if model else set()
    for op in graph.graph.walk():
        if not op.annotated:
            continue
        idents = _ident_classes(op, classes)
        splittable = parse_anno(op.anno).splittable()
        subs_axes: list[tuple[str, list[str]]] = []
        for name in splittable:
            if idents.get(name) in batch:
                subs_axes.append((name, data))
                break
        for name in splittable:
            if idents.get(name) in tp and all(name != n for n, _ in subs_axes):
                subs_axes.append((name, model))
                break
        if not subs_axes:
            continue
        subs: list[Any] = [op]
        for name, axes in subs_axes:
            subs = _split(graph, subs, name, axes)


def dp(graph: Draft, mesh: Any) -> Plan:
    """Data parallel: split the batch over the data axes (all axes if none is named so)."""
    axes = data_axes(graph.mesh_axes) or list(graph.mesh_axes)
    graph.policy = graph.policy or "dp"
    _plan_by_classes(graph, axes, [])
    return graph.finish()


def zero3(graph: Draft, mesh: Any) -> Plan:
    """ZeRO-3: ``dp`` plus parameters (hence gradients and optimizer state) sharded over the
    data axes along their first divisible dim."""
    axes = data_axes(graph.mesh_axes) or list(graph.mesh_axes)
    graph.policy, graph.zero = graph.policy or "zero3", 3
    _plan_by_classes(graph, axes, [])
    return zero3_storage(graph.finish(), graph.graph, axes)


def megatron(graph: Draft, mesh: Any) -> Plan:
    """Megatron-LM tensor parallelism over the model axis (attention heads, MLP hidden: column-
    then row-parallel), data parallelism over the data axes."""
    model = model_axes(graph.mesh_axes)
    if not model:
        raise PlanError(f"megatron needs a model axis named one of {MODEL_AXES}; the mesh has "
                        f"{list(graph.mesh_axes)}. E.g. jax.make_mesh((2, 4), ('data', 'model')).")
    data = [a for a in data_axes(graph.mesh_axes) if a not in model]
    graph.policy = graph.policy or "megatron"
    _plan_by_classes(graph, data, model)
    return graph.finish()


_BATCH: dict[int, tuple[weakref.ref, tuple[DimClasses, set]]] = {}
_BATCH_DIMS: dict[int, tuple[weakref.ref, tuple[tuple[Op, str, int], ...]]] = {}


def _batch_of(graph: Graph) -> tuple[DimClasses, set]:
    """``graph``'s dim classes and its batch classes, computed once per graph."""
    hit = _BATCH.get(id(graph))
    if hit is not None and hit[0]() is graph:
        return hit[1]
    classes = graph_dim_classes(graph)
    out = (classes, _batch_classes(graph, classes))
    _BATCH[id(graph)] = (weakref.ref(graph), out)
    return out


def batch_dims(graph: Graph) -> tuple[tuple[Op, str, int], ...]:
    """Each op with a batch dim, that dim's name and size (the plan does not change them:
    computed once per graph, as a search prices many plans of one graph)."""
    hit = _BATCH_DIMS.get(id(graph))
    if hit is not None and hit[0]() is graph:
        return hit[1]
    classes, batch = _batch_of(graph)
    out = []
    for op in graph.walk() if batch else ():
        idents = _ident_classes(op, classes) if op.annotated else {}
        dim = next((n for n in parse_anno(op.anno).splittable() if idents.get(n) in batch),
                   None) if idents else None
        if dim is not None:
            out.append((op, dim, op.dim_sizes()[dim]))
    _BATCH_DIMS[id(graph)] = (weakref.ref(graph), tuple(out))
    return tuple(out)


def batch_led(graph: Graph, tensors: Iterable[Tensor]) -> tuple[int, ...]:
    """The ids of ``tensors`` (of ``graph``) whose leading axis is ``graph``'s batch (the class
    of axis 0 of its example arguments)."""
    classes, batch = _batch_of(graph)
    return tuple(t.id for t in tensors if t.ndim >= 1 and classes.cls(t.id, 0) in batch)


def batch_unsplit(graph: Graph, plan: Plan, axes: dict[str, int]) -> tuple[Unsplit, ...]:
    """The ops whose batch dim (the class of axis 0 of the example arguments) ``plan`` leaves
    unsplit over a data axis (of size > 1, unused by the op) that does not divide it (its
    per-shard size when other axes split it): what a search could not offer. Nothing without
    data axes."""
    data = [a for a in data_axes(axes) if axes[a] > 1]
    by_id = {p.op: p for p in plan.ops}
    out: list[Unsplit] = []
    for op, dim, size in batch_dims(graph) if data else ():
        split = by_id[op.id].split if op.id in by_id else ()
        ways = math.prod(axes[a] for a, d in split if d == dim)
        for a in data:
            if all(x != a for x, _ in split) and (size // ways) % axes[a]:
                out.append(Unsplit(op.id, op.primitive, op.module_path, dim, size // ways, a,
                                   axes[a]))
    return tuple(out)
