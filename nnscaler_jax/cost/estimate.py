"""``estimate(plan, graph)``: a plan with its cost filled in by the :class:`CostModel`."""

from __future__ import annotations

from dataclasses import replace

from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.ir.graph import Graph
from nnscaler_jax.plan.plan import Plan

__all__ = ["estimate"]


def estimate(plan: Plan, graph: Graph, model: CostModel | None = None) -> Plan:
    """``plan`` with ``cost`` estimated (default: the local CPU cost model for the plan's mesh)."""
    model = model or CostModel.for_axes(dict(plan.mesh), zero=plan.zero)
    return replace(plan, cost=model.plan_cost(plan, graph))
