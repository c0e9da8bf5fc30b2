"""Tensor-parallel pipeline stages planned by the search, judged by XLA:GPU.

Swin tiny (batch 8) on 2 stages x model 4, 1F1B x 4 micro-batches, ``policy="auto"``, priced
for ``h100-80g-8x``: without a budget (the stage DP prices the stages Megatron-style) and under
budgets the Megatron-style pricing cannot meet (each stage's part planned by the search:
``plan.pipeline.stage_plans``); then the same with 8 x 8 windows, cut at ``layers_1``
(nnScaler's Swin plan: the first stage's blocks, window attention and MLP, co-sharded). Per case: the predicted step and memory, what each stage's plan
recomputes and co-shards, and XLA:GPU's per-stage peak (compile-only H100,
:func:`nnscaler_jax.train.xla_gpu.check_stages`). Writes ``results/bench_stage_search.json``
and ``.md``.

    JAX_PLATFORMS=cpu python scripts/bench_stage_search.py [--budgets 200000,150000]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import models
from nnscaler_jax import Constraints
from nnscaler_jax.capture.trace import capture_spec
from nnscaler_jax.cli.xla import xla_entry
from nnscaler_jax.cost.devices import cluster_preset
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.planner import plan_and_report

CLUSTER, AXES = "h100-80g-8x", {"stage": 2, "model": 4}


def case(graph, spec, budget: float | None, window: int = 4, pivots: tuple = ()) -> dict:
    """One plan under ``budget`` (None: none) and its XLA:GPU per-stage figures."""
    cluster = cluster_preset(CLUSTER)
    t0 = time.perf_counter()
    plan = plan_and_report(graph, AXES, policy="auto",
                           cost_model=CostModel.for_cluster(cluster, AXES),
                           constraints=Constraints(pipeline_stages=2, schedule="1f1b",
                                                   microbatches=4, pipeline_pivots=pivots,
                                                   max_memory_per_device=budget)).plan
    plan_s = time.perf_counter() - t0
    paths = lambda sp: {p.op: p.module_path for p in sp.ops}
    stages = [{"coshard": [[paths(sp).get(i, str(i)), d, k] for i, d, k in sp.coshard],
               "recompute": list(sp.recompute), "estimate_bytes": sp.cost.memory_bytes_per_device}
              for sp in plan.pipeline.stage_plans]
    x = xla_entry(spec, plan, cluster, AXES)
    return {"window": window, "cut": list(pivots), "budget_bytes": budget,
            "step_ms": plan.cost.step_time_s * 1e3,
            "estimate_bytes": plan.cost.memory_bytes_per_device, "plan_s": plan_s,
            "stage_plans": stages, "xla_peak_bytes": x.get("peak_bytes"),
            "xla_stage_peaks": [st["peak_bytes"] for st in x.get("stages", [])],
            "xla_remat": x.get("xla_remat"), "involuntary_remat": x.get("involuntary_remat"),
            "error": x.get("error")}


def markdown(rows: list[dict]) -> str:
    head = ("`scripts/bench_stage_search.py`: Swin tiny (batch 8), 2 stages x model 4, 1F1B x "
            f"4, `policy=\"auto\"`, priced for `{CLUSTER}`; XLA:GPU on compile-only H100s, "
            "stage by stage (no autotuning). At this size fixed GPU workspaces dominate XLA's "
            "peaks.")
    cols = ("| window, cut | budget B | step ms | estimate B | stage 0 plan | stage 1 plan | "
            "XLA stage peaks B | XLA remat |")
    lines = ["# Pipeline stages planned by the search, judged by XLA:GPU", "", head, "", cols,
             "|---|---|---|---|---|---|---|---|"]

    def plan_text(st: dict) -> str:
        parts = [f"co-shards {p} x{k}" for p, _, k in st["coshard"]]
        parts += [f"recomputes {g}" for g in st["recompute"]]
        return "; ".join(parts) or "layouts only"
    for r in rows:
        sps = r["stage_plans"] or [None, None]
        cells = [plan_text(st) if st else "(runtime's own search)" for st in sps]
        budget = f"{r['budget_bytes']:,.0f}" if r['budget_bytes'] else 'none'
        cut = f"{r['window']}, " + (", ".join(r["cut"]) or "balanced")
        lines.append(f"| {cut} | {budget} | {r['step_ms']:.3f} | "
                     f"{r['estimate_bytes']:,} | {cells[0]} | {cells[1]} | "
                     f"{' / '.join(f'{p:,}' for p in r['xla_stage_peaks'])} | "
                     f"{'yes' if r['xla_remat'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="200000,150000",
                    help="comma-separated budgets in bytes (a case without one is added)")
    ap.add_argument("--window-budgets", default="250000,200000",
                    help="the same for 8 x 8 windows, cut at layers_1")
    args = ap.parse_args()
    rows = []
    for window, budgets, pivots in ((4, args.budgets, ()),
                                    (8, args.window_budgets, ("layers_1",))):
        spec = models.get("swin", "tiny", batch_size=8, window_size=window)
        graph = capture_spec(spec).graph
        rows += [case(graph, spec, b, window, pivots)
                 for b in [None, *(float(b) for b in budgets.split(",") if b)]]
    out = ROOT / "results"
    (out / "bench_stage_search.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "bench_stage_search.md").write_text(markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
