"""Co-sharded blocks lowered: a loop over chunks whose backward runs each chunk's forward again.

The block's inputs that carry the chunked dim are relaid out whole to the layout the block reads
them in (once, before the loop; their gradients back once, after it) and cut into k chunks, the
rest are read whole by every chunk; each chunk replays the block's ops on chunk-sized values
(shape params rewritten, :func:`~nnscaler_jax.lower.local.bind_local`) with the plan's layouts
as sharding constraints, and the outputs are stitched back. The chunks interleave with the
devices' parts: when the seed op splits the dim ``n`` ways over the mesh, chunk ``c`` holds rows
``c`` of every device's part (the dim viewed as ``(n, k, size / (n k))``), so a chunk keeps the
plan's sharding and no device idles while another computes (the same permutation for every
input and output, so the result does not depend on it). Custom-JVP calls inside a block
(``jax.nn.softmax``) are replayed op by op: their derivative is that of the ops, as a custom
JVP's must be. An iota counting along the chunked dim (a causal mask's positions) counts the
chunk's global positions: in that view, position ``r`` of chunk ``c`` is
``(r // cs) k cs + c cs + r % cs`` (``cs``: a chunk's rows per device).

On each device's blocks (``Lowering(manual=True)``: a tensor-parallel pipeline stage in one
program) the same view holds with one part: a device chunks its own block of the dim, chunk
``c`` being its rows ``c``, which are rows ``c`` of its part in the view above, so the
relayouts inside a chunk (explicit collectives over the mesh axes splitting other dims, or
this one) meet the other devices' chunks ``c``. A chunked input is read as its block's first
reader reads it; the block's other readers relay it from there. An iota counting along the
chunks is refused there (its global positions would need the device's offset).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.graph import Boundary, Op, Tensor
from nnscaler_jax.layout import Layout
from nnscaler_jax.lower.manual import grad_reduced
from nnscaler_jax.mesh.axes import mesh_axes
from nnscaler_jax.plan.layouts import plan_layouts
from nnscaler_jax.plan.plan import VALUE

__all__ = ["chunk_loop", "run_coshard"]


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


def _stacked(lw: Any, t: Tensor, x: Any, pos: int, lay: Layout | None = None) -> Any:
    """The chunks of input ``t`` laid out as ``lay`` (default: as ``t`` is), chunk axis
    unsplit: left to GSPMD, the reshapes of :func:`_split` can carry a split onto the chunk
    axis, and the loop's slice of one chunk then replicates the whole stack on every device
    (XLA's "involuntary full rematerialization"; seen on a Swin at 64 px)."""
    lay = lay if lay is not None else lw.layouts.get(t.id)
    if lay is None or lay.partial or not t.ndim or lw.manual:  # (manual: blocks already)
        return x
    sizes = mesh_axes(lw.mesh)
    if x.shape[pos + 1] % math.prod(sizes[a] for a in lay.dims[pos]):
        return x  # the chunk does not divide over the axes that split the dim
    return jax.lax.with_sharding_constraint(x, lw.sharding(Layout(((),) + lay.dims)))


def _block_view(lw: Any, seed: Op, idents: dict, ops: Sequence[Op], n: int) -> Any:
    """On each device's blocks: ``(layout, axis) -> parts``, how many of the seed's ``n``
    parts of the chunked dim (axis ``axis`` of a value laid out as ``layout``) its block
    holds: the view :func:`_split` / :func:`_merge` take (chunk ``c`` is rows ``c`` of each
    part, as the other values' chunks ``c``). A value must split the dim over a leading run
    of the seed's axes, and no iota may count along the chunks (its global positions would
    need the device's offset); else a ``PlanError``."""
    want = tuple(a for a, d in lw.plan_of(seed).split if d == idents[seed.id])
    for op in ops:
        if op.primitive == "iota" and \
                op.annotation.outputs[0].axis_of(idents[op.id]) == op.params["dimension"]:
            raise lw._not_manual(op, "an iota counting along a co-sharded block's chunks")
    sizes = mesh_axes(lw.mesh)

    def view(lay: Layout | None, a: int) -> int:
        axes = lay.dims[a] if lay is not None else ()  # (None: a constant, whole)
        if want[:len(axes)] != axes:
            raise PlanError(
                f"co-sharded block at '{seed.module_path or '<top>'}' on each device's blocks "
                f"(tensor-parallel stages in one program): a value splits its chunked dim "
                f"over {axes}, not over a leading run of its seed's axes {want}. Fix: run "
                "the stages one program each (Constraints(pipeline_executor='per-stage'))")
        return n // math.prod(sizes[x] for x in axes)
    return view


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


def _differentiable(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _chunk_grads(one: Any, c: Any, whole: dict, xs: list, cts: list) -> tuple[dict, list]:
    """Chunk ``c``'s gradients: ``({whole key: cotangent}, [chunked input's cotangent])``,
    from its forward run again (``one``) and its outputs' cotangents ``cts``."""
    keys = [key for key, x in whole.items() if _differentiable(x)]
    diff = [j for j, x in enumerate(xs) if _differentiable(x)]
    live = [j for j, ct in enumerate(cts) if ct is not None]

    def f(w, d):
        full = list(xs)
        for j, x in zip(diff, d, strict=True):
            full[j] = x
        ys = one(c, full, {**whole, **dict(zip(keys, w, strict=True))})
        return [ys[j] for j in live]
    _, pull = jax.vjp(f, [whole[key] for key in keys], [xs[j] for j in diff])
    gw, gd = pull([cts[j] for j in live])
    gx: list[Any] = [None] * len(xs)
    for j, g in zip(diff, gd, strict=True):
        gx[j] = g
    return dict(zip(keys, gw, strict=True)), gx


def chunk_loop(one: Any, k: int, stack: Any = list, prepare: Any = None,
               stack_out: Any = list) -> Any:
    """``(whole, chunked) -> stacked outputs``: ``one(c, chunk c's inputs, whole)`` for
    ``c < k``, in a loop. The loop has its own backward: chunk c's forward runs again and its
    gradient follows (as ``jax.checkpoint`` of each chunk would), the whole inputs' cotangents
    summed over the chunks, the chunked inputs' written into a stack. The buffers that
    backward fills start as zeros computed from the outputs' cotangents: ``lax.scan``'s own
    transpose starts from constant zeros, which XLA:GPU merges across loops of one shape and
    computes at the start of the step, keeping every co-sharded block's backward buffers live
    through the forward (Llama-3-8B at 128K: ~0.6 GiB per co-sharded layer). ``stack``: lays
    the chunked inputs' cotangent stacks out (a list, ``None`` for integer inputs).
    ``prepare``: ``whole -> whole as the chunks read it`` (int keys), run once before the
    forward's loop and once before the backward's, its gradient after the backward's: the
    whole inputs' relayouts (a weight's all-gather), which run in every chunk when left to
    the chunks (XLA does not hoist them out of the loop). ``stack_out``: lays out the
    outputs' cotangent stacks the backward's chunks read (as ``stack``; a stack split along
    its chunk axis is moved whole by an all-to-all in every chunk to slice one: Llama-3-8B
    cut to 2 layers at 128K, 137 GB a step)."""
    prepare = prepare or (lambda whole: whole)

    def forward(whole, chunked):
        if chunked:  # relaid out when the loop is reached (as in the backward, below)
            whole, _ = jax.lax.optimization_barrier((whole, chunked[0]))
        ready = prepare(whole)

        def body(carry, xs):
            return carry, one(xs[0], xs[1:], ready)
        return jax.lax.scan(body, None, [jnp.arange(k), *chunked], length=k)[1]

    @jax.custom_vjp
    def loop(whole, chunked):
        return forward(whole, chunked)

    def loop_fwd(whole, chunked):
        return forward(whole, chunked), (whole, chunked)

    def loop_bwd(res, cts):
        whole, chunked = res
        cts = stack_out([None if ct.dtype == jax.dtypes.float0 else ct
                         for ct in cts])  # None: integer outputs
        at = lambda xs, c: [None if x is None else
                            jax.lax.dynamic_index_in_dim(x, c, 0, keepdims=False) for x in xs]
        if all(ct is None for ct in cts):
            return {key: None for key in whole}, [None] * len(chunked)
        # zero, computed from a cotangent (its first element: one scalar gathered from the
        # device holding it), so the buffers below are made when the backward reaches the
        # loop; the whole inputs are relaid out then too (behind the barrier, which XLA cannot
        # fold to a constant nor see through): else XLA makes every loop's relayouts
        # (gathered weights) early in the step, all live at once
        zero = next(ct for ct in cts if ct is not None).reshape(-1)[0] * 0
        keys = [key for key, x in whole.items() if _differentiable(x)]
        ws, zero = jax.lax.optimization_barrier(([whole[key] for key in keys], zero))
        ready, pull = jax.vjp(lambda d: prepare({**whole, **dict(zip(keys, d, strict=True))}),
                              ws)
        gw = {key: jnp.broadcast_to(zero.astype(x.dtype), x.shape)
              for key, x in ready.items() if _differentiable(x)}
        bufs = stack([jnp.broadcast_to(zero.astype(x.dtype), x.shape) if _differentiable(x)
                      else None for x in chunked])

        def body(carry, c):
            gw, bufs = carry
            gw_c, gx_c = _chunk_grads(one, c, ready, at(chunked, c), at(cts, c))
            gw = {key: gw[key] + g for key, g in gw_c.items()}
            bufs = [b if g is None else jax.lax.dynamic_update_index_in_dim(b, g, c, 0)
                    for b, g in zip(bufs, gx_c, strict=True)]
            return (gw, bufs), None
        (gw, bufs), _ = jax.lax.scan(body, (gw, bufs), jnp.arange(k))
        (g,) = pull({key: gw[key] if key in gw else
                     np.zeros(x.shape, jax.dtypes.float0) for key, x in ready.items()})
        grads = dict(zip(keys, g, strict=True))
        return {key: grads.get(key) for key in whole}, bufs

    loop.defvjp(loop_fwd, loop_bwd)
    return loop


def _block_reads(lw: Any, ops: Sequence[Op], ids: Any) -> list[tuple]:
    """``(relayout key, tensor, layout, split)`` of each read of a tensor in ``ids`` by the
    block's ops, in order, once per key (as
    :meth:`~nnscaler_jax.lower.replay.Lowering.read_as` keys it)."""
    out: dict[Any, tuple] = {}
    for op in ops:
        split = lw.plan_of(op).split
        for t, lay in zip(op.inputs, plan_layouts(op, lw._plans, lw._sole)[0], strict=True):
            key = lw.relayout_key(t, lay, split) if t.id in ids else None
            if key is not None:
                out.setdefault(key, (key, t, lay, split))
    return list(out.values())


def _chunked_reads(lw: Any, ops: Sequence[Op], cut: Sequence[Tensor]) -> dict[int, tuple]:
    """Chunked input id -> ``(layout, split, keys)``: the layout the block's first reader of
    it reads it in (split as that reader is) and the relayout keys of the block's reads of it
    in that layout; ``(None, None, ())`` for an input no relayout reads (read as stored)."""
    out: dict[int, tuple] = {t.id: (None, None, ()) for t in cut}
    for key, t, lay, split in _block_reads(lw, ops, out):
        if out[t.id][0] is None:
            out[t.id] = (Layout(lay.dims), split, set())
        first = out[t.id]
        if Layout(lay.dims) == first[0]:
            first[2].add(key)
    return out


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
    cut = [(t, a) for t, a in zip(b.inputs, p["in_axes"], strict=True) if a is not None]
    # each chunked input relaid out once, whole, to the layout the block reads it in, then cut
    # into chunks: a stack relaid out inside the loop is moved whole in every chunk (XLA does
    # not hoist it; T5-8's tied LM head: its 1.5 GiB table all-to-all'd 4 times more a step)
    lays = _chunked_reads(lw, ops, [t for t, _ in cut])
    # (the devices' parts the chunk view interleaves; on blocks, those each block holds)
    view = (lambda lay, a: n) if not lw.manual else _block_view(lw, seed, idents, ops, n)
    # (on blocks, a reader's cotangent sum over the axes it splits is its own, in the loop)
    first = lambda t: lays[t.id][1] if not lw.manual else ()
    chunked = [_stacked(lw, t, _split(lw._read(env, t) if lays[t.id][0] is None else
                                      lw.read_as(env, t, lays[t.id][0], first(t)), a, k,
                                      view(lays[t.id][0] or lw.layouts.get(t.id), a)),
                        a, lays[t.id][0]) for t, a in cut]
    whole = {t.id: lw._read(env, t) for t, a in zip(b.inputs, p["in_axes"], strict=True)
             if a is None}
    outer = {key: v for key, v in env.items() if not isinstance(key, tuple)}
    cs = p["size"] // (n * k)
    reads = _block_reads(lw, ops, whole)

    def prepare(whole):  # the whole inputs' relayouts, once per loop: -(i + 1) <- reads[i]
        made = dict(whole)
        ready = {-(i + 1): lw.read_as(made, t, lay, split)
                 for i, (_, t, lay, split) in enumerate(reads)}
        covered = {t.id for _, t, _, _ in reads}
        return {**{key: x for key, x in whole.items() if key not in covered}, **ready}

    def one(c, xs, whole):
        inner = dict(outer)  # relayouts made outside are not reused inside (recomputed)
        inner.update({reads[-key - 1][0] if key < 0 else key: x for key, x in whole.items()})
        inner.update({t.id: x for (t, _), x in zip(cut, xs, strict=True)})
        inner.update({key: grad_reduced(x, key[3]) if lw.manual and key[3] else x
                      for (t, _), x in zip(cut, xs, strict=True) for key in lays[t.id][2]})
        if lw.manual:  # (each chunk is of the input's blocks as its first reader reads them)
            inner.update({("made", t.id): lays[t.id][0] for t, _ in cut
                          if lays[t.id][0] is not None})
        for op in ops:
            lw._op(op, inner, ways={idents[op.id]: k})
            if op.primitive == "iota":
                _count_chunk(op, idents[op.id], inner, c, k, cs)
        return [inner[t.id] for t in b.outputs]

    def stack(xs):  # a stack of the chunked inputs' cotangents, laid out as the inputs' chunks
        return [x if x is None else _stacked(lw, t, x, a, lays[t.id][0])
                for (t, a), x in zip(cut, xs, strict=True)]

    def stack_out(cts):  # the outputs' cotangents, as the outputs' chunks are laid out
        return [x if x is None else _stacked(lw, t, x, a)
                for t, a, x in zip(b.outputs, p["out_axes"], cts, strict=True)]

    ys = chunk_loop(one, k, stack, prepare, stack_out)(whole, chunked)
    for t, y, a in zip(b.outputs, ys, p["out_axes"], strict=True):
        lay = lw.layouts.get(t.id)  # (where the block's op made it: set as the loop ran)
        x = _merge(y, a, k, view(lay, a))
        env[t.id] = jax.lax.with_sharding_constraint(x, lw.sharding(lay)) \
            if lay is not None and t.ndim and not lw.manual else x
