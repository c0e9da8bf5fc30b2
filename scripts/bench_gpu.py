"""What only a GPU shows: the plan's predicted step and memory against a real training step.

Runs ``nnscaler-jax train`` (the command line, as a user runs it; one process per job, each
under its own time limit) on the first GPU as a one-device mesh: the planner prices the step
with the device preset of the GPU's ``device_kind`` (``nnscaler_jax.cost.devices``) and takes
its memory budget from the allocator (``XLA_PYTHON_CLIENT_MEM_FRACTION``, set to .95 here so
the plan may use the card, as the budget's docs say). Each job reports the median step after
the first against ``predicted_step_s``, the MFU from the model's analytic FLOPs
(``models.flops_per_token``, recompute not counted) against the device's dense peak at the
plan's precision, and the allocator's peak bytes against the plan's predicted peak.

Writes ``results/bench_gpu.json`` and ``results/bench_gpu.md`` (``--out`` for another folder),
after every job, so a run cut short keeps what it measured.
Usage: ``python scripts/bench_gpu.py [--only NAME,...] [--out DIR] [--cap S]`` on a machine with a
GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name, model, preset, extra train flags, time limit (s)
JOBS = [
    ("smoke", "gpt", "tiny", ["--steps", "3"], 180),
    ("gpt3-350m-bf16", "gpt", "gpt3-350m", ["--batch-size", "8", "--precision", "bf16"], 240),
    ("gpt3-1.3b-bf16", "gpt", "gpt3-1.3b", ["--precision", "bf16"], 300),
    ("gpt3-1.3b-bf16-b16", "gpt", "gpt3-1.3b", ["--batch-size", "16", "--precision", "bf16"],
     300),
    # not measured yet: 90 s was too short for them (start-up, planning and compilation)
    ("swin-b-bf16", "swin", "swin-b", ["--precision", "bf16"], 300),
    ("t5-base-bf16", "t5", "t5-base", ["--precision", "bf16"], 300),
    # AlphaFold2's initial training size on one card: the search recomputes and co-shards
    ("af2-initial-bf16", "evoformer", "af2-initial", ["--precision", "bf16"], 540),
]


def run_job(model: str, preset: str, extra: list[str], limit: float, steps: int) -> dict:
    """One ``train --json`` run: its JSON, or ``{"ok": False, "error": ...}``."""
    argv = [sys.executable, "-m", "nnscaler_jax", "train", "--model", model, "--preset", preset,
            "--mesh", "1", "--steps", str(steps), "--json", *extra]
    env = {**os.environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": ".95"}
    t0 = time.perf_counter()
    try:
        r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit,
                           check=False)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"over its {limit:.0f} s limit", "wall_s": limit}
    wall = time.perf_counter() - t0
    lines = r.stdout.strip().splitlines()
    try:
        out = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"ok": False, "error": (r.stderr or r.stdout)[-3000:], "wall_s": wall,
                "rc": r.returncode}
    out["wall_s"] = wall
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else a / b


def row(name: str, res: dict) -> dict:
    """The figures the table shows, from one job's JSON."""
    if not res.get("ok"):
        return {"job": name, "ok": False, "error": res.get("error", "")[-400:]}
    mem = res.get("memory") or {}
    pred_peak = (mem.get("predicted") or {}).get("peak")
    return {
        "job": name, "ok": True, "model": res["model"], "preset": res["preset"],
        "tokens_per_step": res["units_per_step"], "plan": res["plan"],
        "predicted_step_s": res["predicted_step_s"], "step_time_s": res["step_time_s"],
        "measured_over_predicted": _ratio(res["step_time_s"], res["predicted_step_s"]),
        "mfu": res["mfu"], "mfu_basis": res["mfu_basis"],
        "units_per_s": res["units_per_s"], "first_step_s": res["first_step_s"],
        "predicted_peak_bytes": pred_peak, "device_peak_bytes": mem.get("device_peak"),
        "device_over_predicted_peak": _ratio(mem.get("device_peak"), pred_peak),
        "losses": res["losses"],
    }


def _fmt(x: float | None, spec: str, scale: float = 1.0) -> str:
    """``x * scale`` formatted, or ``-`` when there is no figure."""
    return "-" if x is None else format(x * scale, spec)


def markdown(meta: dict, rows: list[dict]) -> str:
    about = (f"jax {meta['jax']}, one-device mesh, `nnscaler-jax train` with the plan's "
             "default budget (the allocator's limit at XLA_PYTHON_CLIENT_MEM_FRACTION=.95, less "
             "its reserve). Step: median after the first. MFU: analytic model FLOPs (recompute "
             "not counted) / step / dense peak at the plan's precision. Memory: the allocator's "
             "peak bytes in use against the plan's predicted peak.")
    head = ("| job | plan | step pred (ms) | step measured (ms) | measured / pred | MFU | "
            "peak pred (GiB) | peak device (GiB) | device / pred |")
    lines = [f"# Predicted against measured on one GPU ({meta['device']})", "", about, "", head,
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["ok"]:
            lines.append(f"| {r['job']} | failed: {r['error'][-160:]!r} | | | | | | | |")
            continue
        p = r["plan"]
        plan = (f"{p.get('precision') or 'fp32'}, {len(p.get('recompute') or [])} recomputed, "
                f"{p.get('microbatches', 1)} micro-batch(es)")
        lines.append(
            f"| {r['job']} | {plan} | {_fmt(r['predicted_step_s'], '.1f', 1e3)} | "
            f"{_fmt(r['step_time_s'], '.1f', 1e3)} | "
            f"{_fmt(r['measured_over_predicted'], '.2f')} | {_fmt(r['mfu'], '.1%')} | "
            f"{_fmt(r['predicted_peak_bytes'], '.2f', 2**-30)} | "
            f"{_fmt(r['device_peak_bytes'], '.2f', 2**-30)} | "
            f"{_fmt(r['device_over_predicted_peak'], '.2f')} |")
    return "\n".join(lines) + "\n"


def _kept_rows(path: Path, meta: dict, wanted: set[str] | None) -> list[dict]:
    """The rows of an earlier run on the same device kind that this run does not redo."""
    try:
        old = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return []
    if old.get("meta", {}).get("device") != meta["device"] or wanted is None:
        return []
    return [r for r in old.get("rows", []) if r.get("job") not in wanted]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="comma-separated job names")
    ap.add_argument("--out", default=str(ROOT / "results"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--cap", type=float, default=None,
                    help="at most this many seconds per job (a short device lease)")
    args = ap.parse_args()
    import jax

    meta = {"device": str(jax.devices()[0].device_kind), "platform": jax.devices()[0].platform,
            "jax": jax.__version__, "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(meta), flush=True)
    wanted = None if args.only is None else set(args.only.split(","))
    out, rows = Path(args.out), []
    out.mkdir(parents=True, exist_ok=True)
    kept = _kept_rows(out / "bench_gpu.json", meta, wanted)
    for name, model, preset, extra, limit in JOBS:
        if wanted is not None and name not in wanted:
            continue
        res = run_job(model, preset, extra, min(limit, args.cap or limit), args.steps)
        rows.append(row(name, res))
        print(name, json.dumps(rows[-1])[:600], flush=True)
        both = kept + rows
        (out / "bench_gpu.json").write_text(json.dumps({"meta": meta, "rows": both}, indent=1))
        (out / "bench_gpu.md").write_text(markdown(meta, both))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
