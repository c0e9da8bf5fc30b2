"""Pytest configuration shared by tests/ and the doctests of nnscaler_jax/ and models/: 8 virtual
CPU devices, requested before jax is imported."""
import os

# Most of the suite's time is XLA:CPU compiling small programs. LLVM at -O1 with XLA:CPU's
# older fusion emitters compiles them faster (Swin tiny's 2-stage pipeline test alone: 29.0 s ->
# 21.0 s; the suite 44 -> 26 min with the references jitted) and changes nothing the tests
# check: buffer assignment, remat and the collectives are decided before LLVM. (-O0 is faster
# still but computes a sharded and an unsharded program's random init an ulp apart, which
# test_auto_parallel's bitwise init check catches.) A flag the caller sets wins.
_FAST_COMPILE = ("--xla_backend_optimization_level=1", "--xla_cpu_use_fusion_emitters=false")
_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in _FAST_COMPILE if f.split("=")[0] not in _flags]
    + [_flags, "--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

collect_ignore = ["nnscaler_jax/__main__.py", "scripts", "docs"]
