"""Benchmark: the overhead of ``auto_parallel`` on one device.

On a 1-device mesh, ``auto_parallel(mesh, policy='dp')`` should cost nothing over plain
``jax.jit(module.apply)``: compares a training step's forward + backward (median over 20 runs after
warm-up) and compile time (including tracing and planning), for a tiny and a small GPT.
Writes ``results/bench_overhead.json`` and prints it. Run from the repository root:

    .venv/bin/python scripts/bench_overhead.py
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

import models
from nnscaler_jax import auto_parallel

OUT = pathlib.Path(__file__).resolve().parent.parent / "results" / "bench_overhead.json"
REPS = 20
CONFIGS = {
    "tiny": {"preset": "tiny"},
    "small": {"preset": "tiny", "batch_size": 8, "vocab_size": 1024, "n_positions": 128,
              "seq_len": 128, "d_model": 256, "n_layers": 4, "n_heads": 8},
}


def _time_step(apply, params, spec, variables, tokens) -> tuple[float, float]:
    """(compile seconds incl. tracing, median step seconds) of jit(value_and_grad(loss))."""

    def loss(p, *batch):
        return spec.loss_fn(apply({**variables, "params": p}, *batch), *batch)

    fn = jax.jit(jax.value_and_grad(loss))
    t0 = time.perf_counter()
    compiled = fn.lower(params, *tokens).compile()
    compile_s = time.perf_counter() - t0
    for _ in range(3):
        jax.block_until_ready(compiled(params, *tokens))
    times = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(params, *tokens))
        times.append(time.perf_counter() - t0)
    return compile_s, statistics.median(times)


def bench(name: str, cfg: dict) -> dict:
    cfg = dict(cfg)
    spec = models.get("gpt", cfg.pop("preset"), **cfg)
    tokens = spec.make_args(abstract=False)
    variables = spec.init(jax.random.PRNGKey(0), *tokens)
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    pm = auto_parallel(mesh, policy="dp")(spec.module)
    plain_c, plain_t = _time_step(spec.module.apply, variables["params"], spec, variables, tokens)
    par_c, par_t = _time_step(pm.apply, variables["params"], spec, variables, tokens)
    return {"model": name, "params": sum(x.size for x in jax.tree.leaves(variables["params"])),
            "tokens_shape": list(tokens[0].shape),
            "plain_compile_s": plain_c, "auto_parallel_compile_s": par_c,
            "compile_ratio": par_c / plain_c,
            "plain_step_s": plain_t, "auto_parallel_step_s": par_t,
            "step_ratio": par_t / plain_t}


def main() -> None:
    result = {"mesh": "1 device", "policy": "dp", "reps": REPS, "jax": jax.__version__,
              "runs": [bench(n, c) for n, c in CONFIGS.items()]}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
