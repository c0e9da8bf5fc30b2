"""`lower/verify.py`: the relative difference of result trees and the tolerance check."""

from __future__ import annotations

import numpy as np
import pytest

from nnscaler_jax.errors import PlanError
from nnscaler_jax.lower.verify import RTOL, VerificationError, compare_outputs, max_rel_diff


def test_identical_trees_differ_by_zero():
    t = {"a": np.ones((2, 3), np.float32), "b": [np.arange(4), np.float32(2.0)]}
    assert max_rel_diff(t, t) == (0.0, "")


def test_the_worst_leaf_is_named_and_scaled_by_its_own_magnitude():
    ref = {"big": np.full(3, 100.0), "small": np.full(3, 2.0)}
    out = {"big": np.full(3, 101.0), "small": np.full(3, 2.1)}
    # big: 1 / 100 = 0.01; small: 0.1 / 2 = 0.05
    diff, where = max_rel_diff(out, ref)
    assert diff == pytest.approx(0.05) and where == "['small']"


def test_a_leaf_near_zero_is_compared_at_the_tree_scale():
    ref = (np.full(2, 10.0), np.full(2, 1e-9))
    out = (np.full(2, 10.0), np.full(2, 1e-6))
    # the floor is 1e-2 x 10 = 0.1, not the leaf's own 1e-9: (1e-6 - 1e-9) / 0.1
    diff, where = max_rel_diff(out, ref)
    assert diff == pytest.approx((1e-6 - 1e-9) / 0.1) and where == "[1]"


def test_boolean_leaves_count_any_mismatch_as_one_integers_compare_relatively():
    ref = {"mask": np.array([True, False, True])}
    assert max_rel_diff({"mask": np.array([True, False, True])}, ref)[0] == 0.0
    assert max_rel_diff({"mask": np.array([True, True, True])}, ref) == (1.0, "['mask']")
    # integers are numbers: |4 - 3| / max|ref| = 1 / 3 (no float leaf sets a floor)
    ids = {"ids": np.array([1, 2, 3])}
    assert max_rel_diff({"ids": np.array([1, 2, 4])}, ids)[0] == pytest.approx(1 / 3)


def test_structure_mismatch_is_an_error():
    with pytest.raises(ValueError):
        max_rel_diff([np.ones(2)], [np.ones(2), np.ones(2)])


def test_compare_outputs_uses_the_loosest_dtype_tolerance():
    ref = [np.ones(4, np.float32)]
    assert compare_outputs([np.ones(4) * (1 + 5e-5)], ref, where="x", mesh="m") == \
        pytest.approx(5e-5)
    with pytest.raises(VerificationError, match=r"apply on mesh \{'d': 2\}.*at output \[0\]"):
        compare_outputs([np.ones(4) * (1 + 5e-4)], ref, where="apply", mesh={"d": 2})
    assert issubclass(VerificationError, PlanError)
    # a bfloat16 leaf in the tree loosens the tolerance for all of it
    import ml_dtypes

    mixed = [np.ones(4, np.float32), np.ones(4, ml_dtypes.bfloat16)]
    got = [np.ones(4) * (1 + 5e-3), np.ones(4)]
    assert RTOL["bfloat16"] > 5e-3
    compare_outputs(got, mixed, where="x", mesh="m")
    with pytest.raises(VerificationError, match="tolerance 0.001"):
        compare_outputs(got, mixed, where="x", mesh="m", rtol=1e-3)
