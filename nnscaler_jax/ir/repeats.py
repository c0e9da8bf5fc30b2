"""Repeated layers that are the same program: what is worked out for one holds for its copies.

Two spans of a graph's top-level ops are copies when they run the same ops (primitive,
annotation, shapes, dtypes, module path below the layer's own, boundary kinds; control flow's
bodies by their length only) wired the same way: each input made by the same op of the span (by
position) or read from outside (the same outside tensors in the same order of first read; a
model input and a value made before the span alike), each output outliving the span (read after
it, or a graph output) alike. Whatever depends only on that (co-sharding's blocks, grown op by
op along the wiring) is found in the first copy and moved to the others by position.

>>> import jax.numpy as jnp, flax.linen as nn
>>> from nnscaler_jax import trace
>>> class Two(nn.Module):
...     @nn.compact
...     def __call__(self, x):
...         return jnp.tanh(jnp.tanh(x))
>>> g = trace(Two(), jnp.ones((4, 4)))
>>> span_key(g, 0, 0) == span_key(g, 1, 1)
True"""

from __future__ import annotations

from collections.abc import Hashable

from nnscaler_jax.ir.graph import Graph, Role

__all__ = ["span_key"]

_KEPT = (Role.VARIABLE, Role.CONST)  # an outside read's role that matters (else: a value)


def span_key(graph: Graph, first: int, last: int, prefix: str = "") -> Hashable:
    """A key equal for two spans ``graph.ops[first:last + 1]`` exactly when they are copies
    (see the module docs); module paths are compared below ``prefix`` (the span's layer)."""
    ops = graph.ops[first:last + 1]
    pos = {t.id: (i, k) for i, op in enumerate(ops) for k, t in enumerate(op.outputs)}
    ids = {op.id for op in ops}
    outer: dict[int, int] = {}  # tensors read from outside -> order of first read
    bounds: dict[int, int] = {}  # boundary ids -> order of first appearance
    kinds = {b.id: b.kind for b in graph.boundaries}
    outputs = {t.id for t in graph.outputs}
    key = []
    for op in ops:
        path = op.module_path
        if prefix and (path == prefix or path.startswith(prefix + "/")):
            path = path[len(prefix):]
        reads = tuple(
            (t.shape, str(t.dtype), t.role, pos[t.id]) if t.id in pos else
            (t.shape, str(t.dtype), t.role if t.role in _KEPT else Role.VALUE,
             outer.setdefault(t.id, len(outer)))
            for t in op.inputs)
        made = tuple(
            (t.shape, str(t.dtype), t.id in outputs or
             any(c.id not in ids for c in graph.consumers.get(t.id, ())))
            for t in op.outputs)
        key.append((op.primitive, op.anno, path, tuple(len(r.ops) for r in op.regions), reads,
                    made,
                    tuple((bounds.setdefault(b, len(bounds)), kinds.get(b))
                          for b in op.boundary)))
    return tuple(key)
