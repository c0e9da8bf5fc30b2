"""Pipeline settings on a plan: stages, schedule, micro-batches and the layer -> stage split,
chosen (``pipeline_stages="auto"``) and priced as the pipeline runtime executes them.

The stage DP restricted to what the runtime runs prices every candidate once; the chosen row is
the plan's cost (``step_time_s`` with the bubble, the largest stage's memory, the busiest
stage's compute / communication).
"""

from __future__ import annotations

from dataclasses import replace

from nnscaler_jax.constraints import Constraints
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.errors import NoFitError, PlanError
from nnscaler_jax.ir.graph import Graph
from nnscaler_jax.ir.layers import graph_layers
from nnscaler_jax.mesh.axes import require_stage_axis
from nnscaler_jax.pipeline.cut import Cut, plan_cut
from nnscaler_jax.pipeline.pricing import MEMORY_KINDS, RuntimeChoice, RuntimeSetup, runtime_setup
from nnscaler_jax.pipeline.program import why_cut
from nnscaler_jax.pipeline.rules import stack_modes
from nnscaler_jax.pipeline.schedule import Schedule, settings_steps
from nnscaler_jax.pipeline.stages import stage_of
from nnscaler_jax.plan.plan import PipelineSettings, Plan, PlanCost

__all__ = ["configure_pipeline"]


def configure_pipeline(plan: Plan, graph: Graph, constraints: Constraints,
                       model: CostModel | None = None) -> Plan:
    """``plan`` (an SPMD plan of the whole model) with the pipeline settings ``constraints``
    ask for, priced as the runtime runs them; ``plan`` itself when they ask for none.

    Raises:
        PlanError: no repeated layer stack, settings the runtime cannot execute, or (``"auto"``)
            no schedule x micro-batch count within ``max_memory_per_device``.
    """
    if constraints.pipeline_stages in (None, 1):
        return plan
    mesh_axes = dict(plan.mesh)
    cut = plan_cut(graph, mesh_axes, constraints, plan.policy or None,
                   2 if constraints.schedule == "interleaved"
                   else getattr(constraints.schedule, "virtual", 1), model)
    setup = cut.setup if cut else runtime_setup(graph, mesh_axes, plan.policy or None, model)
    if cut is None:  # one program on every stage: recompute rules select all layers or none
        where = graph_layers(graph)
        names = [where.stack.module] if where.stack.scanned else list(where.names)
        setup = replace(setup, modes=stack_modes(names, (op.module_path for op in graph.walk()),
                                                 constraints.rules))
    if constraints.pipeline_stages == "auto":
        choice, report, rows = _auto_choice(setup, constraints, cut is not None)
        if cut is not None and constraints.schedule is None:
            cut, choice, report = _or_interleaved(graph, plan, constraints, model, cut, choice,
                                                  report)
        if cut is None and _cut_only(choice.schedule):
            cut, choice, report = _as_cut(graph, plan, constraints, model, setup, rows,
                                          report)
    else:
        asked = constraints.schedule or "1f1b"
        virtual = 2 if asked == "interleaved" else getattr(asked, "virtual", 1)
        choice = _priced(setup, constraints.microbatches or getattr(asked, "microbatches",
                                                                    setup.stages),
                         asked, virtual, constraints.max_memory_per_device,
                         constraints.pipeline_overlap)
        report = ""
    if cut is None and not setup.tensor and constraints.pipeline_executor is None \
            and constraints.pipeline_stages == "auto" and not constraints.pipeline_overlap:
        cut, choice, report = _or_per_stage(graph, plan, constraints, model, choice, report)
    stages = mesh_axes[require_stage_axis(mesh_axes)]
    layers = cut.stage_of if cut else stage_of(graph_layers(graph).stack, stages, choice.virtual)
    steps = settings_steps(constraints.schedule)  # (a schedule written with op_order)
    settings = PipelineSettings(stages, choice.microbatches, choice.schedule, choice.virtual,
                                layers, report, steps=steps,
                                paired=bool(steps) and constraints.schedule.paired,
                                recompute=choice.recompute,
                                layer_rules=cut.layer_rules if cut else (),
                                executor=choice.executor,
                                stage_plans=constraints.stage_plans or choice.stage_plans,
                                overlap=choice.overlap)
    return replace(plan, pipeline=settings, cost=_cost(choice))


def _as_cut(graph: Graph, plan: Plan, constraints: Constraints, model: CostModel | None,
            setup: RuntimeSetup, rows: list[RuntimeChoice], report: str
            ) -> tuple[Cut | None, RuntimeChoice, str]:
    """The stage DP over a stack of identical layers chose ``rows[0]``, a schedule only the
    program cut at module boundaries runs (:func:`_cut_only`): plan and price that program,
    and keep it unless the stack's best row of the schedules it runs itself beats it
    (fitting first, then faster)."""
    choice = rows[0]
    cut = plan_cut(graph, dict(plan.mesh), replace(constraints, schedule=choice.schedule),
                   plan.policy or None, choice.virtual, model)
    priced = _priced(cut.setup, choice.microbatches, choice.schedule, choice.virtual,
                     constraints.max_memory_per_device, constraints.pipeline_overlap)
    said = (f"({priced.schedule} runs as the program cut at module boundaries, priced as "
            f"such: {priced.step_time_s * 1e3:.3f} ms/step, peak "
            f"{max(priced.memory_bytes) / 2**20:.2f} MiB")
    try:
        kept, kept_report, _ = _auto_choice(
            setup, constraints, rows=[r for r in rows if not _cut_only(r.schedule)])
    except PlanError:  # (nothing else runs, or fits)
        return cut, priced, report + f"\n  {said})"
    key = lambda r: (not r.fits, r.step_time_s)
    if key(priced) < key(kept):
        return cut, priced, report + f"\n  {said})"
    return None, kept, kept_report + f"\n  {said}: slower, not chosen)"


def _or_interleaved(graph: Graph, plan: Plan, constraints: Constraints,
                    model: CostModel | None, cut: Cut, choice: RuntimeChoice,
                    report: str) -> tuple[Cut, RuntimeChoice, str]:
    """A model cut at module boundaries into one chunk a stage offers the stage DP no
    interleaved row (it needs two chunks a stage): cut it so too, and keep that cut when its
    best interleaved row beats the choice (fitting first, then faster)."""
    try:
        two = plan_cut(graph, dict(plan.mesh), replace(constraints, schedule="interleaved"),
                       plan.policy or None, 2, model)
        rows = two.setup.choices(constraints.max_memory_per_device,
                                 microbatches=constraints.microbatches, schedule="interleaved",
                                 overlap=constraints.pipeline_overlap)
    except PlanError:  # (too few module boundaries for two chunks a stage)
        return cut, choice, report
    best = rows[0]
    report += (f"\n  interleaved (cut into 2 chunks a stage): {best.step_time_s * 1e3:.3f} "
               f"ms/step, peak {max(best.memory_bytes) / 2**20:.2f} MiB"
               + ("" if best.fits else " (over the budget)"))
    key = lambda r: (not r.fits, r.step_time_s)
    if key(best) < key(choice):
        report += " -- chosen"
        return two, best, report
    return cut, choice, report


def _or_per_stage(graph: Graph, plan: Plan, constraints: Constraints,
                  model: CostModel | None, choice: RuntimeChoice,
                  report: str) -> tuple[Cut | None, RuntimeChoice, str]:
    """The stage DP's choice for a stack of identical layers on stages data-parallel inside
    runs in one program in lock step; cut at module boundaries it can run one program per
    stage instead, each stage as its inputs arrive: keep that cut when its best row (with the
    choice's chunks a stage) beats the choice (fitting first, then faster; a tie stays in one
    program)."""
    asked = replace(constraints, pipeline_executor="per-stage")
    try:
        cut = plan_cut(graph, dict(plan.mesh), asked, plan.policy or None, choice.virtual,
                       model)
        rows = [r for r in cut.setup.choices(
                    constraints.max_memory_per_device, schedule=asked.schedule,
                    microbatches=constraints.microbatches, overlap=False)
                if r.virtual == choice.virtual]
    except PlanError:  # (too few module boundaries for the chunks)
        return None, choice, report
    key = lambda r: (not r.fits, r.step_time_s)
    if not rows or key(rows[0]) >= key(choice):
        return None, choice, report
    best = rows[0]
    return cut, best, report + (
        ("\n" if report else "") + f"  ({best.schedule} cut at module boundaries, one program "
        f"per stage: {best.step_time_s * 1e3:.3f} ms/step against {choice.step_time_s * 1e3:.3f}"
        f" in one program, peak {max(best.memory_bytes) / 2**20:.2f} MiB -- chosen)")


def _cut_only(schedule: str | Schedule) -> bool:
    """Only the program cut at module boundaries runs ``schedule`` (all-device or recycling
    blocks), whatever the model: :func:`~nnscaler_jax.pipeline.program.why_cut`."""
    return why_cut(pivots=False, schedule=schedule, precision=None, collections=False,
                   keys=False) is not None


def _priced(setup: RuntimeSetup, microbatches: int, schedule: str | Schedule,
            virtual: int, budget: float | None = None, overlap: bool | None = None
            ) -> RuntimeChoice:
    """The asked configuration priced: the fastest row that fits ``budget`` (every layer
    recomputed inside its chunk only when keeping the chunk's activations does not fit;
    transfers overlapped with the next step where ``overlap`` is None and that is faster),
    else the fastest."""
    rows = [r for r in setup.choices(budget, microbatches=microbatches, schedule=schedule,
                                     overlap=overlap)
            if r.virtual == virtual]
    if not rows:
        raise PlanError(f"pipeline: schedule {getattr(schedule, 'name', schedule)!r} with "
                        f"{virtual} chunks per "
                        "stage is not one the runtime executes (interleaved: 2, else 1)")
    if not rows[0].fits:
        low = min(rows, key=lambda r: max(r.memory_bytes))
        raise NoFitError(
            f"pipeline: no micro-batch count or recompute mode of schedule "
            f"{getattr(schedule, 'name', schedule)!r} on {setup.stages} stages fits "
            f"Constraints(max_memory_per_device={budget}) ({budget / 2**20:.2f} MiB per "
            f"device); the smallest estimate is {max(low.memory_bytes) / 2**20:.2f} MiB "
            f"({low.microbatches} micro-batches, "
            + ("every layer recomputed" if low.recompute == "layer" else "chunks recomputed")
            + "). Use more stages or devices, a smaller batch, or a larger budget",
            smallest_bytes=max(low.memory_bytes), budget_bytes=budget)
    return rows[0]


def _cost(r: RuntimeChoice) -> PlanCost:
    kinds = {k: max(stage[k] for stage in r.memory_kinds) for k in MEMORY_KINDS} \
        if r.memory_kinds else {}
    return PlanCost(step_time_s=r.step_time_s, memory_bytes_per_device=int(max(r.memory_bytes)),
                    comm_bytes=int(r.comm_bytes), compute_time_s=r.compute_s,
                    comm_time_s=r.comm_s,
                    memory_kinds=tuple((k, round(v)) for k, v in kinds.items()))


def _auto_choice(setup: RuntimeSetup, constraints: Constraints, cut: bool = False,
                 rows: list[RuntimeChoice] | None = None
                 ) -> tuple[RuntimeChoice, str, list[RuntimeChoice]]:
    """The runtime-restricted stage DP's choice, its report and the rows it chose from
    (``cut``: the model is cut at module boundaries, one unit per chunk; ``rows``: those
    priced already, else priced here).

    Raises:
        PlanError: ``rows`` given empty; NoFitError: nothing fits.
    """
    S, dp, tp, batch = setup.stages, setup.dp, setup.tp, setup.batch
    budget = constraints.max_memory_per_device
    if rows is None:
        rows = setup.choices(budget, microbatches=constraints.microbatches,
                             schedule=constraints.schedule,
                             overlap=constraints.pipeline_overlap)
    if not rows:
        raise PlanError("pipeline: no schedule the runtime runs was asked")
    par = f"{dp} data-parallel" + (f" x {tp} tensor-parallel ({', '.join(setup.tensor)})"
                                   if tp > 1 else "")
    best = rows[0]
    if not best.fits:
        low = min(max(r.memory_bytes) for r in rows)
        raise NoFitError(
            f"Constraints(pipeline_stages='auto', max_memory_per_device={budget}): no "
            f"schedule x micro-batch count fits {budget / 2**20:.2f} MiB per device on "
            f"{S} stages x {par}; the smallest estimate is "
            f"{low / 2**20:.2f} MiB. Use more stages or devices, a smaller batch, or more "
            "memory", smallest_bytes=low, budget_bytes=budget)
    what = (f"{len(setup.units) - 2} chunks cut at module boundaries" if cut else
            f"{len(setup.units) - 2} layers in equal chunks")
    head = (f"stage DP (runtime: {what} over {S} stages x {par}, batch {batch}"
            + (f", budget {budget / 2**20:.2f} MiB" if budget else "") + "): chose "
            f"{best.schedule} x {best.microbatches} micro-batches of {best.microbatch_size}, "
            f"predicted {best.step_time_s * 1e3:.3f} ms/step (bubble "
            f"{best.bubble_s * 1e3:.3f} ms), peak {max(best.memory_bytes) / 2**20:.2f} MiB")
    table = [(f"  {'schedule':<14} {'M':>4} x mb   {'step ms':>10} {'bubble ms':>9} "
              f"{'MiB/device':>10}")] + [f"  {r.row()}" for r in rows[:8]]
    if len(rows) > 8:
        table.append(f"  ... {len(rows) - 8} more")
    return best, "\n".join([head] + table), rows
