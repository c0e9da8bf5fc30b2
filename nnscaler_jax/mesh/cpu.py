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

``gpu_fusion=True`` leaves reductions and elementwise ops to XLA's own loop fusion, as on a
GPU, for measuring memory against the cost model: by default XLA:CPU hands reductions and some
elementwise chains to YNNPACK library fusions, which read every input materialised, so a
broadcast that a GPU fusion recomputes in place (a LayerNorm's scale, its ``1/std``) is written
out and kept from the forward to the backward. Measured with jax 0.10.2, the reduced-size Swin
(64 px) on a 2x4 mesh: XLA temp 2.79 MB by default, 1.72 MB with library fusion limited to dots
(``--xla_cpu_experimental_ynn_fusion_type=dot``; a dot stays a library call, as cuBLAS on a GPU
reads materialised operands).

>>> cpu_xla_flags("")
'--xla_force_host_platform_device_count=8'
>>> cpu_xla_flags("--xla_disable_hlo_passes=foo --xla_force_host_platform_device_count=4", None,
...               keep_remat=True)
'--xla_disable_hlo_passes=foo,cse_barrier_expander --xla_force_host_platform_device_count=4'
>>> cpu_xla_flags("", gpu_fusion=True)
'--xla_cpu_experimental_ynn_fusion_type=dot --xla_force_host_platform_device_count=8'
>>> cpu_xla_flags("--xla_cpu_experimental_ynn_fusion_type=dot,reduce", 2, gpu_fusion=True)
'--xla_cpu_experimental_ynn_fusion_type=dot,reduce --xla_force_host_platform_device_count=2'
"""

from __future__ import annotations

__all__ = ["COUNT_FLAG", "DISABLE_FLAG", "KEEP_REMAT_PASS", "LIBRARY_FUSION_FLAG", "cpu_xla_flags"]

COUNT_FLAG = "--xla_force_host_platform_device_count"
DISABLE_FLAG = "--xla_disable_hlo_passes"
KEEP_REMAT_PASS = "cse_barrier_expander"
LIBRARY_FUSION_FLAG = "--xla_cpu_experimental_ynn_fusion_type"


def cpu_xla_flags(flags: str, devices: int | None = 8, *, keep_remat: bool = False,
                  gpu_fusion: bool = False) -> str:
    """``flags`` (an ``XLA_FLAGS`` value) asking for ``devices`` virtual CPU devices (``None``:
    the count ``flags`` names, if any, else none asked), with ``cse_barrier_expander`` disabled
    when ``keep_remat`` and library fusion limited to dots when ``gpu_fusion`` (unless ``flags``
    sets it); other flags kept in their order, a disabled-pass list extended rather than
    repeated."""
    out, disabled = [], False
    if gpu_fusion and not any(f.startswith(LIBRARY_FUSION_FLAG + "=") for f in flags.split()):
        out.append(f"{LIBRARY_FUSION_FLAG}=dot")
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
