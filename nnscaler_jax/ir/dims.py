"""Dimension classes: tensor axes that annotations tie together across ops.

Two tensor axes are in one class when some op's annotation gives them the same identifier (as the
first, splittable member of their axis). Classes answer "which axes split together": the batch dim
of the input and every activation derived from it, the hidden dim of an MLP across ``fc1`` and
``fc2``. They compose the annotation of a control-flow region from its body and drive the
built-in policies.
"""

from __future__ import annotations

import itertools
import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from nnscaler_jax.ir.anno import Anno, DimKind, parse_anno

__all__ = ["DimClasses", "compose_anno", "dim_classes", "graph_dim_classes"]

AxisKey = tuple[int, int]  # (tensor id, axis index)


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[AxisKey, AxisKey] = {}

    def find(self, x: AxisKey) -> AxisKey:
        self.parent.setdefault(x, x)
        root = x
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[x] != root:
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a: AxisKey, b: AxisKey) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


@dataclass(frozen=True)
class DimClasses:
    """Classes of tensor axes.

    Attributes:
        of: (tensor id, axis) -> class id (the smallest member key).
        frozen: classes some op forbids splitting (frozen, fixed, grouped non-first, reduced).
    """

    of: dict[AxisKey, AxisKey]
    frozen: frozenset[AxisKey]

    def cls(self, tensor_id: int, axis: int) -> AxisKey | None:
        return self.of.get((tensor_id, axis))

    def members(self, c: AxisKey) -> list[AxisKey]:
        return [k for k, v in self.of.items() if v == c]


def _op_positions(anno: Anno, tensors: Sequence) -> Iterable[tuple[str, DimKind, AxisKey, bool]]:
    """(identifier, kind, (tensor id, axis), is first member of its axis) per annotated axis."""
    for operand, t in zip(anno.operands, tensors):
        if operand.axes is None or t is None:
            continue
        for i, ax in enumerate(operand.axes):
            for j, d in enumerate(ax.dims):
                yield d.name, d.kind, (t.id, i), j == 0 and len(ax.dims) == 1


def dim_classes(ops: Iterable, extra_unions: Iterable[tuple[AxisKey, AxisKey]] = (),
                *, reduce_frozen: bool = True) -> DimClasses:
    """Union tensor axes that share an identifier in some op's annotation.

    Args:
        ops: ``Op`` values (anything with ``anno``, ``annotated``, ``inputs``, ``outputs``).
        extra_unions: more pairs of axes to tie (e.g. a loop's carry in and out).
    """
    uf = _UnionFind()
    frozen_keys: set[AxisKey] = set()
    for op in ops:
        tensors = list(op.inputs) + list(op.outputs)
        if not op.annotated:
            for t in tensors:
                for i in range(t.ndim):
                    frozen_keys.add((t.id, i))
            continue
        anno = parse_anno(op.anno)
        by_name: dict[str, AxisKey] = {}
        out_names = {n for o in anno.outputs for n in o.names()}
        for name, kind, key, single in _op_positions(anno, tensors):
            uf.find(key)
            if not single or kind is DimKind.FROZEN or name.isdigit():
                frozen_keys.add(key)
                continue
            if reduce_frozen and kind is DimKind.REDUCE and name not in out_names:
                frozen_keys.add(key)  # splitting it inside a region would leave partial sums
            if name in by_name:
                uf.union(by_name[name], key)
            else:
                by_name[name] = key
    for a, b in extra_unions:
        uf.union(a, b)
    of = {k: uf.find(k) for k in list(uf.parent)}
    return DimClasses(of, frozenset(of[k] for k in frozen_keys if k in of))


def _names() -> Iterable[str]:
    for n in itertools.count(1):
        for combo in itertools.product(string.ascii_lowercase, repeat=n):
            yield "".join(combo)


def compose_anno(
    classes: DimClasses,
    inputs: Sequence[tuple[AxisKey | None, ...] | None],
    outputs: Sequence[tuple[AxisKey | None, ...] | None],
) -> str:
    """The annotation of a region from the classes of its operands' axes.

    Args:
        classes: classes over the region body.
        inputs / outputs: per operand, per axis, the body axis key it maps to (``None`` for an
            axis with no body counterpart, e.g. a scan's length axis, which is frozen), or
            ``None`` for a replicate-only operand.

    Returns:
        An annotation string where axes of one splittable class share an identifier.
    """
    fresh = _names()
    names: dict[AxisKey, str] = {}

    def dim(key: AxisKey | None) -> str:
        if key is None:
            return next(fresh) + "^"
        c = classes.of.get(key, key)
        if c not in names:
            names[c] = next(fresh)
        return names[c] + ("^" if c in classes.frozen else "")

    def operand(axes: tuple[AxisKey | None, ...] | None) -> str:
        if axes is None:
            return "?"
        return " ".join(dim(k) for k in axes) if axes else "()"

    ins = ", ".join(operand(a) for a in inputs)
    outs = ", ".join(operand(a) for a in outputs)
    return f"{ins} -> {outs}"


def graph_dim_classes(graph, *, reduce_frozen: bool = False) -> DimClasses:
    """Dim classes over a whole graph, region bodies tied to their ops' operands.

    Args:
        graph: the graph.
        reduce_frozen: treat ``+`` dims absent from the outputs as frozen (True when composing
            a region; False for policies, which may split reductions into partial sums).
    """
    from nnscaler_jax.ir.regions import region_links

    ops = list(graph.walk())
    links = [pair for op in ops if op.regions for pair in region_links(op)]
    # A region op's own (composed, coarse) annotation is not used: its body ops, tied to its
    # operands by the links, say precisely how each axis may split.
    plain = [op for op in ops if not op.regions]
    return dim_classes(plain, links, reduce_frozen=reduce_frozen)
