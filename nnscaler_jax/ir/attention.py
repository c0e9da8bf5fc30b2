"""Attention blocks: ``softmax(scale q k^T + mask) v`` found in the graph, whatever the dtype and
however it is written.

A block is two ``dot_general`` ops and the ops between them:

- the **scores**: ``q`` and ``k`` contracted over one dim (the head dim), every other dim either
  shared (batch, heads) or free on one side: the query sequence (and, with grouped-query
  attention, the group) on ``q``'s side, the key sequence on ``k``'s;
- the **chain** from the scores to the probabilities: casts and transposes; multiplications or
  divisions by scalar constants (the scale); a mask that depends on positions and constants
  only (``select_n`` against a fill of at most -1e9, or an added bias); and a softmax over the
  key sequence, written out or ``jax.nn.softmax`` (``reduce_max``, ``stop_gradient``, ``sub``,
  ``exp``, ``reduce_sum``, ``div``);
- the **weighted sum**: the probabilities contracted with ``v`` over the key sequence.

Nothing the chain computes may be read outside the block. The mask is identified by sampling:
the constant-and-position subgraph that makes it is evaluated at sampled (query, key) positions
(:class:`_Sampler`), and must keep exactly the pairs with ``query >= key`` (causal) or every pair
(no mask). A chain with anything else (a soft-capping ``tanh``, a mask read from the batch, a
dropout) is not a block: it stays as written.

Found for the zoo's Llama and GPT, ``jax.nn.dot_product_attention`` and Flax's
``dot_product_attention``; transformers' Flax models read their mask from the batch and are not
blocks.

>>> import jax, jax.numpy as jnp, flax.linen as nn
>>> from nnscaler_jax import trace
>>> class Attn(nn.Module):
...     @nn.compact
...     def __call__(self, x):
...         q, k, v = (nn.DenseGeneral((4, 8), name=n)(x) for n in "qkv")
...         return jax.nn.dot_product_attention(q, k, v, is_causal=True)
>>> g = trace(Attn(), jnp.ones((2, 16, 32)))
>>> [(b.causal, round(b.scale, 4), b.q.shape, b.q_seq) for b in attention_blocks(g)]  # (q: a unit group axis)
[(True, 0.3536, (2, 16, 4, 1, 8), 1)]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import SimpleNamespace

import numpy as np

from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.graph import REMAT_KINDS, Graph, Op, Role, Tensor

__all__ = ["FUSED", "AttentionBlock", "attention_blocks", "fusable_blocks",
           "with_fused_attention"]

#: The primitive of an attention block run as one op (:func:`with_fused_attention`).
FUSED = "fused_attention"


@dataclass(frozen=True)
class AttentionBlock:
    """One attention block of a graph.

    Attributes:
        scores / weighted: ids of the two ``dot_general`` ops.
        ops: ids of every op the block replaces (scores, chain, the mask's ops only it reads,
            weighted sum), in program order.
        q, k, v: the operands as the block reads them (``q`` already scaled if the model scaled
            it before the scores); out: the weighted sum.
        q_seq, k_seq, v_seq: the sequence axis of ``q``, ``k`` and ``v``; head_dim: the
            contracted axis of ``q`` (``k_dim`` of ``k``); v_dim: ``v``'s value axis.
        scale: the product of the chain's scalar factors.
        causal: the mask keeps ``query >= key`` (False: no mask).
        module_path: the scores op's.
        anno: the annotation of the block as one op (:func:`with_fused_attention`): head dims
            frozen (``^``); batch and head axes free to split, and a self-attention's sequence
            ``s`` (query and key sequences of one length; otherwise ``sq^`` / ``sk^``).
    """

    scores: int
    weighted: int
    ops: tuple[int, ...]
    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    q_seq: int
    k_seq: int
    v_seq: int
    head_dim: int
    k_dim: int
    v_dim: int
    scale: float
    causal: bool
    module_path: str
    anno: str = ""


class _NotABlock(Exception):
    """The chain is not one this module identifies."""


_ELEMENTWISE = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
    "max": np.maximum, "min": np.minimum, "ge": np.greater_equal, "gt": np.greater,
    "le": np.less_equal, "lt": np.less, "eq": np.equal, "ne": np.not_equal,
    "and": np.logical_and, "or": np.logical_or, "not": np.logical_not, "neg": np.negative,
    "sqrt": np.sqrt, "rsqrt": lambda x: 1.0 / np.sqrt(x), "exp": np.exp, "log": np.log,
    "abs": np.abs, "pow": np.power,
}
_PASS = frozenset({"convert_element_type", "stop_gradient", "copy", "copy_p"})
_FILL = -1e9  # a masked score's fill: at most this


def _numpy_dtype(dtype) -> np.dtype:
    try:
        return np.dtype(str(dtype))
    except TypeError:
        return np.dtype("float32")  # bfloat16 and friends: sampled in float32


class _Sampler:
    """Values of a constant-and-position tensor at sampled indices (nothing materialised)."""

    def __init__(self, graph: Graph):
        self.producer = graph.producer
        self.inputs = {t.id: t for t in graph.inputs}
        self._const: dict[int, bool] = {}

    def const(self, t: Tensor) -> bool:
        """Whether ``t`` depends on constants and positions only (memoised: a mask's subgraph
        is asked about once per block that reads it)."""
        known = self._const.get(t.id)
        if known is None:
            op = self.producer.get(t.id)
            if op is None:
                src = self.inputs.get(t.id)
                known = (src is not None and src.role is Role.CONST) or \
                    (src is None and t.ndim == 0 and t.value is not None)
            else:
                known = not op.regions and all(self.const(x) for x in op.inputs)
            self._const[t.id] = known
        return known

    def at(self, t: Tensor, idx: np.ndarray) -> np.ndarray:
        """``t`` at the rows of ``idx`` (``[N, t.ndim]``)."""
        op = self.producer.get(t.id)
        if op is None:
            if t.value is None:
                raise _NotABlock(f"tensor {t.id} has no value")
            value = np.asarray(t.value)
            return np.broadcast_to(value, (len(idx),)) if value.ndim == 0 else \
                value[tuple(idx.T)]
        p, prim = op.params, op.primitive
        if prim == "iota":
            return idx[:, p["dimension"]].astype(_numpy_dtype(p["dtype"]))
        if prim == "broadcast_in_dim":
            (x,) = op.inputs
            sub = np.zeros((len(idx), x.ndim), np.int64)
            for k, d in enumerate(p["broadcast_dimensions"]):
                if x.shape[k] != 1:
                    sub[:, k] = idx[:, d]
            return self.at(x, sub)
        if prim == "reshape":
            (x,) = op.inputs[:1]
            flat = np.ravel_multi_index(tuple(idx.T), t.shape)
            return self.at(x, np.stack(np.unravel_index(flat, x.shape), axis=1))
        if prim == "transpose":
            (x,) = op.inputs
            sub = np.zeros_like(idx)
            for i, src in enumerate(p["permutation"]):
                sub[:, src] = idx[:, i]
            return self.at(x, sub)
        if prim in _PASS:
            v = self.at(op.inputs[0], idx)
            return v.astype(_numpy_dtype(p["new_dtype"])) if "new_dtype" in p else v
        if prim == "select_n":
            which, *cases = (self.at(x, idx) for x in op.inputs)
            return np.choose(which.astype(np.int64), cases)
        if prim == "integer_pow":
            return self.at(op.inputs[0], idx) ** p["y"]
        if prim in _ELEMENTWISE:
            return _ELEMENTWISE[prim](*(self.at(x, idx) for x in op.inputs))
        raise _NotABlock(f"'{prim}' in the mask")


def _samples(n_q: int, n_k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(query, key) positions: the corners, the diagonal's neighbours and random pairs."""
    fixed = [(0, 0), (0, 1), (1, 0), (1, 1), (n_q - 1, n_k - 1), (n_q - 1, 0), (0, n_k - 1),
             (n_q // 2, n_k // 2), (n_q // 2, n_k // 2 + 1), (n_q // 2 + 1, n_k // 2)]
    pairs = [(i, j) for i, j in fixed if 0 <= i < n_q and 0 <= j < n_k]
    pairs += [tuple(x) for x in rng.integers(0, [n_q, n_k], size=(48, 2))]
    pairs += [(i, min(i + 1, n_k - 1)) for i in rng.integers(0, n_q, size=16)]
    a = np.array(pairs, np.int64)
    return a[:, 0], a[:, 1]


class _Chain:
    """The walk from the scores to the probabilities (see the module docs)."""

    def __init__(self, graph: Graph, sampler: _Sampler, scores: Op):
        self.graph, self.sampler = graph, sampler
        self.ops: list[Op] = [scores]
        self.scale = 1.0
        # masks met on the way: (kind, tensor, case, perm) with kind "select" (``tensor`` the
        # predicate, kept where it equals ``case``), "fill" (a select's other branch) or "bias"
        self.keep: list[tuple[str, Tensor, int, list[int]]] = []
        self.k_axis: int | None = None  # the scores' axis the softmax reduces
        # the current tensor's axes -> the scores' (None: a unit axis a reshape added)
        self.perm: list[int | None] = list(range(scores.outputs[0].ndim))

    def sole(self, t: Tensor) -> Op:
        readers = self.graph.consumers.get(t.id, ())
        if len(readers) != 1:
            raise _NotABlock(f"tensor {t.id} has {len(readers)} readers")
        return readers[0]

    def other(self, op: Op, t: Tensor) -> Tensor:
        (x,) = [x for x in op.inputs if x.id != t.id] or [None]
        if x is None:
            raise _NotABlock(f"'{op.primitive}' reads the scores twice")
        return x

    def scalar(self, x: Tensor) -> float:
        if x.ndim or not self.sampler.const(x):
            raise _NotABlock("not a scalar constant")
        return float(self.sampler.at(x, np.zeros((1, 0), np.int64))[0])

    def step(self, t: Tensor) -> tuple[Tensor, bool]:
        """The next main tensor after ``t`` and whether the softmax was just taken."""
        readers = self.graph.consumers.get(t.id, ())
        if len(readers) == 2 and "reduce_max" in [op.primitive for op in readers]:
            return self.softmax(t, readers), True
        op = self.sole(t)
        prim = op.primitive
        self.ops.append(op)
        out = op.outputs[0]
        if prim in _PASS:
            return out, False
        if prim == "transpose":
            self.perm = [self.perm[i] for i in op.params["permutation"]]
            return out, False
        if prim == "reshape":  # only unit axes added or dropped
            kept = [(t.shape[a], self.perm[a]) for a in range(t.ndim) if t.shape[a] != 1]
            perm = []
            for n in out.shape:
                if n == 1:
                    perm.append(None)
                elif not kept or kept[0][0] != n:
                    raise _NotABlock("a reshape that moves the scores' axes")
                else:
                    perm.append(kept.pop(0)[1])
            self.perm = perm
            return out, False
        if prim in ("mul", "div"):
            c = self.scalar(self.other(op, t))
            if prim == "div" and op.inputs[0].id != t.id:
                raise _NotABlock("the scores divide a constant")
            self.scale *= c if prim == "mul" else 1.0 / c
            return out, False
        if prim == "select_n" and len(op.inputs) == 3 and op.inputs[0].id != t.id:
            pred, a, b = op.inputs
            fill = b if a.id == t.id else a
            if t.id not in (a.id, b.id) or not self.sampler.const(pred) or \
                    not self.sampler.const(fill):
                raise _NotABlock("a select on data")
            perm = list(self.perm)
            self.keep.append(("select", pred, 0 if a.id == t.id else 1, perm))
            self.keep.append(("fill", fill, 0, perm))
            self.own(pred)
            self.own(fill)
            return out, False
        if prim == "add":
            bias = self.other(op, t)
            if not self.sampler.const(bias):
                raise _NotABlock("a bias read from data")
            self.keep.append(("bias", bias, 0, list(self.perm)))  # 0 kept, <= -1e9 masked
            self.own(bias)
            return out, False
        raise _NotABlock(f"'{prim}' between the scores and the softmax")

    def own(self, t: Tensor) -> None:
        """The ops making constant ``t`` that only the block reads join it."""
        op = self.sampler.producer.get(t.id)
        ids = {o.id for o in self.ops}
        if op is None or op.id in ids:
            return
        if all(r.id in ids for r in self.graph.consumers.get(t.id, ())):
            self.ops.append(op)
            for x in op.inputs:
                self.own(x)

    def reduced_axis(self, op: Op) -> int:
        axes = tuple(op.params.get("axes", ()))
        if len(axes) != 1 or self.perm[axes[0]] is None:
            raise _NotABlock("a softmax over several axes")
        return self.perm[axes[0]]

    def follow(self, t: Tensor, allowed: frozenset[str]) -> tuple[Tensor, list[Op]]:
        """Through sole readers in ``allowed`` (casts, broadcasts): (last tensor, ops)."""
        ops = []
        while True:
            op = self.sole(t)
            if op.primitive not in allowed:
                return t, ops
            ops.append(op)
            t = op.outputs[0]

    def softmax(self, x: Tensor, readers: Sequence[Op]) -> Tensor:
        rmax = next(op for op in readers if op.primitive == "reduce_max")
        sub = next(op for op in readers if op is not rmax)
        self.k_axis = self.reduced_axis(rmax)
        self.ops.append(rmax)
        while sub.primitive in ("transpose", *_PASS):  # the scores moved before the sub
            if sub.primitive == "transpose":
                self.perm = [self.perm[i] for i in sub.params["permutation"]]
            self.ops.append(sub)
            x = sub.outputs[0]
            sub = self.sole(x)
        if sub.primitive != "sub" or sub.inputs[0].id != x.id:
            raise _NotABlock("no scores minus their row max")
        m, path = self.follow(rmax.outputs[0], frozenset({"max", "broadcast_in_dim",
                                                          "stop_gradient", "transpose", *_PASS}))
        for op in path:
            if op.primitive == "max":  # the max with a constant (-inf): its scalar operand
                self.scalar(min(op.inputs, key=lambda x: x.ndim))
        if self.sole(m) is not sub or sub.inputs[1].id != m.id:
            raise _NotABlock("the row max does not meet the scores")
        e, casts = self.follow(sub.outputs[0], frozenset(_PASS))
        exp = self.sole(e)
        if exp.primitive != "exp":
            raise _NotABlock("no exp after the max")
        self.ops += [*path, sub, *casts, exp]
        e = exp.outputs[0]
        readers = self.graph.consumers.get(e.id, ())
        e2, casts2 = (e, []) if len(readers) == 2 else self.follow(e, frozenset(_PASS))
        readers = self.graph.consumers.get(e2.id, ())
        rsum = [op for op in readers if op.primitive == "reduce_sum"]
        div = [op for op in readers if op.primitive == "div"]
        if len(readers) != 2 or len(rsum) != 1 or len(div) != 1 or div[0].inputs[0].id != e2.id:
            raise _NotABlock("no normalisation after the exp")
        if self.reduced_axis(rsum[0]) != self.k_axis:
            raise _NotABlock("the sum and the max reduce different axes")
        s, path2 = self.follow(rsum[0].outputs[0], frozenset({"broadcast_in_dim", "transpose",
                                                              *_PASS}))
        if self.sole(s) is not div[0] or div[0].inputs[1].id != s.id:
            raise _NotABlock("the row sum does not divide the exps")
        self.ops += [*casts2, rsum[0], *path2, div[0]]
        return div[0].outputs[0]


def _contracting(op: Op) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...],
                                  tuple[int, ...]]:
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    return tuple(lc), tuple(rc), tuple(lb), tuple(rb)


def _free(ndim: int, *used: tuple[int, ...]) -> list[int]:
    taken = {a for u in used for a in u}
    return [a for a in range(ndim) if a not in taken]


def _walk(chain: _Chain, scores: Op) -> tuple[Op, Tensor] | None:
    """(the weighted sum, the probabilities it reads) after the chain from ``scores``."""
    t, done = scores.outputs[0], False
    try:
        for _ in range(64):
            t, done = chain.step(t)
            if done:
                break
        if not done:
            return None
        while True:  # casts and transposes up to the weighted sum
            op = chain.sole(t)
            if op.primitive == "dot_general":
                return op, t
            if op.primitive not in _PASS and op.primitive != "transpose":
                return None
            chain.step(t)
            t = op.outputs[0]
    except _NotABlock:
        return None


def _mask(sampler: _Sampler, chain: _Chain, q_out: int, n_q: int, n_k: int,
          rng: np.random.Generator) -> bool | None:
    """Whether the chain's masks keep exactly ``query >= key`` (True) or every pair (False),
    sampled at (query, key) positions of the scores' axes ``q_out`` / ``chain.k_axis``; None:
    another mask."""
    qi, kj = _samples(n_q, n_k, rng)
    kept, fills = np.ones(len(qi), bool), []
    for kind, tensor, case, perm in chain.keep:
        idx = np.zeros((len(qi), tensor.ndim), np.int64)
        for cur, src in enumerate(perm[:tensor.ndim]):
            idx[:, cur] = qi if src == q_out else kj if src == chain.k_axis else 0
        try:
            values = sampler.at(tensor, idx)
        except (_NotABlock, IndexError, ValueError, KeyError, TypeError):
            return None
        if kind == "select":
            kept &= values.astype(np.int64) == case
        elif kind == "fill":
            fills.append(values)
        else:
            if not ((values == 0) | (values <= _FILL)).all():
                return None
            kept &= values == 0
    if any(not (f[~kept] <= _FILL).all() for f in fills):
        return None
    causal = n_q == n_k and not kept.all() and bool((kept == (qi >= kj)).all())
    if not kept.all() and not causal:
        return None
    return causal


def _annotation(scores: Op, weighted: Op, chain: _Chain, q_is_lhs: bool, q_seq: int,
                k_seq: int, p_side: int, v_seq: int) -> str:
    """The fused op's annotation: the scores' axes named (batch ``b<i>``, the query sequence
    ``sq^``, q's other free axes ``g<j>``, the key sequence ``sk^``), the head dims ``d^`` /
    ``dv^`` frozen too; v's and the output's axes named through the chain's axis map.

    Self-attention (query and key sequences of one length) names both sequences ``s``, free to
    split: q, k, v and the output split on the sequence together is context parallelism (the
    op's lowering rotates K / V around the devices, :mod:`~nnscaler_jax.lower.ring`)."""
    lc, rc, lb, rb = _contracting(scores)
    wl, wr, wlb, wrb = _contracting(weighted)
    lhs, rhs = scores.inputs
    l_free, r_free = _free(lhs.ndim, lc, lb), _free(rhs.ndim, rc, rb)
    n_batch = len(lb)
    s_names = [f"b{i}" for i in range(n_batch)]
    free_q = l_free if q_is_lhs else r_free
    q_t, k_t = (lhs, rhs) if q_is_lhs else (rhs, lhs)
    sq, sk = ("s", "s") if q_t.shape[q_seq] == k_t.shape[k_seq] else ("sq^", "sk^")
    for side_free, is_q in ((l_free, q_is_lhs), (r_free, not q_is_lhs)):
        for a in side_free:
            s_names.append((sq if a == q_seq else f"g{free_q.index(a)}") if is_q else sk)

    def operand(t: Tensor, batch: tuple[int, ...], contract: int, free_names: dict) -> str:
        return " ".join(f"b{batch.index(a)}" if a in batch else "d^" if a == contract
                        else free_names[a] for a in range(t.ndim))

    (q_t, q_b, q_c), (k_t, k_b, k_c) = ((lhs, lb, lc), (rhs, rb, rc)) if q_is_lhs else \
        ((rhs, rb, rc), (lhs, lb, lc))
    q_names = {a: s_names[n_batch + (l_free.index(a) if q_is_lhs else len(l_free)
                                     + r_free.index(a))] for a in free_q}
    p_names = [s_names[i] if i is not None else f"u{j}" for j, i in enumerate(chain.perm)]
    v_t = weighted.inputs[1 - p_side]
    v_b, p_b = (wlb, wrb)[1 - p_side], (wlb, wrb)[p_side]
    v_names = [p_names[p_b[v_b.index(a)]] if a in v_b else sk if a == v_seq else "dv^"
               for a in range(v_t.ndim)]
    p_free = _free(len(chain.perm), (wl, wr)[p_side], p_b)
    out_names = [p_names[a] for a in p_b]
    for side in (0, 1):  # the lhs's free axes, then the rhs's
        out_names += [p_names[a] for a in p_free] if side == p_side else ["dv^"]
    return (f"{operand(q_t, q_b, q_c[0], q_names)}, {operand(k_t, k_b, k_c[0], {k_seq: sk})},"
            f" {' '.join(v_names)} -> {' '.join(out_names)}")


def _block(graph: Graph, sampler: _Sampler, scores: Op, rng: np.random.Generator
           ) -> AttentionBlock | None:
    lc, rc, lb, rb = _contracting(scores)
    if len(lc) != 1:
        return None
    lhs, rhs = scores.inputs
    l_free, r_free = _free(lhs.ndim, lc, lb), _free(rhs.ndim, rc, rb)
    chain = _Chain(graph, sampler, scores)
    found = _walk(chain, scores)
    if found is None:
        return None
    weighted, t = found
    wl, wr, wlb, wrb = _contracting(weighted)
    p_side = 0 if weighted.inputs[0].id == t.id else 1
    p_contract = (wl, wr)[p_side]
    if len(p_contract) != 1 or chain.perm[p_contract[0]] != chain.k_axis:
        return None
    # the scores' axes: batch dims, then lhs free, then rhs free
    n_batch = len(lb)
    k_axis = chain.k_axis
    if k_axis < n_batch:
        return None
    if k_axis < n_batch + len(l_free):  # the key sequence comes from the lhs
        k_t, q_t, k_seq, q_free, k_c, q_c = lhs, rhs, l_free[k_axis - n_batch], r_free, lc, rc
        if len(l_free) != 1:
            return None
    else:
        k_t, q_t, k_seq, q_free, k_c, q_c = rhs, lhs, r_free[k_axis - n_batch - len(l_free)], \
            l_free, rc, lc
        if len(r_free) != 1:
            return None
    if not q_free:
        return None
    n_k = k_t.shape[k_seq]
    same = [a for a in q_free if q_t.shape[a] == n_k]
    q_seq = same[-1] if same else q_free[-1]
    v_t = weighted.inputs[1 - p_side]
    v_seq = (wl, wr)[1 - p_side][0]
    v_free = _free(v_t.ndim, (wl, wr)[1 - p_side], (wlb, wrb)[1 - p_side])
    if len(v_free) != 1:
        return None
    # the mask: sampled at (query, key) positions of the scores' axes
    q_out = n_batch + (l_free.index(q_seq) if q_t is lhs else len(l_free) + r_free.index(q_seq))
    n_q = q_t.shape[q_seq]
    causal = _mask(sampler, chain, q_out, n_q, n_k, rng)
    if causal is None:
        return None
    ids = {op.id for op in chain.ops} | {weighted.id}
    outputs = {x.id for x in graph.outputs}
    if any(any(r.id not in ids for r in graph.consumers.get(o.id, ())) or o.id in outputs
           for op in chain.ops for o in op.outputs):
        return None  # something the block computes is read outside it
    order = [op.id for op in graph.ops if op.id in ids]
    anno = _annotation(scores, weighted, chain, q_t is lhs, q_seq, k_seq, p_side, v_seq)
    return AttentionBlock(
        scores=scores.id, weighted=weighted.id, ops=tuple(order), q=q_t, k=k_t, v=v_t,
        out=weighted.outputs[0], q_seq=q_seq, k_seq=k_seq, v_seq=v_seq, head_dim=q_c[0],
        k_dim=k_c[0], v_dim=v_free[0], scale=chain.scale, causal=bool(causal),
        module_path=scores.module_path, anno=anno)


def attention_blocks(graph: Graph) -> list[AttentionBlock]:
    """Every attention block of ``graph``'s top level, in program order (see the module docs)."""
    sampler = _Sampler(graph)
    rng = np.random.default_rng(0)
    out = []
    for op in graph.ops:
        if op.primitive == "dot_general" and not op.regions:
            b = _block(graph, sampler, op, rng)
            if b is not None:
                out.append(b)
    return out



def _fusable(graph: Graph, b: AttentionBlock) -> tuple[int, ...] | None:
    """The boundaries the block's op stays in (remat ones holding all of it), or None when a
    call bound whole at lowering (a custom derivative, a jit) holds part of the block and
    something else (it would run the block's ops as written)."""
    by_id = {x.id: x for x in graph.boundaries}
    ops = {op.id: op for op in graph.ops}
    inside = [set(ops[i].boundary) for i in b.ops]
    keep = []
    for bid in ops[b.scores].boundary:
        members = [op.id for op in graph.ops if bid in op.boundary]
        whole = set(members) <= set(b.ops)
        if by_id[bid].kind in REMAT_KINDS and all(bid in s for s in inside):
            keep.append(bid)
        elif not whole:
            return None
    return tuple(keep)


def fusable_blocks(graph: Graph) -> tuple[int, ...]:
    """The scores op ids of the attention blocks :func:`with_fused_attention` can fuse."""
    return tuple(b.scores for b in attention_blocks(graph) if _fusable(graph, b) is not None)


def with_fused_attention(graph: Graph, seeds: Sequence[int],
                         ring_layout: str | Mapping[int, str] = "") -> Graph:
    """``graph`` with each attention block whose scores op id is in ``seeds`` replaced by one
    :data:`FUSED` op: ``(q, k, v) -> out`` under the block's annotation (head dims frozen, a
    self-attention's sequence ``s`` free to split), its scale, mask and ``ring_layout`` (how a
    split sequence runs, ``"ring"`` / ``"zigzag"``: for every op, or per scores op id, an op
    not listed ``"ring"``; empty: the search's choice, see
    :meth:`~nnscaler_jax.cost.model.CostModel.ring_layout`) in the op's params, placed where the
    weighted sum was, with the scores op's id. Idempotent (a graph that has fused ops is
    returned as it is).

    Raises:
        PlanError: a seed that is not the scores op of a fusable block of ``graph`` (a plan
            made for another model).
    """
    if not seeds or any(op.primitive == FUSED for op in graph.ops):
        return graph
    want = set(seeds)
    blocks = {b.weighted: b for b in attention_blocks(graph) if b.scores in want}
    stays = {b.weighted: _fusable(graph, b) for b in blocks.values()}
    missing = want - {b.scores for w, b in blocks.items() if stays[w] is not None}
    if missing:
        raise PlanError(f"fused attention: op(s) {sorted(missing)} are not the scores of an "
                        "attention block this graph can run as one op (a plan made for another "
                        "model?); plan again with Constraints(attention='fused')")
    drop = {i for b in blocks.values() for i in b.ops}
    scores = {op.id: op for op in graph.ops if op.id in want}
    ops = []
    for op in graph.ops:
        b = blocks.get(op.id)
        if b is not None:
            s = scores[b.scores]
            params = {"scale": b.scale, "causal": b.causal, "out_dtype": b.out.dtype,
                      "ring_layout": ring_layout if isinstance(ring_layout, str)
                      else ring_layout.get(b.scores, "ring")}
            ops.append(Op(b.scores, FUSED, (b.q, b.k, b.v), (b.out,), b.anno,
                          module_path=s.module_path, boundary=stays[op.id],
                          eqn=SimpleNamespace(primitive=None, params=params)))
        elif op.id not in drop:
            ops.append(op)
    used = {bid for op in ops for bid in op.boundary}
    return replace(graph, ops=tuple(ops),
                   boundaries=tuple(x for x in graph.boundaries if x.id in used))
