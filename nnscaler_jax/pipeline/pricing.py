"""Pricing what the pipeline runtime executes: equal chunks of layers, a schedule's step table.

The runtime (:mod:`nnscaler_jax.pipeline.stacked`) splits the layer stack into ``stages x
virtual`` equal contiguous chunks and walks a schedule's step table in lock step; this module
prices every (schedule, micro-batch count) it can run from the model's units
(:func:`nnscaler_jax.pipeline.units.layer_units`) with the cost model's links: per time step the
slowest stage's work plus both ``ppermute``\\ s, then the gradient syncs; memory per stage with
the buffer slots the runtime's loop keeps stage inputs and cotangents in. :func:`runtime_setup`
splits a mesh as the runtime does (stage axis, data-parallel and tensor-parallel axes) and
prices a graph's units on it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from nnscaler_jax.cost.devices import NVLINK_H100
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.graph import Graph, Role
from nnscaler_jax.mesh.axes import require_stage_axis
from nnscaler_jax.mesh.topology import LinkCost, all_reduce_time, ppermute_time
from nnscaler_jax.pipeline import schedule as sch
from nnscaler_jax.pipeline.in_stage import tensor_axes
from nnscaler_jax.pipeline.loop_tables import loop_tables
from nnscaler_jax.pipeline.steps import ALL, Step, deps, peak_pending_weights
from nnscaler_jax.pipeline.units import Unit, layer_units

__all__ = ["HOST_DISPATCH_S", "MEMORY_KINDS", "RuntimeChoice", "RuntimeSetup", "runtime_choices",
           "runtime_setup", "runtime_time"]

MEMORY_KINDS = ("params", "grads", "optimizer", "activations", "peak")
"""The kinds a pipelined plan's memory per stage is priced by (:attr:`RuntimeChoice.
memory_kinds`); ``peak`` is the stage's estimate (the others' sum, but on a stage planned by
the in-stage search: its plan's peak)."""

HOST_DISPATCH_S = 1e-4
"""Seconds the host takes to dispatch one program or transfer of the per-stage runtime (a
jitted call with ~20 arguments on a 4-device sub-mesh: 212 us on this project's 2-core CPU
machine, call included; a ``device_put`` between sub-meshes 148 us). The host dispatches every
stage's blocks and transfers in turn, so a step takes at least their count times this."""


@dataclass(frozen=True, slots=True)
class RuntimeChoice:
    """One (schedule, micro-batches) the runtime can execute, priced by the cost model.

    Attributes:
        schedule / virtual / microbatches / microbatch_size: the configuration.
        step_time_s: sum over the schedule's time steps of the slowest stage's work (forward,
            or recomputed forward + backward, each with its tensor-parallel all-reduces) plus
            both ``ppermute``\\ s, + gradient sync.
        bubble_s: the schedule table's time (without gradient sync) minus the busiest stage's
            work.
        memory_bytes: per stage (params + grads + optimizer + the runtime's activation and
            cotangent buffer slots + one chunk's activations, or with ``recompute='layer'`` its
            layers' inputs and one layer's activations, + its largest op output).
        fits: within the memory budget.
        compute_s: the busiest stage's compute seconds over the step (forward, recomputed
            forward, backward of all its micro-batches).
        comm_s: communication seconds on the step: the ``ppermute``\\ s of every time step, the
            busiest stage's tensor-parallel all-reduces and the gradient syncs;
            ``step_time_s - compute_s - comm_s`` is the busiest stage's idle time (bubble).
        comm_bytes: bytes a device of the busiest stage sends per step (all-reduces counted
            as ``2 (p - 1) / p`` x buffer, as ring all-reduces send).
        recompute: ``PipelineSettings.recompute``: ``'chunk'``, or ``'layer'`` (every layer
            also recomputed inside its chunk's backward: one more forward of the layers).
        executor: ``PipelineSettings.executor``: ``'in-graph'`` (one program walking the step
            table in lock step) or ``'per-stage'`` (one program per stage, dispatched from
            the host, each stage running its blocks as their inputs arrive).
        stage_plans: ``PipelineSettings.stage_plans``: the in-stage search's plans the row's
            memory was priced with (:attr:`RuntimeSetup.searched`), else empty.
        overlap: ``PipelineSettings.overlap``: the in-graph runtime sends a time step's
            results during the next step, beside its compute (:func:`runtime_time`).
        memory_kinds: per stage, ``memory_bytes`` by kind (:data:`MEMORY_KINDS`:
            ``params``, ``grads``, ``optimizer``, ``activations`` (buffer slots, the chunk's
            activations, the kept values of a split backward; a searched stage: its plan's
            activations, transient and gradients held, and the chunk inputs in flight),
            ``peak``); empty where not priced.
    """

    schedule: str
    virtual: int
    microbatches: int
    microbatch_size: int
    step_time_s: float
    bubble_s: float
    memory_bytes: tuple[float, ...]
    fits: bool
    compute_s: float = 0.0
    comm_s: float = 0.0
    comm_bytes: float = 0.0
    recompute: str = "chunk"
    executor: str = "in-graph"
    stage_plans: tuple = field(default=(), compare=False)
    overlap: bool = False
    memory_kinds: tuple[dict[str, float], ...] = field(default=(), compare=False)

    def row(self) -> str:
        name = (self.schedule + (f" x{self.virtual}" if self.virtual > 1 else "")
                + (" +rc" if self.recompute == "layer" else "")
                + (" /ps" if self.executor == "per-stage" else "")
                + (" /ov" if self.overlap else ""))
        return (f"{name:<14} {self.microbatches:>4} x {self.microbatch_size:<4} "
                f"{self.step_time_s * 1e3:>10.3f} {self.bubble_s * 1e3:>9.3f} "
                f"{max(self.memory_bytes) / 2**20:>10.2f}{'' if self.fits else '  over budget'}")


def runtime_time(sched, fwd: list[float], bwd: list[float], p2p: float,
                 all_device: dict[str, float] | None = None, *,
                 table: list | None = None, wgrad: list[float] | None = None,
                 lockstep: bool = True, overlap: bool = False,
                 moves: Sequence[bool] | None = None) -> tuple[float, float]:
    """``(step seconds, bubble seconds)`` of a schedule's step table (``plan.schedule``).

    The runtime walks the table in lock step: time step ``t`` lasts as long as the slowest
    stage's work at ``t`` (``fwd[c]`` / ``bwd[c]`` of chunk ``c``, their sum for a
    :class:`~nnscaler_jax.pipeline.steps.Pair`; a no-grad forward ``N`` costs
    ``fwd[c]``; an all-device block ``all_device[kind]``, run by the stage holding its data,
    ``E`` / ``W`` stage 0 and ``H`` the last chunk's stage, while the others wait) and then both
    ``ppermute``\\ s (``p2p`` seconds together) where it moves values (``moves[t]``, the loop
    tables' ``transfers``: where some stage receives a result). ``overlap``: the runtime
    sends a step's results during the next one, at every step
    (:func:`~nnscaler_jax.pipeline.loop_tables.loop_tables`), so a step lasts its slowest
    stage's work or its transfers, the longer, and the table places a result read on
    another stage one step later. ``table``: ``sch.timeline(sched, lag=overlap)`` and
    ``moves`` when already made. A split backward (``sched.split_backward``): ``G`` costs
    ``wgrad[c]`` (the chunk's weight gradients; default a third of its backward) and ``B``
    the rest of ``bwd[c]``.

    ``lockstep=False``: the per-stage runtime (:mod:`~nnscaler_jax.pipeline.mpmd`), whose
    stages run their blocks as the host dispatches them, each when its inputs have arrived:
    not time steps but events (:func:`_event_time`; ``p2p / 2`` per message).
    """
    S, extra = sched.stages, all_device or {}
    runs = {"E": 0, "W": 0, "H": (sched.chunks - 1) % S}
    total, busy = 0.0, [0.0] * S
    wg = _weight_share(sched, bwd, wgrad)
    if not lockstep:
        return _event_time(sched, fwd, bwd, p2p / 2, wg, extra)[:2]
    table = sch.timeline(sched, lag=int(overlap)) if table is None else table
    if moves is None:
        moves = loop_tables(sched, "FBNEHWG", overlap=overlap, table=table).transfers
    for t, move in enumerate(moves):
        row, dur = table[t] if t < len(table) else (), 0.0
        for s, cell in enumerate(row):
            here = 0.0  # (a pair: its forward, then its backward)
            for st in sch.blocks(cell):
                c = st.virtual * S + s
                w = (extra.get(st.kind, 0.0) if st.all_device else bwd[c] - wg[c]
                     if st.kind == "B" else wg[c] if st.kind == "G" else fwd[c])
                if not st.all_device or runs.get(st.kind, s) == s:
                    busy[s] += w
                here += w
            dur = max(dur, here)
        total += max(dur, p2p * move) if overlap else dur + p2p * move
    return total, total - max(busy)


def _weight_share(sched, bwd: list[float], wgrad: list[float] | None) -> list[float]:
    """Per chunk, the seconds of its backward a ``G`` block runs: ``wgrad`` (default a third)
    where the schedule splits backwards, else 0."""
    if not getattr(sched, "split_backward", False):
        return [0.0] * len(bwd)
    return wgrad or [b / 3 for b in bwd]


def _event_time(sched, fwd: list[float], bwd: list[float], send: float,
                wg: list[float], alld: dict[str, float] | None = None
                ) -> tuple[float, float, list[int]]:
    """``(step seconds, bubble seconds, per stage the most inputs held at once)`` of stages
    that each run their order as soon as a block's inputs are there: a block starts when its
    stage is free and every block it depends on has finished (plus ``send`` seconds when that
    block ran on another stage). ``F`` / ``N`` cost ``fwd[c]``, ``B`` ``bwd[c] - wg[c]``,
    ``G`` ``wg[c]``; an all-device block (``E`` / ``H`` / ``W``, ``alld[kind]``) starts on
    every stage at once, when all are free and have reached it. An input is held from its
    arrival (the previous chunk's forward, or ``E``, + the send) to its chunk's backward
    (chunk 0's input is the batch: not held).

    >>> from nnscaler_jax.pipeline import schedule as sch
    >>> [_event_time(sch.build(n, 2, 4), [1.0] * 2, [2.0] * 2, 0.0, [0.0] * 2)[0::2]
    ...  for n in ("gpipe", "1f1b")]
    [(15.0, [0, 4]), (15.0, [0, 2])]
    """
    S, alld = sched.stages, alld or {}
    cost = {"B": lambda c: bwd[c] - wg[c], "G": lambda c: wg[c]}
    finish: dict = {}
    free, busy, pos = [0.0] * S, [0.0] * S, [0] * S
    left = sum(len(r) for r in sched.steps)
    ready = lambda ds, s: max((finish[d] + (send if d[1] != s else 0.0) for d in ds),
                              default=0.0)
    while left:
        moved = False
        for s in range(S):
            row = sched.steps[s]
            while pos[s] < len(row) and not row[pos[s]].all_device:
                st = row[pos[s]]
                ds = deps(st, s, sched)
                if any(d not in finish for d in ds):
                    break
                c = st.virtual * S + s
                w = cost.get(st.kind, lambda c: fwd[c])(c)
                finish[(st, s)] = free[s] = max(free[s], ready(ds, s)) + w
                busy[s] += w
                pos[s], left, moved = pos[s] + 1, left - 1, True
        heads = {sched.steps[s][pos[s]] if pos[s] < len(sched.steps[s]) else None
                 for s in range(S)}
        st = next(iter(heads))
        if len(heads) == 1 and st is not None and st.all_device \
                and all(d in finish for d in deps(st, 0, sched)):
            end = max(*free, ready(deps(st, 0, sched), ALL)) + alld.get(st.kind, 0.0)
            finish[(st, ALL)] = end
            for s in range(S):
                free[s], busy[s], pos[s] = end, busy[s] + alld.get(st.kind, 0.0), pos[s] + 1
            left, moved = left - S, True
        if not moved:  # (a schedule that passed validate() never gets here)
            raise PlanError(f"schedule {sched.name!r} deadlocks")
    total = max(free)
    held = []
    for s in range(S):
        arrive = lambda c, m: (finish[(Step("F", m, (c - 1) // S), (c - 1) % S)] if c
                               else finish[(Step("E", m), ALL)]) + send
        spans = [(arrive(c, m), finish[(Step("B", m, c // S), s)])
                 for c in range(s, sched.chunks, S) if c or sched.all_device
                 for m in range(sched.microbatches)]
        held.append(max((sum(a <= t < b for a, b in spans) for t, _ in spans), default=0))
    return total, total - max(busy), held


def _wire(p: int, n: float) -> float:
    """Bytes one device sends in a ring all-reduce of ``n`` bytes over ``p`` devices."""
    return 2 * (p - 1) / p * n if p > 1 else 0.0


def runtime_choices(units: list[Unit], stages: int, dp: int, batch: int,
                    memory_per_device: float | None = None, *, microbatches: int | None = None,
                    schedule: str | None = None, optimizer_bytes: float = 3.0,
                    stage_link: LinkCost = NVLINK_H100, data_link: LinkCost = NVLINK_H100,
                    tp: int = 1, tp_link: LinkCost = NVLINK_H100,
                    modes: tuple[str, ...] = ("chunk", "layer"), lockstep: bool = True,
                    overlap: bool | None = False) -> list[RuntimeChoice]:
    """Every (schedule, micro-batch count) :mod:`nnscaler_jax.pipeline.stacked` can run, priced.

    The runtime's restrictions: ``stages x virtual`` equal contiguous chunks of the layer stack
    (the prefix runs with chunk 0, the suffix with the last chunk; their parameters replicated
    on every stage), stages data-parallel inside (``dp`` ways), ``batch`` split into
    ``microbatches x dp``, interleaved only with 2 chunks per stage and micro-batches a multiple
    of the stages. Sorted: fitting first, then by step time, then memory. ``schedule``: a
    name (None: the ones the runtime executes, ``'gpipe'``, ``'1f1b'``, ``'eager-1f1b'``,
    ``'interleaved'``, ``'zb-h1'`` (on the cut program: a stack's plan is re-cut) and
    ``'interlaced'``; ``'nf1b'`` is priced when named) or a
    :class:`~nnscaler_jax.pipeline.steps.Schedule` (written with ``op_order``: its own
    micro-batch count).

    ``'interlaced'`` (all-device blocks): the prefix (embedding, ``E`` / ``W``) and suffix (head
    + loss, ``H``) run as their own blocks, not with chunk 0 / the last chunk. The cut runtime
    (``lockstep``) runs each on the one stage holding its data while the others wait, their
    parameters replicated on every stage; the per-stage runtime runs them on every device at
    once, split over all stages' tensor-parallel devices as the in-stage plan splits them
    (nnScaler's vocabulary-split embedding and head: :func:`_all_device_work`), their
    parameters too. ``'nf1b'``: each no-grad pass costs a chunk's forward.

    ``tp`` > 1: stages are also tensor-parallel inside (:mod:`nnscaler_jax.pipeline.in_stage`),
    priced as Megatron, like :func:`~nnscaler_jax.pipeline.stage_dp.search_stages`: unit compute
    and parameters / ``tp``, each unit's ``tp_collectives`` all-reduces of its output activation
    over ``tp_link`` (half in the forward, half in the backward; the recomputed forward repeats
    its half), one chunk's activations / ``tp``; the buffered stage inputs and the
    ``ppermute``\\ d activations stay whole (replicated over the tensor-parallel axes).

    Each configuration is priced twice when the units have layers (``recompute``): the chunk's
    backward keeping all its activations (``'chunk'``), and every layer also recomputed inside
    it (``'layer'``: the layers' inputs kept and one layer's activations at a time, one more
    forward of the layers, with its all-reduces); ``modes`` narrows them (recompute rules on a
    stack of identical layers, :func:`~nnscaler_jax.pipeline.rules.stack_modes`).

    ``lockstep=False``: the per-stage runtime (:mod:`~nnscaler_jax.pipeline.mpmd`), whose
    stages run as their inputs arrive (:func:`runtime_time`), holding the inputs that have
    arrived, no faster than its host dispatches (:data:`HOST_DISPATCH_S`); without tensor
    axes it runs no all-device schedule.

    ``overlap``: the in-graph runtime (2+ stages) sends a step's results during the next step
    (True: :func:`runtime_time`; two more values held), after it (False), or both are priced
    (None: the planner's default, ``Constraints.pipeline_overlap``).

    Raises:
        PlanError: no configuration the runtime can execute (layers or batch do not divide).
    """
    L, S = len(units) - 2, stages
    if isinstance(schedule, sch.Schedule):
        if schedule.stages != S:
            raise PlanError(f"pipeline: the schedule {schedule.name!r} has {schedule.stages} "
                            f"stages, the mesh's stage axis {S}")
        microbatches = microbatches or schedule.microbatches
    names = (*sch.RUNNABLE, "interlaced") if schedule is None else (schedule,)
    kinds = [(s, 2 if s == "interleaved" else getattr(s, "virtual", 1)) for s in names]
    kinds = [(s, v) for s, v in kinds if L % (S * v) == 0
             and (lockstep or tp > 1  # (per-stage: all-device blocks fold into tp)
                  or not getattr(s, "all_device", s == "interlaced"))]
    ms = [m for m in range(1, batch // dp + 1) if batch % (m * dp) == 0
          and microbatches in (None, m)]
    ways = _Ways(units, S, dp, tp, batch, optimizer_bytes, stage_link, data_link, tp_link,
                 memory_per_device, lockstep)
    if not any(u.layer_in_bytes is not None for u in units):
        modes = ("chunk",)
    overlaps = [o for o in ((False, True) if overlap is None else (overlap,))
                if not o or (lockstep and S > 1)]
    out = [_price(ways, name, V, M, rc, ov) for name, V in kinds for M in ms for rc in modes
           for ov in overlaps if not (name == "interleaved" and M % S)
           and getattr(name, "microbatches", M) == M]
    if not out:
        raise _nothing_runs(L, S, dp, tp, batch, microbatches, schedule,
                            bool(overlap and not overlaps))
    out.sort(key=lambda r: (not r.fits, r.step_time_s, max(r.memory_bytes)))
    return out


def _nothing_runs(L: int, S: int, dp: int, tp: int, batch: int, microbatches: int | None,
                  schedule: Any, overlap: bool) -> PlanError:
    par = f"{dp} data-parallel" + (f" x {tp} tensor-parallel" if tp > 1 else "")
    return PlanError(
        f"pipeline: no schedule the runtime can execute for {L} layers on {S} stages x {par} "
        f"ways with batch {batch}"
        + (f", microbatches={microbatches}" if microbatches else "")
        + (f", schedule={getattr(schedule, 'name', schedule)!r}" if schedule else "")
        + (", overlap=True (the in-graph runtime's, on 2 or more stages)" if overlap else "")
        + f"; the layers must divide into {S} (x2 for interleaved) equal chunks and the "
        f"batch into micro-batches x {dp}")


@dataclass(frozen=True)
class _Ways:
    """One :func:`runtime_choices` call's fixed sizes, links and budget."""

    units: list[Unit]
    stages: int
    dp: int
    tp: int
    batch: int
    optimizer_bytes: float
    stage_link: LinkCost
    data_link: LinkCost
    tp_link: LinkCost
    budget: float | None
    lockstep: bool = True

    @property
    def everywhere(self) -> int:
        """Devices the all-device blocks (interlaced's prefix and suffix) split over: every
        stage in the per-stage runtime (the in-stage plan's tensor-parallel splits over
        ``stages x tp`` devices, nnScaler's vocabulary-split embedding and head; data-parallel
        over the rest), else ``tp`` (the cut runtime runs them on one stage)."""
        return self.tp if self.lockstep else self.tp * self.stages

    def shared(self, all_device: bool = False) -> float:
        """Prefix + suffix parameter bytes per device (their gradients and optimizer state:
        ``optimizer_bytes`` times as many): replicated over the stages (in one program, a leaf
        both read once: :attr:`Unit.tied_bytes`), or split over :attr:`everywhere` where
        all-device blocks run them."""
        ends = (self.units[0], self.units[-1])
        if not all_device:
            tied = self.units[-1].tied_bytes if self.lockstep else 0.0
            return (sum(u.param_bytes for u in ends) - tied) / self.tp
        whole = sum(u.param_bytes if u.whole_param_bytes is None else u.whole_param_bytes
                    for u in ends)
        return whole / self.everywhere


@dataclass(frozen=True)
class _ChunkWork:
    """Per chunk: compute seconds (forward + backward), one pass's tensor-parallel all-reduce
    seconds and bytes sent, the seconds of its forward / backward steps (and of a split
    backward's weight-gradient block ``G``, part of the backward's), and the compute /
    all-reduce seconds and bytes of the layers recomputed again inside its backward
    (``recompute='layer'``; else 0)."""

    compute: list[float]
    ar: list[float]
    ar_bytes: list[float]
    fwd: list[float]
    bwd: list[float]
    wgrad: list[float]
    extra: list[float]
    extra_ar: list[float]
    extra_ar_bytes: list[float]


def _chunk_bounds(n: int, layers: int, chunks: int) -> list[tuple[int, int]]:
    """Unit ranges of equal layer chunks; the prefix joins the first, the suffix the last."""
    k = layers // chunks
    return [(0 if c == 0 else 1 + c * k, n if c == chunks - 1 else 1 + (c + 1) * k)
            for c in range(chunks)]


def _chunk_work(w: _Ways, bounds: list[tuple[int, int]], mb: int,
                layer: bool = False) -> _ChunkWork:
    units, tp = w.units, w.tp
    again = lambda u: layer and u.layer_in_bytes is not None  # recomputed once more

    def again_s(u: Unit) -> float:  # forward seconds recomputed once more, per sample
        if not again(u):
            return u.chunk_again_s
        return u.time_s / 3 if u.layer_again_s is None else u.layer_again_s

    fb = [sum(u.time_s for u in units[a:b]) * mb / tp for a, b in bounds]
    ext = [sum(again_s(u) for u in units[a:b]) * mb / tp for a, b in bounds]
    ar_u = lambda u: (u.tp_collectives / 2 * all_reduce_time(w.tp_link, tp, u.out_bytes * mb)
                      if tp > 1 else 0.0)
    wire_u = lambda u: u.tp_collectives / 2 * _wire(tp, u.out_bytes * mb)
    ar = [sum(ar_u(u) for u in units[a:b]) for a, b in bounds]
    ar_b = [sum(wire_u(u) for u in units[a:b]) for a, b in bounds]
    ext_ar = [sum(ar_u(u) for u in units[a:b] if again(u)) for a, b in bounds]
    ext_b = [sum(wire_u(u) for u in units[a:b] if again(u)) for a, b in bounds]
    fwd = [t / 3 + c for t, c in zip(fb, ar, strict=True)]
    bwd = [t * 2 / 3 + c + f + e + ea  # + recomputed forward (+ the layers' again)
           for t, c, f, e, ea in zip(fb, ar, fwd, ext, ext_ar, strict=True)]
    # a split backward's G: the weight gradients (a third of the compute, as x^T dy beside
    # the cotangent's dy w^T); chunk 0's B makes no cotangent (its input is the batch), so
    # its G runs the whole backward
    wgrad = [bwd[0]] + [t / 3 for t in fb[1:]]
    return _ChunkWork(fb, ar, ar_b, fwd, bwd, wgrad, ext, ext_ar, ext_b)


def _price(w: _Ways, name: str | sch.Schedule, V: int, M: int,
           recompute: str = "chunk", overlap: bool = False) -> RuntimeChoice:
    """One (schedule, virtual, micro-batches, recompute, overlap) priced (see
    :func:`runtime_choices`)."""
    units, S, dp, tp = w.units, w.stages, w.dp, w.tp
    n, C = len(units), S * V
    sched = name if isinstance(name, sch.Schedule) else sch.build(name, S, M, V)
    bounds = _chunk_bounds(n, n - 2, C)
    if sched.all_device:  # interlaced: prefix / suffix in their own blocks
        bounds = [(max(a, 1), min(b, n - 1)) for a, b in bounds]
    mb = w.batch // (M * dp)
    layer = recompute == "layer"
    work = _chunk_work(w, bounds, mb, layer)
    msg = max(units[b - 1].out_bytes * mb for a, b in bounds)
    p2p = 2 * ppermute_time(w.stage_link, S, msg) if S > 1 else 0.0
    alld, alld_compute, alld_ar = _all_device_work(w, mb) if sched.all_device \
        else ({}, [0.0] * S, 0.0)
    if w.lockstep:
        table = sch.timeline(sched, lag=int(overlap))
        tables = loop_tables(sched, "FBNEHWG", overlap=overlap, table=table)
        moves = tables.transfers
        step, bubble = runtime_time(sched, work.fwd, work.bwd, p2p, alld, table=table,
                                    wgrad=work.wgrad, overlap=overlap, moves=moves)
    else:  # (one event walk: the step and the inputs each stage holds)
        step, bubble, held = _event_time(sched, work.fwd, work.bwd, p2p / 2,
                                         _weight_share(sched, work.bwd, work.wgrad), alld)
        host = _dispatches(sched) * HOST_DISPATCH_S
        step, bubble = max(step, host), bubble + max(0.0, host - step)
    # (split over every device, the prefix's shared parameters leave a copy on each stage
    # whose chunks read them too: T5's tied table in the decoder)
    copies = sched.all_device and w.everywhere > tp
    params = [sum(sum(u.param_bytes + u.shared_bytes * copies
                      for u in units[max(a, 1):min(b, n - 1)])
                  for c, (a, b) in enumerate(bounds) if c % S == s) / tp
              for s in range(S)]
    mine = [[c for c in range(C) if c % S == s] for s in range(S)]
    top = max(range(S), key=lambda s: sum(work.fwd[c] + work.bwd[c] for c in mine[s])
              + alld_compute[s])
    shared_grad = w.shared(sched.all_device)
    grad = params[top] + shared_grad
    dsync = max(all_reduce_time(w.data_link, dp, p + shared_grad)
                for p in params) if dp > 1 else 0.0
    ssync = all_reduce_time(w.stage_link, S, shared_grad) \
        if S > 1 and w.everywhere == w.tp else 0.0  # (split over all stages: one copy)
    step = step + dsync + ssync
    # ppermute rounds: one per time step a stage receives in (both directions); per-stage
    # runtime: one message each way per micro-batch and chunk
    steps = int(moves.sum()) if w.lockstep else M * V
    compute = M * (sum(work.compute[c] * (4 + sched.recycles) / 3 + work.extra[c]
                       for c in mine[top]) + alld_compute[top])
    comm = steps * p2p + M * sum(3 * work.ar[c] + work.extra_ar[c] for c in mine[top]) \
        + dsync + ssync + M * alld_ar
    sent = (steps * 2 * msg if S > 1 else 0.0) \
        + M * sum(3 * work.ar_bytes[c] + work.extra_ar_bytes[c] for c in mine[top]) \
        + _wire(dp, grad) + _wire(S, shared_grad)
    if w.lockstep:  # the loop's buffers, alike on every device (+ the B's kept result,
        # + with overlap the activation and cotangent on their way)
        slots = [tables.n_in + tables.n_g + 2 * overlap] * S
        kept = [tables.n_s + 1 if tables.n_s else 0] * S
    else:  # what each stage's dispatched programs hold: arrived inputs, one cotangent
        slots = [h + 1 for h in held]
        kept = list(peak_pending_weights(sched))
    kinds = _stage_memory(w, bounds, mine, params, slots, mb, sched.all_device, layer, kept)
    mem = [k["peak"] for k in kinds]
    fits = w.budget is None or max(mem) <= w.budget
    return RuntimeChoice(sched.name, V, M, mb, step, bubble, tuple(mem), fits, compute, comm,
                         sent, recompute, "in-graph" if w.lockstep else "per-stage",
                         overlap=overlap, memory_kinds=tuple(kinds))


def _dispatches(sched) -> int:
    """Programs and transfers the per-stage runtime's host dispatches in one step: every block
    (an all-device one once), a send of each block's result to another stage, and each
    stage's optax update."""
    blocks = {(st, ALL if st.all_device else s) for s, row in enumerate(sched.steps)
              for st in row}
    return len(blocks) + 2 * sched.microbatches * (sched.chunks - 1) + sched.stages


def _all_device_work(w: _Ways, mb: int) -> tuple[dict[str, float], list[float], float]:
    """Seconds of the all-device blocks (interlaced): ``E`` the prefix's forward, ``H`` the
    suffix's forward + backward (one ``vjp``), ``W`` the prefix's backward (a ``vjp``
    recomputing its forward); per stage the compute seconds per micro-batch they put on it;
    and the seconds of their all-reduces. The cut runtime runs each on one stage (its
    ``embed`` / ``head`` / ``embed_bwd``) while the others wait; the per-stage runtime splits
    them over :attr:`_Ways.everywhere` devices, all stages busy, with an all-reduce of the
    embedding's output (its vocabulary-split partial sums) and of the head input's cotangent
    over them, each in its block."""
    pre, post, S, n = w.units[0], w.units[-1], w.stages, w.everywhere
    t = lambda u: u.time_s * mb / n
    ar = lambda b: all_reduce_time(w.stage_link, n, b * mb) if n > w.tp else 0.0
    comm = {"E": ar(pre.out_bytes), "H": ar(w.units[-2].out_bytes), "W": 0.0}
    work = {"E": t(pre) / 3, "H": t(post), "W": t(pre)}
    per_stage = [0.0] * S
    if n > w.tp:  # on every stage at once
        per_stage = [sum(work.values())] * S
    else:
        per_stage[0] += work["E"] + work["W"]
        per_stage[-1] += work["H"]  # the last chunk's stage (interlaced: one chunk per stage)
    return {k: work[k] + comm[k] for k in work}, per_stage, sum(comm.values())


def _stage_memory(w: _Ways, bounds: list[tuple[int, int]], mine: list[list[int]],
                  params: list[float], slots: list[int], mb: int, all_device: bool,
                  layer: bool = False, kept: list[int] | None = None
                  ) -> list[dict[str, float]]:
    """Per stage, by kind (:data:`MEMORY_KINDS`): its parameters with gradients and optimizer
    state, the prefix / suffix (replicated), the runtime's activation and cotangent buffers and
    one chunk's activations (the backward recomputes the chunk from its saved input;
    ``all_device``: or the prefix's / suffix's on the stage running their blocks, if larger;
    ``layer``: every layer recomputed again inside it, the chunk keeps its layers' inputs and
    one layer's activations), with the largest op output of the chunk live beside them in its
    backward; all split over the tensor axes but the layers' inputs (replicated there, as
    Megatron keeps them).

    ``slots[s]``: the inputs and cotangents stage ``s`` holds at once, each as wide as the
    widest chunk input. In-graph programs: the loop's carry (:func:`~nnscaler_jax.pipeline.
    loop_tables.loop_tables`: ``n_in + n_g``), allocated alike on every device of the SPMD
    program (the cut runtime packs every boundary to the widest); not the stage's own
    in-flight count: a slot is taken when the activation arrives, before the stage's forward,
    and stage 0 keeps the others' count though its chunk-0 input is the batch. Per-stage
    programs: the inputs arrived and not yet backwarded (:func:`_event_time`), and one
    cotangent.

    A split backward (``kept[s]`` sets of values on stage ``s``) keeps, from its ``B`` to its
    ``G``, what the weight gradients read: per set the most a chunk keeps
    (:attr:`~nnscaler_jax.pipeline.units.Unit.wgrad_bytes`: the inputs and output cotangents
    of the ops reading parameters), chunk 0's output cotangent only (its ``B`` runs nothing,
    its ``G`` the whole backward). In-graph programs: the loop's kept-values slots ``n_s``
    and once more, the ``B``'s result beside the buffer before the loop writes it into its
    slot (as XLA:CPU holds it: the difference over 1F1B of GPT with activations dominating is
    twice the kept values with one slot); per-stage programs: the pending ``G`` s.
    """
    units, mem = w.units, []
    inp = max(units[max(a - 1, 0)].out_bytes * mb for a, _ in bounds)

    def chunk_act(a: int, b: int) -> float:
        inputs, split, largest = 0.0, 0.0, 0.0
        for u in units[a:b]:
            if layer and u.layer_in_bytes is not None:  # its input kept, replicated over TP
                inputs += u.layer_in_bytes
                largest = max(largest, u.layer_act_bytes or 0.0)
            else:
                split += u.act_bytes
        top = max((u.transient_bytes for u in units[a:b]), default=0.0)
        return inputs + (split + largest + top) / w.tp

    for s in range(w.stages):
        acts = [chunk_act(a, b) for a, b in (bounds[c] for c in mine[s])]
        if all_device:  # (on every stage, split over all of them: the per-stage runtime)
            n, here = w.everywhere, w.everywhere > w.tp
            acts += [units[0].act_bytes / n] * (s == 0 or here) \
                + [units[-1].act_bytes / n] * (s == w.stages - 1 or here)
        act = max(acts) * mb
        held = max([sum(u.wgrad_bytes for u in units[slice(*bounds[c])]) / w.tp * mb
                    for c in range(1, len(bounds))]
                   + [units[bounds[0][1] - 1].out_bytes * mb]) if kept else 0.0
        weights = params[s] + w.shared(all_device)
        kinds = {"params": weights, "grads": weights,
                 "optimizer": weights * (w.optimizer_bytes - 1),
                 "activations": slots[s] * inp + act + (kept[s] * held if kept else 0.0)}
        mem.append({**kinds, "peak": sum(kinds.values())})
    return mem


@dataclass(frozen=True)
class RuntimeSetup:
    """A graph and mesh as the pipeline runtime runs them: units, axes split, links.

    Attributes:
        units: :func:`~nnscaler_jax.pipeline.units.layer_units` of the graph at its batch.
        axis: the stage axis; ``data`` / ``tensor``: the non-stage axes the runtime runs
            data-parallel / tensor-parallel (:func:`nnscaler_jax.pipeline.in_stage.tensor_axes`).
        stages / dp / tp / batch: sizes; ``*_link``: the cost model's link of the first axis of
            each kind.
        executors: the runtimes that can run the plan, each priced as it runs
            (:attr:`RuntimeChoice.executor`): ``'in-graph'`` walks the step table in lock step
            (one program), ``'per-stage'`` runs each stage as its inputs arrive
            (:mod:`~nnscaler_jax.pipeline.mpmd`; tensor-parallel cut stages' default, and
            for stages data-parallel inside where nothing bars it: no mutable
            collections, no all-device blocks, which it folds into a tensor axis).
        searched: ``(row, budget) -> (memory per stage, stage plans, extra seconds, memory
            per stage by kind) | None``:
            the row's stages planned by the in-stage search under the budget (tensor-parallel
            cut stages and a search policy: :func:`~nnscaler_jax.pipeline.cut.plan_cut`),
            asked only when no row fits as priced (:meth:`choices`).
    """

    units: list[Unit]
    axis: str
    data: tuple[str, ...]
    tensor: tuple[str, ...]
    stages: int
    dp: int
    tp: int
    batch: int
    stage_link: LinkCost
    data_link: LinkCost
    tp_link: LinkCost
    modes: tuple[str, ...] = ("chunk", "layer")
    executors: tuple[str, ...] = ("in-graph",)
    searched: Callable[[RuntimeChoice, float],
                       tuple[tuple[float, ...], tuple, float, tuple] | None] \
        | None = field(default=None, compare=False)

    def choices(self, memory_per_device: float | None = None, **kw) -> list[RuntimeChoice]:
        """:func:`runtime_choices` for this setup (``kw``: microbatches, schedule, ...), for
        each of its executors; sorted as :func:`runtime_choices` sorts, the in-graph runtime
        first where both price the same.

        Raises:
            PlanError: no executor runs anything asked.
        """
        out: list[RuntimeChoice] = []
        error = None
        for ex in self.executors:
            try:
                out += runtime_choices(
                    self.units, self.stages, self.dp, self.batch, memory_per_device,
                    stage_link=self.stage_link, data_link=self.data_link, tp=self.tp,
                    tp_link=self.tp_link, modes=self.modes, lockstep=ex == "in-graph", **kw)
            except PlanError as e:
                error = error or e
        if not out:
            raise error
        if memory_per_device is not None and self.searched is not None \
                and not any(r.fits for r in out):
            out = self._searched(out, memory_per_device)
        out.sort(key=lambda r: (not r.fits, r.step_time_s, max(r.memory_bytes),
                                r.executor != "in-graph"))
        return out

    def _searched(self, rows: list[RuntimeChoice], budget: float) -> list[RuntimeChoice]:
        """``rows`` none of which fits as priced (Megatron's splits, nothing recomputed but
        the runtime's chunks and layers), judged again by :attr:`searched` (tensor-parallel
        cut stages: each stage's part planned by the in-stage search under the stage's
        budget, recompute and co-sharding included): the fastest chunk-recomputing row
        whose stages all fit that way, with the memory the search priced and the busiest
        stage's extra compute (what its plan recomputes or runs in chunks) added to its step
        (the row's other stages wait on it in the step table: priced as one more serial
        stretch, not re-walked through the table)."""
        for k, r in sorted(enumerate(rows), key=lambda kr: kr[1].step_time_s):
            if r.recompute != "chunk":
                continue
            got = self.searched(r, budget)
            if got is not None and max(got[0]) <= budget:
                extra = got[2] / self.dp
                return rows[:k] + [replace(
                    r, memory_bytes=tuple(got[0]), fits=True, stage_plans=got[1],
                    step_time_s=r.step_time_s + extra, compute_s=r.compute_s + extra,
                    memory_kinds=got[3])] \
                    + rows[k + 1:]
        return rows


def runtime_setup(graph: Graph, mesh_axes: dict[str, int], policy,
                  model: CostModel | None = None) -> RuntimeSetup:
    """Split ``mesh_axes`` as the runtime does for ``policy`` and price ``graph``'s units.

    Raises:
        PlanError: no ``stage``/``pipe`` axis, or no repeated layer stack.
    """
    axis = require_stage_axis(mesh_axes)
    tensor = tensor_axes(mesh_axes, axis, policy)
    data = tuple(a for a in mesh_axes if a != axis and a not in tensor)
    batch = next((t.shape[0] for t in graph.inputs if t.role is Role.INPUT and t.shape), 1)
    model = model or CostModel.for_axes(mesh_axes)
    link = model.mesh.link
    return RuntimeSetup(
        layer_units(graph, batch=batch, model=model), axis, data, tensor, mesh_axes[axis],
        math.prod(mesh_axes[a] for a in data), math.prod(mesh_axes[a] for a in tensor), batch,
        link(axis), link(data[0]) if data else link(axis),
        link(tensor[0]) if tensor else link(axis))
