"""Alpa's inter-operator pass (OSDI'22, section 5) on our graph and cost model.

1. **Layer clustering** (Alpa's ``cluster_jaxpr_by_cost``): the top-level ops, in program order,
   are cut into ``L`` layers by a DP minimising the bytes of activations crossing the cuts,
   with every layer's FLOPs at most ``(1 + eps)`` x the average (the smallest ``eps`` of a
   ladder that admits a clustering).
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

from nnscaler_jax.mesh.topology import LinkCost, all_reduce_time
from nnscaler_jax.cost.compute import op_flops
from nnscaler_jax.cost.model import CostModel, DeviceSpec
from nnscaler_jax.constraints import Constraints
from nnscaler_jax.errors import PlanError
from nnscaler_jax.search.entry import plan_spmd
from nnscaler_jax.ir.graph import Graph, Role
from nnscaler_jax.pipeline.stage_dp import H100, INFINIBAND, NVLINK

__all__ = ["InterOpResult", "StageProfile", "alpa_pipeline_search", "cluster_layers",
           "inter_op_dp", "price_stage", "stage_graph", "submesh_shapes"]


# ---- 1. layer clustering ---------------------------------------------------------------------


def _cut_bytes(graph: Graph) -> np.ndarray:
    """``cut[k]``: bytes of op outputs produced before op ``k`` and read at or after it."""
    n = len(graph.ops)
    pos = {t.id: i for i, op in enumerate(graph.ops) for t in op.outputs}
    last: dict[int, int] = {}
    for i, op in enumerate(graph.ops):
        for t in op.inputs:
            if t.id in pos:
                last[t.id] = i
    for t in graph.outputs:
        if t.id in pos:
            last[t.id] = n
    diff = np.zeros(n + 2)
    for op in graph.ops:
        for t in op.outputs:
            if t.id in last and last[t.id] > pos[t.id]:
                diff[pos[t.id] + 1] += t.nbytes
                diff[last[t.id] + 1] -= t.nbytes
    return np.cumsum(diff)[: n + 1]


def _range_min(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Min and argmin of ``values[lo[k]:hi[k]]`` per k (sparse table; empty ranges: inf)."""
    n = len(values)
    tables, args = [values.copy()], [np.arange(n)]
    w = 1
    while 2 * w <= n:
        a, b = tables[-1], args[-1]
        left, right = a[:-w], a[w:]
        pick = right < left
        tables.append(np.where(pick, right, left))
        args.append(np.where(pick, b[w:], b[:-w]))
        w *= 2
    length = np.maximum(hi - lo, 1)
    lev = np.floor(np.log2(length)).astype(int)
    out = np.full(len(lo), np.inf)
    arg = np.zeros(len(lo), dtype=int)
    for level in np.unique(lev):
        sel = np.nonzero(lev == level)[0]
        span = 1 << int(level)
        t, g = tables[level], args[level]
        i1, i2 = lo[sel], hi[sel] - span
        ok = (hi[sel] > lo[sel]) & (i1 < len(t)) & (i2 >= 0)
        i1c, i2c = np.clip(i1, 0, len(t) - 1), np.clip(i2, 0, len(t) - 1)
        pick = t[i2c] < t[i1c]
        out[sel] = np.where(ok, np.where(pick, t[i2c], t[i1c]), np.inf)
        arg[sel] = np.where(pick, g[i2c], g[i1c])
    return out, arg


def cluster_layers(graph: Graph, layers: int,
                   eps_ladder: tuple[float, ...] = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 1e9)
                   ) -> tuple[tuple[int, int], ...]:
    """Alpa's layer clustering: ``layers`` contiguous op ranges ``(start, end)`` of
    ``graph.ops`` minimising the activation bytes crossing the cuts, each layer's FLOPs within
    ``(1 + eps)`` x the average for the smallest ``eps`` of the ladder that admits one."""
    n = len(graph.ops)
    if not 1 <= layers <= n:
        raise PlanError(f"cluster_layers: {layers} layers for {n} ops")
    flops = np.array([op_flops(op) for op in graph.ops], dtype=float)
    cum = np.concatenate([[0.0], np.cumsum(flops)])
    cut = _cut_bytes(graph)
    cut[0] = 0.0
    ends = np.arange(n + 1)
    for eps in eps_ladder:
        cap = (1 + eps) * cum[-1] / layers
        # smallest j with cum[k] - cum[j] <= cap
        lo = np.searchsorted(cum, cum - cap - 1e-9 * max(cum[-1], 1.0), side="left")
        f = np.full(n + 1, np.inf)
        f[0] = 0.0
        back = []
        for _ in range(layers):
            g, arg = _range_min(f + cut, lo, ends)   # j in [lo[k], k)
            f = g
            back.append(arg)
        if np.isfinite(f[n]):
            bounds, k = [], n
            for arg in reversed(back):
                j = int(arg[k])
                bounds.append((j, k))
                k = j
            return tuple(reversed(bounds))
    raise PlanError(f"cluster_layers: no clustering of {n} ops into {layers} layers")


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


def _structure(graph: Graph, start: int, end: int) -> str:
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
                device: DeviceSpec = H100, data_link: LinkCost = NVLINK,
                model_link: LinkCost = NVLINK, send_link: LinkCost = INFINIBAND,
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
        spec = plan.variable_spec(v.name) or ()
        split = {a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)}
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
                         device: DeviceSpec = H100, intra: LinkCost = NVLINK,
                         inter: LinkCost = INFINIBAND, t_max_levels: int = 64,
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
        time_limit: seconds for profiling; profiles not reached are left out (``capped``).
        ilp_time_limit: HiGHS seconds per stage ILP.

    Raises:
        PlanError: nothing fits the memory budget.
    """
    t0 = time.perf_counter()
    graphs = dict(graph) if isinstance(graph, Mapping) else {_batch(graph): graph}
    shapes = submesh_shapes(devices, per_node)
    best: tuple | None = None
    memo: dict = {}
    ilps = requests = 0
    profile_s = dp_s = 0.0
    capped: list[str] = []
    log: list[str] = []
    smallest = math.inf
    for mb, g in sorted(graphs.items()):
        if global_batch % mb:
            continue
        M = global_batch // mb
        clusters = cluster_layers(g, min(layers, len(g.ops)))
        L = len(clusters)
        n_stages = min(max_stages or L, L, devices)
        param = np.array([sum(v.nbytes for v in stage_graph(g, a, b).variables)
                          for a, b in clusters])
        cost: dict = {}
        skipped = 0
        for length in range(1, L + 1):     # short stages first: the time cap drops long ones
            for i in range(L - length + 1):
                j = i + length
                a, b = clusters[i][0], clusters[j - 1][1]
                key_s = _structure(g, a, b) + f"|{b == len(g.ops)}"
                for sh in shapes:
                    d = sh[0] * sh[1]
                    # exact lower bound: params + grads + Adam spread over all d devices
                    if param[i:j].sum() * 4 / d > memory_per_device:
                        smallest = min(smallest, param[i:j].sum() * 4 / d)
                        continue
                    profs = []
                    for dp_, tp in _logical(sh):
                        requests += 1
                        key = (mb, key_s, sh, dp_, tp)
                        if key not in memo:
                            if time.perf_counter() - t0 > time_limit:
                                skipped += 1
                                continue
                            dl = inter if sh[0] > 1 else intra
                            t_ilp = time.perf_counter()
                            try:
                                memo[key] = price_stage(
                                    g, a, b, dp_, tp, "alpa", device=device, data_link=dl,
                                    model_link=intra, send_link=inter,
                                    time_limit=ilp_time_limit, memory=memory_per_device)
                            except PlanError:
                                memo[key] = None     # no intra-op plan fits the budget
                            ilps += 1
                            profile_s += time.perf_counter() - t_ilp
                        if memo[key] is not None:
                            profs.append(memo[key])
                    for s in range(1, n_stages + 1):
                        fit = [p for p in profs if p.memory(min(s, M)) <= memory_per_device]
                        smallest = min([smallest] + [p.memory(min(s, M)) for p in profs])
                        if fit:
                            p = min(fit, key=lambda p: p.time_s)
                            cost[(i, j, sh, min(s, M))] = (p.time_s, (p.dp, p.tp), p)
        if skipped:
            capped.append(f"micro-batch {mb}: {skipped} stage profiles skipped at the "
                          f"{time_limit:.0f} s time limit")
        t1 = time.perf_counter()
        r = inter_op_dp(cost, L, shapes, devices, M, n_stages, t_max_levels,
                        bound=best[0] if best is not None else math.inf)
        if r is not None:
            step, stages, note = r
            if note:
                capped.append(f"micro-batch {mb}: {note}")
            S = len(stages)
            ps = [cost[(k, j, sh, min(S - n, M))][2] for n, ((k, j), sh, _, _) in
                  enumerate(stages)]
            log.append(f"micro-batch {mb}: {S} stages, step {step:.4g} s")
            if best is None or step < best[0]:
                mem = tuple(p.memory(min(S - n, M)) for n, p in enumerate(ps))
                best = (step, mb, M, clusters, tuple(stages), mem)
        dp_s += time.perf_counter() - t1
    if best is None:
        raise PlanError(f"alpa_pipeline_search: no stage / sub-mesh assignment fits "
                        f"{memory_per_device / 2**30:.1f} GiB per device on {devices} devices; "
                        f"the smallest estimate is ~{smallest / 2**30:.1f} GiB")
    step, mb, M, clusters, stages, mem = best
    return InterOpResult(stages, clusters, M, mb, step, mem, time.perf_counter() - t0,
                         profile_s, dp_s, (ilps, requests), "; ".join(capped), tuple(log))


def _batch(graph: Graph) -> int:
    return next((t.shape[0] for t in graph.inputs if t.role is Role.INPUT and t.shape), 1)
