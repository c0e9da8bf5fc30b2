"""Pipelines: measured memory of the runtime's schedules, and the stage searches on GPT-3 175B.

``memory`` (default): XLA's compiled memory analysis of the whole jitted step (``temp`` =
activations, buffers and scratch; ``argument`` = params, optimizer state and batch) for GPT
(8 layers, d 128, seq 128) on a (stage 4, data 2) mesh of 8 CPU devices at 8 micro-batches.

``--search``: GPT-3 175B (unrolled, abstract, micro-batch 1) on 64 abstract H100s (8 per
node, the ``h100-80g-8x`` cluster preset of :mod:`nnscaler_jax.cost.devices`): our stage DP (:func:`search_stages`), the Alpa-style inter-op DP
(:func:`alpa_pipeline_search`) and a Megatron-style 3-D plan (8-way TP x 8 stages), each
stage priced by the same pricer (:func:`price_stage`: its intra-op plan by our ILP / the
Alpa-style ILP / the megatron policy, the cost model at the micro-batch, recompute) and the same
objective ``sum t + (B - 1) max t + max sync``. Writes results/bench_pipeline.json (+ .md).

    .venv/bin/python scripts/bench_pipeline.py [--search [--layers 8] [--alpa-limit 600]]
"""

import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax
import optax

import models
from nnscaler_jax import Constraints, auto_parallel
from nnscaler_jax.cost.devices import cluster_preset
from nnscaler_jax.pipeline import schedule as sch

CLUSTER = cluster_preset("h100-80g-8x")   # H100 80 GB, NVLink 4 in a node, IB NDR across


def measure(schedule: str, stages: int = 4, micro: int = 8, mb_size: int = 4) -> dict:
    dp = 8 // stages
    spec = models.get("gpt", "tiny", n_layers=8, d_model=128, n_heads=4, seq_len=128,
                      n_positions=128, vocab_size=256, batch_size=micro * dp * mb_size)
    (tokens,) = spec.make_args()
    params = spec.init(jax.random.PRNGKey(0))["params"]
    mesh = jax.make_mesh((stages, dp), ("stage", "data"), devices=jax.devices()[:8])
    pm = auto_parallel(mesh, Constraints(pipeline_stages=stages, microbatches=micro,
                                         schedule=schedule))(spec.module)
    step = pm.train_step(spec.loss_fn, optax.adam(1e-3))
    state = step.init({"params": params}, tokens)
    t0 = time.perf_counter()
    compiled = step.lower(state, tokens).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    state, metrics = step(state, tokens)
    t0 = time.perf_counter()
    for _ in range(3):
        state, metrics = step(state, tokens)
    jax.block_until_ready(metrics["loss"])
    prog = step.program
    act = mb_size * spec.config.seq_len * spec.config.d_model * 4
    return {
        "schedule": schedule, "stages": stages, "microbatches": micro, "data": dp,
        "microbatch_size": mb_size, "time_steps": int(prog.tables.kind.shape[0]),
        "peak_in_flight": list(sch.peak_in_flight(prog.schedule)),
        "input_buffer_slots": prog.tables.n_in, "stage_input_bytes": act,
        "temp_bytes": int(mem.temp_size_in_bytes),
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "compile_s": round(compile_s, 2), "step_s": round((time.perf_counter() - t0) / 3, 4),
        "loss": float(metrics["loss"]),
    }


OUT = os.path.join(os.path.dirname(__file__), "..", "results", "bench_pipeline.json")


# ---- GPT-3 175B on 64 devices: ours vs Alpa's inter-op DP vs Megatron 3-D ------------------


def _unit_starts(graph) -> list[int]:
    """Op index where each stage-DP unit (prefix, layers, suffix) starts, + len(ops)."""
    from nnscaler_jax.pipeline.stages import graph_layers

    where = graph_layers(graph)
    return [0] + [a for a, _ in where.bounds] + [where.end, len(graph.ops)]


def _price(graph, op_bounds, dp, tp, policy, M, memory, memo) -> dict:
    """Each stage by ``price_stage`` (memoised by structure), the common objective."""
    from nnscaler_jax.pipeline.inter_op import price_stage, stage_structure

    t0 = time.perf_counter()
    profs = []
    for a, b in op_bounds:
        key = (policy, stage_structure(graph, a, b), b == len(graph.ops), dp, tp)
        if key not in memo:
            c = CLUSTER
            memo[key] = price_stage(graph, a, b, dp, tp, policy, device=c.device,
                                    data_link=c.intra if dp * tp <= c.devices_per_node
                                    else c.inter, model_link=c.intra, send_link=c.inter,
                                    memory=memory)
        profs.append(memo[key])
    S = len(profs)
    ts = [p.time_s for p in profs]
    mem = [p.memory(min(S - k, M)) for k, p in enumerate(profs)]
    return {"stage_time_s": ts, "step_time_s": sum(ts) + (M - 1) * max(ts)
            + max(p.sync_s for p in profs), "memory_gib": [m / 2**30 for m in mem],
            "fits": max(mem) <= memory, "price_s": time.perf_counter() - t0}


def run(layers: int, alpa_limit: float, global_batch: int) -> dict:
    import warnings

    from nnscaler_jax.capture.trace import capture
    from nnscaler_jax.cost.model import CostModel
    from nnscaler_jax.pipeline.inter_op import alpa_pipeline_search
    from nnscaler_jax.pipeline.stage_dp import search_stages
    from nnscaler_jax.pipeline.units import layer_units

    N, per_node, mem = 64, CLUSTER.devices_per_node, CLUSTER.device.memory_bytes
    t0 = time.perf_counter()
    import jax.numpy as jnp

    spec = models.get("gpt", "gpt3-175b", batch_size=1, dtype=jnp.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        graph = capture(spec.module, *spec.make_args(abstract=True),
                        variables=spec.init_abstract()).graph
    trace_s = time.perf_counter() - t0
    starts = _unit_starts(graph)
    memo: dict = {}
    out = {"model": "gpt3-175b unrolled (96 layers), bf16 compute, fp32 params + Adam, micro-batch 1, seq 2048", "devices": N,
           "per_node": per_node, "memory_per_device_gib": mem / 2**30, "global_batch": global_batch,
           "ops": len(graph.ops), "trace_s": trace_s}
    # ours: the stage DP on per-layer units, then our ILP inside each stage
    t0 = time.perf_counter()
    units = layer_units(graph, batch=1, model=CostModel.for_axes({"x": 1}, device=CLUSTER.device))
    best = search_stages(units, N, global_batch, mem, intra=CLUSTER.intra, inter=CLUSTER.inter)
    dp_s = time.perf_counter() - t0
    ob = [(starts[a], starts[b]) for a, b in best.bounds]
    mb = best.microbatch_size
    ours = {"search_s": dp_s, "stages": best.stages, "tp": best.tp, "dp": best.dp,
            "microbatches": best.microbatches, "microbatch_size": mb,
            "own_prediction_s": best.step_time_s, "unit_bounds": best.bounds}
    if mb == 1:
        ours.update(_price(graph, ob, best.dp, best.tp, "auto", best.microbatches, mem, memo))
        ours["search_plus_stage_ilps_s"] = dp_s + ours["price_s"]
    out["ours"] = ours
    print("ours", json.dumps(ours), flush=True)
    # Megatron 3-D: TP 8 inside a node x 8 stages of 12 layers, micro-batch 1, 1F1B
    S = 8
    per = 96 // S
    mb_bounds = [(0 if k == 0 else 1 + per * k, len(units) if k == S - 1 else 1 + per * (k + 1))
                 for k in range(S)]
    mega = {"stages": S, "tp": 8, "dp": 1, "microbatches": global_batch, "microbatch_size": 1}
    mega.update(_price(graph, [(starts[a], starts[b]) for a, b in mb_bounds], 1, 8, "megatron",
                       global_batch, mem, memo))
    out["megatron_3d"] = mega
    print("megatron", json.dumps(mega), flush=True)
    # Alpa-style inter-op DP (its stages priced by the Alpa-style ILP inside)
    r = alpa_pipeline_search(graph, N, global_batch, mem, per_node=per_node, layers=layers,
                             device=CLUSTER.device, intra=CLUSTER.intra, inter=CLUSTER.inter,
                             time_limit=alpa_limit)
    out["alpa_interop"] = {
        "search_s": r.search_s, "profile_s": r.profile_s, "dp_s": r.dp_s,
        "ilps": r.profiles[0], "profile_requests": r.profiles[1], "layers": layers,
        "stages": [{"layers": list(kj), "submesh": list(sm), "logical": list(lg),
                    "time_s": t} for kj, sm, lg, t in r.stages],
        "microbatches": r.microbatches, "microbatch_size": r.microbatch_size,
        "step_time_s": r.step_time_s, "memory_gib": [m / 2**30 for m in r.memory_bytes],
        "capped": r.capped}
    print(str(r), flush=True)
    md = os.path.splitext(OUT)[0] + ".md"
    rows = [("ours (stage DP + our ILP per stage)", ours.get("search_plus_stage_ilps_s", dp_s),
             ours.get("step_time_s", float("nan")),
             f"{best.stages} stages x tp {best.tp} x dp {best.dp}, M {best.microbatches}"),
            ("Alpa-style inter-op DP", r.search_s, r.step_time_s,
             f"{len(r.stages)} stages, M {r.microbatches}, L {layers}"
             + (" (capped)" if r.capped else "")),
            ("Megatron 3-D (hand)", 0.0, mega["step_time_s"],
             f"8 stages x tp 8, M {global_batch}")]
    with open(md, "w") as f:
        f.write(f"# Stage search on GPT-3 175B, {N} H100 ({per_node} per node), "
                f"{mem / 1e9:.0f} GB, global batch "
                f"{global_batch} (predicted)\n\n| planner | search s | step s | plan |\n"
                "|---|---|---|---|\n")
        f.writelines(f"| {name} | {s_:.1f} | {t:.2f} | {desc} |\n" for name, s_, t, desc in rows)
        f.write(f"\nOur stage DP alone: {dp_s:.2f} s (its own unit model predicts "
                f"{best.step_time_s:.2f} s). Alpa: {r.profiles[0]} stage ILPs for "
                f"{r.profiles[1]} profile requests; {r.capped or 'not capped'}.\n")
    return out


def _load() -> dict:
    return json.load(open(OUT)) if os.path.exists(OUT) else {}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--search", action="store_true", help="the 175B stage-search comparison")
    ap.add_argument("--layers", type=int, default=8, help="Alpa's layer clustering L")
    ap.add_argument("--alpa-limit", type=float, default=600.0, help="Alpa profiling seconds")
    ap.add_argument("--global-batch", type=int, default=1536)
    args = ap.parse_args()
    if args.search:
        data = _load()
        data["search_175b"] = run(args.layers, args.alpa_limit, args.global_batch)
        with open(OUT, "w") as f:
            json.dump(data, f, indent=1)
        return
    rows = [measure(s) for s in ("gpipe", "1f1b", "interleaved")]
    data = _load()
    data.update({"note": "XLA compiled memory_analysis per device of the jitted pipelined "
                 "train step (CPU, 8 virtual devices)", "rows": rows})
    with open(OUT, "w") as f:
        json.dump(data, f, indent=1)
    for r in rows:
        print(f"{r['schedule']:>12}: temp {r['temp_bytes'] / 2**20:8.2f} MiB, slots "
              f"{r['input_buffer_slots']}, peak in flight {r['peak_in_flight']}, "
              f"{r['time_steps']} steps, {r['step_s'] * 1e3:.0f} ms/step")


if __name__ == "__main__":
    main()
