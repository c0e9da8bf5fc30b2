"""Mesh helper for tests: a mesh over the first devices, skipping when there are too few."""

import jax
import pytest


def make_mesh(shape, names, axis_types=None):
    """A mesh over the first prod(shape) devices; skips the test when there are too few."""
    import math

    n = math.prod(shape)
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices, have {len(jax.devices())}")
    if axis_types is None:
        return jax.make_mesh(shape, names, devices=jax.devices()[:n])
    return jax.make_mesh(shape, names, axis_types=axis_types, devices=jax.devices()[:n])
