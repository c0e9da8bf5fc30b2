"""Tensor parallelism inside pipeline stages: the in-stage plan replayed as sharding constraints.

The pipelined step (:mod:`nnscaler_jax.pipeline.stacked`) runs one ``jax.shard_map``. With a
tensor-parallel policy (``policy='megatron'``, ``'auto'``, ``'alpa'``, ``'zero3'`` or a function)
that ``shard_map`` is *partial-manual*: manual over the stage axis and the data-parallel axes
(named like :data:`~nnscaler_jax.mesh.axes.DATA_AXES`), while the remaining axes (e.g.
``'model'``) stay in GSPMD's auto mode inside the body. The policy plans the micro-batch training
program (``loss_fn(module.apply(...))`` on one data shard's micro-batch) on the mesh of those
tensor-parallel axes only; the chunk functions then run the ops their equations became through
that plan's one :class:`~nnscaler_jax.lower.replay.Lowering` (:class:`~nnscaler_jax.lower.eqns.
LoweredEqns`), as a flat plan runs: every op's inputs and outputs constrained to its layouts,
partial sums reduced where their consumer needs them, co-sharded blocks and value-split chains
in ``shard_map`` regions manual over the tensor-parallel axes (nested in the pipeline's), so
GSPMD inserts the plan's collectives (an all-reduce over ``'model'`` after each row-parallel
matmul, forward and backward). Layer parameters are stored ``P(stage, None, None, *plan
spec)``: each device holds its stage's chunk of layers and its slice over ``'model'``.

Why partial-manual for a stack of identical layers: ``with_sharding_constraint`` over the auto
axes works inside ``shard_map(axis_names={'stage', 'data'})`` through ``lax.fori_loop`` /
``jax.vjp`` and ``ppermute`` over the manual stage axis (checked on jax 0.10 CPU), and GSPMD
derives every collective and its transpose. Constraints need Auto axis types, so the TP program
runs on an Auto view of the mesh (same devices, names and specs). Chunks that differ per stage
run by ``lax.switch`` on the stage, where GSPMD's resharding in one branch may be a
collective-permute waiting for every device; there the plan runs fully manual instead
(``plan_in_stage(manual=True)``: :class:`~nnscaler_jax.lower.replay.Lowering` on each device's
blocks, its collectives explicit, :mod:`nnscaler_jax.lower.manual`).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from nnscaler_jax.capture.jaxpr import InputInfo, graph_with_sources
from nnscaler_jax.constraints import Constraints, Rule
from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.graph import Graph, Role, Tensor
from nnscaler_jax.layout import Layout
from nnscaler_jax.lower.eqns import LoweredEqns
from nnscaler_jax.lower.replay import Lowering
from nnscaler_jax.mesh.axes import DATA_AXES, auto_view, mesh_axes
from nnscaler_jax.pipeline.steps import peak_in_flight
from nnscaler_jax.plan.plan import Plan
from nnscaler_jax.plan.policies import BATCH_INPUTS, batch_led
from nnscaler_jax.plan.reuse import renumbered
from nnscaler_jax.search.entry import SEARCHES, plan_spmd

__all__ = ["InStagePlan", "part_graph", "plan_in_stage", "stage_parts", "stage_rules",
           "tensor_axes"]



def tensor_axes(mesh_axes: dict[str, int], stage: str, policy: Any) -> tuple[str, ...]:
    """The mesh axes that are tensor-parallel inside stages (auto in the ``shard_map``).

    ``policy`` None or ``'dp'``: none (every non-stage axis is data-parallel, as before).
    Otherwise the non-stage axes of size > 1 not named like a data axis (``'data'``,
    ``'dp'``, ...); an axis of size 1 splits nothing (it is data-parallel, trivially).
    """
    if policy is None or policy == "dp":
        return ()
    return tuple(a for a in mesh_axes if a != stage and a not in DATA_AXES and mesh_axes[a] > 1)


def _policy_name(policy: Any) -> str:
    return policy if isinstance(policy, str) else getattr(policy, "__name__", "custom")


def _stage_error(policy: Any, tp: dict[str, int], what: str, fix: str) -> PlanError:
    return PlanError(f"pipeline stages with policy {_policy_name(policy)!r}: the in-stage plan "
                     f"(micro-batch program on the tensor-parallel axes {tp}) {what}. {fix}")


@dataclass(frozen=True)
class InStagePlan:
    """The in-stage plan and what the chunk functions need from it.

    Attributes:
        axes: the tensor-parallel mesh axes (auto inside the ``shard_map``).
        graph / plan: the micro-batch program's graph and the policy's plan for it.
        constraints: what the chunk functions evaluate equations with: the ops they became,
            run through the plan's one ``Lowering`` (layouts, relayout paths, partial sums,
            co-sharded blocks and recompute groups, ``shard_map`` regions).
        var_specs: per parameter leaf (flat index), its storage ``PartitionSpec`` entries.
        body_specs: ``scan`` body input var -> the layout its first consumer wants (the
            per-layer storage of an ``nn.scan`` stack, whose stacked variable the policies may
            leave unsplit).
    """

    axes: tuple[str, ...]
    graph: Graph
    plan: Plan
    constraints: LoweredEqns
    var_specs: tuple[tuple, ...]
    body_specs: dict

    def layer_spec(self, leaf: int, var: Any, stacked: bool) -> tuple:
        """Storage spec entries of one layer's parameter (without the stacked layer dim)."""
        spec = self.var_specs[leaf][1:] if stacked else self.var_specs[leaf]
        if any(e is not None for e in spec) or var not in self.body_specs:
            return spec
        return tuple(self.body_specs[var]) + (None,) * (len(spec) - len(self.body_specs[var]))

    def evaluate(self, eqns: Any, env: dict) -> None:
        """Evaluate ``eqns`` into ``env`` with the plan's sharding constraints."""
        self.constraints.evaluate(eqns, env)


def _sub_mesh(mesh: Mesh, axes: tuple[str, ...]) -> Mesh:
    """The mesh of ``axes`` over the devices at index 0 of every other axis."""
    idx = tuple(slice(None) if a in axes else 0 for a in mesh.axis_names)
    return auto_view(Mesh(mesh.devices[idx], axes, axis_types=(jax.sharding.AxisType.Auto,) *
                          len(axes)))


def stage_parts(cut: Any, seg_stage: Sequence[int], schedule: Any, budget: float | None,
                plans: tuple = ()) -> list[tuple]:
    """What :func:`plan_in_stage` plans per stage of ``cut`` (segment ``k`` on stage
    ``seg_stage[k]``): the equations of its chunks, the budget its in-stage search plans one
    micro-batch's pass under (the device's, less the chunk inputs the schedule keeps for the
    stage's other micro-batches in flight: a chunk's backward recomputes its forward from its
    input; the search prices the one pass recomputing) and the plan the planner priced it
    with (``PipelineSettings.stage_plans``; None: search)."""
    flight = peak_in_flight(schedule)
    nbytes = lambda a: int(np.prod(a.shape, dtype=np.int64)) * np.dtype(a.dtype).itemsize
    parts = []
    for s in range(schedule.stages):
        mine = [k for k in range(cut.chunks) if seg_stage[k] == s]
        held = max((sum(nbytes(v.aval) for v in cut.bounds[k - 1]) for k in mine if k),
                   default=0)
        eqns = [e for k in mine for e in cut.segments[k]]
        parts.append((eqns, None if budget is None
                      else max(budget - (flight[s] - 1) * held, 0.0),
                      plans[s] if plans else None))
    return parts


def plan_in_stage(closed: Any, param_paths: list[str], n_params: int, mesh: Mesh, stage: str,
                  policy: Any, *, root: str = "", rules: tuple = (),
                  stages: Sequence[tuple[Sequence[Any], float | None, Plan | None]] | None
                  = None, manual: bool = False
                  ) -> InStagePlan | list[InStagePlan]:
    """Plan the micro-batch program ``closed`` with ``policy`` on the tensor-parallel axes:
    the whole program (one plan every stage runs), or with ``stages`` each stage's part.

    Args:
        closed: ``(param leaves..., batch leaves...) -> loss`` of one data shard's micro-batch.
        param_paths: the parameter leaves' paths (``'h_0/attn/query/kernel'``).
        n_params: number of parameter leaves (the first inputs).
        mesh: the whole mesh; stage: its stage axis; policy: the module's policy.
        root: the root module's name in name stacks (stripped from module paths).
        rules: ``Constraints.rules`` for the in-stage search (:func:`stage_rules`).
        stages: per stage, ``(its equations, budget, plan)``: the stage's ops (the equations
            of its chunks) planned as one program under ``budget`` bytes a device (None:
            none), as a flat plan is: the search picks the stage's layouts, recompute groups
            and co-sharded blocks for one micro-batch's pass through its chunks; or ``plan``,
            the planner's plan of the same ops (:func:`~nnscaler_jax.pipeline.cut.plan_cut`
            priced the stage with it), run as it is.
        manual: the chunks run on each device's blocks (``Lowering(manual=True)``: inside a
            ``shard_map`` manual over the tensor-parallel axes too, the plan's collectives
            explicit), not under GSPMD.

    Raises:
        PlanError: the policy fails on the in-stage mesh (e.g. it assigns ops to the stage
            axis), nothing fits a stage's budget, or a tensor-parallel axis is unused by
            every stage (no dim it splits divides, or no split pays for itself).
    """
    sizes = mesh_axes(mesh)
    axes = tensor_axes(sizes, stage, policy)
    tp = {a: sizes[a] for a in axes}
    infos = [InputInfo(Role.VARIABLE, f"params/{p}", "params") for p in param_paths]
    infos += [InputInfo(Role.INPUT, f"args/{i}") for i in range(len(closed.jaxpr.invars) -
                                                                 n_params)]
    graph, _, sources = graph_with_sources(closed, infos, root=root)
    sub = _sub_mesh(mesh, axes)
    parts = [(graph, None, None)] if stages is None else \
        [(part_graph(graph, {i for e in eqns for i in sources.ops.get(id(e), ())}), budget,
          given) for eqns, budget, given in stages]
    plans = []
    for g, budget, given in parts:
        mapped = renumbered(given, g) if given is not None else None
        if mapped is not None:
            plans.append(mapped)
            continue
        if given is not None:
            warnings.warn(f"pipeline stage {len(plans)}: the planner's in-stage plan does not "
                          "match the traced stage's ops; planning the stage again under its "
                          "budget", stacklevel=4)
        try:
            plans.append(plan_spmd(g, sub, policy=policy, constraints=Constraints(
                rules=stage_rules(rules, None if stages is None else g),
                max_memory_per_device=budget)).plan)
        except PlanError as e:
            where = "" if stages is None else f" (stage {len(plans)})"
            raise _stage_error(policy, tp, f"failed{where}: {e}", "In-stage policies see "
                               f"only the tensor-parallel axes {list(tp)}: the stage axis "
                               f"'{stage}' and the data axes are pipelined / data-parallel "
                               "by the pipeline itself") from e
    _check_used(plans, policy, tp)
    out = []
    for (g, _, _), plan in zip(parts, plans, strict=True):
        low = Lowering(g, plan, sub, in_context=True, manual=manual)
        var_specs = []
        for t in graph.inputs[:n_params]:
            spec = plan.variable_spec(t.name)
            var_specs.append(tuple(spec) + (None,) * (t.ndim - len(spec)) if spec is not None
                             else (None,) * t.ndim)
        out.append(InStagePlan(axes, g, plan, LoweredEqns(low, sources), tuple(var_specs),
                               _body_specs(low)))
    return out[0] if stages is None else out


def stage_rules(rules: Sequence[Rule], part: Graph | None = None) -> tuple[Rule, ...]:
    """``Constraints.rules`` as the in-stage search takes them: without their recompute
    flags (the pipeline's layer rules: :mod:`~nnscaler_jax.pipeline.rules`), and for a
    stage's part only those selecting one of its ops (the whole program's were checked)."""
    out = tuple(replace(r, recompute=None) for r in rules)
    if part is None:
        return out
    return tuple(r for r in out if any(r.matches(op) for op in part.walk()))


def part_graph(graph: Graph, ids: set[int]) -> Graph:
    """The ops of ``graph`` with these ids (a stage's chunks), as a program: its inputs the
    values it reads and does not make (parameters first, in ``graph``'s order), its outputs
    the values it makes that other ops or the program's outputs read. Its ``meta`` names the
    inputs that lead with ``graph``'s batch (the earlier stages' activations:
    :data:`~nnscaler_jax.plan.policies.BATCH_INPUTS`), so its batch dims are found as the
    whole graph's are."""
    ops = tuple(op for op in graph.ops if op.id in ids)
    made = {t.id for op in ops for t in op.outputs}
    read: dict[int, Tensor] = {}
    for op in ops:
        read.update((t.id, t) for t in op.inputs if t.id not in made and t.role is not Role.CONST)
    order = {t.id: k for k, t in enumerate(graph.inputs)}
    inputs = sorted(read.values(), key=lambda t: (order.get(t.id, len(order)), t.id))
    later = {t.id for op in graph.ops if op.id not in ids for t in op.inputs}
    later |= {t.id for t in graph.outputs}
    outputs = tuple(t for op in ops for t in op.outputs if t.id in later)
    inside = {b for op in ops for b in op.boundary}
    consts = {t.id for op in ops for t in op.inputs if t.role is Role.CONST}
    led = batch_led(graph, [t for t in inputs if t.role is Role.VALUE])
    return Graph(ops, tuple(inputs), outputs,
                 tuple(b for b in graph.boundaries if b.id in inside),
                 tuple(c for c in graph.consts if c.id in consts), meta={BATCH_INPUTS: led})


def _check_used(plans: Sequence[Plan], policy: Any, tp: dict[str, int]) -> None:
    """Every tensor-parallel axis split by some stage's plan (else its devices compute the
    same everywhere, which the user should hear)."""
    used = {a for plan in plans for p in plan.ops for a, _ in p.split}
    for a, n in tp.items():
        if a in used:
            continue
        if policy in SEARCHES:  # the search's choice: no split pays for its collectives
            raise _stage_error(
                policy, tp, f"splits no op over mesh axis '{a}' (size {n}): at these "
                "sizes every split the search priced costs more in communication than it "
                "saves in compute, so each device of the axis would compute the same",
                f"Name the axis 'data' to run it data-parallel, use fewer devices on "
                f"'{a}', or policy='megatron' to split the heads and MLP over it anyway")
        raise _stage_error(
            policy, tp, f"splits no op over mesh axis '{a}' (size {n}): no dim the "
            "policy would split (attention heads, MLP hidden, ...) divides by it",
            f"Use a '{a}' size that divides the heads and hidden sizes, e.g. 2, or name "
            f"the axis 'data' to make it data-parallel")


def _body_specs(low: Lowering) -> dict:
    """``scan`` body input var -> the layout its first consumer reads (no partial sums)."""
    out = {}
    for op in low.graph.walk():
        if op.eqn is None or op.primitive != "scan":
            continue
        (body,) = op.regions
        for v, t in zip(op.eqn.params["jaxpr"].jaxpr.invars, body.inputs, strict=True):
            lay = low.consumer_layout(t.id)
            if lay is not None and t.ndim:
                out[v] = tuple(Layout(lay.dims).to_pspec())
    return out
