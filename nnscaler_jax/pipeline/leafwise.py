"""Whether an optimizer updates each parameter leaf on its own (the per-stage update's premise).

:class:`~nnscaler_jax.pipeline.mpmd.MpmdProgram` runs the optax update per stage, on the
module's parameter tree with the other stages' leaves as empty placeholders. That equals the
update on the whole tree only when the optimizer treats leaves separately; one that couples
them (``optax.clip_by_global_norm``: a global norm) would see one stage's part. Optimizers are
pairs of functions, so :func:`leafwise` probes instead of reading them.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["SCALES", "leafwise"]


SCALES = (1e-3, 1.0, 1e3, 1e6)
"""Gradient scales :func:`leafwise` probes at (a clipping threshold between them shows)."""


def _miniature(avals: list) -> list[np.ndarray]:
    """Per leaf, an array of its dtype and rank with 2 elements per dim (distinct values)."""
    out = []
    for k, a in enumerate(avals):
        size = 2 ** len(a.shape)
        vals = np.linspace(0.5, 1.5, size) * (-1.0) ** np.arange(k, k + size)
        out.append(vals.reshape((2,) * len(a.shape)).astype(a.dtype))
    return out


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
    grads = [[(np.roll(m, t + 1) * (1.0 + 0.5 * t)).astype(m.dtype) for m in mini]
             for t in range(2)]

    @jax.jit
    def two_steps(params, g0, g1, scale):
        state = optimizer.init(params)
        out = []
        for g in (g0, g1):
            upd, state = optimizer.update(jax.tree.map(lambda x: x * scale, g), state, params)
            out.append(upd)
        return out

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
                    for j in group:
                        a, b = np.asarray(joint[t][j]), np.asarray(alone[t][j])
                        if not np.allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(a).max()):
                            return False
    except Exception:  # noqa: BLE001 (an optimizer that cannot run on part of a tree)
        return False
    return True
