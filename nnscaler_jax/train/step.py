"""The SPMD training step: one jitted program per plan with the optax update, ZeRO 1-3, gradient
accumulation over the plan's micro-batches and its precision.

``pm.train_step(loss_fn, optimizer)`` on a wrapper without pipeline stages returns a
:class:`SpmdStep`. Its program is ``loss_fn(pm.apply(variables, *inputs), *batch)`` on each
micro-batch (the wrapped module's planned program, the plan made for the micro-batch's shapes),
gradients summed over micro-batches inside a ``lax.scan`` (one gradient synchronisation per step:
the scan adds local partial gradients, XLA reduces once after it), then the optax update, all
in one ``jax.jit`` with the state donated.

Where the state lives (``Plan.zero``, over the mesh's data axes and each weight's other
data-parallel axes, :func:`zero_specs`):

- ZeRO 0: parameters, gradients and optimizer state as the plan stores the parameters;
- ZeRO 1: optimizer state also sharded over the data axes (the update runs sharded, the new
  parameters are gathered);
- ZeRO 2: gradients too (reduce-scatter instead of all-reduce);
- ZeRO 3: the plan already stores the parameters sharded over the data axes.

Precision: the wrapper captures its calls at the plan's compute dtype with float32 parameters
(master weights); the gradients come back float32 and the optimizer state is float32. Float16
adds dynamic loss scaling (``state['loss_scale']``: the loss is multiplied by it, the
gradients divided; a step with non-finite gradients is skipped and halves it, every
``growth_interval`` finite steps double it).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnscaler_jax.capture.flax import path_str
from nnscaler_jax.capture.module_call import (
    ModuleCall,
    StepOptions,
    key_like,
    microbatch_rngs,
    typed_key,
)
from nnscaler_jax.cost.devices import default_budget_of, device_for_kind
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.errors import PlanError, PlanFormatError
from nnscaler_jax.layout import Layout
from nnscaler_jax.lower.replay import explicitly_typed
from nnscaler_jax.mesh.axes import auto_view, data_axes, mesh_axes
from nnscaler_jax.mesh.gpu import slop_factor, xla_memory_bytes
from nnscaler_jax.pipeline.update import (
    LossScaling,
    mirror_shardings,
    per_device_bytes,
    place_as,
)
from nnscaler_jax.plan.zero import gradient_axes, state_layout

__all__ = ["SpmdStep", "own_axes", "per_device_bytes", "zero_specs"]


def zero_specs(params: Any, shardings: Any, mesh: Any, zero: int, own: Any = None) -> Any:
    """The shardings of the optimizer state's parameter-shaped leaves (and of ZeRO-2's
    gradients): each parameter's own sharding, for ``zero >= 1`` also split over the mesh's
    data axes and over the parameter's ``own`` data-parallel axes (a list of axis tuples in
    ``params``' leaf order, :func:`own_axes`), on the first dims they divide
    (:func:`~nnscaler_jax.plan.zero.state_layout`: where the cost model prices them)."""
    axes = mesh_axes(mesh)
    dp = data_axes(axes)
    if zero < 1 or not (dp or own):
        return shardings
    leaves, tree = jax.tree_util.tree_flatten(params)
    out = []
    for k, (x, s) in enumerate(zip(leaves, tree.flatten_up_to(shardings), strict=True)):
        lay = Layout.from_pspec(s.spec, x.ndim)
        lay = state_layout(x.shape, lay, dp, own[k] if own else (), axes)
        out.append(NamedSharding(mesh, P(*[(d if len(d) > 1 else d[0]) if d else None
                                           for d in lay.dims])))
    return jax.tree_util.tree_unflatten(tree, out)


def own_axes(params: Any, plan: Any, graph: Any) -> list[tuple[str, ...]]:
    """Each parameter's data-parallel axes under ``plan`` (in ``params``' leaf order;
    :func:`~nnscaler_jax.plan.zero.gradient_axes`), found by its variable's name in ``graph``
    (linen: ``params/<path>``; nnx: the module's state path; boxed leaves end in ``value``);
    a leaf of no variable (an nnx rng counter) has none."""
    found = gradient_axes(plan, graph)
    by_name = {v.name: found[v.id] for v in graph.variables}
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = path_str(path).removesuffix("/value")
        hit = next((by_name[n] for n in (name, "params/" + name, name.removeprefix("module/"))
                    if n in by_name), ())
        out.append(hit)
    return out


def fresh(tree: Any) -> Any:
    """``tree``'s arrays copied into new buffers on their own shardings (one program per set
    of devices: a pipelined state spans several sub-meshes)."""
    leaves, td = jax.tree.flatten(tree)
    groups: dict[frozenset, list[int]] = {}
    for i, x in enumerate(leaves):
        groups.setdefault(frozenset(x.sharding.device_set), []).append(i)
    out = list(leaves)
    for idx in groups.values():
        xs = [leaves[i] for i in idx]
        ys = jax.jit(lambda xs: [jnp.copy(x) for x in xs],
                     out_shardings=[x.sharding for x in xs])(xs)
        for i, y in zip(idx, ys, strict=True):
            out[i] = y
    return td.unflatten(out)


def _split_micro(x: jax.Array, m: int) -> jax.Array:
    """``[B, ...] -> [m, B/m, ...]`` taking rows ``i::m`` into micro-batch ``i``: every
    device's block of a batch split over the data axes splits locally."""
    return jnp.moveaxis(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 1, 0)


class TrainStep(abc.ABC):
    """What ``pm.train_step(loss_fn, optimizer, ...)`` returns: one jitted training step for
    the wrapper's plan, with or without pipeline stages.

    Two implementations behind this interface: :class:`SpmdStep` (one SPMD program: ZeRO,
    gradient accumulation, float16 loss scaling) and
    :class:`~nnscaler_jax.train.pipelined_step.PipelineStep` (stages and a schedule). Both
    take the same options, validated here (:class:`~nnscaler_jax.capture.module_call.StepOptions`):
    ``inputs`` (the module takes the first ``inputs`` batch arrays, the loss all of them),
    ``module_kwargs`` (static flags of the module call), ``rng_streams`` (a key per micro-batch
    with ``init(..., rng=key)``), ``return_grads`` and ``growth_interval`` (float16 dynamic
    loss scaling, both steps': finite steps before the scale doubles, default 2000;
    :class:`~nnscaler_jax.pipeline.update.LossScaling`).

    >>> # step = pm.train_step(loss_fn, optax.adamw(1e-3))
    >>> # state = step.init(variables, *batch)      # laid out as the plan says
    >>> # state, metrics = step(state, *batch)      # metrics['loss']
    >>> # step.params(state), step.variables(state), step.memory(state), step.plan
    >>> # step.predicted_memory()                  # the plan's estimate of step.memory's kinds
    >>> # ckpt.save(i, step.checkpoint_state(state))    # the module's trees, any plan
    >>> # state = step.restore_state(saved)             # laid out as this step keeps it
    """

    def __init__(self, pm: Any, loss_fn: Callable, optimizer: Any, *,
                 return_grads: bool = False, growth_interval: int | None = None,
                 **options: Any):
        self.pm, self.loss_fn, self.optimizer = pm, loss_fn, optimizer
        self.options = StepOptions.of(options)
        self.return_grads = return_grads
        if growth_interval is not None and (isinstance(growth_interval, bool) or
                                            not isinstance(growth_interval, int)
                                            or growth_interval < 1):
            raise PlanError(f"train_step: growth_interval={growth_interval!r} must be a "
                            "positive int (finite float16 steps before the loss scale "
                            "doubles), e.g. growth_interval=2000")
        self.scaling = LossScaling(**({} if growth_interval is None
                                      else {"growth_interval": growth_interval}))
        self.jitted: Callable | None = None

    @abc.abstractmethod
    def init(self, variables: Any, *batch: Any, rng: Any = None) -> dict:
        """Plan for ``batch``'s shapes, build the jitted step and lay out its state."""

    @abc.abstractmethod
    def __call__(self, state: dict, *batch: Any) -> tuple[dict, dict]:
        """One step: ``(new state, metrics)`` (``metrics['loss']``)."""

    @abc.abstractmethod
    def lower(self, state: dict, *batch: Any) -> Any:
        """``jax.jit(step).lower(state, batch)`` (``.compile().memory_analysis()``)."""

    @property
    @abc.abstractmethod
    def plan(self) -> Any:
        """The plan the step runs (after :meth:`init`)."""

    @abc.abstractmethod
    def params(self, state: dict) -> Any:
        """The module's params tree of ``state``."""

    @abc.abstractmethod
    def variables(self, state: dict) -> Any:
        """The module's variables of ``state`` (linen: as ``apply`` takes them; nnx: an
        ``nnx.State``)."""

    @abc.abstractmethod
    def memory(self, state: dict) -> dict[str, int]:
        """Per-device bytes measured from the arrays: ``params``, ``grads``, ``optimizer``,
        ``collections``."""

    @abc.abstractmethod
    def predicted_memory(self) -> dict[str, int]:
        """The plan's per-device estimate by kind, comparable with :meth:`memory`:
        ``params``, ``grads``, ``optimizer``, ``activations`` and ``peak`` (the estimate
        the plan was chosen by) at least."""

    @abc.abstractmethod
    def update(self, state: dict) -> None:
        """nnx: write the trained state back into the module."""

    @abc.abstractmethod
    def loss_and_grads(self, variables: Any, *batch: Any, rng: Any = None) -> tuple[Any, Any]:
        """One batch's mean loss and the parameters' gradients as the step computes them
        (its plan, micro-batches, rng keys drawn from ``rng``), without an update: what
        ``nnscaler-jax verify`` compares with the module's own."""

    @abc.abstractmethod
    def checkpoint_state(self, state: dict) -> dict:
        """``state`` as a checkpoint stores it, whatever the plan: the module's params tree,
        the optimizer's state of that tree, the module's collections, the step counter (and
        ``rng``, ``loss_scale``, ``good_steps`` where the state has them). A linen module's is
        the same under any plan, SPMD or pipelined, so a checkpoint written under one plan
        restores under another (:meth:`restore_state`); an nnx module's too when ``init`` got
        a key (without one the SPMD step's streams draw on from their own keys, which it keeps
        as ``other_state``: that checkpoint restores under SPMD plans only). It may share
        arrays with ``state``, which the next step donates: save it before that step
        (``Checkpointer.save`` copies off the devices before it returns)."""

    @abc.abstractmethod
    def restore_state(self, saved: dict) -> dict:
        """A :meth:`checkpoint_state` (this step's or another plan's, read back from a
        checkpoint) laid out as this step keeps its state (after :meth:`init`)."""

    def _check(self) -> None:
        if self.jitted is None:
            raise PlanError("call step.init(variables, *batch) before the first step")


class SpmdStep(TrainStep):
    """The :class:`TrainStep` of a plan without pipeline stages: the module and its loss
    planned as one graph and run as one SPMD program (the plan's ZeRO stage, micro-batches as
    gradient accumulation, float16 loss scaling); options as :class:`TrainStep`'s.

    >>> # step = pm.train_step(loss_fn, optax.adamw(1e-3))
    >>> # state = step.init(variables, tokens)      # laid out as the plan says (ZeRO stage too)
    >>> # state, metrics = step(state, tokens)      # metrics['loss']
    >>> # params = step.params(state)
    """

    def __init__(self, pm: Any, loss_fn: Callable, optimizer: Any, **options: Any):
        super().__init__(pm, loss_fn, optimizer, **options)
        o = self.options
        self.rng_streams = o.rng_streams
        self.model = ModuleCall.of(pm, self.options)
        self.model.loss_fn = loss_fn
        self.microbatches = 1
        self._shardings: dict | None = None
        self._rest0: Any = None  # (nnx, after init: the carried state's initial values)

    # ---- set-up --------------------------------------------------------------------------------

    @property
    def plan(self) -> Any:
        """The plan of the step (made for the whole batch; ``plan.microbatches``) after
        :meth:`init`."""
        self._check()
        return self._plan

    def _micro_count(self, m: int, batch: Sequence[Any]) -> int:
        sizes = {x.shape[0] for x in batch if hasattr(x, "shape") and x.ndim}
        bad = sorted(n for n in sizes if n % m)
        if bad:
            raise PlanError(f"train_step: {m} micro-batches do not divide the batch size "
                            f"{bad[0]} (batch shapes {[tuple(x.shape) for x in batch]}); use "
                            "Constraints(microbatches=k) with k dividing it")
        return m

    def _micro_shardings(self, variables: Any, micro: list, rngs: Any, batch: Sequence[Any]
                         ) -> tuple[Any, Any]:
        """The state's shardings of the plan run on micro-batches of ``micro``'s shapes; a
        plan for the whole batch that does not run on them (its data split does not divide a
        micro-batch) is the micro-batch count's error, said as such."""
        try:
            return self.model.shardings(variables, micro, rngs)
        except PlanError as e:
            m = self.microbatches
            if m == 1:
                raise
            axes = mesh_axes(self.model.core.mesh)
            dp = {a: axes[a] for a in data_axes(axes)}
            why = str(e).splitlines()[0].split(" Either ")[0].removeprefix("saved plan: ")
            raise PlanError(
                f"train_step: the plan of the whole batch ({batch[0].shape[0]} rows) does not "
                f"run on its {m} micro-batches of {micro[0].shape[0]} rows: {why} Use "
                f"Constraints(microbatches=k) with a micro-batch (batch / k) that the data "
                f"axes {dp} divide, or a batch size that makes it so") from e

    def _make_plan(self, variables: Any, batch: Sequence[Any], rngs: Any) -> Any:
        """The plan of the module and its loss as one graph; a saved plan of the module alone
        (``pm.make_plan(x)``'s) runs the module, the loss after it outside the plan."""
        self.model.plans_loss = True
        try:
            return self.model.plan_with_loss(variables, batch, rngs)
        except PlanFormatError:
            if self.model.core.fixed_plan is None:
                raise
        self.model.plans_loss = False
        return self.model.plan_with_loss(variables, batch, rngs)

    def _rngs(self, key: Any, i: Any) -> dict | None:
        return None if key is None else microbatch_rngs(key, i, self.model.streams)

    def _set_up(self, variables: Any, batch: Sequence[Any], rng: Any,
                abstract: bool = False) -> tuple[Any, Any]:
        """Plan the whole batch's call, derive the state's shardings and build the jitted step
        (nothing allocated; ``abstract``, or on GPUs: the state and batch as laid-out
        ``ShapeDtypeStruct`` values too); returns the module's ``(params, collections)``
        trees."""
        asked = self.model.core.constraints
        if asked is not None and asked.microbatches:  # said before planning
            self._micro_count(asked.microbatches, batch)
        rngs = self._rngs(key_like(rng), 0) if rng is not None else None
        whole = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in batch]
        # planned for the whole batch (the planner may choose micro-batches to fit the
        # budget); the micro-batches' calls run that plan at their sizes
        self._plan = plan = self._make_plan(variables, whole, rngs)
        self._graph = self.model.core.graph
        self.microbatches = m = self._micro_count(plan.microbatches, batch)
        if m > 1:
            self.model.use(plan)
        micro = [jax.ShapeDtypeStruct((x.shape[0] // m, *x.shape[1:]), x.dtype)
                 for x in batch]
        p_sh, c_sh = self._micro_shardings(variables, micro, rngs, batch)
        params, colls = self.model.split(variables)
        # the step runs on the Auto view of the mesh: the wrapper's program inside it picks
        # its own types, and optax mixes the state's leaves freely
        self.mesh = mesh = auto_view(self.model.core.mesh)
        # (state the plan does not lay out, an nnx rng counter, is replicated)
        p_sh, c_sh = jax.tree.map(lambda s: NamedSharding(mesh, getattr(s, "spec", P())),
                                  (p_sh, c_sh))
        z_sh = zero_specs(params, p_sh, mesh, plan.zero,
                          own_axes(params, plan, self._graph) if plan.zero else None)
        opt_shapes = jax.eval_shape(self.optimizer.init, params)
        rep = NamedSharding(mesh, P())
        state_sh = {"params": p_sh, "opt_state": mirror_shardings(opt_shapes, params, z_sh, rep),
                    "step": rep, "collections": c_sh}
        if rng is not None:
            state_sh["rng"] = rep
        if plan.precision == "float16":
            state_sh["loss_scale"] = state_sh["good_steps"] = rep
        self._shardings = {"state": state_sh, "grads": z_sh if plan.zero >= 2 else p_sh}
        self.compiler_options = None
        if abstract or getattr(mesh.devices.flat[0], "platform", "cpu") == "gpu":
            self._abstract = (self._abstract_state(params, colls, opt_shapes, rng),
                              self._batch_abstract(batch))
            self.compiler_options = self._gpu_options()
        self.jitted = jax.jit(self._step, out_shardings=(state_sh, None), donate_argnums=0,
                              compiler_options=self.compiler_options)
        return params, colls

    def _abstract_state(self, params: Any, colls: Any, opt_shapes: Any, rng: Any) -> dict:
        """The state :meth:`init` lays out, as ``jax.ShapeDtypeStruct`` values with their
        shardings."""
        sh = self._shardings["state"]

        def sds(x: Any, s: NamedSharding) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), sharding=s)

        state = {"params": jax.tree.map(sds, params, sh["params"]),
                 "collections": jax.tree.map(sds, colls, sh["collections"]),
                 "opt_state": jax.tree.map(sds, opt_shapes, sh["opt_state"]),
                 "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=sh["step"])}
        if rng is not None:
            key = jax.eval_shape(typed_key, rng)
            state["rng"] = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=sh["rng"])
        for name, dtype in (("loss_scale", jnp.float32), ("good_steps", jnp.int32)):
            if name in sh:
                state[name] = jax.ShapeDtypeStruct((), dtype, sharding=sh[name])
        return state

    def _gpu_options(self) -> dict | None:
        """On GPUs: XLA's scheduler and rematerialization limit put at the plan's budget
        (:func:`~nnscaler_jax.mesh.gpu.slop_factor`; XLA's own is ~76% of the device's memory,
        under the default budget), counting the state and the batch as the program's inputs,
        plus the plan's largest all-gather result, which XLA's count holds twice."""
        if getattr(self.mesh.devices.flat[0], "platform", "cpu") != "gpu":
            return None
        asked = self.model.core.constraints
        budget = asked.max_memory_per_device if asked is not None else None
        default = default_budget_of(self.mesh)
        if default is None:
            return None
        io = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                 for x in jax.tree.leaves(self._abstract)
                 if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended))
        kind = str(self.mesh.devices.flat[0].device_kind)
        # XLA counts the largest all-gather's result twice where it lands: its limit is the
        # budget by XLA's count (slop_factor)
        cost = self._plan.cost
        twice = cost.largest_gather_bytes if cost is not None else 0
        slop = slop_factor(int(budget or default.bytes) + twice, io,
                           xla_memory_bytes(kind) or default.memory_bytes)
        return {"xla_gpu_memory_limit_slop_factor": slop}

    def init(self, variables: Any, *batch: Any, rng: Any = None) -> dict:
        """Plan the whole batch's call, lay out the state and build the jitted step.

        Returns ``{'params', 'opt_state', 'collections', 'step'}`` (+ ``'rng'`` when ``rng`` is
        given, + ``'loss_scale'``, ``'good_steps'`` under float16)."""
        rng = rng if self.model.keyed() else None  # (nnx without streams: nothing keyed)
        params, colls = self._set_up(variables, batch, rng)
        state_sh = self._shardings["state"]
        rep = state_sh["step"]
        # copies: the step donates its state, the caller keeps ``variables``
        copy = jax.jit(lambda t: jax.tree.map(jnp.copy, t),
                       out_shardings=(state_sh["params"], state_sh["collections"]))
        params, colls = copy((params, colls))
        if self.model.nnx:  # (what restore_state fills in where a checkpoint leaves it out:
            # a copy of its own, as the step donates the state's)
            self._rest0 = jax.jit(lambda t: jax.tree.map(jnp.copy, t))(colls)
        state = {"params": params, "collections": colls,
                 "step": jax.device_put(jnp.zeros((), jnp.int32), rep)}
        state["opt_state"] = jax.jit(self.optimizer.init,
                                     out_shardings=state_sh["opt_state"])(state["params"])
        if rng is not None:  # (typed, as the pipelined step keeps it: one checkpoint form;
            # a copy: a device_put may alias the caller's key, which the step would donate)
            state["rng"] = jax.jit(jnp.copy, out_shardings=rep)(typed_key(rng))
        if self._plan.precision == "float16":
            state.update(jax.device_put(self.scaling.initial(), rep))
        return state

    def abstract_init(self, variables: Any, *batch: Any, rng: Any = None) -> tuple[dict, tuple]:
        """What :meth:`init` lays out, as ``jax.ShapeDtypeStruct`` values with their shardings,
        and the batch laid out as the plan reads it: ``(state, batch)`` for
        ``step.lower(state, *batch)``. Nothing is allocated, so ``variables`` and ``batch``
        may be abstract and the mesh's devices compile-only
        (:func:`~nnscaler_jax.cost.devices.compile_only_mesh`)."""
        if self.model.nnx:
            raise PlanError("train_step: abstract_init takes a linen module's variables; an "
                            "nnx module holds its arrays (lay it out with step.init)")
        self._set_up(variables, batch, rng, abstract=True)
        return self._abstract

    @property
    def state_shardings(self) -> dict:
        """Where :meth:`init` lays out the state: a dict like it of ``NamedSharding``."""
        self._check()
        return self._shardings["state"]

    def batch_shardings(self, batch: Sequence[Any]) -> tuple[NamedSharding, ...]:
        """Where the plan of the module and its loss reads each batch array (an array the plan
        does not read: split like the first one's leading dim), after :meth:`init`."""
        got = list(self.model.core.argument_shardings())
        lead = None
        if got and got[0] is not None and got[0].spec:
            lead = got[0].spec[0]
        out = []
        for i, x in enumerate(batch):
            s = got[i] if i < len(got) else None
            if s is None:
                s = P(*([lead] if np.ndim(x) and lead is not None else []))
            out.append(NamedSharding(self.mesh, getattr(s, "spec", s)))
        return tuple(out)

    def _batch_abstract(self, batch: Sequence[Any]) -> tuple:
        """The batch as ``ShapeDtypeStruct`` values laid out as :meth:`batch_shardings`."""
        return tuple(jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), sharding=s)
                     for x, s in zip(batch, self.batch_shardings(batch), strict=True))

    # ---- the step ------------------------------------------------------------------------------

    def _grads(self, state: dict, batch: tuple, key: Any) -> tuple:
        """(mean loss, summed-over-micro-batches gradients / m, updated collections)."""
        m, scale = self.microbatches, state.get("loss_scale", 1.0)

        def micro(params, colls, mb, i):
            loss, new = self.model.loss(params, colls, mb, self._rngs(key, i))
            return loss.astype(jnp.float32) * scale, (loss, new)

        grad_fn = jax.value_and_grad(micro, has_aux=True)
        params, colls = state["params"], state["collections"]
        if m == 1:
            (_, (loss, colls)), grads = grad_fn(params, colls, batch, 0)
            return loss, grads, colls
        mbs = tuple(_split_micro(x, m) for x in batch)

        def body(carry, i):
            g_acc, colls, l_acc = carry
            mb = tuple(x[i] for x in mbs)
            (_, (loss, colls)), g = grad_fn(params, colls, mb, i)
            return (jax.tree.map(jnp.add, g_acc, g), colls, l_acc + loss), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        (grads, colls, loss), _ = lax.scan(body, (zeros, colls, jnp.float32(0)), jnp.arange(m))
        return loss / m, jax.tree.map(lambda g: g / m, grads), colls

    def local(self, state: dict, batch: tuple, key: Any) -> tuple[Any, Any, Any]:
        """The step's gradients, without the update: ``(mean loss, gradients, collections)``,
        the gradients laid out as the step keeps them (float16: still loss-scaled) and the
        micro-batches' rng streams drawn from ``key`` (None: none). Traceable; what
        :class:`~nnscaler_jax.train.grouped_step.GroupStep` runs on each group before
        weighing their gradients together."""
        loss, grads, colls = self._grads(state, batch, key)
        return loss, jax.tree.map(place_as, grads, self._shardings["grads"]), colls

    def apply_grads(self, state: dict, loss: Any, grads: Any, colls: Any
                    ) -> tuple[dict, dict]:
        """The update of :meth:`local`'s results: ``(new state, metrics)``. Traceable."""
        state = dict(state)
        metrics = {"loss": loss}
        if "loss_scale" in state:
            grads = LossScaling.unscale(grads, state)
        updates, opt_state = self.optimizer.update(grads, state["opt_state"], state["params"])
        new = {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}
        if "loss_scale" in state:
            new, more = self.scaling.settle(state, new, grads)
            metrics.update(more)
        state.update(new)
        state.update(collections=colls, step=state["step"] + 1)
        if self.return_grads:
            metrics["grads"] = grads
        return state, metrics

    def _step(self, state: dict, batch: tuple) -> tuple[dict, dict]:
        state = dict(state)
        key = None
        if "rng" in state:
            state["rng"], key = jax.random.split(state["rng"])
        return self.apply_grads(state, *self.local(state, batch, key))

    # ---- use -----------------------------------------------------------------------------------

    def _batch(self, batch: Sequence[Any]) -> tuple:
        """Explicit-typed batch arrays moved onto the step's Auto view (same layout)."""
        return tuple(jax.device_put(x, NamedSharding(self.mesh, x.sharding.spec))
                     if explicitly_typed(x) else x for x in batch)

    def __call__(self, state: dict, *batch: Any) -> tuple[dict, dict]:
        self._check()
        return self.jitted(state, self._batch(batch))

    def lower(self, state: dict, *batch: Any) -> Any:
        """``jax.jit(step).lower(state, batch)`` (``.compile().memory_analysis()``)."""
        self._check()
        return self.jitted.lower(state, self._batch(batch))

    def loss_and_grads(self, variables: Any, *batch: Any, rng: Any = None) -> tuple[Any, Any]:
        """One batch's mean loss and the parameters' gradients as the step computes them
        (under its plan, micro-batches accumulated; ``rng``: the key the micro-batches' rng
        streams are drawn from), without an update: what ``nnscaler-jax verify`` compares
        with the module's own. Sets the step up as :meth:`init` does on first use."""
        if self.jitted is None:
            self._set_up(variables, batch, rng)
        params, colls = self.model.split(variables)
        loss, grads, _ = jax.jit(self._grads)({"params": params, "collections": colls},
                                              self._batch(batch), rng)
        return loss, grads

    def params(self, state: dict) -> Any:
        """The module's params tree of ``state``."""
        return state["params"]

    def variables(self, state: dict) -> Any:
        """Linen: ``{'params': ..., **collections}``, as ``module.apply`` takes them; nnx: the
        module's ``nnx.State``."""
        return self.model.variables(state["params"], state["collections"])

    def update(self, state: dict) -> None:
        """nnx: write the state's parameters and other variables back into the module."""
        self.model.update(self.variables(state))

    def checkpoint_state(self, state: dict) -> dict:
        """The state itself: it holds the module's trees (the plan's layout is in its
        shardings); an nnx module's states as the module's pure dicts, as the pipelined step
        keeps them (:meth:`~nnscaler_jax.capture.module_call.ModuleCall.checkpoint_form`)."""
        return self.model.checkpoint_form(state)

    def restore_state(self, saved: dict) -> dict:
        """``saved`` placed on the state's shardings (arrays copied: the step donates its
        state)."""
        self._check()
        sh = self._shardings["state"]
        missing = sorted(set(sh) - set(saved))
        if missing:
            raise PlanError(f"step.restore_state: the saved state has no {missing} (it has "
                            f"{sorted(saved)}); pass what step.checkpoint_state(state) returns")
        saved = self.model.from_checkpoint_form(saved, sh, self._rest0)
        # (new buffers: the step donates its state, a device_put may alias the caller's)
        return fresh(jax.device_put({k: saved[k] for k in sh}, sh))

    def memory(self, state: dict) -> dict[str, int]:
        """Per-device bytes measured from the arrays: ``params``, ``optimizer``, ``grads``
        (from the stored layout of the gradients) and ``collections`` (BatchNorm statistics and
        other mutable collections; 0 without)."""
        g = jax.tree.map(lambda p, s: math.prod(s.shard_shape(p.shape)) * p.dtype.itemsize,
                         state["params"], self._shardings["grads"])
        return {"params": per_device_bytes(state["params"]),
                "grads": int(np.sum(jax.tree_util.tree_leaves(g))),
                "optimizer": per_device_bytes(state["opt_state"]),
                "collections": per_device_bytes(state.get("collections", {}))}

    def predicted_memory(self) -> dict[str, int]:
        """The plan's per-device estimate by kind (``params``, ``grads``, ``optimizer``,
        ``activations``, ``transient``, ``peak``; activations of one micro-batch), priced with
        the mesh's own cost model (Adam: two moments per parameter; the preset of the mesh's
        accelerator, where it has one)."""
        self._check()
        plan = self._plan
        device = device_for_kind(str(getattr(self.mesh.devices.flat[0], "device_kind", "")))
        cm = CostModel.for_axes(dict(plan.mesh), zero=plan.zero,
                                **({"device": device} if device is not None else {}))
        return cm.memory_breakdown(plan, self._graph)
