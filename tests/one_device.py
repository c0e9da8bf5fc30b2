"""Checks a wrapped module against the plain one on one device: forward and gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def assert_like_one_device(pm, module, variables, args, rtol=1e-5, atol=1e-6) -> None:
    """``pm.apply`` equals ``module.apply`` on ``args``, and so does the gradient of the mean
    square of the output (jitted over the mesh vs the plain module: its forward eager, its
    gradient jitted on one device: one compile, where running it eagerly compiled every op,
    37 s of Swin tiny's test)."""
    np.testing.assert_allclose(pm.apply(variables, *args), module.apply(variables, *args),
                               rtol=rtol, atol=atol)

    def loss(apply, v):
        return jnp.mean(apply(v, *args) ** 2)

    g = jax.jit(jax.grad(lambda v: loss(pm.apply, v)))(variables)
    local = jax.tree.map(np.asarray, variables)  # on one device (the default), not the mesh
    ref = jax.jit(jax.grad(lambda v: loss(module.apply, v)))(local)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


def assert_same_params(got, want, rtol: float, atol: float) -> None:
    """Two parameter trees of one structure are equal leaf by leaf (the failing leaf's path)."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want),
                            strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol,
                                   err_msg=jax.tree_util.keystr(path))


def one_device_params(spec, variables, args, opt, steps: int):
    """The parameters ``steps`` optax steps of ``jax.grad(spec.loss_fn)`` leave on one device,
    each step one jitted program (run eagerly, every op compiled alone: most of a small test's
    time)."""
    params, args = jax.tree.map(np.asarray, (variables["params"], args))  # on one device

    @jax.jit
    def one_step(params, opt_state, args):
        loss = lambda p: spec.loss_fn(spec.module.apply({"params": p}, *args), *args)
        return updated(opt, params, jax.grad(loss)(params), opt_state)  # (inlined)

    opt_state = opt.init(params)
    for _ in range(steps):
        params, opt_state = one_step(params, opt_state, args)
    return params


def updated(opt, params, grads, opt_state=None):
    """``params`` after one ``opt`` update by ``grads`` (from ``opt.init(params)`` unless
    ``opt_state`` is given; with it, ``(params, opt_state)``), as one jitted program: run
    eagerly, each leaf's ops compile alone (~100 programs for the Evoformer tiny's SGD step)."""
    import optax

    @jax.jit
    def update(params, grads, state):
        state = opt.init(params) if state is None else state
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    new, state = update(params, grads, opt_state)
    return new if opt_state is None else (new, state)


def global_norm(tree):
    """``optax.tree.norm(tree)``, jitted (one program, not one per leaf)."""
    import optax

    return jax.jit(optax.tree.norm)(tree)


def assert_trains_like_one_device(step, spec, variables, args, opt, steps: int,
                                  rtol: float = 1e-4, atol: float = 1e-6) -> None:
    """``steps`` calls of a train step (``pm.train_step(spec.loss_fn, opt)``) leave the
    parameters the plain loop on one device leaves (``jax.grad`` of ``spec.loss_fn``, ``opt``)."""
    state = step.init(variables, *args)
    for _ in range(steps):
        state, _ = step(state, *args)
    params = one_device_params(spec, variables, args, opt, steps)
    assert_same_params(step.params(state), params, rtol, atol)


def assert_steps_like_one_device(step, state, spec, params, args, opt, steps: int = 3, *,
                                 batch=None, loss_rtol: float = 1e-5, rtol: float = 1e-4,
                                 atol: float = 1e-6):
    """``steps`` calls of a train step from ``state`` (on ``batch``, default ``args``) report
    the plain loop's loss each step (``jax.grad`` of ``spec.loss_fn`` on one device, ``opt``
    from ``params``) and leave its parameters; returns ``(state, the loop's params)``."""
    full = jax.jit(jax.value_and_grad(
        lambda p: spec.loss_fn(spec.module.apply({"params": p}, *args), *args)))
    ref, opt_state = params, opt.init(params)
    for _ in range(steps):
        state, metrics = step(state, *(args if batch is None else batch))
        loss, grads = full(ref)
        np.testing.assert_allclose(metrics["loss"], loss, rtol=loss_rtol)
        ref, opt_state = updated(opt, ref, grads, opt_state)
    assert_same_params(step.params(state), ref, rtol, atol)
    return state, ref
