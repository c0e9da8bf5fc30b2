"""A chunk's backward in two blocks: the input's cotangent now, the weight gradients later.

Zero-bubble schedules (:func:`~nnscaler_jax.pipeline.schedule.zb_h1`) run a backward as ``B``,
which computes only what the previous stage waits for (the cotangent of the chunk's input), and
``G``, the chunk's weight gradients, in a later time step. :func:`split_backward` traces the
whole backward once (``jax.vjp`` of the chunk, its forward recomputed from the saved input),
inlines its calls, and cuts its equations by what each output needs:

- ``B``: every equation the input's cotangent needs (the recomputed forward, the cotangent
  chain through the chunk);
- ``G``: the rest of what the weight gradients need (``x^T dy`` products, bias sums), which
  reads values ``B`` made: those are *kept* (the :attr:`BackwardSplit.kept` values, e.g. each
  dense layer's input and output cotangent) from ``B`` to ``G``.

No equation runs twice; the kept values are what a split backward holds between its blocks.
``G`` reads the arguments named ``available`` (parameters, the micro-batch: unchanged over the
step) directly, and any other argument it needs through the kept values. A layer recomputed
under ``jax.checkpoint`` is one equation of the backward: its weight gradients stay in ``B``.

>>> import jax, jax.numpy as jnp
>>> def bwd(w, x, dy):   # y = tanh(x @ w): (weight gradient, input cotangent)
...     _, vjp = jax.vjp(lambda w, x: jnp.tanh(x @ w), w, x)
...     gw, gx = vjp(dy)
...     return gw, gx
>>> w, x, dy = jnp.ones((3, 2)), jnp.ones((4, 3)), jnp.ones((4, 2))
>>> sp = split_backward(bwd, (w, x, dy), available=(0,))
>>> gx, kept = sp.input_grads(w, x, dy)
>>> [tuple(a.shape) for a in sp.kept_avals]   # the cotangent of x @ w, and x
[(4, 2), (4, 3)]
>>> gw = sp.weight_grads((w, None, None), kept)
>>> bool(jnp.allclose(gw, bwd(w, x, dy)[0])), bool(jnp.allclose(gx, bwd(w, x, dy)[1]))
(True, True)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.extend import core as jcore

from nnscaler_jax.lower.eqns import NO_CONSTRAINTS

__all__ = ["BackwardSplit", "split_backward"]


def _read(env: dict, v: Any) -> Any:
    return v.val if isinstance(v, jcore.Literal) else env[v]


def _needed(eqns: Sequence[Any], outs: Sequence[Any], skip: set[int] = frozenset()) -> list:
    """The equations (not in ``skip``, by id) ``outs`` need, in program order."""
    live = {v for v in outs if isinstance(v, jcore.Var)}
    keep = []
    for e in reversed(eqns):
        if id(e) in skip or not any(v in live for v in e.outvars):
            continue
        keep.append(e)
        live.update(v for v in e.invars if isinstance(v, jcore.Var))
    return keep[::-1]


@dataclass(frozen=True)
class BackwardSplit:
    """A backward ``fn(*args) -> (weight grads, input grads)`` as two programs.

    Attributes:
        kept: the values ``B`` makes (or arguments not ``available``) that ``G`` reads.
        available: positions of the arguments ``G`` reads directly.
    """

    closed: Any
    b_eqns: tuple
    g_eqns: tuple
    kept: tuple
    available: tuple[int, ...]
    arg_of: tuple[int, ...]   # per flat input, its argument's position
    w_tree: Any
    x_tree: Any
    n_w: int

    @property
    def kept_avals(self) -> list:
        return [v.aval for v in self.kept]

    def _env(self, flat: Sequence[Any]) -> dict:
        jx = self.closed.jaxpr
        env = dict(zip(jx.constvars, self.closed.consts, strict=True))
        env.update((v, x) for v, x in zip(jx.invars, flat, strict=True) if x is not None)
        return env

    def input_grads(self, *args: Any) -> tuple[Any, list]:
        """``B``: ``(input grads, kept values)``."""
        env = self._env(jax.tree.leaves(args))
        NO_CONSTRAINTS.evaluate(self.b_eqns, env)
        outs = [_read(env, v) for v in self.closed.jaxpr.outvars[self.n_w:]]
        return jax.tree.unflatten(self.x_tree, outs), [env[v] for v in self.kept]

    def weight_grads(self, args: tuple, kept: Sequence[Any]) -> Any:
        """``G``: the weight grads from the ``available`` arguments (the others may be None)
        and ``B``'s kept values."""
        flat = []
        for i, a in enumerate(args):
            n = self.arg_of.count(i)
            flat += jax.tree.leaves(a) if i in self.available else [None] * n
        env = self._env(flat)
        env.update(zip(self.kept, kept, strict=True))
        NO_CONSTRAINTS.evaluate(self.g_eqns, env)
        outs = [_read(env, v) for v in self.closed.jaxpr.outvars[:self.n_w]]
        return jax.tree.unflatten(self.w_tree, outs)


def split_backward(fn: Callable, args: tuple, available: Sequence[int]) -> BackwardSplit:
    """Trace ``fn(*args) -> (weight grads, input grads)`` (pytrees) on ``args``' shapes and
    split it (see the module docstring); ``available``: the positions of the arguments the
    weight-gradient block may read as they are (the others reach it as kept values)."""
    flat, in_tree = jax.tree.flatten(args)
    arg_of = tuple(i for i, a in enumerate(args) for _ in jax.tree.leaves(a))
    avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat]
    trees: dict[str, Any] = {}

    def flat_fn(*xs):
        w, x = fn(*jax.tree.unflatten(in_tree, xs))
        w_leaves, trees["w"] = jax.tree.flatten(w)
        x_leaves, trees["x"] = jax.tree.flatten(x)
        return [*w_leaves, *x_leaves]

    traced = jax.make_jaxpr(flat_fn)(*avals)
    # calls inlined (pjit bodies' equations are split like the others)
    closed = jax.make_jaxpr(lambda *xs: NO_CONSTRAINTS.call(traced, list(xs)))(*avals)
    jx, n_w = closed.jaxpr, trees["w"].num_leaves
    b_eqns = _needed(jx.eqns, jx.outvars[n_w:])
    in_b = {id(e) for e in b_eqns}
    g_eqns = _needed(jx.eqns, jx.outvars[:n_w], in_b)
    made_g = {v for e in g_eqns for v in e.outvars}
    direct = {v for v, a in zip(jx.invars, arg_of, strict=True) if a in available}
    direct.update(jx.constvars)
    reads = [v for e in g_eqns for v in e.invars] + list(jx.outvars[:n_w])
    kept = tuple(dict.fromkeys(v for v in reads if isinstance(v, jcore.Var)
                               and v not in made_g and v not in direct))
    return BackwardSplit(closed, tuple(b_eqns), tuple(g_eqns), kept, tuple(available), arg_of,
                         trees["w"], trees["x"], n_w)
