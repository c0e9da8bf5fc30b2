"""Pipelined training step: stages over a mesh axis, a schedule's step table in ``shard_map``.

The training program ``loss_fn(module.apply({'params': p}, *batch), *batch)`` is traced once on
one micro-batch (:mod:`nnscaler_jax.pipeline.program`: the step's options, rng keys, nnx
modules) and cut by module path into a *prefix* (e.g. the embeddings), a stack of
identical *layers* (``h_0 .. h_{L-1}``, or one ``nn.scan`` ``h`` over a leading layer axis) and a
*suffix* (e.g. final norm, head and loss). The layers are split into ``stages x virtual``
contiguous chunks; chunk ``c = v * stages + s`` lives on stage ``s``: its pieces, each layer leaf
stacked over its layers, in the in-graph programs' one layout
(:mod:`~nnscaler_jax.pipeline.packed`: rows ``[stages, virtual, width]`` over the stage axis, a
row per layer leaf). Every chunk's pieces have the same shapes, so one code reads any chunk's
(no branch on the chunk). The prefix runs in chunk 0, the suffix in the last chunk; their
parameters are shared (every stage stores them) and their gradients summed over stages (so tied
embeddings get both contributions).

Inside one ``jax.shard_map`` over the whole mesh (stage axis + data-parallel axes), a
``lax.fori_loop`` walks the schedule's step table (:func:`nnscaler_jax.pipeline.schedule.timeline`):
each device reads what it does at step ``t`` from the table at its ``lax.axis_index`` — forward of
micro-batch ``m``, backward of ``m`` (``jax.vjp`` of the chunk recomputed from its saved input:
activations are kept only as chunk inputs, in a buffer of the schedule's in-flight size), or
nothing; activations and cotangents move to the neighbours with ``lax.ppermute`` after a step
where some stage receives one. Gradients are accumulated over micro-batches (loss = mean over
micro-batches), averaged over the data axes; the optax update runs in the same jitted step.

Tensor parallelism inside stages (a policy other than ``'dp'``, e.g. ``'megatron'``): the mesh
axes not named like data axes (e.g. ``'model'``) are left out of the manual axes of the
``shard_map`` (partial-manual, GSPMD inside) and the chunks run the in-stage plan as sharding
constraints, with layer parameters stored split as that plan says: each device's part of a row
holds its blocks, which a ``shard_map`` over the tensor axes reads as the whole pieces GSPMD
partitions
(:mod:`nnscaler_jax.pipeline.in_stage`, which also says why this and not a fully manual body).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnscaler_jax.capture.module_call import ModuleCall
from nnscaler_jax.errors import PlanError
from nnscaler_jax.layout import Layout
from nnscaler_jax.lower.eqns import NO_CONSTRAINTS
from nnscaler_jax.pipeline import schedule as sch
from nnscaler_jax.pipeline.chunks import ProgramCut, run_chunk
from nnscaler_jax.pipeline.in_graph import InGraphRuntime
from nnscaler_jax.pipeline.in_stage import InStagePlan, plan_in_stage
from nnscaler_jax.pipeline.loop_tables import loop_tables
from nnscaler_jax.pipeline.packed import PackedRows
from nnscaler_jax.pipeline.split import split_program
from nnscaler_jax.pipeline.update import (
    place_as,
)

__all__ = ["PipelineProgram"]


# ---- the pipelined program -----------------------------------------------------------------


class PipelineProgram(InGraphRuntime):
    """A pipelined training program for one module, mesh, schedule and batch shape.

    Use :meth:`to_pipeline` / :meth:`from_pipeline` to move parameters between the module's tree
    and the pipeline layout (``{'shared': leaves, 'stages': {'<leaf>:<dtype>': [stages,
    virtual, width]}}``, :mod:`~nnscaler_jax.pipeline.packed`), :meth:`grads` for the
    accumulated loss and gradients, and :meth:`train_step` for the jitted optax step.
    """

    def __init__(self, module: Any, loss_fn: Callable, mesh: Any, sched: sch.Schedule,
                 params: Any, batch: tuple, *, policy: Any = None, rules: tuple = (),
                 call: ModuleCall | None = None, recompute: str = "chunk",
                 budget: float | None = None, overlap: bool = False):
        del budget  # (one in-stage plan of the whole micro-batch program, every stage's)
        self._setup(module, loss_fn, mesh, sched, batch, policy=policy, recompute=recompute)
        call = call or ModuleCall.plain(module, params)
        closed, abstract = self.trace_micro(params, batch, call)
        paths, n_params = self.param_paths, len(abstract)
        self.split = split_program(closed, paths, type(module).__name__)
        self.stage_plan: InStagePlan | None = None
        self._eval = NO_CONSTRAINTS.evaluate
        if self.tp_axes:
            self.stage_plan = plan_in_stage(closed, paths, n_params, mesh, self.axis, policy,
                                            root=type(module).__name__, rules=rules)
            self._eval = self.stage_plan.evaluate
            self.stage_plans = (self.stage_plan,) * sched.stages  # (one plan, every stage)
        C, L = sched.chunks, self.split.n_layers
        if L % C:
            raise PlanError(f"{L} layers do not split into {sched.stages} stages x "
                            f"{sched.virtual} chunks; use a stage count dividing {L}")
        self.per_chunk = L // C
        self.tables = loop_tables(sched, overlap=overlap)
        self.param_avals = abstract
        self._lay_rows()

    # ---- parameter layout: each chunk's pieces are its layer leaves stacked over its layers

    def _lay_rows(self) -> None:
        """The rows (:mod:`~nnscaler_jax.pipeline.packed`): chunk ``c``'s pieces are each layer
        leaf stacked over its layers (``[layers per chunk, ...]``), each in a row of its own
        (so a chunk reads it as the leaf's own stacked array would be read, no slice of a
        wider row), stored as the in-stage plan stores that leaf (split over the tensor
        axes); the prefix's and suffix's leaves are shared (every stage stores them, as the
        in-stage plan says). ``layer_rows``: one layer's pieces (each leaf's blocks)."""
        sp = self.split
        self.shared = tuple(sp.shared)
        self.scanned = frozenset(sp.layer_leaves[0]) if sp.stacked else frozenset()
        self.leaf_layout, self._layer_layouts = {}, []
        for k, (j, v) in enumerate(zip(sp.layer_leaves[0], sp.layer_params, strict=True)):
            ndim = len(self.param_avals[j].shape) - sp.stacked
            lay = (Layout.replicated(ndim) if self.stage_plan is None else
                   Layout.from_pspec(self.stage_plan.layer_spec(j, v, sp.stacked), ndim))
            self._layer_layouts.append(lay if lay.split_axes else None)
            for lv in sp.layer_leaves[:1] if sp.stacked else sp.layer_leaves:
                if lay.split_axes:
                    self.leaf_layout[lv[k]] = Layout(((),) + lay.dims) if sp.stacked else lay
        self.rows = self._rows_for(self.param_avals)
        self.layer_rows = PackedRows(self.mesh, self.axis, self.tp_axes, 1, 1, [[
            jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in self.rows.avals[0]]],
            [self._layer_layouts])

    def _rows_for(self, avals: list) -> PackedRows:
        sp, K = self.split, self.per_chunk
        piece = [jax.ShapeDtypeStruct((K,) + tuple(avals[j].shape)[int(sp.stacked):],
                                      avals[j].dtype) for j in sp.layer_leaves[0]]
        lays = [None if lay is None else Layout(((),) + lay.dims)
                for lay in self._layer_layouts]
        C = self.schedule.chunks
        return PackedRows(self.mesh, self.axis, self.tp_axes, self.schedule.stages,
                          self.schedule.virtual, [piece] * C, [lays] * C,
                          [[str(k) for k in range(len(piece))]] * C)

    def _pieces(self, leaves: list) -> list[list]:
        sp, K = self.split, self.per_chunk
        if sp.stacked:
            return [[jnp.asarray(leaves[j])[c * K:(c + 1) * K] for j in sp.layer_leaves[0]]
                    for c in range(self.schedule.chunks)]
        return [[jnp.stack([leaves[sp.layer_leaves[i][k]] for i in range(c * K, (c + 1) * K)])
                 for k in range(len(sp.layer_leaves[0]))] for c in range(self.schedule.chunks)]

    def _leaves(self, pieces: list[list], shared: list, n: int) -> list:
        sp, K = self.split, self.per_chunk
        out: list[Any] = [None] * n
        for j, x in zip(sp.shared, shared, strict=True):
            out[j] = x
        for k in range(len(sp.layer_leaves[0])):
            if sp.stacked:
                out[sp.layer_leaves[0][k]] = jnp.concatenate([p[k] for p in pieces])
                continue
            for c, p in enumerate(pieces):
                for i in range(K):
                    out[sp.layer_leaves[c * K + i][k]] = p[k][i]
        return out

    def shared_shardings(self) -> list[NamedSharding]:
        """The prefix's and suffix's leaves: replicated, or as the in-stage plan stores
        them."""
        if self.stage_plan is None:
            return super().shared_shardings()
        return [NamedSharding(self.mesh, P(*self.stage_plan.var_specs[j]))
                for j in self.split.shared]

    # ---- the step ----------------------------------------------------------------------------

    @functools.cached_property
    def _cut(self) -> ProgramCut:
        """The split as three segments for :func:`~nnscaler_jax.pipeline.chunks.run_chunk`
        (the one chunk evaluator): the prefix, one layer (the template) and the suffix,
        reading the template's input and the suffix's."""
        sp = self.split
        return ProgramCut(sp.jaxpr, sp.n_params, (sp.pre, sp.layer_eqns, sp.post),
                          ((sp.layer_x,), (sp.xl,)), (), sp.shared)

    def _chunk(self, c, row, shared, x_in, batch):
        """Chunk ``c``'s forward: prefix if first, its layers (the template's segment, scanned
        over their parameters, each leaf's from its own row of the chunk's ``row``), suffix +
        loss if last."""
        sp, C, jx = self.split, self.schedule.chunks, self.split.jaxpr.jaxpr
        T, K = len(self.rows.devices), self.per_chunk
        # [layers, leaf] (data-parallel inside: a reshape), else [layers, T, block size]
        layer_p = [row[k].reshape((K,) + shape) if T == 1 else
                   row[k].reshape(T, K, -1).swapaxes(0, 1)
                   for (k, _, _), (_, _, shape) in zip(self.rows.packs[0].slots,
                                                       self.layer_rows.packs[0].slots,
                                                       strict=True)]
        own = list(zip([jx.invars[j] for j in sp.shared], shared, strict=True))
        run = lambda seg, pairs, xin: run_chunk(self._cut, seg, pairs, batch, xin,
                                                layer_starts={}, recompute_layers=False,
                                                evaluate=self._eval)
        outer = {**dict(zip(jx.constvars, sp.jaxpr.consts, strict=True)), **dict(own),
                 **dict(zip(jx.invars[sp.n_params:], batch, strict=True))}
        consts = [(tv, ov.val if isinstance(ov, jcore.Literal) else outer[ov])
                  for tv, ov in sp.layer_consts]
        x = lax.cond(c == 0, lambda: run(0, own, ())[sp.x0], lambda: x_in)

        def layer(x, p):
            p = self.layer_rows.whole(p)
            env = run(1, own + consts + list(zip(sp.layer_params, p, strict=True)), (x,))
            return env[sp.layer_y], None

        # chunk: unrolled, so XLA fuses across the layers as in one program (a loop stacks
        # every residual jax's partial evaluation names: GPT's 1F1B step, 80 -> 57 MB of XLA
        # temp); 'layer': a loop of checkpointed layers (unrolled, 38 -> 44 MB)
        if self.recompute == "layer":
            x, _ = lax.scan(jax.checkpoint(layer), x, layer_p)
        else:
            x, _ = lax.scan(layer, x, layer_p, unroll=True)

        def post():
            env = run(2, own, (x,))
            (out,) = jx.outvars
            return jnp.asarray(out.val if isinstance(out, jcore.Literal) else env[out],
                               jnp.float32)

        loss = lax.cond(c == C - 1, post, lambda: jnp.zeros((), jnp.float32))
        return x, loss

    @property
    def act(self) -> dict:
        """An activation-buffer entry (and a cotangent's): the layers' activation."""
        x0 = self.split.x0.aval
        return {"x": jax.ShapeDtypeStruct(x0.shape, x0.dtype)}

    cot = act

    def chunk_forward(self, c: Any, args: tuple) -> tuple[dict, Any, dict]:
        """Chunk ``c``'s forward (:meth:`_chunk`) on the block arguments: no collections."""
        p_c, shared, cin, _, bm, _, _ = args
        y, loss = self._chunk(c, p_c, shared, cin["x"], bm)
        return {"x": y}, loss, {}

    def chunk_backward(self, c: Any, args: tuple, seed: Any, split: Any) -> tuple:
        """``jax.vjp`` of chunk ``c`` recomputed from its saved input, seeded by the loss's
        cotangent on the last chunk, by the received cotangent on the others."""
        del split  # (no split backwards: loop_tables refuses 'G' blocks here)
        p_c, shared, cin, gout, bm, _, _ = args
        _, vjp = jax.vjp(lambda p, sh, x: self._chunk(c, p, sh, x, bm), p_c, shared, cin["x"])
        last = c == self.schedule.chunks - 1
        gy = jnp.where(last, jnp.zeros_like(gout["x"]), gout["x"])
        dp, dsh, dx = vjp((gy, jnp.where(last, seed, 0.0).astype(jnp.float32)))
        return dp, dsh, {"x": dx}, None

    def grads(self, pp: dict, batch: tuple, key: Any = None, *, scale: Any = 1.0
              ) -> tuple[jax.Array, dict]:
        """Mean loss over the batch and its gradients (of ``scale x`` the loss) in the
        pipeline layout (traceable); ``key``: the step's key, when the program was traced with
        rng streams."""
        placed, batch_spec, seed = self.microbatches(batch, key, scale)
        shared_spec = [P()] * len(pp["shared"])
        layer_spec = {dt: P(self.axis) for dt in pp["stages"]}
        # Tensor parallelism: manual over the stage and data axes only, the TP axes stay auto.
        manual = {"axis_names": {self.axis, *self.data_axes}} if self.tp_axes else {}
        fn = jax.shard_map(self._local, mesh=self.mesh,
                           in_specs=(shared_spec, layer_spec, batch_spec, {}, P()),
                           out_specs=(P(), shared_spec, layer_spec, {}), check_vma=False,
                           **manual)
        place = lambda tree: jax.tree.map(place_as, tree, self.layout_shardings())
        laid = place({"shared": pp["shared"], "stages": pp["stages"]})
        loss, gs, gl, _ = fn(laid["shared"], laid["stages"], placed, {}, seed)
        grads = {"shared": gs, "stages": gl}
        return loss, place(grads) if self.tp_axes else grads
