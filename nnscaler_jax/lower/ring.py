"""Ring attention: attention with the sequence split over a mesh axis, K / V rotated around the ring.

The algorithm (Liu et al., "Ring Attention with Blockwise Transformers", 2023). q, k, v are
``[batch, seq, heads, head_dim]``; the sequence is split ``n`` ways over the mesh axis ``axis``.
Inside a ``jax.shard_map`` manual over ``axis`` only (the other mesh axes stay automatic, so the
plan may still split batch or heads over them), device ``i`` keeps its query block and the K / V
block it holds travels one step around the ring per step: device ``j`` sends to ``j + 1``
(``jax.lax.ppermute``), so at step ``t`` device ``i`` holds the K / V of device ``(i - t) mod n``.
Each step attends its query block to the held K / V block (a *pair*: the pair's normalised output
and row log-sum-exp) and folds that into an online softmax in float32: the running output and
log-sum-exp, each side weighted by ``exp(lse_side - lse_new)``. A pair runs as XLA ops (its scores
exist whole), or on GPUs as Pallas' Triton flash kernels (``kernel=True``: forward with its
log-sum-exp, backward kernels given the whole rows' output and log-sum-exp; no score-sized buffer).
:func:`ring_attention_local` is the per-device body, for a ``shard_map`` the caller already has
(a plan's fused attention op, :mod:`nnscaler_jax.lower.attention`).

Causal masking works on chunks with global chunk ids: a (query chunk, key chunk) pair is computed
whole when the key chunk comes before the query chunk, with the lower-triangular mask when they are
the same chunk, and skipped (``lax.switch``, nothing computed) when the key chunk comes after.

Layouts (:data:`Layout`):

- ``"ring"``: device ``i`` holds chunk ``i`` of ``n``. Causal work is uneven: device ``i`` computes
  ``i`` full blocks and one diagonal block, so the last device sets the pace (as slow as non-causal).
- ``"zigzag"``: the sequence is cut into ``2n`` chunks and device ``i`` holds chunks ``i`` and
  ``2n - 1 - i`` (:func:`zigzag_permute`), so every device computes the same causal work: on each
  off-diagonal step 2 of its 4 chunk pairs, on the diagonal step 3. Callers see natural order:
  each device exchanges its blocks for its zigzag chunks first (two ppermutes of half a block per
  operand) and the output back after; :func:`zigzag_permute` gives the whole-sequence order.

Grouped-query attention: k / v may have fewer heads ``hk`` dividing q's ``h``; q head ``j`` reads
kv head ``j // (h / hk)`` (``jnp.repeat(k, h // hk, axis=2)``, the grouping of ``models/llama.py``).
The groups are an einsum dim (``bqngd,bknd``): K / V travel and are held at their own head count
(the kernels read them repeated per group; a kv head's gradient sums its group's).

Per device (``b`` batch, ``s`` sequence, ``n`` ring size, ``hk`` kv heads, ``h`` heads, ``d``
head dim, all local sizes before the automatic axes split them further):

- memory: its q, k, v blocks, the K / V block in flight (``2 b (s / n) hk d`` elements each), the
  accumulators (float32, ``b (s / n) h (dv + 1)``) and, for XLA pairs, one pair's scores
  ``b h (s / n)^2`` (zigzag: ``(s / 2n)^2``); kernel pairs keep none -- O(s / n), never the whole
  sequence.
- communication: ``n - 1`` ppermutes of the K block and ``n - 1`` of the V block per forward, each
  ``b (s / n) hk d`` elements, neighbour to neighbour. The backward (``grad="ring"``, a custom VJP)
  rotates K and V again (``n - 1`` each) and their gradient accumulators (float32) ``n`` times each,
  the last bringing them home; ``grad="autodiff"`` differentiates the forward loop instead (the
  transposed ppermutes run backwards, and the scan keeps every step's K / V block: O(s) memory).
- compute: ``4 b h d`` FLOPs per (query row, key row) pair computed; see :func:`ring_cost`.

>>> import jax, jax.numpy as jnp
>>> mesh = jax.make_mesh((8,), ("seq",), devices=jax.devices()[:8])
>>> q = k = v = jnp.ones((1, 16, 2, 4))
>>> ring_attention(q, k, v, mesh=mesh, axis="seq").shape
(1, 16, 2, 4)
>>> ring_cost(seq=16, heads=2, head_dim=4, batch=1, n=8, dtype_bytes=4, causal=False)
{'flops': 1024, 'bytes_per_ppermute': 64, 'ppermutes': 14, 'exchanges': 0}
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Literal, get_args

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from nnscaler_jax.cost.compute import ring_cost  # (priced there; re-exported: the ring's cost)
from nnscaler_jax.mesh.axes import auto_view, is_explicit

__all__ = [
    "GradMode",
    "Layout",
    "flash_attention",
    "kernel_fits",
    "ring_attention",
    "ring_attention_local",
    "ring_cost",
    "zigzag_permute",
    "zigzag_unpermute",
]

Layout = Literal["ring", "zigzag"]
GradMode = Literal["ring", "autodiff"]

_NEG = -1e30  # a masked score: exp(_NEG - m) == 0 in float32 for any real row max m
_FULL, _DIAG, _SKIP = 0, 1, 2


# Layouts

def zigzag_permute(x: jax.Array, n: int, axis: int) -> jax.Array:
    """``x`` with its ``axis`` cut into ``2n`` chunks, reordered so part ``i`` of ``n`` holds chunks
    ``i`` and ``2n - 1 - i``.

    Args:
        x: any array whose ``axis`` divides by ``2n``.
        n: the number of devices the axis will be split over.
        axis: the sequence axis.

    Returns:
        ``x`` reordered, same shape.

    >>> zigzag_permute(jnp.arange(8), 2, 0).tolist()
    [0, 1, 6, 7, 2, 3, 4, 5]
    """
    axis = axis % x.ndim
    size = x.shape[axis]
    if size % (2 * n):
        raise ValueError(_divisibility_error("zigzag_permute", size, 2 * n))
    c = size // (2 * n)
    parts = x.reshape(x.shape[:axis] + (2, n, c) + x.shape[axis + 1:])
    first = jax.lax.index_in_dim(parts, 0, axis, keepdims=False)  # chunks 0 .. n-1
    second = jnp.flip(jax.lax.index_in_dim(parts, 1, axis, keepdims=False), axis)  # 2n-1 .. n
    return jnp.stack([first, second], axis + 1).reshape(x.shape)


def zigzag_unpermute(x: jax.Array, n: int, axis: int) -> jax.Array:
    """The inverse of :func:`zigzag_permute`: natural order back.

    >>> x = jnp.arange(12)
    >>> bool((zigzag_unpermute(zigzag_permute(x, 3, 0), 3, 0) == x).all())
    True
    """
    axis = axis % x.ndim
    size = x.shape[axis]
    if size % (2 * n):
        raise ValueError(_divisibility_error("zigzag_unpermute", size, 2 * n))
    c = size // (2 * n)
    parts = x.reshape(x.shape[:axis] + (n, 2, c) + x.shape[axis + 1:])
    first = jax.lax.index_in_dim(parts, 0, axis + 1, keepdims=False)
    second = jnp.flip(jax.lax.index_in_dim(parts, 1, axis + 1, keepdims=False), axis)
    return jnp.concatenate([first, second], axis).reshape(x.shape)


def _chunk_ids(layout: Layout, dev: jax.Array, n: int) -> list[jax.Array]:
    """Global chunk ids of the chunks device ``dev`` holds, in the order it holds them."""
    if layout == "ring":
        return [dev]
    return [dev, 2 * n - 1 - dev]


def _zigzag_perms(n: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The two permutations that bring device ``i``'s natural chunks ``2i`` (first) and
    ``2i + 1`` (second) to their zigzag holders: chunk ``c`` goes to ``c`` if ``c < n`` else
    ``2n - 1 - c``. Each is one-to-one (every device receives one even and one odd chunk)."""
    home = lambda c: c if c < n else 2 * n - 1 - c
    return [(i, home(2 * i)) for i in range(n)], [(i, home(2 * i + 1)) for i in range(n)]


def _ring_perm(n: int) -> list[tuple[int, int]]:
    """The rotation: device ``j`` sends its block to ``j + 1``, so at step ``t`` device ``i`` holds
    the block of ``(i - t) mod n`` (what :func:`_local_attention` assumes)."""
    return [(j, (j + 1) % n) for j in range(n)]


# Errors

def _divisibility_error(what: str, size: int, parts: int) -> str:
    return (f"{what}: the sequence length {size} does not divide into {parts} chunks; pad the "
            f"sequence to a multiple of {parts} (ring: n devices, zigzag: 2n chunks)")


def _check(q: jax.Array, k: jax.Array, v: jax.Array, mesh: Mesh, axis: str, layout: str,
           grad: str) -> int:
    if layout not in get_args(Layout):
        raise ValueError(f"ring_attention: layout={layout!r}; expected one of {get_args(Layout)}")
    if grad not in get_args(GradMode):
        raise ValueError(f"ring_attention: grad={grad!r}; expected one of {get_args(GradMode)}")
    if axis not in mesh.shape:
        raise ValueError(f"ring_attention: axis {axis!r} is not a mesh axis; the mesh has "
                         f"{dict(mesh.shape)}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or k.shape != v.shape:
        raise ValueError(f"ring_attention: q, k, v must be [batch, seq, heads, head_dim] with k and "
                         f"v alike; got q {q.shape}, k {k.shape}, v {v.shape}")
    b, s, h, d = q.shape
    if k.shape[0] != b or k.shape[1] != s or k.shape[3] != d or h % k.shape[2]:
        raise ValueError(f"ring_attention: k/v {k.shape} do not match q {q.shape}: same batch, seq "
                         f"and head_dim, and kv heads dividing q's heads (grouped-query)")
    n = mesh.shape[axis]
    parts = n if layout == "ring" else 2 * n
    if s % parts:
        raise ValueError(_divisibility_error(f"ring_attention(layout={layout!r})", s, parts))
    return n


# Per-device chunk pairs. Layouts: q [b, c, h, d], k / v [b, c, hk, d] (grouped-query: q head j
# reads kv head j // (h / hk)), outputs [b, c, h, dv] float32, row statistics [b, h, c] float32.
# A pair's forward gives its normalised output and log-sum-exp; the online softmax merges them.

def _grouped(q: jax.Array, hk: int) -> jax.Array:
    return q.reshape(q.shape[:2] + (hk, -1, q.shape[-1]))


def _xla_scores(q: jax.Array, k: jax.Array, scale: float, diag: bool) -> jax.Array:
    s = jnp.einsum("bqngd,bknd->bngqk", _grouped(q, k.shape[2]), k,
                   preferred_element_type=jnp.float32) * scale
    if diag:
        c = q.shape[1]
        s = jnp.where(jnp.tril(jnp.ones((c, c), bool)), s, _NEG)
    return s


def _xla_forward(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, diag: bool) -> tuple:
    """One pair's ``(output, log-sum-exp)`` by XLA ops (the pair's scores exist whole)."""
    s = _xla_scores(q, k, scale, diag)
    m = s.max(-1)
    p = jnp.exp(s - m[..., None])
    l = p.sum(-1)
    o = jnp.einsum("bngqk,bknd->bqngd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    o = o / jnp.einsum("bngq->bqng", l)[..., None]
    b, c, h = q.shape[:3]
    return o.reshape(b, c, h, v.shape[-1]), (m + jnp.log(l)).reshape(b, h, c)


def _xla_backward(q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, do: jax.Array,
                  lse: jax.Array, delta: jax.Array, scale: float, diag: bool) -> tuple:
    """One pair's ``(dq, dk, dv)`` (float32) from the whole rows' log-sum-exp and
    ``delta = rowsum(do * out)``."""
    del out
    hk = k.shape[2]
    stats = lambda x: x.reshape(x.shape[0], hk, -1, x.shape[-1])  # [b, h, c] -> [b, hk, g, c]
    p = jnp.exp(_xla_scores(q, k, scale, diag) - stats(lse)[..., None])
    do_g = _grouped(do, hk)
    dv = jnp.einsum("bngqk,bqngd->bknd", p, do_g)
    dp = jnp.einsum("bqngd,bknd->bngqk", do_g, v, preferred_element_type=jnp.float32)
    ds = p * (dp - stats(delta)[..., None]) * scale
    dq = jnp.einsum("bngqk,bknd->bqngd", ds, k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bngqk,bqngd->bknd", ds, _grouped(q, hk), preferred_element_type=jnp.float32)
    return dq.reshape(q.shape), dk, dv


_LOG2E = math.log2(math.e)


def _repeat_kv(x: jax.Array, h: int) -> jax.Array:
    return jnp.repeat(x, h // x.shape[2], axis=2)


def _kernel_forward(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, diag: bool,
                    interpret: bool = False) -> tuple:
    """One pair through Pallas' Triton flash attention (its log-sum-exp is in base 2)."""
    from jax.experimental.pallas.ops.gpu import attention as pallas

    h = q.shape[2]
    o, lse2 = pallas.mha(q, _repeat_kv(k, h), _repeat_kv(v, h), None, sm_scale=scale,
                         causal=diag, interpret=interpret, return_residuals=True)
    return o.astype(jnp.float32), lse2 / _LOG2E


def _kernel_backward(q: jax.Array, k: jax.Array, v: jax.Array, out: jax.Array, do: jax.Array,
                     lse: jax.Array, delta: jax.Array, scale: float, diag: bool,
                     interpret: bool = False) -> tuple:
    """One pair's gradients by Pallas' backward kernels, given the whole rows' output and
    log-sum-exp (the kernel recomputes ``delta`` from them); a kv head's gradient sums its
    group's."""
    from jax.experimental.pallas.ops.gpu import attention as pallas

    del delta
    h, hk = q.shape[2], k.shape[2]
    # k / v repeated again, after the output's cotangent: else XLA merges these repeats with
    # the forward's and keeps the repeated copies from the forward to here (Llama-3-8B at
    # 128K: 2 x 96 MiB more per layer and device, measured with XLA:GPU)
    k, v, do = jax.lax.optimization_barrier((k, v, do))
    res = (q, _repeat_kv(k, h), _repeat_kv(v, h), None, out.astype(q.dtype), lse * _LOG2E)
    dq, dk, dv, _ = pallas._mha_backward(scale, diag, pallas.BlockSizes.get_default(), "triton",
                                          None, 2, None, interpret, False, False, res,
                                          do.astype(q.dtype))
    fold = lambda x: x.astype(jnp.float32).reshape(x.shape[:2] + (hk, -1, x.shape[-1])).sum(3)
    return dq.astype(jnp.float32), fold(dk), fold(dv)


def kernel_fits(chunk: int, head_dim: int, v_head_dim: int) -> bool:
    """Whether Pallas' flash kernels take a pair of ``chunk``-row blocks: whole 128-row tiles,
    one head dim for q, k and v, a multiple of 16 up to 256."""
    return chunk % 128 == 0 and head_dim == v_head_dim and head_dim % 16 == 0 \
        and head_dim <= 256


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float, causal: bool,
                    interpret: bool = False) -> jax.Array:
    """``softmax(q k^T * scale [+ causal mask]) v`` on one device by Pallas' Triton flash
    kernels, grouped-query: q ``[b, s, h, d]``, k / v ``[b, s, hk, d]`` with ``hk`` dividing
    ``h``. The kernels take one head count, so k / v are repeated per group inside the forward
    and the backward; the backward keeps q, k, v, the output and the log-sum-exp (the same
    pair functions as ring attention's)."""
    return _kernel_forward(q, k, v, scale, causal, interpret)[0].astype(q.dtype)


def _flash_fwd(q, k, v, scale, causal, interpret):
    out, lse = _kernel_forward(q, k, v, scale, causal, interpret)
    out = out.astype(q.dtype)
    return out, (q, k, v, out, lse)


def _flash_bwd(scale, causal, interpret, res, dout):
    q, k, v, out, lse = res
    dq, dk, dv = _kernel_backward(q, k, v, out, dout, lse, None, scale, causal, interpret)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


flash_attention.defvjp(_flash_fwd, _flash_bwd)


def _merge(acc: tuple, pair: tuple) -> tuple:
    """The online softmax: two normalised partial outputs weighted by their row sums."""
    (o, lse), (o2, lse2) = acc, pair
    new = jnp.logaddexp(lse, lse2)
    w = lambda x: jnp.einsum("bhq->bqh", jnp.exp(x - new))[..., None]
    return o * w(lse) + o2 * w(lse2), new


def _pair(causal: bool, fn: Callable, acc: tuple, qid: jax.Array, kid: jax.Array, *args) -> tuple:
    """``fn`` on one chunk pair: whole, diagonal-masked or skipped, by the chunks' global ids."""
    if not causal:
        return fn(acc, *args, diag=False)
    case = jnp.where(kid < qid, _FULL, jnp.where(kid == qid, _DIAG, _SKIP))
    return jax.lax.switch(case, [lambda a, *xs: fn(a, *xs, diag=False),
                                 lambda a, *xs: fn(a, *xs, diag=True),
                                 lambda a, *xs: a], acc, *args)


@dataclasses.dataclass(frozen=True, slots=True)
class _Ring:
    """What the per-device body needs: the ring's axis and size, the mask, layout and scale,
    and whether pairs run as flash kernels (``kernel``; ``interpret``: Pallas interpret mode)."""

    axis: str | tuple[str, ...]
    n: int
    causal: bool
    layout: Layout
    scale: float
    kernel: bool = False
    interpret: bool = False

    @property
    def parts(self) -> int:
        """Chunks per device: 1 (ring) or 2 (zigzag)."""
        return 1 if self.layout == "ring" else 2

    def varying(self, x: jax.Array) -> jax.Array:
        """``x`` typed as differing across the ring (shard_map's varying-axes check)."""
        return jax.lax.pcast(x, self.axis, to="varying")

    def forward(self, q, k, v, diag: bool) -> tuple:
        if self.kernel:
            return _kernel_forward(q, k, v, self.scale, diag, self.interpret)
        return _xla_forward(q, k, v, self.scale, diag)

    def backward(self, q, k, v, out, do, lse, delta, diag: bool) -> tuple:
        if self.kernel:
            return _kernel_backward(q, k, v, out, do, lse, delta, self.scale, diag,
                                    self.interpret)
        return _xla_backward(q, k, v, out, do, lse, delta, self.scale, diag)

    def permute(self, x):
        """One step around the ring (a pytree of blocks)."""
        return jax.lax.ppermute(x, self.axis, _ring_perm(self.n))

    def to_zigzag(self, x: jax.Array) -> jax.Array:
        """Device ``i``'s natural chunks ``2i, 2i + 1`` (sequence axis 1) exchanged for its
        zigzag chunks ``i, 2n - 1 - i``: two ppermutes of half a block."""
        first, second = jnp.split(x, 2, 1)
        p_even, p_odd = _zigzag_perms(self.n)
        got_even = jax.lax.ppermute(first, self.axis, p_even)   # chunk i or 2n-1-i, even one
        got_odd = jax.lax.ppermute(second, self.axis, p_odd)
        even_dev = jax.lax.axis_index(self.axis) % 2 == 0      # chunk i is even iff i is
        return jnp.concatenate([jnp.where(even_dev, got_even, got_odd),
                                jnp.where(even_dev, got_odd, got_even)], 1)

    def from_zigzag(self, x: jax.Array) -> jax.Array:
        """The inverse of :meth:`to_zigzag`: each device's natural chunks back."""
        lo, hi = jnp.split(x, 2, 1)            # chunks i and 2n - 1 - i
        even_dev = jax.lax.axis_index(self.axis) % 2 == 0
        even, odd = jnp.where(even_dev, lo, hi), jnp.where(even_dev, hi, lo)
        p_even, p_odd = _zigzag_perms(self.n)
        inv = lambda perm: [(b, a) for a, b in perm]
        return jnp.concatenate([jax.lax.ppermute(even, self.axis, inv(p_even)),
                                jax.lax.ppermute(odd, self.axis, inv(p_odd))], 1)


def _ring_forward(r: _Ring, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple:
    """The local output block and, per query chunk, its float32 output and log-sum-exp."""
    parts, n = r.parts, r.n
    dev = jax.lax.axis_index(r.axis)
    qs = jnp.split(q, parts, 1)
    b, c, h, _ = qs[0].shape
    init = (jnp.zeros((b, c, h, v.shape[-1]), jnp.float32), jnp.full((b, h, c), _NEG, jnp.float32))
    qids = _chunk_ids(r.layout, dev, n)
    block = lambda acc, q, k, v, diag: _merge(acc, r.forward(q, k, v, diag))

    def step(t, accs, kv):
        kids = _chunk_ids(r.layout, (dev - t) % n, n)
        ks, vs = jnp.split(kv[0], parts, 1), jnp.split(kv[1], parts, 1)
        accs = list(accs)
        for a in range(parts):
            for bi in range(parts):
                accs[a] = _pair(r.causal, block, accs[a], qids[a], kids[bi], qs[a], ks[bi], vs[bi])
        return tuple(accs)

    def body(t, carry):
        accs, kv = carry
        return step(t, accs, kv), r.permute(kv)

    accs = tuple(tuple(r.varying(x) for x in init) for _ in range(parts))
    accs, kv = jax.lax.fori_loop(0, n - 1, body, (accs, (k, v)))
    accs = step(n - 1, accs, kv)
    outs, lse = [o for o, _ in accs], [x for _, x in accs]
    return jnp.concatenate(outs, 1).astype(q.dtype), (outs, lse)


def _ring_backward(r: _Ring, res: tuple, dout: jax.Array) -> tuple:
    """dq, dk, dv: K / V rotate again, their float32 gradients travel with them and come home."""
    q, k, v, out, lse = res
    parts, n = r.parts, r.n
    dev = jax.lax.axis_index(r.axis)
    qs = jnp.split(q, parts, 1)
    outs = [x.astype(jnp.float32) for x in jnp.split(out, parts, 1)]
    dos = [x.astype(jnp.float32) for x in jnp.split(dout, parts, 1)]
    deltas = [jnp.einsum("bqhd->bhq", do * o) for do, o in zip(dos, outs, strict=True)]
    qids = _chunk_ids(r.layout, dev, n)

    def block(acc, q, k, v, out, do, lse, delta, diag):
        grads = r.backward(q, k, v, out, do, lse, delta, diag)
        return tuple(a + g for a, g in zip(acc, grads, strict=True))

    def step(t, dqs, kv, dkv):
        kids = _chunk_ids(r.layout, (dev - t) % n, n)
        ks, vs = jnp.split(kv[0], parts, 1), jnp.split(kv[1], parts, 1)
        dks, dvs = list(jnp.split(dkv[0], parts, 1)), list(jnp.split(dkv[1], parts, 1))
        dqs = list(dqs)
        for a in range(parts):
            for bi in range(parts):
                dqs[a], dks[bi], dvs[bi] = _pair(
                    r.causal, block, (dqs[a], dks[bi], dvs[bi]), qids[a], kids[bi],
                    qs[a], ks[bi], vs[bi], outs[a], dos[a], lse[a], deltas[a])
        return tuple(dqs), (jnp.concatenate(dks, 1), jnp.concatenate(dvs, 1))

    def body(t, carry):
        dqs, kv, dkv = carry
        dqs, dkv = step(t, dqs, kv, dkv)
        return dqs, r.permute(kv), r.permute(dkv)

    dqs = tuple(r.varying(jnp.zeros(x.shape, jnp.float32)) for x in qs)
    dkv = tuple(r.varying(jnp.zeros(x.shape, jnp.float32)) for x in (k, v))
    dqs, kv, dkv = jax.lax.fori_loop(0, n - 1, body, (dqs, (k, v), dkv))
    dqs, dkv = step(n - 1, dqs, kv, dkv)
    dk, dv = r.permute(dkv)  # the n-th step brings them home
    dq = jnp.concatenate(dqs, 1)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _make_local(r: _Ring, grad: GradMode) -> Callable:
    """The per-device body: local q, k, v blocks in, the local output block out."""
    if grad == "autodiff":
        return lambda q, k, v: _ring_forward(r, q, k, v)[0]

    @jax.custom_vjp
    def local(q, k, v):
        return _ring_forward(r, q, k, v)[0]

    def local_fwd(q, k, v):
        out, (_, lse) = _ring_forward(r, q, k, v)
        return out, (q, k, v, out, lse)  # the output kept in q's dtype, as flash attention

    local.defvjp(local_fwd, functools.partial(_ring_backward, r))
    return local


# API

def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, mesh: Mesh, axis: str,
                   causal: bool = True, layout: Layout = "ring", scale: float | None = None,
                   grad: GradMode = "ring") -> jax.Array:
    """``softmax(q k^T * scale [+ causal mask]) v`` with the sequence split over ``axis``.

    Args:
        q: ``[batch, seq, heads, head_dim]``, natural sequence order.
        k: ``[batch, seq, kv_heads, head_dim]``; ``kv_heads`` divides ``heads`` (grouped-query:
            q head ``j`` reads kv head ``j // (heads / kv_heads)``).
        v: like ``k``.
        mesh: the mesh; only ``axis`` is manual inside, the other axes stay automatic.
        axis: the mesh axis the sequence is split over (``n`` devices, the ring).
        causal: mask key positions after the query position.
        layout: ``"ring"`` (device ``i`` holds chunk ``i`` of ``n``) or ``"zigzag"`` (chunks ``i``
            and ``2n - 1 - i`` of ``2n``; inputs and output are still in natural order).
        scale: the score scale; ``1 / sqrt(head_dim)`` by default.
        grad: ``"ring"`` (a custom VJP that rotates K / V and their gradients again, O(s / n)
            memory) or ``"autodiff"`` (differentiate the forward loop).

    Returns:
        ``[batch, seq, heads, head_dim]`` in q's dtype, natural order, sequence split over ``axis``.
    """
    n = _check(q, k, v, mesh, axis, layout, grad)
    gpu = mesh.devices.flat[0].platform in ("gpu", "cuda", "rocm")
    local = functools.partial(ring_attention_local, axis=axis, n=n, causal=causal, layout=layout,
                              scale=scale, grad=grad, kernel=gpu)
    spec = PartitionSpec(None, axis, None, None)
    # Auto axis types, as the plan's lowering runs: shard_map moves the sequence onto ``axis``
    # and GSPMD keeps the other axes' splits.
    auto = auto_view(mesh)
    fn = jax.shard_map(local, mesh=auto, in_specs=(spec, spec, spec), out_specs=spec,
                       axis_names=frozenset({axis}))
    context = jax.sharding.get_abstract_mesh()
    if not context.empty and is_explicit(context):
        # under ``jax.set_mesh`` of an Explicit mesh: run Auto inside, hand back q's typed sharding
        return jax.sharding.auto_axes(fn, out_sharding=jax.typeof(q).sharding.spec)(q, k, v)
    return fn(q, k, v)


def ring_attention_local(q: jax.Array, k: jax.Array, v: jax.Array, *,
                         axis: str | tuple[str, ...], n: int, causal: bool = True,
                         layout: Layout = "ring", scale: float | None = None,
                         grad: GradMode = "ring", kernel: bool = False,
                         interpret: bool = False) -> jax.Array:
    """One device's part of :func:`ring_attention`, inside a ``shard_map`` manual over ``axis``.

    ``q``, ``k``, ``v`` are this device's blocks, ``[batch, seq / n, heads, head_dim]`` (``v``'s
    head dim may differ), block ``i`` of the natural order on the ``i``-th device of ``axis``
    (a tuple of axes: their devices major to minor, as a ``PartitionSpec`` entry lists them).
    ``"zigzag"`` exchanges the blocks for chunks ``i, 2n - 1 - i`` first (two ppermutes of half
    a block per operand) and the output back after, so callers see natural order either way.
    ``kernel``: each chunk pair through Pallas' Triton flash attention (GPUs; forward with its
    log-sum-exp, backward kernels given the whole rows' statistics) where :func:`kernel_fits`
    its chunks, else XLA ops (the pair's scores exist whole); ``interpret``: Pallas interpret
    mode (tests without a GPU). Returns the local output block ``[batch, seq / n, heads,
    v_head_dim]`` in q's dtype.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    chunk = q.shape[1] // (2 if layout == "zigzag" else 1)
    kernel = kernel and kernel_fits(chunk, q.shape[-1], v.shape[-1])
    r = _Ring(axis, n, causal, layout, scale, kernel, interpret)
    local = _make_local(r, grad)
    if layout == "zigzag":
        q, k, v = (r.to_zigzag(x) for x in (q, k, v))
        return r.from_zigzag(local(q, k, v))
    return local(q, k, v)
