"""Pipelined training step for any model: heterogeneous stages cut at module boundaries.

The micro-batch training program ``loss_fn(module.apply({'params': p}, *batch), *batch)`` is
traced once and cut into ``stages x virtual`` chunks where the plan's ``stage_of`` says
(:func:`nnscaler_jax.pipeline.cut.chunk_starts`, :func:`nnscaler_jax.pipeline.chunks.
cut_program`). Chunk ``c = v * stages + s`` runs on stage ``s``; chunks may differ in everything:
ops, parameters, and the values they pass on (several activations, or values forwarded through
intermediate chunks to a later one).

- **Parameters**: each chunk's own parameter leaves are flattened into one zero-padded vector
  per dtype, stacked ``[stages, virtual, width]`` and sharded over the stage axis, so a device
  stores only its stage's parameters (the padding's gradient is 0, so optax keeps it 0). Leaves
  several chunks read (tied embeddings) are replicated, their gradients summed over stages.
- **Boundaries**: the values crossing a boundary travel packed in one flat vector per dtype, as
  wide as the widest boundary; cotangents likewise (floating dtypes only).
- **Step**: inside one ``jax.shard_map`` a ``lax.fori_loop`` walks the schedule's step table
  (:func:`nnscaler_jax.pipeline.loop_tables.loop_tables`, as the identical-layer runtime);
  ``lax.switch`` on the chunk index runs the device's chunk: forward, or backward as ``jax.vjp``
  of the chunk recomputed from its saved input; ``lax.ppermute`` moves the packed vectors to the
  neighbours. Gradients are averaged over the data axes and the optax update runs in the same
  jitted step. Stages are data-parallel inside (tensor parallelism: :func:`~nnscaler_jax.
  pipeline.cut.tp_error`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnscaler_jax.capture.flax import path_str
from nnscaler_jax.errors import PlanError
from nnscaler_jax.lower.eqns import NO_CONSTRAINTS
from nnscaler_jax.lower.replay import explicitly_typed
from nnscaler_jax.mesh.axes import require_stage_axis
from nnscaler_jax.pipeline import schedule as sch
from nnscaler_jax.pipeline.chunks import cut_program, pack, packing, unpack, widths
from nnscaler_jax.pipeline.cut import chunk_starts, eqn_path, tp_error
from nnscaler_jax.pipeline.in_stage import tensor_axes
from nnscaler_jax.pipeline.loop_tables import loop_tables
from nnscaler_jax.pipeline.update import initial_state, jitted_step

__all__ = ["CutProgram"]


def _place(x: Any, sharding: NamedSharding) -> Any:
    """Lay ``x`` out as ``sharding`` inside jit (Explicit mesh axes: reshard; Auto: constraint)."""
    if any(t == jax.sharding.AxisType.Explicit for t in getattr(sharding.mesh, "axis_types", ())):
        return jax.sharding.reshard(x, sharding)
    return lax.with_sharding_constraint(x, sharding)


def _floating(dt: str) -> bool:
    return jnp.issubdtype(np.dtype(dt), jnp.inexact)


class CutProgram:
    """A pipelined training program of a model cut into heterogeneous chunks.

    Same interface as :class:`~nnscaler_jax.pipeline.runtime.PipelineProgram`:
    :meth:`to_pipeline` / :meth:`from_pipeline` move parameters between the module's tree and
    the pipeline layout ``{'shared': [leaves], 'stages': {dtype: [stages, virtual, width]}}``,
    :meth:`grads` gives the loss and gradients, :meth:`train_step` the jitted optax step.
    """

    stage_plan = None
    tp_axes: tuple[str, ...] = ()

    def __init__(self, module: Any, loss_fn: Callable, mesh: Any, sched: sch.Schedule,
                 params: Any, batch: tuple, *, stage_of: tuple, policy: Any = None,
                 rules: tuple = ()):
        del rules  # recompute rules are refused by PipelineStep; every chunk is recomputed
        self.module, self.loss_fn, self.mesh, self.schedule = module, loss_fn, mesh, sched
        axes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
        self.axis = require_stage_axis(axes)
        S, M = sched.stages, sched.microbatches
        if axes[self.axis] != S:
            raise PlanError(f"schedule has {S} stages but mesh axis '{self.axis}' has "
                            f"{axes[self.axis]} devices; use pipeline_stages={axes[self.axis]}")
        if tensor_axes(axes, self.axis, policy):
            raise tp_error(tensor_axes(axes, self.axis, policy))
        self.data_axes = tuple(a for a in mesh.axis_names if a != self.axis)
        self.dp = int(np.prod([axes[a] for a in self.data_axes], dtype=np.int64))
        B = jax.tree.leaves(batch)[0].shape[0]
        if B % (M * self.dp):
            raise PlanError(f"batch size {B} does not split into {M} micro-batches x {self.dp} "
                            f"data-parallel shards ({self.data_axes}); use a batch size that is a "
                            f"multiple of {M * self.dp}")
        self.mb_size = B // (M * self.dp)
        closed, abstract = self._trace(params, batch)
        root = type(module).__name__
        starts = chunk_starts([eqn_path(e, root) for e in closed.jaxpr.eqns], stage_of, S,
                              sched.chunks)
        self.cut = cut_program(closed, len(abstract), starts)
        self.param_avals = abstract
        self.p_pack = [packing([abstract[j] for j in own]) for own in self.cut.owned]
        self.p_width = widths(self.p_pack)
        self.c_pack = [packing([v.aval for v in b]) for b in self.cut.bounds]
        self.c_width = widths(self.c_pack) or {"float32": 1}
        self.g_width = {k: n for k, n in self.c_width.items() if _floating(k)} or {"float32": 1}
        self.tables = loop_tables(sched)

    def _trace(self, params: Any, batch: tuple) -> tuple[Any, list]:
        flat, self.params_tree = jax.tree_util.tree_flatten_with_path(params)
        self.param_paths = [path_str(p) for p, _ in flat]
        mb_batch = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((self.mb_size,) + tuple(x.shape[1:]), x.dtype), batch)
        self.batch_tree = jax.tree.structure(mb_batch)
        n = len(flat)

        def program(*leaves):
            p = jax.tree.unflatten(self.params_tree, leaves[:n])
            b = jax.tree.unflatten(self.batch_tree, leaves[n:])
            return self.loss_fn(self.module.apply({"params": p}, *b), *b)

        abstract = [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for _, x in flat]
        return jax.make_jaxpr(program)(*abstract, *jax.tree.leaves(mb_batch)), abstract

    # ---- parameter layout --------------------------------------------------------------------

    def _where(self, c: int) -> tuple[int, int]:
        return c % self.schedule.stages, c // self.schedule.stages

    def to_pipeline(self, params: Any) -> dict:
        """Module params -> ``{'shared': [...], 'stages': {dtype: [S, V, width]}}`` on the mesh."""
        leaves = [np.asarray(x) for x in jax.tree.leaves(params)]
        S, V = self.schedule.stages, self.schedule.virtual
        stages = {dt: np.zeros((S, V, n), dt) for dt, n in self.p_width.items()}
        for c, (own, pk) in enumerate(zip(self.cut.owned, self.p_pack, strict=True)):
            s, v = self._where(c)
            for j, (dt, off, shape) in zip(own, pk.slots, strict=True):
                stages[dt][s, v, off:off + int(np.prod(shape, dtype=np.int64))] = \
                    leaves[j].ravel()
        rep, st = self.shardings()
        return {"shared": [jax.device_put(leaves[j], rep) for j in self.cut.shared],
                "stages": {dt: jax.device_put(x, st) for dt, x in stages.items()}}

    def from_pipeline(self, pp: dict) -> Any:
        """The inverse of :meth:`to_pipeline` (a module params tree)."""
        out: list[Any] = [None] * self.cut.n_params
        for j, x in zip(self.cut.shared, pp["shared"], strict=True):
            out[j] = jnp.asarray(x)
        stages = {dt: np.asarray(x) for dt, x in pp["stages"].items()}
        for c, (own, pk) in enumerate(zip(self.cut.owned, self.p_pack, strict=True)):
            s, v = self._where(c)
            for j, (dt, off, shape) in zip(own, pk.slots, strict=True):
                size = int(np.prod(shape, dtype=np.int64))
                out[j] = jnp.asarray(stages[dt][s, v, off:off + size].reshape(shape))
        return jax.tree.unflatten(self.params_tree, out)

    def shardings(self) -> tuple[NamedSharding, NamedSharding]:
        """Replicated, and split over the stage axis (leading dim)."""
        return NamedSharding(self.mesh, P()), NamedSharding(self.mesh, P(self.axis))

    def stage_bytes(self) -> list[int]:
        """Per stage, the bytes of its own parameters (without padding or shared leaves)."""
        out = [0] * self.schedule.stages
        for c, own in enumerate(self.cut.owned):
            out[self._where(c)[0]] += sum(int(np.prod(self.param_avals[j].shape, dtype=np.int64))
                                          * np.dtype(self.param_avals[j].dtype).itemsize
                                          for j in own)
        return out

    # ---- one chunk ---------------------------------------------------------------------------

    def _run(self, c: int, pvec: dict, shared: list, cin: dict, batch: list) -> tuple:
        """Chunk ``c``'s forward: ``(boundary c's packed values, loss or 0)``."""
        cut, C = self.cut, self.cut.chunks
        cj = cut.jaxpr
        env = dict(zip(cj.jaxpr.constvars, cj.consts, strict=True))
        env.update((cj.jaxpr.invars[j], x) for j, x in zip(cut.shared, shared, strict=True))
        env.update(zip(cj.jaxpr.invars[cut.n_params:], batch, strict=True))
        env.update((cj.jaxpr.invars[j], x)
                   for j, x in zip(cut.owned[c], unpack(pvec, self.p_pack[c]), strict=True))
        if c > 0:
            env.update(zip(cut.bounds[c - 1], unpack(cin, self.c_pack[c - 1]), strict=True))
        NO_CONSTRAINTS.evaluate(cut.segments[c], env)
        zero = {dt: jnp.zeros((n,), dt) for dt, n in self.c_width.items()}
        if c < C - 1:
            out = pack([env[v] for v in cut.bounds[c]], self.c_pack[c], self.c_width)
            return out, jnp.zeros((), jnp.float32)
        (o,) = cj.jaxpr.outvars
        return zero, jnp.asarray(o.val if isinstance(o, jcore.Literal) else env[o], jnp.float32)

    def _fwd(self, c: int, pvec, shared, cin, gout, batch):
        out, loss = self._run(c, pvec, shared, cin, batch)
        return out, loss / self.schedule.microbatches

    def _bwd(self, c: int, pvec, shared, cin, gout, batch):
        """``(param grads, shared grads, cotangent of the input boundary)`` of chunk ``c``."""
        fl = [k for k in cin if k in self.g_width]
        rest = {k: x for k, x in cin.items() if k not in fl}

        def f(pv, sh, cf):
            out, loss = self._run(c, pv, sh, {**rest, **cf}, batch)
            return {k: out[k] for k in fl}, loss

        _, vjp = jax.vjp(f, pvec, shared, {k: cin[k] for k in fl})
        last = c == self.cut.chunks - 1
        gy = {k: jnp.zeros_like(cin[k]) if last else gout[k] for k in fl}
        gl = jnp.asarray(1.0 / self.schedule.microbatches if last else 0.0, jnp.float32)
        gp, gsh, gc = vjp((gy, gl))
        gc = {k: gc.get(k, jnp.zeros((n,), k)) for k, n in self.g_width.items()}
        return gp, gsh, gc

    # ---- the step ----------------------------------------------------------------------------

    def _local(self, shared: list, stages: dict, batch: list) -> tuple:
        """Per-device body of the shard_map: run the step table, return (loss, grads)."""
        S, C = self.schedule.stages, self.cut.chunks
        tb = self.tables
        s = lax.axis_index(self.axis)
        stages = {k: x[0] for k, x in stages.items()}                 # [V, width]
        batch = [x[:, 0] for x in batch]                             # [M, b, ...]
        zeros = lambda w: {k: jnp.zeros((n,), k) for k, n in w.items()}
        zeros_like = lambda t: jax.tree.map(jnp.zeros_like, t)
        tabs = [jnp.asarray(a) for a in (tb.kind, tb.mb, tb.virt, tb.in_slot, tb.g_slot,
                                         tb.rf_slot, tb.rb_slot)]
        fwds = [partial(self._fwd, c) for c in range(C)]
        bwds = [partial(self._bwd, c) for c in range(C)]
        f_perm = [(i, (i + 1) % S) for i in range(S)]
        b_perm = [(i, (i - 1) % S) for i in range(S)]

        def body(t, carry):
            inbuf, gbuf, g_st, g_sh, loss_acc = carry
            kind, m, v, isl, gsl, rf, rb = [a[t, s] for a in tabs]
            c = v * S + s
            bm = [lax.dynamic_index_in_dim(x, m, keepdims=False) for x in batch]
            pv = {k: lax.dynamic_index_in_dim(x, v, keepdims=False) for k, x in stages.items()}
            cin = {k: b[isl] for k, b in inbuf.items()}
            gout = {k: b[gsl] for k, b in gbuf.items()}
            args = (pv, shared, cin, gout, bm)

            def idle():
                return (zeros(self.c_width), zeros(self.g_width), zeros_like(pv),
                        zeros_like(shared), jnp.zeros((), jnp.float32))

            def fwd():
                out, loss = lax.switch(c, fwds, *args)
                return out, zeros(self.g_width), zeros_like(pv), zeros_like(shared), loss

            def bwd():
                gp, gsh, gc = lax.switch(c, bwds, *args)
                return zeros(self.c_width), gc, gp, gsh, jnp.zeros((), jnp.float32)

            send_f, send_b, dp, dsh, loss = lax.switch(kind, [idle, fwd, bwd])
            g_st = {k: g.at[v].add(dp[k]) for k, g in g_st.items()}
            g_sh = [g + d for g, d in zip(g_sh, dsh, strict=True)]
            recv_f = jax.tree.map(lambda x: lax.ppermute(x, self.axis, f_perm), send_f)
            recv_b = jax.tree.map(lambda x: lax.ppermute(x, self.axis, b_perm), send_b)
            put = lambda slot, buf, new: lax.cond(
                slot >= 0, lambda b: {k: b[k].at[slot].set(new[k]) for k in b}, lambda b: b,
                buf)
            return put(rf, inbuf, recv_f), put(rb, gbuf, recv_b), g_st, g_sh, loss_acc + loss

        carry = ({k: jnp.zeros((tb.n_in, n), k) for k, n in self.c_width.items()},
                 {k: jnp.zeros((tb.n_g, n), k) for k, n in self.g_width.items()},
                 zeros_like(stages), zeros_like(shared), jnp.zeros((), jnp.float32))
        _, _, g_st, g_sh, loss = lax.fori_loop(0, tb.kind.shape[0], body, carry)
        g_sh = [lax.psum(g, self.axis) for g in g_sh]
        loss = lax.psum(loss, self.axis)
        if self.data_axes:
            g_sh = [lax.pmean(g, self.data_axes) for g in g_sh]
            g_st = {k: lax.pmean(g, self.data_axes) for k, g in g_st.items()}
            loss = lax.pmean(loss, self.data_axes)
        return loss, g_sh, {k: g[None] for k, g in g_st.items()}

    def grads(self, pp: dict, batch: tuple) -> tuple[jax.Array, dict]:
        """Mean loss over the batch and its gradients in the pipeline layout (traceable)."""
        M, D = self.schedule.microbatches, self.dp
        data = self.data_axes if self.data_axes else None
        # (a batch typed on an Explicit mesh says where the micro-batches go)
        shaped = [jnp.reshape(x, (M, D, self.mb_size) + x.shape[1:],
                              **({"out_sharding": P(None, data)} if explicitly_typed(x) else {}))
                  for x in jax.tree.leaves(batch)]
        shared_spec = [P()] * len(pp["shared"])
        stage_spec = {k: P(self.axis) for k in pp["stages"]}
        batch_spec = [P(None, data)] * len(shaped)
        fn = jax.shard_map(self._local, mesh=self.mesh,
                           in_specs=(shared_spec, stage_spec, batch_spec),
                           out_specs=(P(), shared_spec, stage_spec), check_vma=False)
        rep, st = self.shardings()
        loss, gs, gst = fn([_place(x, rep) for x in pp["shared"]],
                           {k: _place(x, st) for k, x in pp["stages"].items()},
                           [_place(x, NamedSharding(self.mesh, sp))
                            for x, sp in zip(shaped, batch_spec, strict=True)])
        return loss, {"shared": gs, "stages": gst}

    def train_step(self, optimizer: Any, *, return_grads: bool = False) -> Callable:
        """A jitted ``step(state, batch) -> (state, metrics)`` (see
        :meth:`~nnscaler_jax.pipeline.runtime.PipelineProgram.train_step`)."""
        return jitted_step(self.grads, optimizer, self.mesh,
                           return_grads=return_grads)

    def init_state(self, params: Any, optimizer: Any) -> dict:
        """``{'params': to_pipeline(params), 'opt_state': optimizer.init(...)}``."""
        pp = self.to_pipeline(params)
        return initial_state(pp, optimizer, self.mesh)
