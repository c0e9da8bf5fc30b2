"""Relayouts lowered along the cost model's own collective path, one step per constraint.

Given one sharding constraint after another, XLA's SPMD partitioner must find its own way from
the first sharding to the second. For a change of several mesh axes at once (a dim split over
``(data, model)`` read split over ``data`` on another dim, a split moved to another dim while a
new axis splits the first) it often finds none, and falls back to "Involuntary full
rematerialization": every device gathers the whole tensor and slices it again, which is slower
and holds memory the plan did not count.

The plan priced each relayout as the cheapest path of :func:`nnscaler_jax.layout.comm_path`:
one collective over one mesh axis (or one group of axes) per step. :func:`relayout_steps` turns
that path into the layouts the lowering constrains the value to, in order, so XLA only ever
takes one step at a time (each step is a collective it emits directly: all-gather, all-to-all,
reduce-scatter, all-reduce, or a local slice), and what runs is what was priced.

The backward pass is priced too: the gradient a consumer hands back
(:func:`nnscaler_jax.cost.relayout.grad_source`: partial sums over the axes it splits but reads
the operand replicated on) goes the cheapest path to the producer's layout. The transpose of a
sharding constraint is the same constraint on the cotangent, so plain constraints would reduce
the gradient to the consumer's layout first and walk the forward path back (an all-reduce and a
slice where a reduce-scatter was priced, e.g. a ZeRO-3 weight read replicated by a
data-parallel op). Where the two differ, :func:`constrain_along` gives the relayout a custom JVP
whose tangent passes the backward path's layouts in reverse: transposed, the cotangent takes
:func:`backward_steps` in order (forward-mode differentiation still works; elsewhere the plain
constraints already take the priced path back).

Partial sums cannot be written as a sharding (``Layout.to_pspec``): a value holding them is
reduced by the constraint on its producer's output, which is the first layout of the path
without partial sums (:func:`~nnscaler_jax.cost.relayout.reduced_layout`, next to the prices
so the cost model can use it too); the path reaches it by reductions and local
slices only (:mod:`nnscaler_jax.layout.comm` never moves a partial value's data).

>>> from nnscaler_jax.mesh.topology import DEFAULT_LINK, MeshSpec
>>> mesh = MeshSpec(("data", "model"), (2, 4), (DEFAULT_LINK,) * 2)
>>> src, dst = Layout.of(2, {0: "data"}), Layout.of(2, {1: "model"})
>>> [str(lay) for lay in relayout_steps(src, dst, (64, 64), 4, mesh)]
['D(0:data,1:model)', 'D(1:model)']
>>> str(reduced_layout(Layout.of(2, partial=("model",)), dst, (64, 64), 4, mesh))
'D(1:model)'
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import jax

from nnscaler_jax.cost.relayout import Split, grad_source, reduced_layout
from nnscaler_jax.errors import PlanError
from nnscaler_jax.layout import Layout, comm_path
from nnscaler_jax.mesh.topology import MeshSpec

__all__ = ["backward_steps", "constrain_along", "reduced_layout", "relayout_steps"]


@lru_cache(maxsize=16384)
def _steps(src: Layout, dst: Layout, shape: tuple[int, ...], itemsize: int,
           mesh: MeshSpec) -> tuple[Layout, ...]:
    try:
        path = comm_path(src, dst, shape, itemsize, mesh)
    except PlanError:  # a layout the path search does not know (not valid for the shape)
        return (Layout(dst.dims),)
    out: list[Layout] = []
    for k, step in enumerate(path.steps):
        if step.dst.partial:
            continue  # partial sums have no sharding: reduced by a later constraint
        nxt = path.steps[k + 1] if k + 1 < len(path.steps) else None
        if step.kind == "slice" and nxt is not None and nxt.kind == "slice":
            continue  # local slices in a row: one constraint slices them all
        out.append(step.dst)
    return tuple(out)


def relayout_steps(src: Layout, dst: Layout, shape: Sequence[int], itemsize: int,
                   mesh: MeshSpec) -> tuple[Layout, ...]:
    """The layouts to constrain a value to, in order, to carry it from ``src`` to ``dst``.

    One per step of the cheapest path (:func:`nnscaler_jax.layout.comm_path`, the path the cost
    model prices), except the steps that leave partial sums (they cannot be constrained; the
    next layout reduces them) and a local slice followed by another. Partial sums wanted by
    ``dst`` are ignored (its reduced layout is the last one). Empty when nothing changes.
    A pair the path search does not know (a layout that does not divide the shape) is one
    direct step ``(dst,)``.

    Args:
        src: the layout the value is in (the producer's constraint).
        dst: the layout the consumer reads.
        shape: the tensor's global shape.
        itemsize: bytes per element (the path depends on the bytes moved).
        mesh: the mesh with the link costs the plan was priced with.
    """
    dst = Layout(dst.dims) if dst.partial else dst
    if src == dst:
        return ()
    return _steps(src, dst, tuple(int(s) for s in shape), int(itemsize), mesh)


def backward_steps(src: Layout, want: Layout, split: Split, shape: Sequence[int], itemsize: int,
                   mesh: MeshSpec) -> tuple[Layout, ...]:
    """The layouts the gradient of a value read as ``want`` by an op split as ``split`` passes
    through, in order, back to the value's layout ``src``: the cheapest path the cost model
    prices for it (from :func:`~nnscaler_jax.cost.relayout.grad_source`), its partial sums
    reduced at the first layout (never empty).

    >>> from nnscaler_jax.mesh.topology import DEFAULT_LINK, MeshSpec
    >>> mesh = MeshSpec(("data", "model"), (2, 4), (DEFAULT_LINK,) * 2)
    >>> r, d = Layout.replicated(2), Layout.of(2, {0: "data"})
    >>> [str(lay) for lay in backward_steps(d, r, (("data", "b0"),), (64, 64), 4, mesh)]
    ['D(0:data)']
    """
    g = grad_source(want, split)
    dst = Layout(src.dims)
    first = reduced_layout(g, dst, shape, itemsize, mesh)
    return (first,) + tuple(relayout_steps(first, dst, shape, itemsize, mesh))


def _chain(x: Any, shardings: Sequence[Any]) -> Any:
    for s in shardings:
        x = jax.lax.with_sharding_constraint(x, s)
    return x


def constrain_along(x: Any, forward: Sequence[Any], backward: Sequence[Any]) -> Any:
    """``x`` constrained to the shardings ``forward`` in order; its cotangent (reverse mode)
    to ``backward`` in order (a custom JVP: the tangent passes ``backward`` reversed, and the
    transpose of a constraint is the same constraint). Values are unchanged either way."""
    forward, tangent = tuple(forward), tuple(reversed(tuple(backward)))

    @jax.custom_jvp
    def relayout(v):
        return _chain(v, forward)

    @relayout.defjvp
    def _jvp(primals, tangents):
        return _chain(primals[0], forward), _chain(tangents[0], tangent)

    return relayout(x)
