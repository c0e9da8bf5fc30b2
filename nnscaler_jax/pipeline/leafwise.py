"""Whether an optimizer updates each parameter leaf on its own (the per-stage update's premise).

:class:`~nnscaler_jax.pipeline.mpmd.MpmdProgram` runs the optax update per stage, on the
module's parameter tree with the other stages' leaves as empty placeholders. That equals the
update on the whole tree only when the optimizer treats leaves separately; one that couples
them (``optax.clip_by_global_norm``: a global norm) would see one stage's part, so such an
optimizer runs there on the module's whole tree, over the whole mesh. Optimizers are pairs of
functions, so :func:`leafwise` probes instead of reading them.

The stacked and packed runtimes run the update on their own layout; :func:`same_on_layout`
probes whether that equals the update on the module's tree (masks, labels and per-leaf
statistics read the module's leaves), else they run it on the module's tree
(:class:`~nnscaler_jax.pipeline.update.ModuleView`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["SCALES", "leafwise", "same_on_layout"]


SCALES = (1e-3, 1.0, 1e3, 1e6)
"""Gradient scales :func:`leafwise` probes at (a clipping threshold between them shows)."""


def _miniature(avals: list, shapes: list | None = None) -> list[np.ndarray]:
    """Per leaf, an array of its dtype and rank with 2 elements per dim (or ``shapes``),
    distinct values."""
    out = []
    for k, a in enumerate(avals):
        shape = tuple(shapes[k]) if shapes is not None else (2,) * len(a.shape)
        size = int(np.prod(shape, dtype=np.int64))
        # (scaled per leaf: per-leaf norms, as trust ratios read them, differ between leaves)
        vals = np.linspace(0.5, 1.5, size) * (-1.0) ** np.arange(k, k + size) * (1 + k % 7)
        out.append(vals.reshape(shape).astype(a.dtype))
    return out


def _two_steps(optimizer: Any) -> Any:
    """Jitted: the updates of two optimizer steps from ``init(params)`` at one gradient scale."""
    @jax.jit
    def two_steps(params, g0, g1, scale):
        state = optimizer.init(params)
        out = []
        for g in (g0, g1):
            upd, state = optimizer.update(jax.tree.map(lambda x: x * scale, g), state, params)
            out.append(upd)
        return out
    return two_steps


def _close(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(
        np.allclose(a, b, rtol=1e-5, atol=1e-6 * (np.abs(a).max() if a.size else 0.0)))


def _grads(mini: list) -> list[list[np.ndarray]]:
    """Two steps' gradients for the miniature parameters (distinct from them and each other)."""
    return [[(np.roll(m, t + 1) * (1.0 + 0.5 * t)).astype(m.dtype) for m in mini]
            for t in range(2)]


def leafwise(optimizer: Any, tree: Any = None, groups: Any = None) -> bool:
    """Whether ``optimizer``, run on each group of leaves alone (the other leaves empty
    placeholders, as the per-stage update runs it), updates them as run on the whole tree.

    Probed on a miniature of ``tree`` (its structure, so masks and labels given as pytrees of
    the model's parameters apply; 2 elements per dim): two steps at each gradient scale of
    :data:`SCALES`. ``groups``: leaf indices per group (default: every leaf alone); ``tree``
    default: a two-leaf dict."""
    tree = tree if tree is not None else {"a": np.zeros(2), "b": np.zeros((2, 3))}
    leaves, treedef = jax.tree.flatten(tree)
    groups = groups if groups is not None else [[j] for j in range(len(leaves))]
    mini = _miniature([jax.ShapeDtypeStruct(np.shape(x), getattr(x, "dtype", None)
                                            or np.asarray(x).dtype) for x in leaves])
    hole = lambda x: np.zeros((0,), x.dtype)
    grads = _grads(mini)
    two_steps = _two_steps(optimizer)

    def run(group: set[int], scale: float) -> list:
        pick = lambda xs: jax.tree.unflatten(
            treedef, [x if j in group else hole(x) for j, x in enumerate(xs)])
        out = two_steps(pick(mini), pick(grads[0]), pick(grads[1]), scale)
        return [jax.tree.leaves(u) for u in out]

    try:
        for scale in SCALES:
            joint = run(set(range(len(leaves))), scale)
            for group in groups:
                alone = run(set(group), scale)
                for t in range(2):
                    if not all(_close(joint[t][j], alone[t][j]) for j in group):
                        return False
    except Exception:  # noqa: BLE001 (an optimizer that cannot run on part of a tree)
        return False
    return True


def same_on_layout(optimizer: Any, tree: Any, shapes: list, layout: Any) -> bool:
    """Whether ``optimizer`` run on a pipeline layout of the parameters updates them as on
    the module's tree (its masks, labels and per-leaf statistics see the module's leaves).

    ``tree``: the module's parameters (leaves with ``.shape`` / ``.dtype``; the structure
    is what matters); ``shapes``: per leaf, the miniature's shape (2 per dim, except dims the
    layout reads, such as a scanned layer dim); ``layout(avals) -> (to_layout, to_module)``:
    traceable maps between leaf lists of those shapes and the layout's tree. Probed as
    :func:`leafwise` (two steps at each scale of :data:`SCALES`); an optimizer that fails on
    the layout (a mask pytree of the module's tree) is not the same there.
    """
    leaves, treedef = jax.tree.flatten(tree)
    avals = [jax.ShapeDtypeStruct(np.shape(x), getattr(x, "dtype", None)
                                  or np.asarray(x).dtype) for x in leaves]
    mini = _miniature(avals, shapes)
    to_layout, to_module = layout([jax.ShapeDtypeStruct(m.shape, m.dtype) for m in mini])
    grads, two_steps = _grads(mini), _two_steps(optimizer)
    for scale in SCALES:
        want = two_steps(jax.tree.unflatten(treedef, mini),
                         *[jax.tree.unflatten(treedef, g) for g in grads], scale)
        try:
            got = two_steps(to_layout(mini), *[to_layout(g) for g in grads], scale)
        except Exception:  # noqa: BLE001 (a mask or label pytree of the module's tree)
            return False
        for t in range(2):
            if not all(_close(a, b) for a, b in zip(jax.tree.leaves(want[t]),
                                                    to_module(got[t]), strict=True)):
                return False
    return True
