"""Compile-only GPU meshes: XLA's GPU compiler on a machine without a GPU.

``jax-cuda12-plugin`` (the ``xla-gpu`` extra: ``jax[cuda12-local]`` at jax's own version, plus
``nvidia-cuda-nvcc-cu12`` for ``ptxas``) compiles for a GPU described by a target config (XLA's
``GpuTargetConfigProto`` text: SM count, clocks, memory size) instead of one it finds.
``jax.experimental.topologies.get_topology_desc(name, "cuda", target_config=..., topology=...)``
gives devices that programs are compiled for but never run on; ``jit(f).lower(...).compile()``
over a mesh of them runs XLA's whole GPU pipeline (SPMD partitioner, collective combiners,
scheduler, buffer assignment, PTX), and ``compiled.memory_analysis()`` is the memory the program
takes on that GPU (within 0.5% of a real H100's allocator peak on the two jobs measured in
``results/bench_gpu.md``).

Every GPU preset of :mod:`nnscaler_jax.cost.devices` has a spec shipped in ``gpu_specs/``
(XLA's, edited for the 0.10 plugin's proto: see ``gpu_specs/README.md``), keyed here by
``device_kind``; ``cost.devices.compile_only_mesh("v100-32g-8x", (2, 4), ("data", "model"))``
builds a mesh of a cluster preset's GPUs.

The plugin starts only with ``JAX_PLATFORMS=cpu`` set before jax starts its backends (else it
looks for a CUDA driver, fails, and no ``cuda`` topology exists): :func:`use_cpu_platform` sets
it where no GPU driver is present (the command line calls it), leaving a machine with a GPU to
run on its GPU. No autotuning happens without a device: GEMM configurations are XLA's defaults.
"""

from __future__ import annotations

import functools
import math
import os
import re
import sys
from importlib import resources
from typing import Any

from nnscaler_jax.errors import PlanError

__all__ = ["GPU_SPECS", "SCHEDULER_FRACTION", "compile_only_devices", "gpu_spec_text",
           "slop_factor", "use_cpu_platform", "xla_gpu_missing", "xla_memory_bytes"]

GPU_SPECS: dict[str, str] = {
    "Tesla V100-SXM2-32GB": "v100_32.txtpb",
    "NVIDIA A100-SXM4-40GB": "a100_sxm_40.txtpb",
    "NVIDIA A100-SXM4-80GB": "a100_sxm_80.txtpb",
    "NVIDIA H100 80GB HBM3": "h100_sxm.txtpb",
    "NVIDIA H200": "h200_sxm.txtpb",
}
"""``jax.Device.device_kind`` (a device preset's ``kind``) -> its target config in
``gpu_specs/``."""


def _gpu_driver_present() -> bool:
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia/version")


def use_cpu_platform() -> bool:
    """Set ``JAX_PLATFORMS=cpu`` when nothing chose a platform and no GPU driver is present (the
    CUDA plugin then offers compile-only devices instead of failing to find a GPU); returns
    whether it did. Call it before jax starts its backends (jax imported or not)."""
    if "JAX_PLATFORMS" in os.environ or _gpu_driver_present():
        return False
    os.environ["JAX_PLATFORMS"] = "cpu"
    if "jax" in sys.modules:  # jax read the variable when it was imported
        sys.modules["jax"].config.update("jax_platforms", "cpu")
    return True


def xla_gpu_missing() -> str | None:
    """Why compile-only GPU devices are unavailable in this process (None: they are)."""
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        return ("jax-cuda12-plugin is not installed: pip install 'nnscaler_jax[xla-gpu]' "
                "(jax[cuda12-local] at jax's version and nvidia-cuda-nvcc-cu12)")
    try:
        _topology("Tesla V100-SXM2-32GB", 1, 1)
    except Exception as e:  # noqa: BLE001 - the plugin's own errors (no driver, bad proto)
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        if os.environ.get("JAX_PLATFORMS") != "cpu" and not _gpu_driver_present():
            return ("no GPU driver here: compile-only GPU devices need JAX_PLATFORMS=cpu set "
                    f"before jax starts ({first})")
        return f"the CUDA plugin offers no compile-only devices: {first}"
    return None


def gpu_spec_text(kind: str) -> str:
    """The target config text of the GPU whose ``device_kind`` is ``kind``.

    Raises:
        PlanError: no spec ships for it.
    """
    if kind not in GPU_SPECS:
        raise PlanError(f"no GPU target config for device kind {kind!r}: compile-only devices "
                        f"exist for {', '.join(GPU_SPECS)}")
    return resources.files("nnscaler_jax.mesh").joinpath("gpu_specs", GPU_SPECS[kind]).read_text()


@functools.cache
def xla_memory_bytes(kind: str) -> int | None:
    """The device memory XLA:GPU budgets for a GPU of ``kind`` (its target config's
    ``device_memory_size``: what CUDA reports, e.g. 31.75 GiB on a V100-32GB, where the
    cluster preset's figure is 32 GiB); None without a spec for the kind."""
    if kind not in GPU_SPECS:
        return None
    found = re.search(r"device_memory_size:\s*(\d+)", gpu_spec_text(kind))
    return int(found.group(1)) if found else None


@functools.cache
def _topology(kind: str, hosts: int, per_host: int) -> Any:
    from jax.experimental import topologies

    return topologies.get_topology_desc(
        f"{kind}-{hosts}x{per_host}", "cuda", target_config=gpu_spec_text(kind),
        topology=f"1x{hosts}x{per_host}")


def compile_only_devices(kind: str, n: int, per_host: int = 8) -> list[Any]:
    """``n`` compile-only devices of the GPU ``kind`` (``jax.Device.device_kind``), as hosts of
    ``per_host`` (one host when ``n <= per_host``).

    Raises:
        PlanError: no spec for ``kind``, the plugin is unavailable (the message says how to
            install it, and that ``JAX_PLATFORMS=cpu`` must be set first), or ``n`` is not
            whole hosts.
    """
    gpu_spec_text(kind)  # the kind's check, with its error
    why = xla_gpu_missing()
    if why is not None:
        raise PlanError(f"compile-only {kind} devices are unavailable: {why}")
    if n > per_host and n % per_host:
        raise PlanError(f"{n} compile-only devices are not whole nodes of {per_host}: use a "
                        f"multiple of {per_host}")
    hosts = max(1, n // per_host) if n > per_host else 1
    return list(_topology(kind, hosts, min(n, per_host)).devices)


SCHEDULER_FRACTION = 0.8
"""XLA:GPU's memory limit for its scheduler and rematerialization (``GetSchedulerMemoryLimit``):
80% of the device's memory (XLA's figure, :func:`xla_memory_bytes`), less the program's inputs
that no output aliases, times ``--xla_gpu_memory_limit_slop_factor`` (95%); the
rematerialization measures the temporaries and the outputs against it (measured on
compile-only V100s: a donated 1 GiB input subtracts nothing, a kept one 1 GiB). A V100-32GB
program is rematerialized by XLA above ~24 GiB, under the 28.8 GiB budget a plan gets by
default (memory less a 10% reserve), so :func:`slop_factor` tells XLA the plan's budget
instead. The rematerialization's count holds an all-gather's result twice where it lands (the
``all-gather-start``'s result buffer and the ``all-gather-done``'s, one buffer once assigned):
T5-8's step gathers its 4.2 GB logits on every device, and XLA counted 32.04 GiB where its
buffers take 27.9 GiB (compiled for an 80 GB GPU, where nothing is rematerialized). The
training step adds the plan's largest all-gather result to the budget it tells XLA
(``PlanCost.largest_gather_bytes``)."""


def slop_factor(budget: int, io_bytes: int, device_memory: int) -> int:
    """The ``xla_gpu_memory_limit_slop_factor`` (percent) that puts XLA:GPU's memory limit at
    ``budget`` or above for a program whose inputs (donated or not) take ``io_bytes`` per
    device on a GPU XLA gives ``device_memory`` bytes (at least XLA's default, 95). Which
    donated inputs XLA counts as aliased when it rematerializes is its own (T5-8's step: all
    but 4.2 of 16.2 GiB): the factor assumes none, the largest it can need when the budget is
    above XLA's 80%. With the preset's 32 GiB for a V100 where XLA has 31.75, T5-8's step was
    rematerialized at 28.62 GiB, its peak 28.77 GiB by XLA's count under a 28.8 GiB budget.

    >>> slop_factor(28 * 2**30, 9 * 2**30, 32 * 2**30)
    115
    >>> slop_factor(10 * 2**30, 1 * 2**30, 32 * 2**30)
    95
    """
    room = SCHEDULER_FRACTION * device_memory - io_bytes
    if room <= 0:
        return 95
    return max(95, math.ceil(100 * (budget - io_bytes) / room))
