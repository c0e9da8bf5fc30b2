"""XLA flags for runs on CPU: virtual devices, and (to measure it) recompute that XLA:CPU keeps.

``jax.checkpoint`` keeps its recomputed forward apart from the original with an
``optimization_barrier``. XLA:CPU drops those barriers early (its ``cse_barrier_expander`` pass,
before layout assignment), and its later CSE then merges the recomputed forward back into the
original: the backward reads the forward's values and recompute saves nothing. Measured with
jax 0.10.2, an 8-layer MLP's gradient (4096 x 256 activations): XLA temp 71.3 MB without
checkpoint, 100.7 MB with it on every layer by default, 41.9 MB with the pass disabled, the
gradients bit for bit the same. ``keep_remat=True`` disables the pass, so that on this backend
``compiled.memory_analysis()`` shows what a plan's recompute groups save.

It is for measuring, not a default: XLA:CPU's code generation is not exercised with barriers
left in, and it aborted the process (no message) compiling the gradient of one fuzzed plan with
them (``scripts/fuzz_plans.py`` seed 2024, case 12: a hand-split ``shard_map`` region whose
``while`` body holds the barriers). The memory benchmarks and the recompute memory test (in its
own process) use it; the test suite and the command line do not.

>>> cpu_xla_flags("")
'--xla_force_host_platform_device_count=8'
>>> cpu_xla_flags("--xla_disable_hlo_passes=foo --xla_force_host_platform_device_count=4", None,
...               keep_remat=True)
'--xla_disable_hlo_passes=foo,cse_barrier_expander --xla_force_host_platform_device_count=4'
"""

from __future__ import annotations

__all__ = ["COUNT_FLAG", "DISABLE_FLAG", "KEEP_REMAT_PASS", "cpu_xla_flags"]

COUNT_FLAG = "--xla_force_host_platform_device_count"
DISABLE_FLAG = "--xla_disable_hlo_passes"
KEEP_REMAT_PASS = "cse_barrier_expander"


def cpu_xla_flags(flags: str, devices: int | None = 8, *, keep_remat: bool = False) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) asking for ``devices`` virtual CPU devices (``None``:
    the count ``flags`` names, if any, else none asked), with ``cse_barrier_expander`` disabled
    when ``keep_remat``; other flags kept in their order, a disabled-pass list extended rather
    than repeated."""
    out, disabled = [], False
    for flag in flags.split():
        if flag.startswith(COUNT_FLAG + "=") and devices is not None:
            continue
        if keep_remat and flag.startswith(DISABLE_FLAG + "="):
            disabled = True
            if KEEP_REMAT_PASS not in flag.split("=", 1)[1].split(","):
                flag = f"{flag},{KEEP_REMAT_PASS}"
        out.append(flag)
    if devices is not None:
        out.append(f"{COUNT_FLAG}={devices}")
    if keep_remat and not disabled:
        out.append(f"{DISABLE_FLAG}={KEEP_REMAT_PASS}")
    return " ".join(out)
