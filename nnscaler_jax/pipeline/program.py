"""The micro-batch program of a pipelined step, traced once, and the runtimes' interface.

Every pipelined program (:class:`~nnscaler_jax.pipeline.stacked.PipelineProgram`, identical
layers; :class:`~nnscaler_jax.pipeline.cut_program.CutProgram` and :class:`~nnscaler_jax.pipeline.
mpmd.MpmdProgram`, any model) implements :class:`PipelineRuntime` and cuts the same traced
program ``(params..., collections..., batch..., keys...) -> (loss, new collections...)``::

    loss_fn(module(*batch[:inputs], **module_kwargs, rngs=keys), *batch)

on one micro-batch, the module called through the steps' one adapter
(:class:`~nnscaler_jax.capture.module_call.ModuleCall`: options, keys, collections, linen and
nnx).

**Keys.** A step with rng streams carries ``state['rng']``; each step splits it, and the
micro-batch holding rows ``[g * b, (g + 1) * b)`` of the batch (``g = m * D + d`` for micro-batch
``m`` of data-parallel shard ``d``) gets :func:`~nnscaler_jax.capture.module_call.
microbatch_rngs` ``(key, g, streams)`` (the SPMD step's derivation for its micro-batch ``g``).
The keys are inputs of the traced program, sliced per micro-batch in the step loop like the
batch (:meth:`PipelineRuntime.micro_leaves`). They are read where a module makes its rng
(``Dropout``), so no key crosses a stage boundary.

**Collections.** Mutable collections are inputs of the traced program after the parameters,
their new values its outputs after the loss (none without collections: the program returns the
loss alone). How the pipeline carries them: :mod:`nnscaler_jax.pipeline.mutable`.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnscaler_jax.capture.flax import path_str
from nnscaler_jax.capture.module_call import ModuleCall, microbatch_rngs
from nnscaler_jax.errors import PlanError
from nnscaler_jax.lower.replay import explicitly_typed
from nnscaler_jax.mesh.axes import auto_view, mesh_axes, require_stage_axis
from nnscaler_jax.pipeline.in_stage import tensor_axes

__all__ = ["PipelineRuntime", "micro_rows", "mirrors", "on_host", "split_batch",
           "spread_sharding", "stage_axis", "why_cut"]


class PipelineRuntime(abc.ABC):
    """What a pipelined step runs: the interface :class:`~nnscaler_jax.train.pipelined_step.
    PipelineStep` uses, and nothing else of a runtime.

    Two executors implement it: in-graph (:class:`~nnscaler_jax.pipeline.in_graph.
    InGraphRuntime`: one jitted program over the stage axis; its programs
    :class:`~nnscaler_jax.pipeline.stacked.PipelineProgram`, identical stacked layers, tensor
    parallel inside stages, and :class:`~nnscaler_jax.pipeline.cut_program.CutProgram`, any model
    cut at module boundaries, stages data-parallel inside) and host-dispatched
    (:class:`~nnscaler_jax.pipeline.mpmd.MpmdProgram`: cut, one program per stage, tensor
    parallel inside). Each keeps the parameters in its executor's layout (:meth:`to_pipeline`
    / :meth:`from_pipeline`): the in-graph programs the one of
    :mod:`~nnscaler_jax.pipeline.packed` (``{'shared': [leaves every stage stores],
    'stages': {row key: [S, V, width]}}``, each chunk's pieces packed in its rows, on
    tensor-parallel stages as each device's blocks), the host-dispatched one a tree per
    stage; :meth:`_setup` starts every one's set-up.

    Attributes:
        mesh: the mesh the step's state and batch live on (its Auto view).
        data_axes: the mesh axes the batch is split over.
        stage_plans: per stage, its in-stage plan (tensor-parallel axes:
            :class:`~nnscaler_jax.pipeline.in_stage.InStagePlan`); empty when the stages are
            data-parallel inside.
    """

    mesh: Any
    data_axes: tuple[str, ...]
    tp_axes: tuple[str, ...] = ()
    stage_plans: tuple = ()

    def _setup(self, module: Any, loss_fn: Callable, mesh: Any, sched: Any, batch: tuple, *,
               policy: Any, recompute: str) -> None:
        """Sets what every runtime's set-up starts from: ``module``, ``loss_fn``,
        ``schedule``, ``recompute``, the stage ``axis`` (checked against the schedule's stage
        count), ``tp_axes`` (the axes ``policy`` makes tensor-parallel inside stages:
        :func:`~nnscaler_jax.pipeline.in_stage.tensor_axes`), ``mesh`` (its Auto view: GSPMD
        places the tensor-parallel constraints, and the optimizer run on the module's tree
        slices stacked leaves across stages), ``data_axes`` (the others), ``dp`` (their
        devices) and ``mb_size`` (:func:`micro_rows`).

        Raises:
            PlanError: no stage axis, or one of another size than the schedule's stages; a
                batch the micro-batches and data shards do not divide.
        """
        self.module, self.loss_fn, self.schedule = module, loss_fn, sched
        self.recompute = recompute  # 'layer': each layer of a chunk under jax.checkpoint
        axes = mesh_axes(mesh)
        self.axis = stage_axis(axes, sched)
        self.tp_axes = tensor_axes(axes, self.axis, policy)
        self.mesh = auto_view(mesh)
        self.data_axes = tuple(a for a in mesh.axis_names
                               if a != self.axis and a not in self.tp_axes)
        self.dp = math.prod(axes[a] for a in self.data_axes)
        self.mb_size = micro_rows(batch, sched.microbatches, self.dp, self.data_axes)

    @abc.abstractmethod
    def to_pipeline(self, params: Any) -> Any:
        """The module's params tree in the runtime's layout."""

    @abc.abstractmethod
    def from_pipeline(self, pp: Any, spread: bool = False) -> Any:
        """Parameters (or a tree like them: gradients) in the runtime's layout as the module's
        params tree: whole arrays (as the module takes them), or with ``spread`` each leaf
        laid out over the mesh by :func:`spread_sharding` (a checkpoint's: no device holds
        the model whole, where the layout kept each stage's on its own devices)."""

    def shardings(self) -> tuple[NamedSharding, NamedSharding]:
        """The replicated sharding and the stage-split one (leading dim over the stage axis)
        of the runtime's mesh (:meth:`_setup`'s ``mesh`` and ``axis``)."""
        return NamedSharding(self.mesh, P()), NamedSharding(self.mesh, P(self.axis))

    @abc.abstractmethod
    def grads(self, pp: Any, batch: tuple, key: Any = None, *, scale: Any = 1.0
              ) -> tuple[Any, Any]:
        """``(mean loss, gradients in the runtime's layout)`` of one batch, its micro-batches
        run as the schedule says; ``scale``: the loss scale (float16), the gradients are of
        ``scale x`` the mean loss (the last chunk's backward seeded with ``scale / M``)."""

    @abc.abstractmethod
    def train_step(self, optimizer: Any, *, return_grads: bool = False,
                   scaling: Any = None) -> Any:
        """The step ``step(state, batch) -> (state, metrics)`` (jitted, or a host-dispatched
        callable with ``.lower``); ``scaling``: a float16 step's
        :class:`~nnscaler_jax.pipeline.update.LossScaling` (the state carries its scale)."""

    @abc.abstractmethod
    def init_state(self, params: Any, optimizer: Any, collections: Any = None) -> dict:
        """The training state: ``{'params', 'opt_state'}`` in the runtime's layout
        (``'collections'`` with mutable collections)."""

    def collections_from_pipeline(self, pc: Any, spread: bool = False) -> Any:
        """Mutable collections in the runtime's layout as the module's (``spread``: as
        :meth:`from_pipeline`'s)."""
        raise PlanError(f"{type(self).__name__} carries no mutable collections")

    @abc.abstractmethod
    def loss_and_grads(self, pp: Any, batch: tuple, key: Any = None,
                       colls: Any = None) -> tuple[Any, Any]:
        """One batch's mean loss and the gradients in this layout, as the step computes them
        (``key``: the step's key; ``colls``: the collections in this layout, where the program
        carries any), outside the step: ``nnscaler-jax verify``'s figures."""

    def module_leaf(self, x: Any, spread: bool) -> Any:
        """A host array ``x`` as a module-tree leaf: whole on the default device, or with
        ``spread`` over the mesh (:func:`spread_sharding`)."""
        x = np.asarray(x)
        return (jax.device_put(x, spread_sharding(self.mesh, x.shape)) if spread
                else jnp.asarray(x))

    def opt_state_to_module(self, opt_state: Any, pp: Any, spread: bool = False) -> Any:
        """``opt_state`` (the optimizer's state of the parameters ``pp``, in this layout) as
        the optimizer's state of the module's params tree: each subtree laid out like ``pp``
        (moments) through :meth:`from_pipeline` (``spread``: its), the rest (step counts; a
        state the update keeps as the module's tree already, spread over the stages) as it
        is."""
        items, outer = mirrors(opt_state, jax.tree.structure(pp))
        return outer.unflatten([self.from_pipeline(x, spread) if k == 0 else x
                                for x, k in items])

    def opt_state_from_module(self, opt_module: Any, like: Any, pp: Any) -> Any:
        """The inverse of :meth:`opt_state_to_module`: ``opt_module`` (of the module's
        params tree) laid out as ``like`` (this runtime's optimizer state of ``pp``, e.g. a
        fresh ``init_state``'s), on ``like``'s shardings."""
        got, _ = mirrors(opt_module, self.params_tree)
        # (like's moments in the layout, or kept as the module's tree: as they are)
        want, outer = mirrors(like, jax.tree.structure(pp), self.params_tree)
        out = [self.to_pipeline(x) if k == 0 else x
               for (x, _), (_, k) in zip(got, want, strict=True)]
        return jax.device_put(outer.unflatten(out),
                              jax.tree.map(lambda w: w.sharding, like))

    def micro_setup(self, params: Any, batch: tuple, call: ModuleCall) -> tuple[list, Any]:
        """``(parameter avals, the batch's micro-batch avals)``; sets ``params_tree``,
        ``param_paths``, ``coll_tree``, ``coll_paths``, ``coll_avals``, ``batch_tree``,
        ``batch_shapes``, ``key_slots`` and ``key_streams`` (what the runtime of a traced
        micro-batch program reads)."""
        flat, self.params_tree = jax.tree_util.tree_flatten_with_path(params)
        self.param_paths = [path_str(p) for p, _ in flat]
        colls, self.coll_tree = jax.tree_util.tree_flatten_with_path(call.collections)
        self.coll_paths = [path_str(p) for p, _ in colls]
        aval = lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x))
        self.coll_avals = [aval(x) for _, x in colls]
        mb_batch = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((self.mb_size,) + tuple(x.shape[1:]), x.dtype), batch)
        self.batch_tree = jax.tree.structure(mb_batch)
        self.batch_shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(batch)]
        self.key_slots, self.key_streams = call.slots, call.streams
        return [aval(x) for _, x in flat], mb_batch

    def trace_micro(self, params: Any, batch: tuple, call: ModuleCall) -> tuple[Any, list]:
        """``(closed jaxpr (params..., collections..., batch..., keys...) -> (loss, new
        collections...), parameter avals)`` of one micro-batch (``mb_size`` rows; without
        collections the program returns the loss alone); sets what :meth:`micro_setup` sets.

        Raises:
            PlanError: the call returns collections other than those it was given.
        """
        abstract, mb_batch = self.micro_setup(params, batch, call)
        n, nc, nb = len(abstract), len(self.coll_avals), len(jax.tree.leaves(mb_batch))

        def program(*leaves):
            p = jax.tree.unflatten(self.params_tree, leaves[:n])
            c = jax.tree.unflatten(self.coll_tree, leaves[n:n + nc])
            b = jax.tree.unflatten(self.batch_tree, leaves[n + nc:n + nc + nb])
            out, new = call(p, call.options.args(b), leaves[n + nc + nb:], c)
            if jax.tree.structure(new) != self.coll_tree:
                raise PlanError(
                    f"train_step: {type(self.module).__name__} returns the collections "
                    f"{jax.tree.structure(new)} for {self.coll_tree}; the pipelined step "
                    "carries the collections it is given: pass every collection module.init "
                    "returned")
            loss = self.loss_fn(out, *b)
            return (loss, *jax.tree.leaves(new)) if nc else loss

        key = jax.eval_shape(lambda: jax.random.key(0))
        # traced without the caller's context mesh (``with jax.set_mesh(mesh):``): the runtimes
        # evaluate the equations inside their own shard_maps / sub-meshes, where values typed on
        # the caller's Explicit mesh do not bind
        with jax.set_mesh(None):
            closed = jax.make_jaxpr(program)(*abstract, *self.coll_avals,
                                             *jax.tree.leaves(mb_batch), *[key] * len(call.slots))
        return closed, abstract

    def micro_leaves(self, batch: tuple, key: Any = None) -> list:
        """The batch leaves as ``[M, D, b, ...]`` (micro-batch, data shard, rows), then (``key``
        given) one ``[M, D]`` key array per key slot of this runtime's traced program."""
        M, D, b = self.schedule.microbatches, self.dp, self.mb_size
        data = self.data_axes if self.data_axes else None
        # (a batch typed on an Explicit mesh says where the micro-batches go)
        out = [jnp.reshape(x, (M, D, b) + x.shape[1:],
                           **({"out_sharding": P(None, data)} if explicitly_typed(x) else {}))
               for x in jax.tree.leaves(batch)]
        if key is None or not self.key_slots:
            return out

        def keys(g):
            rngs = microbatch_rngs(key, g, self.key_streams)
            return [rngs[s] if i is None else jax.random.fold_in(rngs[s], i)
                    for s, i in self.key_slots]

        return out + [k.reshape(M, D) for k in jax.vmap(keys)(jnp.arange(M * D))]

    def check_batch(self, batch: tuple) -> None:
        """Raise a :class:`PlanError` unless ``batch`` has the arrays and shapes of the batch the
        step was built for (``step.init``): the micro-batch program is traced for them.

        >>> class P: batch_tree = jax.tree.structure((0, 0)); batch_shapes = [(8, 4), (8,)]
        >>> PipelineRuntime.check_batch(P, (np.zeros((8, 4)), np.zeros(8)))
        """
        got = [tuple(np.shape(x)) for x in jax.tree.leaves(batch)]
        if jax.tree.structure(tuple(batch)) == self.batch_tree and got == self.batch_shapes:
            return
        raise PlanError(f"step(state, *batch): the step was built (step.init) for a batch of "
                        f"{len(self.batch_shapes)} arrays shaped {self.batch_shapes}, got "
                        f"{len(got)} shaped {got}. Its micro-batch program is traced for those "
                        "shapes: call step.init(variables, *batch) again for another batch size, "
                        "or pad or drop the last, smaller batch of an epoch")


def why_cut(*, pivots: bool, schedule: Any, precision: str | None, collections: bool,
            keys: bool) -> str | None:
    """Why a model runs as a program cut at module boundaries even where its layers are a stack
    of identical ones, or None when the identical-layer runtime may run it.

    The one rule of which runtime runs a pipelined plan, read by the planner
    (:func:`~nnscaler_jax.pipeline.cut.plan_cut`, which prices the runtime it names) and by the
    step (:class:`~nnscaler_jax.train.pipelined_step.PipelineStep`, which builds it). The
    identical-layer runtime runs one program on every stage: ``F`` / ``B`` blocks only, in the
    module's own precision (a compute precision's parameter casts are made where each chunk
    reads them: the cut program), without mutable collections or rng keys (``keys``: the call
    is keyed, its layers would read a key besides their activation), backwards unsplit.

    >>> why_cut(pivots=False, schedule="1f1b", precision=None, collections=False,
    ...         keys=False) is None
    True
    >>> why_cut(pivots=False, schedule="interlaced", precision=None, collections=False,
    ...         keys=False)
    "schedule 'interlaced' has all-device blocks"
    """
    name = getattr(schedule, "name", schedule)
    if pivots:
        return "pipeline_pivots name the cuts"
    if getattr(schedule, "recycles", name == "nf1b"):
        return f"schedule {name!r} runs no-grad recycling passes"
    if getattr(schedule, "all_device", name == "interlaced"):
        return f"schedule {name!r} has all-device blocks"
    if getattr(schedule, "split_backward", name == "zb-h1"):
        return f"schedule {name!r} splits its backwards (weight-gradient blocks 'G')"
    if precision not in (None, "float32"):
        return f"compute precision {precision} (parameters cast where each chunk reads them)"
    if collections:
        return "mutable collections (carried by the cut program)"
    if keys:
        return "rng keys (each micro-batch's, carried by the cut program)"
    return None


def stage_axis(axes: dict[str, int], sched: Any) -> str:
    """The mesh's stage axis, checked against the schedule's stage count.

    Raises:
        PlanError: no stage axis, or one of another size.
    """
    axis = require_stage_axis(axes)
    if axes[axis] != sched.stages:
        raise PlanError(f"schedule has {sched.stages} stages but mesh axis '{axis}' has "
                        f"{axes[axis]} devices; use pipeline_stages={axes[axis]}")
    return axis


def micro_rows(batch: tuple, microbatches: int, dp: int, data_axes: tuple[str, ...]) -> int:
    """Rows of one micro-batch on one data-parallel shard: ``batch / (microbatches x dp)``.

    Raises:
        PlanError: the batch does not split so.
    """
    B = jax.tree.leaves(batch)[0].shape[0]
    if B % (microbatches * dp):
        raise PlanError(f"batch size {B} does not split into {microbatches} micro-batches x "
                        f"{dp} data-parallel shards ({data_axes}); use a batch size that is a "
                        f"multiple of {microbatches * dp}")
    return B // (microbatches * dp)



def spread_sharding(mesh: Any, shape: tuple[int, ...]) -> NamedSharding:
    """A leaf of ``shape`` over all of ``mesh``'s devices as far as it divides: its largest
    dim that the whole mesh divides split over every axis, else its largest dim that the
    mesh's largest axis divides split over that axis, else replicated. How a pipelined
    step's checkpoint lays out the module's trees (``checkpoint_state``): each device holds
    about its share, as in the runtime's layout, never the model whole.

    >>> import jax
    >>> mesh = jax.make_mesh((2, 4), ("stage", "data"))
    >>> spread_sharding(mesh, (16, 64)).spec, spread_sharding(mesh, (3, 4)).spec
    (P(None, ('stage', 'data')), P(None, 'data'))
    """
    sizes = mesh_axes(mesh)
    split = [a for a in mesh.axis_names if sizes[a] > 1]
    dims = sorted(range(len(shape)), key=lambda d: -shape[d])
    for group in ([tuple(split)] if split else []) + [
            (a,) for a in sorted(split, key=lambda a: -sizes[a])]:
        n = math.prod(sizes[a] for a in group)
        for d in dims:
            if shape[d] % n == 0:
                spec: list[Any] = [None] * len(shape)
                spec[d] = group if len(group) > 1 else group[0]
                return NamedSharding(mesh, P(*spec))
    return NamedSharding(mesh, P())


def on_host(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``fn`` of ``tree`` with its arrays copied to host memory, run on the host's CPU
    device, as numpy arrays (a layout changed there holds no device's memory); None where
    an array is not all in this process (several processes) or there is no CPU device."""
    if not all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(tree)):
        return None
    try:  # (this process's: the first of jax.devices() is process 0's)
        cpu = jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return None
    with jax.default_device(cpu):
        return jax.tree.map(np.asarray, fn(jax.tree.map(np.asarray, tree)))


def mirrors(tree: Any, *defs: Any) -> tuple[list[tuple[Any, int]], Any]:
    """``tree`` (an optimizer state) flattened down to its subtrees of structure ``defs``
    (those mirroring the parameters: moments; a masked optimizer's ``optax.MaskedNode`` in
    a leaf's place counts as that leaf) and its other leaves: ``([(item, the index of its
    structure in defs, -1 for a leaf), ...], the outer treedef)``."""
    import optax

    masked = lambda n: isinstance(n, optax.MaskedNode)
    which = lambda x: next((i for i, d in enumerate(defs)
                            if jax.tree.structure(x, is_leaf=masked) == d), -1)
    items, outer = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: which(x) >= 0)
    return [(x, which(x)) for x in items], outer


def split_batch(batch: tuple, mesh: Any, axes: tuple[str, ...]) -> tuple:
    """``batch`` with each leaf not yet spread over the mesh (a numpy array, an array on one
    device) placed split over ``axes`` along its leading dim, where that dim divides. A jit
    argument left as it is would be copied whole to every device: the step reads it as
    :meth:`PipelineRuntime.micro_leaves` lays it out, ``[M, D, b]``, which no sharding of the
    argument says, so XLA propagates none to it. Leaves the caller spread over the devices keep
    their layout (on ``mesh``'s axis types: a batch typed on the caller's Explicit mesh is
    retyped on the Auto view a tensor-parallel runtime runs on)."""
    ways = math.prod(mesh.shape[a] for a in axes)
    sharding = NamedSharding(mesh, P(axes))
    auto = not any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)

    def one(x: Any) -> Any:
        if auto and isinstance(x, jax.Array) and explicitly_typed(x) and \
                isinstance(x.sharding, NamedSharding):  # (same devices and layout, Auto-typed)
            return jax.device_put(x, NamedSharding(mesh, x.sharding.spec))
        if (ways == 1 or isinstance(x, jax.core.Tracer) or not getattr(x, "shape", ())
                or x.shape[0] % ways or getattr(x, "dtype", None) is None
                or isinstance(x, jax.Array) and len(x.sharding.device_set) > 1):
            return x
        return jax.device_put(x, sharding)

    return jax.tree.map(one, batch)
