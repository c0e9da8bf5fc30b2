"""One process of the multi-process tests (tests/train/test_distributed.py); run as a script.

    python tests/train/dist_worker.py compute           # prints the JSON of compute()
    python tests/train/dist_worker.py die VICTIM         # VICTIM exits 1 after one collective;
                                                         # the others keep running collectives
    python tests/train/dist_worker.py checkpoint DIR     # saves a sharded state, restores it

The process layout comes from the environment (``launch_local`` sets it), through
``nnscaler_jax.train.distributed.initialize``; without it this is one process.
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from nnscaler_jax.train.distributed import initialize


def _mesh():
    return jax.make_mesh((2, 4), ("data", "model"), devices=jax.devices(),
                         axis_types=(AxisType.Auto, AxisType.Auto))


def global_inputs() -> tuple[np.ndarray, np.ndarray]:
    """Small integers, so every sum is exact in float32 whatever the reduction order."""
    x = (np.arange(8 * 16) % 7 - 3).astype(np.float32).reshape(8, 16)
    w = (np.arange(16 * 4) % 5 - 2).astype(np.float32).reshape(16, 4)
    return x, w


def _put(mesh, value: np.ndarray, spec: P) -> jax.Array:
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec),
                                        lambda index: value[index])


def compute() -> dict:
    """A global sum, a jitted matmul and a psum over a mesh of all devices of all processes."""
    from jax.experimental import multihost_utils

    mesh = _mesh()
    x_np, w_np = global_inputs()
    x, w = _put(mesh, x_np, P("data", "model")), _put(mesh, w_np, P("model", None))
    replicated = NamedSharding(mesh, P())
    total = jax.jit(jnp.sum, out_shardings=replicated)(x)
    y = jax.jit(jnp.matmul, out_shardings=NamedSharding(mesh, P("data", None)))(x, w)
    y_all = multihost_utils.process_allgather(y, tiled=True)
    psum = jax.jit(jax.shard_map(lambda b: jax.lax.psum(jnp.sum(b), ("data", "model")),
                                 mesh=mesh, in_specs=P("data", "model"), out_specs=P()))(x)
    return {"processes": jax.process_count(), "devices": jax.device_count(),
            "sum": float(total), "psum": float(psum), "matmul": np.asarray(y_all).tolist()}


def die(victim: int) -> None:
    """``victim`` exits 1 after one collective; the others wait in collectives until stopped."""
    mesh = _mesh()
    x = _put(mesh, global_inputs()[0], P("data", "model"))
    step = jax.jit(lambda v: jnp.sum(v * 2), out_shardings=NamedSharding(mesh, P()))
    print(f"first collective: {float(step(x))}", file=sys.stderr, flush=True)
    if jax.process_index() == victim:
        os._exit(1)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # each step needs the dead process: this hangs
        float(step(x))
    print("the collectives never failed", flush=True)


def checkpoint(directory: str) -> dict:
    """Saves a state sharded over all processes, then restores it onto another layout."""
    from nnscaler_jax.train.checkpoint import Checkpointer

    mesh = _mesh()
    x_np, w_np = global_inputs()
    state = {"x": _put(mesh, x_np, P("data", "model")), "w": _put(mesh, w_np, P("model", None)),
             "step": _put(mesh, np.int32(3), P())}
    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(
        mesh, P("model", "data") if v.ndim == 2 else P())) for k, v in state.items()}
    with Checkpointer(directory) as ckpt:
        ckpt.save(3, state, meta={"processes": jax.process_count()})
        ckpt.wait()
        restored, info = ckpt.restore(target=target)
    gathered = {k: jax.jit(lambda v: v, out_shardings=NamedSharding(mesh, P()))(v)
                for k, v in restored.items()}
    return {"step": info.step, "meta": info.meta,
            **{k: np.asarray(v).tolist() for k, v in gathered.items()}}


def main(argv: list[str]) -> None:
    initialize()
    mode = argv[0]
    if mode == "compute":
        print(json.dumps(compute()), flush=True)
    elif mode == "die":
        die(int(argv[1]))
    elif mode == "checkpoint":
        print(json.dumps(checkpoint(argv[1])), flush=True)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
