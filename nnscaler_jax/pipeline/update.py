"""The optax update around a pipelined program's gradients, shared by both runtimes
(:class:`~nnscaler_jax.pipeline.runtime.PipelineProgram` for stacked identical layers,
:class:`~nnscaler_jax.pipeline.hetero.CutProgram` for stages cut at module boundaries)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax import lax
from jax.sharding import NamedSharding

from nnscaler_jax.errors import PlanError

__all__ = ["initial_state", "jitted_step", "per_device_bytes", "place_as"]


def per_device_bytes(tree: Any) -> int:
    """The most bytes one device holds of the arrays in ``tree`` (arrays on different
    devices, as one program per stage keeps them, add up only where they share a device)."""
    held: dict[Any, int] = {}
    for x in jax.tree_util.tree_leaves(tree):
        if isinstance(x, jax.Array):
            for sh in x.addressable_shards:
                held[sh.device] = held.get(sh.device, 0) + sh.data.nbytes
    return max(held.values(), default=0)


def place_as(x: Any, sharding: NamedSharding) -> Any:
    """Lay ``x`` out as ``sharding`` inside jit (Explicit mesh axes: reshard; Auto: constraint)."""
    if any(t == jax.sharding.AxisType.Explicit for t in getattr(sharding.mesh, "axis_types", ())):
        return jax.sharding.reshard(x, sharding)
    return lax.with_sharding_constraint(x, sharding)


def _same(tree: Any) -> Any:
    return tree


def jitted_step(grads: Callable, optimizer: Any, mesh: Any, *, store: Callable = _same,
                return_grads: bool = False) -> Callable:
    """A jitted, donated ``run(state, batch) -> (state, metrics)`` (``run.lower(state, batch)``
    too) under ``mesh``: ``grads(params, batch, key) -> (loss, grads)`` (``key`` split off
    ``state['rng']`` when the state has one, else None), then the optax update;
    ``store`` lays the new parameters and optimizer state out as the program keeps them.
    A state with ``'collections'`` calls ``grads(params, batch, key, collections) -> (loss,
    grads, new collections)`` and keeps the new ones."""
    import optax

    def step(state, batch):
        state, key = dict(state), None
        if "rng" in state:  # a new key per step, as the SPMD step (micro-batches fold it in)
            state["rng"], key = jax.random.split(state["rng"])
        if "collections" in state:
            loss, g, state["collections"] = grads(state["params"], tuple(batch), key,
                                                  state["collections"])
        else:
            loss, g = grads(state["params"], tuple(batch), key)
        updates, opt_state = optimizer.update(g, state["opt_state"], state["params"])
        opt_state = store(opt_state)
        params = store(optax.apply_updates(state["params"], updates))
        metrics = {"loss": loss, "grad_norm": optax.global_norm(g)}
        if return_grads:
            metrics["grads"] = g
        return {**state, "params": params, "opt_state": opt_state}, metrics

    jitted = jax.jit(step, donate_argnums=(0,))

    def run(state, batch):
        with jax.set_mesh(mesh):
            return jitted(state, batch)

    def lower(state, batch):
        with jax.set_mesh(mesh):
            return jitted.lower(state, batch)

    run.lower = lower
    return run


def initial_state(pp: Any, optimizer: Any, mesh: Any, *, store: Callable = _same,
                  collections: Any = None) -> dict:
    """``{'params': pp, 'opt_state': optimizer.init(pp)}`` (the state laid out by ``store``),
    and ``'collections'`` when given."""
    with jax.set_mesh(mesh):
        try:
            opt_state = jax.jit(lambda p: store(optimizer.init(p)))(pp)
        except (ValueError, TypeError) as e:  # (a mask / label pytree of the module's tree)
            raise PlanError(
                f"train_step: optimizer.init failed on the pipeline's parameter layout "
                f"({type(e).__name__}: {str(e).splitlines()[0][:200]}). This runtime lays the "
                "parameters out per stage (stacked or packed), not as the module's tree, so "
                "masks or labels given as a pytree of the module's parameters "
                "(optax.adamw(mask=...), optax.masked, optax.multi_transform) do not apply, "
                "and callables see that layout. Use an optimizer without them; a model cut "
                "at module boundaries with tensor-parallel stages (policy='megatron' or "
                "'auto') keeps the module's tree and takes them") from e
        state = {"params": pp, "opt_state": opt_state}
    if collections is not None:
        state["collections"] = collections
    return state
