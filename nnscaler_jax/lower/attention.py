"""A fused attention op lowered: one ``shard_map`` over the mesh, each device's attention on its
own batch and heads, the sequences whole (the op's annotation freezes them).

On GPUs the device's part runs Pallas' Triton flash attention kernels
(:func:`~nnscaler_jax.lower.ring.flash_attention`: forward and backward kernels, the causal tiles
above the diagonal skipped, no score-sized buffer in memory, k / v kept at their own head count
for the backward); elsewhere (and where the kernel's tiling does not fit: a sequence that is not
a multiple of its 128-row blocks, q and v head dims that differ) the same arithmetic as the
block's ops, written once: the scores in float32, the scale, the causal mask, the softmax, the
weighted sum, cast to the block's output dtype. For the kernel the operands are laid out as
``[batch, sequence, heads, head dim]``: every shared axis (batch, kv heads) folded into the kv
heads, q's other free axes (a grouped-query group) after them. A sequence split over mesh axes
runs as ring attention over them (:mod:`~nnscaler_jax.lower.ring`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from nnscaler_jax.ir.graph import Op
from nnscaler_jax.layout import Layout
from nnscaler_jax.lower.ring import flash_attention, kernel_fits, ring_attention_local

__all__ = ["attention_reference", "ring_layout", "run_fused_attention"]

def _letters(names: Sequence[str], table: dict[str, str]) -> str:
    for n in names:
        table.setdefault(n, "abcdefghijklmnopqrstuvwxyz"[len(table)])
    return "".join(table[n] for n in names)


def _names(op: Op) -> tuple[list[list[str]], list[str]]:
    """The operands' and the output's axis names, a shared sequence ``s`` named by its role:
    ``sq`` on q and the output, ``sk`` on k and v."""
    anno = op.annotation
    ins = [[ax.dims[0].name for ax in o.axes] for o in anno.inputs]
    out = [ax.dims[0].name for ax in anno.outputs[0].axes]
    role = lambda names, r: [r if n == "s" else n for n in names]
    return [role(ins[0], "sq"), role(ins[1], "sk"), role(ins[2], "sk")], role(out, "sq")


def ring_layout(op: Op) -> str:
    """How a fused attention op split on its sequence runs (:mod:`.ring`): the layout its plan
    chose (``Plan.ring_layouts``, in the op's params), else ``"ring"``."""
    return op.params.get("ring_layout") or "ring"


def attention_reference(op: Op, q: Any, k: Any, v: Any) -> Any:
    """The block's arithmetic on (local) ``q``, ``k``, ``v`` laid out as the op's annotation."""
    (qn, kn, vn), on = _names(op)
    table: dict[str, str] = {}
    s_names = [n for n in qn if n != "d"] + ["sk"]
    qs, ks, ss = _letters(qn, table), _letters(kn, table), _letters(s_names, table)
    vs, os_ = _letters(vn, table), _letters(on, table)
    s = jnp.einsum(f"{qs},{ks}->{ss}", q, k, preferred_element_type=jnp.float32)
    s = s * op.params["scale"]
    if op.params["causal"]:
        n_q, n_k = q.shape[qn.index("sq")], k.shape[kn.index("sk")]
        keep = jnp.arange(n_q)[:, None] >= jnp.arange(n_k)[None, :]
        shape = [1] * s.ndim
        shape[s_names.index("sq")], shape[-1] = n_q, n_k
        s = jnp.where(keep.reshape(shape), s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    out = jnp.einsum(f"{ss},{vs}->{os_}", p, v)
    return out.astype(op.params["out_dtype"])


def _kernel_fits(op: Op, q: Any, k: Any, v: Any) -> bool:
    (qn, kn, vn), _ = _names(op)
    d, dv = q.shape[qn.index("d")], v.shape[vn.index("dv")]
    return (kernel_fits(q.shape[qn.index("sq")], d, dv)
            and kernel_fits(k.shape[kn.index("sk")], d, dv))


def _as_heads(op: Op, q: Any, k: Any, v: Any, attend: Any) -> Any:
    """``attend(q, k, v)`` on the op's operands laid out ``[1, seq, heads, dim]``: every shared
    axis (batch, kv heads) folded into the kv heads, q's group axes after them (q head ``j``
    reads kv head ``j // groups``); its output laid out back as the op's, in the op's dtype."""
    (qn, kn, vn), on = _names(op)
    shared = [n for n in kn if n not in ("sk", "d")]           # batch, kv heads
    group = [n for n in qn if n not in shared and n not in ("sq", "d")]
    qt = jnp.transpose(q, [qn.index(n) for n in ("sq", *shared, *group, "d")])
    kt = jnp.transpose(k, [kn.index(n) for n in ("sk", *shared, "d")])
    vt = jnp.transpose(v, [vn.index(n) for n in ("sk", *shared, "dv")])
    heads = lambda x: x.reshape(1, x.shape[0], -1, x.shape[-1])
    o = attend(heads(qt), heads(kt), heads(vt)).reshape(*qt.shape[:-1], vt.shape[-1])
    have = ["sq", *shared, *group, "dv"]
    return jnp.transpose(o, [have.index(n) for n in on]).astype(op.params["out_dtype"])


def _flash(op: Op, q: Any, k: Any, v: Any, interpret: bool = False) -> Any:
    """The block through Pallas' flash attention kernels (see the module docs)."""
    return _as_heads(op, q, k, v, lambda qh, kh, vh: flash_attention(
        qh, kh, vh, op.params["scale"], op.params["causal"], interpret))


def _on_gpu(lw: Any) -> bool:
    dev = lw.mesh.devices.flat[0] if hasattr(lw.mesh, "devices") else None
    return getattr(dev, "platform", "") in ("gpu", "cuda", "rocm")


def _ring(op: Op, axes: tuple[str, ...], n: int, q: Any, k: Any, v: Any, gpu: bool) -> Any:
    """The op's local blocks through :func:`~.ring.ring_attention_local` over ``axes``; on GPUs
    each chunk pair is a flash kernel where its tiles fit."""
    return _as_heads(op, q, k, v, lambda qh, kh, vh: ring_attention_local(
        qh, kh, vh, axis=axes, n=n, causal=op.params["causal"], layout=ring_layout(op),
        scale=op.params["scale"], kernel=gpu))


def run_fused_attention(lw: Any, op: Op, ins: Sequence[Any], in_lays: Sequence[Layout],
                        out_lays: Sequence[Layout]) -> list[Any]:
    """Run fused attention ``op`` on each device's batch and heads (``shard_map`` over the
    mesh; partial sums cannot arise: the op splits no reduced dim); a sequence split over mesh
    axes runs as ring attention over them (:func:`_ring`)."""
    gpu = _on_gpu(lw)
    (qn, _, _), _ = _names(op)
    axes = tuple(in_lays[0].dims[qn.index("sq")])
    n = math.prod(lw.mesh.shape[a] for a in axes)

    def body(q, k, v):
        if n > 1:
            return _ring(op, axes, n, q, k, v, gpu)
        if gpu and _kernel_fits(op, q, k, v):
            return _flash(op, q, k, v)
        return attention_reference(op, q, k, v)

    spec = lambda lay: Layout(lay.dims).to_pspec()  # (no partial sums: nothing is reduced)
    fn = lw.shard_map(body, tuple(spec(l) for l in in_lays),
                      spec(out_lays[0]))
    return [fn(*[jnp.asarray(x) for x in ins])]
