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

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.extend import core as jcore
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnscaler_jax.constraints import Constraints
from nnscaler_jax.errors import PlanError
from nnscaler_jax.lower.eqns import NO_CONSTRAINTS
from nnscaler_jax.lower.replay import auto_view
from nnscaler_jax.mesh.axes import mesh_axes, require_stage_axis
from nnscaler_jax.pipeline import schedule as sch
from nnscaler_jax.pipeline.cut_blocks import send_if
from nnscaler_jax.pipeline.hetero import CutProgram
from nnscaler_jax.pipeline.in_stage import InStagePlan, plan_in_stage, tensor_axes
from nnscaler_jax.pipeline.loop_tables import loop_tables
from nnscaler_jax.pipeline.mpmd import MpmdProgram, cut_runtime
from nnscaler_jax.pipeline.program import (
    ModuleCall,
    StepOptions,
    check_batch,
    micro_leaves,
    micro_rows,
    split_batch,
    trace_micro,
    typed_key,
)
from nnscaler_jax.pipeline.split import NotALayerStack, split_program
from nnscaler_jax.pipeline.update import initial_state, jitted_step, per_device_bytes, place_as

__all__ = ["PipelineProgram", "PipelineStep"]


# ---- the pipelined program -----------------------------------------------------------------


class PipelineProgram:
    """A pipelined training program for one module, mesh, schedule and batch shape.

    Use :meth:`to_pipeline` / :meth:`from_pipeline` to move parameters between the module's tree
    and the pipeline layout (``{'shared': leaves, 'layers': leaves stacked [stages, virtual,
    layers per chunk, ...]}``), :meth:`grads` for the accumulated loss and gradients, and
    :meth:`train_step` for the jitted optax step.
    """

    def __init__(self, module: Any, loss_fn: Callable, mesh: Any, sched: sch.Schedule,
                 params: Any, batch: tuple, *, policy: Any = None, rules: tuple = (),
                 call: ModuleCall | None = None, recompute: str = "chunk"):
        self.module, self.loss_fn, self.mesh, self.schedule = module, loss_fn, mesh, sched
        self.recompute = recompute  # 'layer': each layer of a chunk under jax.checkpoint
        axes = mesh_axes(mesh)
        self.axis = require_stage_axis(axes)
        if axes[self.axis] != sched.stages:
            raise PlanError(f"schedule has {sched.stages} stages but mesh axis '{self.axis}' has "
                            f"{axes[self.axis]} devices; use pipeline_stages={axes[self.axis]}")
        self.tp_axes = tensor_axes(axes, self.axis, policy)
        if self.tp_axes:  # sharding constraints over the auto (tensor-parallel) axes
            self.mesh = auto_view(mesh)
        self.data_axes = tuple(a for a in mesh.axis_names
                               if a != self.axis and a not in self.tp_axes)
        self.dp = int(np.prod([axes[a] for a in self.data_axes], dtype=np.int64))
        M = sched.microbatches
        self.mb_size = micro_rows(batch, M, self.dp, self.data_axes)
        call = call or ModuleCall.plain(module, params)
        closed, abstract = trace_micro(self, params, batch, call)
        paths, n_params = self.param_paths, len(abstract)
        self.split = split_program(closed, paths, type(module).__name__)
        self.stage_plan: InStagePlan | None = None
        self._eval = NO_CONSTRAINTS.evaluate
        if self.tp_axes:
            self.stage_plan = plan_in_stage(closed, paths, n_params, mesh, self.axis, policy,
                                            root=type(module).__name__,
                                            rules=tuple(dataclasses.replace(r, recompute=None)
                                                        for r in rules))
            self._eval = self.stage_plan.evaluate
        C, L = sched.chunks, self.split.n_layers
        if L % C:
            raise PlanError(f"{L} layers do not split into {sched.stages} stages x "
                            f"{sched.virtual} chunks; use a stage count dividing {L}")
        self.per_chunk = L // C
        self.tables = loop_tables(sched)
        self.param_shapes = [tuple(a.shape) for a in abstract]

    # ---- parameter layout --------------------------------------------------------------------

    def to_pipeline(self, params: Any) -> dict:
        """Module params -> ``{'shared': [...], 'layers': [...]}`` placed on the mesh."""
        rep, _ = self.shardings()
        shared_sh, layer_sh = self.leaf_shardings()
        leaves = [jax.device_put(x, rep) for x in jax.tree.leaves(params)]
        S, V, K = self.schedule.stages, self.schedule.virtual, self.per_chunk
        split = self.split
        shared = [leaves[j] for j in split.shared]
        layers = []
        for k in range(len(split.layer_leaves[0])):
            if split.stacked:
                x = jnp.asarray(leaves[split.layer_leaves[0][k]])
            else:
                x = jnp.stack([leaves[lv[k]] for lv in split.layer_leaves])
            x = x.reshape((V, S, K) + x.shape[1:]).swapaxes(0, 1)  # chunk c = v * S + s
            layers.append(x)
        return {"shared": [jax.device_put(x, sh, may_alias=False)
                           for x, sh in zip(shared, shared_sh, strict=True)],
                "layers": [jax.device_put(x, sh) for x, sh in zip(layers, layer_sh,
                                                                   strict=True)]}

    def from_pipeline(self, pp: dict) -> Any:
        """The inverse of :meth:`to_pipeline` (a module params tree)."""
        split, L = self.split, self.split.n_layers
        leaves: list[Any] = [None] * split.n_params
        for j, x in zip(split.shared, pp["shared"], strict=True):
            leaves[j] = x
        rep, _ = self.shardings()
        for k, x in enumerate(pp["layers"]):
            x = jax.device_put(x, rep)
            full = jnp.swapaxes(x, 0, 1).reshape((L,) + x.shape[3:])
            if split.stacked:
                leaves[split.layer_leaves[0][k]] = full
            else:
                for i, lv in enumerate(split.layer_leaves):
                    leaves[lv[k]] = full[i]
        return jax.tree.unflatten(self.params_tree, leaves)

    def shardings(self) -> tuple[NamedSharding, NamedSharding]:
        """Replicated, and split over the stage axis (leading dim)."""
        return NamedSharding(self.mesh, P()), NamedSharding(self.mesh, P(self.axis))

    def leaf_shardings(self) -> tuple[list[NamedSharding], list[NamedSharding]]:
        """Storage of the ``shared`` and ``layers`` leaves: replicated / over the stage axis,
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

    def _chunk(self, c, layer_p, shared, x_in, batch):
        """Chunk ``c``'s forward: prefix if first, its layers, suffix + loss if last."""
        sp, C = self.split, self.schedule.chunks
        cj = sp.jaxpr
        base = dict(zip(cj.jaxpr.constvars, cj.consts, strict=True))
        for j, x in zip(sp.shared, shared, strict=True):
            base[cj.jaxpr.invars[j]] = x
        for v, x in zip(cj.jaxpr.invars[sp.n_params:], batch, strict=True):
            base[v] = x

        def pre():
            env = dict(base)
            self._eval(sp.pre, env)
            return env[sp.x0]

        x = lax.cond(c == 0, pre, lambda: x_in)

        def layer(x, p):
            env = dict(base)
            for tv, ov in sp.layer_consts:
                env[tv] = ov.val if isinstance(ov, jcore.Literal) else base[ov]
            env[sp.layer_x] = x
            env.update(zip(sp.layer_params, p, strict=True))
            self._eval(sp.layer_eqns, env)
            return env[sp.layer_y], None

        # chunk: unrolled, so XLA fuses across the layers as in one program (a loop stacks
        # every residual jax's partial evaluation names: GPT's 1F1B step, 80 -> 57 MB of XLA
        # temp); 'layer': a loop of checkpointed layers (unrolled, 38 -> 44 MB)
        if self.recompute == "layer":
            x, _ = lax.scan(jax.checkpoint(layer), x, layer_p)
        else:
            x, _ = lax.scan(layer, x, layer_p, unroll=True)

        def post():
            env = dict(base)
            env[sp.xl] = x
            self._eval(sp.post, env)
            (out,) = cj.jaxpr.outvars
            return jnp.asarray(out.val if isinstance(out, jcore.Literal) else env[out],
                               jnp.float32)

        loss = lax.cond(c == C - 1, post, lambda: jnp.zeros((), jnp.float32))
        return x, loss

    def _local(self, shared, layers, batch):
        """Per-device body of the shard_map: run the step table, return (loss, grads)."""
        S, C, M = self.schedule.stages, self.schedule.chunks, self.schedule.microbatches
        tb = self.tables
        s = lax.axis_index(self.axis)
        layers = [x[0] for x in layers]                      # [V, K, ...]
        batch = [x[:, 0] for x in batch]                     # [M, b, ...]
        xs = jax.ShapeDtypeStruct(self.split.x0.aval.shape, self.split.x0.aval.dtype)
        zx = jnp.zeros(xs.shape, xs.dtype)
        T = tb.kind.shape[0]
        tabs = [jnp.asarray(a) for a in (tb.kind, tb.mb, tb.virt, tb.in_slot, tb.g_slot,
                                         tb.rf_slot, tb.rb_slot)]
        sends, zeros_like = jnp.asarray(tb.sends), lambda t: [jnp.zeros_like(x) for x in t]

        def body(t, carry):
            inbuf, gbuf, g_layers, g_shared, loss_acc = carry
            kind, m, v, isl, gsl, rf, rb = [a[t, s] for a in tabs]
            c = v * S + s
            bm = [lax.dynamic_index_in_dim(x, m, keepdims=False) for x in batch]
            p_c = [lax.dynamic_index_in_dim(x, v, keepdims=False) for x in layers]
            x_in = inbuf[isl]

            def idle():
                return zx, zx, zeros_like(p_c), zeros_like(shared), jnp.zeros((), jnp.float32)

            def fwd():
                y, loss = self._chunk(c, p_c, shared, x_in, bm)
                return y, zx, zeros_like(p_c), zeros_like(shared), loss / M

            def bwd():
                f = lambda p, sh, x: self._chunk(c, p, sh, x, bm)
                _, vjp = jax.vjp(f, p_c, shared, x_in)
                last = c == C - 1
                gy = jnp.where(last, jnp.zeros_like(zx), gbuf[gsl])
                gl = jnp.where(last, 1.0 / M, 0.0).astype(jnp.float32)
                dp, dsh, dx = vjp((gy, gl))
                return zx, dx, dp, dsh, jnp.zeros((), jnp.float32)

            send_f, send_b, dp, dsh, loss = lax.switch(kind, [idle, fwd, bwd])
            g_layers = [g.at[v].add(d) for g, d in zip(g_layers, dp, strict=True)]
            g_shared = [g + d for g, d in zip(g_shared, dsh, strict=True)]
            recv_f = send_if(sends[t, 0], send_f, self.axis, [(i, (i + 1) % S) for i in range(S)])
            recv_b = send_if(sends[t, 1], send_b, self.axis, [(i, (i - 1) % S) for i in range(S)])
            inbuf = lax.cond(rf >= 0, lambda b: b.at[rf].set(recv_f), lambda b: b, inbuf)
            gbuf = lax.cond(rb >= 0, lambda b: b.at[rb].set(recv_b), lambda b: b, gbuf)
            return inbuf, gbuf, g_layers, g_shared, loss_acc + loss

        carry = (jnp.zeros((tb.n_in,) + xs.shape, xs.dtype),
                 jnp.zeros((tb.n_g,) + xs.shape, xs.dtype),
                 zeros_like(layers), zeros_like(shared), jnp.zeros((), jnp.float32))
        _, _, g_layers, g_shared, loss = lax.fori_loop(0, T, body, carry)
        g_shared = [lax.psum(g, self.axis) for g in g_shared]
        loss = lax.psum(loss, self.axis)
        if self.data_axes:
            g_shared = [lax.pmean(g, self.data_axes) for g in g_shared]
            g_layers = [lax.pmean(g, self.data_axes) for g in g_layers]
            loss = lax.pmean(loss, self.data_axes)
        return loss, g_shared, [g[None] for g in g_layers]

    def grads(self, pp: dict, batch: tuple, key: Any = None) -> tuple[jax.Array, dict]:
        """Mean loss over the batch and its gradients in the pipeline layout (traceable);
        ``key``: the step's key, when the program was traced with rng streams."""
        data = self.data_axes if self.data_axes else None
        shaped = micro_leaves(self, batch, key)
        shared_spec = [P()] * len(pp["shared"])
        layer_spec = [P(self.axis)] * len(pp["layers"])
        batch_spec = [P(None, data)] * len(shaped)
        # Tensor parallelism: manual over the stage and data axes only, the TP axes stay auto.
        manual = {"axis_names": {self.axis, *self.data_axes}} if self.tp_axes else {}
        fn = jax.shard_map(self._local, mesh=self.mesh,
                           in_specs=(shared_spec, layer_spec, batch_spec),
                           out_specs=(P(), shared_spec, layer_spec), check_vma=False, **manual)
        shared_sh, layer_sh = self.leaf_shardings()
        place = lambda xs, shs: [place_as(x, sh)
                                 for x, sh in zip(xs, shs, strict=True)]
        batch_sh = [NamedSharding(self.mesh, sp) for sp in batch_spec]
        loss, gs, gl = fn(place(pp["shared"], shared_sh), place(pp["layers"], layer_sh),
                          place(shaped, batch_sh))
        if self.tp_axes:
            gs, gl = place(gs, shared_sh), place(gl, layer_sh)
        return loss, {"shared": gs, "layers": gl}

    def _store(self, tree: Any) -> Any:
        """``tree`` (params, or optimizer state mirroring them) laid out as stored.

        TP only (an Auto mesh does not carry shardings through ``zeros_like``): every leaf whose
        path ends like a pipeline parameter's (``['layers'][k]``) and has its shape is placed like
        it; other leaves (step counts) replicated. Keeps the layout stable across steps.
        """
        if not self.tp_axes:
            return tree
        shared_sh, layer_sh = self.leaf_shardings()
        sp, (S, V, K) = self.split, (self.schedule.stages, self.schedule.virtual, self.per_chunk)
        shape = lambda j: self.param_shapes[j][1:] if sp.stacked else self.param_shapes[j]
        by_key = {("shared", i): (sh, self.param_shapes[j])
                  for i, (j, sh) in enumerate(zip(sp.shared, shared_sh, strict=True))}
        by_key.update({("layers", k): (sh, (S, V, K) + shape(j)) for k, (j, sh) in
                       enumerate(zip(sp.layer_leaves[0], layer_sh, strict=True))})
        rep, _ = self.shardings()

        def place(path, x):
            keys = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path[-2:])
            sh, want = by_key.get(keys, (rep, None))
            return place_as(x, sh if tuple(np.shape(x)) == want else rep)

        return jax.tree_util.tree_map_with_path(place, tree)

    def train_step(self, optimizer: Any, *, return_grads: bool = False) -> Callable:
        """A jitted ``step(state, batch) -> (state, metrics)`` with
        ``state = {'params': pipeline params, 'opt_state': ...}`` (see :meth:`init_state`) and
        ``metrics = {'loss': mean loss, 'grad_norm': global gradient norm}`` (and ``'grads'``,
        pipeline layout, with ``return_grads``)."""
        return jitted_step(self.grads, optimizer, self.mesh, store=self._store,
                           return_grads=return_grads)

    def init_state(self, params: Any, optimizer: Any) -> dict:
        """``{'params': to_pipeline(params), 'opt_state': optimizer.init(...)}``."""
        pp = self.to_pipeline(params)
        return initial_state(pp, optimizer, self.mesh, store=self._store)


class PipelineStep:
    """``pm.train_step(loss_fn, optimizer)``: a pipelined training step for a wrapped module.

    The wrapper's ``Constraints(pipeline_stages=S, microbatches=M, schedule=...)`` pick the
    stages (along the mesh's ``stage``/``pipe`` axis) and the schedule. With ``policy=None`` /
    ``'dp'`` the other mesh axes are data-parallel inside each stage; with another policy
    (``'megatron'``, ``'auto'``, a function) the axes named like data axes stay data-parallel and
    the rest (e.g. ``'model'``) are tensor-parallel as the policy plans one micro-batch
    (:attr:`stage_plan`).

    >>> # step = pm.train_step(models_loss_fn, optax.adam(1e-3))
    >>> # state = step.init(variables, tokens)        # params in the pipeline layout
    >>> # state, metrics = step(state, tokens)        # one jitted step: M micro-batches + update
    >>> # params = step.params(state)                 # back to the module's params tree

    Options (as the SPMD step's, :class:`~nnscaler_jax.pipeline.program.StepOptions`):
    ``inputs``, ``module_kwargs`` (``{'deterministic': False}``) and ``rng_streams``; with
    ``step.init(variables, *batch, rng=key)`` (nnx: its own streams' key unless given) each
    micro-batch and data-parallel shard gets its own keys
    (:func:`~nnscaler_jax.pipeline.program.microbatch_rngs`). An nnx module trains its
    ``nnx.Param``; ``step.update(state)`` writes them back into it. ``Constraints(precision=
    'bfloat16')``: float32 master weights cast where each chunk reads them (the cut program).
    Mutable collections (linen ``{'params', 'batch_stats'}`` with ``module_kwargs={'train':
    True}``, nnx ``BatchStat``) run in the cut program and live in ``state['collections']``
    (:mod:`~nnscaler_jax.pipeline.mutable`); ``step.variables(state)`` gives them back.

    Attributes:
        program: the :class:`PipelineProgram` / :class:`CutProgram` / :class:`MpmdProgram`
            (after :meth:`init`).
        jitted: the jitted ``step(state, batch)`` (after :meth:`init`): ``.lower(...)``.
    """

    @property
    def stage_plan(self) -> Any:
        """The in-stage :class:`~nnscaler_jax.plan.plan.Plan` (tensor-parallel axes only) of one
        micro-batch, or None when stages are data-parallel inside (after :meth:`init`)."""
        sp = self.program.stage_plan if self.program is not None else None
        return sp.plan if sp is not None else None

    def __init__(self, pm: Any, loss_fn: Callable, optimizer: Any, *, return_grads: bool = False,
                 **options: Any):
        self.options = StepOptions.of(options)
        self.constraints = pm.constraints or Constraints()  # (none with a saved plan)
        if not pm.pipelined:  # (pipeline_stages, or a saved plan with pipeline settings)
            raise PlanError("train_step builds a pipelined step: wrap the module with "
                            "auto_parallel(mesh, Constraints(pipeline_stages=4, microbatches=8, "
                            "schedule='1f1b')); without stages use pm.apply inside your own "
                            "jax.jit(jax.grad(...))")
        if pm.precision == "float16":
            raise PlanError("train_step: the pipelined step has no loss scaling for float16; "
                            "use Constraints(precision='bfloat16'), or the SPMD step (no "
                            "pipeline stages), which scales the loss")
        self.options = dataclasses.replace(self.options, precision=pm.precision)
        self.pm, self.loss_fn, self.optimizer = pm, loss_fn, optimizer
        self.return_grads = return_grads
        self.program: PipelineProgram | CutProgram | MpmdProgram | None = None
        self.jitted, self.call = None, None  # (after init: the jitted step, the ModuleCall)

    def init(self, variables: Any, *batch: Any, rng: Any = None) -> dict:
        """Plan, build the program for ``batch``'s shapes and lay out the training state
        (``{'params', 'opt_state'}``, ``'collections'`` with any, ``'rng'`` with rng streams)."""
        self.call = call = ModuleCall(self.pm.module, variables, self.options, rng)
        self.program = None
        params, rng = call.params, rng if rng is not None else call.default_rng
        args = self.options.args(batch)
        plan = call.make_plan(self.pm, args, rng)
        pipe, c = plan.pipeline, self.constraints
        if pipe is None:
            raise PlanError("train_step: the plan has no pipeline settings (a saved plan made "
                            "without Constraints(pipeline_stages=...)); re-plan with them")
        sched = sch.require_runnable(sch.from_settings(pipe))  # built-in or op_order-written
        if call.slots and sched.recycles:
            raise PlanError(f"train_step: schedule {sched.name!r} runs its recycling passes "
                            "without rng streams; drop rng= (nnx: rng_streams=()), or use "
                            "schedule='1f1b'")
        args = (self.pm.module, self.loss_fn, self.pm.mesh, sched, params, tuple(batch))
        policy = self.pm.policy if self.pm.policy is not None else plan.policy or None  # (saved)
        kw = {"policy": policy, "rules": c.rules, "call": call, "recompute": pipe.recompute}
        # a stack of identical layers, unless pivots ask for a cut at module boundaries; any
        # other model: heterogeneous stages (hetero.py). Other errors of the stacked program
        # (an in-stage plan that splits nothing) are the user's to see, not a reason to cut.
        stack_error: NotALayerStack | None = None
        # (recycling and all-device blocks run in the cut runtime only)
        if not (c.pipeline_pivots or sched.recycles or sched.all_device
                or self.options.precision  # (casts: made where read, cut program)
                or call.collections):  # (carried by the cut program, mutable.py)
            try:
                self.program = PipelineProgram(*args, **kw)
            except NotALayerStack as e:
                stack_error = e
        if self.program is None:
            try:
                self.program = cut_runtime(self.pm.mesh, policy)(
                    *args, stage_of=pipe.stage_of, layer_rules=pipe.layer_rules, **kw)
            except PlanError as cut_error:
                raise cut_error from stack_error
        self.jitted = self.program.train_step(self.optimizer, return_grads=self.return_grads)
        state = self.program.init_state(
            params, self.optimizer, **({"collections": call.collections} if call.collections
                                       else {}))
        if call.slots:
            rep = self.program.shardings()[0]  # a copy: the step donates its state
            state["rng"] = jax.jit(jnp.copy, out_shardings=rep)(typed_key(rng))
        return state

    def _batch(self, batch: tuple) -> tuple:
        if self.jitted is None:
            raise PlanError("call step.init(variables, *batch) before the first step")
        check_batch(self.program, tuple(batch))
        return split_batch(tuple(batch), self.program.mesh, self.program.data_axes)

    def __call__(self, state: dict, *batch: Any) -> tuple[dict, dict]:
        return self.jitted(state, self._batch(batch))

    def lower(self, state: dict, *batch: Any) -> Any:
        """``jax.jit(step).lower(state, batch)`` (``.compile().memory_analysis()``)."""
        return self.jitted.lower(state, self._batch(batch))

    @property
    def plan(self) -> Any:
        """The plan of the step (its ``pipeline`` settings; after :meth:`init`)."""
        if self.jitted is None:
            raise PlanError("call step.init(variables, *batch) before asking for its plan")
        return self.pm.plan

    def memory(self, state: dict) -> dict[str, int]:
        """Per-device bytes measured from the arrays (the first device of each): ``params``,
        ``optimizer`` (the gradients are laid out like the parameters) and ``collections``."""
        params = per_device_bytes(state["params"])
        return {"params": params, "grads": params,
                "optimizer": per_device_bytes(state["opt_state"]),
                "collections": per_device_bytes(state.get("collections", {}))}

    def params(self, state: dict) -> Any:
        """The module's params tree of ``state`` (nnx: an ``nnx.State`` of its ``nnx.Param``)."""
        return self.call.module_params(self.program.from_pipeline(state["params"]))

    def variables(self, state: dict) -> Any:
        """The module's variables of ``state``: linen ``{'params': ..., **collections}`` (as
        ``module.apply`` takes them), nnx an ``nnx.State`` of its parameters and statistics."""
        colls = state.get("collections")
        colls = {} if colls is None else self.program.collections_from_pipeline(colls)
        return self.call.variables(self.program.from_pipeline(state["params"]), colls)

    def update(self, state: dict) -> None:
        """nnx: write the state's parameters and ``nnx.BatchStat`` back into the module."""
        if self.call is None or not self.call.nnx:
            raise PlanError("step.update(state) writes an nnx module's state; for linen use "
                            "step.variables(state) (or step.params(state)) with apply")
        nnx.update(self.pm.module, self.variables(state))
