"""``CostModel``: what a partition of an op costs, and what a whole plan costs.

The search prices every candidate through this one interface:

- ``op_time(op, split)``: forward + backward compute seconds of one device's part of ``op``;
- ``reshard_time(tensor, src, dst)``: forward + backward seconds to move ``tensor`` from layout
  ``src`` to ``dst`` (the cheapest collective path, :func:`nnscaler_jax.layout.comm_path`);
- ``grad_sync_time(variable, layout, split)``: seconds to reduce a weight's gradient over the
  mesh axes its consumer is split over but the weight is not (data-parallel all-reduce, or
  reduce-scatter under ZeRO >= 2);
- ``activation_bytes(op, split)``: bytes of ``op``'s outputs kept per device for the backward;
- ``variable_bytes(variable, layout)``: per-device bytes of a weight with its gradient and
  optimizer state under the ZeRO stage;
- ``plan_cost(plan, graph)``: the :class:`~nnscaler_jax.plan.plan.PlanCost` of a whole plan.

Compute is a roofline: ``max(flops / (peak x efficiency), bytes / bandwidth)``; a dot is
``2 x prod(dim sizes)`` FLOPs, other ops one FLOP per output element; backward is 2x forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from nnscaler_jax.cost.comm import (
    DEFAULT_LINK,
    MeshSpec,
    all_reduce_time,
    reduce_scatter_time,
)
from nnscaler_jax.ir.graph import Graph, Op, Role, Tensor
from nnscaler_jax.layout import Layout, comm_path
from nnscaler_jax.plan.layouts import op_layouts
from nnscaler_jax.plan.plan import VALUE, OpPlan, Plan, PlanCost

__all__ = ["CostModel", "DeviceSpec", "CPU", "itemsize", "op_flops"]


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One accelerator: peak FLOP/s per dtype class, memory bytes and bandwidth.

    Attributes:
        name: e.g. ``"H100-80G"``.
        flops: peak dense FLOP/s for 16-bit types (bf16/fp16).
        flops_fp32: peak FLOP/s for float32.
        memory_bytes: HBM capacity.
        bandwidth: HBM bytes/s.
        efficiency: fraction of peak a large matmul reaches.
    """

    name: str
    flops: float
    flops_fp32: float
    memory_bytes: int
    bandwidth: float
    efficiency: float = 0.8


CPU = DeviceSpec("cpu", flops=1e11, flops_fp32=1e11, memory_bytes=24 * 2**30,
                 bandwidth=2e10, efficiency=0.5)


def itemsize(t: Tensor) -> int:
    try:
        return np.dtype(t.dtype).itemsize
    except TypeError:
        return 8


def op_flops(op: Op) -> float:
    """Forward FLOPs of one op, unsplit."""
    if op.primitive in ("dot_general", "conv_general_dilated") and op.annotated:
        sizes = op.annotation.bind([t.shape for t in op.inputs], [t.shape for t in op.outputs])
        flops = 2.0 * math.prod(sizes.values())
        if op.primitive == "conv_general_dilated":  # window dims are not in the annotation
            rhs = op.inputs[1].shape
            spatial = op.params.get("dimension_numbers")
            if spatial is not None:
                window = math.prod(rhs[i] for i in spatial.rhs_spec[2:])
                flops *= window
        return flops
    if op.regions:
        body = sum(op_flops(o) for g in op.regions for o in g.walk())
        return body * int(op.params.get("length", 1))
    return float(sum(math.prod(t.shape) for t in op.outputs))


@dataclass(frozen=True)
class CostModel:
    """Prices ops, relayouts and plans on ``mesh`` made of ``device``s.

    Attributes:
        mesh: axis names, sizes and per-axis links.
        device: the accelerator.
        optimizer_moments: optimizer state per parameter in units of the parameter (Adam: 2).
        zero: ZeRO stage for variable memory and gradient synchronisation.
        backward_factor: backward FLOPs as a multiple of forward (2 for matmuls).
    """

    mesh: MeshSpec
    device: DeviceSpec = CPU
    optimizer_moments: int = 2
    zero: int = 0
    backward_factor: float = 2.0
    _cache: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @classmethod
    def for_axes(cls, axes: dict[str, int], **kw) -> CostModel:
        mesh = MeshSpec(tuple(axes), tuple(axes.values()), (DEFAULT_LINK,) * len(axes))
        return cls(mesh, **kw)

    def _ways(self, split: tuple[tuple[str, str], ...]) -> int:
        sizes = dict(zip(self.mesh.axis_names, self.mesh.axis_sizes, strict=True))
        return math.prod(sizes[a] for a, d in split if d != VALUE)

    def op_time(self, op: Op, split: tuple[tuple[str, str], ...]) -> float:
        """Forward + backward seconds of one device's part of ``op``."""
        key = ("op", op.id, split)
        if key not in self._cache:
            ways = self._ways(split)
            flops = op_flops(op) / ways
            fp32 = any(t.dtype == "float32" for t in op.outputs)
            peak = (self.device.flops_fp32 if fp32 else self.device.flops) * self.device.efficiency
            moved = sum(math.prod(t.shape) * itemsize(t) for t in op.inputs + op.outputs) / ways
            fwd = max(flops / peak, moved / self.device.bandwidth)
            self._cache[key] = fwd * (1.0 + self.backward_factor)
        return self._cache[key]

    def reshard_time(self, t: Tensor, src: Layout, dst: Layout) -> float:
        """Forward + backward seconds to move ``t`` from ``src`` to ``dst``."""
        if src == dst or t.ndim == 0:
            return 0.0
        return 2.0 * _path(src, dst, t.shape, itemsize(t), self.mesh)[0]

    def reshard_bytes(self, t: Tensor, src: Layout, dst: Layout) -> int:
        if src == dst or t.ndim == 0:
            return 0
        return 2 * _path(src, dst, t.shape, itemsize(t), self.mesh)[1]

    def _unsplit_axes(self, layout: Layout, split: tuple[tuple[str, str], ...]) -> list[str]:
        return [a for a, _ in split if a not in layout.split_axes and a not in layout.partial]

    def grad_sync_time(self, v: Tensor, layout: Layout, split: tuple[tuple[str, str], ...]
                       ) -> float:
        """Seconds to reduce ``v``'s gradient over the axes its consumer splits but ``v`` not."""
        n = layout.local_bytes(v.shape, itemsize(v), self.mesh) if v.ndim else itemsize(v)
        f = reduce_scatter_time if self.zero >= 2 else all_reduce_time
        return sum(f(self.mesh.link(a), self.mesh.size(a), n)
                   for a in self._unsplit_axes(layout, split))

    def grad_sync_bytes(self, v: Tensor, layout: Layout, split: tuple[tuple[str, str], ...]
                        ) -> int:
        n = layout.local_bytes(v.shape, itemsize(v), self.mesh) if v.ndim else itemsize(v)
        return n * len(self._unsplit_axes(layout, split))

    def activation_bytes(self, op: Op, split: tuple[tuple[str, str], ...]) -> int:
        """Bytes of ``op``'s outputs on one device (kept for the backward pass)."""
        ways = self._ways(split)
        return int(sum(math.prod(t.shape) * itemsize(t) for t in op.outputs) / ways)

    def variable_bytes(self, v: Tensor, layout: Layout) -> int:
        """Per-device bytes of a weight + its gradient + optimizer state under ``zero``."""
        local = layout.local_bytes(v.shape, itemsize(v), self.mesh) if v.ndim else itemsize(v)
        return int(local * (2 + self.optimizer_moments))

    def plan_cost(self, plan: Plan, graph: Graph) -> PlanCost:
        """Step time, per-device memory and communication bytes of ``plan``."""
        plans = {p.op: p for p in plan.ops}
        layout: dict[int, Layout] = {}
        for t in graph.inputs:
            spec = plan.variable_spec(t.name) if t.role is Role.VARIABLE else None
            layout[t.id] = Layout.from_pspec(spec, t.ndim) if spec else Layout.replicated(t.ndim)
        compute = comm_t = 0.0
        comm_b = act = 0
        first_use: dict[int, tuple[Layout, tuple]] = {}
        for op in graph.walk():
            p = plans.get(op.id) or OpPlan(op.id, op.primitive, op.module_path)
            ins, outs = op_layouts(op, p)
            if not op.regions:
                compute += self.op_time(op, p.split)
            for t, want in zip(op.inputs, ins, strict=True):
                if t.role is Role.VARIABLE:
                    first_use.setdefault(t.id, (want, p.split))
                have = layout.get(t.id)
                if have is not None:
                    comm_t += self.reshard_time(t, Layout(have.dims, have.partial), want)
                    comm_b += self.reshard_bytes(t, have, want)
            for t, lay in zip(op.outputs, outs, strict=True):
                layout[t.id] = lay
            act += self.activation_bytes(op, p.split)
        var_bytes = 0
        for v in graph.variables:
            var_bytes += self.variable_bytes(v, layout[v.id])
            if v.id in first_use:
                want, split = first_use[v.id]
                comm_t += self.grad_sync_time(v, want, split)
                comm_b += self.grad_sync_bytes(v, want, split)
        return PlanCost(step_time_s=compute + comm_t, memory_bytes_per_device=var_bytes + act,
                        comm_bytes=int(comm_b), compute_time_s=compute, comm_time_s=comm_t)


@lru_cache(maxsize=65536)
def _path(src: Layout, dst: Layout, shape: tuple[int, ...], size: int,
          mesh: MeshSpec) -> tuple[float, int]:
    try:
        p = comm_path(src, dst, shape, size, mesh)
    except Exception:  # noqa: BLE001 - an unreachable layout is priced as infinitely slow
        return math.inf, 0
    return p.time_s, p.bytes
