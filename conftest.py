"""Pytest configuration shared by tests/ and the doctests of nnscaler_jax/ and models/: 8 virtual
CPU devices, requested before jax is imported."""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

collect_ignore = ["nnscaler_jax/__main__.py", "scripts", "docs"]
