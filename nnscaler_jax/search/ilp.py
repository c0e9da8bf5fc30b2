"""The SPMD search: Alpa's intra-operator ILP over a (shrunk) strategy space, solved by HiGHS.

Formulation (Alpa, OSDI'22, section 4.2), over the groups of a :class:`SearchSpace`:

- one binary vector ``s_g`` per group, ``sum(s_g) == 1`` (one strategy per group);
- per edge between groups ``u`` and ``v`` a continuous matrix ``e_uv`` over (layout class of
  ``u``) x (layout class of ``v``) with the transportation constraints ``sum_y e_xy ==
  sum_{a in x} s_u[a]`` and ``sum_x e_xy == sum_{b in y} s_v[b]``: for binary ``s`` it is the
  one-hot of the chosen pair (Alpa's ``e_uv = s_u s_v^T`` linearised with row / column sums;
  strategies with equal layouts on the edge share a row, which changes nothing but the size);
- minimise ``sum_g s_g . (compute_g + comm_g) + sum_uv e_uv . R_uv`` (seconds per step);
- memory: ``sum_g s_g . m_g + sum_uv e_uv . M_uv + T <= max_memory_per_device`` when given
  (``M_uv``: operands an edge's relayout gathers and the consumer keeps for the backward; ``T``
  at least each group's transient ``t_g . s_g`` and each recomputed block's residuals).

Ours first minimises chain groups out exactly (:mod:`nnscaler_jax.search.reduce`); under a
budget it checks that some choice fits (the exact least memory: no HiGHS run to prove that none
does) and drops the strategies a no-costlier, no-larger one dominates before solving.

:func:`search` returns the plan (through ``Draft.decide`` + ``finish``) and a
:class:`SearchReport`.
"""

from __future__ import annotations

import gc
import logging
import math
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from scipy import sparse
from scipy.optimize import Bounds, LinearConstraint, milp

from nnscaler_jax.constraints import Constraints
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.errors import NoFitError, PlanError
from nnscaler_jax.ir.graph import Graph
from nnscaler_jax.plan.plan import OpPlan, Plan
from nnscaler_jax.search.recompute import Outpriced
from nnscaler_jax.search.reduce import (
    least_memory,
    prune_dominated,
    reduce_tables,
    solve_by_elimination,
)
from nnscaler_jax.search.rows import SCALE, Rows, edge_rows, memory_rows, sync_rows
from nnscaler_jax.search.space import SearchSpace, build_space
from nnscaler_jax.search.tables import CostTables, build_tables

log = logging.getLogger(__name__)

__all__ = ["PRESOLVE_MAX_VARIABLES", "GroupCost", "SearchReport", "fixed_decisions", "search",
           "search_policy", "solve"]

RESOLVE_FACTOR, RESOLVE_FLOOR_S = 10.0, 10.0  # a re-solve's time limit (see _meet_budget)
MIP_GAP = 1e-4
"""HiGHS stops at a plan within this fraction of the optimum's objective (0.01%: far below
the cost model's own error; proving 1e-6 took a quarter of Swin's search under a budget)."""
PROBE_GAP = 1e-3
"""The gap of a solve that only has to beat the best plan found (``beat``: the recompute count
search's probes, :mod:`nnscaler_jax.search.recompute`): each probe's plan is within 0.1% of its
count's optimum (the best of them is the plan kept). On Swin's 8-GPU preset under the V100
budget, HiGHS closed the last 0.09% of its hardest probe in 6.4 of its 10.2 s."""
PRESOLVE_MAX_VARIABLES = 1_000_000
"""Above this many variables HiGHS solves without presolve: its presolve does not check the
time limit (ERGO-Code/HiGHS#1501), and the Alpa-style AF2-initial ILP (2,378,663 variables,
60 s limit) was still in presolve after 14 minutes; without it each solve stopped at 70 s with a
plan (the best found by then)."""


@dataclass(frozen=True, slots=True)
class GroupCost:
    """The chosen strategy of one group and what it costs per step."""

    label: str
    ops: int
    strategies: int
    split: tuple[tuple[str, str], ...]
    compute_s: float
    comm_s: float
    memory_bytes: int


@dataclass(frozen=True, slots=True)
class SearchReport:
    """What a search did.

    Attributes:
        planner: ``"auto"`` (ours) or ``"alpa"``.
        ops / groups: ops in the graph, ILP groups.
        strategies: strategies per group.
        log10_space / log10_full: log10 of the searched and of the unshrunk space size.
        removed: (rule, strategies it removed).
        variables / constraints: ILP size.
        build_s / solve_s: seconds building the tables + ILP, and in HiGHS.
        objective_s: predicted seconds per step of the solution (the ILP objective).
        memory_bytes: predicted bytes per device of the solution.
        status: HiGHS' message; ``optimal`` is False when the time limit stopped it.
        bound_s: the lower bound HiGHS proved on the objective (``objective_s`` when optimal;
            ``-inf`` when the time limit stopped it before any bound): no plan in this
            search's space is faster, so a comparison with a time-limited search can say
            how far off its plan may be.
        breakdown: per group, its choice and costs (edges counted at their later group).
        eliminated: groups minimised out exactly before the ILP (``search/reduce.py``, ours).
    """

    planner: str
    ops: int
    groups: int
    strategies: tuple[int, ...]
    log10_space: float
    log10_full: float
    removed: tuple[tuple[str, int], ...]
    variables: int
    constraints: int
    build_s: float
    solve_s: float
    objective_s: float
    memory_bytes: int
    status: str
    optimal: bool
    breakdown: tuple[GroupCost, ...]
    eliminated: int = 0
    bound_s: float | None = None

    @property
    def gap(self) -> float:
        """The relative gap of a time-limited solve, ``1 - bound / objective`` (0 when
        optimal)."""
        if self.optimal or self.bound_s is None:
            return 0.0
        if not math.isfinite(self.bound_s) or self.objective_s <= 0:
            return 1.0  # nothing proven: the plan may be anything down to free
        return 1.0 - self.bound_s / self.objective_s

    def __str__(self) -> str:
        lines = [
            (f"{self.planner} search: {self.ops} ops -> {self.groups} groups, space "
            f"10^{self.log10_space:.1f} (unshrunk 10^{self.log10_full:.1f}); "
            f"{self.eliminated} groups eliminated exactly, ILP "
            f"{self.variables} variables x {self.constraints} constraints; build "
            f"{self.build_s:.2f} s, solve {self.solve_s:.2f} s ({self.status}"
            + ("" if self.optimal else f"; gap {self.gap:.1%}, nothing faster than "
               f"{self.bound_s * 1e3:.3f} ms/step") + ")"),
            (f"objective {self.objective_s * 1e3:.3f} ms/step, memory "
            f"{self.memory_bytes / 2**20:.1f} MiB/device"),
        ]
        lines += [f"  {r} removed {n} strategies" for r, n in self.removed if n]
        top = sorted(self.breakdown, key=lambda g: -(g.compute_s + g.comm_s))[:12]
        if top:
            w = max(len(g.label) for g in top)
            lines.append(f"  {'group':<{w}}  {'split':<28} {'compute ms':>10} {'comm ms':>9}")
            for g in top:
                split = ",".join(f"{a}:{d}" for a, d in g.split) or "replicated"
                lines.append(f"  {g.label:<{w}}  {split:<28} {g.compute_s * 1e3:>10.3f} "
                             f"{g.comm_s * 1e3:>9.3f}")
        return "\n".join(lines)


@dataclass(frozen=True)
class _Solution:
    choice: tuple[int, ...]
    objective_s: float
    memory_bytes: float
    status: str
    optimal: bool
    variables: int
    constraints: int
    gap_s: float = 0.0  # found objective - HiGHS' proven lower bound (0: optimal; inf: none)


def solve(tables: CostTables, *, max_memory: float | None = None, time_limit: float = 60.0,
          desc: str = "ILP", memory_offset: float = 0.0,
          transient_floor: float = 0.0, beat: float | None = None) -> _Solution:
    """Solve the ILP of ``tables``.

    Raises:
        PlanError: no choice fits ``max_memory`` (says the smallest estimate).
        Outpriced: ``beat`` is given and no choice that fits takes fewer than ``beat``
            seconds: HiGHS' ``objective_bound`` is ``beat`` (a cutoff: it prunes every branch
            whose bound reaches it, and an infeasible problem is the proof).
    """
    n = [len(c) for c in tables.compute]
    if any(k == 0 for k in n):
        raise PlanError("a group has no strategy left (rules removed them all)")
    if max_memory is not None and (any(e.block >= 0 for e in tables.edges) or
                                   any(gs.block >= 0 for gs in tables.gathers)):
        # the operands recomputed blocks gather again (their rows slow HiGHS down) bind only
        # when such a block's transient is the peak: solve without them first; a choice that
        # fits with them too is the optimum (the problem without them is a relaxation)
        plain = replace(tables, edges=[e for e in tables.edges if e.block < 0],
                        gathers=[gs for gs in tables.gathers if gs.block < 0])
        sol = solve(plain, max_memory=max_memory, time_limit=time_limit, desc=desc,
                    memory_offset=memory_offset, transient_floor=transient_floor, beat=beat)
        if _fits(tables, sol.choice, max_memory - memory_offset, transient_floor):
            return replace(sol, memory_bytes=tables.memory_of(sol.choice))
    off = np.concatenate([[0], np.cumsum(n)]).astype(np.int64)
    lp = Rows(int(off[-1]))
    lp.c_parts += [(tables.unary(g) * SCALE) for g in range(len(n))]
    for g, k in enumerate(n):  # one strategy per group
        lp.add(list(range(off[g], off[g] + k)), [1.0] * k, 1.0, 1.0)
    pairs = edge_rows(lp, tables, off, desc)
    sync_rows(lp, tables, off)
    scale = memory_rows(lp, tables, off, max_memory, memory_offset, pairs) \
        if max_memory is not None else 1.0
    c = np.concatenate(lp.c_parts)
    nv = lp.nv
    a = sparse.csr_array((lp.vals, (lp.rows, lp.cols)), shape=(lp.r, nv))
    last = np.arange(nv) == nv - 1
    bounds = Bounds(np.where(last, transient_floor / scale, 0.0), np.where(last, np.inf, 1.0)) \
        if max_memory is not None else Bounds(0.0, 1.0)
    integrality = np.zeros(nv)
    integrality[: int(off[-1])] = 1
    options = {"time_limit": float(time_limit), "disp": False,
               "mip_rel_gap": MIP_GAP if beat is None else PROBE_GAP,
               "presolve": nv <= PRESOLVE_MAX_VARIABLES}
    if beat is not None:  # the cutoff: only choices faster than the best found so far
        options["objective_bound"] = beat * SCALE
        _quiet_cutoff()
    log.info("%s: %d variables (%d binary), %d constraints%s", desc, nv, int(off[-1]), lp.r,
             "" if options["presolve"] else ", no presolve (it overruns the time limit)")
    res = milp(c, constraints=LinearConstraint(a, lp.lb, lp.ub), integrality=integrality,
               bounds=bounds, options=options)
    if res.x is None:
        if max_memory is not None and res.status == 1:  # time limit, no plan found yet
            raise NoFitError(
                f"the search's solver found no plan within max_memory_per_device="
                f"{int(max_memory):,} bytes in its time limit ({time_limit:g} s). Raise "
                "time_limit or the budget.", smallest_bytes=None, budget_bytes=max_memory)
        if beat is not None and res.status == 2:  # (the budget or the cutoff: either way)
            raise Outpriced(f"{desc}: no plan within the budget is faster than {beat:.4g} s")
        if max_memory is not None:
            raise _memory_error(max_memory, least_memory(tables))
        raise PlanError(f"the search found no plan: {res.message}")
    choice = tuple(int(np.argmax(res.x[off[g]:off[g + 1]])) for g in range(len(n)))
    objective = tables.objective(choice)
    if beat is not None and objective >= beat:
        # HiGHS pruned every branch by the cutoff but kept a plan found before it applied the
        # bound (it reports that plan as optimal): nothing faster than ``beat`` exists
        raise Outpriced(f"{desc}: no plan within the budget is faster than {beat:.4g} s")
    bound = getattr(res, "mip_dual_bound", None)
    gap = 0.0 if res.status == 0 else (
        max(0.0, (float(res.fun) - float(bound)) / SCALE)
        if bound is not None and np.isfinite(bound) else math.inf)  # inf: no bound proven
    return _Solution(choice, objective, tables.memory_of(choice),
                     str(res.message), res.status == 0, nv, lp.r, gap)


def _quiet_cutoff() -> None:
    """Silence scipy's warning that ``objective_bound`` (HiGHS' cutoff) is not one of
    ``milp``'s own options: it passes such options "to HiGHS verbatim", as documented. HiGHS
    prunes by the option; the same cutoff as a row of the problem made its probes 1.5-4x slower
    (the LP relaxation degenerates on it: Swin's 8-GPU preset, 12 probes 55.7 s -> 32.7 s of
    HiGHS). Set at every solve: a test harness may reset the filters between calls."""
    warnings.filterwarnings("ignore", message=r"Unrecognized options detected: "
                            r"\{'objective_bound'\}", category=RuntimeWarning)


def _fits(tables: CostTables, choice, cap: float, floor: float) -> bool:
    """Whether ``choice`` keeps at most ``cap`` bytes with its largest transient at least
    ``floor`` (the eliminated groups' largest, as the ILP's ``T`` is bounded)."""
    peak = tables.memory_of(choice)
    kept = peak - max(tables.block_transient(choice), max(
        (float(t[c]) for t, c in zip(tables.transient or [], choice, strict=False)),
        default=0.0))
    return max(peak, kept + floor) <= cap * (1 + 1e-9)


def _solve_reduced(tables: CostTables, budget: float | None, limit: float,
                   planner: str, beat: float | None = None) -> tuple[_Solution, int]:
    """Eliminate chain groups exactly, solve what is left, read the eliminated ones back."""
    _bound_fits(tables, budget)
    red = reduce_tables(tables, memory_budget=budget is not None)
    n = len(tables.compute)
    rest = solve_by_elimination(red.tables) if budget is None else None
    if rest is not None:  # what is left is small enough to minimise out as well
        part, choice = None, red.expand(rest, n)
    else:
        left, kept = prune_dominated(red.tables) if budget is not None else (red.tables, None)
        part = solve(left, max_memory=budget, time_limit=limit, desc=f"{planner} ILP",
                     memory_offset=red.memory_offset, transient_floor=red.transient_floor,
                     beat=beat)
        choice = red.expand(part.choice if kept is None else
                            [int(k[c]) for k, c in zip(kept, part.choice, strict=True)], n)
    if budget is not None and tables.memory_of(choice) > budget:
        raise _memory_error(budget, least_memory(tables))
    return _Solution(choice, tables.objective(choice), tables.memory_of(choice),
                     part.status if part else "solved by elimination",
                     part.optimal if part else True, part.variables if part else 0,
                     part.constraints if part else 0, part.gap_s if part else 0.0), red.eliminated


def _bound_fits(tables: CostTables, budget: float | None) -> None:
    """Raise the no-fit error when even the tables' lower bound on memory is over ``budget``:
    no choice fits, and HiGHS need not prove it (a proof it may not finish in its time limit:
    the Alpa-style T5-8 without recompute ran 265 s to say nothing)."""
    if budget is not None and all(len(c) for c in tables.compute) and \
            (least := least_memory(tables)) > budget:
        raise _memory_error(budget, least)


def _meet_budget(plan: Plan, sol: _Solution, budget: float, solved, cm: CostModel,
                 graph: Graph, make_plan, seconds: float) -> tuple[Plan, _Solution]:
    """The cost tables price the memory ``plan_cost`` does but for a tensor gathered by a later
    reader to another layout than its first keeping reader's (``search.edges``); the plan's full
    pricing checks it. When that pushes the plan over ``budget``, solve again under a budget
    lowered by the excess (a few rounds).

    ``solved(cap, limit)`` solves under ``cap`` within ``limit`` seconds; each round gets
    :data:`RESOLVE_FACTOR` x ``seconds`` (the first solve's), at least :data:`RESOLVE_FLOOR_S`:
    a budget lowered close to the least memory makes a far harder problem (minutes where the
    first took a second), and HiGHS' best plan by then is what the round checks."""
    cost = cm.plan_cost(plan, graph)
    real = cost.memory_bytes_per_device
    limit = max(RESOLVE_FLOOR_S, RESOLVE_FACTOR * seconds)
    for _ in range(3):
        if real <= budget:
            return replace(plan, cost=cost), sol
        try:
            sol = solved(budget - (real - sol.memory_bytes), limit)[0]
        except PlanError:
            break
        plan = make_plan(sol)
        cost = cm.plan_cost(plan, graph)
        real = cost.memory_bytes_per_device
    if real <= budget:
        return replace(plan, cost=cost), sol
    raise NoFitError(
        f"no plan fits max_memory_per_device={int(budget):,} bytes ({budget / 2**30:.2f} GiB): "
        f"the best plan found within the search's per-op estimate needs {int(real):,} bytes "
        f"({real / 2**30:.2f} GiB) per device once relayout buffers kept for the backward (all-"
        "gathered matmul operands) are counted. Raise the budget, use Constraints(zero=3), or "
        "a larger mesh.", smallest_bytes=real, budget_bytes=budget)


def _memory_error(budget: float, smallest: float) -> NoFitError:
    if smallest <= budget:  # the lower bound fits; the solver proved that no choice does
        return NoFitError(
            f"no plan fits max_memory_per_device={int(budget):,} bytes ({budget / 2**30:.2f} "
            f"GiB): every choice keeps more (a lower bound, {int(smallest):,} bytes, fits, but "
            "not once the operands relayouts gather for matmuls and recomputed blocks' "
            "residuals are counted together). Raise the budget, use Constraints(zero=3), or "
            "a larger mesh.", smallest_bytes=None, budget_bytes=budget)
    return NoFitError(
        f"no plan fits max_memory_per_device={int(budget):,} bytes ({budget / 2**30:.2f} GiB): "
        f"the smallest estimate found is {int(smallest):,} bytes ({smallest / 2**30:.2f} GiB) "
        "per device (parameters, gradients, optimizer state, activations). Raise the budget, "
        "use Constraints(zero=3), or a larger mesh.", smallest_bytes=smallest,
        budget_bytes=budget)


def _report(planner: str, space: SearchSpace, tables: CostTables, sol: _Solution,
            build_s: float, solve_s: float, eliminated: int = 0) -> SearchReport:
    comm = [float(tables.comm[g][c]) for g, c in enumerate(sol.choice)]
    for e in tables.edges:
        comm[e.dst] += float(e.cost[e.rows[sol.choice[e.src]], e.cols[sol.choice[e.dst]]])
    breakdown = tuple(
        GroupCost(grp.label, grp.n_ops, grp.n, grp.fgroups[0].splits[0][c],
                  float(tables.compute[g][c]), comm[g], int(tables.memory[g][c]))
        for g, (grp, c) in enumerate(zip(space.groups, sol.choice, strict=True)))
    return SearchReport(planner, space.ops, len(space.groups), tuple(g.n for g in space.groups),
                        space.log10_size, space.log10_full, space.removed, sol.variables,
                        sol.constraints, build_s, solve_s, sol.objective_s,
                        int(sol.memory_bytes), sol.status, sol.optimal, breakdown, eliminated,
                        sol.objective_s - sol.gap_s)


def _plan(graph: Graph, mesh_axes: Mapping[str, int], space: SearchSpace,
          choice: Sequence[int], policy: str, zero: int, draft=None) -> Plan:
    from nnscaler_jax.primitives import Draft

    draft = draft if draft is not None else Draft(graph, dict(mesh_axes))
    draft.policy = draft.policy or policy
    draft.zero = zero
    for op in graph.walk():
        if op.id in space.fixed:
            continue  # decided by hand before the search: the policy's own OpPlan stays
        # strategies come from the enumerated (valid) space: record them as Draft.decide would
        draft.decisions[op.id] = OpPlan(op.id, op.primitive, op.module_path,
                                        tuple(space.split_of(op.id, choice)))
    return draft.finish()


def fixed_decisions(draft) -> dict[int, tuple[tuple[str, str], ...]]:
    """op id -> split of the ops a policy decided by hand on ``draft`` before searching."""
    if draft is None:
        return {}
    out = {op_id: tuple(p.split) for op_id, p in getattr(draft, "decisions", {}).items()}
    for op_id, assigned in getattr(draft, "_assigned", {}).items():
        out[op_id] = tuple(draft._compile_assignment(op_id, assigned).split)
    return out


def _pins(graph: Graph, draft, partitioning: Any) -> dict[int, tuple]:
    from nnscaler_jax.capture.metadata import partitioning_specs, pins_of

    specs: dict[str, tuple] = {}
    if partitioning is None and draft is not None:  # auto_parallel put the model's metadata there
        partitioning = getattr(draft, "partitioning", None) or None
    if partitioning is not None:
        if isinstance(partitioning, Mapping) and partitioning and all(
                isinstance(v, tuple | list) for v in partitioning.values()):
            specs.update({k: tuple(v) for k, v in partitioning.items()})
        else:
            specs.update(partitioning_specs(partitioning))
    if draft is not None:
        specs.update({k: tuple(v) for k, v in getattr(draft, "variables", {}).items()})
    return pins_of(graph, specs) if specs else {}


def search(graph: Graph, mesh_axes: Mapping[str, int], constraints: Constraints | None = None,
           cost_model: CostModel | None = None, *, planner: str = "auto",
           time_limit: float | None = None, draft=None,
           partitioning: Any = None) -> tuple[Plan, SearchReport]:
    """Search the plan of least predicted step time.

    Args:
        graph: the annotated graph.
        mesh_axes: mesh axis name -> size (``dict(mesh.shape)``; no devices needed).
        constraints: rules prune the space, ``zero`` sets the ZeRO stage, and
            ``max_memory_per_device`` bounds the plan's estimated memory.
        cost_model: default ``CostModel.for_axes(mesh_axes, zero=...)``.
        planner: ``"auto"`` (ours: followers + repeated layers share decisions) or ``"alpa"``
            (every op its own variable but for Alpa's followers).
        time_limit: HiGHS time budget in seconds (default 60 ours, 600 Alpa's).
        draft: a policy's draft to record the decisions in (keeps its policy name). Ops the
            policy already decided (``draft.decide``, ``op_trans`` + ``op_assign``) keep their
            decision: the search fills in the rest (a partial plan by hand). Its ``beat_s``:
            under a budget, give up (``Outpriced``) once no plan can be faster.
        partitioning: Flax partitioning metadata honoured as constraints: boxed linen variables
            (``nn.with_partitioning`` / ``nn.with_logical_partitioning``), an nnx module with
            ``nnx.with_partitioning`` params, or ``{variable path: spec}``; a variable whose
            metadata names mesh axes is stored (read by its first reader) split over them.
            Variables a policy stored by hand (``draft.store_variable``) are pinned the same way.

    Returns:
        ``(plan, report)``.

    Raises:
        PlanError: contradictory rules (naming both), or no plan fits the memory budget (with
            the smallest estimate found).
    """
    # The search allocates many small, acyclic objects (layouts, splits, cost rows); the cyclic
    # collector would re-scan the caller's whole heap (traced graphs, jax caches) many times.
    paused = gc.isenabled()
    gc.disable()
    try:
        return _search(graph, mesh_axes, constraints, cost_model, planner, time_limit, draft,
                       partitioning)
    finally:
        if paused:
            gc.enable()


def _search(graph, mesh_axes, constraints, cost_model, planner, time_limit, draft,
            partitioning) -> tuple[Plan, SearchReport]:
    t0 = time.perf_counter()
    constraints = constraints or Constraints()
    zero = constraints.zero or 0
    mesh_axes = dict(mesh_axes)
    cm = cost_model or CostModel.for_axes(mesh_axes, zero=zero)
    space = build_space(graph, mesh_axes, constraints.rules, followers=True,
                        share_layers=planner != "alpa", fixed=fixed_decisions(draft),
                        pinned=_pins(graph, draft, partitioning), microbatches=cm.microbatches)
    log.info("%s: %s", planner, space.summary())
    tables = build_tables(space, cm, zero)
    t1 = time.perf_counter()
    limit = time_limit if time_limit is not None else (600.0 if planner == "alpa" else 60.0)
    budget = constraints.max_memory_per_device

    def solved(cap: float | None, seconds: float = limit) -> tuple[_Solution, int]:
        seconds = min(seconds, limit)
        if planner == "alpa":  # Alpa solves the whole ILP
            _bound_fits(tables, cap)
            return solve(tables, max_memory=cap, time_limit=seconds, desc=f"{planner} ILP"), 0
        # ours: exact elimination of chain groups first (search/reduce.py)
        return _solve_reduced(tables, cap, seconds, planner, beat=getattr(draft, "beat_s", None))

    sol, eliminated = solved(budget)
    t2 = time.perf_counter()
    plan = _plan(graph, mesh_axes, space, sol.choice, planner, zero, draft)
    if budget is not None:
        plan, sol = _meet_budget(plan, sol, budget, solved, cm, graph,
                                 lambda s: _plan(graph, mesh_axes, space, s.choice, planner,
                                                 zero, draft), t2 - t1)
    report = _report(planner, space, tables, sol, t1 - t0 + (time.perf_counter() - t2), t2 - t1,
                     eliminated)
    log.info("%s", report)
    return plan, report


def search_policy(planner: str = "auto", constraints: Constraints | None = None,
                  cost_model: CostModel | None = None, time_limit: float | None = None,
                  partitioning: Any = None):
    """A policy ``policy(graph, mesh) -> Plan`` running :func:`search`; the report is left on
    the draft as ``draft.search_report``. Constraints default to ``draft.constraints`` when the
    caller set them. ``partitioning``: Flax metadata honoured as constraints (see :func:`search`).

    Partial plans: a policy may decide some ops by hand and hand the rest to the search, which
    keeps those decisions fixed::

        def my_policy(graph, mesh):
            graph.decide(graph.op("fc1"), {"model": "n"})
            return search_policy("auto")(graph, mesh)
    """

    def policy(draft, mesh) -> Plan:
        cons = constraints if constraints is not None else getattr(draft, "constraints", None)
        plan, report = search(draft.graph, draft.mesh_axes, cons, cost_model, planner=planner,
                              time_limit=time_limit, draft=draft, partitioning=partitioning)
        draft.search_report = report
        return plan

    policy.__name__ = planner
    return policy
