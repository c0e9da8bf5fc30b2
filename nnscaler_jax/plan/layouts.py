"""RVD layouts of every operand, derived from an op's annotation and its partition."""

from __future__ import annotations

from functools import lru_cache

from nnscaler_jax.ir.anno import DimKind, parse_anno
from nnscaler_jax.ir.graph import Op
from nnscaler_jax.layout import Layout
from nnscaler_jax.layout.rvd import interned
from nnscaler_jax.plan.plan import VALUE, OpPlan

__all__ = ["lift", "op_layouts", "partial_grad_axes", "plan_layouts", "scan_read_layouts",
           "scan_stored_inputs", "sole_read_variables", "split_for_layout", "unstack"]


@lru_cache(maxsize=65536)
def _layouts(anno_text: str, ranks: tuple[int, ...], n_in: int,
             split: tuple[tuple[str, str], ...]) -> tuple[Layout, ...]:
    anno = parse_anno(anno_text)
    kinds = anno.kinds()
    out = []
    for k, (operand, rank) in enumerate(zip(anno.operands, ranks, strict=True)):
        dims: list[list[str]] = [[] for _ in range(rank)]
        partial: list[str] = []
        if operand.axes is not None:
            for axis, name in split:
                if name == VALUE:
                    if k >= n_in:
                        partial.append(axis)
                    continue
                pos = operand.axis_of(name)
                if pos is not None:
                    dims[pos].append(axis)
                elif k >= n_in and kinds.get(name) is DimKind.REDUCE:
                    partial.append(axis)
        out.append(interned(Layout(tuple(tuple(d) for d in dims), tuple(partial))))
    return tuple(out)


def op_layouts(op: Op, plan: OpPlan | None) -> tuple[tuple[Layout, ...], tuple[Layout, ...]]:
    """(input layouts, output layouts) of ``op`` under ``plan`` (None: replicated).

    A split identifier makes the operands holding it dim-split (D) on that mesh axis; outputs
    lacking a split ``+`` identifier are partial sums (V); everything else is replicated (R).
    """
    split = plan.split if plan is not None else ()
    ranks = tuple([len(t.shape) for t in op.inputs] + [len(t.shape) for t in op.outputs])
    lays = _layouts(op.anno, ranks, len(op.inputs), split)
    return lays[: len(op.inputs)], lays[len(op.inputs):]


def split_for_layout(op: Op, operand: int, layout: Layout) -> tuple[tuple[str, str], ...] | None:
    """The partition of ``op`` under which operand ``operand`` (inputs first) has ``layout``.

    Returns None when the annotation cannot produce that layout (frozen or grouped dims).
    """
    anno = parse_anno(op.anno)
    spec = anno.operands[operand]
    if spec.axes is None:
        return () if not layout.split_axes else None
    names = set(anno.splittable())
    pairs = []
    for i, axes in enumerate(layout.dims):
        if not axes:
            continue
        ax = spec.axes[i]
        name = ax.dims[0].name
        if name not in names:
            return None
        pairs += [(a, name) for a in axes]
    return tuple(pairs)


def sole_read_variables(graph) -> frozenset[int]:
    """Ids of the variables exactly one op of ``graph`` reads (region bodies read theirs
    through their op's operands, so the top-level ``Graph.consumers`` hold every read)."""
    readers = graph.consumers
    return frozenset(t.id for t in graph.variables if len(readers.get(t.id, ())) == 1)


def scan_stored_inputs(op: Op, sole: frozenset[int]) -> dict[int, tuple[Op, int, bool]]:
    """The weights a ``scan`` reads for its body: input index -> (the body op that first reads
    the weight's per-iteration block, its operand index, stacked).

    Each such input is a top-level variable the scan alone reads (``sole``: see
    :func:`sole_read_variables`; an ``nn.scan`` stack's weights), passed as a const or a
    stacked input. It is stored, and read by the scan, the way that body op reads its block
    (the stacked leading length dim unsplit), not replicated: the scan does not relayout it.
    """
    if op.primitive != "scan":
        return {}
    (body,) = op.regions
    nc, ncarry = op.params["num_consts"], op.params["num_carry"]
    first: dict[int, tuple[Op, int]] = {}
    for bop in body.ops:
        for j, t in enumerate(bop.inputs):
            first.setdefault(t.id, (bop, j))
    out = {}
    for k, (outer, inner) in enumerate(zip(op.inputs, body.inputs, strict=True)):
        if nc <= k < nc + ncarry or outer.id not in sole or not inner.ndim:
            continue
        reader = first.get(inner.id)
        if reader is not None and not reader[0].regions:
            out[k] = (reader[0], reader[1], k >= nc + ncarry)
    return out


def lift(lay: Layout, stacked: bool) -> Layout:
    """A body block's layout as the layout of its outer tensor (stacked: an unsplit length dim
    in front; partial sums dropped: a read is never partial)."""
    return Layout((((),) if stacked else ()) + lay.dims)


def unstack(lay: Layout, stacked: bool) -> Layout:
    """The inverse of :func:`lift`: a stacked outer tensor's layout as its per-iteration
    block's (the leading length dim dropped)."""
    return Layout(lay.dims[1:], lay.partial) if stacked else lay


def scan_read_layouts(op: Op, plans, sole: frozenset[int]) -> dict[int, Layout]:
    """Input index -> the layout a ``scan`` reads that weight in (see
    :func:`scan_stored_inputs`), under ``plans`` (op id -> ``OpPlan``) of its body ops."""
    return {k: lift(op_layouts(bop, plans.get(bop.id))[0][j], stacked)
            for k, (bop, j, stacked) in scan_stored_inputs(op, sole).items()}


def plan_layouts(op: Op, plans, sole: frozenset[int] = frozenset()
                 ) -> tuple[tuple[Layout, ...], tuple[Layout, ...]]:
    """:func:`op_layouts` of ``op`` under ``plans`` (op id -> ``OpPlan``), where a ``scan``
    reads the weights of its body as its body ops do (:func:`scan_read_layouts`; ``sole``:
    :func:`sole_read_variables` of the graph)."""
    ins, outs = op_layouts(op, plans.get(op.id))
    if op.primitive == "scan" and sole:
        reads = scan_read_layouts(op, plans, sole)
        if reads:
            ins = tuple(reads.get(k, lay) for k, lay in enumerate(ins))
    return ins, outs


def partial_grad_axes(want: Layout, split: tuple[tuple[str, str], ...]) -> tuple[str, ...]:
    """Axes a consumer splits (by a dim) while reading the operand replicated: its gradient
    comes back as partial sums over them (the operand's data-parallel axes)."""
    used = set(want.split_axes) | set(want.partial)
    return tuple(dict.fromkeys(a for a, d in split if d != VALUE and a not in used))
