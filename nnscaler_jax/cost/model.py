"""``CostModel``: what a partition of an op costs, and what a whole plan costs.

The search prices every candidate through this one interface:

- ``op_time(op, split)``: forward + backward compute seconds of one device's part of ``op``
  (:mod:`nnscaler_jax.cost.compute`; a profiled time when the model has a ``profile``);
- ``reshard_time(tensor, src, dst)``: forward + backward seconds to move ``tensor`` from layout
  ``src`` to ``dst`` (the cheapest collective path, :func:`nnscaler_jax.layout.comm_path`); the
  backward moves the gradient back from ``dst`` to ``src`` (partial sums dropped: the gradient of
  an all-reduced value is already replicated);
- ``grad_sync_time(tensor, layout, split)``: seconds to reduce the gradient of an operand that
  its consumer splits over mesh axes the operand is replicated on (each device then holds a
  partial sum of the gradient): the cheapest collective path from those partial sums, as
  ``plan_cost`` takes it. For a weight that is the data-parallel all-reduce (ZeRO-3:
  reduce-scatter to its shard); for an activation the backward all-reduce of Megatron's ``f``
  operator. Call it for every operand that needs a gradient;
- ``activation_bytes(op, split)``: bytes of ``op``'s outputs kept per device for the backward;
- ``variable_bytes(variable, layout)``: per-device bytes of a weight with its gradient and
  optimizer state under the ZeRO stage;
- ``plan_cost(plan, graph)``: the :class:`~nnscaler_jax.plan.plan.PlanCost` of a whole plan, and
  ``memory_breakdown(plan, graph)`` its memory by kind.

``plan_cost`` walks the graph once (:mod:`nnscaler_jax.cost.plan_walk`): every edge (tensor ->
consumer) costs the forward path from the tensor's layout to the layout its consumer needs plus, for
tensors that need a gradient (computed from trainable variables; example inputs only with
``input_grads``), the backward path of the gradient (reduced once per tensor and gradient layout).
Weights start from their storage layout, so data parallelism costs one all-reduce per weight and
ZeRO-3 an all-gather in the forward and a reduce-scatter of the gradient (2 Psi, like DP's
all-reduce): XLA keeps the gathered weight for the backward rather than gathering it again
(DeepSpeed's 3 Psi), so the gathered weights count as kept activations.

Memory per device for a training step (ZeRO as in DeepSpeed, over each weight's data-parallel
axes: the mesh axes its consumers split while it is replicated on them)::

    params + optimizer state + activations kept for backward + transient + gradients held

(gradients held: a weight's gradient is freed by its elementwise optimizer update as soon as it
is complete, so only those built up over the backward count: several contributions, a loop,
micro-batches; :meth:`CostModel.held_gradients`)

(transient: the largest op output, or — when that makes the larger peak — the buffer of local
weight gradients XLA reduces across devices in one combined collective at the end of the
backward, when the kept activations are already freed: activations + transient =
max(activations + largest output, reduction buffer)).

With ``param_bytes=2, grad_bytes=2, optimizer_bytes=12`` (bf16 weights, fp32 master + Adam moments)
and ``Psi`` parameters on ``N`` data-parallel devices this is DeepSpeed's table: DP ``16 Psi``,
ZeRO-1 ``4 Psi + 12 Psi / N``, ZeRO-2 ``2 Psi + 14 Psi / N``, ZeRO-3 ``16 Psi / N``.
Activations: the forward values the backward reads, after XLA's fusion
(:mod:`nnscaler_jax.cost.residuals`: what each primitive's transpose needs, traced back through
cheap elementwise and layout ops to the values XLA materialises), except inside remat
(``checkpoint``) boundaries, which keep only their inputs and recompute the rest (one more forward
of those ops in the compute time; the largest such block is transient during the backward). Ops
inside a ``scan`` body count ``length`` times (compute, communication and kept activations).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from nnscaler_jax.cost.compute import (
    FREE,
    MATMUL,
    MATRIX,
    TRAINABLE,
    compute_dtype,
    is_float,
    is_reduction,
    itemsize,
    needs_grad_locally,
    op_bytes,
    op_flops,
    region_length,
    ring_cost,
    walk_weighted,
)
from nnscaler_jax.cost.devices import CPU, ClusterSpec, DeviceSpec
from nnscaler_jax.cost.plan_walk import analyze
from nnscaler_jax.cost.profile import ProfileDB
from nnscaler_jax.cost.relayout import (
    Split,
    drop_partial,
    partial_grad_axes,
    relayout_price,
    storage_layout,
)
from nnscaler_jax.cost.residuals import accumulated_gradients, combines_all_reductions
from nnscaler_jax.ir.attention import FUSED
from nnscaler_jax.ir.graph import Graph, Op, Role, Tensor
from nnscaler_jax.layout import Layout
from nnscaler_jax.layout.rvd import interned
from nnscaler_jax.mesh.topology import DEFAULT_LINK, LinkCost, MeshSpec
from nnscaler_jax.plan.layouts import op_layouts
from nnscaler_jax.plan.plan import VALUE, OpPlan, Plan, PlanCost

__all__ = ["ATTENTION_BACKWARD", "ATTENTION_KERNEL_EFFICIENCY", "CPU", "CostModel", "DeviceSpec", "itemsize", "op_flops"]

#: A fused attention's backward over its forward: flash attention recomputes the scores and
#: runs five matmuls (scores, dP, dV, dQ, dK) against the forward's two.
ATTENTION_BACKWARD = 2.5
#: The fraction of the matrix units' peak a fused (flash) attention kernel reaches: FlashAttention-2
#: reports up to 335 TFLOP/s on an H100 (0.34 of its 989); Pallas' Triton kernel is of that kind.
#: Not measured here (no GPU): the one figure of the fused op's price taken on trust.
ATTENTION_KERNEL_EFFICIENCY = 0.34



@dataclass(frozen=True)
class CostModel:
    """Prices ops, relayouts and plans on ``mesh`` made of ``device``s.

    Attributes:
        mesh: axis names, sizes and per-axis links.
        device: the accelerator.
        optimizer_moments: optimizer state per parameter in units of the parameter (Adam: 2).
        zero: ZeRO stage (0-3) for variable memory and gradient synchronisation (``plan_cost``
            uses the larger of this and the plan's own).
        backward_factor: backward FLOPs of a matmul as a multiple of forward when both operands
            need a gradient (2); one operand: half of it.
        elementwise_backward_factor: the same for every other op (~1: memory bound).
        param_bytes / grad_bytes: bytes per parameter / gradient element (None: the variable's
            dtype; bf16 mixed precision: 2 and 2).
        optimizer_bytes: optimizer state bytes per parameter (None: ``optimizer_moments`` x the
            dtype size, + 4 with ``master_weights``; mixed-precision Adam: 12).
        master_weights: an fp32 master copy of the weights is part of the optimizer state.
        input_grads: example inputs need gradients too (a model that is a block of a larger one).
        profile: measured op times preferred over the roofline (for ``device.kind``).
        grads_held: every weight's gradient stays live to the end of the backward (an
            optimizer that reads all gradients at once: global-norm clipping). By default a
            gradient is freed by its weight's elementwise update as soon as it is complete
            (:func:`~nnscaler_jax.cost.residuals.accumulated_gradients`), unless it gets
            several contributions or accumulates over micro-batches.
        microbatches: SPMD gradient accumulation: the batch runs as this many micro-batches, so
            the activations kept and the transients are one micro-batch's (``1 / m``); compute
            and activations' relayouts are priced for the whole batch (the same FLOPs and
            bytes; the extra latency of m smaller collectives and small-shape efficiency are not
            priced); weights' relayouts from storage and gradient reductions run once per
            micro-batch (``m`` times the bytes, as XLA runs the step's loop).
            ``plan_cost`` uses the larger of this and the plan's own.
    """

    mesh: MeshSpec
    device: DeviceSpec = CPU
    optimizer_moments: int = 2
    zero: int = 0
    backward_factor: float = 2.0
    elementwise_backward_factor: float = 1.0
    param_bytes: float | None = None
    grad_bytes: float | None = None
    optimizer_bytes: float | None = None
    master_weights: bool = False
    input_grads: bool = False
    grads_held: bool = False
    microbatches: int = 1
    profile: ProfileDB | None = field(default=None, compare=False, hash=False)
    # memoised prices (op times, split ways, per-layout block bytes); not an __init__ argument,
    # so a dataclasses.replace copy (another mesh, micro-batch count) starts with its own
    _cache: dict = field(default_factory=dict, init=False, compare=False, hash=False,
                         repr=False)

    @classmethod
    def for_axes(cls, axes: Mapping[str, int], *,
                 links: LinkCost | Mapping[str, LinkCost] | None = None, **kw) -> CostModel:
        """A model for mesh axes ``{name: size}`` (links: one for all, per axis, or default)."""
        if isinstance(links, LinkCost):
            per_axis = (links,) * len(axes)
        else:
            per_axis = tuple((links or {}).get(a, DEFAULT_LINK) for a in axes)
        return cls(MeshSpec(tuple(axes), tuple(axes.values()), per_axis), **kw)

    @classmethod
    def for_cluster(cls, cluster: ClusterSpec, axes: Mapping[str, int], *,
                    placement: Mapping[str, str] | None = None, **kw) -> CostModel:
        """A model for mesh axes ``{name: size}`` laid on ``cluster``'s nodes (see
        :meth:`ClusterSpec.mesh_spec`); the device is the cluster's unless given."""
        kw.setdefault("device", cluster.device)
        return cls(cluster.mesh_spec(tuple(axes), tuple(axes.values()), placement), **kw)

    # ---- compute -------------------------------------------------------------------------------

    def _ways(self, split: Split) -> int:
        out = self._cache.get(("ways", split))
        if out is None:
            sizes = dict(zip(self.mesh.axis_names, self.mesh.axis_sizes, strict=True))
            out = self._cache["ways", split] = math.prod(sizes[a] for a, d in split
                                                         if d != VALUE)
        return out

    def _profiled(self, op: Op, split: Split, ways: int) -> float | None:
        kind = self.device.kind
        try:
            ins, outs = op_layouts(op, OpPlan(op.id, op.primitive, op.module_path, split))
            local_in = tuple(lay.local_shape(t.shape, self.mesh)
                             for lay, t in zip(ins, op.inputs, strict=True))
            local_out = tuple(lay.local_shape(t.shape, self.mesh)
                              for lay, t in zip(outs, op.outputs, strict=True))
        except Exception:  # noqa: BLE001 - an indivisible split: scale the unsplit time
            local_in = local_out = None
        if local_in is not None:
            t = self.profile.lookup_op(op, kind, local_in, local_out)
            if t is not None:
                return t
        t = self.profile.lookup_op(op, kind)
        return None if t is None else t / ways

    def forward_time(self, op: Op, split: Split = (),
                     traffic: Mapping[int, float] | None = None) -> float:
        """Forward seconds of one device's part of ``op`` (region ops: their bodies).

        ``traffic``: op id -> the bytes its fusion reads and writes
        (:func:`~nnscaler_jax.cost.fusion.fused_bytes` of the graph); without it, or for an op it
        does not hold, every operand and result is read or written once (no fusion)."""
        ways = self._ways(split)
        if op.regions:
            body = sum(self.forward_time(o, (), traffic) * m for g in op.regions
                       for o, m in walk_weighted(g) if not o.regions)
            return body * region_length(op) / ways
        if self.profile is not None and self.device.kind:
            t = self._profiled(op, split, ways)
            if t is not None:
                return t
        peak = self.device.peak(compute_dtype(op), op.primitive in MATRIX) * (
            ATTENTION_KERNEL_EFFICIENCY if op.primitive == FUSED else self.device.efficiency)
        bandwidth = self.device.bandwidth * self.device.bandwidth_efficiency
        io = op_bytes(op) if traffic is None else traffic.get(op.id, op_bytes(op))
        return max(op_flops(op) / peak, io / bandwidth) / ways

    def chunk_overhead(self, op: Op, split: Split, k: int,
                       traffic: Mapping[int, float] | None = None) -> float:
        """Extra seconds of running ``op`` as ``k`` sequential chunks (a co-sharded block):
        a matmul's or reduction's 3k kernels (forward, recomputed forward, backward) cost at
        least the device's launch floor each, so small chunks are priced by the floor, not the
        roofline (elementwise ops fuse into them)."""
        if op.primitive not in MATMUL and not is_reduction(op):
            return 0.0
        per = self.forward_time(op, split, traffic) / k
        return 3 * k * max(0.0, self.device.launch_s - per)

    def _backward_ratio(self, op: Op, grads: tuple[bool, ...]) -> float:
        if not any(grads):
            return 0.0
        if op.primitive == FUSED:  # flash attention's backward: five matmuls to two
            return ATTENTION_BACKWARD
        if op.primitive in MATMUL:
            return self.backward_factor * sum(grads) / max(len(grads), 1)
        return self.elementwise_backward_factor

    def _op_time(self, op: Op, split: Split, grads: tuple[bool, ...],
                 traffic: Mapping[int, float] | None = None) -> float:
        io = None if traffic is None else traffic.get(op.id)
        key = ("op", op.id, op.primitive, tuple(t.shape for t in op.inputs), split, grads, io,
               op.params.get("ring_layout") if op.primitive == FUSED else None)
        if key not in self._cache:
            if op.regions:
                t = sum(self.op_time(o, (), None, traffic) * m for g in op.regions
                        for o, m in walk_weighted(g) if not o.regions
                        ) * region_length(op) / self._ways(split)
            elif op.primitive == FUSED and any(name == "s" for _, name in split):
                t = self._ring_time(op, split, grads, traffic)
            else:
                t = self.forward_time(op, split, traffic) * (1.0 + self._backward_ratio(op, grads))
            self._cache[key] = t
        return self._cache[key]

    def ring_layout(self, op: Op, split: Split, grads: tuple[bool, ...] | None = None) -> str:
        """How fused attention ``op`` split on its sequence (``split``) runs: the layout its
        params force (``Constraints(attention="ring" | "zigzag")``, or a plan's record), else
        the cheaper of ``"ring"`` and, for a causal mask whose blocks halve, ``"zigzag"``
        (its balanced work against its exchanges in and out)."""
        forced = op.params.get("ring_layout")
        if forced:
            return forced
        n = math.prod(self.mesh.size(a) for a, name in split if name == "s")
        if not op.params.get("causal") or op.dim_sizes()["s"] % (2 * n):
            return "ring"
        if grads is None:
            grads = tuple(needs_grad_locally(t, self.input_grads) for t in op.inputs)
        return min(("zigzag", "ring"), key=lambda lay: self._ring_time(op, split, grads, None,
                                                                       lay))

    def _ring_time(self, op: Op, split: Split, grads: tuple[bool, ...],
                   traffic: Mapping[int, float] | None, layout: str | None = None) -> float:
        """Forward + backward seconds of a fused attention op split ``n`` ways on its sequence
        (ring attention, :mod:`nnscaler_jax.lower.ring`): the busiest device's blocks (a causal
        ring's last device computes as much as without the mask; zigzag about half, see
        :func:`~nnscaler_jax.lower.ring.ring_cost`), each ring step's K / V transfer
        overlapping its block (the forward takes the longer of the two; the backward likewise,
        with the float32 K / V gradients travelling too), zigzag's exchanges in and out added."""
        axes = tuple(a for a, name in split if name == "s")
        n = math.prod(self.mesh.size(a) for a in axes)
        causal = bool(op.params.get("causal"))
        layout = layout or self.ring_layout(op, split, grads)
        seq = op.dim_sizes()["s"]
        busiest = ring_cost(seq, 1, 1, 1, n, 1, causal, layout=layout)["flops"]
        priced = 4 * seq * seq / n / (2 if causal else 1)  # what forward_time's FLOPs assume
        forward = self.forward_time(op, split, traffic) * busiest / priced
        backward = forward * self._backward_ratio(op, grads)
        link = self.mesh.link(axes)
        names = [[ax.dims[0].name for ax in o.axes] for o in op.annotation.inputs]
        split_of = dict(split)

        def local(t: Tensor, names: list[str]) -> float:
            ways = math.prod(self.mesh.size(a) for a, name in split_of.items() if name in names)
            return t.nbytes / ways

        q, k, v = (local(t, nm) for t, nm in zip(op.inputs, names, strict=True))
        o = local(op.outputs[0], names[0])  # split as q (its batch, heads and sequence)
        hop = lambda b: link.alpha_s + b * link.beta_s_per_byte
        rotate = (n - 1) * (hop(k) + hop(v))
        exchange = 2 * (hop(q / 2) + hop(k / 2) + hop(v / 2) + hop(o / 2)) \
            if layout == "zigzag" else 0.0
        t = max(forward, rotate) + exchange
        if backward:
            f32 = 4 / itemsize(op.inputs[1])  # the K / V gradients travel in float32
            t += max(backward, rotate + n * (hop(k * f32) + hop(v * f32))) + exchange
        return t

    def op_time(self, op: Op, split: Split = (), grads: tuple[bool, ...] | None = None,
                traffic: Mapping[int, float] | None = None) -> float:
        """Forward + backward seconds of one device's part of ``op``.

        ``grads``: which operands need a gradient (``plan_cost`` and the search know it from
        :func:`~nnscaler_jax.cost.compute.grad_tensors`); default a local guess (floating
        point, not a constant, not an example input unless ``input_grads``). ``traffic``: as
        for :meth:`forward_time`.
        """
        if grads is None:
            grads = tuple(needs_grad_locally(t, self.input_grads) for t in op.inputs)
        return self._op_time(op, split, grads, traffic)

    # ---- communication -------------------------------------------------------------------------

    def _needs_grad(self, t: Tensor) -> bool:
        return needs_grad_locally(t, self.input_grads) and t.collection in TRAINABLE

    def reshard_time(self, t: Tensor, src: Layout, dst: Layout, grad: Layout | None = None,
                     backward: bool | None = None) -> float:
        """Forward + backward seconds to move ``t`` from ``src`` to ``dst``.

        The backward moves the gradient from ``grad`` (default ``dst`` without partial sums;
        a consumer splitting ``t`` over axes it reads it replicated on hands back partial sums
        over those axes, see :meth:`grad_sync_time`) to ``src`` without partial sums.
        ``backward``: whether ``t`` gets a gradient this way (False also when another read of
        ``t`` pays it); default a local guess as :meth:`op_time`'s.
        """
        if t.ndim == 0 or (src == dst and grad is None):
            return 0.0
        out = relayout_price(src, dst, t.shape, itemsize(t), self.mesh)[0] if src != dst else 0.0
        if self._needs_grad(t) if backward is None else backward:
            out += relayout_price(drop_partial(dst) if grad is None else grad, drop_partial(src),
                         t.shape, itemsize(t), self.mesh)[0]
        return out

    def _sync_axes(self, layout: Layout, split: Split) -> list[str]:
        return list(partial_grad_axes(layout, split))

    def _local_bytes(self, t: Tensor, layout: Layout) -> int:
        key = ("bytes", t.shape, t.dtype, layout)
        out = self._cache.get(key)
        if out is None:
            out = self._cache[key] = self._block_bytes(t, layout)
        return out

    def _block_bytes(self, t: Tensor, layout: Layout) -> int:
        if t.ndim == 0:
            return itemsize(t)
        try:
            return layout.local_bytes(t.shape, itemsize(t), self.mesh)
        except Exception:  # noqa: BLE001 - an indivisible layout: the even share
            return int(t.nbytes / math.prod(self.mesh.size(a) for a in layout.split_axes))

    def _sync_path(self, v: Tensor, layout: Layout, split: Split,
                   needs_grad: bool | None = None) -> tuple[float, int]:
        axes = self._sync_axes(layout, split)
        if not axes or v.ndim == 0 or not (self._needs_grad(v) if needs_grad is None
                                           else needs_grad):
            return 0.0, 0
        dst = drop_partial(layout)
        if v.role is Role.VARIABLE and self.zero >= 3:
            dst = storage_layout(self.mesh, v, dst, axes)
        return relayout_price(interned(Layout(layout.dims, tuple(axes))), dst, v.shape, itemsize(v),
                     self.mesh)

    def grad_sync_time(self, v: Tensor, layout: Layout, split: Split,
                       needs_grad: bool | None = None) -> float:
        """Seconds to reduce ``v``'s gradient over the axes its consumer splits but ``v`` not.

        ``layout`` is the layout the consumer reads ``v`` in; the gradient comes back as partial
        sums over those axes and takes the cheapest collective path to ``layout`` (over two
        axes one hierarchical reduction, not two all-reduces; as ``plan_cost``). Weights under
        ZeRO-3 are reduce-scattered to their shard (their forward all-gather is the edge's; XLA
        keeps the gathered weight for the backward instead of gathering it again); everything
        else is all-reduced (ZeRO-1/2's reduce-scatter + all-gather of the updated shard costs
        the same). ``needs_grad``: whether ``v`` gets a gradient (default a local guess).
        """
        return self._sync_path(v, layout, split, needs_grad)[0]

    # ---- memory --------------------------------------------------------------------------------

    def activation_bytes(self, op: Op, split: Split, outputs: tuple[int, ...] | None = None,
                         forms: Mapping[tuple[int, int], str] = MappingProxyType({})) -> int:
        """Bytes of ``op``'s outputs on one device kept for the backward pass (partial sums keep
        their full shape; free layout ops and region ops hold none of their own).

        Args:
            outputs: the indices of the outputs that are kept, from
                :func:`nnscaler_jax.cost.residuals.residual_outputs` (default: all of them).
            forms: :func:`nnscaler_jax.cost.residuals.residual_forms` (``(op id, index)`` a
                GPU keeps in another form).
        """
        if op.primitive in FREE or op.regions or outputs == ():
            return 0
        _, outs = op_layouts(op, OpPlan(op.id, op.primitive, op.module_path, split))
        keep = range(len(op.outputs)) if outputs is None else outputs
        return int(sum(self.residual_bytes(op.outputs[k], outs[k], forms.get((op.id, k)))
                       for k in keep) / self.microbatches)

    def residual_bytes(self, t: Tensor, layout: Layout, form: str | None = None) -> int:
        """Bytes of residual ``t`` on one device under ``layout``, in ``form``
        (:func:`nnscaler_jax.cost.residuals.residual_forms`): ``"float32"``, a bf16 value this
        device's fusions compute and keep in float32 (``DeviceSpec.bf16_arithmetic`` False),
        twice its bytes; ``"rebuilt"``, a float32 tanh this device's backward rebuilds
        (``DeviceSpec.rebuilds_tanh``), none."""
        n = self._local_bytes(t, layout)
        if form == "float32" and not self.device.bf16_arithmetic:
            return 2 * n
        if form == "rebuilt" and self.device.rebuilds_tanh:
            return 0
        return n

    def state_bytes(self, v: Tensor, layout: Layout, dp_axes: tuple[str, ...] = (),
                    zero: int | None = None) -> tuple[float, float, float]:
        """Per-device (parameter, gradient, optimizer state) bytes of variable ``v``.

        Args:
            v: the variable.
            layout: its storage layout.
            dp_axes: its data-parallel axes; ZeRO-1 shards the optimizer state over those the
                layout does not split already, ZeRO-2 also the gradient, ZeRO-3 the parameter.
            zero: the ZeRO stage (default ``self.zero``).
        """
        zero = self.zero if zero is None else zero
        n = math.prod(v.shape) / math.prod(self.mesh.size(a) for a in layout.split_axes)
        dp = math.prod(self.mesh.size(a) for a in set(dp_axes) if a not in layout.split_axes)
        size = itemsize(v)
        pb = size if self.param_bytes is None else self.param_bytes
        param = n * pb / (dp if zero >= 3 else 1)
        if v.collection not in TRAINABLE or not is_float(v):
            return param, 0.0, 0.0
        gb = pb if self.grad_bytes is None else self.grad_bytes
        ob = self.optimizer_bytes
        if ob is None:
            ob = self.optimizer_moments * size + (4 if self.master_weights else 0)
        return param, n * gb / (dp if zero >= 2 else 1), n * ob / (dp if zero >= 1 else 1)

    def variable_bytes(self, v: Tensor, layout: Layout, dp_axes: tuple[str, ...] = (),
                       held: bool = True) -> int:
        """Per-device bytes of a weight + its optimizer state under ``zero``, + its gradient
        when ``held`` (live at the peak: :meth:`held_gradients`)."""
        param, grad, opt = self.state_bytes(v, layout, dp_axes)
        return int(param + opt + (grad if held else 0.0))

    def held_gradients(self, graph: Graph, microbatches: int | None = None
                       ) -> Callable[[int], bool]:
        """Whether a variable id's gradient is live at the peak: all of them with
        ``grads_held``, gradient accumulation over micro-batches, or a model whose reductions
        XLA combines into one (:func:`~nnscaler_jax.cost.residuals.combines_all_reductions`);
        else those :func:`~nnscaler_jax.cost.residuals.accumulated_gradients` finds."""
        if self.grads_held or max(self.microbatches, microbatches or 1) > 1 or \
                combines_all_reductions(graph):
            return lambda v: True
        return accumulated_gradients(graph).__contains__

    # ---- whole plans ---------------------------------------------------------------------------

    def plan_cost(self, plan: Plan, graph: Graph) -> PlanCost:
        """Step time, per-device peak memory and communication bytes of ``plan``."""
        a = analyze(self, plan, graph)
        return PlanCost(step_time_s=a.compute + a.comm_time, memory_bytes_per_device=int(a.peak),
                        comm_bytes=int(a.comm_bytes), compute_time_s=a.compute,
                        comm_time_s=a.comm_time, comm_kinds=tuple(
                            (k, int(n)) for k, n in sorted(a.comm_kinds.items())),
                        largest_gather_bytes=int(a.largest_gather))

    def memory_breakdown(self, plan: Plan, graph: Graph) -> dict[str, int]:
        """Per-device bytes of a training step by kind: ``params``, ``grads`` (as stored),
        ``optimizer``, ``activations`` (kept for the backward), ``transient`` (the largest
        temporary), ``grads_held`` (the gradients live at the peak: :meth:`held_gradients`)
        and ``peak`` (params + optimizer + activations + transient + grads_held)."""
        a = analyze(self, plan, graph)
        return {"params": int(a.params), "grads": int(a.grads), "optimizer": int(a.optimizer),
                "activations": int(a.activations), "transient": int(a.transient),
                "grads_held": int(a.grads_held), "peak": int(a.peak)}
