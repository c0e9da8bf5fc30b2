"""Compute cost of one op: FLOPs and bytes from shapes, a roofline against a device.

- ``dot_general``: ``2 x prod(annotated dim sizes)`` FLOPs; ``conv_general_dilated``: ``2 x
  output elements x window x input features per group``; both on the matrix units at the
  operand dtype's peak; backward is one forward-sized matmul per operand that needs a gradient
  (2x forward when both do).
- Everything else: one FLOP per output element on the vector units; in practice bound by memory
  traffic (inputs + outputs); backward about 1x forward.
- Pure layout ops (``reshape``, ``squeeze``, ``expand_dims``, ``broadcast_in_dim``) are free:
  XLA turns them into bitcasts or fuses them into their consumers.
- Region ops (``scan``, ``while``, ``cond``) are priced by their bodies; a ``scan`` body runs
  ``params['length']`` times (a ``while`` once: its trip count is unknown).

>>> from nnscaler_jax.ir.graph import Op, Tensor
>>> a, b = Tensor(0, (8, 16), "float32"), Tensor(1, (16, 4), "float32")
>>> op = Op(2, "dot_general", (a, b), (Tensor(3, (8, 4), "float32"),), "m k+, k+ n -> m n")
>>> op_flops(op)
1024.0
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from functools import lru_cache

import jax.numpy as jnp

from nnscaler_jax.ir.anno import parse_anno
from nnscaler_jax.ir.attention import FUSED
from nnscaler_jax.ir.graph import DataflowMemo, Graph, Op, Role, Tensor, dtype_itemsize

__all__ = ["FREE", "MATMUL", "MATRIX", "TRAINABLE", "attention_flops", "grad_sources",
           "grad_tensors", "is_float", "is_reduction", "itemsize", "op_bytes", "op_flops",
           "region_length", "ring_cost", "walk_weighted"]

MATMUL = frozenset({"dot_general", "conv_general_dilated"})
MATRIX = MATMUL | {FUSED}  # ops on the matrix units (a fused attention: two matmuls)
TRAINABLE = (None, "params", "param")  # variable collections that get gradients
FREE = frozenset({"reshape", "squeeze", "expand_dims", "broadcast_in_dim"})


def itemsize(t: Tensor) -> int:
    """Bytes per element of ``t`` (8 for extended dtypes such as rng keys)."""
    return dtype_itemsize(t.dtype)


def is_float(t: Tensor) -> bool:
    """Whether ``t`` can carry a gradient (a floating-point dtype)."""
    return _is_float(t.dtype)


@lru_cache(maxsize=256)
def _is_float(dtype: str) -> bool:
    """numpy's ``inexact`` as JAX sees it: ``bfloat16`` (an ml_dtypes type numpy does not class
    as floating) included; extended dtypes (rng keys) not."""
    try:
        return bool(jnp.issubdtype(dtype, jnp.inexact))
    except TypeError:
        return False


def is_reduction(op: Op) -> bool:
    """A reduction (``reduce_*``, ``argmax`` / ``argmin``): one kernel that writes its result."""
    return op.primitive.startswith(("reduce_", "argm"))


def numel(t: Tensor) -> int:
    return math.prod(t.shape)


def region_length(op: Op) -> int:
    """How many times a region op runs its body (``scan``: its length; others 1)."""
    if op.primitive == "scan":
        return int(op.params.get("length", 1))
    return 1


def op_flops(op: Op) -> float:
    """Forward FLOPs of one op, unsplit (region ops: their bodies x the scan length)."""
    if op.regions:
        body = sum(op_flops(o) for g in op.regions for o in g.ops)
        return body * region_length(op)
    if op.primitive == "conv_general_dilated":
        return _conv_flops(op)
    if op.primitive == FUSED:
        return attention_flops(op)
    if op.primitive in MATMUL and op.annotated:
        return _matmul_flops(op.anno, tuple(t.shape for t in op.inputs),
                             tuple(t.shape for t in op.outputs))
    if op.primitive in FREE:
        return 0.0
    return float(sum(numel(t) for t in op.outputs))


@lru_cache(maxsize=65536)
def _matmul_flops(anno: str, in_shapes: tuple, out_shapes: tuple) -> float:
    """``2 x`` the product of every identifier's size (each multiply-add once)."""
    return 2.0 * math.prod(parse_anno(anno).bind(list(in_shapes), list(out_shapes)).values())


def attention_flops(op: Op) -> float:
    """A fused attention block's forward FLOPs: its two matmuls (scores ``b g sq sk d`` and
    weighted sum ``b g sq sk dv``; a self-attention's shared ``s`` counts twice), the causal
    half only when causal (the kernel skips the tiles above the diagonal)."""
    sizes = op.dim_sizes()
    pairs = math.prod(n for name, n in sizes.items() if name not in ("d", "dv")) * sizes.get("s", 1)
    return 2.0 * pairs * (sizes["d"] + sizes["dv"]) / (2.0 if op.params.get("causal") else 1.0)


def ring_cost(seq: int, heads: int, head_dim: int, batch: int, n: int, dtype_bytes: int,
              causal: bool, *, kv_heads: int | None = None,
              layout: str = "ring") -> dict[str, int]:
    """The forward's cost on the busiest device, for the cost model.

    ``flops``: matmul FLOPs (``q k^T`` and ``p v``, ``2 x 2 b h d`` per query-key pair) of the
    chunk pairs the busiest device computes; a diagonal pair is computed whole (masked), a pair
    after the diagonal is skipped. Non-causal: ``4 b h d s^2 / n``. Causal ring: the last device
    computes ``n`` blocks of ``(s / n)^2`` -- the same as non-causal. Causal zigzag: every device
    computes ``2n + 1`` pairs of ``(s / 2n)^2`` (``2 (n - 1)`` off the diagonal, 3 on it), about
    half. The backward (custom VJP) recomputes the scores and adds ``dv, dp, dq, dk``: 2.5x the
    forward's FLOPs, ``2 (n - 1)`` ppermutes of K / V blocks plus ``2n`` of their float32
    gradient blocks.

    ``bytes_per_ppermute``: one K (or V) block, ``b (s / n) kv_heads d dtype_bytes``.
    ``ppermutes``: ``2 (n - 1)``, K and V each ``n - 1`` times.
    ``exchanges``: zigzag's half-block ppermutes into and out of zigzag order (two per q, k, v
    and output: 8; the backward the same for their gradients); 0 for ``"ring"``.

    Args:
        seq, heads, head_dim, batch: the global attention shape (batch as seen by the ring's
            devices: divide it first by any axis splitting it).
        n: the ring size.
        dtype_bytes: bytes of one K / V element.
        causal: causal mask (pairs after the diagonal skipped).
        kv_heads: K / V heads (grouped-query); ``heads`` by default.
        layout: ``"ring"`` or ``"zigzag"``.

    Returns:
        ``{"flops", "bytes_per_ppermute", "ppermutes", "exchanges"}``.

    >>> shape = dict(seq=64, heads=4, head_dim=8, batch=2, n=4, dtype_bytes=4)
    >>> ring_cost(**shape, causal=True, layout="zigzag")["flops"] / ring_cost(**shape,
    ...                                                                 causal=False)["flops"]
    0.5625
    """
    if layout not in ("ring", "zigzag"):
        raise ValueError(f"ring_cost: layout={layout!r}; expected 'ring' or 'zigzag'")
    kv_heads = heads if kv_heads is None else kv_heads
    per_pair = 4 * batch * heads * head_dim
    if not causal or layout == "ring":
        flops = per_pair * n * (seq // n) ** 2
    else:
        flops = per_pair * (2 * n + 1) * (seq // (2 * n)) ** 2
    return {"flops": flops,
            "bytes_per_ppermute": batch * (seq // n) * kv_heads * head_dim * dtype_bytes,
            "ppermutes": 2 * (n - 1), "exchanges": 8 if layout == "zigzag" else 0}


def _conv_flops(op: Op) -> float:
    """``2 x output elements x (kernel elements / output features)``: every output element is
    one dot product over a window of its group's input features (grouped and batch-grouped
    convolutions included: their kernel holds only one group's input features)."""
    out, kernel = op.outputs[0], op.inputs[1]
    spec = op.params.get("dimension_numbers")
    o_dim = spec.rhs_spec[0] if spec is not None else 0
    return 2.0 * numel(out) * numel(kernel) / kernel.shape[o_dim]


def op_bytes(op: Op) -> float:
    """Bytes read and written by one op, unsplit (0 for free layout ops)."""
    if op.regions:
        return sum(op_bytes(o) for g in op.regions for o in g.ops) * region_length(op)
    if op.primitive in FREE:
        return 0.0
    return float(sum(numel(t) * itemsize(t) for t in op.inputs + op.outputs))


def compute_dtype(op: Op) -> str:
    """The dtype whose peak applies: a matmul's operand dtype, else the first output's."""
    ts = op.inputs if op.primitive in MATRIX else op.outputs
    return ts[0].dtype if ts else "float32"


def needs_grad_locally(t: Tensor, input_grads: bool) -> bool:
    """A local guess: floating point, not a constant, and not an example input (unless asked)."""
    if not is_float(t) or t.role is Role.CONST or t.role is Role.RNG:
        return False
    return input_grads or t.role is not Role.INPUT


def grad_sources(graph: Graph) -> dict[int, int]:
    """Tensor id -> where its gradient would come from: bit 1 if it is (computed from) a
    trainable variable, bit 2 if from an example input; floating point only (an integer breaks
    the chain: top-k indices, their one-hot masks), region bodies included. Memoised per
    :attr:`~nnscaler_jax.ir.graph.Graph.dataflow`: do not change the result."""
    return _SOURCES.get(graph, None, lambda: _grad_sources(graph))


_SOURCES = DataflowMemo()


def _grad_sources(graph: Graph) -> dict[int, int]:
    src: dict[int, int] = {}
    for t in graph.inputs:
        if is_float(t) and t.role is Role.VARIABLE and t.collection in TRAINABLE:
            src[t.id] = 1
        elif is_float(t) and t.role is Role.INPUT:
            src[t.id] = 2
    for op in graph.walk():
        m = 0
        for t in op.inputs:
            m |= src.get(t.id, 0)
        if not m:
            continue
        for t in (*op.outputs, *(u for region in op.regions for u in region.inputs)):
            if is_float(t):
                src[t.id] = src.get(t.id, 0) | m
    return src


def grad_tensors(graph: Graph, input_grads: bool = False,
                 sources: dict[int, int] | None = None) -> frozenset[int]:
    """Ids of tensors that need a gradient: trainable variables (+ example inputs with
    ``input_grads``) and every floating-point value computed from them, region bodies included
    (``sources``: :func:`grad_sources` of ``graph`` when already computed; it is the same
    whichever way it comes, so the result is memoised per dataflow all the same)."""
    want = 3 if input_grads else 1
    return _SOURCES.get(graph, want, lambda: frozenset(
        t for t, m in (sources if sources is not None else grad_sources(graph)).items()
        if m & want))


def walk_weighted(graph: Graph, mult: int = 1) -> Iterator[tuple[Op, int]]:
    """``(op, times it runs per step)`` for every op, region bodies included (depth first)."""
    for op in graph.ops:
        yield op, mult
        for region in op.regions:
            yield from walk_weighted(region, mult * region_length(op))
