"""Alpa's inter-operator pass (OSDI'22, section 5) on our graph and cost model.

1. **Layer clustering** (Alpa's ``cluster_jaxpr_by_cost``,
   :func:`nnscaler_jax.pipeline.clustering.cluster_layers`): the top-level ops cut into ``L``
   layers of balanced FLOPs with cheap cuts.
2. **Stage profiles**: for a layer range ``[i, j)`` and a logical mesh ``(dp, tp)`` of a
   sub-mesh, the stage's ops are planned by the Alpa-style intra-op ILP
   (:func:`nnscaler_jax.search.ilp.search`, ``planner="alpa"``) and priced by the
   :class:`~nnscaler_jax.cost.model.CostModel` at the micro-batch size: per micro-batch time
   (forward + recomputed forward + backward + the send to the next stage), gradient sync (once
   per step), state bytes, one micro-batch's activations, the stage input kept per in-flight
   micro-batch. Profiles are memoised by the stage's structure (identical op sequences, e.g.
   the same number of identical transformer layers, share one ILP) and sub-mesh.
3. **Stage DP** (Alpa's eq. 3-5): sub-meshes from Alpa's set (``(1, 2^k)`` inside a node,
   ``(n, M)`` whole nodes), which must cover all devices; for each slowest-stage bound
   ``t_max`` (Alpa's enumeration, capped at ``t_max_levels`` values), ``F(s, k, d)`` = least sum
   of stage times placing layers ``[k, L)`` on ``d`` devices in ``s`` stages, each stage within
   ``t_max`` and within the memory budget with 1F1B's ``s`` micro-batches in flight; the step
   time ``sum t_i + (B - 1) max t_j`` (+ the slowest gradient sync). The micro-batch size is
   the outer loop (one graph per size).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from nnscaler_jax.constraints import Constraints
from nnscaler_jax.cost.devices import H100_80G, IB_NDR, NVLINK_H100, DeviceSpec
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.graph import Graph, Role
from nnscaler_jax.layout import Layout
from nnscaler_jax.mesh.topology import LinkCost, all_reduce_time
from nnscaler_jax.pipeline.clustering import cluster_layers
from nnscaler_jax.search.entry import plan_spmd

__all__ = ["InterOpResult", "StageProfile", "alpa_pipeline_search", "inter_op_dp",
           "price_stage", "stage_graph", "stage_structure", "submesh_shapes"]


# ---- 2. stage profiles -----------------------------------------------------------------------


def stage_graph(graph: Graph, start: int, end: int) -> Graph:
    """The ops ``graph.ops[start:end]`` as a graph: inputs are the variables, example inputs and
    earlier activations they read; outputs what later ops (or the graph's outputs) read."""
    ops = graph.ops[start:end]
    made = {t.id for op in ops for t in op.outputs}
    later = {t.id for op in graph.ops[end:] for t in op.inputs} | {t.id for t in graph.outputs}
    seen: dict[int, object] = {}
    for op in ops:
        for t in op.inputs:
            if t.id not in made and t.role is not Role.CONST:
                seen.setdefault(t.id, t)
    outs = tuple({t.id: t for op in ops for t in op.outputs if t.id in later}.values())
    used = {b for op in ops for b in op.boundary}
    consts = tuple(c for c in graph.consts if any(c.id == t.id for op in ops for t in op.inputs))
    return Graph(tuple(ops), tuple(seen.values()), outs,
                 tuple(b for b in graph.boundaries if b.id in used), consts)


def stage_structure(graph: Graph, start: int, end: int) -> str:
    """A hash of ops ``[start, end)``: primitives, annotations, shapes, roles and wiring, equal
    for identical op sequences (e.g. the same number of identical layers)."""
    h = hashlib.sha1()
    ids: dict[int, int] = {}
    for op in graph.ops[start:end]:
        ins = []
        for t in op.inputs:
            ins.append(ids.setdefault(t.id, -len(ids) - 1) if t.id not in ids else ids[t.id])
        for t in op.outputs:
            ids[t.id] = len(ids)
        h.update(f"{op.primitive}|{op.anno}|{[t.shape for t in op.inputs]}|{ins}|"
                 f"{[t.role.value for t in op.inputs]};".encode())
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class StageProfile:
    """One stage (op range) on one logical mesh ``(dp, tp)``, per micro-batch.

    Attributes:
        time_s: forward + recomputed forward + backward + communication inside the stage + the
            send of its output to the next stage (both directions).
        sync_s: gradient all-reduce over ``dp`` (once per training step).
        state_bytes: params + grads + optimizer state per device.
        work_bytes: one micro-batch's activations + the largest temporary per device.
        input_bytes: the stage input kept per in-flight micro-batch per device.
        ilp_s: seconds planning it (0 when memoised).
    """

    dp: int
    tp: int
    time_s: float
    sync_s: float
    state_bytes: float
    work_bytes: float
    input_bytes: float
    ilp_s: float = 0.0

    def memory(self, inflight: int) -> float:
        return self.state_bytes + self.work_bytes + inflight * self.input_bytes


def price_stage(graph: Graph, start: int, end: int, dp: int, tp: int, policy: str = "alpa", *,
                device: DeviceSpec = H100_80G, data_link: LinkCost = NVLINK_H100,
                model_link: LinkCost = NVLINK_H100, send_link: LinkCost = IB_NDR,
                time_limit: float = 60.0, memory: float | None = None) -> StageProfile:
    """Plan ops ``[start, end)`` with ``policy`` (``"alpa"``, ``"auto"``, ``"megatron"``...)
    on the logical mesh ``{data: dp, model: tp}`` and price one micro-batch of it.

    ``memory``: the intra-op ILP's per-device budget (Alpa passes the device memory).

    Raises:
        PlanError: no intra-op plan fits ``memory``.
    """
    t0 = time.perf_counter()
    sub = stage_graph(graph, start, end)
    axes = {"data": dp, "model": tp}
    cm = CostModel.for_axes(axes, links={"data": data_link, "model": model_link},
                            device=device, input_grads=True)
    cons = Constraints(max_memory_per_device=int(memory)) if memory else None
    plan = plan_spmd(sub, axes, policy=policy, constraints=cons, cost_model=cm,
                     time_limit=time_limit).plan
    br = cm.memory_breakdown(plan, sub)
    sync = 0.0
    for v in sub.variables:
        split = set(Layout.from_pspec(plan.variable_spec(v.name) or (), v.ndim).split_axes)
        local = v.nbytes / math.prod(axes[a] for a in split if a in axes)
        if dp > 1 and "data" not in split:
            sync += all_reduce_time(data_link, dp, local)
    c = plan.cost
    inp = sum(t.nbytes for t in sub.inputs if t.role is not Role.VARIABLE) / dp
    out = sum(t.nbytes for t in sub.outputs) / dp
    send = 2 * (send_link.alpha_s + out * send_link.beta_s_per_byte) if end < len(graph.ops) \
        else 0.0
    t = c.compute_time_s * 4 / 3 + max(c.comm_time_s - sync, 0.0) + send
    return StageProfile(dp, tp, t, sync, br["params"] + br["grads"] + br["optimizer"],
                        br["activations"] + br["transient"], inp, time.perf_counter() - t0)


# ---- 3. the stage DP -------------------------------------------------------------------------


def submesh_shapes(devices: int, per_node: int) -> list[tuple[int, int]]:
    """Alpa's sub-mesh set: ``(1, 2^k)`` with ``2^k <= per_node``, then ``(n, per_node)``."""
    small = [(1, 1 << k) for k in range(per_node.bit_length()) if (1 << k) <= per_node
             and (1 << k) <= devices]
    nodes = max(devices // per_node, 1)
    return small + [(n, per_node) for n in range(2, nodes + 1)] if devices >= per_node else small


def _logical(shape: tuple[int, int]) -> list[tuple[int, int]]:
    """Logical ``(dp, tp)`` meshes of a physical sub-mesh: tp inside a node (Alpa's
    ``single_node_model_parallel`` space)."""
    n, m = shape
    return [(n * m // tp, tp) for tp in (1 << k for k in range(m.bit_length())) if m % tp == 0]


@dataclass(frozen=True)
class InterOpResult:
    """What :func:`alpa_pipeline_search` chose.

    Attributes:
        stages: ``((first layer, end layer), (nodes, per node), (dp, tp), seconds per
            micro-batch)`` per stage; layers are clusters of ``layer_ops``.
        layer_ops: the clustering: ``(first op, end op)`` per layer.
        microbatches / microbatch_size: the pipeline.
        step_time_s: ``sum t_i + (B - 1) max t_j`` + the slowest gradient sync.
        memory_bytes: per stage, per device.
        search_s / profile_s / dp_s: seconds in all, profiling stages (ILPs), in the DP.
        profiles: stage profiles computed (ILPs run) / requested (memoised or not).
        capped: what was cut short (time limit, skipped profiles), empty if nothing.
    """

    stages: tuple[tuple[tuple[int, int], tuple[int, int], tuple[int, int], float], ...]
    layer_ops: tuple[tuple[int, int], ...]
    microbatches: int
    microbatch_size: int
    step_time_s: float
    memory_bytes: tuple[float, ...]
    search_s: float
    profile_s: float
    dp_s: float
    profiles: tuple[int, int]
    capped: str = ""
    log: tuple[str, ...] = field(default=(), repr=False)

    def __str__(self) -> str:
        head = (f"Alpa inter-op: {len(self.stages)} stages, {self.microbatches} micro-batches "
                f"of {self.microbatch_size}: step {self.step_time_s:.3f} s; search "
                f"{self.search_s:.1f} s ({self.profiles[0]} ILPs / {self.profiles[1]} "
                f"profiles, {self.profile_s:.1f} s; DP {self.dp_s:.1f} s)")
        lines = [head]
        for k, ((a, b), sm, lg, t) in enumerate(self.stages):
            lines.append(f"  stage {k}: layers {a}..{b - 1} on sub-mesh {sm[0]}x{sm[1]} as "
                         f"(dp {lg[0]}, tp {lg[1]}): {t * 1e3:.1f} ms/micro-batch, "
                         f"{self.memory_bytes[k] / 2**30:.1f} GiB")
        if self.capped:
            lines.append(f"  capped: {self.capped}")
        return "\n".join(lines)


def _inter_dp(cost: dict, L: int, shapes: list, N: int, M: int, t_max: float, max_stages: int):
    """Alpa's F(s, k, d) for one ``t_max``; returns (sum of times, stages) or None."""
    INF = math.inf
    # G[s][k]: array over devices d of the least sum for layers [k, L) in s stages
    G = [[np.full(N + 1, INF) for _ in range(L + 1)] for _ in range(max_stages + 1)]
    arg: dict = {}
    G[0][L][0] = 0.0
    for s in range(1, max_stages + 1):
        for k in range(L - 1, -1, -1):
            best = np.full(N + 1, INF)
            for j in range(k + 1, L + 1):
                rest = G[s - 1][j]
                if not np.isfinite(rest).any():
                    continue
                for sh in shapes:
                    c = cost.get((k, j, sh, min(s, M)))
                    if c is None or c[0] > t_max:
                        continue
                    d = sh[0] * sh[1]
                    cand = np.full(N + 1, INF)
                    cand[d:] = rest[: N + 1 - d] + c[0]
                    better = cand < best
                    if better.any():
                        best = np.where(better, cand, best)
                        for dd in np.nonzero(better)[0]:
                            arg[(s, k, int(dd))] = (j, sh, c[1])
            G[s][k] = best
    options = [(G[s][0][N], s) for s in range(1, max_stages + 1) if np.isfinite(G[s][0][N])]
    if not options:
        return None
    total, s = min(options)
    out, k, d = [], 0, N
    while s > 0:
        j, sh, lg = arg[(s, k, d)]
        out.append(((k, j), sh, lg))
        k, d, s = j, d - sh[0] * sh[1], s - 1
    return total, out


def inter_op_dp(cost: Mapping, layers: int, shapes: list[tuple[int, int]], devices: int,
                microbatches: int, max_stages: int | None = None, t_max_levels: int = 64,
                bound: float = math.inf) -> tuple[float, list, str] | None:
    """Alpa's stage DP over precomputed stage costs, enumerating the slowest-stage bound.

    Args:
        cost: ``{(first layer, end layer, sub-mesh, in-flight micro-batches): (seconds per
            micro-batch, logical mesh, profile or None[, sync seconds])}``; a missing key is an
            infeasible stage (e.g. over the memory budget with that many in flight).
        layers / shapes / devices: ``L``, the sub-mesh set, ``N`` (all must be used).
        microbatches: ``B``.
        bound: a known step time; ``t_max`` values that cannot beat it are not tried.

    Returns:
        ``(step seconds, [((i, j), sub-mesh, logical mesh, seconds)], note)`` with
        ``step = sum t_i + (B - 1) max t_j + max sync`` (sync: the cost tuple's 4th item or the
        profile's ``sync_s``), or None if nothing is feasible. ``note`` says if the
        enumeration was capped.
    """
    M = microbatches
    max_stages = max_stages or layers
    times = np.unique([c[0] for c in cost.values()])
    note = ""
    if len(times) > t_max_levels:
        note = f"t_max enumeration capped at {t_max_levels} of {len(times)} values (quantiles)"
        times = np.unique(np.quantile(times, np.linspace(0, 1, t_max_levels)))
    best = None

    def sync(c) -> float:
        if len(c) > 3:
            return float(c[3])
        return float(getattr(c[2], "sync_s", 0.0) or 0.0)

    for t_max in times:
        if (M - 1) * t_max >= min(bound, best[0] if best else math.inf):
            break
        r = _inter_dp(cost, layers, shapes, devices, M, float(t_max), max_stages)
        if r is None:
            continue
        _, stages = r
        S = len(stages)
        cs = [cost[(k, j, sh, min(S - n, M))] for n, ((k, j), sh, _) in enumerate(stages)]
        ts = [c[0] for c in cs]
        step = sum(ts) + (M - 1) * max(ts) + max(sync(c) for c in cs)
        if best is None or step < best[0]:
            best = (step, [(kj, sh, lg, t) for (kj, sh, lg), t in zip(stages, ts, strict=True)])
    return None if best is None else (best[0], best[1], note)


def alpa_pipeline_search(graph: Graph | Mapping[int, Graph], devices: int, global_batch: int,
                         memory_per_device: float, *, per_node: int = 8, layers: int = 16,
                         device: DeviceSpec = H100_80G, intra: LinkCost = NVLINK_H100,
                         inter: LinkCost = IB_NDR, t_max_levels: int = 64,
                         time_limit: float = 3600.0, ilp_time_limit: float = 60.0,
                         max_stages: int | None = None) -> InterOpResult:
    """Alpa's inter-operator pass: layer clustering + stage / sub-mesh / micro-batch DP with
    every stage planned by the Alpa-style intra-op ILP.

    Args:
        graph: the model traced at one micro-batch size (its batch dim), or ``{micro-batch
            size: graph}`` to search several (Alpa's outer loop over micro-batches).
        devices: ``N`` devices, ``per_node`` per node (sub-meshes ``(1, 2^k)``, ``(n, per_node)``).
        global_batch: samples per step; micro-batches ``B = global_batch / size``.
        memory_per_device: bytes.
        layers: ``L`` of the layer clustering.
        device / intra / inter: the hardware (default: H100 nodes, NVLink 4 inside a node,
            InfiniBand NDR across; :mod:`nnscaler_jax.cost.devices`).
        time_limit: seconds for profiling; profiles not reached are left out (``capped``).
        ilp_time_limit: HiGHS seconds per stage ILP.

    Raises:
        PlanError: nothing fits the memory budget.
    """
    t0 = time.perf_counter()
    graphs = dict(graph) if isinstance(graph, Mapping) else {_batch(graph): graph}
    shapes = submesh_shapes(devices, per_node)
    prof = _Profiler(device, intra, inter, memory_per_device, ilp_time_limit, time_limit, t0)
    best: tuple | None = None
    dp_s = 0.0
    capped: list[str] = []
    log: list[str] = []
    for mb, g in sorted(graphs.items()):
        if global_batch % mb:
            continue
        M = global_batch // mb
        clusters = cluster_layers(g, min(layers, len(g.ops)))
        L = len(clusters)
        n_stages = min(max_stages or L, L, devices)
        skipped = prof.skipped
        cost = _stage_costs(g, clusters, mb, M, n_stages, shapes, prof)
        if prof.skipped > skipped:
            capped.append(f"micro-batch {mb}: {prof.skipped - skipped} stage profiles skipped "
                          f"at the {time_limit:.0f} s time limit")
        t1 = time.perf_counter()
        r = inter_op_dp(cost, L, shapes, devices, M, n_stages, t_max_levels,
                        bound=best[0] if best is not None else math.inf)
        if r is not None:
            step, stages, note = r
            if note:
                capped.append(f"micro-batch {mb}: {note}")
            S = len(stages)
            log.append(f"micro-batch {mb}: {S} stages, step {step:.4g} s")
            if best is None or step < best[0]:
                ps = [cost[(k, j, sh, min(S - n, M))][2] for n, ((k, j), sh, _, _) in
                      enumerate(stages)]
                mem = tuple(p.memory(min(S - n, M)) for n, p in enumerate(ps))
                best = (step, mb, M, clusters, tuple(stages), mem)
        dp_s += time.perf_counter() - t1
    if best is None:
        raise PlanError(f"alpa_pipeline_search: no stage / sub-mesh assignment fits "
                        f"{memory_per_device / 2**30:.1f} GiB per device on {devices} devices; "
                        f"the smallest estimate is ~{prof.smallest / 2**30:.1f} GiB")
    step, mb, M, clusters, stages, mem = best
    return InterOpResult(stages, clusters, M, mb, step, mem, time.perf_counter() - t0,
                         prof.profile_s, dp_s, (prof.ilps, prof.requests), "; ".join(capped),
                         tuple(log))


@dataclass
class _Profiler:
    """Memoised stage profiles of one search (across micro-batch sizes) and what they cost."""

    device: DeviceSpec
    intra: LinkCost
    inter: LinkCost
    memory: float
    ilp_time_limit: float
    time_limit: float
    t0: float
    memo: dict = field(default_factory=dict)
    ilps: int = 0
    requests: int = 0
    skipped: int = 0
    profile_s: float = 0.0
    smallest: float = math.inf

    def profiles(self, g: Graph, a: int, b: int, key: str, sh: tuple[int, int],
                 mb: int) -> list[StageProfile]:
        """Ops ``[a, b)`` (structure ``key``) on sub-mesh ``sh``, per logical mesh that has an
        intra-op plan within the budget (profiles past the time limit are skipped)."""
        profs = []
        for dp_, tp in _logical(sh):
            self.requests += 1
            k = (mb, key, sh, dp_, tp)
            if k not in self.memo:
                if time.perf_counter() - self.t0 > self.time_limit:
                    self.skipped += 1
                    continue
                dl = self.inter if sh[0] > 1 else self.intra
                t_ilp = time.perf_counter()
                try:
                    self.memo[k] = price_stage(
                        g, a, b, dp_, tp, "alpa", device=self.device, data_link=dl,
                        model_link=self.intra, send_link=self.inter,
                        time_limit=self.ilp_time_limit, memory=self.memory)
                except PlanError:
                    self.memo[k] = None     # no intra-op plan fits the budget
                self.ilps += 1
                self.profile_s += time.perf_counter() - t_ilp
            if self.memo[k] is not None:
                profs.append(self.memo[k])
        return profs


def _stage_costs(g: Graph, clusters: tuple[tuple[int, int], ...], mb: int, M: int,
                 n_stages: int, shapes: list[tuple[int, int]], prof: _Profiler) -> dict:
    """:func:`inter_op_dp`'s cost table for one micro-batch size: the fastest fitting profile
    per (layer range, sub-mesh, micro-batches in flight)."""
    L = len(clusters)
    param = np.array([sum(v.nbytes for v in stage_graph(g, a, b).variables)
                      for a, b in clusters])
    cost: dict = {}
    for length in range(1, L + 1):     # short stages first: the time cap drops long ones
        for i in range(L - length + 1):
            j = i + length
            a, b = clusters[i][0], clusters[j - 1][1]
            key = stage_structure(g, a, b) + f"|{b == len(g.ops)}"
            for sh in shapes:
                d = sh[0] * sh[1]
                # exact lower bound: params + grads + Adam spread over all d devices
                if param[i:j].sum() * 4 / d > prof.memory:
                    prof.smallest = min(prof.smallest, param[i:j].sum() * 4 / d)
                    continue
                profs = prof.profiles(g, a, b, key, sh, mb)
                for s in range(1, n_stages + 1):
                    fit = [p for p in profs if p.memory(min(s, M)) <= prof.memory]
                    prof.smallest = min([prof.smallest] + [p.memory(min(s, M)) for p in profs])
                    if fit:
                        p = min(fit, key=lambda p: p.time_s)
                        cost[(i, j, sh, min(s, M))] = (p.time_s, (p.dp, p.tp), p)
    return cost


def _batch(graph: Graph) -> int:
    return next((t.shape[0] for t in graph.inputs if t.role is Role.INPUT and t.shape), 1)
