"""Planning on mesh axis sizes alone (an ``AbstractMesh`` or a dict): no devices needed.

``make_plan_for`` reads ``mesh.devices``; benchmarks plan for 64 or 512 devices on a laptop, so
they go through :func:`plan_on_axes`, which runs any policy (``"auto"``, ``"alpa"``, the
built-ins, a function) on a :class:`~nnscaler_jax.primitives.Draft` of the axis sizes and prices
the plan with the same cost model.

>>> import jax
>>> mesh_axes(jax.sharding.AbstractMesh((8, 8), ("data", "model")))
{'data': 8, 'model': 8}
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from nnscaler_jax.constraints import Constraints
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.graph import Graph
from nnscaler_jax.plan.plan import Plan

__all__ = ["mesh_axes", "plan_on_axes"]


def mesh_axes(mesh: Any) -> dict[str, int]:
    """Axis name -> size of a ``Mesh``, ``AbstractMesh`` or ``{name: size}`` mapping."""
    if isinstance(mesh, Mapping):
        return {str(k): int(v) for k, v in mesh.items()}
    shape = getattr(mesh, "shape", None)
    if isinstance(shape, Mapping):
        return {str(k): int(v) for k, v in shape.items()}
    raise PlanError(f"cannot read mesh axes from {type(mesh).__name__}: pass a jax Mesh, an "
                    "AbstractMesh or a dict like {'data': 8, 'model': 8}")


def plan_on_axes(graph: Graph, mesh: Any, policy: Any = "auto",
                 constraints: Constraints | None = None, cost_model: CostModel | None = None,
                 time_limit: float | None = None) -> tuple[Plan, float, Any]:
    """Plan ``graph`` with ``policy`` on the axis sizes of ``mesh``.

    Returns:
        ``(plan with cost, seconds planning, SearchReport or None)``.
    """
    from nnscaler_jax.plan.policies import get_policy
    from nnscaler_jax.primitives import Draft
    from nnscaler_jax.search.ilp import search_policy

    axes = mesh_axes(mesh)
    constraints = constraints or Constraints()
    t0 = time.perf_counter()
    draft = Draft(graph, dict(axes))
    draft.policy = policy if isinstance(policy, str) else getattr(policy, "__name__", "custom")
    if policy in ("auto", "alpa"):
        fn = search_policy(policy, constraints, cost_model, time_limit)
    else:
        fn = get_policy(policy)
    plan = fn(draft, mesh)
    plan = constraints.apply_zero(plan, graph, axes)
    seconds = time.perf_counter() - t0
    cm = cost_model or CostModel.for_axes(axes, zero=plan.zero)
    return replace(plan, cost=cm.plan_cost(plan, graph)), seconds, getattr(
        draft, "search_report", None)
