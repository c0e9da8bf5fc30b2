"""Compare a parallel program's results with the single-device program's."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from nnscaler_jax.errors import PlanError

__all__ = ["VerificationError", "compare_outputs", "max_rel_diff"]

RTOL = {"float32": 1e-4, "float64": 1e-9, "bfloat16": 2e-2, "float16": 5e-3}


class VerificationError(PlanError):
    """The parallel program computed something else than the single-device program."""


def max_rel_diff(a: Any, b: Any) -> tuple[float, str]:
    """Largest relative difference over the leaves, and where (the leaf's tree path).

    A leaf's difference is ``max|a - b|`` over ``max(max|b|, 1e-2 x the largest max|b| of all
    leaves)``: a leaf that is numerically zero next to the others (the gradient of an attention
    key bias, which softmax makes exactly zero in theory) is compared at the tree's scale instead
    of its own rounding noise.
    """
    worst, where = 0.0, ""
    la = jax.tree_util.tree_flatten_with_path(a)[0]
    lb = jax.tree_util.tree_leaves(b)
    floor = 1e-2 * max([float(np.max(np.abs(np.asarray(y, dtype=np.float64)))) for y in lb
                        if np.asarray(y).dtype.kind in "fc" and np.asarray(y).size] or [0.0])
    for (path, x), y in zip(la, lb, strict=True):
        x = np.asarray(x, dtype=np.float64) if np.issubdtype(np.asarray(x).dtype, np.number) \
            else np.asarray(x)
        y = np.asarray(y, dtype=np.float64) if np.issubdtype(np.asarray(y).dtype, np.number) \
            else np.asarray(y)
        if x.dtype.kind not in "fc":
            d = float(np.any(x != y))
        else:
            scale = max(float(np.max(np.abs(y))) if y.size else 0.0, floor, 1e-30)
            d = float(np.max(np.abs(x - y))) / scale if x.size else 0.0
        if d > worst:
            worst, where = d, jax.tree_util.keystr(path)
    return worst, where


def compare_outputs(out: Any, ref: Any, *, where: str, mesh: Any, rtol: float | None = None
                    ) -> float:
    """Raise ``VerificationError`` if ``out`` and ``ref`` differ by more than ``rtol``."""
    leaves = [x for x in jax.tree_util.tree_leaves(ref) if hasattr(x, "dtype")]
    if rtol is None:
        rtol = max([RTOL.get(np.dtype(x.dtype).name, 1e-4) for x in leaves] or [1e-4])
    diff, leaf = max_rel_diff(out, ref)
    if diff > rtol:
        raise VerificationError(
            f"{where} on mesh {mesh}: results differ from the single-device program: max "
            f"relative difference {diff:.3e} (tolerance {rtol:g}) at output {leaf or '<root>'}. "
            "Re-plan with another policy, or report the plan JSON (plan.to_json()) as a bug.")
    return diff
