"""Pipelines over clusters of several device kinds: ours against Metis-style and
heterogeneity-unaware plans (predicted, our cost model).

Per model and mixed cluster, the three planners of :mod:`nnscaler_jax.pipeline.hetero`
(``auto``: ours; ``metis``; ``uniform``), each stage's in-stage plan made and priced for its own
kind (``realize``). Models at nnScaler's 8-GPU sizes (GPT-3 2.6B / 6.7B: Alpa's benchmark
configs; Swin and T5: ``*-nnscaler-8gpu``), float16 (float32 master weights and Adam),
global batch 16 (``model:preset@batch``: another; GPT-3 350M and 1.3B at 64, where ours
picks data-parallel groups on uneven shares over pipelines). Writes
``results/bench_hetero.json`` and ``.md``.

    JAX_PLATFORMS=cpu python scripts/bench_hetero.py [--models gpt:gpt3-6.7b,gpt:gpt3-1.3b@64]
        [--clusters a100-80g-4x+v100-32g-4x,...]
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

import jax

from nnscaler_jax.capture.trace import capture_spec
from nnscaler_jax.cli.common import model_spec, spec_mutable
from nnscaler_jax.cli.compare import mixed_entry
from nnscaler_jax.cost.devices import cluster_preset
from nnscaler_jax.errors import PlanError
from nnscaler_jax.pipeline.hetero import PLANNERS, kind_units, plan_realized
from nnscaler_jax.train.xla_gpu import check_mixed_stages

MODELS = ("gpt:gpt3-350m@64,gpt:gpt3-1.3b@64,gpt:gpt3-2.6b,gpt:gpt3-6.7b,"
          "swin:swin-nnscaler-8gpu,t5:t5-nnscaler-8gpu")
CLUSTERS = "a100-80g-4x+v100-32g-4x,h100-80g-4x+a100-80g-4x"
BATCH = 16


def judge(plan, graph_at) -> dict:
    """Each stage compiled by XLA:GPU for its own kind: the judge of every planner's choices
    (a plan over a stage's budget by XLA's count is not one; the planner tries its next)."""
    try:
        return check_mixed_stages(plan, graph_at)
    except (PlanError, jax.errors.JaxRuntimeError) as e:
        return {"error": str(e).splitlines()[0], "fits": False}


def case(name: str, preset: str, cluster_name: str, xla: bool) -> dict:
    preset, _, at = preset.partition("@")
    batch = int(at) if at else BATCH
    cluster = cluster_preset(cluster_name)
    traced: dict[int, object] = {}

    def graph_at(rows: int):  # the model traced at ``rows`` (a stage's micro-batch rows)
        if rows not in traced:
            spec = model_spec(name, preset, "float16", batch_size=rows)
            traced[rows] = capture_spec(spec, mutable=spec_mutable(spec), precision="float16",
                                        loss=True).graph
        return traced[rows]

    t0 = time.perf_counter()
    graph = graph_at(batch)
    units = kind_units(graph, cluster, batch)
    row = {"model": name, "preset": preset, "cluster": cluster_name, "global_batch": batch,
           "units": len(units[0]), "capture_s": time.perf_counter() - t0, "planners": {}}
    for planner in PLANNERS:
        t0 = time.perf_counter()
        try:
            plan = plan_realized(units, cluster, batch, graph_at, planner=planner,
                                 judge=(lambda p: judge(p, graph_at)) if xla else None)
            entry = mixed_entry(plan)  # (compare --json's entry)
            if plan.xla is not None:
                entry["xla"] = plan.xla
        except PlanError as e:
            entry = {"fits": False, "error": str(e).splitlines()[0],
                     "smallest_bytes": getattr(e, "smallest_bytes", None)}
        entry["plan_s"] = time.perf_counter() - t0
        row["planners"][planner] = entry
        print(f"{name} {preset} {cluster_name} {planner}: "
              f"{entry.get('step_time_s', float('nan')) * 1e3:.1f} ms fits {entry['fits']}",
              flush=True)
    return row


def _stages(entry: dict) -> str:
    if "stages" not in entry:
        return entry.get("error", "")[:90]
    shares = entry.get("shares")
    return "<br>".join(
        f"{st['kind']} x{st['devices'][1] - st['devices'][0] + 1} tp{st['tp']}"
        f"{' dp' + str(st['dp']) if st['dp'] > 1 else ''}: "
        + (f"{shares[k]} rows (all layers)" if shares else
           f"{st['layers'][0]} .. {st['layers'][1]}") + f", {st['policy']}"
        f"{', recompute ' + str(len(st['recompute_groups'])) if st['recompute_groups'] else ''}"
        f"{', co-shard ' + str(len(st['cosharded'])) if st['cosharded'] else ''}"
        f", {st['memory_bytes'] / 2**30:.1f} / {st['budget_bytes'] / 2**30:.1f} GiB"
        f"{_xla(entry, k)}" for k, st in enumerate(entry["stages"]))


def _xla(entry: dict, k: int) -> str:
    x = entry.get("xla")
    if not x or "error" in x:
        return f" (XLA:GPU: {x['error'][:50]})" if x else ""
    st = x["stages"][k]
    return f" (XLA:GPU {st['peak_bytes'] / 2**30:.1f}{'' if st['fits'] else ', over'})"


def markdown(rows: list[dict]) -> str:
    lines = ["# Heterogeneous clusters: ours vs Metis-style vs heterogeneity-unaware", "",
             ("Written by `scripts/bench_hetero.py` (predicted by our cost model; no GPU). "
              "float16 compute, float32 master weights + Adam, global batch as the row says "
              f"(default {BATCH}), pipelines run 1F1B. "
              "Every stage keeps its input per micro-batch in flight and recomputes its "
              "forward in the backward, as the pipeline runtime runs it. "
              "`auto`: ours (stage DP over the groups' arrangements with per-kind prices, "
              "memory and links; each stage planned by our search for its kind; or the "
              "groups side by side, data parallel on uneven batch shares, `rows` per group, "
              "where that is faster). `metis`: "
              "Metis's space (per-stage device type, DP x TP per stage, layers by balanced "
              "compute; Megatron inside the stages). `uniform`: every device priced as the "
              "slowest kind, equal stages, priced where its stages land (Megatron inside). "
              "Speed-up: the baseline's step over ours. Per stage: memory estimate / its "
              "kind's budget, and (XLA:GPU n) the stage compiled for its own kind on "
              "compile-only devices (one micro-batch's backward with its forward recomputed, "
              "plus the gradient accumulator, Adam's moments and the inputs in flight; "
              "`check_mixed_stages`): the judge of every planner's choices, a plan over a "
              "stage's budget by XLA's count is not one (the planner takes its next)."), "",
             ("| model | batch | cluster | planner | fits | step ms | speed-up | stages (kind "
              "x devices, layers or rows, in-stage policy, memory / budget) |"),
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ours = r["planners"]["auto"].get("step_time_s")
        for name, e in r["planners"].items():
            step = e.get("step_time_s")
            ratio = f"{step / ours:.2f}x" if step and ours and name != "auto" else ""
            lines.append(f"| {r['model']} {r['preset']} | {r['global_batch']} | "
                         f"{r['cluster']} | {name} | "
                         f"{'yes' if e['fits'] else 'NO'} | "
                         f"{'-' if step is None else f'{step * 1e3:.1f}'} | {ratio} | "
                         f"{_stages(e)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--clusters", default=CLUSTERS)
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_hetero"))
    ap.add_argument("--no-xla", action="store_true", help="skip the XLA:GPU per-stage check")
    args = ap.parse_args()
    rows = [case(*m.split(":"), c, not args.no_xla) for m in args.models.split(",")
            for c in args.clusters.split(",")]
    pathlib.Path(args.out + ".json").write_text(json.dumps(rows, indent=1))
    pathlib.Path(args.out + ".md").write_text(markdown(rows))
    print(f"wrote {args.out}.json and .md")


if __name__ == "__main__":
    main()
