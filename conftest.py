"""Pytest configuration shared by tests/ and the doctests of nnscaler_jax/ and models/: 8 virtual
CPU devices and recompute kept by XLA:CPU (:mod:`nnscaler_jax.mesh.cpu`), requested before JAX
starts its backends."""
import os

from nnscaler_jax.mesh.cpu import cpu_xla_flags  # imports jax, starts no backend

os.environ["XLA_FLAGS"] = cpu_xla_flags(os.environ.get("XLA_FLAGS", ""))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

collect_ignore = ["nnscaler_jax/__main__.py", "scripts", "docs"]
