"""Devices and clusters as data: accelerator presets, node links, mesh axes -> links, and the
default memory budget.

Figures are public peak numbers (dense, no sparsity), per GPU:

=========  ============  =============  ===========  =========  ========
preset     bf16 FLOP/s   fp32 (TF32)    HBM          HBM B/s    NVLink*
=========  ============  =============  ===========  =========  ========
V100-32G   125 T (fp16)  15.7 T (none)  32 GiB       0.9 T      150 GB/s
A100-40G   312 T         19.5 T (156)   40 GB        1.555 T    300 GB/s
A100-80G   312 T         19.5 T (156)   80 GB        2.039 T    300 GB/s
H100-80G   989 T         67 T (495)     80 GB        3.35 T     450 GB/s
H200       989 T         67 T (495)     141 GB       4.8 T      450 GB/s
=========  ============  =============  ===========  =========  ========

(*) per GPU, one direction. Inter-node InfiniBand per GPU port: EDR 12.5 GB/s, HDR 25 GB/s,
NDR 50 GB/s.

V100 (V100-SXM2-32GB, NVIDIA's V100 datasheet): 125 TFLOP/s on fp16 tensor cores, 15.7
TFLOP/s fp32, no TF32 (float32 matmuls run at the fp32 rate); Volta has no bf16 units, so the
16-bit figure is fp16's (a bf16 model is priced at it, faster than a V100 runs one). Memory:
32 GiB of HBM2 (four 8 GiB stacks; ``nvidia-smi`` shows 32510 MiB of the 32768) at 900 GB/s.
NVLink 2.0: six links of 25 GB/s per direction = 150 GB/s per GPU. Efficiency 0.75: cuBLAS fp16
GEMMs of 8192^3 reach ~101 of the ~112 TFLOP/s peak of a V100-PCIe, ~90% (NVIDIA developer
forum, "Understanding IPC and issue slot utilization when using tensor cores"); 0.75 leaves
room for the SXM2's clocks under sustained tensor load and for the mid-size matmuls of a
sharded model, as A100's 0.75 does. Two V100 clusters: ``v100-32g-8x`` (DGX-1-like nodes of 8,
one IB EDR 100 Gb/s port per GPU as the A100 / H100 presets have one port per GPU; a DGX-1's
cube-mesh NVLink reaches less than 150 GB/s in collectives over all 8 GPUs) and
``v100-32g-16x`` (nnScaler's artifact ran on V100-32GB nodes of 16: DGX-2-like, NVSwitch at
150 GB/s between any two GPUs of a node, eight EDR ports per 16 GPUs = 6.25 GB/s per GPU).

Latencies (alpha) are explicit constants below: NVLink :data:`NVLINK_LATENCY_S` (1 us),
InfiniBand :data:`IB_LATENCY_S` (2 us). A cluster maps mesh axes to links by Alpa's convention:
the minor (last) axes stay inside a node while the product of their sizes fits in a node (the
``model`` axis), the others cross nodes (``data``).

>>> c = cluster_preset("h100-80g-8x")
>>> m = c.mesh_spec(("data", "model"), (4, 8))
>>> m.link("model") == c.intra, m.link("data") == c.inter
(True, True)

Planning for a cluster preset or for real accelerators, the device's memory less
:data:`DEFAULT_RESERVE_FRACTION` is the memory budget unless the user gives one
(:func:`default_budget`; the planner applies it):

>>> budget = default_budget({"data": 2, "model": 4}, cluster_preset("v100-32g-8x"))
>>> budget, round(budget / 2**30, 2)
(30923764532, 28.8)
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from nnscaler_jax.errors import PlanError
from nnscaler_jax.mesh.topology import LinkCost, MeshSpec

__all__ = [
    "A100_40G", "A100_80G", "CLUSTERS", "CPU", "DEFAULT_RESERVE_FRACTION", "DEVICES",
    "H100_80G", "H200", "IB_EDR", "IB_EDR_SHARED", "IB_HDR", "IB_NDR", "NVLINK_A100",
    "NVLINK_H100", "NVLINK_V100", "PCIE_GEN3", "PCIE_GEN4", "V100_32G", "ClusterSpec",
    "DefaultBudget", "DeviceGroup", "DeviceSpec", "MixedCluster", "cluster_preset",
    "compile_only_mesh", "default_budget", "default_budget_of", "device_for_kind",
    "device_preset", "local_cpu", "memory_reserve", "mixed_cluster",
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
        launch_s: the least seconds one kernel takes (launch and scheduling): the floor of a
            small co-sharded chunk's time.
        gemm_workspace_bytes: the scratch buffer XLA:GPU gives each cuBLAS GEMM (a training
            step's peak holds one): 4 MiB on V100, where every matmul is a cuBLAS call; 0 where
            XLA emits its own Triton GEMMs by default (A100, H100, compiled without a device
            to autotune on).
        bf16_arithmetic: XLA:GPU computes bf16 elementwise arithmetic in bf16 (H100, H200);
            False: in float32 (A100, V100), and its fusions keep the residual sums and
            activations the backward reads in float32 (float16: not measured, priced as is)
            (:func:`nnscaler_jax.cost.residuals.residual_forms`).
        rebuilds_tanh: the backward rebuilds a float32 tanh from its input rather than keeping
            it (XLA:GPU, measured on V100s; XLA:CPU keeps it)
            (:func:`nnscaler_jax.cost.residuals.residual_forms`).
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
    launch_s: float = 5e-6
    gemm_workspace_bytes: int = 0
    bf16_arithmetic: bool = True
    rebuilds_tanh: bool = True

    def peak(self, dtype: str, matmul: bool) -> float:
        """Peak FLOP/s for ``dtype`` (16-bit, or 32/64-bit) on matrix or vector units."""
        if dtype in ("bfloat16", "float16") or dtype.startswith(("float8", "int8")):
            return self.flops
        if dtype == "float64":
            return self.flops_fp32 / 2
        if matmul and self.flops_tf32:
            return self.flops_tf32
        return self.flops_fp32


V100_32G = DeviceSpec("V100-32G", 125 * T, 15.7 * T, 32 * 2**30, 900 * GB, efficiency=0.75,
                      kind="Tesla V100-SXM2-32GB", gemm_workspace_bytes=4 * 2**20,
                      bf16_arithmetic=False)
A100_40G = DeviceSpec("A100-40G", 312 * T, 19.5 * T, 40 * GB, 1.555 * T, efficiency=0.75,
                      flops_tf32=156 * T, kind="NVIDIA A100-SXM4-40GB", bf16_arithmetic=False)
A100_80G = DeviceSpec("A100-80G", 312 * T, 19.5 * T, 80 * GB, 2.039 * T, efficiency=0.75,
                      flops_tf32=156 * T, kind="NVIDIA A100-SXM4-80GB", bf16_arithmetic=False)
H100_80G = DeviceSpec("H100-80G", 989 * T, 67 * T, 80 * GB, 3.35 * T, efficiency=0.8,
                      flops_tf32=494.7 * T, kind="NVIDIA H100 80GB HBM3")
H200 = DeviceSpec("H200", 989 * T, 67 * T, 141 * GB, 4.8 * T, efficiency=0.8,
                  flops_tf32=494.7 * T, kind="NVIDIA H200")
CPU = DeviceSpec("cpu", flops=1e11, flops_fp32=1e11, memory_bytes=24 * 2**30,
                 bandwidth=2e10, efficiency=0.5, bandwidth_efficiency=1.0, kind="cpu",
                 rebuilds_tanh=False)
"""A nominal CPU (nothing measured); :func:`local_cpu` times this machine instead."""

DEVICES: Mapping[str, DeviceSpec] = {
    d.name.lower(): d for d in (V100_32G, A100_40G, A100_80G, H100_80G, H200, CPU)
}


def device_preset(name: str) -> DeviceSpec:
    """A :class:`DeviceSpec` by (case-insensitive) name: v100-32g, a100-40g, a100-80g, h100-80g,
    h200, cpu."""
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
                      bandwidth_efficiency=1.0, kind=dev.device_kind,
                      rebuilds_tanh=dev.platform == "gpu")


NVLINK_LATENCY_S = 1e-6
IB_LATENCY_S = 2e-6
NVLINK_V100 = LinkCost.from_bandwidth(NVLINK_LATENCY_S, 150 * GB)
NVLINK_A100 = LinkCost.from_bandwidth(NVLINK_LATENCY_S, 300 * GB)
NVLINK_H100 = LinkCost.from_bandwidth(NVLINK_LATENCY_S, 450 * GB)
IB_EDR = LinkCost.from_bandwidth(IB_LATENCY_S, 12.5 * GB)
IB_EDR_SHARED = LinkCost.from_bandwidth(IB_LATENCY_S, 6.25 * GB)  # one EDR port per 2 GPUs (DGX-2)
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
        ClusterSpec("v100-32g-8x", V100_32G, 8, NVLINK_V100, IB_EDR),
        ClusterSpec("v100-32g-16x", V100_32G, 16, NVLINK_V100, IB_EDR_SHARED),
        ClusterSpec("a100-40g-8x", A100_40G, 8, NVLINK_A100, IB_HDR),
        ClusterSpec("a100-80g-8x", A100_80G, 8, NVLINK_A100, IB_HDR),
        ClusterSpec("h100-80g-8x", H100_80G, 8, NVLINK_H100, IB_NDR),
        ClusterSpec("h200-8x", H200, 8, NVLINK_H100, IB_NDR),
    )
}
"""8-GPU nodes: V100 with NVLink 2 + IB EDR; A100 with NVLink 3 + IB HDR; H100 / H200 with
NVLink 4 + IB NDR. ``v100-32g-16x``: 16 V100 per node (NVSwitch), 8 EDR ports per node."""


def cluster_preset(name: str) -> ClusterSpec | MixedCluster:
    """A :class:`ClusterSpec` preset by name (see :data:`CLUSTERS`), or a :class:`MixedCluster`
    of several kinds named by its groups joined with ``+`` (:func:`mixed_cluster`)."""
    if "+" in name:
        return mixed_cluster(name)
    try:
        return CLUSTERS[name.lower()]
    except KeyError:
        raise PlanError(f"unknown cluster {name!r}; presets: {', '.join(CLUSTERS)}, or groups "
                        "of several kinds joined with '+' (a100-80g-4x+v100-32g-4x); or build "
                        "a ClusterSpec(name, device, devices_per_node, intra, inter)") from None


# ---- clusters of several device kinds ----------------------------------------------------------

PCIE_LATENCY_S = 5e-6
PCIE_GEN3 = LinkCost.from_bandwidth(PCIE_LATENCY_S, 12 * GB)
"""PCIe 3.0 x16 between GPUs of one node that share no NVLink: 15.75 GB/s per direction
nominal, ~12 GB/s in peer-to-peer copies (V100-era hosts)."""
PCIE_GEN4 = LinkCost.from_bandwidth(PCIE_LATENCY_S, 24 * GB)
"""PCIe 4.0 x16: 31.5 GB/s per direction nominal, ~24 GB/s in peer-to-peer copies."""


@dataclass(frozen=True, slots=True)
class DeviceGroup:
    """Devices of one kind in a :class:`MixedCluster`: ``count`` of ``nodes.device``, linked
    inside the group as that kind's nodes are (``nodes``: its one-kind :class:`ClusterSpec`)."""

    nodes: ClusterSpec
    count: int

    @property
    def device(self) -> DeviceSpec:
        return self.nodes.device

    @property
    def name(self) -> str:
        return f"{self.device.name.lower()}-{self.count}x"


@dataclass(frozen=True, slots=True)
class MixedCluster:
    """A cluster of several device kinds: groups of one kind each, linked to each other by
    ``between`` (per device). Mesh devices are numbered group by group, in order: a mesh of
    ``devices`` puts group 0 first (the first ``groups[0].count`` devices), then group 1, ...

    >>> c = cluster_preset("a100-80g-4x+v100-32g-4x")
    >>> c.devices, [g.device.name for g in c.groups], c.between == PCIE_GEN3
    (8, ['A100-80G', 'V100-32G'], True)
    >>> c.slowest().device.name, round(c.slowest().device.memory_bytes / 2**30)
    ('V100-32G (slowest)', 32)
    """

    name: str
    groups: tuple[DeviceGroup, ...]
    between: LinkCost

    @property
    def devices(self) -> int:
        return sum(g.count for g in self.groups)

    def group_of(self, device: int) -> int:
        """The group of mesh device ``device`` (devices numbered group by group)."""
        left = device
        for k, g in enumerate(self.groups):
            if 0 <= left < g.count:
                return k
            left -= g.count
        raise PlanError(f"device {device} is not in cluster {self.name} "
                        f"({self.devices} devices)")

    def budgets(self, budget: float | None = None) -> list[float]:
        """Each group's memory budget per device: ``budget`` (the user's, for every device),
        else its device's memory less the reserve (:func:`memory_reserve`)."""
        return [float(budget) if budget is not None else
                float(g.device.memory_bytes - memory_reserve(g.device.memory_bytes))
                for g in self.groups]

    def kinds(self) -> list[str]:
        """Each device's kind (its preset's name), in the cluster's numbering: the labels of
        devices that do not say their kind themselves (virtual CPU devices in tests).

        >>> cluster_preset("a100-80g-2x+v100-32g-2x").kinds()
        ['A100-80G', 'A100-80G', 'V100-32G', 'V100-32G']
        """
        return [g.device.name for g in self.groups for _ in range(g.count)]

    def slowest(self) -> ClusterSpec:
        """The one-kind cluster a heterogeneity-unaware planner sees: every device priced as the
        slowest kind's (its 16-bit peak) with the smallest memory, linked by the slower of its
        links (inside the groups: the slowest group's; across nodes: ``between`` where slower).
        """
        slow = min(self.groups, key=lambda g: g.device.flops * g.device.efficiency)
        memory = min(g.device.memory_bytes for g in self.groups)
        device = DeviceSpec(**{**{f: getattr(slow.device, f) for f in DeviceSpec.__slots__},
                               "memory_bytes": memory, "name": f"{slow.device.name} (slowest)"})
        inter = max((slow.nodes.inter, self.between), key=lambda ln: ln.beta_s_per_byte)
        return ClusterSpec(f"{self.name} as {slow.device.name.lower()}", device,
                           min(g.nodes.devices_per_node for g in self.groups), slow.nodes.intra,
                           inter)


def mixed_cluster(name: str) -> MixedCluster:
    """The :class:`MixedCluster` named by its groups, ``<device>-<n>x`` joined with ``+``
    (``a100-80g-4x+v100-32g-4x``, ``h100-80g-8x+a100-80g-8x``): ``n`` devices of each device
    preset (:data:`DEVICES`), linked inside a group as that kind's preset nodes
    (:data:`CLUSTERS`). Groups that fit one node together (8 devices in all at most) share it
    over PCIe (3.0 where a V100 is among them, else 4.0): NVLink islands of one kind; otherwise
    each group is its own nodes, linked over InfiniBand (the slowest group's ports).

    Raises:
        PlanError: a group that is not ``<device preset>-<n>x``, a kind in two groups, more
            than 4096 devices in a group, or a single group.
    """
    parts = [p.strip().lower() for p in name.split("+")]
    groups = []
    for p in parts:
        m = re.fullmatch(r"(.+)-(\d+)x", p)
        device = DEVICES.get(m.group(1)) if m else None
        if device is None or device is CPU or int(m.group(2)) < 1:
            raise PlanError(f"cluster {name!r}: group {p!r} is not <device>-<n>x with a GPU "
                            f"preset ({', '.join(d for d in DEVICES if d != 'cpu')}), e.g. "
                            "a100-80g-4x+v100-32g-4x")
        if int(m.group(2)) > 4096 or any(g.device is device for g in groups):
            raise PlanError(f"cluster {name!r}: group {p!r} "
                            + ("repeats a kind: give each kind one group, its devices "
                               "counted together" if int(m.group(2)) <= 4096 else
                               "has more than 4096 devices"))
        nodes = next(c for c in CLUSTERS.values() if c.device is device)
        groups.append(DeviceGroup(nodes, int(m.group(2))))
    if len(groups) < 2:
        raise PlanError(f"cluster {name!r}: one group; name a one-kind cluster by its preset "
                        f"({', '.join(CLUSTERS)}) or join groups of several kinds with '+'")
    total = sum(g.count for g in groups)
    if total <= min(g.nodes.devices_per_node for g in groups):
        between = PCIE_GEN3 if any(g.device is V100_32G for g in groups) else PCIE_GEN4
    else:
        between = max((g.nodes.inter for g in groups), key=lambda ln: ln.beta_s_per_byte)
    return MixedCluster("+".join(parts), tuple(groups), between)


def compile_only_mesh(cluster: ClusterSpec | DeviceSpec | str, shape: Sequence[int],
                      axes: Sequence[str]) -> object:
    """A ``jax.sharding.Mesh`` of compile-only GPUs (:mod:`nnscaler_jax.mesh.gpu`) of a cluster
    preset (``"v100-32g-8x"``), a :class:`ClusterSpec` or a GPU :class:`DeviceSpec` / device
    preset name, shaped ``shape`` with axis names ``axes`` (Auto axis types).

    Programs over it compile for that GPU (``jit(f).lower(...).compile()``) but never run.
    Planning on it prices with the preset of its ``device_kind`` and budgets that device's
    memory (:func:`default_budget`).

    Raises:
        PlanError: not a GPU preset, the CUDA plugin unavailable (the message says how to get
            it), or a shape that does not match ``axes``.
    """
    import math

    import jax
    import numpy as np

    from nnscaler_jax.mesh.gpu import compile_only_devices

    per_host = 8
    if isinstance(cluster, str):
        cluster = (CLUSTERS[cluster.lower()] if cluster.lower() in CLUSTERS
                   else device_preset(cluster))
    if isinstance(cluster, ClusterSpec):
        per_host, cluster = cluster.devices_per_node, cluster.device
    shape, axes = tuple(int(s) for s in shape), tuple(axes)
    if len(shape) != len(axes):
        raise PlanError(f"mesh shape {shape} and axis names {axes} differ in length")
    devices = compile_only_devices(cluster.kind, math.prod(shape), per_host)
    return jax.sharding.Mesh(np.asarray(devices, dtype=object).reshape(shape), axes)


# ---- the default memory budget -----------------------------------------------------------------

DEFAULT_RESERVE_FRACTION = 0.1
"""Share of a device's memory kept out of the default budget: what a training step needs beyond
the plan's estimate (parameters, gradients, optimizer state, activations, the largest transient).
It covers the CUDA context and library handles (cuBLAS / cuDNN, a few hundred MiB), NCCL's
communicator buffers (``NCCL_BUFFSIZE`` 4 MiB per channel and peer), XLA's scratch (GEMM
workspaces, autotuning), the allocator's fragmentation, and some of the estimate's own error
(it models what XLA keeps, not XLA's buffer assignment). 10% is vLLM's default too
(``gpu_memory_utilization=0.9``). V100-32G: 3.2 GiB of 32 GiB; A100-80G: 8 GB of 80 GB.
A user's ``Constraints(max_memory_per_device=...)`` replaces the default, reserve included."""


def memory_reserve(memory_bytes: int) -> int:
    """Bytes of ``memory_bytes`` left out of the default budget (:data:`DEFAULT_RESERVE_FRACTION`).

    >>> round(memory_reserve(32 * 2**30) / 2**30, 3)
    3.2
    """
    return int(memory_bytes * DEFAULT_RESERVE_FRACTION)


@dataclass(frozen=True, slots=True)
class DefaultBudget:
    """The memory budget a device implies when the user gives none.

    Attributes:
        device: the device's name (a preset's, or ``jax.Device.device_kind``).
        memory_bytes: its memory (real devices: the allocator's ``bytes_limit`` when reported).
        reserve_bytes: the part kept back (:func:`memory_reserve`).
        source: where the device came from (``"the cost model's device"``, ``"the mesh's
            devices"``).
    """

    device: str
    memory_bytes: int
    reserve_bytes: int
    source: str

    @property
    def bytes(self) -> int:
        """The budget: memory less the reserve."""
        return self.memory_bytes - self.reserve_bytes

    def short(self) -> str:
        """``'28.80 GiB: V100-32G's 32.00 GiB less a 10% reserve'``."""
        g = 2**30
        return (f"{self.bytes / g:.2f} GiB: {self.device}'s {self.memory_bytes / g:.2f} GiB less "
                f"a {DEFAULT_RESERVE_FRACTION:.0%} reserve")

    def describe(self) -> str:
        """One sentence naming the device, its memory, the reserve and how to override it."""
        g = 2**30
        return (f"the memory budget {self.bytes / g:.2f} GiB per device is the default for "
                f"{self.device} ({self.source}): {self.memory_bytes / g:.2f} GiB of memory less "
                f"a {self.reserve_bytes / g:.2f} GiB reserve "
                f"({DEFAULT_RESERVE_FRACTION:.0%}) for XLA's workspace and the runtime; give "
                "Constraints(max_memory_per_device=...) (command line: --budget) to set another")


def device_for_kind(kind: str) -> DeviceSpec | None:
    """The preset whose ``kind`` is ``jax.Device.device_kind`` ``kind`` (case-insensitive), if any.

    >>> device_for_kind("Tesla V100-SXM2-32GB").name
    'V100-32G'
    """
    for d in DEVICES.values():
        if d.kind and d.kind.lower() == kind.lower() and d is not CPU:
            return d
    return None


def _has_memory(device: DeviceSpec) -> bool:
    """Whether ``device``'s memory is a real limit (not the nominal CPU's or a timed local
    backend's, which borrow :data:`CPU`'s figure)."""
    return device.kind != "cpu" and device.name != CPU.name and not device.name.startswith("local-")


def _mesh_budget(mesh: object) -> DefaultBudget | None:
    """The budget of a ``jax.sharding.Mesh`` over accelerators (None: CPU, abstract, a dict)."""
    try:
        dev = mesh.devices.flat[0]  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - AbstractMesh raises ValueError; a dict has no devices
        return None
    if getattr(dev, "platform", "cpu") == "cpu":
        return None
    kind = str(getattr(dev, "device_kind", ""))
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        stats = {}
    memory = stats.get("bytes_limit")
    if memory:  # what XLA's allocator may hand out (XLA_PYTHON_CLIENT_MEM_FRACTION applied)
        return DefaultBudget(kind, int(memory), memory_reserve(int(memory)),
                             "the mesh's devices, the allocator's bytes_limit")
    preset = device_for_kind(kind)
    if preset is None:
        return None
    return DefaultBudget(preset.name, preset.memory_bytes, memory_reserve(preset.memory_bytes),
                         f"the mesh's devices, {kind!r}")


def default_budget_of(mesh: object, cost_model: object | None = None) -> DefaultBudget | None:
    """The default memory budget and where it comes from (see :func:`default_budget`)."""
    device = getattr(cost_model, "device", cost_model)
    if isinstance(device, DeviceSpec) and _has_memory(device):
        return DefaultBudget(device.name, device.memory_bytes, memory_reserve(device.memory_bytes),
                             "the cost model's device")
    return _mesh_budget(mesh)


def default_budget(mesh: object, cost_model: object | None = None) -> int | None:
    """Bytes per device a plan may use when the user sets no ``max_memory_per_device``.

    The device's memory less :func:`memory_reserve`, for:

    - a cost model (or a :class:`ClusterSpec` / :class:`DeviceSpec`) whose device has a known
      memory: a preset, ``CostModel.for_cluster``, a ``DeviceSpec`` of one's own;
    - else a ``jax.sharding.Mesh`` over accelerators (GPU, TPU): the memory XLA's allocator
      reports (``memory_stats()["bytes_limit"]``, which honours
      ``XLA_PYTHON_CLIENT_MEM_FRACTION``), or the preset of its ``device_kind``.

    None (no budget) for CPU meshes, abstract meshes and ``{axis: size}`` without such a cost
    model, and for the nominal / timed CPU devices (:data:`CPU`, :func:`local_cpu`).
    A preset's memory is the card's: run with ``XLA_PYTHON_CLIENT_MEM_FRACTION=.95`` (JAX
    preallocates 75% by default) for the plan to have it.

    >>> default_budget({"data": 8}) is None
    True
    >>> default_budget({"data": 8}, H100_80G) == 72 * GB
    True
    """
    b = default_budget_of(mesh, cost_model)
    return None if b is None else b.bytes
