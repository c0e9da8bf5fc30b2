"""Benchmark: our search against the Alpa-style planner and the built-in policies, on the model
zoo at paper presets over abstract meshes (nothing allocated; planning needs no devices).

Per model: search seconds of ours and of the Alpa-style planner (median of ``--runs``), and
the predicted step time / memory / communication of auto, alpa, dp, zero3 and megatron under the
same cost model (``CostModel.plan_cost``). Writes ``results/bench_search.json`` and
``results/bench_search.md``. Run from the repository root:

    .venv/bin/python scripts/bench_search.py [--only gpt-1.3b,gpt-175b-scan] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import models
from nnscaler_jax.capture.trace import capture_spec
from nnscaler_jax.cost import cluster_preset
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.planner import plan_and_report

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "results" / "bench_search.json"

# (key, model, preset, mesh {axis: size}, config overrides)
CASES = [
    ("gpt-1.3b", "gpt", "gpt3-1.3b", {"data": 2, "model": 4}, {}),
    ("gpt-39b-scan", "gpt", "gpt3-39b", {"data": 8, "model": 8}, {"scan_layers": True}),
    ("llama-7b", "llama", "llama-7b", {"data": 2, "model": 4}, {}),
    ("swin-8gpu", "swin", "swin-nnscaler-8gpu", {"data": 2, "model": 4}, {}),
    ("t5-8gpu", "t5", "t5-nnscaler-8gpu", {"data": 2, "model": 4}, {}),
    ("moe-2.4b", "moe", "moe-2.4b", {"data": 2, "model": 4}, {}),
    ("wrn-2b", "wide_resnet", "wrn-2b", {"data": 2, "model": 4}, {}),
    ("evoformer", "evoformer", "af2-initial", {"data": 2, "model": 2}, {}),
    ("gpt-175b-scan", "gpt", "gpt3-175b", {"data": 8, "model": 8}, {"scan_layers": True}),
    ("gpt-175b", "gpt", "gpt3-175b", {"data": 8, "model": 8}, {"scan_layers": False}),
]
BASELINES = ["dp", "zero3", "megatron"]


def _plan(graph, axes, policy, cost_model, time_limit=None):
    """``(plan, seconds, search report)`` through the one planning entry."""
    p = plan_and_report(graph, axes, policy=policy, cost_model=cost_model, time_limit=time_limit)
    return p.plan, p.seconds, p.report


def _graph(name: str, preset: str, overrides: dict):
    spec = models.get(name, preset, **overrides)
    return capture_spec(spec, mutable=list(spec.mutable) or None).graph


def _row(plan, seconds, report) -> dict:
    c = plan.cost
    out = {"search_s": seconds, "step_time_s": c.step_time_s,
           "memory_bytes_per_device": c.memory_bytes_per_device, "comm_bytes": c.comm_bytes}
    if report is not None:
        out.update(groups=report.groups, log10_space=round(report.log10_space, 2),
                   log10_full=round(report.log10_full, 2), ilp_variables=report.variables,
                   objective_s=report.objective_s, build_s=report.build_s,
                   solve_s=report.solve_s, optimal=report.optimal,
                   eliminated=report.eliminated)
    return out


def _model(cluster: str, axes: dict) -> CostModel | None:
    """The cost model every planner of a case is searched and priced with."""
    return CostModel.for_cluster(cluster_preset(cluster), axes) if cluster else None


def bench(key, name, preset, axes, overrides, runs: int, alpa_limit: float,
          cluster: str = "") -> dict:
    t0 = time.perf_counter()
    graph = _graph(name, preset, overrides)
    res = {"model": name, "preset": preset, "mesh": "x".join(map(str, axes.values())),
           "cluster": cluster or "cpu-defaults",
           "overrides": overrides, "ops": sum(1 for _ in graph.walk()),
           "trace_s": time.perf_counter() - t0, "planners": {}}
    planners = ["auto", "alpa"]
    times: dict[str, list[float]] = {p: [] for p in planners}
    last: dict[str, tuple] = {}
    first: dict[str, float] = {}

    def run(planner: str) -> float:
        plan, s, report = _plan(graph, axes, planner, _model(cluster, axes),
                                       time_limit=alpa_limit if planner == "alpa" else 60)
        last[planner] = (plan, report)
        return s

    # one untimed warm-up of each (shared caches: annotations, layouts, collective paths), then
    # the timed runs alternate so both planners see the same machine load
    for p in planners:
        first[p] = run(p)
    for _ in range(runs):
        for p in planners:
            if first[p] > 120:  # one run of a slow planner is enough to make the point
                if not times[p]:
                    times[p].append(first[p])
                continue
            times[p].append(run(p))
    for p in planners:
        row = _row(last[p][0], statistics.median(times[p]), last[p][1])
        row["runs"] = len(times[p])
        row["first_s"] = first[p]  # the untimed warm-up: caches cold (ours runs first)
        res["planners"][p] = row
    if overrides.get("scan_layers"):
        # Alpa's auto-sharding pass does not support control flow (alpa-projects/alpa#400):
        # an Alpa user unrolls the scan; plan that graph with the Alpa-style planner too.
        unrolled = _graph(name, preset, {**overrides, "scan_layers": False})
        runs_u = []
        for _ in range(runs + 1):
            plan, s, report = _plan(unrolled, axes, "alpa", _model(cluster, axes),
                                           time_limit=alpa_limit)
            runs_u.append(s)
        row = _row(plan, statistics.median(runs_u[1:]), report)
        row.update(runs=runs, first_s=runs_u[0],
                   ops=sum(1 for _ in unrolled.walk()))
        res["planners"]["alpa_unrolled"] = row
    for p in BASELINES:
        try:
            plan, s, _ = _plan(graph, axes, p, _model(cluster, axes))
            res["planners"][p] = _row(plan, s, None)
        except Exception as e:  # noqa: BLE001 - a baseline that cannot plan this model
            res["planners"][p] = {"error": str(e).splitlines()[0][:200]}
    a, b = res["planners"]["auto"], res["planners"]["alpa"]
    res["search_speedup_vs_alpa"] = b["search_s"] / a["search_s"]
    if "alpa_unrolled" in res["planners"]:
        res["search_speedup_vs_alpa_unrolled"] = (res["planners"]["alpa_unrolled"]["search_s"]
                                                  / a["search_s"])
    res["step_ratio"] = {p: a["step_time_s"] / r["step_time_s"]
                         for p, r in res["planners"].items() if "step_time_s" in r}
    return res


def _markdown(results: list[dict]) -> str:
    clusters = sorted({r.get("cluster", "cpu-defaults") for r in results})
    lines = [f"# Search benchmark (predicted, abstract meshes; cost model: {', '.join(clusters)})",
             "",
             ("| case | mesh | ops | groups ours / alpa | search s ours | search s alpa | "
             "speedup | ILP solve s ours / alpa | auto / alpa | auto / dp | auto / zero3 | "
             "auto / megatron |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    unrolled = []
    for r in results:
        if "error" in r:
            lines.append(f"| {r['case']} | | | | | | | | error: {r['error'][:80]} | | | |")
            continue
        p, q = r["planners"], r["step_ratio"]

        def ratio(name, q=q):
            return f"{q[name]:.3f}" if name in q else "n/a"

        lines.append(
            f"| {r['case']} | {r['mesh']} | {r['ops']} | {p['auto'].get('groups')} / "
            f"{p['alpa'].get('groups')} | {p['auto']['search_s']:.2f} | "
            f"{p['alpa']['search_s']:.2f}{'' if p['alpa'].get('optimal', True) else ' (limit)'} | "
            f"{r['search_speedup_vs_alpa']:.1f}x | {p['auto'].get('solve_s', 0):.2f} / "
            f"{p['alpa'].get('solve_s', 0):.2f} | {ratio('alpa')} | {ratio('dp')} | "
            f"{ratio('zero3')} | {ratio('megatron')} |")
        if "alpa_unrolled" in p:
            u = p["alpa_unrolled"]
            unrolled.append(
                f"| {r['case']} | {p['auto']['search_s']:.2f} | {u['search_s']:.2f} "
                f"({u['ops']} ops, {u.get('groups')} groups) | "
                f"{r['search_speedup_vs_alpa_unrolled']:.1f}x | {ratio('alpa_unrolled')} |")
    cold = [f"| {r['case']} | {r['planners']['auto']['first_s']:.2f} | "
            f"{r['planners']['alpa']['first_s']:.2f} |"
            for r in results if "error" not in r and "first_s" in r["planners"]["auto"]]
    extra: list[str] = []
    if unrolled:
        extra += ["", ("`nn.scan` models against what Alpa can run: Alpa's auto-sharding pass "
                       "does not support control flow (alpa-projects/alpa#400), so an Alpa user "
                       "unrolls the scan. Ours on the scan graph vs the Alpa-style planner on "
                       "the unrolled graph of the same model (step ratio: ours / it, same cost "
                       "model):"),
                  "", ("| case | ours s (scan) | alpa-style s (unrolled) | speedup | "
                       "auto / alpa unrolled |"), "|---|---|---|---|---|", *unrolled]
    if cold:
        extra += ["", ("Cold first runs (the untimed warm-ups; ours runs first and fills the "
                       "shared caches of annotations, layouts and collective paths that Alpa's "
                       "first run then reuses):"), "", "| case | ours first s | alpa first s |",
                  "|---|---|---|", *cold]
    lines += ["", ("Ratios are predicted step time of ours divided by the other planner's "
              "(<= 1: ours is as fast or faster). Search seconds are medians of the runs "
              "(end to end: space, cost tables, ILP, plan) after one untimed warm-up of each; "
              "the timed runs alternate ours / Alpa's in one process."),
              "", ("Ours shares one decision across copies of a layer and across sibling ops "
                   "(q / k / v of one input), prices one representative of each class of "
                   "identical work (op, annotation, shapes, splits), prices edges inside a group "
                   "by their diagonal only, and minimises out every group meeting at most two "
                   "others exactly before the ILP and drops strategies another one always beats "
                   "(dead-end elimination; `search/reduce.py`): its ILP is tiny and the "
                   "rest of its time is building cost tables, which grows with the number of "
                   "distinct shapes (Swin's four stages) and ops (WRN's Alpa ILP is itself small, "
                   "267 groups). The Alpa-style planner builds its per-op tables (memoised "
                   "by layer-copy key) and solves its full ILP, one variable per op group, as "
                   "Alpa does. `nn.scan` models hold one copy of the layer, so both planners see "
                   "the same small graph there (speedup ~1-2x by construction; see the unrolled "
                   "comparison below). Evoformer: the Alpa-style ILP stops at its 600 s limit "
                   "with a worse plan.")]
    return "\n".join(lines + extra) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma separated case keys")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--alpa-limit", type=float, default=600.0, help="HiGHS seconds for alpa")
    ap.add_argument("--markdown-only", action="store_true",
                    help="rewrite the .md from the existing JSON")
    ap.add_argument("--cluster", default="a100-80g-8x",
                    help="cluster preset the cost model prices on ('' = CPU defaults)")
    args = ap.parse_args()
    if args.markdown_only:
        OUT.with_suffix(".md").write_text(_markdown(json.loads(OUT.read_text())))
        return
    only = {k for k in args.only.split(",") if k}
    results = json.loads(OUT.read_text()) if OUT.exists() and only else []
    results = [r for r in results if r.get("case") not in only]
    for key, name, preset, axes, overrides in CASES:
        if only and key not in only:
            continue
        print(f"== {key}", flush=True)
        try:
            r = bench(key, name, preset, axes, overrides, args.runs, args.alpa_limit, args.cluster)
        except Exception as e:  # noqa: BLE001 - record and go on with the zoo
            r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        r = {"case": key, **r}
        results.append(r)
        print(json.dumps(r, indent=1), flush=True)
        order = [c[0] for c in CASES]
        results.sort(key=lambda x: order.index(x["case"]) if x["case"] in order else 99)
        OUT.parent.mkdir(exist_ok=True)
        OUT.write_text(json.dumps(results, indent=1) + "\n")
        OUT.with_suffix(".md").write_text(_markdown(results))


if __name__ == "__main__":
    main()
