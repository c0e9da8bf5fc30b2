"""``estimate(plan, graph)``: a plan with its cost filled in by the :class:`CostModel`."""

from __future__ import annotations

from dataclasses import replace

from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.ir.graph import Graph
from nnscaler_jax.plan.plan import Plan, PlanCost

__all__ = ["estimate"]


def estimate(plan: Plan, graph: Graph, model: CostModel | None = None) -> Plan:
    """``plan`` with ``cost`` estimated (default: the local CPU cost model for the plan's mesh).

    A pipelined plan (``stages > 1``) is priced as the pipeline runtime executes its settings
    (:func:`nnscaler_jax.search.pipeline_dp.price_pipeline`: stages, micro-batches, schedule,
    data / tensor-parallel split): ``step_time_s`` includes the bubble,
    ``memory_bytes_per_device`` is the largest stage's, ``compute_time_s`` / ``comm_time_s`` /
    ``comm_bytes`` are the busiest stage's compute, communication (``ppermute``\\ s, tensor-
    parallel all-reduces, gradient syncs) and bytes sent per device; ``step_time_s -
    compute_time_s - comm_time_s`` is its idle (bubble) time.

    Raises:
        PlanError: a pipelined plan whose settings the pipeline runtime cannot execute.
    """
    if plan.stages > 1:
        from nnscaler_jax.search.pipeline_dp import price_pipeline

        r = price_pipeline(plan, graph, model)
        return replace(plan, cost=PlanCost(
            step_time_s=r.step_time_s, memory_bytes_per_device=int(max(r.memory_bytes)),
            comm_bytes=int(r.comm_bytes), compute_time_s=r.compute_s, comm_time_s=r.comm_s))
    model = model or CostModel.for_axes(dict(plan.mesh), zero=plan.zero)
    return replace(plan, cost=model.plan_cost(plan, graph))
