"""ZeRO on a plan: the stage recorded, and stage 3's storage sharded over the data axes.

:func:`zero3_layout` is the one rule deciding where ZeRO-3 puts a variable's data axes; the plan's
storage (:func:`zero3_storage`) and the cost model's and search tables' pricing of a plan whose
storage was left unsharded (``cost/relayout.py``, ``search/tables.py``) both call it.

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

from nnscaler_jax.layout import Layout
from nnscaler_jax.mesh.axes import data_axes
from nnscaler_jax.plan.plan import Plan

__all__ = ["apply_zero", "zero3_layout", "zero3_storage"]


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
    """``plan`` with every variable's storage also sharded over the data ``axes`` (ZeRO-3), as
    :func:`zero3_layout` (``joint=True``) places them; other spec entries are kept as written."""
    mesh_axes = dict(plan.mesh)
    specs = dict(plan.variables)
    for t in graph.variables:
        spec = list(specs.get(t.name, (None,) * t.ndim))
        lay = Layout.from_pspec(spec, t.ndim)
        new = zero3_layout(t.shape, lay, axes, mesh_axes)
        if new is lay:
            continue
        i = next(i for i, (a, b) in enumerate(zip(lay.dims, new.dims, strict=True)) if a != b)
        spec += [None] * (i + 1 - len(spec))
        spec[i] = new.dims[i][0] if len(new.dims[i]) == 1 else new.dims[i]
        specs[t.name] = tuple(spec)
    return replace(plan, zero=3, variables=tuple(sorted(specs.items())))
