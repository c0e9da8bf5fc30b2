"""One program per stage (MPMD): tensor parallelism inside heterogeneous stages, and any cut
stages whose plan runs them so (``PipelineSettings.executor == 'per-stage'``: stages
data-parallel inside too, where the stage DP prices them faster than the one program's lock
step, each stage running its blocks as their inputs arrive).

:class:`~nnscaler_jax.pipeline.cut_program.CutProgram` runs every stage in one SPMD program, its
chunks in branches of ``lax.switch``. Tensor-parallel chunks cannot run that way on XLA:CPU:
the collectives GSPMD inserts inside a branch (a ``collective-permute`` for a relayout) wait
for every device of the mesh (``RendezvousKey{global_devices=[0..7]}``), while the other
stages run other branches, and the step hangs until XLA aborts it. Here every chunk is its own
pair of jitted programs on its stage's devices, the stage's sub-mesh (data x tensor axes):

- **forward** ``F``: the chunk's equations of the traced micro-batch program, evaluated under
  the in-stage plan's sharding constraints (:mod:`~nnscaler_jax.pipeline.in_stage`: the
  policy's plan of one micro-batch on the tensor-parallel axes; GSPMD inserts the
  collectives) inside a ``shard_map`` manual over the data axes only;
- **backward** ``B``: ``jax.vjp`` of the chunk recomputed from its saved input (as the cut
  program's), adding the parameter gradients to per-data-shard accumulators, one per leaf
  and group (a leaf two of its segments read, the tied table of interlaced's embedding and
  head, has one).

Python walks the schedule's step table (:func:`~nnscaler_jax.pipeline.steps.timeline`),
dispatching each block to its stage; dispatch is asynchronous, so stages run concurrently,
and the values crossing a boundary move between sub-meshes with ``jax.device_put`` (data
shard ``i`` to data shard ``i``). Parameters live on the stage reading them, stored as the
in-stage plan says (split over the tensor axes); a leaf several stages read (tied embeddings)
has a copy on each, updated alike with the sum of their gradients. The optax update runs per
stage (jitted on its sub-mesh) on the module's parameter tree with the other stages' leaves
empty placeholders (the tree keeps the module's structure, so optimizer masks and labels given
as pytrees apply). An optimizer coupling leaves across stages (``clip_by_global_norm``: per
stage it would see one stage's norm; :func:`~nnscaler_jax.pipeline.leafwise.leafwise` probes
it) runs once on the module's whole tree instead, on every device of the mesh: each step the
parameters and gradients move from their stages to the whole mesh (each leaf spread over it,
:func:`~nnscaler_jax.pipeline.program.spread_sharding`, as the optimizer state is kept), and
the new parameters back (the in-graph programs' module view does the same exchange).

Rng streams (dropout) get each micro-batch and data shard its own keys, as in the other
runtimes. Recycling (``nf1b``: ``N`` blocks) and split backwards (``zb-h1``: ``G`` blocks) run.
The all-device blocks of ``interlaced`` (``E`` / ``H`` / ``W``: the embedding before the first
chunk, the head + loss after the last) run as nnScaler runs them: one program on every device,
a mesh whose first tensor axis folds in the stage axis (group ``S``, ``sub[S]``), their
parameters split over it on their largest dim (the vocabulary), GSPMD partitioning the lookup
and the softmax cross-entropy from there. Not run here (a :class:`PlanError`): mutable
collections (the cut program carries them, stages data-parallel inside).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnscaler_jax.capture.module_call import ModuleCall
from nnscaler_jax.errors import PlanError
from nnscaler_jax.lower.eqns import NO_CONSTRAINTS
from nnscaler_jax.lower.replay import explicitly_typed
from nnscaler_jax.pipeline import schedule as sch
from nnscaler_jax.pipeline.chunks import run_chunk, vars_of
from nnscaler_jax.pipeline.cut import cut_traced, per_stage_error
from nnscaler_jax.pipeline.in_stage import plan_in_stage, stage_parts
from nnscaler_jax.pipeline.leafwise import leafwise
from nnscaler_jax.pipeline.program import PipelineRuntime, mirrors, spread_sharding
from nnscaler_jax.pipeline.recycle import traced_program
from nnscaler_jax.pipeline.split_backward import split_backward
from nnscaler_jax.pipeline.steps import blocks, timeline
from nnscaler_jax.pipeline.update import LossScaling, mirror_shardings

__all__ = ["MpmdProgram"]


def _value(env: dict, v: Any) -> Any:
    return v.val if isinstance(v, jcore.Literal) else env[v]


def _floating(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _updater(optimizer: Any) -> Callable:
    """``update(params, grads, opt_state) -> (params, opt_state)``: one optax step."""
    import optax

    def update(params: Any, grads: Any, opt_state: Any) -> tuple[Any, Any]:
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return update


class MpmdProgram(PipelineRuntime):
    """A pipelined training program of a model cut into chunks, tensor-parallel inside stages.

    A :class:`~nnscaler_jax.pipeline.program.PipelineRuntime` dispatched from the host, one
    jitted program per stage; the state's ``'params'``
    and ``'opt_state'`` are lists, one module-shaped tree per stage (leaves of other stages
    empty placeholders).
    """

    def __init__(self, module: Any, loss_fn: Callable, mesh: Any, sched: sch.Schedule,
                 params: Any, batch: tuple, *, stage_of: tuple, policy: Any = None,
                 rules: tuple = (), call: ModuleCall | None = None, recompute: str = "chunk",
                 layer_rules: tuple = (), budget: float | None = None,
                 stage_plans: tuple = (), overlap: bool = False):
        if overlap:
            raise PlanError("pipeline: the per-stage runtime sends each result as its block "
                            "ends, beside the stages' other work; overlap=True (transfers one "
                            "time step late) is the in-graph runtime's. Drop it, or use "
                            "Constraints(pipeline_executor='in-graph')")
        if (err := per_stage_error()) is not None:
            raise err
        self.layer_rules = dict(layer_rules)
        self._setup(module, loss_fn, mesh, sched, batch, policy=policy, recompute=recompute)
        self.user_mesh = mesh
        closed, abstract = traced_program(self, params, batch,
                                          call or ModuleCall.plain(module, params))
        if self.coll_avals:
            raise PlanError(f"train_step: {type(module).__name__} has mutable collections "
                            f"({self.coll_paths[:3]}); tensor parallelism inside heterogeneous "
                            "stages does not carry them. Use policy='dp' (stages data-parallel "
                            "inside), or no pipeline stages")
        self.param_avals = abstract
        self._cut(closed, len(abstract), stage_of)
        self.stage_plans = tuple(plan_in_stage(
            closed, self.param_paths, len(abstract), mesh, self.axis, policy,
            root=type(module).__name__, rules=rules,
            stages=stage_parts(self.cut, self.seg_stage, sched, budget, stage_plans)))
        self._meshes(mesh)
        self._made: dict = {}  # (jitted helpers, built once: accumulators, means)
        kinds = (("F", "B-split", "G") if sched.split_backward else ("F", "B")) \
            + ("N", "N-fresh") * bool(sched.recycles) + ("H",) * sched.all_device
        self._blocks = {k: [self._jit_chunk(k_, k) for k_ in range(self.cut.chunks)]
                        for k in kinds}

    # ---- the cut and where things live -------------------------------------------------------

    def _cut(self, closed: Any, n: int, stage_of: tuple) -> None:
        """Cut the traced program into its segments: the chunks, and with all-device blocks
        (``interlaced``) the embedding segment before them and the head segment after them
        (``seg0`` = 1), which run on every device (``seg_stage``: the group ``S``)."""
        sched, C, S = self.schedule, self.schedule.chunks, self.schedule.stages
        cut, self.layer_starts = cut_traced(
            closed, n, type(self.module).__name__, stage_of, sched,
            layer_rules=self.layer_rules, recompute=self.recompute, made_first=self.x_vars)
        self.cut = cut
        self.seg0 = int(sched.all_device)
        self.seg_stage = tuple(S if not 0 <= k - self.seg0 < C else (k - self.seg0) % S
                               for k in range(cut.chunks))
        invars = cut.jaxpr.jaxpr.invars
        reads = [{v for e in seg for v in vars_of(e.invars)} for seg in cut.segments]
        # per segment, the parameter leaves it reads (its own and shared ones), in leaf order
        self.reads = tuple(tuple(j for j in range(n) if invars[j] in reads[k])
                           for k in range(cut.chunks))
        unread = set(range(n)) - {j for r in self.reads for j in r}  # (kept on stage 0)
        self.stage_leaves = tuple(
            sorted({j for k, r in enumerate(self.reads) if self.seg_stage[k] == s for j in r}
                   | (unread if s == 0 else set()))
            for s in range(S + self.seg0))
        self.owner = {j: min(s for s, mine in enumerate(self.stage_leaves) if j in mine)
                      for j in range(n)}

    def _meshes(self, mesh: Mesh) -> None:
        """Each stage's sub-mesh (its devices, the data and tensor axes, Auto types); with
        all-device blocks also the mesh of every device (group ``S``), the stage axis folded
        into the first tensor axis (which then spans ``stages x`` its devices), so the
        in-stage plan's splits over it split over all devices there (nnScaler's
        vocabulary-split embedding and head)."""
        k = mesh.axis_names.index(self.axis)
        names = tuple(a for a in mesh.axis_names if a != self.axis)
        auto = (jax.sharding.AxisType.Auto,) * len(names)
        self.sub = [Mesh(np.take(mesh.devices, s, axis=k), names, axis_types=auto)
                    for s in range(self.schedule.stages)]
        if self.seg0:
            t = mesh.axis_names.index(self.tp_axes[0])
            devs = np.moveaxis(mesh.devices, k, t - (k < t))  # (stage just before it)
            shape = [n for i, n in enumerate(mesh.devices.shape) if i != k]
            shape[names.index(self.tp_axes[0])] *= self.schedule.stages
            self.sub.append(Mesh(devs.reshape(shape), names, axis_types=auto))
        data = self.data_axes if self.data_axes else None
        self._split = [NamedSharding(m, P(data)) for m in self.sub]
        self._rep = [NamedSharding(m, P()) for m in self.sub]

    def leaf_sharding(self, s: int, j: int) -> NamedSharding:
        """Where group ``s`` keeps parameter leaf ``j``: a stage as the in-stage plan stores
        it; every device (``s == S``, the all-device blocks' leaves) split on its largest dim
        the folded axis divides (the vocabulary of an embedding table or LM head), vectors
        (norm scales, biases) replicated: split, they would split the activations' features
        and GSPMD would gather them back for the head's matmul."""
        if s < self.schedule.stages:
            return NamedSharding(self.sub[s], P(*self.stage_plans[s].var_specs[j]))
        shape, axis = self.param_avals[j].shape, self.tp_axes[0]
        n = self.sub[s].shape[axis]
        dims = [i for i, d in enumerate(shape) if d % n == 0 and len(shape) > 1]
        if not dims:
            return self._rep[s]
        i = max(dims, key=lambda i: shape[i])
        return NamedSharding(self.sub[s], P(*(None,) * i, axis))

    def _stage(self, k: int) -> int:
        """The group running segment ``k``: its stage, or ``S`` (every device)."""
        return self.seg_stage[k]

    # ---- one chunk's programs ----------------------------------------------------------------

    def _evaluate(self, c: int, params: list, xin: list, batch: list, *,
                  recycled: bool = False) -> tuple[list, Any]:
        """Segment ``c`` of one data shard's micro-batch: ``(values it passes on, loss or 0)``
        (the segments are the chunks, and the embedding and head with all-device blocks).

        Recycling (``nf1b``): chunk 0 reads the module's inputs from ``xin`` (the last pass's
        outputs) unless ``xin`` is empty (the first pass: the batch's leading arrays); with
        ``recycled`` the last chunk passes on the model's outputs (a no-grad pass)."""
        cut, C, n_x = self.cut, self.cut.chunks, len(self.x_vars)
        jx = cut.jaxpr.jaxpr
        # (the all-device blocks: GSPMD partitions them from their parameters' split)
        evaluate = NO_CONSTRAINTS.evaluate if self._stage(c) == self.schedule.stages \
            else self.stage_plans[self._stage(c)].evaluate
        env = run_chunk(cut, c, zip([jx.invars[j] for j in self.reads[c]], params, strict=True),
                        batch, xin if c else (xin or batch[:n_x]),
                        x_vars=self.x_vars, layer_starts=self.layer_starts,
                        recompute_layers=self.recompute == "layer", evaluate=evaluate)
        if c < C - 1:
            return [env[v] for v in cut.bounds[c]], jnp.zeros((), jnp.float32)
        outs = [_value(env, v) for v in jx.outvars[1:]] if recycled else []
        return outs, jnp.asarray(_value(env, jx.outvars[0]), jnp.float32)

    def _backward(self, c: int, last: bool, params: list, xin: list, batch: list,
                  gout: list, seed: Any) -> tuple[list, list, Any]:
        """``jax.vjp`` of segment ``c`` on one data shard's micro-batch, seeded by the next
        segment's cotangents ``gout`` and (``last``: it computes the loss) the loss's
        ``seed``: ``(parameter grads, input grads, loss)``."""
        fl = [i for i, x in enumerate(xin) if _floating(x)]

        def f(ps, xf):
            xs = list(xin)
            for i, x in zip(fl, xf, strict=True):
                xs[i] = x
            out, loss = self._evaluate(c, ps, xs, batch)
            return ([o for o in out if _floating(o)], loss), \
                [o for o in out if not _floating(o)]

        (_, loss), vjp, _ = jax.vjp(f, params, [xin[i] for i in fl], has_aux=True)
        gy = [g for g in gout if _floating(g)]
        gp, gx = vjp((gy, jnp.asarray(seed if last else 0.0, jnp.float32)))
        gin = [jnp.zeros_like(x) for x in xin]
        for i, g in zip(fl, gx, strict=True):
            gin[i] = g
        return gp, gin, loss

    def _jit_chunk(self, c: int, kind: str) -> Callable:
        """Segment ``c``'s block ``kind`` on its group's mesh: ``'F'`` forward ``(params,
        xin, batch) -> (xout, loss)``; ``'B'`` backward ``(params, xin, batch, gout, acc,
        seed) -> (gin, acc + grads)``; ``'H'`` the head's ``(params, xin, batch, acc, seed)
        -> (gin, acc + grads, loss)``; a split backward's ``'B-split'`` ``(params, xin,
        batch, gout, seed) -> (gin, kept values)`` and ``'G'`` ``(params, batch, kept, acc,
        seed) -> acc + grads`` (:mod:`~nnscaler_jax.pipeline.split_backward`: both trace the
        chunk's backward alike, so the kept values line up); ``seed``: the loss's cotangent,
        ``scale / M``. Boundary values, micro-batch leaves and kept values are ``[D, ...]``
        (one row per data shard), gradient accumulators ``[D, *leaf]``; the loss is the mean
        over the data shards."""
        M, data = self.schedule.microbatches, self.data_axes
        last = c == self.cut.chunks - 1
        mean = (lambda x: jax.lax.pmean(x, data)) if data else (lambda x: x)
        first = lambda xs: [x[0] for x in xs]
        rows = lambda xs: [x[None] for x in xs]

        def fwd(params, xin, batch):
            out, loss = self._evaluate(c, params, first(xin), first(batch))
            return rows(out), mean(loss / M)

        def nograd(params, xin, batch):  # a recycling pass ('N-fresh': chunk 0's first)
            out, _ = self._evaluate(c, params, first(xin), first(batch), recycled=True)
            return rows(out)

        backward_loss = partial(self._backward, c, last)
        backward = lambda *args: backward_loss(*args)[:2]

        def split(params, xin, batch, gout, seed):  # (G reads params, batch, seed as they are)
            args = (params, xin, batch, gout, seed)
            return split_backward(backward, args, available=(0, 2, 4)), args

        def bwd(params, xin, batch, gout, acc, seed):
            gp, gin = backward(params, first(xin), first(batch), first(gout), seed)
            return rows(gin), [a + g[None] for a, g in zip(acc, gp, strict=True)]

        def head(params, xin, batch, acc, seed):  # forward, loss and backward at once
            gp, gin, loss = backward_loss(params, first(xin), first(batch), [], seed)
            return rows(gin), [a + g[None] for a, g in zip(acc, gp, strict=True)], \
                mean(loss / M)

        def bwd_split(params, xin, batch, gout, seed):
            sp, args = split(params, first(xin), first(batch), first(gout), seed)
            gin, kept = sp.input_grads(*args)
            return rows(gin), rows(kept)

        def wgrad(params, batch, kept, acc, seed):
            shapes = lambda vs: [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in vs]
            xin = shapes(self.cut.bounds[c - 1] if c else ())  # (shapes: G reads neither)
            gout = shapes(self.cut.bounds[c] if not last else ())
            sp, args = split(params, xin, first(batch), gout, seed)
            gp = sp.weight_grads(args, first(kept))
            return [a + g[None] for a, g in zip(acc, gp, strict=True)]

        spec = P(data) if data else P()
        fn, ins, outs = {
            "F": (fwd, (P(), spec, spec), (spec, P())),
            "B": (bwd, (P(), spec, spec, spec, spec, P()), (spec, spec)),
            "H": (head, (P(), spec, spec, spec, P()), (spec, spec, P())),
            "B-split": (bwd_split, (P(), spec, spec, spec, P()), (spec, spec)),
            "G": (wgrad, (P(), spec, spec, spec, P()), spec),
            "N": (nograd, (P(), spec, spec), spec),
            "N-fresh": (lambda p, b: nograd(p, [], b), (P(), spec), spec)}[kind]
        return self._on_stage(self._stage(c), fn, ins, outs,
                              {"B": (4,), "G": (3,), "H": (3,)}.get(kind, ()))

    def _on_stage(self, s: int, fn: Callable, ins: tuple, outs: Any,
                  donate: tuple[int, ...]) -> Callable:
        """``fn`` jitted on stage ``s``'s sub-mesh, manual over the data axes (``ins`` /
        ``outs``: their specs; the tensor axes stay GSPMD's), called inside that mesh; the
        jitted function is its ``.jitted``."""
        if self.data_axes:
            fn = jax.shard_map(fn, mesh=self.sub[s], in_specs=ins, out_specs=outs,
                               check_vma=False, axis_names=set(self.data_axes))
        jitted = jax.jit(fn, donate_argnums=donate)

        def run(*args):
            with jax.set_mesh(self.sub[s]):
                return jitted(*args)

        run.jitted = jitted
        return run

    def abstract_args(self, c: int, kind: str) -> tuple:
        """What segment ``c``'s block ``kind`` (``'F'``, ``'N'``, ``'B'``, ``'B-split'``,
        ``'H'``) is called with, as ``jax.ShapeDtypeStruct`` values laid out on its group's
        mesh (see :meth:`_jit_chunk`)."""
        s, D, cut = self._stage(c), self.dp, self.cut
        aval = lambda a, sh, lead=(): jax.ShapeDtypeStruct((*lead, *a.shape), a.dtype,
                                                           sharding=sh)
        rows = lambda vs: [aval(v.aval, self._split[s], (D,)) for v in vs]
        params = [aval(self.param_avals[j], self.leaf_sharding(s, j)) for j in self.reads[c]]
        xin = rows(cut.bounds[c - 1] if c else ())
        batch = rows(cut.jaxpr.jaxpr.invars[cut.n_params + len(self.x_vars):])
        gout = rows(cut.bounds[c] if c < cut.chunks - 1 else ())
        acc = [aval(self.param_avals[j], sh, (D,))
               for j, sh in zip(self.reads[c], self._acc_shardings(c), strict=True)]
        seed = jax.ShapeDtypeStruct((), jnp.float32)
        return {"F": (params, xin, batch), "N": (params, xin, batch),
                "B": (params, xin, batch, gout, acc, seed),
                "B-split": (params, xin, batch, gout, seed),
                "H": (params, xin, batch, acc, seed)}[kind]

    def block_programs(self, optimizer: Any) -> list[tuple[int, str, Any]]:
        """Every program the step runs, lowered for its group's devices (compile-only ones
        too: nothing runs): ``(group, name, jax.stages.Lowered)``, each segment's blocks
        (``'F 1'``, ``'B 1'``, ...) and each group's optax update (``'update'``). A split
        backward's ``G`` is not among them (its kept values' shapes come from tracing).

        Raises:
            PlanError: an optimizer coupling leaves across stages (its update runs on the
                whole mesh, not per stage).
        """
        if not self.updates_alone(optimizer):
            raise PlanError(
                "check_stages: this optimizer couples leaves across stages (a global norm: "
                "optax.clip_by_global_norm), so its update runs once on the whole mesh, not "
                "per stage; check the stages with a per-leaf optimizer of the same state "
                "(e.g. the chain without its clipping)")
        out = []
        for c in range(self.cut.chunks):
            head = self.seg0 and c == self.cut.chunks - 1  # (H: forward and backward)
            kinds = ["H"] if head else [k for k in ("F", "N", "B", "B-split")
                                        if k in self._blocks]
            for kind in kinds:
                with jax.set_mesh(self.sub[self._stage(c)]):
                    lowered = self._blocks[kind][c].jitted.lower(*self.abstract_args(c, kind))
                out.append((self._stage(c), f"{kind} {c}", lowered))
        update = _updater(optimizer)
        for s, mine in enumerate(self.stage_leaves):
            leaf = lambda j, s=s, mine=mine: (
                jax.ShapeDtypeStruct(self.param_avals[j].shape, self.param_avals[j].dtype,
                                     sharding=self.leaf_sharding(s, j)) if j in mine else
                jax.ShapeDtypeStruct((0,), self.param_avals[j].dtype, sharding=self._rep[s]))
            tree = jax.tree.unflatten(self.params_tree,
                                      [leaf(j) for j in range(len(self.param_avals))])
            with jax.set_mesh(self.sub[s]):
                state = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                        sharding=sh),
                                     jax.eval_shape(optimizer.init, tree),
                                     self._opt_layout(tree, optimizer, self._rep[s]))
                out.append((s, "update", jax.jit(update, donate_argnums=(0, 2)).lower(
                    tree, tree, state)))
        return out

    def chunk_text(self, c: int, kind: str = "F") -> str:
        """Segment ``c``'s forward program (``kind='H'``: the head's forward and backward)
        compiled: HLO text, the collectives it runs. The segments are the chunks (with
        all-device blocks: after the embedding, segment 0; the head last)."""
        with jax.set_mesh(self.sub[self._stage(c)]):
            return self._blocks[kind][c].jitted.lower(
                *self.abstract_args(c, kind)).compile().as_text()

    # ---- the training state ------------------------------------------------------------------

    def _hole(self, s: int, j: int) -> Any:
        """The placeholder of leaf ``j`` on stage ``s``, which does not hold it: empty, so the
        stage's tree keeps the module's structure (optimizer masks and labels apply)."""
        return jax.device_put(np.zeros((0,), self.param_avals[j].dtype), self._rep[s])

    def to_pipeline(self, params: Any) -> list:
        """Module params -> one module-shaped tree per stage: the leaves its chunks read (stage
        0 also those no chunk reads), placed on its sub-mesh as the in-stage plan stores them,
        the others empty placeholders."""
        # (from host copies: a device_put may alias the caller's buffer, which the update
        # donates, even with may_alias=False; checked on jax 0.10 CPU)
        leaves = [np.asarray(x) for x in jax.tree.leaves(params)]
        out = []
        for s, mine in enumerate(self.stage_leaves):
            own = [jax.device_put(leaves[j], self.leaf_sharding(s, j)) if j in mine
                   else self._hole(s, j) for j in range(len(leaves))]
            out.append(jax.tree.unflatten(self.params_tree, own))
        return out

    def from_pipeline(self, pp: list, spread: bool = False) -> Any:
        """The module's params tree of :meth:`to_pipeline`'s layout (each leaf from the first
        stage holding it), as the cut program gives it back: whole arrays on the default
        device (uncommitted), so the module runs on them as on its own parameters; with
        ``spread`` over the whole mesh (:func:`~nnscaler_jax.pipeline.program.
        spread_sharding`)."""
        per = [self.params_tree.flatten_up_to(t) for t in pp]
        leaves = [self.module_leaf(per[self.owner[j]][j], spread)
                  for j in range(len(self.param_avals))]
        return jax.tree.unflatten(self.params_tree, leaves)

    def updates_alone(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` run on each stage's parameters alone updates them as on the
        whole tree (:func:`~nnscaler_jax.pipeline.leafwise.leafwise`): then each stage
        updates its own (else the update runs on the module's whole tree, :meth:`_update`)."""
        key = ("leafwise", id(optimizer))  # (probed once: the step's set-up and init ask)
        if key not in self._made:
            shaped = jax.tree.unflatten(self.params_tree, self.param_avals)
            self._made[key] = (optimizer, leafwise(optimizer, shaped, self.stage_leaves))
        return self._made[key][1]

    def init_state(self, params: Any, optimizer: Any, collections: Any = None) -> dict:
        """``{'params': [per stage], 'opt_state': [optimizer.init per stage]}``; for an
        optimizer coupling leaves across stages (not :meth:`updates_alone`) ``'opt_state'``
        is one state of the module's tree, each moment spread over the whole mesh."""
        del collections  # (refused at construction)
        pp = self.to_pipeline(params)
        if not self.updates_alone(optimizer):
            tree = self._gathered(pp)
            with jax.set_mesh(self.mesh):
                return {"params": pp, "opt_state": jax.jit(
                    optimizer.init, out_shardings=self._opt_layout(
                        tree, optimizer, self.shardings()[0]))(tree)}
        opt = []
        for s, tree in enumerate(pp):
            with jax.set_mesh(self.sub[s]):
                opt.append(jax.jit(optimizer.init,
                                   out_shardings=self._opt_layout(tree, optimizer,
                                                                  self._rep[s]))(tree))
        return {"params": pp, "opt_state": opt}

    def loss_and_grads(self, pp: list, batch: tuple, key: Any = None,
                       colls: Any = None) -> tuple[Any, list]:
        with jax.set_mesh(None):  # (eager glue between stages, as the step)
            return self.grads(pp, batch, key)

    def opt_state_to_module(self, opt_state: Any, pp: list, spread: bool = False) -> Any:
        """The stages' optimizer states (one per stage, of its module-shaped tree) as one
        state of the module's params tree: each moment leaf from the stage holding it (a
        masked optimizer's ``MaskedNode`` kept), the rest (step counts) from stage 0's; one
        state of the whole tree (an optimizer coupling leaves) as it is, its arrays laid
        out as :meth:`from_pipeline` lays out leaves."""
        if not isinstance(opt_state, list):
            return jax.tree.map(lambda x: self.module_leaf(x, spread), opt_state)
        per = [mirrors(o, self.params_tree) for o in opt_state]
        items, outer = per[0]

        def joined(k: int) -> Any:
            flat = [self.params_tree.flatten_up_to(p[0][k][0]) for p in per]
            leaves = [flat[self.owner[j]][j] for j in range(len(self.param_avals))]
            return self.params_tree.unflatten(
                [self.module_leaf(x, spread) if hasattr(x, "shape") else x for x in leaves])

        return outer.unflatten([joined(k) if m == 0 else x for k, (x, m) in enumerate(items)])

    def opt_state_from_module(self, opt_module: Any, like: list, pp: list) -> list:
        """The inverse of :meth:`opt_state_to_module`, on the shardings of ``like`` (the
        stages' states of a fresh ``init_state``, or its one state of the whole tree; new
        buffers, from host copies)."""
        if not isinstance(like, list):
            return jax.tree.map(lambda v, w: jax.device_put(np.asarray(v), w.sharding),
                                opt_module, like)
        got, _ = mirrors(opt_module, self.params_tree)
        out = []
        for s, o in enumerate(like):
            want, outer = mirrors(o, self.params_tree)
            items = [self._stage_leaves(s, x, w) if m == 0 else
                     jax.tree.map(lambda v, w: jax.device_put(np.asarray(v), w.sharding), x, w)
                     for (x, m), (w, _) in zip(got, want, strict=True)]
            out.append(outer.unflatten(items))
        return out

    def _stage_leaves(self, s: int, tree: Any, like: Any) -> Any:
        """A module-shaped tree (a moment) as stage ``s`` keeps it in ``like`` (its own
        moment): its leaves placed as the stage keeps those parameters, the others
        placeholders, and a masked optimizer's ``MaskedNode`` where ``like`` has one (a
        callable mask sees the stage's placeholders, so stages mask differently)."""
        mine = self.stage_leaves[s]
        flat = self.params_tree.flatten_up_to(tree)
        shape = self.params_tree.flatten_up_to(like)
        return self.params_tree.unflatten(
            [w if not hasattr(w, "shape") else
             jax.device_put(np.asarray(x), self.leaf_sharding(s, j)) if j in mine
             else self._hole(s, j) for j, (x, w) in enumerate(zip(flat, shape, strict=True))])

    def _gathered(self, trees: list) -> Any:
        """The stages' trees (parameters, or gradients: each stage holding a leaf has the sum
        of its stages' gradients) as one module tree on the whole mesh, each leaf from the
        first stage holding it, spread over the mesh
        (:func:`~nnscaler_jax.pipeline.program.spread_sharding`)."""
        per = [self.params_tree.flatten_up_to(t) for t in trees]
        return self.params_tree.unflatten(
            [jax.device_put(per[self.owner[j]][j], spread_sharding(self.mesh, a.shape))
             for j, a in enumerate(self.param_avals)])

    def _scattered(self, tree: Any, like: list) -> list:
        """The inverse of :meth:`_gathered`: each stage's leaves from the module ``tree``, laid
        out as the stage keeps them; its placeholders from ``like`` (the stages' trees)."""
        flat = self.params_tree.flatten_up_to(tree)
        out = []
        for s, mine in enumerate(self.stage_leaves):
            old = self.params_tree.flatten_up_to(like[s])
            out.append(self.params_tree.unflatten(
                [jax.device_put(flat[j], self.leaf_sharding(s, j)) if j in mine else old[j]
                 for j in range(len(self.param_avals))]))
        return out

    @staticmethod
    def _opt_layout(tree: Any, optimizer: Any, rep: NamedSharding) -> Any:
        """Shardings of the optimizer's state for the parameters ``tree`` (a stage's, or the
        whole module's spread over the mesh): moments as their parameters (split over the
        tensor axes where they are), the rest (step counts) ``rep`` (``zeros_like`` carries no
        sharding: jitted alone, every moment came out replicated, the whole parameter on each
        device of the stage)."""
        return mirror_shardings(jax.eval_shape(optimizer.init, tree), tree,
                                jax.tree.map(lambda x: x.sharding, tree), rep)

    # ---- the step ----------------------------------------------------------------------------

    def _acc_sharding(self, g: int, j: int) -> NamedSharding:
        """Where group ``g``'s gradient accumulator of leaf ``j`` lives: the leaf's storage
        with a leading dim over the data axes."""
        return NamedSharding(self.sub[g], P(self.data_axes or None,
                                            *self.leaf_sharding(g, j).spec))

    def _acc_shardings(self, c: int) -> list[NamedSharding]:
        """Segment ``c``'s gradient accumulators' shardings, per leaf it reads."""
        return [self._acc_sharding(self._stage(c), j) for j in self.reads[c]]

    def acc_leaves(self, g: int) -> tuple[int, ...]:
        """The leaves group ``g``'s segments read: one gradient accumulator each, shared by
        its segments (a tied table read by the embedding and the head: one)."""
        return tuple(sorted({j for c in range(self.cut.chunks) if self._stage(c) == g
                             for j in self.reads[c]}))

    def _zeros(self, g: int) -> dict[int, Any]:
        """Group ``g``'s gradient accumulators, ``{leaf: [D, *leaf]}``."""
        D, leaves = self.dp, self.acc_leaves(g)
        if ("zeros", g) not in self._made:
            avals = [self.param_avals[j] for j in leaves]
            shs = [self._acc_sharding(g, j) for j in leaves]
            make = lambda: [jnp.zeros((D, *a.shape), a.dtype) for a in avals]
            self._made["zeros", g] = jax.jit(make, out_shardings=shs)
        with jax.set_mesh(self.sub[g]):
            return dict(zip(leaves, self._made["zeros", g](), strict=True))

    def _walk(self, pp: list, batch: tuple, key: Any, seed: Any) -> tuple[Any, dict]:
        """Run the step table: ``(loss, per group its gradient accumulators)``; ``seed``: the
        loss's cotangent per micro-batch."""
        S, K, e = self.schedule.stages, self.cut.chunks, self.seg0
        # [M, D, b, ...] (+ keys [M, D]); a batch typed on the caller's Explicit mesh is
        # reshaped under that mesh (outside any, its out_sharding has no mesh to name)
        typed = any(explicitly_typed(x) for x in jax.tree.leaves(batch))
        with jax.set_mesh(self.user_mesh if typed else None):
            shaped = self.micro_leaves(batch, key)
            shaped = [[x[m] for x in shaped] for m in range(self.schedule.microbatches)]
        leaves = [self.params_tree.flatten_up_to(t) for t in pp]
        params = [[leaves[self._stage(k)][j] for j in self.reads[k]] for k in range(K)]
        acc = {g: self._zeros(g) for g in sorted(set(self.seg_stage))}
        mine = lambda k: [acc[self._stage(k)][j] for j in self.reads[k]]

        def added(k: int, new: list) -> None:  # (the block donated the old ones)
            acc[self._stage(k)].update(zip(self.reads[k], new, strict=True))

        micro: dict[tuple[int, int], list] = {}
        inbox: dict[tuple[int, int], list] = {}
        gbox: dict[tuple[int, int], list] = {}
        saved: dict[tuple[int, int], list] = {}
        kept: dict[tuple[int, int], list] = {}
        move = lambda xs, k: [jax.device_put(x, self._split[self._stage(k)]) for x in xs]
        losses = []
        for row in timeline(self.schedule):
            for s, st in ((s, st) for s, cell in enumerate(row) for st in blocks(cell)):
                if st.all_device and s:  # (in every stage's cell: run once)
                    continue
                k, m = {"E": 0, "W": 0, "H": K - 1}.get(st.kind, st.virtual * S + s + e), \
                    st.microbatch
                g = self._stage(k)
                if (g, m) not in micro:
                    micro[g, m] = [jax.device_put(x, self._split[g]) for x in shaped[m]]
                if st.kind == "N":  # a recycling pass (nf1b)
                    self._recycle(st, k, params[k], micro[g, m], inbox, move)
                    continue
                if st.kind in "FE":  # (chunk 0 of nf1b: the last pass's outputs)
                    xin = inbox.pop((k, m), [])
                    out, loss = self._blocks["F"][k](params[k], xin, micro[g, m])
                    saved[k, m] = xin
                    if k < K - 1:
                        inbox[k + 1, m] = move(out, k + 1)
                    else:
                        losses.append(loss)
                    continue
                if st.kind == "G":  # a split backward's weight gradients (zb-h1)
                    added(k, self._blocks["G"][k](params[k], micro[g, m], kept.pop((k, m)),
                                                  mine(k), seed))
                    continue
                if st.kind == "H":  # the head: forward, loss and backward on every device
                    gin, new, loss = self._blocks["H"][k](
                        params[k], inbox.pop((k, m)), micro[g, m], mine(k), seed)
                    added(k, new)
                    losses.append(loss)
                    gbox[k - 1, m] = move(gin, k - 1)
                    continue
                args = (params[k], saved.pop((k, m)), micro[g, m], gbox.pop((k, m), []))
                if self.schedule.split_backward:  # 'B': the input's cotangent only
                    gin, kept[k, m] = self._blocks["B-split"][k](*args, seed)
                else:  # 'B' (and 'W', the embedding's)
                    gin, new = self._blocks["B"][k](*args, mine(k), seed)
                    added(k, new)
                if k > 0:
                    gbox[k - 1, m] = move(gin, k - 1)
        return sum(float(x) for x in losses), acc

    def _recycle(self, st: Any, c: int, params: list, micro: list, inbox: dict,
                 move: Callable) -> None:
        """Run the no-grad pass ``st`` (``'N'``) of chunk ``c``: chunk 0's first pass reads
        the batch, the others what reached ``inbox``; the last chunk's outputs go to chunk 0,
        for its next pass or, after the last, its forward."""
        C, R, m = self.schedule.chunks, self.schedule.recycles, st.microbatch
        if c == 0 and st.it == 0:
            out = self._blocks["N-fresh"][0](params, micro)
        else:
            out = self._blocks["N"][c](params, inbox.pop(("N", c, m, st.it)), micro)
        if c < C - 1:
            inbox["N", c + 1, m, st.it] = move(out, c + 1)
        elif st.it + 1 < R:
            inbox["N", 0, m, st.it + 1] = move(out, 0)
        else:
            inbox[0, m] = move(out, 0)

    def grads(self, pp: list, batch: tuple, key: Any = None, *, scale: Any = 1.0
              ) -> tuple[Any, list]:
        """Mean loss over the batch and its gradients (of ``scale x`` the loss, float16's loss
        scaling), one module-shaped tree per stage (a
        leaf several stages read: the sum of their gradients on each); ``key``: the step's
        key, when the program was traced with rng streams (each micro-batch and data shard
        its own, :meth:`~nnscaler_jax.pipeline.program.PipelineRuntime.micro_leaves`)."""
        S = self.schedule.stages + self.seg0  # (the groups: stages, all devices)
        seed = np.float32(float(scale) / self.schedule.microbatches)
        loss, acc = self._walk(pp, batch, key, seed)
        part: dict[tuple[int, int], Any] = {}
        for s, sums in acc.items():
            leaves = self.acc_leaves(s)
            if ("mean", s) not in self._made:  # the mean over the data shards' rows
                shs = [self.leaf_sharding(s, j) for j in leaves]
                self._made["mean", s] = jax.jit(lambda xs: [jnp.mean(x, 0) for x in xs],
                                                out_shardings=shs)
            with jax.set_mesh(self.sub[s]):
                means = self._made["mean", s]([sums[j] for j in leaves])
            part.update(((s, j), g) for j, g in zip(leaves, means, strict=True))
        out = []
        for s, mine in enumerate(self.stage_leaves):
            gs = [self._hole(s, j) for j in range(len(self.param_avals))]
            for j in mine:
                got = [jax.device_put(part[t, j], self.leaf_sharding(s, j))
                       for t in range(S) if (t, j) in part]
                aval = self.param_avals[j]  # (a leaf no chunk reads: gradient 0)
                gs[j] = (sum(got[1:], got[0]) if got else jax.device_put(
                    np.zeros(aval.shape, aval.dtype), self.leaf_sharding(s, j)))
            out.append(jax.tree.unflatten(self.params_tree, gs))
        return jnp.asarray(loss, jnp.float32), out

    def _update(self, optimizer: Any) -> Callable[[list, list, Any], tuple[list, Any]]:
        """``(params, grads, opt_state) -> (params, opt_state)``: each stage's jitted optax
        update on its sub-mesh (donated; its results laid out as its state came from
        ``init``, so every step after the first reuses the program), or for an optimizer
        coupling leaves across stages one update of the module's whole tree on the whole
        mesh (the stages' parameters and gradients gathered to it, the new parameters
        scattered back)."""
        update = _updater(optimizer)
        laid = lambda t: jax.tree.map(lambda x: x.sharding, t)
        made: dict[int, Callable] = {}

        def per_stage(params: list, grads: list, opt: list) -> tuple[list, list]:
            out = []
            for s, (p, g, o) in enumerate(zip(params, grads, opt, strict=True)):
                if s not in made:
                    made[s] = jax.jit(update, donate_argnums=(0, 2),
                                      out_shardings=(laid(p), laid(o)))
                with jax.set_mesh(self.sub[s]):
                    out.append(made[s](p, g, o))
            return [p for p, _ in out], [o for _, o in out]

        def whole(params: list, grads: list, opt: Any) -> tuple[list, Any]:
            p, g = self._gathered(params), self._gathered(grads)
            if not made:
                made[0] = jax.jit(update, donate_argnums=(0, 2),
                                  out_shardings=(laid(p), laid(opt)))
            with jax.set_mesh(self.mesh):
                p, opt = made[0](p, g, opt)
            return self._scattered(p, params), opt

        return per_stage if self.updates_alone(optimizer) else whole

    def train_step(self, optimizer: Any, *, return_grads: bool = False,
                   scaling: Any = None) -> Callable:
        """``step(state, batch) -> (state, metrics)``: the step table dispatched stage by
        stage, then each stage's jitted optax update (donated); with ``scaling`` (float16) the
        gradients are unscaled per stage and a step with any non-finite one updates nothing
        (:class:`~nnscaler_jax.pipeline.update.LossScaling`, its rules run on the host)."""
        apply = self._update(optimizer)
        first = {j: min(s for s, mine in enumerate(self.stage_leaves) if j in mine)
                 for j in range(len(self.param_avals))
                 if any(j in mine for mine in self.stage_leaves)}

        counted = [[j for j in mine if first[j] == s]  # (each leaf once in the norm)
                   for s, mine in enumerate(self.stage_leaves)]
        squares = jax.jit(lambda gs: (sum((jnp.sum(jnp.square(g)) for g in gs),
                                          jnp.zeros((), jnp.float32)),
                                      LossScaling.all_finite(gs)))
        unscale = jax.jit(lambda g, scale: LossScaling.unscale(g, {"loss_scale": scale}))

        def step(state: dict, batch: tuple) -> tuple[dict, dict]:
            with jax.set_mesh(None):  # (eager glue between stages: no caller's context mesh)
                return run(state, batch)

        def run(state: dict, batch: tuple) -> tuple[dict, dict]:
            state, key = dict(state), None
            if "rng" in state:  # a new key per step, as the other runtimes
                state["rng"], key = jax.random.split(state["rng"])
            scale = None if scaling is None else float(state["loss_scale"])
            loss, grads = self.grads(state["params"], tuple(batch), key,
                                     scale=1.0 if scale is None else scale)
            sq, finite = [], True
            for s, g in enumerate(grads):
                with jax.set_mesh(self.sub[s]):
                    if scale is not None:
                        grads[s] = g = unscale(g, np.float32(scale))
                    flat = self.params_tree.flatten_up_to(g)
                    got = squares([flat[j] for j in counted[s]])
                sq.append(float(got[0]))
                finite = finite and bool(got[1])
            metrics = {"loss": loss, "grad_norm": jnp.sqrt(jnp.asarray(sum(sq), jnp.float32))}
            if finite:
                params, opt = apply(state["params"], grads, state["opt_state"])
                state.update(params=params, opt_state=opt)
            if scaling is not None:
                state.update(scaling.advance(state, finite))
                metrics.update(loss_scale=jnp.float32(scale), finite=jnp.asarray(finite))
            if "step" in state:  # the steps taken, as the other runtimes count them
                state["step"] = state["step"] + 1
            if return_grads:
                metrics["grads"] = grads
            return state, metrics

        def lower(state: dict, batch: tuple) -> Any:
            raise PlanError("step.lower: this pipelined plan runs one program per stage and "
                            "chunk (plan.pipeline.executor 'per-stage'; tensor-parallel cut "
                            "stages always): no single program to lower. Compile its programs "
                            "with nnscaler_jax.train.check_stages, or plan with "
                            "Constraints(pipeline_executor='in-graph') where the stages are "
                            "data-parallel inside")

        step.lower = lower
        return step
