"""Every training step after the first is a cache hit: ``init`` lays the whole state out as the
step returns it (parameters, the optimizer's moments, the step count), so steps 2 and 3 compile
nothing. A moment laid out otherwise by ``init`` (replicated, while the step returns it split
over the stage axis) compiles the whole step again at step 2."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import optax
import pytest
from jax import monitoring
from meshes import make_mesh
from tiny_gpt2 import tiny_gpt2

import models
from nnscaler_jax import Constraints, auto_parallel

slow = pytest.mark.slow
PIPELINED = Constraints(pipeline_stages=2, microbatches=4, schedule="1f1b")


@contextlib.contextmanager
def _compilations():
    """The XLA compilations made inside the block (jax's backend-compile events)."""
    seen: list[str] = []

    def listener(event: str, _duration: float, **_kw) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(event)
    monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        monitoring.unregister_event_duration_listener(listener)


def _after_the_first(step, state, args) -> list[str]:
    state, metrics = step(state, *args)  # compiles
    with _compilations() as seen:
        for _ in range(2):
            state, metrics = step(state, *args)
        jax.block_until_ready(metrics["loss"])
    assert jnp.isfinite(metrics["loss"])
    return seen


@slow
@pytest.mark.parametrize("constraints,axes", [(None, ("data", "model")),
                                              (PIPELINED, ("stage", "data"))],
                         ids=["spmd", "pipelined"])
def test_gpt_tiny_compiles_one_step_for_three(constraints, axes):
    spec = models.get("gpt", "tiny", batch_size=16)
    pm = auto_parallel(make_mesh((2, 4), axes), constraints)(spec.module)
    step = pm.train_step(spec.loss_fn, optax.adamw(1e-3))
    args = spec.make_args()
    state = step.init(spec.init(jax.random.PRNGKey(0)), *args)
    assert _after_the_first(step, state, args) == []


@slow
def test_tensor_parallel_stages_compile_one_step_for_three():
    # the per-stage runtime (one program per stage and block, Megatron inside the stages;
    # interlaced: the stages' updates and the all-device blocks' one): each optax update lays
    # its results out as init laid its state (it compiled the updates again at step 2)
    spec = models.get("t5", "tiny", batch_size=16)
    pm = auto_parallel(make_mesh((2, 2, 2), ("stage", "data", "model")),
                       Constraints(pipeline_stages=2, microbatches=4, schedule="interlaced"),
                       policy="megatron")(spec.module)
    step = pm.train_step(spec.loss_fn, optax.adamw(1e-3))
    args = spec.make_args()
    state = step.init(spec.init(jax.random.PRNGKey(0)), *args)
    assert type(step.program).__name__ == "MpmdProgram"
    assert _after_the_first(step, state, args) == []


@slow
def test_transformers_gpt2_pipelined_compiles_one_step_for_three():
    model, args, loss_fn = tiny_gpt2(16, 8)
    pm = auto_parallel(make_mesh((2, 4), ("stage", "data")), PIPELINED)(model.module)
    step = pm.train_step(loss_fn, optax.adam(1e-3))
    state = step.init({"params": model.params}, *args)
    assert _after_the_first(step, state, args) == []
