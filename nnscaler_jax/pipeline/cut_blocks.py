"""The blocks of a cut pipeline program and the per-device loop that runs its step table.

:class:`~nnscaler_jax.pipeline.hetero.CutProgram` traces the micro-batch program and cuts it
into *segments*: the pipelined chunks ``0 .. C-1`` and, for schedules with all-device blocks
(``interlaced``), an embedding segment before chunk 0 and a head segment (head + loss) after
the last chunk. :func:`local_step` is the body of its ``jax.shard_map``: a ``lax.fori_loop``
over the step table (:func:`~nnscaler_jax.pipeline.loop_tables.loop_tables`) in which each
device runs, by ``lax.switch`` on the table's block code, one of

- ``F``: its chunk's forward (the last chunk adds the loss unless a head segment follows);
- ``B``: ``jax.vjp`` of the chunk recomputed from its saved input: parameter gradients and the
  cotangent of its input, seeded by the next chunk's (or the head's, or the loss's);
- ``B`` / ``G`` of a split backward (``zb-h1``, :mod:`~nnscaler_jax.pipeline.split_backward`):
  ``B`` the input's cotangent only, keeping what the weight gradients read in a buffer of the
  schedule's pending ``G`` s; ``G`` the chunk's weight gradients from it;
- ``N``: a forward without gradient (recycling, ``nf1b``): the model's outputs of the last
  chunk go back to chunk 0 as its inputs for the next pass (pass 0 reads the batch; ``F`` reads
  the last pass's), nothing is kept for a backward;
- ``E`` / ``H`` / ``W``: the embedding forward, the head's forward + loss + backward, the
  embedding backward, each on the stage holding its data (stage 0; the last chunk's stage;
  stage 0).

After each step the activations go to the next stage and the cotangents to the previous one
with ``lax.ppermute``, each only at the steps where some stage receives one (the tables say
which), so a step without transfers in one direction does not wait on that collective.

Gradients of parameters several segments read (tied embeddings) are summed over the stages,
the loss is counted on the stage that computes it, both averaged over the data axes.

Collections (:mod:`nnscaler_jax.pipeline.mutable`): the loop carries the stage's packed
collections ``[virtual, width]``; ``F`` reads its chunk's and replaces them with the new values
its segment returns, keeping the ones it read for its ``B`` (``[virtual, M, width]``), which
reads those and drops what it makes; the other blocks leave them alone.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore

from nnscaler_jax.pipeline.chunks import pack, packing, run_chunk, unpack, widths
from nnscaler_jax.pipeline.in_graph import exchange
from nnscaler_jax.pipeline.loop_tables import CODES
from nnscaler_jax.pipeline.mutable import average
from nnscaler_jax.pipeline.split_backward import split_backward

__all__ = ["local_step", "run_segment"]


def _value(env: dict, v: Any) -> Any:
    return v.val if isinstance(v, jcore.Literal) else env[v]


def run_segment(prog: Any, seg: int, pvec: dict, shared: list, cin: dict, batch: list,
                fresh: Any = True, kvec: dict | None = None) -> tuple[dict, Any, dict]:
    """Segment ``seg``'s forward: ``(packed values it passes on, loss or 0, its chunk's new
    collections)`` (``kvec``: the chunk's packed collections, ``prog.coll_pack``).

    The last segment passes on the model's outputs packed for recycling (``prog.r_pack``) or
    zeros. Chunk 0 of a recycling program reads the module inputs from the batch when
    ``fresh`` (a bool, traced or not), else unpacked from ``cin`` (the last pass's outputs).
    """
    cut = prog.cut
    cj = cut.jaxpr
    invars, n_x = cj.jaxpr.invars, len(prog.x_vars)
    params = [(invars[j], x) for j, x in zip(prog.shared, shared, strict=True)]
    c = seg - prog.seg0
    chunk = 0 <= c < prog.schedule.chunks
    own = prog.coll_owned[c] if chunk else ()
    if chunk:
        params += zip([invars[j] for j in prog.owned[c]], unpack(pvec, prog.p_pack[c]),
                      strict=True)
        params += zip([prog.coll_in[k] for k in own], unpack(kvec or {}, prog.coll_pack[c]),
                      strict=True)
    if seg > 0:
        xin = unpack(cin, prog.c_pack[seg - 1])
    elif n_x:  # the module's inputs: the batch (first pass) or the recycled outputs
        prev, first = unpack(cin, prog.r_pack), batch[:n_x]  # (the module's leading inputs)
        if isinstance(fresh, bool):
            xin = first if fresh else prev
        else:
            xin = [jnp.where(fresh, b, p) for b, p in zip(first, prev, strict=True)]
    else:
        xin = []
    env = run_chunk(cut, seg, params, batch, xin, x_vars=prog.x_vars,
                    layer_starts=prog.layer_starts, recompute_layers=prog.recompute == "layer")
    new = pack([_value(env, prog.coll_out[k]) for k in own],
               prog.coll_pack[c] if chunk else packing([]), prog.coll_width)
    if seg < cut.chunks - 1:
        out = pack([env[v] for v in cut.bounds[seg]], prog.c_pack[seg], prog.c_width)
        return out, jnp.zeros((), jnp.float32), new
    loss, *outs = cj.jaxpr.outvars
    if n_x:
        out = pack([_value(env, v) for v in outs], prog.r_pack, prog.c_width)
    else:
        out = {dt: jnp.zeros((n,), dt) for dt, n in prog.c_width.items()}
    return out, jnp.asarray(_value(env, loss), jnp.float32), new


def _floats(prog: Any, vec: dict) -> list[str]:
    return [k for k in vec if k in prog.g_width]


def _vjp(prog: Any, seg: int, pvec: dict, shared: list, cin: dict, gout: dict, batch: list,
         seed: Any, fresh: bool, kvec: dict) -> tuple:
    """``(param grads, shared grads, cotangent of the packed input, loss / M)`` of segment
    ``seg``, seeded by the loss's cotangent ``seed`` (``scale / M``) where it computes the loss
    (else None: by ``gout``); the segment reads the collections ``kvec`` and its new ones are
    dropped."""
    fl = _floats(prog, cin)
    rest = {k: x for k, x in cin.items() if k not in fl}

    def f(pv, sh, cf):
        out, loss, _ = run_segment(prog, seg, pv, sh, {**rest, **cf}, batch, fresh, kvec)
        return {k: out[k] for k in fl}, loss

    (_, loss), vjp = jax.vjp(f, pvec, shared, {k: cin[k] for k in fl})
    M = prog.schedule.microbatches
    gy = {k: jnp.zeros_like(cin[k]) if seed is not None else gout[k] for k in fl}
    gp, gsh, gc = vjp((gy, jnp.asarray(0.0 if seed is None else seed, jnp.float32)))
    gc = {k: gc.get(k, jnp.zeros((n,), k)) for k, n in prog.g_width.items()}
    return gp, gsh, gc, loss / M


def _zeros(width: dict) -> dict:
    return {k: jnp.zeros((n,), k) for k, n in width.items()}


def _zl() -> Any:
    return jnp.zeros((), jnp.float32)


class _Split:
    """The split backwards of a cut program's chunks (``G`` blocks): per chunk its
    :class:`~nnscaler_jax.pipeline.split_backward.BackwardSplit` and the packing of its kept
    values, and the kept-values buffer's width per dtype (the widest chunk's)."""

    def __init__(self, prog: Any, args: tuple):
        C, last_seg, seg0 = prog.schedule.chunks, prog.cut.chunks - 1, prog.seg0

        def backward(c, pv, sh, cin, gout, bm, kv, seed):
            gp, gsh, gc, _ = _vjp(prog, c + seg0, pv, sh, cin, gout, bm,
                                  seed if c + seg0 == last_seg else None, True, kv)
            return (gp, gsh), gc

        # G reads the parameters, the micro-batch, the collections F read and the seed as
        # they are (unchanged over the step); the input and its cotangent through B
        self.parts = [split_backward(partial(backward, c), args, available=(0, 1, 4, 5, 6))
                      for c in range(C)]
        self.packs = [packing(p.kept_avals) for p in self.parts]
        self.width = widths(self.packs)

    def input_grads(self, c: int, args: tuple, seed: Any) -> tuple[dict, dict]:
        gc, kept = self.parts[c].input_grads(*args[:6], seed)
        return gc, pack(kept, self.packs[c], self.width)

    def weight_grads(self, c: int, args: tuple, seed: Any) -> tuple:
        pv, sh, _, _, bm, kv, kept = args
        return self.parts[c].weight_grads((pv, sh, None, None, bm, kv, seed),
                                          unpack(kept, self.packs[c]))


def _branches(prog: Any, c: Any, it: Any, args: tuple, seed: Any,
              split: _Split | None = None) -> list:
    """The ``lax.switch`` branches of one time step, indexed by
    :data:`~nnscaler_jax.pipeline.loop_tables.CODES`: each returns ``(activation to send,
    cotangent to send, stage param grads, shared grads, loss, new collections, kept values)``
    for the device's chunk ``c`` (``args = (chunk params, shared params, packed input, packed
    cotangent, micro-batch, chunk collections, kept values of a split backward)``; ``seed``:
    the loss's cotangent; ``split``: the chunks' split backwards, when the schedule has ``G``
    blocks); only ``F`` changes the collections, only a split ``B`` keeps values."""
    C, M = prog.schedule.chunks, prog.schedule.microbatches
    last_seg, seg0, recycling = prog.cut.chunks - 1, prog.seg0, bool(prog.x_vars)
    pv, shared, cin, gout, bm, kv, kept = args
    no_p, no_sh = jax.tree.map(jnp.zeros_like, pv), jax.tree.map(jnp.zeros_like, shared)
    no_k = jax.tree.map(jnp.zeros_like, kept)
    fresh = lambda c: c > 0 or not recycling  # chunk 0 of recycling reads the last pass
    fwds = [partial(lambda c, *a: run_segment(prog, c + seg0, *a[:3], a[4], fresh(c), a[5]), c)
            for c in range(C)]
    bwds = [partial(lambda c, *a: _vjp(prog, c + seg0, *a[:5],
                                       seed if c + seg0 == last_seg else None, fresh(c), a[5]),
                    c)
            for c in range(C)]
    nfwds = [partial(lambda c, *a: run_segment(prog, c + seg0, *a[:3], a[4],
                                               (it == 0) if c == 0 else True, a[5])[0], c)
             for c in range(C)]

    def idle():
        return _zeros(prog.c_width), _zeros(prog.g_width), no_p, no_sh, _zl(), kv, no_k

    def fwd():
        out, loss, new = lax.switch(c, fwds, *args)
        return out, _zeros(prog.g_width), no_p, no_sh, loss / M, new, no_k

    def bwd():
        if split is not None:  # the input's cotangent; the weight gradients in G
            gc, k = lax.switch(c, [partial(split.input_grads, c, seed=seed) for c in range(C)],
                               args)
            return _zeros(prog.c_width), gc, no_p, no_sh, _zl(), kv, k
        gp, gsh, gc, _ = lax.switch(c, bwds, *args)
        return _zeros(prog.c_width), gc, gp, gsh, _zl(), kv, no_k

    def wgrad():
        gp, gsh = lax.switch(c, [partial(split.weight_grads, c, seed=seed) for c in range(C)],
                             args)
        return _zeros(prog.c_width), _zeros(prog.g_width), gp, gsh, _zl(), kv, no_k

    def nograd():  # recycling pass `it`: chunk 0 reads the batch on pass 0
        return lax.switch(c, nfwds, *args), _zeros(prog.g_width), no_p, no_sh, _zl(), kv, no_k

    def embed():
        out, _, _ = run_segment(prog, 0, pv, shared, cin, bm)
        return out, _zeros(prog.g_width), no_p, no_sh, _zl(), kv, no_k

    def head():
        _, gsh, gc, loss = _vjp(prog, last_seg, pv, shared, cin, gout, bm, seed, True, {})
        return _zeros(prog.c_width), gc, no_p, gsh, loss, kv, no_k

    def embed_bwd():
        _, gsh, _, _ = _vjp(prog, 0, pv, shared, cin, gout, bm, None, True, {})
        return _zeros(prog.c_width), _zeros(prog.g_width), no_p, gsh, _zl(), kv, no_k

    out = [idle, fwd, bwd] + [nograd] * recycling
    if seg0:
        out += [idle] * (4 - len(out)) + [embed, head, embed_bwd]
    if split is not None:
        out += [idle] * (CODES["G"] - len(out)) + [wgrad]
    return out


def _two_lanes(prog: Any, first: tuple, second: tuple, seed: Any,
               split: _Split | None = None) -> tuple:
    """The blocks of a time step of a paired table, as :func:`_branches`' results: the first
    lane runs every kind but ``B`` (``first = (code, chunk, pass, args)``), the second the
    backward (``second = (on, chunk, args)``: a pair's, or the step's only block). A step
    holds one set of gradient results, as in an unpaired table, not one per lane: the
    parameter gradients come from the backward lane, or from the first lane's ``G`` where
    backwards are split (their ``B`` makes none); the first lane's shared gradients are kept
    where its blocks make some (``E`` / ``H`` / ``W``, ``G``)."""
    code, c, it, args = first
    on, cb, b_args = second
    keep_sh = bool(prog.seg0) or split is not None
    keep_p = split is not None

    def lane(f):
        def run():
            out_f, out_b, dp, dsh, loss, new, _ = f()
            return out_f, out_b, dp if keep_p else {}, dsh if keep_sh else [], loss, new
        return run

    fs = _branches(prog, c, it, args, seed, split)
    fs[CODES["B"]] = fs[0]  # (a backward runs in the second lane)
    out_f, out_b, dp_f, dsh, loss, new = lax.switch(code, [lane(f) for f in fs])
    br = _branches(prog, cb, it, b_args, seed, split)
    _, out_bb, dp, dsh_b, _, _, kept = lax.cond(on, br[CODES["B"]], br[0])
    out_b = jax.tree.map(lambda x, y: jnp.where(on, x, y), out_bb, out_b)
    if keep_sh:
        dsh_b = [x + y for x, y in zip(dsh, dsh_b, strict=True)]
    return out_f, out_b, dp_f if keep_p else dp, dsh_b, loss, new, kept


def local_step(prog: Any, shared: list, stages: dict, batch: list, colls: dict,
               seed: Any) -> tuple:
    """Per-device body of the cut program's shard_map: run the step table, return
    ``(loss, shared grads, stage grads, new stage collections)``; ``seed``: the loss's
    cotangent per micro-batch (``scale / M``)."""
    S, M, tb = prog.schedule.stages, prog.schedule.microbatches, prog.tables
    s = lax.axis_index(prog.axis)
    stages = {k: x[0] for k, x in stages.items()}                 # [V, width]
    colls = {k: x[0] for k, x in colls.items()}                   # [V, width]
    batch = [x[:, 0] for x in batch]                             # [M, b, ...]
    split = None
    if prog.schedule.split_backward:  # traced on one block's arguments
        split = _Split(prog, ({k: x[0] for k, x in stages.items()}, shared,
                              _zeros(prog.c_width), _zeros(prog.g_width), [x[0] for x in batch],
                              {k: x[0] for k, x in colls.items()}, seed))
    tabs = [jnp.asarray(a) for a in (tb.kind, tb.mb, tb.virt, tb.it, tb.in_slot, tb.g_slot,
                                     tb.rf_slot, tb.rb_slot, tb.keep_f, tb.keep_b, tb.keep_s,
                                     tb.s_slot)]
    sends = jnp.asarray(tb.sends)
    pair = [jnp.asarray(a) for a in (tb.b_kind, tb.b_mb, tb.b_virt, tb.b_in, tb.b_g)]
    pick = lambda tree, i: {k: lax.dynamic_index_in_dim(x, i, keepdims=False)
                            for k, x in tree.items()}

    def body(t, carry):
        inbuf, gbuf, g_st, g_sh, loss_acc, cst, snap, kbuf, pend = carry
        code, m, v, it, isl, gsl, rf, rb, kf, kb, ks, ssl = [a[t, s] for a in tabs]
        now, saved = pick(cst, v), pick(pick(snap, v), m)  # B / G read what their F read
        is_f, is_b = code == CODES["F"], (code == CODES["B"]) | (code == CODES["G"])
        block = lambda m, v, isl, gsl, kv: (
            pick(stages, v), shared, {k: b[isl] for k, b in inbuf.items()},
            {k: b[gsl] for k, b in gbuf.items()},
            [lax.dynamic_index_in_dim(x, m, keepdims=False) for x in batch], kv,
            {k: b[ssl] for k, b in kbuf.items()})
        args = block(m, v, isl, gsl, {k: jnp.where(is_b, saved[k], x) for k, x in now.items()})
        if not tb.paired:
            out_f, out_b, dp, dsh, loss, new, kept = lax.switch(
                code, _branches(prog, v * S + s, it, args, seed, split))
            gv = v
        else:  # a forward lane and a backward lane (a pair runs both)
            bk, bm, bv, bi, bg = [a[t, s] for a in pair]
            sel = lambda a, b: jnp.where(bk > 0, b, a)
            bm, gv, bi, bg = sel(m, bm), sel(v, bv), sel(isl, bi), sel(gsl, bg)
            b_args = block(bm, gv, bi, bg, pick(pick(snap, gv), bm))
            out_f, out_b, dp, dsh, loss, new, kept = _two_lanes(
                prog, (code, v * S + s, it, args), ((code == CODES["B"]) | (bk > 0), gv * S + s,
                                                    b_args),
                seed, split)
            gv = v if split is not None else gv  # (split: a G, in the first lane, has them)
        cst = {k: x.at[v].set(jnp.where(is_f, new[k], now[k])) for k, x in cst.items()}
        snap = {k: x.at[v, m].set(jnp.where(is_f, now[k], saved[k])) for k, x in snap.items()}
        g_st = {k: g.at[gv].add(dp[k]) for k, g in g_st.items()}
        g_sh = [g + d for g, d in zip(g_sh, dsh, strict=True)]
        (recv_f, recv_b), pend = exchange(tb, sends[t], (out_f, out_b), pend, prog.axis, S)
        put = lambda slot, buf, new: lax.cond(
            slot >= 0, lambda b: {k: b[k].at[slot].set(new[k]) for k in b}, lambda b: b, buf)
        inbuf = put(kf, put(rf, inbuf, recv_f), out_f)
        gbuf = put(kb, put(rb, gbuf, recv_b), out_b)
        kbuf = put(ks, kbuf, kept)
        return inbuf, gbuf, g_st, g_sh, loss_acc + loss, cst, snap, kbuf, pend

    sent = ({k: jnp.zeros((n,), k) for k, n in prog.c_width.items()},
            {k: jnp.zeros((n,), k) for k, n in prog.g_width.items()})
    carry = ({k: jnp.zeros((tb.n_in, n), k) for k, n in prog.c_width.items()},
             {k: jnp.zeros((tb.n_g, n), k) for k, n in prog.g_width.items()},
             jax.tree.map(jnp.zeros_like, stages), jax.tree.map(jnp.zeros_like, shared), _zl(),
             colls, {k: jnp.zeros((x.shape[0], M) + x.shape[1:], x.dtype)
                     for k, x in colls.items()},
             {k: jnp.zeros((tb.n_s, n), k) for k, n in (split.width if split else {}).items()},
             sent if tb.overlap else ())
    _, _, g_st, g_sh, loss, colls, _, _, _ = lax.fori_loop(0, tb.kind.shape[0], body, carry)
    g_sh = [lax.psum(g, prog.axis) for g in g_sh]
    loss = lax.psum(loss, prog.axis)
    if prog.data_axes:
        g_sh = [lax.pmean(g, prog.data_axes) for g in g_sh]
        g_st = {k: lax.pmean(g, prog.data_axes) for k, g in g_st.items()}
        loss = lax.pmean(loss, prog.data_axes)
    colls = average(colls, prog.data_axes)
    add_stage = lambda tree: {k: x[None] for k, x in tree.items()}
    return loss, g_sh, add_stage(g_st), add_stage(colls)
