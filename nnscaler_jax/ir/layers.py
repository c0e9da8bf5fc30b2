"""A model's stack of repeated layers, found once for every user: the pipeline's stages
(:mod:`nnscaler_jax.pipeline.stages`) and the search's recompute groups.

A *layer stack* is either

- numbered modules ``<prefix>_0``, ``<prefix>_1``, ... among the top modules (the prefix with the
  most distinct numbers, at least two; any prefix, no model's names are special), or
- one ``nn.scan`` module whose variables carry a leading layer axis (``<module>[i]``).

>>> stack = variable_stack([("params/h_0/w", (4, 4)), ("params/h_1/w", (4, 4)),
...                         ("params/wte/embedding", (8, 4))])
>>> stack.names
('h_0', 'h_1')
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.graph import Graph

__all__ = ["LAYER_NAME", "GraphLayers", "LayerStack", "block_paths", "graph_layers",
           "layer_number", "numbered_layers", "variable_casts", "variable_stack", "variable_top"]

LAYER_NAME = re.compile(r"^(.*)_(\d+)$")
"""A numbered module name: ``<prefix>_<i>``."""

_COLLECTIONS = ("params", "batch_stats", "cache")
_HOW = ("layers named '<prefix>_0', '<prefix>_1', ... or one nn.scan over them")


@dataclass(frozen=True, slots=True)
class LayerStack:
    """A model's stack of repeated layers.

    Attributes:
        module: the prefix of the numbered layers, or the scanned module's name.
        numbers: the layer numbers, ascending (``0 .. count - 1`` for a scanned stack).
        scanned: one ``nn.scan`` module with a leading layer axis (else numbered modules).
    """

    module: str
    numbers: tuple[int, ...]
    scanned: bool = False

    @property
    def count(self) -> int:
        return len(self.numbers)

    @property
    def names(self) -> tuple[str, ...]:
        """``<prefix>_<i>`` per numbered layer, ``<module>[<i>]`` per scanned layer."""
        if self.scanned:
            return tuple(f"{self.module}[{i}]" for i in self.numbers)
        return tuple(f"{self.module}_{i}" for i in self.numbers)

    def number_of(self, top: str | None) -> int | None:
        """The layer number of top module ``top`` in this (numbered) stack, None if not one."""
        return layer_number(top, self.module)


def layer_number(top: str | None, prefix: str) -> int | None:
    """``i`` if ``top`` is ``<prefix>_<i>``, else None."""
    m = LAYER_NAME.match(top or "")
    return int(m.group(2)) if m and m.group(1) == prefix else None


def numbered_layers(tops: Iterable[str | None]) -> LayerStack | None:
    """The numbered stack among top module names (one per op, equation or variable; repeats
    and None are fine): the prefix with the most distinct numbers, the first seen on ties;
    None when no prefix has two."""
    groups: dict[str, set[int]] = {}
    for top in tops:
        m = LAYER_NAME.match(top or "")
        if m:
            groups.setdefault(m.group(1), set()).add(int(m.group(2)))
    best = max(groups, key=lambda k: len(groups[k]), default=None)
    if best is None or len(groups[best]) < 2:
        return None
    return LayerStack(best, tuple(sorted(groups[best])))


def variable_top(path: str) -> str | None:
    """The top module of a variable path (``params/h_3/attn/kernel`` -> ``h_3``)."""
    parts = [p for p in path.split("/") if p]
    if len(parts) > 1 and parts[0] in _COLLECTIONS:
        parts = parts[1:]
    return parts[0] if parts else None


def variable_stack(variables: Sequence[tuple[str, tuple[int, ...]]]) -> LayerStack:
    """The layer stack of a model from its variables ``(path, shape)``.

    Numbered top modules first; otherwise a stacked (``nn.scan``) top module: at least four
    variables, all sharing one leading dim ``n >= 2`` (the one with the most variables).

    Raises:
        PlanError: no layer stack.
    """
    tops: dict[str, list[tuple[int, ...]]] = {}
    for name, shape in variables:
        top = variable_top(name)
        if top:
            tops.setdefault(top, []).append(tuple(shape))
    stack = numbered_layers(tops)
    if stack is not None:
        return stack
    best: tuple[int, str, int] | None = None
    for top, shapes in tops.items():
        lead = {s[0] for s in shapes if s}
        stacked = len(lead) == 1 and all(shapes) and len(shapes) >= 4 and min(lead) >= 2
        if stacked and (best is None or len(shapes) > best[0]):
            best = (len(shapes), top, min(lead))
    if best is None:
        raise PlanError(f"no stack of repeated layers in the model (top modules "
                        f"{sorted(tops)[:12]}); stage splitting needs {_HOW}")
    return LayerStack(best[1], tuple(range(best[2])), scanned=True)


@dataclass(frozen=True, slots=True)
class GraphLayers:
    """Where a graph's layer stack is.

    Attributes:
        stack: the layers.
        bounds: ``(start, end)`` op ranges of ``graph.ops`` per numbered layer in program order
            (ops between two layers belong to the earlier one); a scanned stack:
            ``((k, k + 1),)``, the one ``scan`` op. The prefix is ``graph.ops[:start]``, the
            suffix ``graph.ops[end:]``.
        names: the layer of each range (numbered stacks; a scanned stack: ``stack.names``).
    """

    stack: LayerStack
    bounds: tuple[tuple[int, int], ...]
    names: tuple[str, ...]

    @property
    def start(self) -> int:
        return self.bounds[0][0]

    @property
    def end(self) -> int:
        return self.bounds[-1][1]


def variable_casts(graph: Graph) -> dict[int, int]:
    """Op id -> variable id of the ops casting a variable to the compute precision (a model
    captured at a precision casts every weight at the program's start, each op under its
    layer's module path)."""
    var_ids = {t.id for t in graph.variables}
    return {op.id: op.inputs[0].id for op in graph.ops
            if op.primitive == "convert_element_type" and len(op.inputs) == 1
            and op.inputs[0].id in var_ids}


def graph_layers(graph: Graph) -> GraphLayers:
    """The layer stack of a traced graph: numbered top modules (ops' module paths) first,
    otherwise the one top-level ``scan`` reading variables. A layer's ops run from its first
    op that is not a weight's precision cast (:func:`variable_casts`: those come first, in
    the parameters' order, and belong with what reads them).

    Raises:
        PlanError: no repeated layer stack.
    """
    casts = variable_casts(graph)  # (a precision's casts of every weight come first)
    tops = ["" if op.id in casts else op.module_path.split("/")[0] for op in graph.ops]
    stack = numbered_layers(tops)
    if stack is not None:
        at = [(i, stack.number_of(t)) for i, t in enumerate(tops)]
        starts: dict[int, int] = {}
        for i, n in at:
            if n is not None:
                starts.setdefault(n, i)
        last = max(i for i, n in at if n is not None)
        firsts = sorted(starts.values())
        bounds = tuple(zip(firsts, firsts[1:] + [last + 1], strict=True))
        return GraphLayers(stack, bounds, tuple(tops[a] for a, _ in bounds))
    variables = {t.id: t for t in graph.variables}
    scans = [i for i, op in enumerate(graph.ops) if op.regions and op.primitive == "scan"
             and any(t.id in variables for t in op.inputs)]
    if len(scans) != 1:
        raise PlanError(f"no stack of repeated layers in the graph (module paths "
                        f"{sorted(set(tops))[:12]}); it needs {_HOW}")
    k = scans[0]
    op = graph.ops[k]
    name = tops[k] or next(variable_top(t.name) for t in op.inputs if t.id in variables)
    length = int(op.params.get("length", 1))
    stack = LayerStack(name or "", tuple(range(length)), scanned=True)
    return GraphLayers(stack, ((k, k + 1),), stack.names)


def block_paths(module_paths: Iterable[str]) -> list[str]:
    """The model's repeated blocks at their finest level, in program order: the elements of
    every numbered stack of modules that have sub-modules, looking inside an element that
    holds a stack of its own (Swin's ``layers_2/blocks_7``) and inside unnumbered modules
    (T5's ``encoder/block_3``); leaf modules (``Dense_0``, ``Dense_1``) are never blocks.

    >>> block_paths(["enc/block_0/attn", "enc/block_1/mlp", "enc/norm", "head/Dense_0",
    ...              "head/Dense_1"])
    ['enc/block_0', 'enc/block_1']
    """
    return _blocks("", [p.split("/") for p in dict.fromkeys(module_paths) if p])


def _blocks(prefix: str, parts: list[list[str]]) -> list[str]:
    children = list(dict.fromkeys(p[0] for p in parts))
    deep = {p[0] for p in parts if len(p) > 1}
    stack = numbered_layers(c for c in children if c in deep)
    out: list[str] = []
    for c in children:
        path = f"{prefix}/{c}" if prefix else c
        sub = [p[1:] for p in parts if p[0] == c and len(p) > 1]
        inner = _blocks(path, sub) if sub else []
        if stack is not None and stack.number_of(c) is not None:
            out += inner if len(inner) > 1 else [path]
        else:
            out += inner
    return out
