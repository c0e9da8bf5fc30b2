"""The Alpa-style planner (``policy="alpa"``): Alpa's intra-operator pass on our graph.

Faithful to Alpa's ``auto_sharding`` (OSDI'22, section 4.2): every op is its own ILP variable
with its full strategy set (every assignment of mesh axes to annotated dims whose sizes divide:
Alpa's ``S0``, ``S1``, ``S01``, ``S0S1``... of every operand dim, and replicated), except that
ops following their producer share its variable (Alpa's follower merging); resharding matrices
on every edge; the memory budget; the same cost model and solver as ours (HiGHS, Alpa used CBC
with the same 600 s limit). What it does not do is share decisions between copies of a layer,
so its ILP grows with depth.

Alpa's inter-operator pass (layer clustering, stage / sub-mesh DP) waits for pipelining.
"""

from __future__ import annotations

from collections.abc import Mapping

from nnscaler_jax.constraints import Constraints
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.ir.graph import Graph
from nnscaler_jax.plan.plan import Plan
from nnscaler_jax.search.ilp import SearchReport, search

__all__ = ["alpa_search"]


def alpa_search(graph: Graph, mesh_axes: Mapping[str, int],
                constraints: Constraints | None = None, cost_model: CostModel | None = None,
                *, time_limit: float = 600.0, draft=None) -> tuple[Plan, SearchReport]:
    """Alpa's intra-operator ILP: ``(plan, report)``; see :func:`nnscaler_jax.search.search`."""
    return search(graph, mesh_axes, constraints, cost_model, planner="alpa",
                  time_limit=time_limit, draft=draft)
