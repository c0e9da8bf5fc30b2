"""Measured per-device memory of pipelined train steps: 1F1B vs GPipe (and interleaved).

XLA's compiled memory analysis of the whole jitted step (``temp`` = activations, buffers and
scratch; ``argument`` = params, optimizer state and batch) for GPT (8 layers, d 128, seq 128) on
a (stage 4, data 2) mesh of 8 CPU devices at 8 micro-batches. Writes results/bench_pipeline.json.

    .venv/bin/python scripts/bench_pipeline.py
"""

import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax  # noqa: E402
import optax  # noqa: E402

import models  # noqa: E402
from nnscaler_jax import Constraints, auto_parallel  # noqa: E402
from nnscaler_jax.plan import schedule as sch  # noqa: E402


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


def main() -> None:
    rows = [measure(s) for s in ("gpipe", "1f1b", "interleaved")]
    out = os.path.join(os.path.dirname(__file__), "..", "results", "bench_pipeline.json")
    with open(out, "w") as f:
        json.dump({"note": "XLA compiled memory_analysis per device of the jitted pipelined "
                   "train step (CPU, 8 virtual devices)", "rows": rows}, f, indent=1)
    for r in rows:
        print(f"{r['schedule']:>12}: temp {r['temp_bytes'] / 2**20:8.2f} MiB, slots "
              f"{r['input_buffer_slots']}, peak in flight {r['peak_in_flight']}, "
              f"{r['time_steps']} steps, {r['step_s'] * 1e3:.0f} ms/step")


if __name__ == "__main__":
    main()
