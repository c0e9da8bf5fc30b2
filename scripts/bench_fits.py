"""Benchmark: which planner finds a plan that fits the device, at nnScaler's own workload sizes.

Swin and T5 at the artifact's 4 / 8 / 16 / 32-GPU presets and the AlphaFold2 Evoformer presets,
planned on abstract shapes (nothing allocated) for the ``v100-32g-8x`` and ``a100-80g-8x``
clusters. The budget is each cluster's device memory less the default reserve
(``nnscaler_jax.cost.devices.DEFAULT_RESERVE_FRACTION``), the same for every planner:

- ``auto``: ours (layout search + recompute chosen by the search);
- ``alpa``: the Alpa-style planner (full ILP, one global remat switch);
- ``megatron-lm``: tensor parallel over ``model`` + full recompute, as Megatron-LM trains;
- ``deepspeed``: ZeRO-3 + full recompute, as DeepSpeed trains.

Per case and planner: fits, predicted step seconds, memory per device, search seconds and the
plan's features (recompute groups, co-sharded ops, micro-batches, stages). Writes
``results/bench_fits.json`` (after every case, so a long run can be read while it goes; a run
with other planners or cases is merged into it) and ``results/bench_fits.md``. Run from the repository root:

    .venv/bin/python scripts/bench_fits.py [--only swin-8gpu,t5-8gpu] [--planners auto,alpa]
        [--clusters v100-32g-8x] [--time-limit 120]
    .venv/bin/python scripts/bench_fits.py --long   # Llama-3-8B at 128K tokens, 8 x H100
    .venv/bin/python scripts/bench_fits.py --batch 8 --pipelines --planners auto,alpa \
        --clusters v100-32g-8x --only swin-8gpu,t5-8gpu,af2-initial

``--xla``: each flat plan's training step is also compiled by XLA's GPU compiler for the
cluster's GPU (compile-only devices): the entry gains ``xla`` (peak, fits, XLA's own remat,
involuntary full remats, collectives), the table ``[XLA peak GiB, XLA / estimate]``.

``--batch B --pipelines``: every case at global batch B (the flat plans accumulate gradients
over micro-batches where the whole batch does not fit), ours and the Alpa-style planner also
planned on every stage x data (x model) shape of the 8 devices
(:func:`nnscaler_jax.cli.compare.best_over_meshes`), the fastest fitting shape kept.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import models
from nnscaler_jax import Constraints
from nnscaler_jax.capture.trace import capture_spec, spec_at_precision
from nnscaler_jax.cli.compare import best_over_meshes, plan_features
from nnscaler_jax.cli.xla import xla_entry
from nnscaler_jax.cost import cluster_preset
from nnscaler_jax.cost.devices import memory_reserve
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.errors import NoFitError, PlanError
from nnscaler_jax.ir.remat import is_selective
from nnscaler_jax.planner import plan_and_report

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "results" / "bench_fits.json"

MESHES = {4: {"data": 2, "model": 2}, 8: {"data": 2, "model": 4},
          16: {"data": 4, "model": 4}, 32: {"data": 8, "model": 4}}
CASES = [(f"{m}-{n}gpu", m, f"{m}-nnscaler-{n}gpu", MESHES[n])
         for m in ("swin", "t5") for n in (4, 8, 16, 32)]
CASES += [("af2-initial", "evoformer", "af2-initial", MESHES[8]),
          ("af2-finetune", "evoformer", "af2-finetune", MESHES[8]),
          ("af2-finetune-384", "evoformer", "af2-finetune-384", MESHES[8])]
PLANNERS = ["auto", "alpa", "megatron-lm", "deepspeed"]
CLUSTERS = ["v100-32g-8x", "a100-80g-8x"]
# nnScaler's long-sequence run: Llama-3-8B at 128K tokens on 8 x H100, bf16, 41.1 s per step,
# 41% MFU (as nnScaler counts it); planned here on its own cluster with --long
LONG = ("llama3-8b-128k", "llama", "llama3-8b-128k", MESHES[8])
LONG_CLUSTER, LONG_PRECISION = "h100-80g-8x", "bfloat16"
# nnScaler's examples/llama/README.rst: 41.12 s per step of 4 sequences (gradient
# accumulation 4), 40.96% MFU by its count
LONG_SEED_STEP_S, LONG_SEED_SEQUENCES = 41.12, 4


def _entry(graph, axes, planner: str, cluster: str, time_limit: float,
           pipelines: bool = False, xla_spec=None, constraints=None) -> dict:
    if pipelines:  # the flat mesh and every stage x data (x model) shape, the best kept
        return best_over_meshes(planner, graph, axes, cluster_preset(cluster), None)[1]
    cm = CostModel.for_cluster(cluster_preset(cluster), axes)
    t0 = time.perf_counter()
    try:
        planned = plan_and_report(graph, axes, policy=planner, cost_model=cm,
                                  time_limit=time_limit, constraints=constraints)
    except NoFitError as e:
        return {"fits": False, "memory_bytes_per_device": e.smallest_bytes,
                "search_s": time.perf_counter() - t0, "error": str(e).splitlines()[0][:300]}
    except PlanError as e:
        return {"fits": None, "search_s": time.perf_counter() - t0,
                "error": str(e).splitlines()[0][:300]}
    c = planned.plan.cost
    out = {"fits": True, "step_time_s": c.step_time_s,
           "memory_bytes_per_device": c.memory_bytes_per_device, "comm_bytes": c.comm_bytes,
           "search_s": planned.seconds, "features": plan_features(planned.plan)}
    if planned.report is not None:  # the kept plan's ILP: did the time limit stop it?
        r = planned.report
        out["ilp"] = {"optimal": r.optimal, "solve_s": r.solve_s, "variables": r.variables,
                      "time_limit_s": time_limit, "gap": None if r.optimal else r.gap}
    if xla_spec is not None:  # --xla: the plan's training step compiled by XLA:GPU
        out["xla"] = xla_entry(xla_spec, planned.plan, cluster_preset(cluster), axes)
    return out


def _xla_cell(e: dict) -> str:
    """`` [XLA 27.6 GiB, 0.96]`` of an entry with --xla figures (NO FIT / remat / involuntary
    full remats marked), else empty."""
    x = e.get("xla")
    if not x:
        return ""
    if "error" in x:
        return " [XLA n/a]"
    marks = ("" if x["fits"] else " NO FIT") + (" remat" if x["xla_remat"] else "") + (
        f" invol {x['involuntary_remat']}" if x["involuntary_remat"] else "")
    return f" [XLA {x['peak_bytes'] / 2**30:.1f} GiB, {x['over_estimate']:.2f}{marks}]"


def _mfu(name: str, preset: str, entry: dict, cluster: str, devices: int,
         sequences: int | None = None) -> None:
    """Add ``model_flops`` / ``mfu`` (model FLOPs over the predicted step at the cluster's
    16-bit peak) to a fitting entry; ``sequences``: the rows of its step (default: the
    preset's batch)."""
    if not entry.get("fits"):
        return
    spec = models.get(name, preset)
    rows = sequences or int(spec.make_args()[0].shape[0])
    entry["sequences"] = rows
    entry["step_per_sequence_s"] = entry["step_time_s"] / rows
    units = rows * (
        int(spec.make_args()[0].shape[1]) if models.flops_unit(name) == "token" else 1)
    flops = models.flops_per_token(name, preset) * units
    peak = cluster_preset(cluster).device.flops * devices
    entry["model_flops"], entry["mfu"] = flops, flops / (entry["step_time_s"] * peak)


def _long(planners: list[str], time_limit: float) -> dict:
    key, name, preset, axes = LONG
    spec = models.get(name, preset)
    graph = capture_spec(spec, precision=LONG_PRECISION).graph
    row = {p: _entry(graph, axes, p, LONG_CLUSTER, time_limit) for p in planners}
    devices = 1
    for n in axes.values():
        devices *= n
    for e in row.values():
        _mfu(name, preset, e, LONG_CLUSTER, devices)
    # nnScaler's setting: a step of 4 sequences as 4 micro-batches (gradient accumulation)
    k = LONG_SEED_SEQUENCES
    graph_k = capture_spec(models.get(name, preset, batch_size=k), precision=LONG_PRECISION).graph
    for p in planners:
        e = row[f"{p}-{k}-sequences"] = _entry(  # (in {k} micro-batches)
            graph_k, axes, p, LONG_CLUSTER, time_limit, constraints=Constraints(microbatches=k))
        _mfu(name, preset, e, LONG_CLUSTER, devices, sequences=k)
    seed = {"step_time_s": LONG_SEED_STEP_S, "mfu_reported": 0.41, "fits": True}
    _mfu(name, preset, seed, LONG_CLUSTER, devices, sequences=LONG_SEED_SEQUENCES)
    print(key, LONG_CLUSTER, {p: (e.get("fits"), round(e.get("step_time_s") or 0, 2),
                                   round(e.get("mfu") or 0, 3), round(e["search_s"], 1))
                               for p, e in row.items()}, flush=True)
    return {"cluster": LONG_CLUSTER, "precision": LONG_PRECISION,
            "mesh": "x".join(str(v) for v in axes.values()), "planners": row,
            "nnscaler": seed}


def _ratios(row: dict) -> dict:
    """Predicted step of each fitting baseline over ours (> 1: ours is faster)."""
    ours = row.get("auto", {})
    if not ours.get("fits"):
        return {}
    return {p: e["step_time_s"] / ours["step_time_s"] for p, e in row.items()
            if p != "auto" and e.get("fits")}


def _limited(e: dict) -> str:
    """`` time-limited (gap 12%)`` for an entry whose kept ILP the time limit stopped, else
    empty: its step is the solver's best by then, not the planner's optimum."""
    ilp = e.get("ilp") or {}
    if ilp.get("optimal", True):
        return ""
    gap = ilp.get("gap")
    return " time-limited" + (f" (gap {gap:.0%})" if gap is not None and gap < 1 else "")


def _ratio_text(p: str, r: float, row: dict) -> str:
    """A ratio, saying when the baseline's solve was cut off: then the ratio is an upper bound
    and its proven floor (the ratio scaled by one minus the solver's relative gap) is given."""
    ilp = (row["planners"].get(p) or {}).get("ilp") or {}
    if ilp.get("optimal", True):
        return f"{p} {r:.2f}x"
    gap = ilp.get("gap")
    low = f", >= {r * (1 - gap):.2f}x proven" if gap is not None and gap < 1 else ""
    return f"{p} {r:.2f}x (time-limited solve{low})"


def _shapes(cases: dict) -> list[str]:
    """``--pipelines``: every shape each planner tried, with its step or smallest estimate."""
    rows = [f"| {key} | {p} | " + " x ".join(f"{a} {k}" for a, k in c["mesh"].items())
            + " | " + (f"{c['schedule']}, {c['microbatches']} micro-batches"
                       + (", one program per stage" if c.get("executor") == "per-stage"
                          else "") if "schedule" in c else "-")
            + " | " + ("yes" if c["fits"] else "no" if c["fits"] is False else "-") + " | "
            + (f"{c['step_time_s']:.3g}" if c["fits"] else "-") + " | "
            + (f"{c['memory_bytes_per_device'] / 2**30:.1f}"
               if c["memory_bytes_per_device"] else "-") + " | "
            + (c.get("error", "")[:90] if c["fits"] is None else "") + " |"
            for key, row in cases.items() for p, e in row["planners"].items()
            for c in e.get("candidates", ())]
    if not rows:
        return []
    return ["Shapes tried (memory: the estimate, or the smallest when nothing fits):", "",
            "| case | planner | shape | pipeline | fits | step (s) | memory (GiB) | why not run |",
            "|---|---|---|---|---|---|---|---|"] + rows + [""]


def _markdown(results: dict) -> str:
    lines = ["# Plans that fit: nnScaler's workloads on V100-32GB and A100-80GB clusters", "",
             ("Predicted step (s) / memory per device (GiB) / search (s); rc: recomputed layers, "
             "sel: layers recomputed selectively (matmul outputs kept), cs: co-sharded blocks; "
             "`no (X GiB)`: nothing fits, X the smallest estimate; `none "
             "found in S s`: the solver found no plan within the budget in its time limit; "
             "`time-limited`: the solver's best plan when its time limit stopped it (not the "
             "planner's optimum; a ratio over it says so, with the floor its proven bound gives). "
             "Ratio: baseline step / ours (> 1: ours faster). Rows are from the run that last "
             "planned them (see docs/benchmarks.md)."), ""]
    for cluster, cases in results["clusters"].items():
        lines += [f"## {cluster} (budget {cases['budget_gib']:.1f} GiB per device)", "",
                  "| case | mesh | " + " | ".join(results["planners"]) + " | ratios |",
                  "|---" * (len(results["planners"]) + 3) + "|"]
        for key, row in cases["cases"].items():
            cells = []
            for p in results["planners"]:
                e = row["planners"].get(p) or {}
                if e.get("fits"):
                    groups = e["features"]["recompute"]
                    sel = sum(is_selective(g) for g in groups)
                    rc = len(groups) - sel
                    cs = len(e["features"].get("cosharded", ()))
                    st = e["features"]["stages"]
                    extra = ", ".join(([f"rc {rc}"] if rc else [])
                                      + ([f"sel {sel}"] if sel else [])
                                      + ([f"cs {cs}"] if cs else [])
                                      + ([f"{st} stages x " + " x ".join(
                                          f"{a} {k}" for a, k in e["mesh"].items()
                                          if a != "stage")] if st > 1 else []))
                    cells.append(f"{e['step_time_s']:.3g} / "
                                 f"{e['memory_bytes_per_device'] / 2**30:.1f} / "
                                 f"{e['search_s']:.0f}" + (f" ({extra})" if extra else "")
                                 + _limited(e) + _xla_cell(e))
                elif e.get("fits") is False and e.get("memory_bytes_per_device"):
                    cells.append(f"no ({e['memory_bytes_per_device'] / 2**30:.0f} GiB)")
                elif e.get("fits") is False:  # the solver's time limit, nothing found
                    cells.append(f"none found in {e['search_s']:.0f} s")
                else:
                    cells.append("error" if e else "-")
            ratios = ", ".join(_ratio_text(p, r, row) for p, r in row["ratios"].items())
            lines.append(f"| {key} | {row['mesh']} | " + " | ".join(cells) + f" | {ratios} |")
        lines.append("")
        lines += _shapes(cases["cases"])
    long = results.get("long")
    if long:
        seed = long["nnscaler"]
        lines += [f"## {LONG[0]} on {long['cluster']} ({long['precision']}, mesh {long['mesh']})",
                  "", ("Sequences per step differ (ours: the preset's batch, or 4 as "
                       "micro-batches; nnScaler's run: 4, gradient accumulation 4): compare the "
                       "step per sequence. MFU: model FLOPs (ours' count) over the step at the "
                       "16-bit peak."),
                  "", ("| planner | fits | step (s) | sequences | per sequence (s) | memory (GiB) "
                       "| search (s) | MFU | co-sharded blocks | recompute (selective) |"),
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for p, e in long["planners"].items():
            f = e.get("features", {})
            lines.append(
                f"| {p} | {e.get('fits')} | {e.get('step_time_s', 0):.1f} | "
                f"{e.get('sequences', '-')} | {e.get('step_per_sequence_s', 0):.1f} | "
                f"{(e.get('memory_bytes_per_device') or 0) / 2**30:.1f} | {e['search_s']:.0f} | "
                f"{e.get('mfu', 0):.1%} | {len(f.get('cosharded', []))} | "
                f"{len(f.get('recompute', []))} "
                f"({sum(is_selective(g) for g in f.get('recompute', []))}) |")
        lines += [(f"| nnScaler (reported) | True | {seed['step_time_s']} | "
                   f"{seed['sequences']} | {seed['step_per_sequence_s']:.1f} | - | - | "
                   f"{seed['mfu']:.1%} (ours' count; reported {seed['mfu_reported']:.0%}) "
                   "| - | - |"), ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated case keys")
    ap.add_argument("--planners", default=",".join(PLANNERS))
    ap.add_argument("--clusters", default=",".join(CLUSTERS))
    ap.add_argument("--time-limit", type=float, default=120.0,
                    help="each search's solver budget in seconds")
    ap.add_argument("--long", action="store_true",
                    help=f"plan {LONG[0]} on {LONG_CLUSTER} instead of the cases above")
    ap.add_argument("--precision", default=None,
                    help="compute precision of every planner (e.g. float16, as the artifact "
                         "ran on V100); results are kept under '<cluster> <precision>'")
    ap.add_argument("--batch", type=int, default=None,
                    help="global batch of every case (default: the preset's); with "
                         "micro-batches the flat plans accumulate gradients")
    ap.add_argument("--pipelines", action="store_true",
                    help="let ours and the Alpa-style planner also use the 8 devices as "
                         "stages x data x model (compare --pipelines); results are kept under "
                         "'<cluster> batch B pipelines'")
    ap.add_argument("--xla", action="store_true",
                    help="also compile each plan's training step with XLA's GPU compiler for "
                         "the cluster's GPU (compile-only devices) and report its peak memory "
                         "beside the estimate (flat plans)")
    args = ap.parse_args()
    only = {k for k in args.only.split(",") if k}
    planners = [p for p in args.planners.split(",") if p]
    clusters = [c for c in args.clusters.split(",") if c]
    # merged into earlier results: a run with other planners or cases adds to them
    results: dict = json.loads(OUT.read_text()) if OUT.exists() else {"clusters": {}}
    if args.long:
        results["long"] = _long(planners, args.time_limit)
        OUT.write_text(json.dumps(results, indent=1))
        OUT.with_suffix(".md").write_text(_markdown(results))
        return
    results["planners"] = list(dict.fromkeys(results.get("planners", []) + planners))
    suffix = "".join([f" {args.precision}" if args.precision else "",
                      f" batch {args.batch}" if args.batch else "",
                      " pipelines" if args.pipelines else ""])
    label = {c: c + suffix for c in clusters}
    for cluster in clusters:
        device = cluster_preset(cluster).device
        budget = device.memory_bytes - memory_reserve(device.memory_bytes)
        results["clusters"].setdefault(label[cluster], {"cases": {}})["budget_gib"] = \
            budget / 2**30
    for key, name, preset, axes in CASES:
        if only and key not in only:
            continue
        spec = models.get(name, preset, **({"batch_size": args.batch} if args.batch else {}))
        graph = capture_spec(spec, precision=args.precision,
                             mutable=list(spec.mutable) or None).graph
        for cluster in clusters:
            case = results["clusters"][label[cluster]]["cases"].setdefault(key,
                                                                           {"planners": {}})
            case["mesh"] = "x".join(str(v) for v in axes.values())
            row = {p: _entry(graph, axes, p, cluster, args.time_limit, args.pipelines,
                             spec_at_precision(spec, args.precision)
                             if args.xla and not args.pipelines else None)
                   for p in planners}
            case["planners"].update(row)
            case["ratios"] = _ratios(case["planners"])
            print(key, cluster, {p: (e.get("fits"), round(e.get("step_time_s") or 0, 4),
                                     round(e["search_s"], 1)) for p, e in row.items()},
                  flush=True)
            OUT.write_text(json.dumps(results, indent=1))
    OUT.with_suffix(".md").write_text(_markdown(results))


if __name__ == "__main__":
    main()
