"""The optax update around a pipelined program's gradients, shared by both runtimes
(:class:`~nnscaler_jax.pipeline.stacked.PipelineProgram` for stacked identical layers,
:class:`~nnscaler_jax.pipeline.cut_program.CutProgram` for stages cut at module boundaries).

Both keep parameters in their own layout (layers stacked ``[stages, virtual, layers, ...]``,
or packed vectors per chunk). The update runs on that layout when the optimizer updates it as
it would the module's tree (:func:`~nnscaler_jax.pipeline.leafwise.same_on_layout`); else
(a mask or label of the module's leaves, a per-leaf statistic) on a :class:`ModuleView`: the
gradients and parameters seen as the module's tree inside the step, the optimizer state kept
in that tree, spread over the axes the layout splits."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnscaler_jax.pipeline.leafwise import same_on_layout

__all__ = ["LossScaling", "ModuleView", "cached_view", "initial_state", "jitted_step",
           "mirror_shardings", "mirror_store", "module_view", "per_device_bytes", "place_as"]


def _keyed(path: Any) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _mirror_table(params: Any, shardings: Any) -> dict[tuple[str, ...], tuple]:
    return {_keyed(path): (tuple(np.shape(p)), sh) for (path, p), sh in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree_util.tree_leaves(shardings),
        strict=True)}


def _mirrored(table: dict, rep: Any, path: Any, x: Any) -> Any:
    keys = _keyed(path)
    for start in range(len(keys)):
        hit = table.get(keys[start:])
        if hit is not None and hit[0] == tuple(np.shape(x)):
            return hit[1]
    return rep


def mirror_shardings(tree: Any, params: Any, shardings: Any, rep: Any) -> Any:
    """Shardings of ``tree``, an optimizer state mirroring ``params`` (arrays or shapes) laid
    out as ``shardings``: a leaf whose path ends with a parameter's path and has its shape
    (Adam's ``mu`` / ``nu``, momentum) as that parameter; anything else (step counts) ``rep``.

    >>> import numpy as np
    >>> params = {"w": np.zeros((4, 2)), "b": np.zeros(2)}
    >>> opt = ({"count": np.zeros(()), "mu": {"w": np.zeros((4, 2)), "b": np.zeros(2)}},)
    >>> mirror_shardings(opt, params, {"w": "split", "b": "bias"}, "rep")
    ({'count': 'rep', 'mu': {'b': 'bias', 'w': 'split'}},)
    """
    table = _mirror_table(params, shardings)
    return jax.tree_util.tree_map_with_path(lambda p, x: _mirrored(table, rep, p, x), tree)


def mirror_store(params: Any, shardings: Any, rep: NamedSharding) -> Callable[[Any], Any]:
    """``tree -> tree`` laying each leaf out as :func:`mirror_shardings` says (inside jit):
    the optimizer state keeps its parameters' layout from ``init`` on, so the step's output
    state is laid out as its input (``zeros_like`` carries no sharding: without it the
    initial moments are replicated and the first step returns them split, a second compile
    of the whole step)."""
    table = _mirror_table(params, shardings)
    return lambda tree: jax.tree_util.tree_map_with_path(
        lambda p, x: place_as(x, _mirrored(table, rep, p, x)), tree)


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


@dataclass(frozen=True)
class LossScaling:
    """Dynamic loss scaling of a float16 step, the SPMD and the pipelined alike.

    The state carries ``'loss_scale'`` (float32, :attr:`INITIAL` at first) and
    ``'good_steps'``; the backward is seeded with the scale (the SPMD step multiplies the loss,
    a pipeline seeds the last chunk's backward with ``scale / M``), so float16 cotangents stay
    above float16's smallest normal. :meth:`settle` divides the gradients by it; a step whose
    gradients are not all finite keeps the old parameters and optimizer state and halves the
    scale; ``growth_interval`` finite steps in a row double it.

    >>> LossScaling(growth_interval=3).initial()["loss_scale"]
    Array(32768., dtype=float32)
    """

    growth_interval: int = 2000
    INITIAL = 2.0 ** 15

    def initial(self) -> dict:
        """The state's ``{'loss_scale', 'good_steps'}`` of a first step."""
        return {"loss_scale": jnp.float32(self.INITIAL), "good_steps": jnp.zeros((), jnp.int32)}

    @staticmethod
    def unscale(grads: Any, state: dict) -> Any:
        """The gradients of the loss itself (the scale's gradients divided by it)."""
        scale = state["loss_scale"]
        return jax.tree.map(lambda g: g / scale, grads)

    @staticmethod
    def all_finite(grads: Any) -> Any:
        """Whether every gradient entry is finite (a traced bool; True for no leaves)."""
        return jnp.all(jnp.array([jnp.all(jnp.isfinite(g))
                                  for g in jax.tree_util.tree_leaves(grads)] or [True]))

    def settle(self, state: dict, new: dict, grads: Any) -> tuple[dict, dict]:
        """``(state updates, metrics)`` after an update to ``new`` (``{'params',
        'opt_state'}``) from the unscaled ``grads``: ``new`` where they are finite, else the
        state's own, with the scale and good-step count advanced; metrics ``'loss_scale'``
        (the scale this step used) and ``'finite'``."""
        scale = state["loss_scale"]
        finite = LossScaling.all_finite(grads)
        out = {k: jax.tree.map(lambda a, b: jnp.where(finite, a, b), v, state[k])
               for k, v in new.items()}
        return {**out, **self.advance(state, finite)}, {"loss_scale": scale, "finite": finite}

    def advance(self, state: dict, finite: Any) -> dict:
        """The next ``{'loss_scale', 'good_steps'}`` after a step whose gradients were
        ``finite`` or not (traced, or eager on the host)."""
        scale = state["loss_scale"]
        good = jnp.where(finite, state["good_steps"] + 1, 0)
        grow = good >= self.growth_interval
        return {"loss_scale": jnp.where(finite, jnp.where(grow, scale * 2, scale), scale / 2),
                "good_steps": jnp.where(grow, 0, good)}


@dataclass(frozen=True)
class ModuleView:
    """The module's parameter tree seen from a pipeline layout, inside the step.

    Attributes:
        tree: ``layout tree -> module tree`` (traceable).
        layout: ``module tree -> layout tree`` (traceable).
        store: lays a module-shaped tree (the optimizer state) out on the mesh.
    """

    tree: Callable
    layout: Callable
    store: Callable


def spread(mesh: Any, axes: tuple[str, ...]) -> Callable:
    """``tree -> tree`` placing each array with its largest dims split over ``axes`` in turn
    (a dim divisible by the axis size; none: that axis replicates it)."""
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))

    def place(x):
        shape, spec = np.shape(x), [None] * np.ndim(x)
        for a in axes:
            free = [d for d in range(len(shape)) if spec[d] is None
                    and shape[d] >= sizes[a] and shape[d] % sizes[a] == 0]
            if free:
                spec[max(free, key=lambda d: shape[d])] = a
        return place_as(x, NamedSharding(mesh, P(*spec)))

    return lambda tree: jax.tree.map(place, tree)


def module_view(program: Any, optimizer: Any, axes: tuple[str, ...]) -> ModuleView | None:
    """None when ``optimizer`` updates ``program``'s layout as the module's tree
    (:func:`~nnscaler_jax.pipeline.leafwise.same_on_layout`), else the view to run it on.

    ``program`` gives ``params_tree``, ``param_avals``, ``mini_shapes()`` and
    ``layout(avals) -> (to_layout, to_module)``; ``axes``: the mesh axes its layout splits."""
    tree = jax.tree.unflatten(program.params_tree, program.param_avals)
    if same_on_layout(optimizer, tree, program.mini_shapes(), program.layout):
        return None
    to_layout, to_module = program.layout(program.param_avals)
    return ModuleView(tree=lambda pp: jax.tree.unflatten(program.params_tree, to_module(pp)),
                      layout=lambda t: to_layout(jax.tree.leaves(t)),
                      store=spread(program.mesh, axes))


def cached_view(program: Any, optimizer: Any, axes: tuple[str, ...]) -> ModuleView | None:
    """:func:`module_view`, probed once per optimizer (the step and the state share it)."""
    views = program.__dict__.setdefault("_views", {})
    if id(optimizer) not in views:  # (the optimizer is kept, so its id is not reused)
        views[id(optimizer)] = (optimizer, module_view(program, optimizer, axes))
    return views[id(optimizer)][1]


def jitted_step(grads: Callable, optimizer: Any, mesh: Any, *, store: Callable = _same,
                view: ModuleView | None = None, return_grads: bool = False,
                scaling: LossScaling | None = None,
                compiler_options: dict | None = None, norm: Callable | None = None
                ) -> Callable:
    """A jitted, donated ``run(state, batch) -> (state, metrics)`` (``run.lower(state, batch)``
    too) under ``mesh``: ``grads(params, batch, key) -> (loss, grads)`` (``key`` split off
    ``state['rng']`` when the state has one, else None), then the optax update;
    ``store`` lays the new parameters and optimizer state out as the program keeps them;
    ``view``: the update runs on the module's tree (the optimizer state kept there).
    A state with ``'collections'`` calls ``grads(params, batch, key, collections) -> (loss,
    grads, new collections)`` and keeps the new ones. With ``scaling`` (float16) ``grads``
    also takes ``scale=`` (the state's loss scale, the backward's seed) and the update is
    :meth:`LossScaling.settle`'s. ``compiler_options``: XLA's, for the jitted step;
    ``norm``: the gradients' global norm from their layout (default: of every element, for
    layouts holding each once)."""
    import optax

    norm = norm or optax.tree.norm

    def update(state, g):
        if view is None:
            updates, opt_state = optimizer.update(g, state["opt_state"], state["params"])
            opt_state = store(opt_state)
        else:
            updates, opt_state = optimizer.update(view.tree(g), state["opt_state"],
                                                  view.tree(state["params"]))
            updates, opt_state = view.layout(updates), view.store(opt_state)
        return {"params": store(optax.apply_updates(state["params"], updates)),
                "opt_state": opt_state}

    def step(state, batch):
        state, key = dict(state), None
        if "rng" in state:  # a new key per step, as the SPMD step (micro-batches fold it in)
            state["rng"], key = jax.random.split(state["rng"])
        args = (state["params"], tuple(batch), key)
        if "collections" in state:
            args += (state["collections"],)
        kw = {} if scaling is None else {"scale": state["loss_scale"]}
        loss, g, *colls = grads(*args, **kw)
        if colls:
            state["collections"] = colls[0]
        metrics = {}
        if scaling is None:
            new = update(state, g)
        else:
            g = LossScaling.unscale(g, state)
            new, metrics = scaling.settle(state, update(state, g), g)
        metrics = {"loss": loss, "grad_norm": norm(g), **metrics}
        if return_grads:
            metrics["grads"] = g
        if "step" in state:  # the steps taken, as the SPMD step counts them
            new["step"] = state["step"] + 1
        return {**state, **new}, metrics

    jitted = jax.jit(step, donate_argnums=(0,), compiler_options=compiler_options)

    def run(state, batch):
        with jax.set_mesh(mesh):
            return jitted(state, batch)

    def lower(state, batch):
        with jax.set_mesh(mesh):
            return jitted.lower(state, batch)

    run.lower = lower
    return run


def initial_state(pp: Any, optimizer: Any, mesh: Any, *, store: Callable = _same,
                  view: ModuleView | None = None, collections: Any = None) -> dict:
    """``{'params': pp, 'opt_state': optimizer.init(...)}``: of ``pp`` laid out by ``store``,
    or with ``view`` of the module's tree laid out by ``view.store``; and ``'collections'``
    when given."""
    init = ((lambda p: store(optimizer.init(p))) if view is None
            else (lambda p: view.store(optimizer.init(view.tree(p)))))
    with jax.set_mesh(mesh):
        state = {"params": pp, "opt_state": jax.jit(init)(pp)}
    if collections is not None:
        state["collections"] = collections
    return state
