"""Stage search: Alpa's inter-operator DP over layer boundaries x sub-mesh shapes x micro-batches.

The traced graph is cut into units (:func:`nnscaler_jax.pipeline.units.layer_units`: prefix ops,
each layer of the repeated stack, suffix ops), each priced per sample. For every (stages ``S``,
tensor-parallel degree ``tp`` inside a stage, data-parallel degree ``dp = N / (S tp)``, micro-batch
count ``M``), a DP places the stage boundaries minimising Alpa's objective ``sum_s t_s + (M - 1)
max_s t_s`` (enumerating the slowest-stage bound ``t_max``) under the per-device memory budget with
1F1B's in-flight activations (stage ``k`` keeps ``S - k`` micro-batches). Stages get equal
sub-meshes (``tp x dp`` devices), as the runtime's stage mesh axis requires.

>>> import models
>>> from nnscaler_jax.capture.trace import trace
>>> from nnscaler_jax.pipeline.units import layer_units
>>> spec = models.get("gpt", "tiny", n_layers=4)
>>> units = layer_units(trace(spec.module, *spec.make_args()), batch=2)
>>> best = search_stages(units, devices=8, global_batch=16, memory_per_device=2**30)
>>> best.stages * best.tp * best.dp
8
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nnscaler_jax.cost.devices import IB_NDR, NVLINK_H100
from nnscaler_jax.errors import PlanError
from nnscaler_jax.mesh.axes import model_axes, stage_axis
from nnscaler_jax.mesh.topology import LinkCost, all_reduce_time
from nnscaler_jax.pipeline.units import Unit

__all__ = ["StageChoice", "StagePrices", "evaluate", "place_stages", "rank_stages",
           "search_stages", "stage_meshes", "stage_prices"]


@dataclass(frozen=True, slots=True)
class StageChoice:
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
class StagePrices:
    """Every contiguous stage of units ``[i, j)`` priced at once (:func:`stage_prices`),
    per device: ``[n + 1, n + 1]`` arrays, ``inf`` where ``j <= i``."""

    time: np.ndarray     # [n+1, n+1] stage time of units [i, j) per micro-batch
    act: np.ndarray      # bytes per device kept per in-flight micro-batch of units [i, j)
    work: np.ndarray     # bytes of one micro-batch's backward working set
    state: np.ndarray    # parameter + grad + optimizer bytes per device
    grad: np.ndarray     # gradient bytes per device (for the dp all-reduce)


def stage_prices(units: list[Unit], tp: int, mb: int, optimizer_bytes: float,
                 intra: LinkCost, inter: LinkCost, recompute: bool = True) -> StagePrices:
    """Every stage ``[i, j)``'s prices. ``recompute``: the stage keeps its input per
    micro-batch in flight and its backward recomputes its whole forward (holding all of its
    activations at once); else it keeps every activation of every micro-batch in flight."""
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
    return StagePrices(time, act, work, state, grad)


def place_stages(prices: Sequence[StagePrices], budgets: Sequence[float], t_max: float,
                 inflight) -> tuple | None:
    """Min sum of stage times with every stage <= t_max and within memory; boundaries.

    ``prices[k]`` / ``budgets[k]``: stage ``k``'s prices and its devices' bytes: stages may
    differ (devices of several kinds, :mod:`~nnscaler_jax.pipeline.hetero`)."""
    S = len(prices)
    n = prices[0].time.shape[0] - 1
    f = np.full(n + 1, np.inf)
    f[0] = 0.0
    back = []
    for k in range(S):
        pr = prices[k]
        mem = pr.state + inflight(k) * pr.act + pr.work
        c = np.where((pr.time <= t_max) & (mem <= budgets[k]), pr.time, np.inf)
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
             intra: LinkCost = NVLINK_H100, inter: LinkCost = IB_NDR,
             recompute: bool = True) -> StageChoice:
    """Price a given stage split (e.g. a hand-written Megatron plan) with the search's model."""
    S = len(bounds)
    pr = stage_prices(units, tp, microbatch_size, optimizer_bytes, intra, inter, recompute)
    times = tuple(float(pr.time[a, b]) for a, b in bounds)
    fl = (lambda k: S - k) if schedule == "1f1b" else (lambda k: microbatches)
    mem = tuple(float(pr.state[a, b] + min(fl(k), microbatches) * pr.act[a, b] + pr.work[a, b])
                for k, (a, b) in enumerate(bounds))
    sync = max(all_reduce_time(inter, dp, float(pr.grad[a, b])) if dp > 1 else 0.0
               for a, b in bounds)
    step = sum(times) + (microbatches - 1) * max(times) + sync
    names = tuple((units[a].name, units[b - 1].name) for a, b in bounds)
    return StageChoice(S, tp, dp, microbatches, microbatch_size, tuple(bounds), names, times, mem,
                     step)


def search_stages(units: list[Unit], devices: int, global_batch: int, memory_per_device: float,
                  *, max_tp: int = 8, optimizer_bytes: float = 3.0, t_max_levels: int = 48,
                  intra: LinkCost = NVLINK_H100, inter: LinkCost = IB_NDR,
                  recompute: bool = True) -> StageChoice:
    """The best (stages, tp, dp, micro-batches, boundaries) under the memory budget.

    Args:
        units: from :func:`nnscaler_jax.pipeline.units.layer_units`.
        devices: N devices; stages x tp x dp = N, tp a power of two <= ``max_tp`` (in a node).
        global_batch: samples per training step.
        memory_per_device: bytes.
        optimizer_bytes: gradient + optimizer state per parameter byte (Adam, fp32: 3).
        t_max_levels: slowest-stage bounds tried per configuration (Alpa's enumeration,
            quantised).
        recompute: stages keep only their inputs per in-flight micro-batch and recompute the
            forward in the backward (what :mod:`nnscaler_jax.pipeline.stacked` runs); otherwise
            all activations of every in-flight micro-batch are kept.

    Raises:
        PlanError: no configuration fits the budget (says the smallest memory found).
    """
    return rank_stages(units, devices, global_batch, memory_per_device, max_tp=max_tp,
                       optimizer_bytes=optimizer_bytes, t_max_levels=t_max_levels,
                       intra=intra, inter=inter, recompute=recompute)[0]


def rank_stages(units: list[Unit], devices: int, global_batch: int, memory_per_device: float,
                *, max_tp: int = 8, optimizer_bytes: float = 3.0, t_max_levels: int = 48,
                intra: LinkCost = NVLINK_H100, inter: LinkCost = IB_NDR,
                recompute: bool = True) -> list[StageChoice]:
    """:func:`search_stages`'s configurations, each (stages, tp, micro-batches) by the best
    boundaries it found, fastest first (a configuration the bound on the slowest stage rules
    out before any fit is left out): the next choices where the first turns out not to run.

    Raises:
        PlanError: no configuration fits the budget (says the smallest memory found).
    """
    n = len(units)
    found: dict[tuple[int, int, int], StageChoice] = {}
    best = math.inf
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
                pr = stage_prices(units, tp, mb, optimizer_bytes, intra, inter, recompute)
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
                    if (M - 1) * t_max >= best:
                        break
                    r = place_stages([pr] * S, [memory_per_device] * S, t_max,
                                     lambda k, S=S, M=M: min(S - k, M))
                    if r is None:
                        continue
                    plan = evaluate(units, r[1], tp, dp, M, mb, optimizer_bytes=optimizer_bytes,
                                    intra=intra, inter=inter, recompute=recompute)
                    key = (S, tp, M)
                    if key not in found or plan.step_time_s < found[key].step_time_s:
                        found[key] = plan
                        best = min(best, plan.step_time_s)
    if not found:
        raise PlanError(f"stage search: no (stages, tp, micro-batches) fits "
                        f"{memory_per_device / 2**30:.1f} GiB per device on {devices} devices; "
                        f"the smallest estimate is ~{smallest / 2**30:.1f} GiB. Use more devices, "
                        "a smaller global batch, or more memory")
    return sorted(found.values(), key=lambda c: c.step_time_s)


def stage_meshes(axes: dict[str, int]) -> list[dict[str, int]]:
    """The pipelined shapes of a flat mesh's devices a planner may use instead: ``{'stage': S,
    <data axis>: d, <model axis>: t}`` for every stage count ``S > 1`` dividing the device count,
    with the mesh's tensor-parallel size ``t`` (its axes named like ``'model'``; the product when
    several) kept when ``S`` leaves room for it, and without tensor parallelism (``t = 1``).
    Axis names are the mesh's own (its first data axis, else ``'data'``; its first model axis);
    an axis of size 1 is left out. A mesh that already has a stage axis gives none.

    >>> stage_meshes({"data": 2, "model": 4})
    [{'stage': 2, 'model': 4}, {'stage': 2, 'data': 4}, {'stage': 4, 'data': 2}, {'stage': 8}]
    """
    if stage_axis(axes) is not None:
        return []
    n = math.prod(axes.values())
    tensor = model_axes(axes)
    t_mesh = math.prod(axes[a] for a in tensor)
    data_name = next((a for a in axes if a not in tensor), "data")
    out = []
    for S in (s for s in range(2, n + 1) if n % s == 0):
        for t in dict.fromkeys((t_mesh, 1)):
            if (n // S) % t:
                continue
            shape = {"stage": S, data_name: n // (S * t)}
            if t > 1:
                shape[tensor[0]] = t
            out.append({a: k for a, k in shape.items() if k > 1 or a == "stage"})
    return out
