"""Pipelines: measured memory of the runtime's schedules, and the stage searches on GPT-3 175B.

``memory`` (default): XLA's compiled memory analysis of the whole jitted step (``temp`` =
activations, buffers and scratch; ``argument`` = params, optimizer state and batch) for GPT
(8 layers, d 128, seq 128) on a (stage 4, data 2) mesh of 8 CPU devices at 8 micro-batches.

``--t5``: T5 ``t5-nnscaler-8gpu`` (11.6B, abstract) on the ``v100-32g-8x`` cluster preset, cut
at module boundaries (:func:`~nnscaler_jax.pipeline.cut.plan_cut`) on 8 devices as (stage, data)
= (2, 4), (4, 2), (8, 1), global batch 32: each schedule's best priced row (interlaced, 1F1B,
eager 1F1B, GPipe, interleaved; :mod:`nnscaler_jax.pipeline.pricing`) and the runtime-restricted
stage DP's own choice (what ``pipeline_stages="auto"`` picks: fitting first, then fastest).

``--search``: GPT-3 175B (unrolled, abstract, micro-batch 1) on 64 abstract H100s (8 per
node, the ``h100-80g-8x`` cluster preset of :mod:`nnscaler_jax.cost.devices`): our stage DP (:func:`search_stages`), the Alpa-style inter-op DP
(:func:`alpa_pipeline_search`) and a Megatron-style 3-D plan (8-way TP x 8 stages), each
stage priced by the same pricer (:func:`price_stage`: its intra-op plan by our ILP / the
Alpa-style ILP / the megatron policy, the cost model at the micro-batch, recompute) and the same
objective ``sum t + (B - 1) max t + max sync``. Writes results/bench_pipeline.json (+ .md).

    .venv/bin/python scripts/bench_pipeline.py [--t5 [--xla]] [--search [--layers 8] [--alpa-limit 600]]

``--t5 --xla``: the per-stage runtime's interlaced and 1F1B plans (2 stages x Megatron 4) also
compiled by XLA:GPU for the V100, program by program (``check_stages``).
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # (before jax: the CUDA plugin's compile-only
# devices for --xla, and no failing GPU start-up)
from nnscaler_jax.mesh.cpu import cpu_xla_flags  # starts no JAX backend

os.environ["XLA_FLAGS"] = cpu_xla_flags(os.environ.get("XLA_FLAGS", ""))

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
    predicted = step.plan.cost.memory_bytes_per_device
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
        "schedule": schedule, "runtime": type(prog).__name__, "kept_slots": prog.tables.n_s,
        "stages": stages, "microbatches": micro, "data": dp,
        "microbatch_size": mb_size, "time_steps": int(prog.tables.kind.shape[0]),
        "peak_in_flight": list(sch.peak_in_flight(prog.schedule)),
        "input_buffer_slots": prog.tables.n_in, "cotangent_buffer_slots": prog.tables.n_g,
        "stage_input_bytes": act, "predicted_bytes": int(predicted),
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
    from nnscaler_jax.ir.layers import graph_layers

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
    return out


# ---- T5 (nnScaler's 8-GPU artifact) on V100s: schedules of the cut program, priced ----------

T5_CLUSTER = "v100-32g-8x"
# (mesh, policy): stages data-parallel inside (either runtime, priced both ways), and nnScaler's
# shape, 2 stages x tensor-parallel 4 (Megatron inside; one program per stage, events)
T5_MESHES = [({"stage": 2, "data": 4}, None), ({"stage": 4, "data": 2}, None),
             ({"stage": 8}, None), ({"stage": 2, "model": 4}, "megatron")]
T5_SCHEDULES = ("interlaced", "1f1b", "eager-1f1b", "gpipe", "interleaved", "zb-h1")


def _row(r) -> dict:
    return {"schedule": r.schedule, "virtual": r.virtual, "microbatches": r.microbatches,
            "microbatch_size": r.microbatch_size, "step_time_s": r.step_time_s,
            "bubble_s": r.bubble_s, "compute_s": r.compute_s, "comm_s": r.comm_s,
            "memory_gib": [m / 2**30 for m in r.memory_bytes],
            "peak_gib": max(r.memory_bytes) / 2**30, "fits": r.fits, "executor": r.executor,
            "overlap": r.overlap}


def t5(global_batch: int = 32) -> dict:
    """Each schedule's best row and the stage DP's choice per mesh (see the module doc)."""
    from nnscaler_jax.capture.trace import capture_spec
    from nnscaler_jax.constraints import Constraints
    from nnscaler_jax.cost.devices import default_budget
    from nnscaler_jax.cost.model import CostModel
    from nnscaler_jax.errors import PlanError
    from nnscaler_jax.pipeline.cut import plan_cut

    cluster = cluster_preset(T5_CLUSTER)
    graph = capture_spec(models.get("t5", "t5-nnscaler-8gpu", batch_size=global_batch)).graph
    out = {"model": "t5-nnscaler-8gpu (11.6B, vocab 1,024,000 tied, seq 1024 / 1024), fp32 "
           "params + Adam", "cluster": T5_CLUSTER, "global_batch": global_batch, "meshes": []}
    for axes, policy in T5_MESHES:
        cm = CostModel.for_cluster(cluster, axes)
        budget = default_budget(axes, cluster)
        entry = {"mesh": axes, "policy": policy, "budget_gib": budget / 2**30,
                 "schedules": {}}
        for name in T5_SCHEDULES:
            try:
                # ("auto": both runtimes priced where both run, as the stage DP weighs them)
                cut = plan_cut(graph, axes, Constraints(pipeline_stages="auto",
                                                        schedule=name),
                               policy, 2 if name == "interleaved" else 1, cm)
                rows = cut.setup.choices(budget, schedule=name, overlap=None)
            except PlanError as e:
                entry["schedules"][name] = {"error": str(e).splitlines()[0][:200]}
                continue
            entry["schedules"][name] = _row(rows[0])
            entry.setdefault("by_executor", {})[name] = {
                ex: _row(next(r for r in rows if r.executor == ex and not r.overlap))
                for ex in cut.setup.executors
                if any(r.executor == ex and not r.overlap for r in rows)}
            lock = [r for r in rows if r.executor == "in-graph"]
            if any(r.overlap for r in lock):  # the in-graph runtime's transfers overlapped
                entry.setdefault("by_overlap", {})[name] = {
                    k: _row(next(r for r in lock if r.overlap is o))
                    for k, o in (("after", False), ("overlapped", True))}
            if name == "1f1b":  # the runtime-restricted stage DP (pipeline_stages="auto")
                entry["dp_choice"] = _row(cut.setup.choices(budget, overlap=None)[0])
                entry["units"] = [{"name": u.name, "time_s": u.time_s,
                                   "param_gib": u.param_bytes / 2**30,
                                   "act_gib_per_sample": u.act_bytes / 2**30,
                                   "out_mib_per_sample": u.out_bytes / 2**20}
                                  for u in cut.setup.units]
        out["meshes"].append(entry)
        print(axes, {k: (round(v.get("step_time_s", 0), 2), round(v.get("peak_gib", 0), 1),
                         v.get("microbatches")) for k, v in entry["schedules"].items()},
              flush=True)
    return out


def t5_xla(t: dict, schedules: tuple[str, ...] = ("interlaced", "1f1b")) -> None:
    """``--t5 --xla``: on the meshes whose stages run one program each (a policy inside),
    each of ``schedules``' best row planned again (its micro-batches; under the budget when it
    fits) and compiled by XLA:GPU for the cluster's GPU program by program
    (:func:`nnscaler_jax.train.xla_gpu.check_stages`); the entry gains ``xla``."""
    from nnscaler_jax.capture.trace import capture_spec
    from nnscaler_jax.cli.xla import xla_entry
    from nnscaler_jax.cost.model import CostModel
    from nnscaler_jax.planner import plan_and_report

    cluster = cluster_preset(T5_CLUSTER)
    spec = models.get("t5", "t5-nnscaler-8gpu", batch_size=t["global_batch"])
    graph = capture_spec(spec).graph
    for e in t["meshes"]:
        if not e.get("policy"):
            continue
        axes = e["mesh"]
        e["xla"] = {}
        for name in schedules:
            row = e["schedules"].get(name)
            if row is None or "error" in row:
                continue
            # (a row over the budget: planned without one, as priced)
            budget = e["budget_gib"] * 2**30 if row["fits"] else 2.0**50
            plan = plan_and_report(graph, axes, policy=e["policy"],
                                   cost_model=CostModel.for_cluster(cluster, axes),
                                   constraints=Constraints(
                                       pipeline_stages=axes["stage"], schedule=name,
                                       microbatches=row["microbatches"],
                                       max_memory_per_device=budget)).plan
            x = xla_entry(spec, plan, cluster, axes)
            e["xla"][name] = x if "error" in x else {
                "estimate_gib": plan.cost.memory_bytes_per_device / 2**30,
                "peak_gib": x["peak_bytes"] / 2**30, "over_estimate": x["over_estimate"],
                "fits": x["fits"], "xla_remat": x["xla_remat"],
                "involuntary_remat": x["involuntary_remat"], "compile_s": x["compile_s"],
                "stages_gib": [st["peak_bytes"] / 2**30 for st in x["stages"]]}
            print("xla", axes, name, e["xla"][name], flush=True)


# ---- results/bench_pipeline.md from the JSON ------------------------------------------------


def _memory_md(rows: list[dict]) -> list[str]:
    mib = lambda b: f"{b / 2**20:.2f}"
    r0 = rows[0]
    lines = ["## Measured: XLA compiled memory of the pipelined step (CPU, 8 devices)", "",
             (f"GPT (8 layers, d 128, seq 128), stage {r0['stages']} x data {r0['data']}, "
             f"{r0['microbatches']} micro-batches of {r0['microbatch_size']}, Adam; per device, "
             "MiB. `predicted`: the plan's `cost.memory_bytes_per_device`; step times are CPU "
             "(devices share 2 cores), not meaningful for speed."), "",
             ("| schedule | time steps | input / cotangent slots | peak in flight | predicted | "
             "XLA temp | XLA argument | compile s | step s |"), "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        name = r["schedule"] + (" (cut program)" if r.get("runtime") == "CutProgram" else "")
        lines.append(f"| {name} | {r['time_steps']} | {r['input_buffer_slots']} / "
                     f"{r.get('cotangent_buffer_slots', '-')} | {r['peak_in_flight']} | "
                     f"{mib(r['predicted_bytes']) if 'predicted_bytes' in r else '-'} | "
                     f"{mib(r['temp_bytes'])} | {mib(r['argument_bytes'])} | "
                     f"{r['compile_s']} | {r['step_s']} |")
    by = {r["schedule"]: r for r in rows}
    if all("predicted_bytes" in r for r in rows) and {"gpipe", "1f1b"} <= set(by):
        g, o = by["gpipe"], by["1f1b"]
        meas = (g["temp_bytes"] + g["argument_bytes"]) - (o["temp_bytes"] + o["argument_bytes"])
        lines += ["", (f"GPipe - 1F1B: predicted "
                  f"{mib(g['predicted_bytes'] - o['predicted_bytes'])} MiB, measured (temp + "
                  f"argument) {mib(meas)} MiB. The absolute predictions are below XLA's: the "
                  "schedule-independent terms (one chunk's recomputed activations, the step's "
                  "gradient / update temporaries) are under-priced; see "
                  "results/bench_pipeline_memory.md.")]
    if "eager-1f1b" in by and "predicted_bytes" in by["eager-1f1b"]:
        e, o = by["eager-1f1b"], by["1f1b"]
        lines += ["", (f"Eager 1F1B - 1F1B: predicted "
                  f"{mib(e['predicted_bytes'] - o['predicted_bytes'])} MiB (its "
                  f"{e['input_buffer_slots'] - o['input_buffer_slots']} more input slots; a "
                  "pair adds nothing: the loops run a forward lane and a backward lane, so a "
                  "step holds one set of gradient results either way), XLA temp "
                  f"{mib(e['temp_bytes'] - o['temp_bytes'])} MiB.")]
    return lines + [""]


def _xla_text(e: dict) -> str:
    """`` Compiled by XLA:GPU for the V100 ...`` of a mesh entry with ``--xla`` figures."""
    xs = {k: x for k, x in (e.get("xla") or {}).items() if "error" not in x}
    if not xs:
        return ""
    return (" Compiled by XLA:GPU for the V100, program by program (compile-only devices, no "
            "autotuning; with the chunk inputs a stage keeps for its backwards): "
            + "; ".join(f"{k} {x['peak_gib']:.1f} GiB a device ({x['over_estimate']:.2f} of "
                        f"its {x['estimate_gib']:.1f} GiB estimate; stages "
                        + " / ".join(f"{g:.1f}" for g in x["stages_gib"]) + ")"
                        + (", XLA rematerialized" if x["xla_remat"] else "")
                        + ("" if x["fits"] else ", over the device")
                        for k, x in xs.items()) + ".")


def _fit_text(r: dict | None) -> str:
    """``75.5 s, 27.7 GiB (fits)`` of a schedule's row."""
    if r is None or "error" in r:
        return "not priced"
    return (f"{r['step_time_s']:.1f} s, {r['peak_gib']:.1f} GiB per device "
            f"({'fits' if r['fits'] else 'over the budget'})")


def _t5_md(t: dict) -> list[str]:
    lines = [(f"## T5 {t['model']} on {t['cluster']}, global batch {t['global_batch']} "
             "(predicted)"), "",
             ("Cut at module boundaries (the cut-program runtime). Per schedule its best row "
             "(fitting first, then fastest); `DP choice`: the runtime-restricted stage DP "
             "(`pipeline_stages=\"auto\"`, schedules gpipe / 1f1b / eager-1f1b / interleaved / "
             "zb-h1 / interlaced). Step s / peak GiB per device / micro-batches x size; `ps`: "
             "run one program per stage (each stage running its blocks as their inputs "
             "arrive, priced by events), else one program in lock step; `ov`: in lock step "
             "with each step's transfers overlapped with the next step's compute "
             "(`Constraints(pipeline_overlap=)`, priced both ways). Stages data-parallel "
             "inside run either, the planner pricing both (`PipelineSettings.executor`); "
             "`stage 2 x model 4` (Megatron inside the stages, nnScaler's shape) runs one "
             "program per stage."), "",
             "| mesh | budget GiB | " + " | ".join(T5_SCHEDULES) + " | DP choice |",
             "|---" * (len(T5_SCHEDULES) + 3) + "|"]
    mesh_of = lambda e: " x ".join(f"{k} {v}" for k, v in e["mesh"].items())
    cell = lambda r: ("-" if r is None or "error" in r else
                      f"{r['step_time_s']:.1f} / {r['peak_gib']:.1f} / {r['microbatches']} x "
                      f"{r['microbatch_size']}" + (" ps" if r.get("executor") == "per-stage"
                                                    else "") + (" ov" if r.get("overlap") else "")
                      + ("" if r["fits"] else " (over)"))
    for e in t["meshes"]:
        mesh = mesh_of(e)
        dp = e.get("dp_choice")
        lines.append(f"| {mesh} | {e['budget_gib']:.1f} | "
                     + " | ".join(cell(e["schedules"].get(s)) for s in T5_SCHEDULES)
                     + f" | {dp['schedule'] + ' ' + cell(dp) if dp else '-'} |")
    e = t["meshes"][0]
    ex = e["by_executor"]
    g, o, ea = (ex[k]["in-graph"] for k in ("gpipe", "1f1b", "eager-1f1b"))
    og, gg = ex["1f1b"].get("per-stage"), ex["gpipe"].get("per-stage")
    shared = e["units"][0]["param_gib"]
    lines += ["", (
        f"{mesh_of(e)}, at {o['microbatches']} micro-batches: one program per stage, 1F1B "
        f"{og['step_time_s']:.1f} s = GPipe {gg['step_time_s']:.1f} s ({og['peak_gib']:.2f} / "
        f"{gg['peak_gib']:.2f} GiB): each stage runs as its inputs arrive. In one program in "
        f"lock step: 1F1B {o['step_time_s']:.1f} s, GPipe {g['step_time_s']:.1f} s, eager "
        f"1F1B {ea['step_time_s']:.1f} s ({o['peak_gib']:.2f} / {g['peak_gib']:.2f} / "
        f"{ea['peak_gib']:.2f} GiB). That runtime walks the step table in lock step (each time "
        "step ends with both `ppermute`s, so it lasts as long as its slowest stage): 1F1B's "
        "table puts one stage's forward beside another's backward in every steady-state "
        "step, each then lasting a backward (recomputed forward + backward, about 3 "
        "forwards). Eager 1F1B (`2 (S - s - 1)` warm-up forwards, `paired`) runs a forward "
        "and a backward on every stage in each steady-state step: GPipe's compute time in "
        "`M + 2S - 1` time steps instead of `2 (M + S - 1)` (fewer `ppermute` rounds), with "
        "`2 (S - s) - 1` micro-batches in flight instead of `M`. So the planner runs 1F1B "
        "one program per stage there. The memory is nearly equal "
        "here because stages keep only their input per in-flight micro-batch (recompute), "
        f"while every stage holds the replicated tied embedding ({shared:.1f} GiB, x4 with "
        "gradient and Adam state) and one chunk's recomputed activations. Interlaced's E / H "
        "/ W blocks (the embedding, and the final norm + LM head + loss over the "
        "1,024,000-word vocabulary) run whole on one stage each while the others wait, as "
        "this runtime runs them (stages data-parallel inside), so it is slower than GPipe "
        "here; on tensor-parallel stages they run vocabulary-split over all devices (below).")]
    lines += _overlap_md(t, mesh_of)
    for e in t["meshes"]:
        if not e.get("policy"):
            continue
        r = {k: v for k, v in e["schedules"].items() if "error" not in v}
        lines += ["", (
            f"{mesh_of(e)} ({e['policy']} inside the stages, one program per stage, priced by "
            "events): " + ", ".join(f"{k} {v['step_time_s']:.1f} s / {v['peak_gib']:.1f} GiB"
                                    for k, v in r.items())
            + ". Stages that run as their inputs arrive give 1F1B GPipe's time at equal "
            "micro-batches; zb-h1's weight gradients fill the bubbles, for the values its "
            "backwards keep. The other schedules keep the tied 1,024,000-word embedding and "
            "LM head on both stages, whole on every device as Megatron's in-stage plan stores "
            "it (priced as the in-stage plan stores each parameter); interlaced, as "
            "nnScaler's T5 plan, runs them on all 8 devices at once, the table split on its "
            "vocabulary 8 ways (both embeddings in E, the head + loss in H), so only its "
            "shape fits: " + _fit_text(r.get("interlaced")) + "." + _xla_text(e))]
    return lines + [""]


def _overlap_md(t: dict, mesh_of) -> list[str]:
    """In lock step, each schedule's best row with the transfers after each step and
    overlapped with the next (``by_overlap``)."""
    out = []
    for e in t["meshes"]:
        pairs = e.get("by_overlap", {})
        if not pairs:
            continue
        text = "; ".join(
            f"{k} {v['after']['step_time_s']:.2f} -> {v['overlapped']['step_time_s']:.2f} s "
            f"({v['after']['microbatches']} / {v['overlapped']['microbatches']} micro-batches)"
            for k, v in pairs.items())
        out += ["", (f"{mesh_of(e)}, one program in lock step, transfers after each step -> "
                     f"overlapped with the next step's compute (each the schedule's best row): "
                     f"{text}. Overlapped, a step lasts its compute or its transfers, the "
                     "longer, on a table one step longer a hop (and two more stage inputs "
                     "held).")]
    return out


def _search_md(d: dict) -> list[str]:
    ours, a, mega = d["ours"], d["alpa_interop"], d["megatron_3d"]
    rows = [("ours (stage DP + our ILP per stage)",
             ours.get("search_plus_stage_ilps_s", ours["search_s"]),
             ours.get("step_time_s", float("nan")),
             (f"{ours['stages']} stages x tp {ours['tp']} x dp {ours['dp']}, "
             f"M {ours['microbatches']}")),
            ("Alpa-style inter-op DP", a["search_s"], a["step_time_s"],
             f"{len(a['stages'])} stages, M {a['microbatches']}, L {a['layers']}"
             + (" (capped)" if a["capped"] else "")),
            ("Megatron 3-D (hand)", 0.0, mega["step_time_s"],
             f"8 stages x tp 8, M {d['global_batch']}")]
    lines = [(f"## Stage search on GPT-3 175B, {d['devices']} H100 ({d['per_node']} per node), "
             f"{d['memory_per_device_gib'] * 2**30 / 1e9:.0f} GB, global batch {d['global_batch']} "
             "(predicted)"), "", "| planner | search s | step s | plan |", "|---|---|---|---|"]
    lines += [f"| {n} | {s_:.1f} | {t:.2f} | {desc} |" for n, s_, t, desc in rows]
    lines += ["", f"Our stage DP alone: {ours['search_s']:.2f} s (its own unit model predicts "
              f"{ours['own_prediction_s']:.2f} s). Alpa: {a['ilps']} stage ILPs for "
              f"{a['profile_requests']} profile requests; {a['capped'] or 'not capped'}."
              + (f" {d['note']}" if d.get("note") else ""), ""]
    return lines


def _write(data: dict) -> None:
    with open(OUT, "w") as f:
        json.dump(data, f, indent=1)
    lines = ["# Pipelines", "", ("Written by scripts/bench_pipeline.py from "
             "results/bench_pipeline.json."), ""]
    if "rows" in data:
        lines += _memory_md(data["rows"])
    if "t5" in data:
        lines += _t5_md(data["t5"])
    if "search_175b" in data:
        lines += _search_md(data["search_175b"])
    with open(os.path.splitext(OUT)[0] + ".md", "w") as f:
        f.write("\n".join(lines))


def _load() -> dict:
    return json.load(open(OUT)) if os.path.exists(OUT) else {}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--search", action="store_true", help="the 175B stage-search comparison")
    ap.add_argument("--layers", type=int, default=8, help="Alpa's layer clustering L")
    ap.add_argument("--alpa-limit", type=float, default=600.0, help="Alpa profiling seconds")
    ap.add_argument("--global-batch", type=int, default=1536)
    ap.add_argument("--t5", action="store_true", help="T5 schedules on v100-32g-8x (priced)")
    ap.add_argument("--xla", action="store_true",
                    help="with --t5: the per-stage runtime's plans compiled by XLA:GPU")
    args = ap.parse_args()
    data = _load()
    if args.t5:
        old = data.get("t5", {})
        data["t5"] = t5()
        if args.xla:
            t5_xla(data["t5"])
        else:  # (the per-stage plans compiled before: kept where their rows are unchanged)
            for e, was in zip(data["t5"]["meshes"], old.get("meshes", ()), strict=False):
                bare = lambda r: {k: v for k, v in (r or {}).items() if k != "overlap"}
                same = all(bare(e["schedules"].get(k)) == bare(was["schedules"].get(k))
                           for k in was.get("xla", {}))
                if "xla" in was and e["mesh"] == was["mesh"] and same:
                    e["xla"] = was["xla"]
        _write(data)
        return
    if args.search:
        data["search_175b"] = run(args.layers, args.alpa_limit, args.global_batch)
        if args.alpa_limit < 600:
            data["search_175b"]["note"] = (f"Reduced run: Alpa's profiling capped at "
                                           f"{args.alpa_limit:.0f} s (default 600 s).")
        _write(data)
        return
    rows = [measure(s) for s in ("gpipe", "1f1b", "eager-1f1b", "interleaved", "zb-h1")]
    data.update({"note": "XLA compiled memory_analysis per device of the jitted pipelined "
                 "train step (CPU, 8 virtual devices)", "rows": rows})
    _write(data)
    for r in rows:
        print(f"{r['schedule']:>12}: temp {r['temp_bytes'] / 2**20:8.2f} MiB, slots "
              f"{r['input_buffer_slots']}, peak in flight {r['peak_in_flight']}, "
              f"{r['time_steps']} steps, {r['step_s'] * 1e3:.0f} ms/step")


if __name__ == "__main__":
    main()
