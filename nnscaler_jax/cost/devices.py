"""Devices and clusters as data: accelerator presets, node links, and mesh axes -> links.

Figures are public peak numbers (dense, no sparsity), per GPU:

=========  ============  =============  ===========  =========  ========
preset     bf16 FLOP/s   fp32 (TF32)    HBM          HBM B/s    NVLink*
=========  ============  =============  ===========  =========  ========
A100-40G   312 T         19.5 T (156)   40 GB        1.555 T    300 GB/s
A100-80G   312 T         19.5 T (156)   80 GB        2.039 T    300 GB/s
H100-80G   989 T         67 T (495)     80 GB        3.35 T     450 GB/s
H200       989 T         67 T (495)     141 GB       4.8 T      450 GB/s
=========  ============  =============  ===========  =========  ========

(*) per GPU, one direction. Inter-node InfiniBand per GPU port: HDR 25 GB/s, NDR 50 GB/s.
Latencies (alpha) are explicit constants below: NVLink :data:`NVLINK_LATENCY_S` (1 us),
InfiniBand :data:`IB_LATENCY_S` (2 us). A cluster maps mesh axes to links by Alpa's convention:
the minor (last) axes stay inside a node while the product of their sizes fits in a node (the
``model`` axis), the others cross nodes (``data``).

>>> c = cluster_preset("h100-80g-8x")
>>> m = c.mesh_spec(("data", "model"), (4, 8))
>>> m.link("model") == c.intra, m.link("data") == c.inter
(True, True)
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from nnscaler_jax.errors import PlanError
from nnscaler_jax.mesh.topology import LinkCost, MeshSpec

__all__ = [
    "A100_40G", "A100_80G", "CLUSTERS", "CPU", "DEVICES", "H100_80G", "H200", "IB_HDR", "IB_NDR",
    "NVLINK_A100", "NVLINK_H100", "ClusterSpec", "DeviceSpec", "cluster_preset", "device_preset",
    "local_cpu",
]

GB = 10**9
T = 10**12


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One accelerator: peak FLOP/s per dtype class, memory bytes and bandwidth.

    Attributes:
        name: e.g. ``"H100-80G"``.
        flops: peak dense FLOP/s for 16-bit types (bf16/fp16) on matrix units.
        flops_fp32: peak FLOP/s for float32 on vector units (elementwise, reductions).
        memory_bytes: HBM capacity.
        bandwidth: HBM peak bytes/s.
        efficiency: fraction of peak FLOP/s a large matmul reaches (H100: ~790/989).
        flops_tf32: float32 matmul FLOP/s (TF32 tensor cores; XLA's default precision on GPUs).
            ``None``: ``flops_fp32``.
        bandwidth_efficiency: fraction of peak bandwidth a large copy reaches (H200: ~4.3/4.8).
        kind: ``jax.Device.device_kind`` of this device, the key of profiled times.
    """

    name: str
    flops: float
    flops_fp32: float
    memory_bytes: int
    bandwidth: float
    efficiency: float = 0.8
    flops_tf32: float | None = None
    bandwidth_efficiency: float = 0.9
    kind: str = ""

    def peak(self, dtype: str, matmul: bool) -> float:
        """Peak FLOP/s for ``dtype`` (16-bit, or 32/64-bit) on matrix or vector units."""
        if dtype in ("bfloat16", "float16") or dtype.startswith(("float8", "int8")):
            return self.flops
        if dtype == "float64":
            return self.flops_fp32 / 2
        if matmul and self.flops_tf32:
            return self.flops_tf32
        return self.flops_fp32


A100_40G = DeviceSpec("A100-40G", 312 * T, 19.5 * T, 40 * GB, 1.555 * T, efficiency=0.75,
                      flops_tf32=156 * T, kind="NVIDIA A100-SXM4-40GB")
A100_80G = DeviceSpec("A100-80G", 312 * T, 19.5 * T, 80 * GB, 2.039 * T, efficiency=0.75,
                      flops_tf32=156 * T, kind="NVIDIA A100-SXM4-80GB")
H100_80G = DeviceSpec("H100-80G", 989 * T, 67 * T, 80 * GB, 3.35 * T, efficiency=0.8,
                      flops_tf32=494.7 * T, kind="NVIDIA H100 80GB HBM3")
H200 = DeviceSpec("H200", 989 * T, 67 * T, 141 * GB, 4.8 * T, efficiency=0.8,
                  flops_tf32=494.7 * T, kind="NVIDIA H200")
CPU = DeviceSpec("cpu", flops=1e11, flops_fp32=1e11, memory_bytes=24 * 2**30,
                 bandwidth=2e10, efficiency=0.5, bandwidth_efficiency=1.0, kind="cpu")
"""A nominal CPU (nothing measured); :func:`local_cpu` times this machine instead."""

DEVICES: Mapping[str, DeviceSpec] = {
    d.name.lower(): d for d in (A100_40G, A100_80G, H100_80G, H200, CPU)
}


def device_preset(name: str) -> DeviceSpec:
    """A :class:`DeviceSpec` by (case-insensitive) name: a100-40g, a100-80g, h100-80g, h200, cpu."""
    try:
        return DEVICES[name.lower()]
    except KeyError:
        raise PlanError(f"unknown device {name!r}; presets: {', '.join(DEVICES)} (or build a "
                        "DeviceSpec(name, flops, flops_fp32, memory_bytes, bandwidth))") from None


def local_cpu(n: int = 512, repeats: int = 3) -> DeviceSpec:
    """The local backend's device with FLOP/s and bandwidth timed now (a matmul and a copy).

    Efficiency is 1: the timing already is what this machine reaches.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    def best(f, *a) -> float:
        f(*a).block_until_ready()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            f(*a).block_until_ready()
            ts.append(time.perf_counter() - t0)
        return max(min(ts), 1e-9)

    x = jnp.asarray(np.random.default_rng(0).standard_normal((n, n), dtype=np.float32))
    flops = 2.0 * n**3 / best(jax.jit(lambda a: a @ a), x)
    big = jnp.zeros((1 << 24,), jnp.float32)
    bandwidth = 2.0 * big.nbytes / best(jax.jit(lambda a: a + 1.0), big)
    dev = jax.devices()[0]
    return DeviceSpec(f"local-{dev.platform}", flops=flops, flops_fp32=flops,
                      memory_bytes=CPU.memory_bytes, bandwidth=bandwidth, efficiency=1.0,
                      bandwidth_efficiency=1.0, kind=dev.device_kind)


NVLINK_LATENCY_S = 1e-6
IB_LATENCY_S = 2e-6
NVLINK_A100 = LinkCost.from_bandwidth(NVLINK_LATENCY_S, 300 * GB)
NVLINK_H100 = LinkCost.from_bandwidth(NVLINK_LATENCY_S, 450 * GB)
IB_HDR = LinkCost.from_bandwidth(IB_LATENCY_S, 25 * GB)
IB_NDR = LinkCost.from_bandwidth(IB_LATENCY_S, 50 * GB)

Placement = Literal["intra", "inter"]


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """Nodes of identical devices: a fast link inside a node, a slower one across nodes.

    Attributes:
        name: e.g. ``"h100-80g-8x"``.
        device: the accelerator.
        devices_per_node: GPUs per node.
        intra: the link between devices of one node (NVLink).
        inter: the link between nodes, per device (InfiniBand port).
    """

    name: str
    device: DeviceSpec
    devices_per_node: int
    intra: LinkCost
    inter: LinkCost

    def placement(self, axis_names: Sequence[str], axis_sizes: Sequence[int]
                  ) -> dict[str, Placement]:
        """Alpa's convention: minor axes inside a node while their product fits, others across."""
        out: dict[str, Placement] = {}
        inside, fits = 1, True
        for name, size in reversed(list(zip(axis_names, axis_sizes, strict=True))):
            inside *= int(size)
            fits = fits and inside <= self.devices_per_node
            out[name] = "intra" if fits else "inter"
        return {n: out[n] for n in axis_names}

    def mesh_spec(self, axis_names: Sequence[str], axis_sizes: Sequence[int],
                  placement: Mapping[str, Placement] | None = None) -> MeshSpec:
        """The :class:`MeshSpec` whose axes use this cluster's links.

        Args:
            axis_names / axis_sizes: the mesh, major to minor.
            placement: ``{axis: "intra" | "inter"}`` to override the convention for some axes.

        Raises:
            PlanError: unknown axis or placement in ``placement``.
        """
        names, sizes = tuple(axis_names), tuple(int(s) for s in axis_sizes)
        where = self.placement(names, sizes)
        for axis, p in (placement or {}).items():
            if axis not in where:
                raise PlanError(f"placement for unknown mesh axis {axis!r}; mesh axes {names}")
            if p not in ("intra", "inter"):
                raise PlanError(f"placement {axis}={p!r}: use 'intra' (inside a node) or "
                                "'inter' (across nodes)")
            where[axis] = p
        links = tuple(self.intra if where[n] == "intra" else self.inter for n in names)
        return MeshSpec(names, sizes, links)


CLUSTERS: Mapping[str, ClusterSpec] = {
    c.name: c for c in (
        ClusterSpec("a100-40g-8x", A100_40G, 8, NVLINK_A100, IB_HDR),
        ClusterSpec("a100-80g-8x", A100_80G, 8, NVLINK_A100, IB_HDR),
        ClusterSpec("h100-80g-8x", H100_80G, 8, NVLINK_H100, IB_NDR),
        ClusterSpec("h200-8x", H200, 8, NVLINK_H100, IB_NDR),
    )
}
"""8-GPU nodes: A100 with NVLink 3 + IB HDR; H100 / H200 with NVLink 4 + IB NDR."""


def cluster_preset(name: str) -> ClusterSpec:
    """A :class:`ClusterSpec` preset by name (see :data:`CLUSTERS`)."""
    try:
        return CLUSTERS[name.lower()]
    except KeyError:
        raise PlanError(f"unknown cluster {name!r}; presets: {', '.join(CLUSTERS)} (or build a "
                        "ClusterSpec(name, device, devices_per_node, intra, inter))") from None
