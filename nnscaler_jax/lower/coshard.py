"""Co-sharded blocks lowered: a ``lax.scan`` over chunks, each chunk under ``jax.checkpoint``.

The block's inputs that carry the chunked dim are cut into k chunks, the rest are read whole by
every chunk; each chunk replays the block's ops on chunk-sized values (shape params rewritten,
:func:`~nnscaler_jax.lower.local.bind_local`) with the plan's layouts as sharding constraints,
and the outputs are stitched back. The chunks interleave with the devices' parts: when the seed
op splits the dim ``n`` ways over the mesh, chunk ``c`` holds rows ``c`` of every device's part
(the dim viewed as ``(n, k, size / (n k))``), so a chunk keeps the plan's sharding and no
device idles while another computes (the same permutation for every input and output, so the
result does not depend on it). Custom-JVP calls inside a block (``jax.nn.softmax``) are replayed
op by op: their derivative is that of the ops, as a custom JVP's must be. An iota counting
along the chunked dim (a causal mask's positions) counts the chunk's global positions: in that
view, position ``r`` of chunk ``c`` is ``(r // cs) k cs + c cs + r % cs`` (``cs``: a chunk's
rows per device).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.graph import Boundary, Op, Tensor
from nnscaler_jax.layout import Layout
from nnscaler_jax.mesh.axes import mesh_axes
from nnscaler_jax.plan.plan import VALUE

__all__ = ["run_coshard"]


def _split(x: Any, pos: int, k: int, n: int) -> Any:
    """``x``'s axis ``pos`` as k chunks, leading: ``(k, ..., size / k, ...)``."""
    shape = x.shape
    c = shape[pos] // (n * k)
    x = x.reshape(shape[:pos] + (n, k, c) + shape[pos + 1:])
    x = jnp.moveaxis(x, pos + 1, 0)
    return x.reshape((k,) + shape[:pos] + (n * c,) + shape[pos + 1:])


def _merge(y: Any, pos: int, k: int, n: int) -> Any:
    """The inverse of :func:`_split` (``y``: the chunks stacked on a leading axis)."""
    shape = y.shape[1:]
    c = shape[pos] // n
    y = y.reshape((k,) + shape[:pos] + (n, c) + shape[pos + 1:])
    y = jnp.moveaxis(y, 0, pos + 1)
    return y.reshape(shape[:pos] + (n * k * c,) + shape[pos + 1:])


def _stacked(lw: Any, t: Tensor, x: Any, pos: int) -> Any:
    """The chunks of input ``t`` laid out as ``t`` is, chunk axis unsplit: left to GSPMD, the
    reshapes of :func:`_split` can carry a split onto the chunk axis, and the loop's slice of
    one chunk then replicates the whole stack on every device (XLA's "involuntary full
    rematerialization"; seen on a Swin at 64 px)."""
    lay = lw.layouts.get(t.id)
    if lay is None or lay.partial or not t.ndim:
        return x
    sizes = mesh_axes(lw.mesh)
    if x.shape[pos + 1] % math.prod(sizes[a] for a in lay.dims[pos]):
        return x  # the chunk does not divide over the axes that split the dim
    return jax.lax.with_sharding_constraint(x, lw.sharding(Layout(((),) + lay.dims)))


def _seed_ways(lw: Any, seed: Op, ident: str) -> int:
    plan = lw.plan_of(seed)
    sizes = mesh_axes(lw.mesh)
    return math.prod(sizes[a] for a, d in plan.split if d == ident and d != VALUE)


def _count_chunk(op: Op, ident: str, env: dict, c: Any, k: int, cs: int) -> None:
    """An iota of chunk ``c`` counting along the chunked dim: its global positions (see the
    module docs) instead of ``0 .. n cs``."""
    t = op.outputs[0]
    if op.annotation.outputs[0].axis_of(ident) != op.params["dimension"]:
        return  # counts along another dim: the chunk's values are the whole one's
    r = env[t.id]
    env[t.id] = ((r // cs) * (k * cs) + c.astype(r.dtype) * cs + r % cs).astype(r.dtype)


def run_coshard(lw: Any, ops: Sequence[Op], env: dict, b: Boundary) -> None:
    """Run the block ``ops`` (boundary ``b``) chunk by chunk; its outputs land in ``env``."""
    p = b.eqn.params
    k, idents = p["chunks"], p["idents"]
    seed = next(op for op in ops if op.id == p["seed"])
    n = _seed_ways(lw, seed, idents[seed.id])
    if p["size"] % (n * k):
        raise PlanError(
            f"co-sharded block at '{seed.module_path or '<top>'}' ({len(ops)} ops around "
            f"'{seed.primitive}'): its dim '{idents[seed.id]}' of size {p['size']} is split "
            f"{n} ways over the mesh and cannot run as {k} chunks per device; use a chunk "
            f"count dividing {p['size'] // n}")
    ins = [lw._read(env, t) for t in b.inputs]
    chunked = [_stacked(lw, t, _split(x, a, k, n), a) for t, x, a
               in zip(b.inputs, ins, p["in_axes"], strict=True) if a is not None]
    outer = {key: v for key, v in env.items() if not isinstance(key, tuple)}

    cs = p["size"] // (n * k)

    @jax.checkpoint
    def one(xs):
        c, xs = xs[0], xs[1:]
        inner = dict(outer)  # relayouts made outside are not reused inside (recomputed)
        it = iter(xs)
        for t, a, x in zip(b.inputs, p["in_axes"], ins, strict=True):
            inner[t.id] = next(it) if a is not None else x
        for op in ops:
            lw._op(op, inner, ways={idents[op.id]: k})
            if op.primitive == "iota":
                _count_chunk(op, idents[op.id], inner, c, k, cs)
        return [inner[t.id] for t in b.outputs]

    _, ys = jax.lax.scan(lambda carry, xs: (carry, one(xs)), None,
                         [jnp.arange(k), *chunked], length=k)
    for t, y, a in zip(b.outputs, ys, p["out_axes"], strict=True):
        x = _merge(y, a, k, n)
        lay = lw.layouts.get(t.id)
        env[t.id] = jax.lax.with_sharding_constraint(x, lw.sharding(lay)) \
            if lay is not None and t.ndim else x
