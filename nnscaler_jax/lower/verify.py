"""Compare a parallel program's results with the single-device program's."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from nnscaler_jax.errors import PlanError

__all__ = ["PRECISION_RTOL", "RTOL", "VerificationError", "compare_outputs", "max_rel_diff",
           "precision_rtol"]

RTOL = {"float32": 1e-4, "float64": 1e-9, "bfloat16": 2e-2, "float16": 5e-3}
"""Tolerance by the dtype of a result (the largest over the results applies)."""

PRECISION_RTOL = {"bfloat16": 5e-2, "float16": 1e-2}
"""Tolerance of a program computed at a 16-bit precision (``Constraints(precision=...)``),
whatever its results' dtype (they come back float32), used for those programs only.

The parallel program and the single-device one compute the same thing with the same casts but
round at other points: XLA fuses the two programs differently (on CPU a fused chain of 16-bit
ops keeps its intermediates in float32, an unfused one rounds each), and a split contraction
rounds each device's partial sum before the all-reduce adds them; the differences go on through
the network and its backward. One bfloat16 rounding is up to 2**-9 (2e-3) of a value, float16's
2**-12 (2.4e-4). Measured (:func:`max_rel_diff`) on GPT tiny, 2x4 mesh, dp / megatron / auto:
bfloat16 forward 1.3e-2 to 1.4e-2, gradients 2.1e-2 to 2.6e-2, while the same single-device
bfloat16 program jitted and run op by op already differ by 2.1e-2 in the gradients (and
bfloat16 from float32 by 1.7e-2): 5e-2 is about twice that noise. float16: forward 1.3e-3,
gradients 3.5e-3 (op by op vs jitted 2.9e-3): 1e-2. A wrong plan (a missing reduction, a
wrong slice) is off by O(1)."""


def precision_rtol(precision: str | None) -> float | None:
    """The tolerance of a program at ``precision`` (None: float32 or the model's own dtypes,
    judged by the results' dtypes).

    >>> precision_rtol("bfloat16"), precision_rtol("float16"), precision_rtol("float32")
    (0.05, 0.01, None)
    """
    return PRECISION_RTOL.get(precision) if precision else None


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
    floor = 1e-2 * max([float(np.max(np.abs(_numbers(y)))) for y in lb
                        if _inexact(y) and np.asarray(y).size] or [0.0])
    for (path, x), y in zip(la, lb, strict=True):
        x, y = _numbers(x), _numbers(y)
        if x.dtype.kind not in "fc":
            d = float(np.any(x != y))
        else:
            scale = max(float(np.max(np.abs(y))) if y.size else 0.0, floor, 1e-30)
            d = float(np.max(np.abs(x - y))) / scale if x.size else 0.0
        if d > worst:
            worst, where = d, jax.tree_util.keystr(path)
    return worst, where


def _inexact(x: Any) -> bool:
    """Floating point or complex, bfloat16 included (numpy does not class it as a number)."""
    return bool(jax.numpy.issubdtype(np.asarray(x).dtype, jax.numpy.inexact))


def _numbers(x: Any) -> np.ndarray:
    """``x`` as float64 (complex128) when numeric, else as it is (bools, keys)."""
    x = np.asarray(x)
    if x.dtype == bool or not jax.numpy.issubdtype(x.dtype, jax.numpy.number):
        return x
    return x.astype(np.complex128 if x.dtype.kind == "c" else np.float64)


def compare_outputs(out: Any, ref: Any, *, where: str, mesh: Any, rtol: float | None = None,
                    precision: str | None = None) -> float:
    """Raise ``VerificationError`` if ``out`` and ``ref`` differ by more than ``rtol`` (default:
    by the results' dtypes, :data:`RTOL`, or at least :data:`PRECISION_RTOL` for a program
    computed at a 16-bit ``precision``)."""
    leaves = [x for x in jax.tree_util.tree_leaves(ref) if hasattr(x, "dtype")]
    if rtol is None:
        rtol = max([RTOL.get(np.dtype(x.dtype).name, 1e-4) for x in leaves] or [1e-4])
        rtol = max(rtol, precision_rtol(precision) or 0.0)
    diff, leaf = max_rel_diff(out, ref)
    if diff > rtol:
        raise VerificationError(
            f"{where} on mesh {mesh}{f' at {precision}' if precision else ''}: results differ "
            "from the single-device program: max "
            f"relative difference {diff:.3e} (tolerance {rtol:g}) at output {leaf or '<root>'}. "
            "Re-plan with another policy, or report the plan JSON (plan.to_json()) as a bug.")
    return diff
