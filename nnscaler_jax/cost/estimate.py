"""First-order estimates of a plan's step time, memory and communication.

Compute: FLOPs from the annotation (a dot is 2 x the product of its dim sizes, other ops one
FLOP per output element), divided by the ways the op is split, x3 for forward + backward,
against the device's peak. Communication: the cheapest collective path
(:func:`nnscaler_jax.layout.comm_path`) from each producer's layout to each consumer's, twice
(the backward pass transposes it), plus gradient synchronisation of weights that are replicated
on an axis their consumer is split over. Memory: parameters, gradients and Adam's two moments
(sharded as stored / by ZeRO), plus every op output kept for the backward pass.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from nnscaler_jax.cost.comm import DEFAULT_LINK, MeshSpec, all_reduce_time, reduce_scatter_time
from nnscaler_jax.ir.graph import Graph, Role, Tensor
from nnscaler_jax.layout import Layout, comm_path
from nnscaler_jax.plan.layouts import op_layouts
from nnscaler_jax.plan.plan import Plan, PlanCost

__all__ = ["estimate", "op_flops"]

DEFAULT_FLOPS = 1e11  # a CPU-ish default; cluster presets arrive with the cost-model issue


def _itemsize(t: Tensor) -> int:
    try:
        return np.dtype(t.dtype).itemsize
    except TypeError:
        return 8


def op_flops(op) -> float:
    """FLOPs of one op, unsplit."""
    if op.primitive in ("dot_general", "conv_general_dilated") and op.annotated:
        anno = op.annotation
        sizes = anno.bind([t.shape for t in op.inputs], [t.shape for t in op.outputs])
        return 2.0 * math.prod(sizes.values())
    return float(sum(math.prod(t.shape) for t in op.outputs))


def estimate(plan: Plan, graph: Graph, *, mesh: MeshSpec | None = None,
             flops_per_s: float = DEFAULT_FLOPS, optimizer_moments: int = 2) -> Plan:
    """``plan`` with ``cost`` filled in."""
    axes = dict(plan.mesh)
    if mesh is None:
        mesh = MeshSpec(tuple(axes), tuple(axes.values()), (DEFAULT_LINK,) * len(axes))
    plans = {p.op: p for p in plan.ops}
    layout: dict[int, Layout] = {}
    for t in graph.inputs:
        spec = plan.variable_spec(t.name) if t.role is Role.VARIABLE else None
        layout[t.id] = Layout.from_pspec(spec, t.ndim) if spec else Layout.replicated(t.ndim)
    compute = comm_t = 0.0
    comm_b = 0
    act_bytes = 0
    grad_sync: dict[int, tuple[Tensor, Layout, object]] = {}
    for op in graph.walk():
        p = plans.get(op.id)
        ins, outs = op_layouts(op, p)
        ways = math.prod(axes[a] for a, _ in (p.split if p else ()))
        compute += 3 * op_flops(op) / ways / flops_per_s
        for t, want in zip(op.inputs, ins, strict=True):
            have = layout.get(t.id)
            if t.role is Role.VARIABLE:
                grad_sync.setdefault(t.id, (t, want, op))
            if have is None or t.ndim == 0 or have == want:
                continue
            try:
                path = comm_path(have, want, t.shape, _itemsize(t), mesh)
            except Exception:  # noqa: BLE001 - unpriceable relayouts are left out of estimates
                continue
            comm_t += 2 * path.time_s
            comm_b += 2 * path.bytes
        for t, lay in zip(op.outputs, outs, strict=True):
            layout[t.id] = lay
            act_bytes += Layout(lay.dims).local_bytes(t.shape, _itemsize(t), mesh) \
                if t.ndim else _itemsize(t)
    # Weight gradients are partial sums over axes the consumer splits but the weight does not.
    param_bytes = 0
    for t in graph.variables:
        store = layout[t.id]
        local = store.local_bytes(t.shape, _itemsize(t), mesh) if t.ndim else _itemsize(t)
        param_bytes += local
        if t.id not in grad_sync:
            continue
        _, want, consumer = grad_sync[t.id]
        for a, _dim in (plans[consumer.id].split if consumer.id in plans else ()):
            if a in want.split_axes:
                continue
            n = want.local_bytes(t.shape, _itemsize(t), mesh) if t.ndim else _itemsize(t)
            link, size = mesh.link(a), axes[a]
            f = reduce_scatter_time if plan.zero >= 2 else all_reduce_time
            comm_t += f(link, size, n)
            comm_b += n
    memory = param_bytes * (2 + optimizer_moments) + act_bytes
    cost = PlanCost(step_time_s=compute + comm_t, memory_bytes_per_device=int(memory),
                    comm_bytes=int(comm_b), compute_time_s=compute, comm_time_s=comm_t)
    return replace(plan, cost=cost)

