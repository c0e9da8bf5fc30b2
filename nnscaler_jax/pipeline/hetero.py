"""Pipelines over a cluster of several device kinds: stages sized to their devices.

A :class:`~nnscaler_jax.cost.devices.MixedCluster` is groups of devices of one kind each (4
A100-80G beside 4 V100-32G in one node over PCIe; 8 H100 nodes joined to 8 A100 nodes over
InfiniBand), its devices numbered group by group. A plan here is a pipeline of stages, each on
a run of those devices (``first``, ``devices``: tensor parallel ``tp`` x data parallel ``dp``
inside), the model's units (one per repeated block, with a prefix and a suffix:
:func:`~nnscaler_jax.pipeline.units.unit_parts`) cut into contiguous ranges, one per stage, run
1F1B over ``M`` micro-batches as the pipeline runtime runs a stage (its input kept per
micro-batch in flight, its forward recomputed in the backward). Each stage is priced with its
own devices' kind (units priced per kind: :func:`kind_units`), held to its own kind's memory,
and its transfers to the next stage priced over the link between them (inside a group its
NVLink, between groups the cluster's ``between``).

Three planners share one evaluator (:func:`price_stages`) and one cost model:

- ``auto`` (ours): every arrangement of the groups into stages (per group a stage count and a
  tensor parallel size, the groups in any order), every micro-batch count, and the boundaries
  placed by the stage DP (:func:`~nnscaler_jax.pipeline.stage_dp.place_stages`) with each
  stage's own kind's prices and budget (its layers in proportion to its speed where memory
  allows, more to the larger memory where it does not); then (:func:`realize`) each stage's
  ops planned for its kind by our search (layouts, recompute, co-sharding under its budget).
- ``metis``: the search space of Metis (Um et al., ATC'24): per-stage device type, data x tensor
  parallel per stage, layers partitioned by balanced compute (each stage's share of the model's
  compute in proportion to its devices' speed); no boundary placed by memory or transfers, no
  op-level decision (Megatron's tensor parallelism inside the stages).
- ``uniform``: heterogeneity-unaware: every device priced as the slowest kind with the smallest
  memory (:meth:`~nnscaler_jax.cost.devices.MixedCluster.slowest`), equal stages searched by
  the homogeneous stage DP (:func:`~nnscaler_jax.pipeline.stage_dp.search_stages`), then
  priced on the devices its stages land on (a stage whose devices span kinds runs at the
  slower's pace); Megatron inside the stages.

Ours also weighs no pipeline: the groups side by side (:func:`price_groups`), each the whole
model on its own share of the batch (in proportion to its speed where memory allows), their
gradients exchanged over the link between them once a step (Poplar's and FlashFlex's data
parallelism across kinds); such a plan has ``shares`` and runs as
``Constraints(batch_shares=...)`` (:class:`~nnscaler_jax.train.grouped_step.GroupStep`).

>>> import models
>>> from nnscaler_jax.capture.trace import trace
>>> from nnscaler_jax.cost.devices import cluster_preset
>>> spec = models.get("gpt", "tiny", n_layers=6)
>>> cluster = cluster_preset("a100-80g-4x+v100-32g-4x")
>>> units = kind_units(trace(spec.module, *spec.make_args()), cluster, batch=2)
>>> plan = plan_hetero(units, cluster, global_batch=16)
>>> sum(s.slot.devices for s in plan.stages), plan.fits
(8, True)
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from nnscaler_jax.cost.devices import MixedCluster
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.errors import NoFitError, PlanError
from nnscaler_jax.ir.graph import Graph
from nnscaler_jax.mesh.topology import LinkCost, all_reduce_time
from nnscaler_jax.pipeline.stage_dp import (
    StagePrices,
    place_stages,
    rank_stages,
    stage_prices,
)
from nnscaler_jax.pipeline.units import Unit, layer_units, sent_bytes, unit_parts

__all__ = ["PLANNERS", "HeteroPlan", "HeteroStage", "Slot", "candidates", "kind_units",
           "plan_hetero", "plan_realized", "price_groups", "price_stages", "realize",
           "stage_policy"]

PLANNERS = ("auto", "metis", "uniform")


@dataclass(frozen=True, slots=True)
class Slot:
    """A stage's devices: ``devices`` of them from ``first`` (the cluster's numbering), tensor
    parallel ``tp`` x data parallel ``devices / tp``."""

    first: int
    devices: int
    tp: int

    @property
    def dp(self) -> int:
        return self.devices // self.tp


@dataclass(frozen=True, slots=True)
class HeteroStage:
    """One priced stage.

    Attributes:
        slot: its devices. groups: the cluster's groups they belong to (one, but for a
            heterogeneity-unaware plan's stage spanning kinds). kind: the device it is priced
            as (the slowest of its groups').
        units / names: its units ``[a, b)`` and the first and last unit's names.
        time_s: forward + backward seconds per micro-batch (its tensor parallel all-reduces
            and its send to the next stage included). sync_s: its data-parallel gradient
            all-reduce, once a step.
        memory_bytes / budget_bytes: per device: parameters, gradients, optimizer state and
            the activations 1F1B keeps in flight; its kind's budget.
        policy / plan: after :func:`realize`, the in-stage policy and its plan of the
            stage's ops on its tensor-parallel devices (None: priced by the units).
    """

    slot: Slot
    groups: tuple[int, ...]
    kind: str
    units: tuple[int, int]
    names: tuple[str, str]
    time_s: float
    sync_s: float
    memory_bytes: float
    budget_bytes: float
    policy: str = ""
    plan: Any = None

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.budget_bytes


@dataclass(frozen=True)
class HeteroPlan:
    """A planner's pipeline on a mixed cluster, priced by :func:`price_stages`: step seconds
    ``sum t_s + (M - 1) max t_s + max sync_s`` (1F1B); or (``shares``) its groups side by side,
    each on its own rows, priced by :func:`price_groups`: ``M max t_s + max sync_s``."""

    planner: str
    cluster: str
    stages: tuple[HeteroStage, ...]
    microbatches: int
    microbatch_size: int
    step_time_s: float
    search_s: float = 0.0
    xla: dict | None = field(default=None, compare=False)
    shares: tuple[int, ...] | None = None

    @property
    def grouped(self) -> bool:
        """Data parallelism across the groups (:func:`price_groups`): each "stage" is a group
        running the whole model on its ``shares`` rows a step."""
        return self.shares is not None

    def rows(self, k: int) -> int:
        """Stage ``k``'s rows per micro-batch on one of its data-parallel replicas."""
        st = self.stages[k]
        total = self.shares[k] // self.microbatches if self.shares else self.microbatch_size
        return total // st.slot.dp

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.stages)

    @property
    def memory_bytes_per_device(self) -> float:
        return max(s.memory_bytes for s in self.stages)

    def mesh(self, devices: Sequence[Any]) -> Any:
        """The plan's stages as a ``(stage, data, model)`` mesh over ``devices`` numbered as
        the cluster's (``devices[i]``: the cluster's device ``i``, e.g. ``jax.devices()`` labelled
        by :meth:`~nnscaler_jax.cost.devices.MixedCluster.kinds`): stage ``k`` on its slot's
        devices, data-parallel major, tensor-parallel minor (axes of size 1 left out).

        Raises:
            PlanError: stages of different shapes (one mesh axis cannot hold them: a plan of
                ``runnable=False``), or too few devices.
        """
        import jax
        import numpy as np

        shapes = {(s.slot.dp, s.slot.tp) for s in self.stages}
        if len(shapes) != 1:
            raise PlanError(f"{self.planner} on {self.cluster}: stages of shapes "
                            f"{sorted(shapes)} (data x tensor parallel) do not make one mesh "
                            "with a stage axis; plan without runnable=False")
        need = max(s.slot.first + s.slot.devices for s in self.stages)
        if len(devices) < need:
            raise PlanError(f"{self.planner} on {self.cluster}: {len(devices)} devices, the "
                            f"plan places stages on devices 0..{need - 1}")
        ((dp, tp),) = shapes
        grid = np.asarray([[devices[s.slot.first + i * tp + j] for i in range(dp)
                            for j in range(tp)] for s in self.stages], dtype=object)
        # (grouped: the groups are the first data axis, Constraints.batch_shares' axis)
        names = (("data",) + (("replica",) if dp > 1 else ()) if self.grouped else
                 ("stage",) + (("data",) if dp > 1 else ())) + (("model",) if tp > 1 else ())
        return jax.sharding.Mesh(grid.reshape((len(self.stages),)
                                              + tuple(k for k in (dp, tp) if k > 1)), names)

    def constraints(self, graph: Graph) -> Any:
        """What ``auto_parallel`` runs this plan with on :meth:`mesh`, at the precision
        ``graph`` was captured at (what the plan was priced for). Grouped: its batch
        shares (:class:`~nnscaler_jax.train.grouped_step.GroupStep`) and micro-batches.
        Else 1F1B over its micro-batches, its stages cut where its units start
        (``pipeline_pivots``: the blocks' module paths), one program per stage (the
        host-dispatched executor, each stage's program on its own devices: the base for
        stages of different kinds), and after
        :func:`realize` each stage's plan for its kind (``stage_plans``: the runtime runs
        them; unrealized, it plans each stage itself with the wrapper's policy)."""
        from nnscaler_jax.capture.precision import UNKNOWN, graph_precision
        from nnscaler_jax.constraints import Constraints
        from nnscaler_jax.ir.layers import variable_casts
        from nnscaler_jax.pipeline.cut import first_positions

        precision = graph_precision(graph)
        precision = None if precision == UNKNOWN else precision
        if self.grouped:
            return Constraints(batch_shares=self.shares, microbatches=self.microbatches
                               if self.microbatches > 1 else None, precision=precision)
        parts = unit_parts(graph, blocks=True)
        casts = variable_casts(graph)  # (the runtime makes a weight's cast where it is read)
        paths = ["" if op.id in casts else op.module_path for op in graph.ops]
        first, at = first_positions(paths), {op.id: i for i, op in enumerate(graph.ops)}
        pivots = []
        for st in self.stages[1:]:
            name, ops = parts[st.units[0]]
            start = min(at[o.id] for o in ops if o.id not in casts)
            steps = paths[start].split("/") if paths[start] else []
            # the outermost module starting where the stage does (T5's suffix: its
            # decoder/final_layer_norm, not the decoder)
            pivot = next((q for q in ("/".join(steps[:k]) for k in range(1, len(steps) + 1))
                          if first[q] == start), None)
            if pivot is None:
                raise PlanError(f"{self.planner} on {self.cluster}: stage {len(pivots) + 1} "
                                f"starts at unit {name!r}, whose first op belongs to no module "
                                "that starts there; the runtime cuts only at module starts")
            pivots.append(pivot)
        plans = tuple(s.plan for s in self.stages)
        return Constraints(pipeline_stages=len(self.stages), schedule="1f1b",
                           microbatches=self.microbatches, pipeline_pivots=tuple(pivots),
                           pipeline_executor="per-stage", precision=precision,
                           stage_plans=plans if all(p is not None for p in plans) else ())

    def to_json(self) -> dict:
        return {"planner": self.planner, "cluster": self.cluster, "fits": self.fits,
                "step_time_s": self.step_time_s, "microbatches": self.microbatches,
                "microbatch_size": self.microbatch_size, "search_s": self.search_s,
                "shares": list(self.shares) if self.shares else None,
                "memory_bytes_per_device": self.memory_bytes_per_device,
                "stages": [{"kind": s.kind, "groups": list(s.groups),
                            "devices": [s.slot.first, s.slot.first + s.slot.devices - 1],
                            "tp": s.slot.tp, "dp": s.slot.dp, "units": list(s.units),
                            "layers": list(s.names),
                            "time_s": s.time_s, "sync_s": s.sync_s,
                            "memory_bytes": s.memory_bytes, "budget_bytes": s.budget_bytes}
                           for s in self.stages]}

    def __str__(self) -> str:
        g = 2**30
        what = (f"{len(self.stages)} data-parallel groups, rows {'/'.join(map(str, self.shares))}"
                if self.grouped else f"{len(self.stages)} stages")
        lines = [(f"{self.planner} on {self.cluster}: {what}, "
                  f"{self.microbatches} micro-batches of {self.microbatch_size}, step "
                  f"{self.step_time_s:.3f} s{'' if self.fits else ' (over memory)'}")]
        for k, s in enumerate(self.stages):
            lines.append(
                f"  {'group' if self.grouped else 'stage'} {k}: {s.kind} x {s.slot.devices} "
                f"(devices {s.slot.first}.."
                f"{s.slot.first + s.slot.devices - 1}, tp {s.slot.tp} x dp {s.slot.dp}), "
                f"units {s.units[0]}..{s.units[1] - 1} ({s.names[0]} .. {s.names[1]}), "
                f"{s.time_s * 1e3:.1f} ms/micro-batch, {s.memory_bytes / g:.1f} of "
                f"{s.budget_bytes / g:.1f} GiB")
        return "\n".join(lines)


def kind_units(graph: Graph, cluster: MixedCluster, batch: int) -> list[list[Unit]]:
    """Per group of ``cluster``, ``graph``'s units (traced at ``batch``; a unit per repeated
    block: :func:`~nnscaler_jax.pipeline.units.unit_parts`) priced on its kind, each sending
    on what a stage ending there sends (:func:`~nnscaler_jax.pipeline.units.sent_bytes` per
    sample: a T5 decoder block the encoder output and position bias too, not only its own
    output; a value without a batch dim counted per sample too)."""
    sent = sent_bytes(graph, [ops for _, ops in unit_parts(graph, blocks=True)])
    priced: dict[str, list[Unit]] = {}
    out = []
    for g in cluster.groups:
        if g.device.name not in priced:
            units = layer_units(graph, batch=batch, blocks=True,
                                model=CostModel.for_axes({"x": 1}, device=g.device))
            priced[g.device.name] = [replace(u, out_bytes=b / batch) if k < len(units) - 1
                                     else u for k, (u, b) in enumerate(zip(units, sent,
                                                                          strict=True))]
        out.append(priced[g.device.name])
    return out


def _budgets(cluster: MixedCluster, budget: float | Sequence[float] | None) -> list[float]:
    """Per group: ``budget`` (the user's, for every device; or one per group), else its
    device's memory less the reserve (:func:`~nnscaler_jax.cost.devices.memory_reserve`)."""
    if isinstance(budget, Sequence):
        if len(budget) != len(cluster.groups):
            raise PlanError(f"{len(budget)} budgets for the {len(cluster.groups)} groups of "
                            f"{cluster.name}: give one per group, or one for every device")
        return [float(b) for b in budget]
    return cluster.budgets(budget)


def _groups(cluster: MixedCluster, slot: Slot) -> tuple[int, ...]:
    return tuple(sorted({cluster.group_of(d) for d in range(slot.first,
                                                              slot.first + slot.devices)}))


def _link(cluster: MixedCluster, a: int, b: int) -> LinkCost:
    """The link between devices ``a`` and ``b``: one group's node (NVLink), across its nodes,
    or between groups."""
    ga, gb = cluster.group_of(a), cluster.group_of(b)
    if ga != gb:
        return cluster.between
    start = _start(cluster, ga)
    nodes = cluster.groups[ga].nodes
    same = (a - start) // nodes.devices_per_node == (b - start) // nodes.devices_per_node
    return nodes.intra if same else nodes.inter


def _start(cluster: MixedCluster, group: int) -> int:
    """The cluster's number of the group's first device."""
    return sum(g.count for g in cluster.groups[:group])


def _group_slots(cluster: MixedCluster, group: int, stages: int) -> list[list[Slot]]:
    """Per tensor parallel size (a power of two inside a node), the group's devices as
    ``stages`` equal slots."""
    g, first = cluster.groups[group], _start(cluster, group)
    d = g.count // stages
    return [[Slot(first + i * d, d, tp) for i in range(stages)]
            for tp in _powers(min(d, g.nodes.devices_per_node), d)]


def _sync(cluster: MixedCluster, slot: Slot, grad_bytes: float) -> float:
    """The slot's data-parallel gradient all-reduce, at its slowest link's pace."""
    if slot.dp == 1:
        return 0.0
    link = _slowest(cluster, [(slot.first, d) for d in range(slot.first,
                                                            slot.first + slot.devices)])
    return all_reduce_time(link, slot.dp, grad_bytes)


def _speed(cluster: MixedCluster, group: int) -> float:
    """A group's device's 16-bit matmul FLOP/s as reached (peak x efficiency)."""
    d = cluster.groups[group].device
    return d.flops * d.efficiency


def _tp_link(cluster: MixedCluster, slot: Slot) -> LinkCost:
    """The link the slot's tensor-parallel collectives run at: the slowest within a run of
    ``tp`` consecutive devices (the minor mesh axis)."""
    return _slowest(cluster, [(d, d + i) for d in range(slot.first, slot.first + slot.devices,
                                                        slot.tp) for i in range(slot.tp)])


def _step(stages: Sequence[HeteroStage], microbatches: int, grouped: bool = False) -> float:
    """1F1B: ``sum t_s + (M - 1) max t_s`` and the slowest gradient all-reduce; ``grouped``
    (side by side): ``M max t_s`` and it."""
    times = [s.time_s for s in stages]
    run = microbatches * max(times) if grouped else \
        sum(times) + (microbatches - 1) * max(times)
    return run + max(s.sync_s for s in stages)


def _rows(slot: Slot, microbatch_size: int) -> int:
    """Each data-parallel replica's rows of a micro-batch.

    Raises:
        PlanError: ``dp`` does not divide the micro-batch.
    """
    if microbatch_size % slot.dp or microbatch_size < slot.dp:
        raise PlanError(f"a stage on devices {slot.first}..{slot.first + slot.devices - 1} "
                        f"runs {slot.dp}-way data parallel, which does not divide a micro-batch "
                        f"of {microbatch_size}: choose micro-batches of a multiple of {slot.dp}")
    return microbatch_size // slot.dp


def _slot_prices(units_by_group: Sequence[list[Unit]], cluster: MixedCluster, slot: Slot,
                 nxt: Slot | None, mb: int, optimizer_bytes: float
                 ) -> tuple[int, StagePrices]:
    """The slowest of the slot's groups and its prices at micro-batch ``mb`` (each device's
    share ``mb / dp``), sending to ``nxt`` over their link: as the pipeline runtime runs a
    stage, keeping its input per micro-batch in flight and recomputing its forward in the
    backward (:func:`realize` and :func:`~nnscaler_jax.train.xla_gpu.check_mixed_stages`
    plan and compile it so)."""
    groups = _groups(cluster, slot)
    slow = min(groups, key=lambda k: _speed(cluster, k))
    last = slot.first + slot.devices - 1
    send = _link(cluster, last, nxt.first) if nxt is not None else cluster.between
    return slow, stage_prices(units_by_group[slow], slot.tp, _rows(slot, mb), optimizer_bytes,
                              _tp_link(cluster, slot), send, True)


def _slowest(cluster: MixedCluster, pairs: Sequence[tuple[int, int]]) -> LinkCost:
    """The slowest link between the device pairs (a collective over them runs at its pace)."""
    return max((_link(cluster, a, b) for a, b in pairs), key=lambda ln: ln.beta_s_per_byte)


def price_stages(planner: str, units_by_group: Sequence[list[Unit]], cluster: MixedCluster,
                 slots: Sequence[Slot], bounds: Sequence[tuple[int, int]],
                 microbatches: int, microbatch_size: int, *,
                 budget: float | None = None, optimizer_bytes: float = 3.0) -> HeteroPlan:
    """Price ``slots`` running units ``bounds`` 1F1B: each stage on its slowest kind's units
    (:func:`_slot_prices`), held to its kind's budget."""
    S, M = len(slots), microbatches
    budgets = _budgets(cluster, budget)
    stages = []
    for k, (slot, (a, b)) in enumerate(zip(slots, bounds, strict=True)):
        nxt = slots[k + 1] if k + 1 < S else None
        slow, pr = _slot_prices(units_by_group, cluster, slot, nxt, microbatch_size,
                                optimizer_bytes)
        groups = _groups(cluster, slot)
        cap = min(budgets[g] for g in groups)
        t = float(pr.time[a, b])
        mem = float(pr.state[a, b] + min(S - k, M) * pr.act[a, b] + pr.work[a, b])
        sync = _sync(cluster, slot, float(pr.grad[a, b]))
        names = (units_by_group[slow][a].name, units_by_group[slow][b - 1].name)
        stages.append(HeteroStage(slot, groups, cluster.groups[slow].device.name, (a, b), names,
                                  t, sync, mem, cap))
    return HeteroPlan(planner, cluster.name, tuple(stages), M, microbatch_size,
                      _step(stages, M))


def price_groups(planner: str, units_by_group: Sequence[list[Unit]], cluster: MixedCluster,
                 slots: Sequence[Slot], shares: Sequence[int], microbatches: int, *,
                 recompute: bool = False, budget: float | None = None,
                 optimizer_bytes: float = 3.0) -> HeteroPlan:
    """Data parallelism across the groups with uneven batch shares (as
    :class:`~nnscaler_jax.train.grouped_step.GroupStep` runs it): slot ``k`` (one group's
    devices) runs every unit on ``shares[k]`` rows a step, ``microbatches`` after another,
    priced on its kind (``recompute``: each micro-batch's forward again in its backward),
    holding the whole model's state; its gradients all-reduced inside it, then each group's
    sent to every other over the cluster's ``between`` link.

    Raises:
        PlanError: a share that its micro-batches x data-parallel replicas do not divide.
    """
    M, n, G = microbatches, len(units_by_group[0]), len(slots)
    budgets = _budgets(cluster, budget)
    between = cluster.between
    stages = []
    for slot, r in zip(slots, shares, strict=True):
        g = cluster.group_of(slot.first)
        if r % M:
            raise PlanError(f"{M} micro-batches do not divide group {g}'s {r} rows")
        pr = stage_prices(units_by_group[g], slot.tp, _rows(slot, r // M), optimizer_bytes,
                          _tp_link(cluster, slot), between, recompute)
        grad = float(pr.grad[0, n])
        inner = _sync(cluster, slot, grad)
        cross = (G - 1) * (between.alpha_s + grad * between.beta_s_per_byte)
        units = units_by_group[g]
        stages.append(HeteroStage(slot, (g,), cluster.groups[g].device.name, (0, n),
                                  (units[0].name, units[-1].name), float(pr.time[0, n]),
                                  inner + cross,
                                  float(pr.state[0, n] + pr.act[0, n] + pr.work[0, n]),
                                  budgets[g]))
    return HeteroPlan(planner, cluster.name, tuple(stages), M, sum(shares) // M,
                      _step(stages, M, grouped=True), shares=tuple(int(r) for r in shares))


def _compositions(total: int, steps: Sequence[int]) -> list[tuple[int, ...]]:
    """Every ``(r_0, ..)`` summing to ``total``, ``r_k`` a positive multiple of ``steps[k]``."""
    if len(steps) == 1:
        return [(total,)] if total >= steps[0] and total % steps[0] == 0 else []
    return [(r,) + rest for r in range(steps[0], total, steps[0])
            for rest in _compositions(total - r, steps[1:])]


def _grouped(units_by_group, cluster, global_batch, budget, optimizer_bytes, equal: bool
             ) -> list[HeteroPlan]:
    """Ours, besides pipelines: the groups side by side (:func:`price_groups`), each with one
    tensor parallel size (inside a node), every split of the batch into shares, micro-batch
    count and recompute choice; the fastest that fits for each (tensor parallel sizes,
    micro-batches). ``equal``: groups of one shape (what one mesh runs)."""
    opts = [[slots[0] for slots in _group_slots(cluster, k, 1)]
            for k in range(len(cluster.groups))]
    out = []
    for slots in itertools.product(*opts):
        if equal and len({(s.devices, s.tp) for s in slots}) != 1:
            continue
        for M in _powers(global_batch, global_batch):
            best = None
            for shares in _compositions(global_batch, [M * s.dp for s in slots]):
                for rc in (False, True):
                    plan = price_groups("auto", units_by_group, cluster, slots, shares, M,
                                        recompute=rc, budget=budget,
                                        optimizer_bytes=optimizer_bytes)
                    if plan.fits and (best is None or plan.step_time_s < best.step_time_s):
                        best = plan
            if best is not None:
                out.append(best)
    return out


def _powers(limit: int, of: int) -> list[int]:
    """Powers of two up to ``limit`` dividing ``of``."""
    return [t for t in (1, 2, 4, 8, 16) if t <= limit and of % t == 0]


def _arrangements(cluster: MixedCluster, n_units: int, equal: bool = False
                  ) -> list[list[Slot]]:
    """Every way to run each group as stages of one tensor parallel size (stage count dividing
    its devices, tensor parallel inside a node), the groups in any order, at least one unit
    a stage; ``equal``: only those whose stages all have the same devices and tensor parallel
    size (what one mesh with a stage axis runs: :meth:`HeteroPlan.mesh`)."""
    per_group = [[slots for S in range(1, g.count + 1) if g.count % S == 0
                  for slots in _group_slots(cluster, k, S)]
                 for k, g in enumerate(cluster.groups)]
    out = []
    for order in itertools.permutations(range(len(cluster.groups))):
        for pick in itertools.product(*(per_group[k] for k in order)):
            slots = [s for stages in pick for s in stages]
            same = len({(s.devices, s.tp) for s in slots}) == 1
            if len(slots) <= n_units and (same or not equal):
                out.append(slots)
    return out


def _microbatches(global_batch: int, slots: Sequence[Slot]) -> list[tuple[int, int]]:
    """``(M, size)``: micro-batch counts (powers of two, or the whole batch one sample each)
    whose size every stage's data parallel degree divides."""
    lcm = math.lcm(*(s.dp for s in slots))
    return [(M, global_batch // M) for M in range(1, global_batch + 1)
            if global_batch % M == 0 and (M & (M - 1) == 0 or M == global_batch)
            and (global_batch // M) % lcm == 0]


def _prices(units_by_group, cluster: MixedCluster, slots: Sequence[Slot], mb: int,
            optimizer_bytes: float) -> list[StagePrices]:
    """Each slot's stage prices at micro-batch ``mb``, sending to the next slot."""
    return [_slot_prices(units_by_group, cluster, s, slots[k + 1] if k + 1 < len(slots)
                         else None, mb, optimizer_bytes)[1] for k, s in enumerate(slots)]


def _placements(prices: Sequence[StagePrices], caps: Sequence[float], M: int, levels: int,
                stop: Callable[[float], bool] = lambda t: False):
    """The stage DP's boundaries for each slowest-stage bound it tries (quantiles of the
    stages' times, as :func:`~nnscaler_jax.pipeline.stage_dp.search_stages` enumerates them,
    smallest first; ``stop(t_max)``: no further), 1F1B keeping ``min(S - k, M)`` inputs on
    stage ``k``."""
    S, n = len(prices), prices[0].time.shape[0] - 1
    finite = np.concatenate([pr.time[np.isfinite(pr.time)] for pr in prices])
    lo = max(min(float(pr.time[i, i + 1]) for pr in prices) for i in range(n))
    for t_max in np.unique(np.quantile(finite[finite >= lo], np.linspace(0, 1, levels))):
        if stop(float(t_max)):
            return
        r = place_stages(prices, caps, float(t_max), lambda k: min(S - k, M))
        if r is not None:
            yield r[1]


def rebalance(real: HeteroPlan, plan: HeteroPlan, units_by_group: Sequence[list[Unit]],
              cluster: MixedCluster, *, budget: float | Sequence[float] | None = None,
              optimizer_bytes: float = 3.0, t_max_levels: int = 48) -> HeteroPlan | None:
    """Ours' boundaries placed again where the stages' own plans (``real``, :func:`realize`'s
    of ``plan``) run faster or slower than the units priced them: the stage DP on ``plan``'s
    arrangement and micro-batches, each stage's unit times scaled by its realized / priced
    time, held to ``budget`` (:func:`price_stages`'). Returns the boundaries fastest so
    scaled, priced by the units as :func:`candidates` prices (to :func:`realize`), or None
    where they are ``plan``'s own (or ``plan`` is not ours, or runs groups side by side)."""
    if plan.grouped or plan.planner != "auto":
        return None
    slots = [st.slot for st in plan.stages]
    M, mb = plan.microbatches, plan.microbatch_size
    scale = [r.time_s / p.time_s if p.time_s > 0 else 1.0
             for r, p in zip(real.stages, plan.stages, strict=True)]
    prices = [replace(pr, time=pr.time * q) for pr, q in
              zip(_prices(units_by_group, cluster, slots, mb, optimizer_bytes), scale,
                  strict=True)]
    budgets = _budgets(cluster, budget)
    caps = [min(budgets[g] for g in st.groups) for st in plan.stages]
    best, chosen = math.inf, None
    for bounds in _placements(prices, caps, M, t_max_levels):
        cand = price_stages("auto", units_by_group, cluster, slots, bounds, M, mb,
                            budget=budget, optimizer_bytes=optimizer_bytes)
        scaled = _step([replace(st, time_s=st.time_s * q)
                        for st, q in zip(cand.stages, scale, strict=True)], M)
        if cand.fits and scaled < best:
            best, chosen = scaled, cand
    if chosen is None or [st.units for st in chosen.stages] == [st.units for st in plan.stages]:
        return None
    return chosen


def _search(units_by_group, cluster, global_batch, budget, optimizer_bytes, equal: bool,
            levels: int) -> list[HeteroPlan]:
    """``auto``: arrangements x micro-batches x boundaries by the stage DP (slowest-stage
    bounds enumerated as :func:`~nnscaler_jax.pipeline.stage_dp.search_stages` does): the
    best boundaries found for each (arrangement, micro-batches) that fits."""
    n = len(units_by_group[0])
    budgets = _budgets(cluster, budget)
    found: dict[tuple, HeteroPlan] = {}
    best = math.inf
    for slots in _arrangements(cluster, n, equal):
        caps = [min(budgets[g] for g in _groups(cluster, s)) for s in slots]
        for M, mb in _microbatches(global_batch, slots):
            prices = _prices(units_by_group, cluster, slots, mb, optimizer_bytes)
            # (the best so far as the placements go on: read when each is tried)
            for bounds in _placements(prices, caps, M, levels,
                                      stop=lambda t, M=M: (M - 1) * t >= best):  # noqa: B023
                plan = price_stages("auto", units_by_group, cluster, slots, bounds, M, mb,
                                    budget=budget, optimizer_bytes=optimizer_bytes)
                key = (tuple(slots), M)
                if plan.fits and (key not in found
                                  or plan.step_time_s < found[key].step_time_s):
                    found[key] = plan
                    best = min(best, plan.step_time_s)
    return sorted(found.values(), key=lambda p: p.step_time_s)


def _balanced(units_by_group, cluster: MixedCluster, slots: Sequence[Slot]
              ) -> tuple[tuple[int, int], ...] | None:
    """Metis's layer partition: contiguous units, each stage's share of the model's compute in
    proportion to its devices' speed (devices x the kind's peak x efficiency); None when a
    stage would get no unit."""
    speed = [s.devices * min(_speed(cluster, g) for g in _groups(cluster, s)) for s in slots]
    cost = np.cumsum([0.0] + [u.time_s for u in units_by_group[0]])
    n, total = len(cost) - 1, cost[-1]
    cuts, share = [0], 0.0
    for w in speed[:-1]:
        share += w / sum(speed)
        cuts.append(int(np.argmin(np.abs(cost - share * total))))
    cuts.append(n)
    bounds = tuple(itertools.pairwise(cuts))
    return bounds if all(b > a for a, b in bounds) else None


def _metis(units_by_group, cluster, global_batch, budget, optimizer_bytes, equal: bool
           ) -> list[HeteroPlan]:
    out = []
    for slots in _arrangements(cluster, len(units_by_group[0]), equal):
        bounds = _balanced(units_by_group, cluster, slots)
        if bounds is None:
            continue
        for M, mb in _microbatches(global_batch, slots):
            plan = price_stages("metis", units_by_group, cluster, slots, bounds, M, mb,
                                budget=budget, optimizer_bytes=optimizer_bytes)
            if plan.fits:
                out.append(plan)
    return sorted(out, key=lambda p: p.step_time_s)


def _uniform(units_by_group, cluster, global_batch, budget, optimizer_bytes, _equal: bool
             ) -> list[HeteroPlan]:
    """The homogeneous stage search's choices on the slowest kind, in its own order (it
    sees no other kind), each priced where its stages land."""
    slow = cluster.slowest()
    ref = min(range(len(cluster.groups)), key=lambda k: _speed(cluster, k))
    try:
        ranked = rank_stages(units_by_group[ref], cluster.devices, global_batch,
                             min(_budgets(cluster, budget)), max_tp=slow.devices_per_node,
                             optimizer_bytes=optimizer_bytes, intra=slow.intra,
                             inter=slow.inter, recompute=True)
    except PlanError:
        return []
    priced = [price_stages("uniform", units_by_group, cluster,
                           [Slot(s * c.tp * c.dp, c.tp * c.dp, c.tp) for s in range(c.stages)],
                           c.bounds, c.microbatches, c.microbatch_size * c.dp, budget=budget,
                           optimizer_bytes=optimizer_bytes) for c in ranked]
    return [p for p in priced if p.fits]


def candidates(units_by_group: Sequence[list[Unit]], cluster: MixedCluster,
               global_batch: int, *, planner: str = "auto", budget: float | None = None,
               optimizer_bytes: float = 3.0, t_max_levels: int = 48,
               runnable: bool = True) -> list[HeteroPlan]:
    """The ``planner``'s pipelines (:data:`PLANNERS`) that fit as it prices them, in its order
    of preference (ours and Metis's: fastest first; the unaware one: by its own model of the
    slowest kind); :func:`plan_hetero` has the arguments.

    Raises:
        PlanError: an unknown planner.
    """
    if planner not in PLANNERS:
        raise PlanError(f"unknown planner {planner!r} for a cluster of several kinds "
                        f"({cluster.name}); choose from {', '.join(PLANNERS)}")
    args = (units_by_group, cluster, global_batch, budget, optimizer_bytes, runnable)
    if planner == "auto":  # (pipelines, and the groups side by side on uneven shares)
        return sorted(_search(*args, t_max_levels) + _grouped(*args),
                      key=lambda p: p.step_time_s)
    return _metis(*args) if planner == "metis" else _uniform(*args)


def _no_fit(planner: str, cluster: MixedCluster, units: int, global_batch: int,
            budget: float | None, smallest: float | None = None) -> NoFitError:
    caps = ", ".join(f"{g.name} {b / 2**30:.1f} GiB"
                     for g, b in zip(cluster.groups, _budgets(cluster, budget), strict=True))
    return NoFitError(f"{planner} on {cluster.name}: no pipeline of the model's {units} units "
                      f"fits the devices' budgets ({caps}) at global batch {global_batch}. "
                      "Fix: a smaller batch, more devices, or a larger budget (--budget)",
                      smallest_bytes=smallest)


def plan_hetero(units_by_group: Sequence[list[Unit]], cluster: MixedCluster, global_batch: int,
                *, planner: str = "auto", budget: float | None = None,
                optimizer_bytes: float = 3.0, t_max_levels: int = 48,
                runnable: bool = True) -> HeteroPlan:
    """The ``planner``'s pipeline (:data:`PLANNERS`) of the units on ``cluster``: its first
    choice (:func:`candidates`).

    Args:
        units_by_group: :func:`kind_units`. global_batch: samples per step.
        budget: bytes per device for every kind (None: each kind's memory less the reserve).
        optimizer_bytes: gradient + optimizer state per parameter byte (Adam, fp32: 3).
        runnable: only stages of one shape (devices, tensor parallel size), which the
            pipeline runtime runs over one mesh (:meth:`HeteroPlan.mesh`,
            :meth:`HeteroPlan.constraints`; the uniform planner's always are); False also
            weighs stages of different shapes, which no runtime here runs yet.

    Raises:
        PlanError: an unknown planner. NoFitError: nothing the planner tries fits.
    """
    t0 = time.perf_counter()
    found = candidates(units_by_group, cluster, global_batch, planner=planner, budget=budget,
                       optimizer_bytes=optimizer_bytes, t_max_levels=t_max_levels,
                       runnable=runnable)
    if not found:
        raise _no_fit(planner, cluster, len(units_by_group[0]), global_batch, budget)
    return replace(found[0], search_s=time.perf_counter() - t0)


def plan_realized(units_by_group: Sequence[list[Unit]], cluster: MixedCluster,
                  global_batch: int, graph_at: Callable[[int], Graph], *,
                  planner: str = "auto", budget: float | None = None, tries: int = 8,
                  judge: Callable[[HeteroPlan], dict] | None = None, **kw: Any
                  ) -> HeteroPlan:
    """The planner's first choice whose stages, planned for their kinds (:func:`realize`),
    fit: its :func:`candidates` realized in its order, at most ``tries`` of them (``kw``:
    :func:`plan_hetero`'s other arguments). Ours (``auto``), when none fits, looks again at
    stages that fit only 2 or 4 times the budgets as the units price them (Megatron's splits,
    nothing co-sharded): its in-stage search may fit them, co-sharding and recomputing. Ours
    then moves its boundaries once by what the stages' plans found (:func:`rebalance`) and
    keeps the moved pipeline where it fits, realized, and is faster.
    ``judge`` (e.g. ``lambda p: check_mixed_stages(p, graph_at)``, XLA's GPU compiler): a plan
    fits only where its answer's ``"fits"`` is true too, which the plan keeps as ``xla``.

    Raises:
        NoFitError: none of them fits realized (the smallest realized peak in it).
    """
    t0 = time.perf_counter()
    smallest = None
    caps = _budgets(cluster, budget)
    seen: set[tuple] = set()
    opt = kw.get("optimizer_bytes", 3.0)

    def realized(plan: HeteroPlan) -> tuple[HeteroPlan, dict | None, bool]:
        real = realize(plan, graph_at, units_by_group, cluster, budget=budget,
                       optimizer_bytes=opt)
        verdict = judge(real) if judge is not None and real.fits else None
        return real, verdict, real.fits and (verdict is None or bool(verdict.get("fits")))

    for relax in (1, 2, 4) if planner == "auto" else (1,):
        found = candidates(units_by_group, cluster, global_batch, planner=planner,
                           budget=[c * relax for c in caps], **kw)
        fresh = []
        for p in found:  # (those realized under a tighter relaxation are not again)
            key = (tuple((s.slot, s.units) for s in p.stages), p.microbatches, p.shares)
            if key not in seen:
                seen.add(key)
                fresh.append(p)
        for plan in fresh[:tries]:
            real, verdict, ok = realized(plan)
            if ok:
                moved = rebalance(real, plan, units_by_group, cluster,
                                  budget=[c * relax for c in caps], optimizer_bytes=opt)
                if moved is not None:
                    again, said, fine = realized(moved)
                    if fine and again.step_time_s < real.step_time_s:
                        real, verdict = again, said
                return replace(real, search_s=time.perf_counter() - t0, xla=verdict)
            peak = real.memory_bytes_per_device if verdict is None else max(
                (st.get("peak_bytes", 0) for st in verdict.get("stages", ())), default=0)
            smallest = peak if smallest is None else min(smallest, peak)
    raise _no_fit(planner, cluster, len(units_by_group[0]), global_batch, budget, smallest)


def stage_policy(planner: str) -> str:
    """The in-stage policy a planner's stages run: ours the search (``auto``: layouts,
    recompute and co-sharding chosen under the stage's budget), the baselines Megatron's tensor
    parallelism (``megatron``)."""
    return "auto" if planner == "auto" else "megatron"


def realize(plan: HeteroPlan, graph_at: Callable[[int], Graph],
            units_by_group: Sequence[list[Unit]], cluster: MixedCluster, *,
            budget: float | None = None, optimizer_bytes: float = 3.0) -> HeteroPlan:
    """``plan`` with each stage's ops planned on its tensor-parallel devices by its planner's
    in-stage policy (:func:`stage_policy`), as the runtime plans a stage: one micro-batch of
    one data-parallel replica (the stage's ops, :func:`~nnscaler_jax.pipeline.units.
    unit_parts`, of ``graph_at(rows)``: the model traced at ``microbatch_size / dp`` rows),
    priced by the cost model of its devices' kind (its links; gradients held, accumulated
    over the micro-batches), under its budget less the stage inputs 1F1B keeps for its other
    micro-batches in flight. Each stage's time and memory become its plan's (with its forward
    again in the backward, priced as a third of its compute, its send to the next stage; its
    gradient all-reduce as priced before). A stage whose search finds nothing within its
    budget keeps its smallest estimate (the plan does not fit).

    Raises:
        PlanError: no repeated blocks (:func:`~nnscaler_jax.pipeline.units.unit_parts`).
    """
    from nnscaler_jax.constraints import Constraints
    from nnscaler_jax.mesh.topology import MeshSpec
    from nnscaler_jax.pipeline.in_stage import part_graph
    from nnscaler_jax.search.entry import plan_spmd

    S, M, mb = len(plan.stages), plan.microbatches, plan.microbatch_size
    caps = _budgets(cluster, budget)
    traced: dict[int, tuple[Graph, list]] = {}
    out = []
    for k, st in enumerate(plan.stages):
        (a, b), slot = st.units, st.slot
        nxt = plan.stages[k + 1].slot if k + 1 < S and not plan.grouped else None
        slow, pr = (cluster.group_of(slot.first), None) if plan.grouped else \
            _slot_prices(units_by_group, cluster, slot, nxt, mb, optimizer_bytes)
        units, rows = units_by_group[slow], plan.rows(k)
        if rows not in traced:
            g = graph_at(rows)
            traced[rows] = (g, [ops for _, ops in unit_parts(g, blocks=True)])
        graph, parts = traced[rows]
        send = _link(cluster, slot.first + slot.devices - 1, nxt.first) if nxt else None
        p2p = 2 * (send.alpha_s + units[b - 1].out_bytes * rows * send.beta_s_per_byte) \
            if send is not None else 0.0
        # (the other inputs in flight; a group runs its micro-batches one after another)
        kept = 0.0 if pr is None else (min(S - k, M) - 1) * float(pr.act[a, b])
        cm = CostModel(MeshSpec(("model",), (slot.tp,), (_tp_link(cluster, slot),)),
                       device=cluster.groups[slow].device, grads_held=M > 1)
        policy = stage_policy(plan.planner)
        g = part_graph(graph, {op.id for part in parts[a:b] for op in part})
        cap = min(caps[i] for i in st.groups)
        try:
            sp = plan_spmd(g, {"model": slot.tp}, policy=policy, cost_model=cm,
                           constraints=Constraints(max_memory_per_device=(
                               cap - kept) if policy == "auto" else None)).plan
            # (+ its forward again in the backward, a third of its compute, where the
            # pipeline runtime recomputes it; a group runs its plan as it is)
            t = sp.cost.step_time_s + (0.0 if plan.grouped else sp.cost.compute_time_s / 3) \
                + p2p
            mem = sp.cost.memory_bytes_per_device
        except NoFitError as e:
            sp, t, mem = None, st.time_s, float(e.smallest_bytes or math.inf)
        out.append(replace(st, time_s=t, memory_bytes=mem + kept, budget_bytes=cap,
                           policy=policy, plan=sp))
    return replace(plan, stages=tuple(out), step_time_s=_step(out, M, plan.grouped))
