"""Benchmark: the cost model's memory against XLA's GPU compiler, plan by plan.

Each case is planned as ``nnscaler-jax compare`` plans it (the cluster preset's cost model, its
device memory less the reserve as the budget, or ``--no-budget``: none), then the plan's whole
training step (forward, backward, AdamW, donated state) is compiled by XLA:GPU for the
cluster's GPU on compile-only devices (``nnscaler_jax.cli.xla.xla_entry``; no GPU needed).
Per case and planner: the estimate (``memory_bytes_per_device``), XLA's peak (argument + output +
temp - alias), their ratio, whether XLA fits the device, XLA's own rematerialization,
involuntary full rematerializations, the collectives (count and bytes per kind; the total in
the plan's ``comm_bytes`` convention: all-reduce / all-gather result bytes, reduce-scatter /
all-to-all p x result bytes) and the compile time. No autotuning happens without a device:
GEMM configurations are XLA's defaults.

Writes ``results/bench_xla_gpu.json`` after every case (a run of some cases is merged in) and
``results/bench_xla_gpu.md``. Run from the repository root:

    .venv/bin/python scripts/bench_xla_gpu.py [--only swin-8gpu,gpt3-1.3b-v100] [--planners auto]

``--reprice`` re-plans the stored cases without compiling and re-prices their communication
(step time, ``comm_bytes``, each collective kind beside XLA's) where the plan is the one
compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

from nnscaler_jax.cli.common import capture_model, model_spec, spec_mutable
from nnscaler_jax.cli.compare import one_planner
from nnscaler_jax.cli.xla import xla_entry
from nnscaler_jax.cost.devices import cluster_preset

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "results" / "bench_xla_gpu.json"
MESH = {"data": 2, "model": 4}
NO_BUDGET = 1 << 50

# name: (model, preset, cluster, precision, batch, planners, budget)
CASES = {
    "swin-8gpu": ("swin", "swin-nnscaler-8gpu", "v100-32g-8x", None, None, "auto,alpa", True),
    # the search's no-limit bound: what the budgeted plan's recompute buys (XLA:GPU's measure;
    # planned for V100s, compiled for a GPU it fits: COMPILED_ON)
    "swin-8gpu-free": ("swin", "swin-nnscaler-8gpu", "v100-32g-8x", None, None, "auto", False),
    "t5-8gpu": ("t5", "t5-nnscaler-8gpu", "v100-32g-8x", None, None, "auto,alpa", True),
    "af2-initial": ("evoformer", "af2-initial", "v100-32g-8x", None, None, "auto,megatron",
                    True),
    "af2-finetune": ("evoformer", "af2-finetune", "v100-32g-8x", None, None, "auto", True),
    "gpt3-1.3b-v100": ("gpt", "gpt3-1.3b", "v100-32g-8x", None, 8,
                       "dp,zero3,megatron,auto,alpa", True),
    "gpt3-1.3b-v100-free": ("gpt", "gpt3-1.3b", "v100-32g-8x", None, 8, "auto", False),
    "gpt3-1.3b-h100-bf16": ("gpt", "gpt3-1.3b", "h100-80g-8x", "bfloat16", 8,
                            "megatron,auto", True),
    "gpt3-6.7b-a100-bf16": ("gpt", "gpt3-6.7b", "a100-80g-8x", "bfloat16", 8,
                            "zero3,megatron,auto", True),
    "moe-380m-a100": ("moe", "moe-380m", "a100-80g-8x", None, None, "dp,auto", True),
    "llama3-8b-128k-h100": ("llama", "llama3-8b-128k", "h100-80g-8x", "bfloat16", None, "auto",
                            True),
}

# case -> the cluster whose GPU compiles its plans, where not the one it is planned for (a plan
# no V100 holds is compiled for a larger GPU, so XLA's peak is its own, not after XLA's remat)
COMPILED_ON = {"swin-8gpu-free": "h200-8x"}
# (budgeted case, its no-limit case): the memory the budget's recompute / co-sharding saves,
# priced against XLA:GPU's (the saving within 15% of priced is the goal)
SAVINGS = (("swin-8gpu", "swin-8gpu-free"),)

# (case, planner) -> why it is outside 5% (memory) or 10% (collective bytes): what was measured
# (docs/benchmarks.md has the history); a row outside with no cause here is listed as untraced.
# Since 2026-12-04 a value read alike by several ops is priced relaid out once per (value,
# target layout), as XLA makes it (the plan walk and the search's relayout sets): the rows
# whose cause was the per-reader pricing were re-run (all-gathers: GPT-3 6.7B 0.88 -> 0.98,
# 1.3B bf16 0.85 -> 1.00, T5-8 Alpa-style 0.71 -> 0.91, MoE 0.67 -> 0.86); and since then a
# recomputed block remakes them once per value and block, the operands of a matmul its policy
# keeps included (Swin-8 ours' all-gathers, all-reduces and all-to-alls XLA's to the byte)
EMBEDDING_GRADIENT = (
    "collectives by kind: all-gathers 1.10 and all-reduces 0.94 of priced, the totals equal "
    "(6.94 GB; the plan found since 2026-12-04): 0.21 GB priced as an all-reduce XLA moves as "
    "all-gathers, half the embedding table's gradient (51200 x 2048, float32), the pattern "
    "traced in the plan before (not re-traced): the table's gradient, a scatter-add of the "
    "tokens' cotangents, partial sums over `model`, was priced as a reduce-scatter over "
    "`model` (209.7 MB) and an all-gather (419.4 MB); XLA's SPMD partitioner all-gathers the "
    "cotangents (67.1 MB) and the token ids over `model` instead, each device scatter-adds "
    "into its own 6400 rows, and the rows are all-gathered over all 8 devices (419.4 MB): no "
    "reduce-scatter, 67 MB more all-gather; pricing a scatter-add whose operand is gathered "
    "rather than its result reduced is open")
CAUSES = {
    ("swin-8gpu-free", "auto"): (
        "the search's no-limit bound, run to say what holds Swin-8's budgeted step (4.471 s "
        "against this plan's 3.992 s, 1.12x): it fits no V100 (estimate 127.9 GiB; compiled "
        "for V100s, XLA's rematerialization pass counts 123.05 GiB before it starts, 0.962 of "
        "the estimate, and stops at 73.2 GiB), so it is compiled for H200s, whose fusions "
        "differ (Triton softmax: four score-sized buffers per window attention at the peak "
        "where V100's keep two; XLA rematerialized 4 instructions at H200's default budget); "
        "not traced further. The budgeted plan's estimate is 4% over XLA (swin-8gpu / auto); "
        "planned under a budget 4% higher (29.95 GiB) the search recomputes 39 layers instead "
        "of 40, 4.465 s (2026-12-04): the recompute is what fitting a V100 costs. The saving "
        "the budget makes: 99.24 GiB priced, XLA 88.58 GiB against H200's peak (0.893), 95.5 "
        "GiB against V100's rematerialization count (0.962)"),
    ("swin-8gpu", "auto"): (
        "collectives: XLA reduce-scatters 12.85 GB where 8.78 GB is priced. Traced in the plan "
        "before (XLA 12.74 GB, 8.66 priced; 2026-12-04): 5.78 GB are 51 reduce-scatters over "
        "`model` of float32 [4, 2304, 3072] cotangents (113 MB each), three in each of "
        "layers_2's 17 recomputed blocks' backward: the q, k and v projections' transposes "
        "each reduce their partial sums of the block input's cotangent, and the three are "
        "added after; the plan prices one reduction of their sum (17, 1.93 GB: one per tensor "
        "and layout, as XLA's all-reduce reassociation makes them where they are all-reduces). "
        "The other reduce-scatters are as priced (the MLP's 34, 1.93 GB; 17 of a sum XLA does "
        "reduce once, an `add_any` of [2, 2304, 3072], 0.96 GB). Which partial sums XLA adds "
        "before scattering and which after is not traced; pricing it is open"),
    ("gpt3-1.3b-v100", "zero3"): (
        "collectives by kind: XLA lowers ZeRO-3's gradient reduce-scatters as all-reduces and "
        "collective-permutes (10.5 + 9.7 GB where 21.0 GB of reduce-scatter is priced); the "
        "total is within 4%. Traced on GPT tiny (the same: all-reduce 55 KB, permute 53 KB, "
        "reduce-scatter 6 KB of 12 KB priced; 2026-12-04): ZeRO-3 splits over `data` only, "
        "`model`'s 4 devices repeat the work; XLA's partitioner splits each weight gradient "
        "in halves over half of `model` (the transposed dots), all-reduces those halves over "
        "`data` (one combined buffer) and moves each half to the devices storing it through a "
        "collective-permute swapping `data` with half of `model` (pairs 2<->4, 3<->5), where "
        "the plan reduce-scatters over `data`; why the partitioner splits over an axis the "
        "plan leaves replicated is not traced"),
    ("gpt3-1.3b-v100", "auto"): EMBEDDING_GRADIENT,
    ("gpt3-1.3b-v100", "alpa"): EMBEDDING_GRADIENT,
    ("gpt3-1.3b-v100-free", "auto"): EMBEDDING_GRADIENT,
    ("llama3-8b-128k-h100", "auto"): (
        "collectives by kind: the plan found since values read alike are priced relaid out "
        "once (2026-12-04; 43.3 GiB, 65.65 s priced) has XLA all-reduce 309 GB in its "
        "co-sharded attention's chunk loops (4064 all-reduces, 2048 fewer reduce-scatters: one "
        "per chunk of each layer) where reduce-scatters are priced (2049 GB priced, 1584 GB "
        "by XLA; the total 0.95 of priced); not traced. The plan before (49.4 GiB; 65.51 s "
        "under today's pricing too, the co-sharded search's probes stop within 0.1%) matched "
        "XLA per kind within 0.1%"),
    ("moe-380m-a100", "auto"): (
        "collectives by kind (traced in the compiled HLO, 2026-12-03, when the batch-split "
        "activations (8 x 1024 x 768, 6.3 MB) were priced gathered over `data` 48 times, one "
        "per reader, where XLA gathers 32; priced once per value and layout since 2026-12-04, "
        "all-gathers 0.35 GB priced, XLA's 0.30 GB, the rest not traced); the tied "
        "table's gradient (768 x 32000, float32, partial sums over `data` and `model`) priced "
        "as a reduce-scatter over both axes (98.3 MB) and an all-gather over `model` (49.2 MB), "
        "where XLA reduce-scatters over `data` (98.3 MB) and all-reduces the half-tables of its "
        "two contributions (the LM head's and the lookup's scatter-add) over `model` one by one "
        "(2 x 49.2 MB); its all-gather over `data` (98.3 MB) as priced; XLA reduce-scatters 28 "
        "activation cotangents over `data` where 24 are priced (25 MB)"),
}


def _outside(results: dict) -> list[str]:
    """One line per (case, planner) outside 5% of memory or 10% of collective bytes."""
    out = []
    for name, case in results.items():
        for planner, e in case["planners"].items():
            x = e.get("xla") or {}
            if "peak_bytes" not in x:
                continue
            what = []
            if abs(x["over_estimate"] - 1) > 0.05:
                what.append(f"memory {x['over_estimate']:.3f}")
            if e.get("comm_bytes") and x.get("comm_bytes") and \
                    abs(x["comm_bytes"] / e["comm_bytes"] - 1) > 0.10:
                what.append(f"collectives {x['comm_bytes'] / e['comm_bytes']:.2f}")
            what += [f"{kind} {ratio}" for kind, ratio in _kinds_outside(e, x)]
            if x.get("xla_remat"):
                what.append("XLA rematerialized")
            if what:
                why = CAUSES.get((name, planner), "not traced")
                out.append(f"- {name} / {planner} ({', '.join(what)}): {why}.")
    return out


def _kinds_outside(e: dict, x: dict) -> list[tuple[str, str]]:
    """The collective kinds whose bytes XLA and the plan's pricing put more than 10% apart,
    among those carrying at least 2% of the plan's or XLA's total (``XLA / priced``; ``"only
    XLA"`` / ``"only priced"`` where one side has none)."""
    total = max(e.get("comm_bytes") or 0, x.get("comm_bytes") or 0)
    out = []
    for kind, c in sorted((x.get("collectives") or {}).items()):
        got, priced = c.get("plan_bytes", 0), c.get("priced_bytes")
        if priced is None or max(got, priced) < 0.02 * total:
            continue
        if not priced or not got:
            out.append((kind, "only XLA" if got else "only priced"))
        elif abs(got / priced - 1) > 0.10:
            out.append((kind, f"{got / priced:.2f}"))
    return out


def _kinds_table(results: dict) -> list[str]:
    """Per (case, planner) and collective kind: bytes priced and XLA's (the same convention)."""
    rows = ["| case | planner | kind | priced GB | XLA GB | XLA / priced | XLA count |",
            "|---|---|---|---|---|---|---|"]
    for name, case in results.items():
        for planner, e in case["planners"].items():
            for kind, c in sorted(((e.get("xla") or {}).get("collectives") or {}).items()):
                if c.get("priced_bytes") is None:
                    continue
                ratio = f"{c['plan_bytes'] / c['priced_bytes']:.3f}" if c["priced_bytes"] \
                    else "-"
                rows.append(f"| {name} | {planner} | {kind} | {c['priced_bytes'] / 1e9:.2f} | "
                            f"{c['plan_bytes'] / 1e9:.2f} | {ratio} | {c['count']} |")
    return rows if len(rows) > 2 else []


def _planned_on(name: str) -> tuple:
    """Case ``name``'s model spec, the training step's graph it is planned on (the module and
    its loss) and the abstract 2 x 4 mesh."""
    model, preset, _cl, precision, batch, _default, _budgeted = CASES[name]
    spec = model_spec(model, preset, precision, **({"batch_size": batch} if batch else {}))
    graph = capture_model(spec, mutable=spec_mutable(spec), precision=precision,
                          loss=True).graph
    return spec, graph, jax.sharding.AbstractMesh(tuple(MESH.values()), tuple(MESH))


def _reprice(name: str, stored: dict) -> None:
    """Re-plan case ``name``'s planners and re-price the stored entries where the plan is the
    one compiled (the same features and memory to the byte; else it says so and leaves the
    entry): step time, ``comm_bytes`` and the priced bytes per collective kind beside XLA's."""
    from nnscaler_jax.cli.compare import plan_features
    from nnscaler_jax.cli.xla import add_priced

    _model, _preset, cl, _precision, _batch, _default, budgeted = CASES[name]
    _spec, graph, mesh = _planned_on(name)
    for planner, e in stored["planners"].items():
        x = e.get("xla") or {}
        if "collectives" not in x:
            continue
        plan, _ = one_planner(planner, graph, mesh, cluster_preset(cl),
                              None if budgeted else NO_BUDGET)
        # the plan compiled: the same features and memory to the byte (the pricing of its
        # communication may have changed since; XLA's figures depend on the plan alone)
        same = plan is not None and plan.cost.memory_bytes_per_device == \
            e["memory_bytes_per_device"] and json.loads(json.dumps(
            plan_features(plan), default=str)) == e.get("features")
        print(f"{name} {planner}: {'repriced' if same else 'a different plan: left'}",
              flush=True)
        if same:
            add_priced(x["collectives"], plan)
            e.update(step_time_s=plan.cost.step_time_s, comm_bytes=plan.cost.comm_bytes)


def _case(name: str, planners: list[str] | None) -> dict:
    model, preset, cl, precision, batch, default, budgeted = CASES[name]
    spec, graph, mesh = _planned_on(name)
    cluster = cluster_preset(cl)
    out = {"model": model, "preset": preset, "cluster": cl, "precision": precision,
           "batch": batch, "budget": "default" if budgeted else "none", "graph": "step",
           "planners": {}}
    for planner in planners or default.split(","):
        t0 = time.perf_counter()
        plan, entry = one_planner(planner, graph, mesh, cluster, None if budgeted else NO_BUDGET)
        if plan is not None:
            entry["xla"] = xla_entry(spec, plan, cluster_preset(COMPILED_ON.get(name, cl)),
                                     MESH)
        entry["seconds"] = time.perf_counter() - t0
        out["planners"][planner] = entry
        print(f"{name} {planner}: {_line(entry)}", flush=True)
    return out


def _line(e: dict) -> str:
    x = e.get("xla") or {}
    if not e.get("fits"):
        return f"no plan ({e.get('error', '')[:80]})"
    if "error" in x:
        return f"estimate {e['memory_bytes_per_device'] / 2**30:.2f} GiB, XLA: {x['error']}"
    return (f"estimate {e['memory_bytes_per_device'] / 2**30:.2f} GiB, XLA "
            f"{x['peak_bytes'] / 2**30:.2f} GiB ({x['over_estimate']:.3f}), fits {x['fits']}, "
            f"xla_remat {x['xla_remat']}, involuntary {x['involuntary_remat']}")


def _gb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


def _savings(results: dict) -> list[str]:
    """A table row per :data:`SAVINGS` pair both of whose ``auto`` plans XLA compiled."""
    out = []
    for budgeted, free in SAVINGS:
        pair = [(results.get(n) or {}).get("planners", {}).get("auto") or {} for n in
                (budgeted, free)]
        if not all("peak_bytes" in (e.get("xla") or {}) for e in pair):
            continue
        priced = (pair[1]["memory_bytes_per_device"] - pair[0]["memory_bytes_per_device"])
        got = pair[1]["xla"]["peak_bytes"] - pair[0]["xla"]["peak_bytes"]
        ratio = f"{got / priced:.3f}" if priced else "-"
        out.append(f"| {budgeted} | {priced / 2**30:.2f} | {got / 2**30:.2f} | {ratio} |")
    return out


def _markdown(results: dict) -> str:
    rows = [("| case | planner | step s | estimate GiB | XLA:GPU GiB | XLA / est | fits | XLA remat "
            "| invol. | comm est GB | comm XLA GB | compile s |"),
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, case in results.items():
        if case.get("graph") != "step":  # planned before the step's graph held the loss
            name = f"{name} (module only)"
        for planner, e in case["planners"].items():
            x = e.get("xla") or {}
            if not e.get("fits") or "peak_bytes" not in x:
                why = e.get("error") or x.get("error", "")
                rows.append(f"| {name} | {planner} | - | "
                            f"{(e.get('memory_bytes_per_device') or 0) / 2**30:.2f} | - | - | "
                            f"{'no plan' if not e.get('fits') else 'n/a'} | - | - | - | - | "
                            f"{why[:60]} |")
                continue
            rows.append(
                f"| {name} | {planner} | {e['step_time_s']:.3f} | "
                f"{e['memory_bytes_per_device'] / 2**30:.2f} | {x['peak_bytes'] / 2**30:.2f} | "
                f"{x['over_estimate']:.3f} | {'yes' if x['fits'] else 'NO'} | "
                f"{'yes' if x['xla_remat'] else 'no'} | {x['involuntary_remat']} | "
                f"{e['comm_bytes'] / 1e9:.2f} | {_gb(x.get('comm_bytes'))} | "
                f"{x['compile_s']:.0f} |")
    head = ("# The cost model's memory against XLA's GPU compiler\n\n"
            "`scripts/bench_xla_gpu.py`: each plan's whole training step (AdamW, donated state) "
            "compiled by XLA:GPU for compile-only devices of the cluster's GPU on a 2 x 4 mesh "
            "(data x model); XLA's peak is argument + output + temp - alias. No autotuning "
            "without a device: GEMM configurations are XLA's defaults. comm: the plan's "
            "`comm_bytes` and XLA's collectives in the same convention (all-reduce / all-gather "
            "result bytes, reduce-scatter / all-to-all p x result bytes). Each case is planned "
            "on the training step's graph (the module and its loss, as `train_step` plans it); "
            "a case marked (module only) was planned on the module alone, its loss outside the "
            "plan and its estimate (not yet re-run).\n\n")
    kinds = _kinds_table(results)
    if kinds:
        note = ("Collectives by kind (bytes as in `comm_bytes`; the plan's pricing against "
                "XLA:GPU's HLO after its combiners):")
        rows += ["", note, "", *kinds]
    saved = _savings(results)
    if saved:
        title = ("Memory the budget saves (ours: the budgeted plan against the no-limit one, "
                 "GiB):")
        rows += ["", title, "", "| case | priced | XLA:GPU | XLA / priced |",
                 "|---|---|---|---|", *saved]
    outside = _outside(results)
    tail = ("\n## Outside 5% (memory) or 10% (collective bytes), XLA / estimate\n\n"
            + "\n".join(outside) + "\n") if outside else ""
    return head + "\n".join(rows) + "\n" + tail


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma separated case names")
    ap.add_argument("--planners", default="", help="comma separated (default: per case)")
    ap.add_argument("--reprice", action="store_true",
                    help="re-plan the stored cases and add the priced bytes per collective kind "
                         "(no compile; a plan that changed is left as it was)")
    a = ap.parse_args()
    names = [n for n in a.only.split(",") if n] or list(CASES)
    results = json.loads(OUT.read_text()) if OUT.exists() else {}
    for name in names:
        if a.reprice:
            if results.get(name, {}).get("graph") == "step":
                _reprice(name, results[name])
        else:
            planners = [p for p in a.planners.split(",") if p] or None
            got = _case(name, planners)
            if planners and name in results:  # the other planners' rows are kept
                got["planners"] = {**results[name]["planners"], **got["planners"]}
            results[name] = got
        OUT.write_text(json.dumps(results, indent=1, default=str))
        OUT.with_suffix(".md").write_text(_markdown(results))


if __name__ == "__main__":
    main()
