"""Pytest configuration shared by tests/ and the doctests of nnscaler_jax/ and models/: 8 virtual
CPU devices, requested before jax is imported."""
import os

# Most of the suite's time is XLA:CPU compiling small programs. LLVM at -O0 and XLA:CPU's
# older fusion emitters compile them faster (Swin tiny's 2-stage pipeline test: 27.1 s -> 14.0 s)
# and change nothing the tests check: the parallel program and its one-device reference compile
# alike, and buffer assignment, remat and the collectives are decided before LLVM. (XLA:GPU's
# compile-only tests read memory and HLO, not code quality.) A flag the caller sets wins.
_FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in _FAST_COMPILE if f.split("=")[0] not in _flags]
    + [_flags, "--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

collect_ignore = ["nnscaler_jax/__main__.py", "scripts", "docs"]
