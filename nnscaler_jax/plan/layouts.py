"""RVD layouts of every operand, derived from an op's annotation and its partition."""

from __future__ import annotations

from functools import lru_cache

from nnscaler_jax.ir.anno import DimKind, parse_anno
from nnscaler_jax.ir.graph import Op
from nnscaler_jax.layout import Layout
from nnscaler_jax.plan.plan import VALUE, OpPlan

__all__ = ["op_layouts", "split_for_layout"]


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
        out.append(Layout(tuple(tuple(d) for d in dims), tuple(partial)))
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
