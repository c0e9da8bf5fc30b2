"""Stage search: Alpa's inter-operator DP over layer boundaries x sub-mesh shapes x micro-batches.

The traced graph is cut into units (prefix ops, each layer of the repeated stack — unrolled
``h_i`` or one ``nn.scan`` body — and suffix ops); each unit is priced per sample by the
:class:`~nnscaler_jax.cost.model.CostModel` (``op_time`` forward + backward, ``activation_bytes``)
plus its parameter bytes. For every (stages ``S``, tensor-parallel degree ``tp`` inside a stage,
data-parallel degree ``dp = N / (S tp)``, micro-batch count ``M``), a DP places the stage
boundaries minimising Alpa's objective ``sum_s t_s + (M - 1) max_s t_s`` (enumerating the
slowest-stage bound ``t_max``) under the per-device memory budget with 1F1B's in-flight
activations (stage ``k`` keeps ``S - k`` micro-batches). Stages get equal sub-meshes
(``tp x dp`` devices), as the runtime's stage mesh axis requires.

>>> import jax, models
>>> from nnscaler_jax.capture.trace import trace
>>> spec = models.get("gpt", "tiny", n_layers=4)
>>> units = layer_units(trace(spec.module, *spec.make_args()), batch=2)
>>> [u.name for u in units]
['<prefix>', 'h_0', 'h_1', 'h_2', 'h_3', '<suffix>']
>>> best = search_stages(units, devices=8, global_batch=16, memory_per_device=2**30)
>>> best.stages * best.tp * best.dp
8
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from nnscaler_jax.mesh.topology import LinkCost, all_reduce_time, ppermute_time
from nnscaler_jax.cost.model import CostModel, DeviceSpec, itemsize
from nnscaler_jax.cost.residuals import residual_outputs
from nnscaler_jax.errors import PlanError
from nnscaler_jax.mesh.axes import stage_axis
from nnscaler_jax.ir.graph import Graph

__all__ = [
    "H100",
    "INFINIBAND",
    "NVLINK",
    "RuntimeChoice",
    "RuntimeSetup",
    "StagePlan",
    "Unit",
    "evaluate",
    "layer_units",
    "runtime_choices",
    "runtime_setup",
    "runtime_time",
    "search_stages",
]

H100 = DeviceSpec("H100-80G", flops=990e12, flops_fp32=67e12, memory_bytes=80 * 2**30,
                  bandwidth=3.35e12, efficiency=0.8)
NVLINK = LinkCost.from_bandwidth(2e-6, 450e9)
INFINIBAND = LinkCost.from_bandwidth(5e-6, 50e9)
_LAYER = re.compile(r"^(.*)_(\d+)$")


@dataclass(frozen=True, slots=True)
class Unit:
    """One indivisible piece of the model, priced for one sample on one device.

    Attributes:
        name: ``'<prefix>'``, a layer module path, or ``'<suffix>'``.
        time_s: forward + backward seconds.
        act_bytes: activations kept for the backward pass.
        param_bytes: parameter bytes (without gradient / optimizer state).
        out_bytes: bytes of the activation sent to the next unit.
        tp_collectives: all-reduces of ``out_bytes`` per pass under tensor parallelism
            (Megatron: 2 per layer forward, 2 backward).
    """

    name: str
    time_s: float
    act_bytes: float
    param_bytes: float
    out_bytes: float
    tp_collectives: int = 0


def layer_units(graph: Graph, batch: int = 1, model: CostModel | None = None) -> list[Unit]:
    """Cut ``graph`` (traced at batch ``batch``) into prefix / layers / suffix units per sample.

    Raises:
        PlanError: the graph has no repeated layer stack.
    """
    model = model or CostModel.for_axes({"x": 1}, device=H100)
    saved = residual_outputs(graph)  # the activations autodiff keeps, after fusion
    var_bytes = {t.id: math.prod(t.shape) * itemsize(t) for t in graph.variables}
    tops = [op.module_path.split("/")[0] for op in graph.ops]
    scan = [i for i, op in enumerate(graph.ops) if op.regions and op.primitive == "scan"
            and any(t.id in var_bytes for t in op.inputs)]
    layer_ids = [i for i, t in enumerate(tops) if _LAYER.match(t)]
    if len(layer_ids) > 1 and not scan:
        first, last = layer_ids[0], layer_ids[-1]
        by: dict[str, list] = {}
        for op, t in zip(graph.ops[first:last + 1], tops[first:last + 1], strict=True):
            by.setdefault(t, []).append(op)
        pre, post = list(graph.ops[:first]), list(graph.ops[last + 1:])
        layers = [(name, ops, 1) for name, ops in by.items()]
    elif len(scan) == 1:
        k = scan[0]
        op = graph.ops[k]
        length = int(op.params.get("length", 1))
        body = [o for region in op.regions for o in region.walk()]
        pre, post = list(graph.ops[:k]), list(graph.ops[k + 1:])
        layers = [(f"h[{i}]", body, length) for i in range(length)]
        scanned = {t.id for t in op.inputs if t.id in var_bytes}
    else:
        raise PlanError("stage search: no repeated layer stack in the graph (module paths "
                        f"{sorted(set(tops))[:12]}); it needs layers '<prefix>_<i>' or one nn.scan")

    def params_of(ops, share=1) -> float:
        ids = {t.id for o in ops for t in o.inputs if t.id in var_bytes}
        return sum(var_bytes[i] for i in ids) / share

    def unit(name, ops, share=1, tp_coll=0) -> Unit:
        flat = [o for o in ops if not o.regions]
        t = sum(model.op_time(o, ()) for o in flat) / batch
        act = sum(model.activation_bytes(o, (), saved.get(o.id, ())) for o in flat) / batch
        out = flat[-1].outputs[0] if flat and flat[-1].outputs else None
        ob = (math.prod(out.shape) * itemsize(out) / batch) if out is not None else 0.0
        return Unit(name, t, act, params_of(ops, share), ob, tp_coll)

    units = [unit("<prefix>", pre)]
    if len(scan) == 1:
        body_unit = unit("h", layers[0][1], tp_coll=4)
        p = sum(var_bytes[i] for i in scanned) / layers[0][2]
        units += [Unit(n, body_unit.time_s, body_unit.act_bytes, p, body_unit.out_bytes, 4)
                  for n, _, _ in layers]
    else:
        units += [unit(n, ops, tp_coll=4) for n, ops, _ in layers]
    units.append(unit("<suffix>", post))
    # the prefix hands the first layer the same activation a layer hands the next
    p0 = units[0]
    units[0] = Unit(p0.name, p0.time_s, p0.act_bytes, p0.param_bytes, units[1].out_bytes, 0)
    return units


@dataclass(frozen=True, slots=True)
class StagePlan:
    """The stage search's choice (or an evaluated hand-written plan).

    Attributes:
        stages / tp / dp / microbatches / microbatch_size: the configuration.
        bounds: ``(first unit, end unit)`` per stage.
        names: unit names per stage (first and last).
        stage_time_s: per micro-batch forward + backward seconds per stage.
        memory_bytes: per-device bytes per stage (params + grads + Adam + in-flight activations).
        step_time_s: ``sum t_s + (M - 1) max t_s`` + data-parallel gradient all-reduce.
    """

    stages: int
    tp: int
    dp: int
    microbatches: int
    microbatch_size: int
    bounds: tuple[tuple[int, int], ...]
    names: tuple[tuple[str, str], ...]
    stage_time_s: tuple[float, ...]
    memory_bytes: tuple[float, ...]
    step_time_s: float

    def __str__(self) -> str:
        lines = [(f"{self.stages} stages x tp {self.tp} x dp {self.dp}, {self.microbatches} "
                  f"micro-batches of {self.microbatch_size}: step {self.step_time_s:.3f} s")]
        for k, ((a, b), (n0, n1)) in enumerate(zip(self.bounds, self.names, strict=True)):
            lines.append(f"  stage {k}: units {a}..{b - 1} ({n0} .. {n1}), "
                         f"{self.stage_time_s[k] * 1e3:.1f} ms/micro-batch, "
                         f"{self.memory_bytes[k] / 2**30:.1f} GiB")
        return "\n".join(lines)


@dataclass(frozen=True)
class _Prices:
    time: np.ndarray     # [n+1, n+1] stage time of units [i, j) per micro-batch
    act: np.ndarray      # bytes per device kept per in-flight micro-batch of units [i, j)
    work: np.ndarray     # bytes of one micro-batch's backward working set
    state: np.ndarray    # parameter + grad + optimizer bytes per device
    grad: np.ndarray     # gradient bytes per device (for the dp all-reduce)


def _prices(units: list[Unit], tp: int, mb: int, optimizer_bytes: float, intra: LinkCost,
            inter: LinkCost, recompute: bool = True) -> _Prices:
    n = len(units)

    def cum(xs):
        return np.concatenate([[0.0], np.cumsum(xs)])

    # recompute: the backward re-runs the stage forward (1/3 of forward + backward)
    t = cum([u.time_s * mb / tp * (4 / 3 if recompute else 1.0) for u in units])
    tpc = cum([(all_reduce_time(intra, tp, u.out_bytes * mb / tp * tp) * u.tp_collectives
                if tp > 1 else 0.0) for u in units])
    a = cum([u.act_bytes * mb / tp for u in units])
    p = cum([u.param_bytes / tp for u in units])
    i, j = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    out = np.array([0.0] + [u.out_bytes * mb for u in units])
    p2p = np.where(j < n, 2 * (inter.alpha_s + out[j] * inter.beta_s_per_byte), 0.0)
    valid = j > i
    big = np.inf
    time = np.where(valid, t[j] - t[i] + tpc[j] - tpc[i] + p2p, big)
    full = np.where(valid, a[j] - a[i], big)
    inp = np.concatenate([[units[0].out_bytes * mb / tp], out[1:-1] / tp, [0.0]])
    if recompute:   # keep only the stage input per micro-batch; one stage forward live in B
        act, work = np.where(valid, inp[i], big), full
    else:
        act, work = full, np.where(valid, 0.0, big)
    state = np.where(valid, (p[j] - p[i]) * (1 + optimizer_bytes), big)
    grad = np.where(valid, p[j] - p[i], big)
    return _Prices(time, act, work, state, grad)


def _dp(pr: _Prices, S: int, M: int, budget: float, t_max: float, inflight) -> tuple | None:
    """Min sum of stage times with every stage <= t_max and within memory; boundaries."""
    n = pr.time.shape[0] - 1
    f = np.full(n + 1, np.inf)
    f[0] = 0.0
    back = []
    for k in range(S):
        mem = pr.state + inflight(k) * pr.act + pr.work
        c = np.where((pr.time <= t_max) & (mem <= budget), pr.time, np.inf)
        tot = f[:, None] + c
        arg = np.argmin(tot, axis=0)
        f = tot[arg, np.arange(n + 1)]
        back.append(arg)
    if not np.isfinite(f[n]):
        return None
    bounds, j = [], n
    for k in reversed(range(S)):
        i = int(back[k][j])
        bounds.append((i, j))
        j = i
    return float(f[n]), tuple(reversed(bounds))


def evaluate(units: list[Unit], bounds, tp: int, dp: int, microbatches: int,
             microbatch_size: int, *, optimizer_bytes: float = 3.0, schedule: str = "1f1b",
             intra: LinkCost = NVLINK, inter: LinkCost = INFINIBAND,
             recompute: bool = True) -> StagePlan:
    """Price a given stage split (e.g. a hand-written Megatron plan) with the search's model."""
    S = len(bounds)
    pr = _prices(units, tp, microbatch_size, optimizer_bytes, intra, inter, recompute)
    times = tuple(float(pr.time[a, b]) for a, b in bounds)
    fl = (lambda k: S - k) if schedule == "1f1b" else (lambda k: microbatches)
    mem = tuple(float(pr.state[a, b] + min(fl(k), microbatches) * pr.act[a, b] + pr.work[a, b])
                for k, (a, b) in enumerate(bounds))
    sync = max(all_reduce_time(inter, dp, float(pr.grad[a, b])) if dp > 1 else 0.0
               for a, b in bounds)
    step = sum(times) + (microbatches - 1) * max(times) + sync
    names = tuple((units[a].name, units[b - 1].name) for a, b in bounds)
    return StagePlan(S, tp, dp, microbatches, microbatch_size, tuple(bounds), names, times, mem,
                     step)


def search_stages(units: list[Unit], devices: int, global_batch: int, memory_per_device: float,
                  *, max_tp: int = 8, optimizer_bytes: float = 3.0, t_max_levels: int = 48,
                  intra: LinkCost = NVLINK, inter: LinkCost = INFINIBAND,
                  recompute: bool = True) -> StagePlan:
    """The best (stages, tp, dp, micro-batches, boundaries) under the memory budget.

    Args:
        units: from :func:`layer_units`.
        devices: N devices; stages x tp x dp = N, tp a power of two <= ``max_tp`` (in a node).
        global_batch: samples per training step.
        memory_per_device: bytes.
        optimizer_bytes: gradient + optimizer state per parameter byte (Adam, fp32: 3).
        t_max_levels: slowest-stage bounds tried per configuration (Alpa's enumeration,
            quantised).
        recompute: stages keep only their inputs per in-flight micro-batch and recompute the
            forward in the backward (what :mod:`nnscaler_jax.pipeline.runtime` runs); otherwise
            all activations of every in-flight micro-batch are kept.

    Raises:
        PlanError: no configuration fits the budget (says the smallest memory found).
    """
    n = len(units)
    best: StagePlan | None = None
    smallest = math.inf
    for S in [s for s in range(1, min(devices, n) + 1) if devices % s == 0]:
        for tp in [t for t in (1, 2, 4, 8, 16) if t <= max_tp and (devices // S) % t == 0]:
            dp = devices // (S * tp)
            if global_batch % dp:
                continue
            per_replica = global_batch // dp
            for M in [m for m in range(S, per_replica + 1) if per_replica % m == 0
                      and (m & (m - 1) == 0 or m == per_replica)]:
                mb = per_replica // M
                pr = _prices(units, tp, mb, optimizer_bytes, intra, inter, recompute)
                finite = pr.time[np.isfinite(pr.time)]
                lo = float(np.max([pr.time[i, i + 1] for i in range(n)]))
                # quantiles of all stage times + the times of near-balanced stages
                w = max(1, n // S)
                near = [pr.time[i, i + d] for d in (w - 1, w, w + 1, w + 2) if d > 0
                        for i in range(n + 1 - d)]
                levels = np.unique(np.concatenate([
                    np.quantile(finite[finite >= lo], np.linspace(0, 1, t_max_levels)), [lo],
                    np.asarray(near)[np.asarray(near) >= lo]]))
                smallest = min(smallest, float(pr.state[0, n] / S + pr.work[0, n] / S))
                for t_max in levels:
                    if best is not None and (M - 1) * t_max >= best.step_time_s:
                        break
                    r = _dp(pr, S, M, memory_per_device, t_max, lambda k, S=S, M=M: min(S - k, M))
                    if r is None:
                        continue
                    plan = evaluate(units, r[1], tp, dp, M, mb, optimizer_bytes=optimizer_bytes,
                                    intra=intra, inter=inter, recompute=recompute)
                    if best is None or plan.step_time_s < best.step_time_s:
                        best = plan
    if best is None:
        raise PlanError(f"stage search: no (stages, tp, micro-batches) fits "
                        f"{memory_per_device / 2**30:.1f} GiB per device on {devices} devices; "
                        f"the smallest estimate is ~{smallest / 2**30:.1f} GiB. Use more devices, "
                        "a smaller global batch, or more memory")
    return best


# ---- what the runtime executes: equal chunks, a schedule's step table ------------------------


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
        memory_bytes: per stage (params + grads + optimizer + in-flight stage inputs + one
            chunk's activations).
        fits: within the memory budget.
        compute_s: the busiest stage's compute seconds over the step (forward, recomputed
            forward, backward of all its micro-batches).
        comm_s: communication seconds on the step: the ``ppermute``\\ s of every time step, the
            busiest stage's tensor-parallel all-reduces and the gradient syncs;
            ``step_time_s - compute_s - comm_s`` is the busiest stage's idle time (bubble).
        comm_bytes: bytes a device of the busiest stage sends per step (all-reduces counted
            as ``2 (p - 1) / p`` x buffer, as ring all-reduces send).
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

    def row(self) -> str:
        name = self.schedule + (f" x{self.virtual}" if self.virtual > 1 else "")
        return (f"{name:<14} {self.microbatches:>4} x {self.microbatch_size:<4} "
                f"{self.step_time_s * 1e3:>10.3f} {self.bubble_s * 1e3:>9.3f} "
                f"{max(self.memory_bytes) / 2**20:>10.2f}{'' if self.fits else '  over budget'}")


def runtime_time(sched, fwd: list[float], bwd: list[float], p2p: float) -> tuple[float, float]:
    """``(step seconds, bubble seconds)`` of a schedule's step table (``plan.schedule``).

    The runtime walks the table in lock step: time step ``t`` lasts as long as the slowest
    stage's work at ``t`` (``fwd[c]`` / ``bwd[c]`` of chunk ``c``) and then both ``ppermute``\\ s
    (``p2p`` seconds together).
    """
    from nnscaler_jax.pipeline.schedule import timeline

    S = sched.stages
    total, busy = 0.0, [0.0] * S
    for row in timeline(sched):
        dur = 0.0
        for s, st in enumerate(row):
            if st is None:
                continue
            c = st.virtual * S + s
            w = fwd[c] if st.kind == "F" else bwd[c]
            busy[s] += w
            dur = max(dur, w)
        total += dur + p2p
    return total, total - max(busy)


def _wire(p: int, n: float) -> float:
    """Bytes one device sends in a ring all-reduce of ``n`` bytes over ``p`` devices."""
    return 2 * (p - 1) / p * n if p > 1 else 0.0


def runtime_choices(units: list[Unit], stages: int, dp: int, batch: int,
                    memory_per_device: float | None = None, *, microbatches: int | None = None,
                    schedule: str | None = None, optimizer_bytes: float = 3.0,
                    stage_link: LinkCost = NVLINK, data_link: LinkCost = NVLINK, tp: int = 1,
                    tp_link: LinkCost = NVLINK) -> list[RuntimeChoice]:
    """Every (schedule, micro-batch count) :mod:`nnscaler_jax.pipeline.runtime` can run, priced.

    The runtime's restrictions: ``stages x virtual`` equal contiguous chunks of the layer stack
    (the prefix runs with chunk 0, the suffix with the last chunk; their parameters replicated
    on every stage), stages data-parallel inside (``dp`` ways), ``batch`` split into
    ``microbatches x dp``, interleaved only with 2 chunks per stage and micro-batches a multiple
    of the stages. Sorted: fitting first, then by step time, then memory.

    ``tp`` > 1: stages are also tensor-parallel inside (:mod:`nnscaler_jax.pipeline.in_stage`),
    priced as Megatron, like :func:`search_stages`: unit compute and parameters / ``tp``, each
    unit's ``tp_collectives`` all-reduces of its output activation over ``tp_link`` (half in the
    forward, half in the backward; the recomputed forward repeats its half), one chunk's
    activations / ``tp``; the in-flight stage inputs and the ``ppermute``\\ d activations stay
    whole (replicated over the tensor-parallel axes).

    Raises:
        PlanError: no configuration the runtime can execute (layers or batch do not divide).
    """
    from nnscaler_jax.pipeline import schedule as sch

    L, n, S = len(units) - 2, len(units), stages
    shared = (units[0].param_bytes + units[-1].param_bytes) / tp * (1 + optimizer_bytes)
    kinds = [(s, 2 if s == "interleaved" else 1) for s in ("1f1b", "gpipe", "interleaved")
             if schedule in (None, s)]
    kinds = [(s, v) for s, v in kinds if L % (S * v) == 0]
    ms = [m for m in range(1, batch // dp + 1) if batch % (m * dp) == 0
          and microbatches in (None, m)]
    out: list[RuntimeChoice] = []
    for name, V in kinds:
        C, k = S * V, L // (S * V)
        bounds = [(0 if c == 0 else 1 + c * k, n if c == C - 1 else 1 + (c + 1) * k)
                  for c in range(C)]
        for M in ms:
            if name == "interleaved" and M % S:
                continue
            mb = batch // (M * dp)
            sched = sch.build(name, S, M, V)
            fb = [sum(u.time_s for u in units[a:b]) * mb / tp for a, b in bounds]
            # one pass's (forward or backward) tensor-parallel all-reduces: seconds and bytes
            ar = [sum(u.tp_collectives / 2 * all_reduce_time(tp_link, tp, u.out_bytes * mb)
                      for u in units[a:b]) if tp > 1 else 0.0 for a, b in bounds]
            ar_b = [sum(u.tp_collectives / 2 * _wire(tp, u.out_bytes * mb) for u in units[a:b])
                    for a, b in bounds]
            fwd = [t / 3 + c for t, c in zip(fb, ar, strict=True)]
            bwd = [t * 2 / 3 + c + f  # + recomputed forward
                   for t, c, f in zip(fb, ar, fwd, strict=True)]
            msg = max(units[b - 1].out_bytes * mb for a, b in bounds)
            p2p = 2 * ppermute_time(stage_link, S, msg) if S > 1 else 0.0
            step, bubble = runtime_time(sched, fwd, bwd, p2p)
            params = [sum(sum(u.param_bytes for u in units[max(a, 1):min(b, n - 1)])
                          for c, (a, b) in enumerate(bounds) if c % S == s) / tp
                      for s in range(S)]
            mine = [[c for c in range(C) if c % S == s] for s in range(S)]
            top = max(range(S), key=lambda s: sum(fwd[c] + bwd[c] for c in mine[s]))
            grad = params[top] + shared / (1 + optimizer_bytes)
            dsync = max(all_reduce_time(data_link, dp, p + shared / (1 + optimizer_bytes))
                        for p in params) if dp > 1 else 0.0
            ssync = all_reduce_time(stage_link, S, shared / (1 + optimizer_bytes)) if S > 1 \
                else 0.0
            step = step + dsync + ssync
            steps = len(sch.timeline(sched))
            compute = M * sum(fb[c] * 4 / 3 for c in mine[top])
            comm = steps * p2p + M * sum(3 * ar[c] for c in mine[top]) + dsync + ssync
            sent = (steps * 2 * msg if S > 1 else 0.0) + M * sum(3 * ar_b[c] for c in mine[top]) \
                + _wire(dp, grad) + _wire(S, shared / (1 + optimizer_bytes))
            peaks = sch.peak_in_flight(sched)
            mem = []
            for s in range(S):
                inp = max(units[max(bounds[c][0] - 1, 0)].out_bytes * mb for c in mine[s])
                work = max(sum(u.act_bytes for u in units[bounds[c][0]:bounds[c][1]]) * mb / tp
                           for c in mine[s])
                mem.append(params[s] * (1 + optimizer_bytes) + shared + peaks[s] * inp + work)
            fits = memory_per_device is None or max(mem) <= memory_per_device
            out.append(RuntimeChoice(name, V, M, mb, step, bubble, tuple(mem), fits, compute,
                                     comm, sent))
    if not out:
        par = f"{dp} data-parallel" + (f" x {tp} tensor-parallel" if tp > 1 else "")
        raise PlanError(
            f"pipeline: no schedule the runtime can execute for {L} layers on {S} stages x {par} "
            f"ways with batch {batch}"
            + (f", microbatches={microbatches}" if microbatches else "")
            + (f", schedule={schedule!r}" if schedule else "")
            + f"; the layers must divide into {S} (x2 for interleaved) equal chunks and the "
            f"batch into micro-batches x {dp}")
    out.sort(key=lambda r: (not r.fits, r.step_time_s, max(r.memory_bytes)))
    return out


@dataclass(frozen=True)
class RuntimeSetup:
    """A graph and mesh as the pipeline runtime runs them: units, axes split, links.

    Attributes:
        units: :func:`layer_units` of the graph at its batch.
        axis: the stage axis; ``data`` / ``tensor``: the non-stage axes the runtime runs
            data-parallel / tensor-parallel (:func:`nnscaler_jax.pipeline.in_stage.tensor_axes`).
        stages / dp / tp / batch: sizes; ``*_link``: the cost model's link of the first axis of
            each kind.
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

    def choices(self, memory_per_device: float | None = None, **kw) -> list[RuntimeChoice]:
        """:func:`runtime_choices` for this setup (``kw``: microbatches, schedule, ...)."""
        return runtime_choices(self.units, self.stages, self.dp, self.batch, memory_per_device,
                               stage_link=self.stage_link, data_link=self.data_link, tp=self.tp,
                               tp_link=self.tp_link, **kw)


def runtime_setup(graph: Graph, mesh_axes: dict[str, int], policy,
                  model: CostModel | None = None) -> RuntimeSetup:
    """Split ``mesh_axes`` as the runtime does for ``policy`` and price ``graph``'s units.

    Raises:
        PlanError: no ``stage``/``pipe`` axis, or no repeated layer stack.
    """
    from nnscaler_jax.ir.graph import Role
    from nnscaler_jax.pipeline.in_stage import tensor_axes

    axis = stage_axis(mesh_axes)
    if axis is None:
        raise PlanError(f"pipeline pricing needs a 'stage' (or 'pipe') mesh axis; the mesh has "
                        f"{mesh_axes}")
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
