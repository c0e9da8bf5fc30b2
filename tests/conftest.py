"""Test configuration: 8 virtual CPU devices, requested before jax is imported."""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402


def make_mesh(shape, names, axis_types=None):
    """A mesh over the first prod(shape) devices; skips the test when there are too few."""
    import math

    n = math.prod(shape)
    if len(jax.devices()) < n:
        pytest.skip(f"needs {n} devices, have {len(jax.devices())}")
    if axis_types is None:
        return jax.make_mesh(shape, names, devices=jax.devices()[:n])
    return jax.make_mesh(shape, names, axis_types=axis_types, devices=jax.devices()[:n])
