"""``make_plan``: the one planning entry, used by ``auto_parallel``, the CLI and the benchmarks.

SPMD plans come from :func:`nnscaler_jax.search.entry.plan_spmd` (constraints checked, policy
run, ZeRO recorded, plan priced); ``Constraints(pipeline_stages=...)`` adds the pipeline's
stages, schedule and micro-batches on top (:func:`nnscaler_jax.pipeline.configure.
configure_pipeline`, priced as the pipeline runtime runs them). A saved plan is checked against
the graph and mesh instead (:func:`nnscaler_jax.plan.reuse.check_reuse`: the same model, splits
that divide this graph's sizes) and re-priced at them. Dims a policy left replicated because a
mesh axis does not divide them (``Plan.unsplit``) are warned about once per plan. The plan
records the compute precision the graph was captured at (``Plan.precision``; ``Constraints(
precision=...)`` must agree with it: :mod:`nnscaler_jax.capture.precision`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from nnscaler_jax.capture.precision import UNKNOWN, graph_precision
from nnscaler_jax.constraints import Constraints
from nnscaler_jax.cost.devices import DefaultBudget, default_budget_of, device_for_kind
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.errors import (
    ConstraintError,
    NoFitError,
    PlanError,
    PlanFormatError,
    user_stacklevel,
)
from nnscaler_jax.ir.graph import Graph, Role
from nnscaler_jax.mesh.axes import data_axes, mesh_axes
from nnscaler_jax.pipeline.configure import configure_pipeline
from nnscaler_jax.pipeline.schedule import from_settings
from nnscaler_jax.plan.plan import Plan, unsplit_summary
from nnscaler_jax.plan.reuse import check_reuse, module_part
from nnscaler_jax.search.entry import Planned, plan_spmd

__all__ = ["make_plan", "plan_and_report", "with_default_budget"]


def plan_and_report(graph: Graph, mesh: Any, *, policy: str | Callable | None = "auto",
                    constraints: Constraints | None = None, partitioning: dict | None = None,
                    cost_model: CostModel | None = None,
                    time_limit: float | None = None) -> Planned:
    """:func:`make_plan` with the planning seconds and the search's report.

    The memory budget is the user's, else the device's (:func:`with_default_budget`).
    """
    precision = _precision(graph, constraints)
    constraints, default = with_default_budget(constraints, mesh, cost_model)
    cost_model = cost_model or _device_cost_model(mesh)  # (budget: the allocator's limit)
    if policy is None and constraints.pipeline_stages not in (None, 1):
        policy = "dp"   # a pipeline without a policy: stages data-parallel inside
    try:
        if constraints.pipeline_stages not in (None, 1):
            # the budget is the pipeline's (priced per stage by configure_pipeline): the
            # whole model on the mesh need not fit, and the runtime recomputes every stage
            # (the searches' recompute / co-sharding for the whole model would not run)
            whole = replace(constraints, max_memory_per_device=None)
            planned = plan_spmd(graph, mesh, policy=policy, constraints=whole,
                                partitioning=partitioning, cost_model=cost_model,
                                time_limit=time_limit)
            planned = Planned(configure_pipeline(planned.plan, graph, constraints, cost_model),
                              planned.seconds, planned.report)
            _check_budget(planned.plan, constraints.max_memory_per_device, default)
        else:
            planned = _plan_microbatched(graph, mesh, policy, constraints, partitioning,
                                         cost_model, time_limit, default)
    except PlanError as e:
        if default is not None and _about_memory(e):
            e.args = (f"{e.args[0] if e.args else ''}\n{default.describe()}", *e.args[1:])
        raise
    if precision is not None:
        planned = Planned(replace(planned.plan, precision=precision), planned.seconds,
                          planned.report)
    _warn_unsplit(planned.plan)
    return planned


def microbatch_candidates(graph: Graph, mesh: Any) -> list[int]:
    """Micro-batch counts an SPMD plan of ``graph`` may accumulate over: ``m > 1`` dividing the
    batch size (the leading dim every example input shares) such that the mesh's data axes
    still divide a micro-batch; none when the inputs share no leading dim."""
    lead = {t.shape[0] for t in graph.inputs if t.role is Role.INPUT and t.ndim}
    if len(lead) != 1:
        return []
    (batch,) = lead
    axes = mesh_axes(mesh)
    ways = math.prod(axes[a] for a in data_axes(axes))
    return [m for m in range(2, batch + 1) if batch % m == 0 and (batch // m) % ways == 0]


def _plan_microbatched(graph: Graph, mesh: Any, policy: Any, constraints: Constraints,
                       partitioning: dict | None, cost_model: CostModel | None,
                       time_limit: float | None, default: DefaultBudget | None) -> Planned:
    """The SPMD plan: with ``Constraints(microbatches=m)`` priced as m micro-batches; else
    the plan of the whole batch if one fits the budget, otherwise of the fewest micro-batches
    (gradient accumulation) with which one does (each count searched with the cost model's
    ``microbatches``, so splits and recompute are chosen for one micro-batch's memory). When
    ours (``"auto"``) fits the whole batch only by co-sharding, the fewest fitting micro-batches
    are planned as well and the faster plan is kept.

    Raises:
        NoFitError: no count fits (the error of the largest count tried, its smallest
            estimate being the smallest).
    """
    budget = constraints.max_memory_per_device

    def attempt(m: int) -> Planned:
        cm = cost_model
        if m > 1:
            base = cost_model or CostModel.for_axes(mesh_axes(mesh))
            cm = replace(base, microbatches=m)
        planned = plan_spmd(graph, mesh, policy=policy, constraints=constraints,
                            partitioning=partitioning, cost_model=cm, time_limit=time_limit)
        plan = replace(planned.plan, microbatches=m)
        _check_budget(plan, budget, default)
        return Planned(plan, planned.seconds, planned.report)

    if constraints.microbatches:
        return attempt(constraints.microbatches)
    counts = microbatch_candidates(graph, mesh) if budget is not None else []
    try:
        whole = attempt(1)
    except NoFitError:
        if not counts:
            raise
        return _fewest_microbatches(attempt, counts)
    if policy == "auto" and whole.plan.coshard and counts:
        # ours gave memory back by co-sharding: gradient accumulation may give it back faster
        try:
            micro = _fewest_microbatches(attempt, counts)
        except NoFitError:
            return whole
        return min((whole, micro), key=lambda p: p.plan.cost.step_time_s)
    return whole


def _fewest_microbatches(attempt: Callable[[int], Planned], counts: list[int]) -> Planned:
    """``attempt(m)`` for the fewest of ``counts`` (ascending) that fits."""
    try:  # the most micro-batches: if that does not fit, nothing does
        best = attempt(counts[-1])
    except NoFitError as e:
        e.args = ((f"{e.args[0] if e.args else ''}\n(with gradient accumulation over "
                   f"{counts[-1]} micro-batches, the most this batch allows; the whole batch at "
                   "once needs more)"), *e.args[1:])
        raise
    lo, hi = 0, len(counts) - 1  # bisect for the fewest that fit (memory falls with m)
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            best, hi = attempt(counts[mid]), mid
        except NoFitError:
            lo = mid + 1
    return best


def _device_cost_model(mesh: Any) -> CostModel | None:
    """The cost model of a ``jax.sharding.Mesh`` over accelerators with a device preset (its
    peaks price the plan, its memory is the default budget); None elsewhere (CPU meshes,
    abstract meshes, ``{axis: size}``: the nominal CPU model)."""
    try:
        kind = mesh.devices.flat[0].device_kind
    except Exception:  # noqa: BLE001 - AbstractMesh raises; a dict has no devices
        return None
    device = device_for_kind(kind)
    return CostModel.for_axes(mesh_axes(mesh), device=device) if device is not None else None


def _precision(graph: Graph, constraints: Constraints | None) -> str | None:
    """The precision a plan records: the one the graph was captured at, else (a graph built by
    hand) ``Constraints(precision=...)``.

    Raises:
        ConstraintError: the constraints ask for another precision than the graph's.
    """
    asked = constraints.precision if constraints is not None else None
    have = graph_precision(graph)
    if have == UNKNOWN:
        return asked
    if asked is not None and asked != have:
        raise ConstraintError(
            f"Constraints(precision={asked!r}), but the graph was captured at "
            f"{_precision_text(have)}: the precision is applied "
            f"when the model is captured; capture it with precision={asked!r} (capture(..., "
            "precision=...), capture_spec(spec, precision=...); auto_parallel does it from "
            "the constraints)")
    return have


def with_default_budget(constraints: Constraints | None, mesh: Any,
                        cost_model: CostModel | None) -> tuple[Constraints, DefaultBudget | None]:
    """``constraints`` with ``max_memory_per_device`` filled in from the device when the user
    left it unset (:func:`nnscaler_jax.cost.devices.default_budget`), and that default (None
    when the user set one, or the device has no known memory: CPU meshes, ``{axis: size}``
    without a cluster's cost model)."""
    constraints = constraints or Constraints()
    if constraints.max_memory_per_device is not None:
        return constraints, None
    default = default_budget_of(mesh, cost_model)
    if default is None:
        return constraints, None
    return replace(constraints, max_memory_per_device=max(default.bytes, 1)), default


def _about_memory(e: PlanError) -> bool:
    """Whether a planning failure is about the memory budget (to say where the default came
    from)."""
    return isinstance(e, NoFitError) or "max_memory_per_device" in str(e)


def _warn_unsplit(plan: Plan) -> None:
    """One ``UserWarning`` per plan listing the dims left replicated because a mesh axis does
    not divide them (grouped by size and axis), pointing at the user's call
    (:func:`~nnscaler_jax.errors.user_stacklevel`; the command line prints it as a note of
    its own)."""
    if not plan.unsplit:
        return
    level = user_stacklevel()
    u = plan.unsplit[0]
    warnings.warn(
        f"policy {plan.policy or 'custom'!r} left {len(plan.unsplit)} op dims replicated: the "
        "mesh axis they would split over does not divide their size (every device computes "
        "them whole):\n" + "\n".join(f"  {x}" for x in unsplit_summary(plan.unsplit)) + "\n"
        f"Use sizes the mesh axes divide (e.g. a multiple of {u.axis_size} rather than "
        f"{u.size} over '{u.axis}'), or a mesh whose axis sizes divide them; str(plan) lists "
        "them.",
        UserWarning, stacklevel=level)


def _check_budget(plan: Plan, budget: int | None, default: DefaultBudget | None = None, *,
                  saved: bool = False) -> None:
    """Every policy's plan must fit the memory budget (the searches choose within it; a
    hand-written or built-in policy's plan is checked here).

    Raises:
        NoFitError: over the budget (``smallest_bytes``: the plan's estimate); ``default``
            (the budget came from the device) adds where it came from in the caller.
    """
    if budget is None or plan.cost is None or plan.cost.memory_bytes_per_device <= budget:
        return
    need = plan.cost.memory_bytes_per_device
    over = (f"the default budget ({budget / 2**20:.2f} MiB)" if default is not None else
            f"Constraints(max_memory_per_device={budget}) ({budget / 2**20:.2f} MiB)")
    what = "the saved plan" if saved else f"policy {plan.policy or 'custom'!r}: the plan"
    fix = ("re-plan under the budget (without plan=; policy='auto' searches within it)"
           if saved else "no plan fits with this policy. Use policy='auto' (it searches within "
           "the budget), Constraints(zero=3)")
    raise NoFitError(
        f"{what} needs an estimated {need / 2**20:.2f} MiB per device, over {over}; {fix}, "
        "more devices, a smaller batch, or a larger budget", smallest_bytes=need,
        budget_bytes=budget)


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
        constraints: what the plan must satisfy (rules, memory, ZeRO, pipeline); without
            ``max_memory_per_device``, a cluster preset's or accelerator's memory less a reserve
            (see the module doc; none on CPU).
        partitioning: ``{variable path: mesh axes per dim}`` from Flax metadata.
        cost_model: prices search and plan, a saved plan too (default: the preset of the
            mesh's GPU kind, else the local CPU model of the mesh).
        time_limit: the searches' solver budget in seconds.

    Returns:
        The plan, with ``plan.cost`` filled in (a saved plan as it was saved, its cost, if it
        had one, re-priced for this graph's sizes).

    Raises:
        PlanError: the saved plan is for another model or mesh, or (a ``PlanFormatError``
            naming the op, dim, size and mesh axis) its splits do not divide this graph's sizes;
            a constraint that cannot be met; (``NoFitError``) no plan fits the memory budget.
    """
    if plan is not None:
        _check_saved_precision(plan, graph, constraints)
        try:
            check_reuse(plan, graph, mesh_axes(mesh))
        except PlanFormatError:
            part = module_part(plan, graph)  # a training step's plan runs the module's calls
            if part is None:
                raise
            check_reuse(part, graph, mesh_axes(mesh))
            plan = part
        plan = _repriced(plan, graph, cost_model or _device_cost_model(mesh))
        if constraints is not None:  # (the user's budget; a device's default is not checked)
            _check_budget(plan, constraints.max_memory_per_device, saved=True)
        return plan
    return plan_and_report(graph, mesh, policy=policy, constraints=constraints,
                           partitioning=partitioning, cost_model=cost_model,
                           time_limit=time_limit).plan


def _precision_text(precision: str | None) -> str:
    return repr(precision) if precision else "the model's own dtypes"


def _check_saved_precision(plan: Plan, graph: Graph, constraints: Constraints | None) -> None:
    """A saved plan computes at its own precision: the graph must have been captured at it, and
    ``Constraints(precision=...)`` (and ``zero=``), if given, must agree.

    Raises:
        ConstraintError: the constraints ask for another precision or ZeRO stage.
        PlanFormatError: the graph was captured at another one.
    """
    zero = constraints.zero if constraints is not None else None
    if zero is not None and zero != plan.zero:
        raise ConstraintError(f"Constraints(zero={zero}) contradicts the saved plan's ZeRO stage "
                              f"({plan.zero}): a saved plan runs as it was made; drop one, or "
                              "re-plan")
    asked = constraints.precision if constraints is not None else None
    name = _precision_text
    if asked is not None and asked != plan.precision:
        raise ConstraintError(f"Constraints(precision={asked!r}) contradicts the saved plan's "
                              f"precision ({name(plan.precision)}); drop one, or re-plan")
    have = graph_precision(graph)
    if have != UNKNOWN and have != plan.precision:
        raise PlanFormatError(
            f"the saved plan computes in {name(plan.precision)}, but the graph was captured at "
            f"{name(have)}; capture the model with precision={plan.precision!r} "
            "(auto_parallel(plan=...) does it from the plan)")


def _repriced(plan: Plan, graph: Graph, cost_model: CostModel | None) -> Plan:
    """A saved plan's cost at ``graph``'s sizes (as plan_spmd / configure_pipeline price it);
    ``plan`` itself when it had no cost."""
    if plan.cost is None:
        return plan
    if plan.pipeline is None:
        cm = cost_model or CostModel.for_axes(dict(plan.mesh), zero=plan.zero)
        return replace(plan, cost=cm.plan_cost(plan, graph))
    p = plan.pipeline
    cons = Constraints(pipeline_stages=p.stages, microbatches=p.microbatches,
                       schedule=from_settings(p) if p.steps else (p.schedule or None))
    priced = configure_pipeline(replace(plan, pipeline=None, microbatches=1), graph, cons,
                                cost_model)
    return replace(plan, cost=priced.cost)
