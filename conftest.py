"""Pytest configuration shared by tests/ and the doctests of nnscaler_jax/ and models/: 8 virtual
CPU devices, requested before jax is imported."""
import os
import shutil
import tempfile

# (Tried for the suite's compile time: LLVM at -O0 / -O1 / -O2 compiles 25-30% faster but moves a
# co-sharded T5 tiny's outputs 2e-6 from the one-device program, and -O0 a sharded init an ulp.)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent compilation cache for the run, shared by the xdist workers (they inherit the
# controller's environment): tests compile the same programs from new closures (the one-device
# reference of a model, a plan's step in several tests), which jit's in-memory cache cannot
# see. Measured 2026-12-04 on four pipeline / train files: 488 s without, 417 s from an empty
# cache. What reads XLA's log turns it off (nnscaler_jax.lower.hlo.xla_stderr); jax's compile
# event, which tests/train/test_compiles_once.py counts, fires on a cache read too.
# JAX_ENABLE_COMPILATION_CACHE=false runs without it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="nnsj-jax-cache-")
    os.environ["NNSJ_TEST_CACHE_OWNER"] = str(os.getpid())
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def pytest_unconfigure(config):
    """The process that made the run's compilation cache removes it."""
    if os.environ.get("NNSJ_TEST_CACHE_OWNER") == str(os.getpid()):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)

collect_ignore = ["nnscaler_jax/__main__.py", "scripts", "docs"]
