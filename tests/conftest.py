"""Test configuration: 8 virtual CPU devices, requested before jax is imported."""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402,F401 - jax starts after XLA_FLAGS is set

from meshes import make_mesh  # noqa: E402,F401 - re-exported for old imports
