"""Pipelined training step: stages over a mesh axis, a schedule's step table in ``shard_map``.

The training program ``loss_fn(module.apply({'params': p}, *batch), *batch)`` is traced once on
one micro-batch (:mod:`nnscaler_jax.pipeline.program`: the step's options, rng keys, nnx
modules) and cut by module path into a *prefix* (e.g. the embeddings), a stack of
identical *layers* (``h_0 .. h_{L-1}``, or one ``nn.scan`` ``h`` over a leading layer axis) and a
*suffix* (e.g. final norm, head and loss). The layers are split into ``stages x virtual``
contiguous chunks; chunk ``c = v * stages + s`` lives on stage ``s`` (its parameters stacked along
a leading axis sharded over the stage mesh axis). The prefix runs in chunk 0, the suffix in the
last chunk; their parameters are replicated and their gradients summed over stages (so tied
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
constraints, with layer parameters stored split as that plan says
(:mod:`nnscaler_jax.pipeline.in_stage`, which also says why this and not a fully manual body).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnscaler_jax.capture.module_call import ModuleCall
from nnscaler_jax.errors import PlanError
from nnscaler_jax.lower.eqns import NO_CONSTRAINTS
from nnscaler_jax.pipeline import schedule as sch
from nnscaler_jax.pipeline.chunks import ProgramCut, run_chunk
from nnscaler_jax.pipeline.in_graph import InGraphRuntime
from nnscaler_jax.pipeline.in_stage import InStagePlan, plan_in_stage
from nnscaler_jax.pipeline.loop_tables import loop_tables
from nnscaler_jax.pipeline.program import on_host, spread_sharding
from nnscaler_jax.pipeline.split import split_program
from nnscaler_jax.pipeline.update import (
    mirror_store,
    place_as,
)

__all__ = ["PipelineProgram"]


# ---- the pipelined program -----------------------------------------------------------------


class PipelineProgram(InGraphRuntime):
    """A pipelined training program for one module, mesh, schedule and batch shape.

    Use :meth:`to_pipeline` / :meth:`from_pipeline` to move parameters between the module's tree
    and the pipeline layout (``{'shared': leaves, 'stages': leaves stacked [stages, virtual,
    layers per chunk, ...]}``), :meth:`grads` for the accumulated loss and gradients, and
    :meth:`train_step` for the jitted optax step.
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
        self.param_avals, self.param_shapes = abstract, [tuple(a.shape) for a in abstract]

    # ---- parameter layout --------------------------------------------------------------------

    def to_pipeline(self, params: Any) -> dict:
        """Module params -> ``{'shared': [...], 'stages': [...]}`` placed on the mesh: laid out
        on the host where the leaves are all in this process (no device holds more than its
        share), else in one jitted program on the mesh."""
        shared_sh, layer_sh = self.leaf_shardings()
        to_layout = self.layout(self.param_avals)[0]
        pp = on_host(to_layout, jax.tree.leaves(params))
        if pp is None:
            # (a leaf laid out over the mesh's devices stays as it is laid out)
            leaves = [jax.device_put(x, self._on_mesh(x)) for x in jax.tree.leaves(params)]
            with jax.set_mesh(self.mesh):  # (the caller's context mesh may be Explicit)
                pp = jax.jit(to_layout, out_shardings={"shared": shared_sh,
                                                       "stages": layer_sh})(leaves)
        # (new buffers: the step donates the shared leaves, which may be the caller's own)
        put = lambda x, sh: jax.device_put(x, sh, may_alias=False)
        return {"shared": [put(x, sh) for x, sh in zip(pp["shared"], shared_sh, strict=True)],
                "stages": [put(x, sh) for x, sh in zip(pp["stages"], layer_sh, strict=True)]}

    def _on_mesh(self, x: Any) -> NamedSharding:
        """Where :meth:`to_pipeline` reads ``x`` from: its own layout where it lies on this
        mesh (its axes and devices, whatever their types), else replicated."""
        sh, mesh = getattr(x, "sharding", None), self.mesh
        same = (isinstance(sh, NamedSharding) and sh.mesh.shape == mesh.shape
                and sh.mesh.axis_names == mesh.axis_names
                and (sh.mesh.devices == mesh.devices).all())
        return NamedSharding(self.mesh, sh.spec) if same else self.shardings()[0]

    def from_pipeline(self, pp: dict, spread: bool = False) -> Any:
        """The inverse of :meth:`to_pipeline` (a module params tree; ``spread``: each leaf
        over the mesh, :func:`~nnscaler_jax.pipeline.program.spread_sharding`, unstacked on
        the host where the layout is all in this process)."""
        to_module = self.layout(self.param_avals)[1]
        got = on_host(to_module, pp) if spread else None
        if got is not None:
            leaves = [self.module_leaf(x, spread) for x in got]
        else:
            rep = self.shardings()[0]
            out = [spread_sharding(self.mesh, a.shape) if spread else rep
                   for a in self.param_avals]
            with jax.set_mesh(self.mesh):
                leaves = jax.jit(to_module, out_shardings=out)(pp)
        return jax.tree.unflatten(self.params_tree, leaves)

    def layout(self, avals: list) -> tuple[Callable, Callable]:
        """Traceable ``(to_layout, to_module)`` between the module's parameter leaves (shaped
        as ``avals``) and ``{'shared', 'stages'}``: each layer leaf stacked ``[stages, virtual,
        layers per chunk, ...]`` (chunk ``c = v * S + s``)."""
        del avals  # (shapes are read off the leaves)
        S, V, K, split = self.schedule.stages, self.schedule.virtual, self.per_chunk, self.split

        def to_layout(leaves: list) -> dict:
            layers = []
            for k in range(len(split.layer_leaves[0])):
                x = (jnp.asarray(leaves[split.layer_leaves[0][k]]) if split.stacked
                     else jnp.stack([leaves[lv[k]] for lv in split.layer_leaves]))
                layers.append(x.reshape((V, S, K) + x.shape[1:]).swapaxes(0, 1))
            return {"shared": [leaves[j] for j in split.shared], "stages": layers}

        def to_module(pp: dict) -> list:
            leaves: list[Any] = [None] * split.n_params
            for j, x in zip(split.shared, pp["shared"], strict=True):
                leaves[j] = x
            for k, x in enumerate(pp["stages"]):
                full = jnp.swapaxes(x, 0, 1).reshape((split.n_layers,) + x.shape[3:])
                for i, lv in enumerate(split.layer_leaves[:1] if split.stacked
                                       else split.layer_leaves):
                    leaves[lv[k]] = full if split.stacked else full[i]
            return leaves

        return to_layout, to_module

    def mini_shapes(self) -> list[tuple[int, ...]]:
        """Per parameter leaf, the shape of its miniature in the optimizer probe: 2 per dim,
        a scanned stack of layers keeping its layer dim."""
        stacked = set(self.split.layer_leaves[0]) if self.split.stacked else set()
        return [tuple(a.shape[:1]) + (2,) * (len(a.shape) - 1) if j in stacked
                else (2,) * len(a.shape) for j, a in enumerate(self.param_avals)]

    def leaf_shardings(self) -> tuple[list[NamedSharding], list[NamedSharding]]:
        """Storage of the ``shared`` and ``stages`` leaves: replicated / over the stage axis,
        and over the tensor-parallel axes as the in-stage plan stores the variables."""
        sp, split = self.stage_plan, self.split
        if sp is None:
            rep, st = self.shardings()
            return [rep] * len(split.shared), [st] * len(split.layer_leaves[0])
        shared = [NamedSharding(self.mesh, P(*sp.var_specs[j])) for j in split.shared]
        layers = []
        for j, v in zip(split.layer_leaves[0], split.layer_params, strict=True):
            spec = sp.layer_spec(j, v, split.stacked)
            layers.append(NamedSharding(self.mesh, P(self.axis, None, None, *spec)))
        return shared, layers

    # ---- the step ----------------------------------------------------------------------------

    @functools.cached_property
    def _cut(self) -> ProgramCut:
        """The split as three segments for :func:`~nnscaler_jax.pipeline.chunks.run_chunk`
        (the one chunk evaluator): the prefix, one layer (the template) and the suffix,
        reading the template's input and the suffix's."""
        sp = self.split
        return ProgramCut(sp.jaxpr, sp.n_params, (sp.pre, sp.layer_eqns, sp.post),
                          ((sp.layer_x,), (sp.xl,)), (), sp.shared)

    def _chunk(self, c, layer_p, shared, x_in, batch):
        """Chunk ``c``'s forward: prefix if first, its layers (the template's segment, scanned
        over their stacked parameters), suffix + loss if last."""
        sp, C, jx = self.split, self.schedule.chunks, self.split.jaxpr.jaxpr
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
        layer_spec = [P(self.axis)] * len(pp["stages"])
        # Tensor parallelism: manual over the stage and data axes only, the TP axes stay auto.
        manual = {"axis_names": {self.axis, *self.data_axes}} if self.tp_axes else {}
        fn = jax.shard_map(self._local, mesh=self.mesh,
                           in_specs=(shared_spec, layer_spec, batch_spec, {}, P()),
                           out_specs=(P(), shared_spec, layer_spec, {}), check_vma=False,
                           **manual)
        shared_sh, layer_sh = self.leaf_shardings()
        place = lambda xs, shs: [place_as(x, sh)
                                 for x, sh in zip(xs, shs, strict=True)]
        loss, gs, gl, _ = fn(place(pp["shared"], shared_sh), place(pp["stages"], layer_sh),
                             placed, {}, seed)
        if self.tp_axes:
            gs, gl = place(gs, shared_sh), place(gl, layer_sh)
        return loss, {"shared": gs, "stages": gl}

    @functools.cached_property
    def _store(self) -> Callable[[Any], Any]:
        """``tree -> tree``: params, or optimizer state mirroring them, laid out as stored
        (:func:`~nnscaler_jax.pipeline.update.mirror_store`)."""
        shared_sh, layer_sh = self.leaf_shardings()
        sp, (S, V, K) = self.split, (self.schedule.stages, self.schedule.virtual, self.per_chunk)
        shape = lambda j: self.param_shapes[j][1:] if sp.stacked else self.param_shapes[j]
        shapes = {"shared": [jax.ShapeDtypeStruct(self.param_shapes[j], np.float32)
                             for j in sp.shared],
                  "stages": [jax.ShapeDtypeStruct((S, V, K) + shape(j), np.float32)
                             for j in sp.layer_leaves[0]]}
        return mirror_store(shapes, {"shared": list(shared_sh), "stages": list(layer_sh)},
                            self.shardings()[0])
