"""A whole plan priced by walking its graph once (``CostModel.plan_cost`` /
``memory_breakdown``): every op's compute at its split, every producer -> consumer relayout and
each gradient's way back (reduced once per gradient layout), outputs handed back from partial
sums, scan carries; per-device memory of parameters, gradients and optimizer state under the
ZeRO stage, autodiff's residuals, gathered operands and the largest transient. The per-op and
per-relayout prices are :class:`~nnscaler_jax.cost.model.CostModel`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nnscaler_jax.cost.compute import (
    FREE,
    grad_tensors,
    is_float,
    itemsize,
    region_length,
    walk_weighted,
)
from nnscaler_jax.cost.fusion import fused_bytes
from nnscaler_jax.cost.relayout import (
    Split,
    drop_partial,
    grad_source,
    relayout_parts,
    storage_layout,
)
from nnscaler_jax.cost.residuals import (
    BITCAST,
    MASKED,
    REGATHERED_COPIES,
    copies_cotangent,
    copies_read_once,
    residual_forms,
    residual_outputs,
    residual_readers,
    residual_reads,
    saved_operands,
)
from nnscaler_jax.ir.attention import with_fused_attention
from nnscaler_jax.ir.coshard import COSHARD, whole_reads, with_boundaries
from nnscaler_jax.ir.graph import REMAT_KINDS, Graph, Op, Role, Tensor
from nnscaler_jax.ir.regions import region_links, weight_origins
from nnscaler_jax.ir.remat import remat_roles
from nnscaler_jax.layout import Layout
from nnscaler_jax.mesh.axes import data_axes
from nnscaler_jax.plan.layouts import plan_layouts, sole_read_variables, unstack
from nnscaler_jax.plan.plan import OpPlan, Plan
from nnscaler_jax.plan.zero import gradient_axes

__all__ = ["analyze", "backward_held", "boundary_kinds", "loop_stacks"]


@dataclass
class _Edge:
    tensor: Tensor
    have: Layout
    want: Layout
    split: Split
    mult: int
    region: bool = False  # the consumer is a region op: its body's edges reduce the gradients
    rerun: bool = False  # the consumer is recomputed: the relayout runs again in its backward
    # the consumer's co-sharded block reads the tensor whole in each of this many chunks: its
    # gradient is reduced in each (ir.coshard.whole_reads)
    chunks: int = 1
    block: int = -1  # the consumer's recomputed block (its rerun relayouts are that block's)
    made_once: bool = False  # a value an op wrote: its relayout to ``want`` is made once


@dataclass
class _Analysis:
    compute: float = 0.0
    comm_time: float = 0.0
    comm_bytes: float = 0.0
    comm_kinds: dict[str, float] = field(default_factory=dict)  # comm_bytes by collective
    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    transient: float = 0.0
    grads_held: float = 0.0  # the gradients live at the peak (CostModel.held_gradients)
    largest_gather: float = 0.0  # the largest all-gather result a device receives

    @property
    def peak(self) -> float:
        return self.params + self.grads_held + self.optimizer + self.activations + self.transient


def boundary_kinds(graph: Graph) -> dict[int, tuple[str, tuple[Tensor, ...]]]:
    """Boundary id -> (kind, the tensors it reads from outside), region bodies included."""
    out = {b.id: (b.kind, b.inputs) for b in graph.boundaries}
    for op in graph.ops:
        for region in op.regions:
            out.update(boundary_kinds(region))
    return out




def loop_stacks(graph: Graph, grads: Any = ()
                ) -> dict[int, tuple[int, tuple[tuple[Tensor, int, int], ...]]]:
    """Co-sharded block id -> (the remat boundary whose backward runs it: its recompute group,
    else the block itself; ``(tensor, copies)``: what the block's chunk loop holds besides the
    block's own transient while its backward runs). The loop (``lower/coshard.py``) scans over
    its chunked inputs stacked (a transposed copy, built again in a recomputed layer) and
    writes the inputs' cotangent stacked before transposing it back; the outputs' cotangent is
    stacked to be scanned over: each chunked input once (twice recomputed), each output once;
    the cotangent of each input read whole by every chunk (in ``grads``, e.g. a weight's cast)
    is summed over the chunks in a buffer of its own. Measured on XLA:CPU (Swin at 64 px,
    ``scripts/bench_decisions_memory.py``) and XLA:GPU (Llama-3-8B's LM head at 128K).
    Each held item is ``(tensor, copies, reader)``: an input's stack and cotangent buffer are
    laid out as the block's first op reading it (``reader``) reads it (``lower/coshard.py``
    relays the input out before the loop), an output's as it is made (``reader`` -1)."""
    kinds = boundary_kinds(graph)
    outer: dict[int, int] = {}
    reader: dict[tuple[int, int], int] = {}  # (block, input id) -> the block's first op reading it
    for op in graph.ops:
        remat = [b for b in op.boundary if kinds.get(b, ("",))[0] in REMAT_KINDS]
        for b in op.boundary:
            if kinds.get(b, ("",))[0] == COSHARD:
                outer.setdefault(b, remat[0])
                for t in op.inputs:
                    reader.setdefault((b, t.id), op.id)
    out = {}
    for b in graph.boundaries:
        if b.id not in outer:
            continue
        again = 2 if outer[b.id] != b.id else 1
        axes = b.eqn.params["in_axes"]
        ins = tuple((t, again, reader.get((b.id, t.id), -1))
                    for t, a in zip(b.inputs, axes, strict=True) if a is not None and t.ndim)
        summed = tuple((t, 1, reader.get((b.id, t.id), -1))
                       for t, a in zip(b.inputs, axes, strict=True)
                       if a is None and t.ndim and t.id in grads)
        out[b.id] = (outer[b.id], ins + summed + tuple((t, 1, -1) for t in b.outputs if t.ndim))
    return out


def backward_held(graph: Graph, grads: Any = ()
                  ) -> list[tuple[int, tuple[tuple[Tensor, int, int], ...]]]:
    """``(recompute group, ((tensor, copies, reader), ...))``: what is live besides a recomputed
    block's residuals while its backward runs: co-sharded blocks' chunk loops
    (:func:`loop_stacks`), and the cotangents of each recompute group's outputs, which arrive
    before its backward starts (measured: XLA:CPU's live set at the peak of an Evoformer
    block's backward, ``scripts/bench_decisions_memory.py``)."""
    out = list(loop_stacks(graph, grads).values())
    stacked: dict[int, set[int]] = {}
    for outer, held in out:
        stacked.setdefault(outer, set()).update(t.id for t, _, _ in held)
    for b in graph.boundaries:
        if b.kind in REMAT_KINDS:
            own = tuple((t, 1, -1) for t in b.outputs
                        if t.ndim and is_float(t) and t.id not in stacked.get(b.id, ()))
            if own:
                out.append((b.id, own))
    return out


def _region_layouts(op: Op, ins: tuple[Layout, ...], layout: dict[int, Layout]) -> None:
    """Layouts of a region's body inputs from the layouts its op reads its operands in."""
    by_outer = {t.id: lay for t, lay in zip(op.inputs, ins, strict=True)}
    dims: dict[int, dict[int, tuple[str, ...]]] = {}
    try:
        for (outer, i), (inner, j) in region_links(op):
            if outer in by_outer and i < by_outer[outer].ndim:
                dims.setdefault(inner, {})[j] = by_outer[outer].dims[i]
    except Exception:  # noqa: BLE001 - unknown region kinds: body inputs stay unpriced
        return
    for region in op.regions:
        for t in region.inputs:
            if t.id in dims and t.id not in layout:
                d = dims[t.id]
                dims_t = tuple(d.get(k, ()) for k in range(t.ndim))
                used = [a for axes in dims_t for a in axes]
                if len(used) == len(set(used)):  # else unpriced: an axis used twice
                    layout[t.id] = Layout(dims_t)


def relayout_reruns(have: Layout, producer_reruns: bool) -> bool:
    """Whether a recomputed op's read of a value in layout ``have`` relayouts it again when the
    op runs again in its block's backward: always, but for partial sums of a producer that does
    not run again (kept by its boundary's policy, or outside the block): the reduction is part
    of the producer (XLA's SPMD partitioner reduces a matmul's output in the matmul), so the
    value saved for the block is the reduced one. Measured (``tests/cost/test_rerun_comm.py``):
    a Megatron-split GPT recomputed whole reruns one all-reduce per layer, the attention's out
    projection's (the MLP's feeds only dead code); recomputed selectively, none."""
    return not have.partial or producer_reruns


def rebuilt_operands(op: Op, grads: Any) -> frozenset[int]:
    """Indices of the operands a recomputed block's op reads for its transpose, rebuilt in the
    block's backward though the op itself does not run again there (its output is not needed,
    ``ir.remat.remat_roles``' dropped ops): a relayout on the way to them runs again
    (measured with XLA:GPU: T5-8's co-sharded LM head gathers its table's chunks in the
    backward's chunk loop as in the forward's, 9.4 GB more a step)."""
    if op.regions:
        return frozenset()
    return frozenset(saved_operands(op, tuple(t.id in grads for t in op.inputs))[0])


def _gathered(model: Any, op: Op, reads: list[int], ins: tuple[Layout, ...],
              layout: Mapping[int, Layout], zero: int, mult: float, kept: dict,
              grown: set | None = None) -> None:
    """An operand ``op`` reads for the backward (``reads``), reaching it through a relayout
    that grows it (an all-gather), is saved as ``op`` reads it: the gathered copy stays for the
    backward next to the original (as ZeRO-3's gathered weights; a residual only ``op``
    reads keeps the gathered copy alone: ``grown`` records the read, see
    :meth:`_Walk.only_gathered`). Matmul / convolution (or
    ReLU max) operands their transposes read; cheap elementwise ops' inputs a residual is
    traced through (``z + all_gather(delta)``: XLA keeps the gathered sum)."""
    for j in reads:
        t, want = op.inputs[j], ins[j]
        have = layout.get(t.id)
        if have is None or not t.ndim or have == want or (
                t.role is Role.VARIABLE and zero >= 3) or not is_float(t):
            continue
        size = model._local_bytes(t, want)
        if size > model._local_bytes(t, have):
            kept[(t.id, want)] = max(kept.get((t.id, want), 0.0), size * mult)
            if grown is not None:
                grown.add((op.id, t.id))


def _dense_cotangent(model: Any, graph: Graph, op: Op, ins: tuple[Layout, ...],
                     grads: Any, kept: Mapping | None = None) -> float:
    """Bytes of the dense cotangent a gather's transpose builds for a computed operand (the
    labels' ``take_along_axis`` of a loss: a scatter-add into zeros of the logits' shape, in
    their dtype, live while the backward reads it; measured with XLA:GPU, Llama-3-8B's chunked
    loss), with its copy cast back to the logits' type (:func:`_narrowed`). A weight's (an
    embedding table) is its gradient, priced as such.

    ``kept``: the walk's kept residuals, where the loss is not recomputed. The cast copy is
    made once the loss's backward has read the narrow logits it keeps (the last use of those
    residuals), so it takes their place: only what it needs beyond them counts (measured with
    XLA:GPU, GPT-3 1.3B's whole-batch loss in bf16 on H100s, Megatron's plan: at the peak, the
    loss's backward, XLA holds the float32 cotangent beside the other residuals, 12.54 GiB,
    where the copy beside the kept logits priced 13.33)."""
    if op.primitive != "gather" or not op.inputs:
        return 0.0
    t = op.inputs[0]
    if t.role is Role.VARIABLE or t.id not in grads or not is_float(t) or not t.ndim:
        return 0.0
    dense = model._local_bytes(t, ins[0])
    src = _narrowed(graph, t)
    copy = dense * itemsize(src) / itemsize(t) if src is not None else 0.0
    if copy and kept is not None:
        copy = max(0.0, copy - _kept_bytes(graph, src, kept))
    return dense + copy


def _kept_bytes(graph: Graph, t: Tensor, kept: Mapping) -> float:
    """Bytes ``kept`` holds of ``t`` or of the tensor it is a bitcast view of (a reshape of a
    matmul output), in any layout (its own, or gathered for a reader)."""
    while True:
        got = sum(b for key, b in kept.items() if key == t.id or (
            isinstance(key, tuple) and key[0] == t.id))
        w = graph.writers.get(t.id)
        if got or w is None or w[0].regions or w[0].primitive not in BITCAST:
            return got
        t = w[0].inputs[0]


def _transposed_cotangent(model: Any, graph: Graph, op: Op, ins: tuple[Layout, ...],
                          grads: Any) -> float:
    """Bytes of the copy XLA makes of the cotangent of a transposed matmul output
    (:func:`~nnscaler_jax.cost.residuals.copies_cotangent`)."""
    if op.primitive != "transpose" or op.inputs[0].id not in grads or \
            not copies_cotangent(op, graph):
        return 0.0
    return float(model._local_bytes(op.inputs[0], ins[0]))


def _narrowed(graph: Graph, t: Tensor) -> Tensor | None:
    """The narrower tensor the cotangent of ``t`` is cast back to on its way to what computed
    it (the bf16 logits of a float32 log-softmax), or None: that cast copy lives with the dense
    cotangent it is made from (measured with XLA:GPU, Llama-3-8B's chunked loss in bf16: 3.9
    GiB of float32 and 2 GiB of bf16 logits cotangent per chunk)."""
    while True:
        w = graph.writers.get(t.id)
        if w is None or w[0].regions or w[0].primitive not in _BACK_TO:
            return None
        src = next((x for x in w[0].inputs if x.shape == t.shape and is_float(x)), None)
        if src is None:
            return None
        if w[0].primitive == "convert_element_type":
            return src if itemsize(src) < itemsize(t) else None
        t = src


_BACK_TO = frozenset({"sub", "add", "neg", "mul", "convert_element_type"})


def _scan_outputs(scans, layout: Mapping[int, Layout]) -> list[_Edge]:
    """Each iteration relayouts a scan body's outputs into the scan's carry layout and its
    stacked outputs' per-iteration block (the search tables price the same edges)."""
    out = []
    for op, outs, mult in scans:
        ncarry = op.params["num_carry"]
        for k, (t, want) in enumerate(zip(op.regions[0].outputs, outs, strict=True)):
            have = layout.get(t.id)
            want = unstack(want, k >= ncarry)
            if have is not None and t.ndim and have != want:
                out.append(_Edge(t, have, want, (), mult))
    return out


def _partial_outputs(graph: Graph, layout: Mapping[int, Layout]) -> list[_Edge]:
    """Graph outputs left as partial sums that no op reads: the program hands back their value,
    so they are all-reduced over those axes (the lowering constrains them to their dims)."""
    out = []
    for t in graph.outputs:
        lay = layout.get(t.id)
        if lay is not None and lay.partial and t.ndim and t.id not in graph.consumers:
            out.append(_Edge(t, lay, drop_partial(lay), (), 1))
    return out


def analyze(model: Any, plan: Plan, graph: Graph) -> _Analysis:
    """Step time, bytes moved and per-device memory of ``plan`` (see the module docs); the
    plan's recompute groups are remat boundaries (:func:`nnscaler_jax.ir.remat.with_recompute`)."""
    graph = with_fused_attention(graph, plan.fused_attention, dict(plan.ring_layouts))
    graph = with_boundaries(graph, plan.coshard, plan.recompute)
    zero = max(model.zero, plan.zero)
    grads = grad_tensors(graph, model.input_grads)
    out = _Analysis()
    walk = _Walk(model, plan, graph, grads, zero, out)
    walk.run()
    # one micro-batch's activations live (a pipelined plan's micro-batches are its stages'
    # business: priced by the stage pricing, not here)
    micro = max(model.microbatches, plan.microbatches if plan.pipeline is None else 1)
    out.activations, out.transient = out.activations / micro, out.transient / micro
    held = model.held_gradients(graph, micro)
    store, var_ids = _storage(model, plan, graph, walk.edges, walk.origin, zero, out, held)
    _communication(model, walk.edges, store, var_ids, grads, zero, out, held, micro,
                   walk.origin)
    # XLA:GPU's cuBLAS GEMMs take a workspace of their own, live while one runs (the peak is
    # at a matmul of the backward)
    if model.device.gemm_workspace_bytes and any(op.primitive == "dot_general"
                                                 for op in graph.walk()):
        out.transient += model.device.gemm_workspace_bytes
    return out


class _Walk:
    """One pass over the ops in program order: compute, layouts (the edges between them), what
    is kept for the backward and the largest transient."""

    def __init__(self, model: Any, plan: Plan, graph: Graph, grads, zero: int,
                 out: _Analysis) -> None:
        self.model, self.graph, self.grads, self.zero, self.out = model, graph, grads, zero, out
        self.plans = plan._by_id()
        self.saved = residual_outputs(graph, grads if model.input_grads else None)
        self.reads = residual_reads(graph, grads if model.input_grads else None)
        self.forms = residual_forms(graph, grads if model.input_grads else None)
        self.traffic = fused_bytes(graph)  # what each op's fusion reads and writes
        self.kinds = boundary_kinds(graph)
        self.sole = sole_read_variables(graph)
        self.layout: dict[int, Layout] = {}
        for t in graph.inputs:
            spec = plan.variable_spec(t.name) if t.role is Role.VARIABLE else None
            self.layout[t.id] = Layout.from_pspec(spec, t.ndim) if spec else \
                Layout.replicated(t.ndim)
        self.edges: list[_Edge] = []
        self.kept: dict[int, float] = {}
        self.remat_inputs: dict[int, int] = {}  # boundary id -> multiplicity
        self.remat_sum: dict[int, float] = {}
        self.regathered: dict[int, dict] = {}  # block -> its gathered matmul operands' bytes
        # the variable a tensor is computed from alone (reshapes, casts; region body inputs)
        self.origin = weight_origins(graph)
        self.first_want: dict[int, Layout] = {}
        self.read_in: dict[tuple[int, int], Layout] = {}  # (op id, tensor id) -> read as
        self.scans: list[tuple[Op, tuple[Layout, ...], int]] = []
        self.whole = whole_reads(graph)  # op id -> (chunks, what its block reads whole)
        self.chunks = {op: k for op, (k, _) in self.whole.items()}  # op id -> its block's chunks
        self.again: set[int] = set()  # ops recomputed in their block's backward
        # ops their remat boundary's policy keeps, and recomputed ones nothing needs
        roles = remat_roles(graph, lambda: residual_readers(
            graph, grads if model.input_grads else None))
        self.grown: set[tuple[int, int]] = set()  # (op id, tensor id): read gathered, kept so
        self.once = copies_read_once(graph, grads if model.input_grads else None)
        self.policy, self.dropped = roles.kept, roles.dropped

    def run(self) -> None:
        for op, mult in walk_weighted(self.graph):
            self.op(op, mult)
        self.edges += _scan_outputs(self.scans, self.layout)
        self.edges += _partial_outputs(self.graph, self.layout)
        out, layout, model = self.out, self.layout, self.model
        for tid in self.only_gathered():  # (a recomputed block's input is kept again below)
            del self.kept[tid]
        for b, mult in self.remat_inputs.items():
            for t in self.kinds[b][1]:
                if t.role in (Role.VALUE, Role.INPUT) and t.id in layout:
                    lays = [layout[t.id]] + ([self.first_want[t.id]]
                                             if t.id in self.first_want else [])
                    self.kept.setdefault(t.id, min(model._local_bytes(t, lay)
                                                   for lay in lays) * mult)
        out.activations = sum(self.kept.values())
        for outer, held in backward_held(self.graph, self.grads):  # loops' stacks, cotangents
            self.remat_sum[outer] = self.remat_sum.get(outer, 0.0) + sum(
                model._local_bytes(t, self.read_in.get((reader, t.id), layout[t.id])) * copies
                for t, copies, reader in held)
        out.transient = max([out.transient, *(s + sum(self.regathered.get(b, {}).values())
                                               for b, s in self.remat_sum.items())])

    def only_gathered(self) -> list[int]:
        """Residuals kept in their own layout that their one reader reads gathered
        (:func:`~nnscaler_jax.cost.residuals.copies_read_once`): the gathered copy
        stays (:func:`_gathered`), the shard is dead once gathered."""
        return [tid for tid, (reader, views) in self.once.items() if tid in self.kept
                and any((reader, v) in self.grown for v in views)]

    def op(self, op: Op, mult: int) -> None:
        model, out = self.model, self.out
        p = self.plans.get(op.id) or OpPlan(op.id, op.primitive, op.module_path)
        ins, outs = plan_layouts(op, self.plans, self.sole)
        remat = [b for b in op.boundary if self.kinds.get(b, ("",))[0] in REMAT_KINDS]
        again = bool(remat) and not op.regions and op.id not in self.policy and \
            op.id not in self.dropped
        if again:
            self.again.add(op.id)
        # the operands a dropped op, or one its boundary's policy keeps, reads for its transpose
        # are rebuilt in the block's backward (the policy keeps outputs, not operands)
        rebuilt = rebuilt_operands(op, self.grads) if remat and (
            op.id in self.dropped or op.id in self.policy) else ()
        k, whole = self.whole.get(op.id, (1, frozenset()))
        for j, (t, want) in enumerate(zip(op.inputs, ins, strict=True)):
            have = self.layout.get(t.id)
            if have is not None and t.ndim:
                w = self.graph.writers.get(t.id)
                rerun = (again or j in rebuilt) and relayout_reruns(
                    have, w is not None and w[0].id in self.again)
                self.edges.append(_Edge(t, have, want, p.split, mult, bool(op.regions), rerun,
                                        k if t.id in whole else 1, remat[0] if remat else -1,
                                        t.role is Role.VALUE and w is not None))
                self.first_want.setdefault(t.id, want)
                self.read_in.setdefault((op.id, t.id), want)
        for t, lay in zip(op.outputs, outs, strict=True):
            self.layout[t.id] = lay
        if op.regions:
            _region_layouts(op, ins, self.layout)
            if op.primitive == "scan":
                self.scans.append((op, outs, mult * region_length(op)))
            return
        mask = tuple(t.id in self.grads for t in op.inputs)
        out.compute += model._op_time(op, p.split, mask, self.traffic) * mult
        k = self.chunks.get(op.id, 1)  # a co-sharded block's op: one chunk is live at a time
        if remat or not op.boundary:
            # recomputed: the gathered copy is rebuilt with the block's residuals, live with
            # them (a matmul operand's with its cotangent) during the block's backward (one
            # chunk's at a time)
            into = self.regathered.setdefault(remat[0], {}) if remat else self.kept
            grown = None if remat else self.grown
            if op.primitive in MASKED:
                _gathered(model, op, saved_operands(op, mask)[0], ins, self.layout, self.zero,
                          mult / k * (REGATHERED_COPIES if remat else 1), into, grown)
            reads = [j for j in range(len(op.inputs)) if (op.id, j) in self.reads]
            if reads:
                _gathered(model, op, reads, ins, self.layout, self.zero, mult / k, into, grown)
        local = sum(model._local_bytes(t, lay) for t, lay in zip(op.outputs, outs, strict=True))
        out.transient = max(out.transient, local / k)
        dense = _dense_cotangent(model, self.graph, op, ins, self.grads,
                                 None if remat else self.kept) + \
            _transposed_cotangent(model, self.graph, op, ins, self.grads)
        if dense and remat:  # live with the recomputed block's residuals
            self.remat_sum[remat[0]] = self.remat_sum.get(remat[0], 0.0) + dense * mult / k
        elif dense:
            out.transient = max(out.transient, dense / k)
        if k > 1:
            out.compute += model.chunk_overhead(op, p.split, k, self.traffic) * mult
        if remat:
            self.remat_inputs.setdefault(remat[0], mult)
        if remat and op.id in self.policy:  # the boundary's policy keeps it: it runs once and
            # keeps what its backward and the block's recomputed ops read
            for k in sorted(self.policy[op.id]):
                self.kept[op.outputs[k].id] = model.residual_bytes(
                    op.outputs[k], outs[k], self.forms.get((op.id, k))) * mult
        elif remat:  # recomputed in the backward: one more forward; while the block's backward
            # runs, its residuals are live again (the block's transient). An op the backward
            # does not need is not run again (dead code); its residuals are still counted in
            # the transient (not measured against XLA yet: dropping them let a Swin plan at
            # 64 px under a 40% budget price 0.66 of XLA's memory)
            if op.id not in self.dropped:
                out.compute += model.forward_time(op, p.split, self.traffic) * mult
            redo = 0 if op.primitive in FREE else sum(
                model._local_bytes(op.outputs[k], outs[k]) for k in self.saved.get(op.id, ()))
            self.remat_sum[remat[0]] = self.remat_sum.get(remat[0], 0.0) + redo * mult / k
        elif op.primitive not in FREE:
            for k in self.saved.get(op.id, ()):
                self.kept[op.outputs[k].id] = model.residual_bytes(
                    op.outputs[k], outs[k], self.forms.get((op.id, k))) * mult


def _storage(model: Any, plan: Plan, graph: Graph, edges: list[_Edge],
             origin: Mapping[int, int], zero: int,
             out: _Analysis, held: Any) -> tuple[dict[int, Layout], set[int]]:
    """Data-parallel axes of each weight and its storage under the ZeRO stage (parameters,
    gradients and optimizer state added to ``out``): ``(variable -> storage, variable ids)``."""
    var_ids = {v.id for v in graph.variables}
    dp = gradient_axes(plan, graph)
    # ZeRO 1 / 2 shard optimizer state / gradients over all of the mesh's data axes (as the
    # training step does), also for a weight whose gradient is reduced downstream of its
    # readers (a position table sliced, then broadcast over the batch)
    mesh_axes = {a: model.mesh.size(a) for a in dict(plan.mesh)}
    zero_axes = tuple(data_axes(mesh_axes)) if zero in (1, 2) else ()
    store: dict[int, Layout] = {}
    for v in graph.variables:
        lay = layout_v = Layout.from_pspec(plan.variable_spec(v.name), v.ndim) \
            if plan.variable_spec(v.name) else Layout.replicated(v.ndim)
        store[v.id] = storage_layout(model.mesh, v, lay, dp[v.id]) if zero >= 3 else lay
        pb, gb, ob = model.state_bytes(v, layout_v, tuple(dict.fromkeys(dp[v.id] + zero_axes)),
                                       zero)
        out.params += pb
        out.grads += gb
        out.grads_held += gb if held(v.id) else 0.0
        out.optimizer += ob
    return store, var_ids


def _scattered(g: Layout, dst: Layout) -> Layout | None:
    """What a co-sharded block's chunk loop holds of a gradient reduced from ``g`` to ``dst``
    (the chunks reading the tensor whole), when the reduction reduce-scatters (a partial axis of
    ``g`` splits a dim of ``dst``): ``dst`` still partial over the other axes. XLA makes that in
    every chunk, and all-reduces those axes once after the loop (its while-loop all-reduce code
    motion; no such motion of a reduce-scatter applies here, the flag
    ``xla_gpu_enable_while_loop_reduce_scatter_code_motion`` left Llama-3-8B's loops alike).
    None when the reduction is an all-reduce alone (moved out of the loop: one)."""
    split = {a for d in dst.dims for a in d}
    if not split & set(g.partial):
        return None
    return Layout(dst.dims, tuple(a for a in g.partial if a not in split))


def _price(out: _Analysis, src: Layout, dst: Layout, t: Tensor, mesh: Any, runs: float) -> None:
    """One relayout of ``t`` from ``src`` to ``dst`` run ``runs`` times, added to ``out``."""
    secs, n, kinds = relayout_parts(src, dst, t.shape, itemsize(t), mesh)
    out.comm_time += secs * runs
    out.comm_bytes += n * runs
    for kind, b in kinds:
        out.comm_kinds[kind] = out.comm_kinds.get(kind, 0.0) + b * runs
        if kind == "all_gather":
            out.largest_gather = max(out.largest_gather, b)


def _communication(model: Any, edges: list[_Edge], store: Mapping[int, Layout],
                   var_ids: set[int], grads, zero: int, out: _Analysis, held: Any,
                   micro: int, origin: Mapping[int, int]) -> None:
    """Forward paths, then each gradient reduced once per (tensor, layout) (in every chunk of
    a co-sharded block that reads the tensor whole), added to ``out``.
    A value read in one layout by several ops is relaid out once (XLA's SPMD partitioner
    reshards an instruction once per target sharding: q, k and v gather a LayerNorm's output
    once; measured with XLA:GPU, GPT-3 6.7B's searched plan all-gathers 8.15 GB a step, 9.22 GB
    priced per reader), and again in each recomputed reader's backward. A weight's readers
    still pay one relayout each from its storage.
    A weight's relayout from storage and its gradient's reduction run once per micro-batch
    (``micro``; measured with XLA:GPU, GPT-3 1.3B under ZeRO-3 in 4 micro-batches: every
    gather and reduction 4 times); an activation's relayouts move the batch's bytes once.
    ``origin``: the variable a tensor is computed from alone (a weight's cast or slice)."""
    mesh = model.mesh

    def weighty(t: Tensor) -> bool:
        return origin.get(t.id, t.id) in var_ids
    backward: dict[tuple[int, Layout], tuple[Tensor, Layout, int]] = {}
    chunks: dict[tuple[int, Layout], int] = {}  # the chunks of a loop reducing it in each
    gathered: dict[int, int] = {}
    made: set[tuple] = set()  # relayouts made (forward, then the gradients')
    # a value's cotangents read in one layout -> the layouts they come back in (some partial)
    summed: dict[tuple[int, Layout], set[Layout]] = {}
    for e in edges:
        t = e.tensor
        src = store.get(t.id, e.have)
        if src != e.want:
            once = e.made_once and not e.region
            keys = [(t.id, src, e.want)] + ([(t.id, src, e.want, e.block)] if e.rerun else [])
            runs = sum(1 for key in keys if not (once and key in made))
            if once:
                made.update(keys)
            if runs:
                _price(out, src, e.want, t, mesh, e.mult * runs * (micro if weighty(t) else 1))
            if t.id in var_ids and zero >= 3:  # the gathered weight stays for the backward
                gathered[t.id] = max(gathered.get(t.id, 0), model._local_bytes(t, e.want))
        if t.id in grads and not e.region:
            g = grad_source(e.want, e.split)
            backward.setdefault((t.id, g), (t, drop_partial(src), e.mult))
            chunks[t.id, g] = max(chunks.get((t.id, g), 1), e.chunks)
            if e.made_once:
                summed.setdefault((t.id, drop_partial(g)), set()).add(g)
    synced: dict[int, int] = {}
    for key, (t, dst, mult) in backward.items():
        g = key[1]
        if g != dst:
            mid = _scattered(g, dst) if chunks[key] > 1 else None
            steps = [(g, dst, 1)] if mid is None else \
                [(g, mid, chunks[key])] + ([(mid, dst, 1)] if mid != dst else [])
            whole = drop_partial(g)
            if mid is None and len(summed.get((t.id, whole), ())) > 1:
                # cotangents read alike, some partial: each reduced, summed, relaid out once
                steps = [(g, whole, 1)] if g != whole else []
                if whole != dst and (t.id, whole, dst, "grad") not in made:
                    made.add((t.id, whole, dst, "grad"))
                    steps.append((whole, dst, 1))
            for a, b, k in steps:
                _price(out, a, b, t, mesh, mult * k * (micro if weighty(t) else 1))
            if t.id in var_ids and held(t.id):
                # the local gradient of a held weight before its reduction (one fused buffer;
                # the others are reduced and consumed one by one)
                synced[t.id] = max(synced.get(t.id, 0), model._local_bytes(t, g) * mult)
    out.activations += sum(gathered.values())
    # the reduction buffer lives at the end of the backward, when the residuals are freed
    out.transient = max(out.transient, sum(synced.values()) - out.activations)
