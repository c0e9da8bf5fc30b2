"""Memory traffic of each op after XLA's fusion: what its fusion reads and writes.

Priced op by op, a chain of elementwise ops (a softmax's ``sub``, ``exp``, ``div``, the casts
around it, a layer norm's ``mul`` / ``add``) reads and writes every intermediate in full. XLA
fuses such chains into one kernel that reads the chain's inputs and writes its outputs once; the
intermediates stay in registers. Measured on one H100 (``results/bench_gpu.md``): GPT-3 1.3B in
bf16 ran its step in 0.43 of the time the op-by-op roofline predicted, three quarters of which
were elementwise ops.

The model here follows XLA's fusion rules closely enough for a roofline:

- **Fusible** ops are elementwise and layout ops: anything but matmuls / convolutions, region ops
  (``scan``, ``while``, ``cond``), reductions and the ops in :data:`BARRIER` (gathers,
  scatters, sorts, cumulative ops, collectives, random bits). A reduction fuses its elementwise
  producers (XLA's input fusion) but writes its own output.
- A tensor is **materialised** when its producer is not fusible (or it is a graph input, a
  weight or a constant), when it is a graph output, when the backward keeps it (a residual root,
  :func:`~nnscaler_jax.cost.residuals.residual_outputs`), when a consumer cannot fuse it (a
  matmul operand, a region's or a barrier's input), or when an expensive elementwise op (not in
  :data:`~nnscaler_jax.cost.residuals.CHEAP`) has several readers (XLA does not duplicate it).
  A cheap op read by several fusions is duplicated into each: its inputs are read once per
  reader. Free layout ops (``reshape``...) pass the need through.
- An op's **traffic** is the bytes of its materialised inputs plus its materialised outputs;
  everything else lives inside its fusion.

>>> import jax.numpy as jnp, flax.linen as nn
>>> from nnscaler_jax import trace
>>> class Chain(nn.Module):
...     @nn.compact
...     def __call__(self, x):
...         return nn.Dense(2, use_bias=False)(jnp.exp(jnp.tanh(x * 2.0) + 1.0))
>>> g = trace(Chain(), jnp.ones((4, 8)))
>>> io = fused_bytes(g)
>>> [(op.primitive, io[op.id]) for op in g.ops]  # x read once, exp's output written once
[('mul', 128.0), ('tanh', 0.0), ('add', 0.0), ('exp', 128.0), ('dot_general', 224.0)]
"""

from __future__ import annotations

from collections.abc import Mapping

from nnscaler_jax.cost.compute import FREE, MATMUL, is_reduction
from nnscaler_jax.cost.residuals import CHEAP, residual_outputs
from nnscaler_jax.ir.graph import DataflowMemo, Graph, Op

__all__ = ["BARRIER", "fused_bytes", "fusible"]

#: Ops XLA neither fuses into their consumers nor lets fuse their operands' producers.
BARRIER = frozenset("""
gather scatter scatter-add scatter_add scatter_mul scatter_min scatter_max sort top_k cumsum
cumprod cummax cummin cumlogsumexp dynamic_update_slice psum all_gather reduce_scatter
ppermute all_to_all psum_scatter random_bits random_seed random_wrap random_unwrap
rng_bit_generator threefry2x32 custom_call fused_attention fft cholesky triangular_solve eigh lu qr svd
""".split())  # noqa: SIM905 - a word list, as residuals' sets

_MEMO = DataflowMemo()


def fusible(op: Op) -> bool:
    """Whether XLA can fuse ``op`` into its consumers (an elementwise or layout op)."""
    return not (op.regions or op.primitive in MATMUL or op.primitive in BARRIER
                or is_reduction(op))


def fused_bytes(graph: Graph) -> Mapping[int, float]:
    """Op id -> bytes its fusion reads and writes for it (see the module docstring), region
    bodies included; free layout ops 0. Once per :attr:`Graph.dataflow`."""
    return _MEMO.get(graph, None, lambda: _fused_bytes(graph))


def _fused_bytes(graph: Graph) -> dict[int, float]:
    saved = residual_outputs(graph)
    out: dict[int, float] = {}
    _level(graph, saved, out)
    return out


def _level(graph: Graph, saved: Mapping[int, tuple[int, ...]], out: dict[int, float]) -> None:
    """Traffic of the ops of one graph level (a region body is its own level)."""
    producer: dict[int, Op] = {}
    readers: dict[int, list[Op]] = {}
    for op in graph.ops:
        for t in op.outputs:
            producer[t.id] = op
        for t in op.inputs:
            readers.setdefault(t.id, []).append(op)
    needed = {t.id for t in graph.outputs}
    for op in reversed(graph.ops):  # consumers first: a free op passes its need back
        if op.primitive in FREE and any(t.id in needed for t in op.outputs):
            needed.update(t.id for t in op.inputs)
        if not (fusible(op) or is_reduction(op)):  # a matmul, region or barrier reads buffers
            needed.update(t.id for t in op.inputs)
        needed.update(op.outputs[k].id for k in saved.get(op.id, ()))
        if fusible(op) and op.primitive not in CHEAP | FREE:  # not duplicated into readers
            needed.update(t.id for t in op.outputs if len(readers.get(t.id, ())) > 1)

    def in_memory(tid: int) -> bool:
        p = producer.get(tid)
        while p is not None and p.primitive in FREE and p.inputs:  # a bitcast of its input
            if tid in needed:
                break
            tid = p.inputs[0].id
            p = producer.get(tid)
        return p is None or not fusible(p) or tid in needed

    for op in graph.ops:
        for region in op.regions:
            _level(region, saved, out)
        if op.primitive in FREE:
            out[op.id] = 0.0
            continue
        ins = sum(t.nbytes for t in op.inputs if t.ndim and in_memory(t.id))  # (a scalar is a
        # kernel argument); a cheap op fused into several readers is computed in each
        if fusible(op):
            ins *= max([1, *(len(readers.get(t.id, ())) for t in op.outputs
                             if t.id not in needed)])
        outs = sum(t.nbytes for t in op.outputs if not fusible(op) or t.id in needed)
        out[op.id] = float(ins + outs)
