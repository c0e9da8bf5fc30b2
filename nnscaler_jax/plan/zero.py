"""ZeRO on a plan: the stage recorded, and stage 3's storage sharded over the data axes.

:func:`zero3_layout` is the one rule deciding where ZeRO-3 puts a variable's data axes; the plan's
storage (:func:`zero3_storage`) and the cost model's and search tables' pricing of a plan whose
storage was left unsharded (``cost/relayout.py``, ``search/tables.py``) both call it. A
variable's data-parallel axes are the mesh's data axes and the axes its gradient is reduced
over (:func:`gradient_axes`: a reader splits its work over them while reading it whole);
:func:`state_layout` places both, for the stored weight (ZeRO-3) and the training step's
optimizer state and gradients (ZeRO 1-3) alike, as the cost model prices them.

>>> from nnscaler_jax.layout import Layout
>>> mesh = {"data": 2, "fsdp": 2, "model": 2}
>>> lay = Layout.of(2, {1: "model"})
>>> str(zero3_layout((2, 8), lay, ("data", "fsdp"), mesh))
'D(1:(data,fsdp,model))'
>>> str(zero3_layout((2, 8), lay, ("data", "fsdp"), mesh, joint=False))
'D(0:data,1:(model,fsdp))'
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from nnscaler_jax.ir.regions import weight_origins
from nnscaler_jax.layout import Layout
from nnscaler_jax.mesh.axes import data_axes
from nnscaler_jax.plan.layouts import partial_grad_axes, plan_layouts, sole_read_variables
from nnscaler_jax.plan.plan import Plan

__all__ = ["apply_zero", "gradient_axes", "state_layout", "zero3_layout", "zero3_storage"]


def zero3_layout(shape: Sequence[int], layout: Layout, axes: Sequence[str],
                 mesh_axes: Mapping[str, int], *, joint: bool = True) -> Layout:
    """The ZeRO-3 storage layout of a variable of ``shape`` kept as ``layout``: the data-parallel
    ``axes`` also shard it, on the first dim whose size their product times the sizes of the
    axes already splitting that dim divides (else it stays as it is).

    Two callers, two readings of "the data axes", kept apart because each one's results are
    pinned (golden plans; the search's objective equals ``plan_cost``):

    - ``joint=True``, the plan's storage (:func:`zero3_storage`: the ``zero3`` policy,
      ``Constraints(zero=3)`` on a plan whose storage is not sharded yet): all the mesh's data
      axes as one block, major-most on one dim (``PartitionSpec(("data", "model"))``); a
      variable already split over any of them, or whose block ways are 1, stays as it is.
    - ``joint=False``, pricing a plan whose storage was not sharded (the searches record
      ``zero=3`` on the consumers' layouts; ``plan_cost``, the grad-sync price and the search
      tables assume ZeRO-3 shards it): each of the variable's own data-parallel axes (those
      its readers split but it isn't), one at a time and minor-most, each on the first dim it
      divides then; axes the layout already uses are skipped.

    Both agree for one data axis on a dim no other axis splits (the usual data x model mesh).
    """
    if joint:
        groups: list[tuple[str, ...]] = [tuple(axes)]
        if math.prod(mesh_axes[a] for a in axes) == 1:
            return layout
    else:
        groups = [(a,) for a in axes]
    for group in groups:
        if any(a in layout.split_axes or a in layout.partial for a in group):
            continue
        ways = math.prod(mesh_axes[a] for a in group)
        for i, n in enumerate(shape):
            have = layout.dims[i]
            if n % (ways * math.prod(mesh_axes[b] for b in have)) == 0:
                new = group + have if joint else have + group
                layout = Layout(layout.dims[:i] + (new,) + layout.dims[i + 1:], layout.partial)
                break
    return layout


def gradient_axes(plan: Plan, graph: Any) -> dict[int, tuple[str, ...]]:
    """Variable id -> its data-parallel axes under ``plan``: the mesh axes its gradient comes
    back partial over, because a reader splits its work over them by a dim while reading the
    variable unsplit there (a cast or reshape of it, or a region body's input tied to it, reads
    it too). ZeRO shards the variable's state over them; the cost model prices the gradient
    reductions over them. Beyond the mesh's data axes these are the axes a plan uses for data
    parallelism of some ops only (tokens split over ``model`` in a sequence-parallel block)."""
    plans = plan._by_id()
    sole = sole_read_variables(graph)
    origin = weight_origins(graph)
    dp: dict[int, tuple[str, ...]] = {v.id: () for v in graph.variables}
    for op in graph.walk():
        if op.regions:  # a region's body reads carry its gradients' axes (weight_origins)
            continue
        p = plans.get(op.id)
        ins, _ = plan_layouts(op, plans, sole)
        for t, want in zip(op.inputs, ins, strict=True):
            v = origin.get(t.id)
            if v is not None and t.ndim and p is not None:
                dp[v] = tuple(dict.fromkeys(dp[v] + partial_grad_axes(want, p.split)))
    return dp


def state_layout(shape: Sequence[int], layout: Layout, axes: Sequence[str],
                 own: Sequence[str], mesh_axes: Mapping[str, int]) -> Layout:
    """Where ZeRO puts a variable's sharded state (its parameter under ZeRO-3, its optimizer
    state under ZeRO 1-3): its ``layout`` also split over the mesh's data ``axes`` as one block
    (:func:`zero3_layout`, ``joint=True``), then over its own other data-parallel axes ``own``
    (:func:`gradient_axes`), one at a time, as the cost model prices them (``joint=False``)."""
    lay = zero3_layout(shape, layout, axes, mesh_axes)
    rest = [a for a in own if a not in axes]
    return zero3_layout(shape, lay, rest, mesh_axes, joint=False) if rest else lay


def apply_zero(plan: Plan, graph: Any, zero: int | None) -> Plan:
    """``plan`` with ZeRO stage ``zero`` recorded (None: as the policy left it); stage 3 also
    shards every variable's storage over the mesh's data axes (all axes if none is named so)."""
    if zero is None:
        return plan
    if zero == 3:  # also after a search that priced ZeRO-3 but kept its readers' layouts
        mesh_axes = dict(plan.mesh)
        return zero3_storage(plan, graph, data_axes(mesh_axes) or list(mesh_axes))
    return replace(plan, zero=zero)


def zero3_storage(plan: Plan, graph: Any, axes: list[str]) -> Plan:
    """``plan`` with every variable's storage also sharded over the data ``axes`` and its own
    data-parallel axes (ZeRO-3), as :func:`state_layout` places them; other spec entries are
    kept as written."""
    mesh_axes = dict(plan.mesh)
    specs = dict(plan.variables)
    own = gradient_axes(plan, graph)
    for t in graph.variables:
        spec = list(specs.get(t.name, (None,) * t.ndim))
        lay = Layout.from_pspec(spec, t.ndim)
        new = state_layout(t.shape, lay, axes, own[t.id], mesh_axes)
        if new == lay:
            continue
        spec += [None] * (t.ndim - len(spec))
        for i, (a, b) in enumerate(zip(lay.dims, new.dims, strict=True)):
            if a != b:
                spec[i] = b[0] if len(b) == 1 else b
        specs[t.name] = tuple(spec)
    return replace(plan, zero=3, variables=tuple(sorted(specs.items())))
