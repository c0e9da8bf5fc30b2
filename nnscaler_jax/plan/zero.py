"""ZeRO on a plan: the stage recorded, and stage 3's storage sharded over the data axes."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from nnscaler_jax.mesh.axes import data_axes
from nnscaler_jax.plan.plan import Plan

__all__ = ["apply_zero", "zero3_storage"]


def apply_zero(plan: Plan, graph: Any, zero: int | None) -> Plan:
    """``plan`` with ZeRO stage ``zero`` recorded (None: as the policy left it); stage 3 also
    shards every variable's storage over the mesh's data axes (all axes if none is named so)."""
    if zero is None:
        return plan
    if zero == 3 and plan.zero != 3:
        mesh_axes = dict(plan.mesh)
        return zero3_storage(plan, graph, data_axes(mesh_axes) or list(mesh_axes))
    return replace(plan, zero=zero)


def zero3_storage(plan: Plan, graph: Any, axes: list[str]) -> Plan:
    """``plan`` with every variable's storage also sharded over the data ``axes`` (ZeRO-3):
    on its first dim that the data axes (times any axes already splitting it) divide."""
    mesh_axes = dict(plan.mesh)
    ways = math.prod(mesh_axes[a] for a in axes)
    specs = dict(plan.variables)
    for t in graph.variables:
        spec = list(specs.get(t.name, (None,) * t.ndim))
        used = {a for e in spec if e for a in ((e,) if isinstance(e, str) else e)}
        if ways == 1 or used & set(axes):
            continue
        for i, n in enumerate(t.shape):
            have = () if spec[i] is None else ((spec[i],) if isinstance(spec[i], str)
                                               else tuple(spec[i]))
            if n % (ways * math.prod(mesh_axes[a] for a in have)) == 0:
                new = tuple(axes) + have
                spec[i] = new[0] if len(new) == 1 else new
                specs[t.name] = tuple(spec)
                break
    return replace(plan, zero=3, variables=tuple(sorted(specs.items())))
