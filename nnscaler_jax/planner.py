"""``make_plan``: the one planning entry, used by ``auto_parallel``, the CLI and the benchmarks.

SPMD plans come from :func:`nnscaler_jax.search.entry.plan_spmd` (constraints checked, policy
run, ZeRO recorded, plan priced); ``Constraints(pipeline_stages=...)`` adds the pipeline's
stages, schedule and micro-batches on top (:func:`nnscaler_jax.pipeline.configure.
configure_pipeline`, priced as the pipeline runtime runs them). A saved plan is checked against
the graph and mesh instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nnscaler_jax.constraints import Constraints
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.graph import Graph
from nnscaler_jax.mesh.axes import mesh_axes
from nnscaler_jax.pipeline.configure import configure_pipeline
from nnscaler_jax.plan.plan import Plan
from nnscaler_jax.search.entry import Planned, plan_spmd

__all__ = ["make_plan", "plan_and_report"]


def plan_and_report(graph: Graph, mesh: Any, *, policy: str | Callable | None = "auto",
                    constraints: Constraints | None = None, partitioning: dict | None = None,
                    cost_model: CostModel | None = None,
                    time_limit: float | None = None) -> Planned:
    """:func:`make_plan` with the planning seconds and the search's report."""
    constraints = constraints or Constraints()
    if policy is None and constraints.pipeline_stages not in (None, 1):
        policy = "dp"   # a pipeline without a policy: stages data-parallel inside
    planned = plan_spmd(graph, mesh, policy=policy, constraints=constraints,
                        partitioning=partitioning, cost_model=cost_model, time_limit=time_limit)
    if constraints.pipeline_stages not in (None, 1):
        planned = Planned(configure_pipeline(planned.plan, graph, constraints, cost_model),
                          planned.seconds, planned.report)
    _check_budget(planned.plan, constraints.max_memory_per_device)
    return planned


def _check_budget(plan: Plan, budget: int | None) -> None:
    """Every policy's plan must fit the memory budget (the searches choose within it; a
    hand-written or built-in policy's plan is checked here)."""
    if budget is None or plan.cost is None or plan.cost.memory_bytes_per_device <= budget:
        return
    raise PlanError(
        f"policy {plan.policy or 'custom'!r}: the plan needs an estimated "
        f"{plan.cost.memory_bytes_per_device / 2**20:.2f} MiB per device, over "
        f"Constraints(max_memory_per_device={budget}) ({budget / 2**20:.2f} MiB); no plan fits "
        "with this policy. Use policy='auto' (it searches within the budget), Constraints("
        "zero=3), more devices, a smaller batch, or a larger budget")


def make_plan(graph: Graph, mesh: Any, *, policy: str | Callable | None = "auto",
              plan: Plan | None = None, constraints: Constraints | None = None,
              partitioning: dict | None = None, cost_model: CostModel | None = None,
              time_limit: float | None = None) -> Plan:
    """Plan ``graph`` on ``mesh`` (a ``Mesh``, ``AbstractMesh`` or ``{axis: size}``).

    Args:
        graph: the annotated graph (``nnscaler_jax.trace`` or ``pm.graph``).
        mesh: the mesh, or just its axis sizes (no devices needed).
        policy: ``"auto"`` (the search), ``"alpa"``, ``"dp"``, ``"zero3"``, ``"megatron"`` or a
            function ``policy(draft, mesh) -> Plan``; None: ``"auto"``, or ``"dp"`` with
            pipeline stages (stages data-parallel inside, as the pipeline runtime runs them).
        plan: a saved plan to check and reuse instead of planning.
        constraints: what the plan must satisfy (rules, memory, ZeRO, pipeline).
        partitioning: ``{variable path: mesh axes per dim}`` from Flax metadata.
        cost_model: prices search and plan (default: the local CPU model of the mesh).
        time_limit: the searches' solver budget in seconds.

    Returns:
        The plan, with ``plan.cost`` filled in (a saved plan as it was saved).

    Raises:
        PlanError: the saved plan is for another graph or mesh; a constraint that cannot be
            met; no plan fits the memory budget.
    """
    if plan is not None:
        plan.check_graph(graph, mesh_axes(mesh))
        return plan
    return plan_and_report(graph, mesh, policy=policy, constraints=constraints,
                           partitioning=partitioning, cost_model=cost_model,
                           time_limit=time_limit).plan
