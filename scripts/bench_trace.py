"""Benchmark: trace GPT-3 175B (abstract args, nothing allocated) unrolled and with nn.scan.

Writes ``results/bench_trace.json`` and prints it. Run from the repository root:

    .venv/bin/python scripts/bench_trace.py
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import time
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

import models
from nnscaler_jax.capture.trace import capture

OUT = pathlib.Path(__file__).resolve().parent.parent / "results" / "bench_trace.json"


def bench(scan_layers: bool) -> dict:
    spec = models.get("gpt", "gpt3-175b", scan_layers=scan_layers)
    args = spec.make_args(abstract=True)
    t0 = time.perf_counter()
    variables = spec.init_abstract()
    init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = capture(spec.module, *args, variables=variables).graph
    trace_s = time.perf_counter() - t0
    ops = list(graph.walk())
    return {
        "scan_layers": scan_layers,
        "abstract_init_s": round(init_s, 3),
        "trace_s": round(trace_s, 3),
        "ops": len(ops),
        "top_level_ops": len(graph.ops),
        "annotated_fraction": sum(op.annotated for op in ops) / len(ops),
        "variables": len(graph.variables),
        "params": sum(math.prod(t.shape) for t in graph.variables),
        "warnings": sorted({str(w.message).split(";")[0] for w in caught}),
    }


def main() -> None:
    result = {"model": "gpt", "preset": "gpt3-175b", "jax": jax.__version__,
              "runs": [bench(False), bench(True)]}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
