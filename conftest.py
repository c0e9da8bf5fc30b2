"""Pytest configuration shared by tests/ and the doctests of nnscaler_jax/ and models/: 8 virtual
CPU devices, requested before jax is imported."""
import os

# (Tried for the suite's compile time: LLVM at -O0 / -O1 / -O2 compiles 25-30% faster but moves a
# co-sharded T5 tiny's outputs 2e-6 from the one-device program, and -O0 a sharded init an ulp.)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

collect_ignore = ["nnscaler_jax/__main__.py", "scripts", "docs"]
