"""``pm.train_step(loss_fn, optimizer)`` with pipeline stages: plans, builds the runtime the
plan was priced for (:func:`~nnscaler_jax.pipeline.executor.build_runtime`) and runs its
step."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from nnscaler_jax.capture.module_call import ModuleCall, typed_key
from nnscaler_jax.constraints import Constraints
from nnscaler_jax.errors import PlanError
from nnscaler_jax.pipeline import schedule as sch
from nnscaler_jax.pipeline.executor import build_runtime
from nnscaler_jax.pipeline.program import PipelineRuntime, split_batch
from nnscaler_jax.pipeline.update import per_device_bytes
from nnscaler_jax.train.step import TrainStep, fresh

__all__ = ["PipelineStep"]


class PipelineStep(TrainStep):
    """``pm.train_step(loss_fn, optimizer)``: a pipelined training step for a wrapped module.

    The wrapper's ``Constraints(pipeline_stages=S, microbatches=M, schedule=...)`` pick the
    stages (along the mesh's ``stage``/``pipe`` axis) and the schedule. With ``policy=None`` /
    ``'dp'`` the other mesh axes are data-parallel inside each stage; with another policy
    (``'megatron'``, ``'auto'``, a function) the axes named like data axes stay data-parallel and
    the rest (e.g. ``'model'``) are tensor-parallel as the policy plans one micro-batch
    (:attr:`stage_plans`).

    >>> # step = pm.train_step(models_loss_fn, optax.adam(1e-3))
    >>> # state = step.init(variables, tokens)        # params in the pipeline layout
    >>> # state, metrics = step(state, tokens)        # one jitted step: M micro-batches + update
    >>> # params = step.params(state)                 # back to the module's params tree

    Options (as the SPMD step's, :class:`~nnscaler_jax.capture.module_call.StepOptions`):
    ``inputs``, ``module_kwargs`` (``{'deterministic': False}``) and ``rng_streams``; with
    ``step.init(variables, *batch, rng=key)`` (nnx: its own streams' key unless given) each
    micro-batch and data-parallel shard gets its own keys
    (:func:`~nnscaler_jax.capture.module_call.microbatch_rngs`). An nnx module trains its
    ``nnx.Param``; ``step.update(state)`` writes them back into it. ``Constraints(precision=
    'bfloat16')`` (or ``'float16'``): float32 master weights cast where each chunk reads them
    (the cut program); float16 adds the SPMD step's dynamic loss scaling (``state['loss_scale']``
    seeds the last chunk's backward, :class:`~nnscaler_jax.pipeline.update.LossScaling`:
    ``metrics['loss_scale']``, ``metrics['finite']``; ``growth_interval=``).
    Mutable collections (linen ``{'params', 'batch_stats'}`` with ``module_kwargs={'train':
    True}``, nnx ``BatchStat``) run in the cut program and live in ``state['collections']``
    (:mod:`~nnscaler_jax.pipeline.mutable`); ``step.variables(state)`` gives them back.

    Attributes:
        program: the :class:`~nnscaler_jax.pipeline.program.PipelineRuntime` it runs
            (:class:`PipelineProgram` / :class:`CutProgram` / :class:`MpmdProgram`, after
            :meth:`init`).
        jitted: the jitted ``step(state, batch)`` (after :meth:`init`): ``.lower(...)``.
    """

    @property
    def stage_plans(self) -> tuple:
        """Per stage, its in-stage :class:`~nnscaler_jax.plan.plan.Plan` (tensor-parallel axes
        only) of one micro-batch; empty when stages are data-parallel inside (after
        :meth:`init`). A stack of identical layers runs one plan on every stage; a cut model
        plans each stage's chunks on their own, under the stage's budget."""
        sps = self.program.stage_plans if self.program is not None else ()
        return tuple(sp.plan for sp in sps)

    @property
    def stage_plan(self) -> Any:
        """The in-stage plan every stage runs (a stack of identical layers), else None
        (:attr:`stage_plans`)."""
        plans = self.stage_plans
        return plans[0] if plans and all(p is plans[0] for p in plans) else None

    def __init__(self, pm: Any, loss_fn: Callable, optimizer: Any, **options: Any):
        super().__init__(pm, loss_fn, optimizer, **options)
        self.constraints = pm.constraints or Constraints()  # (none with a saved plan)
        if not pm.pipelined:  # (pipeline_stages, or a saved plan with pipeline settings)
            raise PlanError("train_step builds a pipelined step: wrap the module with "
                            "auto_parallel(mesh, Constraints(pipeline_stages=4, microbatches=8, "
                            "schedule='1f1b')); without stages use pm.apply inside your own "
                            "jax.jit(jax.grad(...))")
        self.options = dataclasses.replace(self.options, precision=pm.precision)
        self.program: PipelineRuntime | None = None
        self.call: ModuleCall | None = None  # (after init)

    def init(self, variables: Any, *batch: Any, rng: Any = None) -> dict:
        """Plan, build the program for ``batch``'s shapes and lay out the training state
        (``{'params', 'opt_state', 'step'}``, ``'collections'`` with any, ``'rng'`` with rng
        streams, ``'loss_scale'`` and ``'good_steps'`` under float16)."""
        params, rng = self.build(variables, *batch, rng=rng)
        call = self.call
        fp16 = self.options.precision == "float16"
        state = self.program.init_state(
            params, self.optimizer, **({"collections": call.collections} if call.collections
                                       else {}))
        rep = self.program.shardings()[0]
        if call.slots:  # (a copy: the step donates its state)
            state["rng"] = jax.jit(jnp.copy, out_shardings=rep)(typed_key(rng))
        if fp16:
            state.update(jax.device_put(self.scaling.initial(), rep))
        state["step"] = jax.device_put(jnp.zeros((), jnp.int32), rep)
        return state

    def checkpoint_state(self, state: dict) -> dict:
        """The state with the parameters, the optimizer's state and the collections as the
        module's trees (out of the runtime's layout: stacked layers, packed rows or a tree per
        stage), each leaf spread over the mesh (:func:`~nnscaler_jax.pipeline.program.
        spread_sharding`: a device holds about its share, as in the layout); the SPMD step's
        form, so either restores the other's."""
        self._check()
        prog = self.program
        out = {k: v for k, v in state.items() if k not in ("params", "opt_state")}
        # (spread over the mesh: no device holds the model or its moments whole)
        out["params"] = prog.from_pipeline(state["params"], spread=True)
        out["opt_state"] = prog.opt_state_to_module(state["opt_state"], state["params"],
                                                    spread=True)
        # (none: an empty tree, as the SPMD step keeps them)
        out["collections"] = (prog.collections_from_pipeline(state["collections"], spread=True)
                              if "collections" in state else {})
        other = self.call.other_state("rng" in state)  # (nnx: the variables it does not carry)
        if other is not None:
            out["other_state"] = other
        return out

    def restore_state(self, saved: dict) -> dict:
        """``saved`` laid out in the runtime's layout, as :meth:`init` lays out a state."""
        self._check()
        want = {"params", "opt_state", "step", *(("collections",) if self.call.collections
                                                  else ()),
                *(("rng",) if self.call.slots else ()),
                *(("loss_scale", "good_steps") if self.options.precision == "float16"
                  else ())}
        missing = sorted(want - set(saved))
        if missing:
            raise PlanError(f"step.restore_state: the saved state has no {missing} (it has "
                            f"{sorted(saved)}); pass what step.checkpoint_state(state) returns")
        colls = {"collections": saved["collections"]} if self.call.collections else {}
        state = self.program.init_state(saved["params"], self.optimizer, **colls)
        state["opt_state"] = self.program.opt_state_from_module(
            saved["opt_state"], state["opt_state"], state["params"])
        rep = self.program.shardings()[0]
        rest = {k: saved[k] for k in want - {"params", "opt_state", "collections"}}
        if "rng" in rest:
            rest["rng"] = typed_key(rest["rng"])
        state.update(jax.device_put(rest, jax.tree.map(lambda _: rep, rest)))
        return fresh(state)  # (none of the caller's buffers: the step donates its state)

    def build(self, variables: Any, *batch: Any, rng: Any = None) -> tuple[Any, Any]:
        """Plan and build the program (:attr:`program`, :attr:`jitted`) for ``batch``'s
        shapes, laying nothing out: ``(the module's params, the rng key)``. :meth:`init`
        then lays out the state; without it ``variables`` and ``batch`` may be abstract
        (``jax.ShapeDtypeStruct``) and the mesh's devices compile-only (the per-stage
        programs compiled for a GPU: :func:`~nnscaler_jax.train.xla_gpu.check_stages`)."""
        self.call = call = ModuleCall.of(self.pm, self.options).bind(variables, rng)
        self.program = None
        params, rng = call.params, rng if rng is not None else call.default_rng
        args = self.options.args(batch)
        plan = call.make_plan(args, rng)
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
        kw = {"policy": policy, "rules": c.rules, "call": call, "recompute": pipe.recompute,
              "budget": c.max_memory_per_device, "overlap": pipe.overlap}
        self.program = build_runtime(args, kw, pipe, pivots=bool(c.pipeline_pivots),
                                     precision=self.options.precision,
                                     collections=bool(call.collections),
                                     keys=bool(call.slots))
        fp16 = self.options.precision == "float16"
        self.jitted = self.program.train_step(self.optimizer, return_grads=self.return_grads,
                                              scaling=self.scaling if fp16 else None)
        return params, rng

    def _batch(self, batch: tuple) -> tuple:
        self._check()
        self.program.check_batch(tuple(batch))
        return split_batch(tuple(batch), self.program.mesh, self.program.data_axes)

    def __call__(self, state: dict, *batch: Any) -> tuple[dict, dict]:
        """One step: ``(new state, metrics)``; with ``return_grads``, ``metrics['grads']`` is
        the module's params tree, as :meth:`params` gives the parameters (a step compiled
        from :meth:`lower` returns them in the runtime's layout:
        ``step.program.from_pipeline`` maps them back)."""
        state, metrics = self.jitted(state, self._batch(batch))
        if self.return_grads:
            metrics = {**metrics, "grads": self._module_tree(metrics["grads"])}
        return state, metrics

    def loss_and_grads(self, variables: Any, *batch: Any, rng: Any = None) -> tuple[Any, Any]:
        """One batch's mean loss and the parameters' gradients (the module's tree) as the
        pipelined step computes them, without an update: what ``nnscaler-jax verify`` compares
        with the module's own. ``rng`` is the step's key (each micro-batch ``m`` of data shard
        ``d`` draws ``microbatch_rngs(rng, m * D + d)``; nnx: its first stream's key unless
        given). Builds the program as :meth:`init` does on first use."""
        if self.program is None:
            self.build(variables, *batch, rng=rng)
        call, prog = self.call, self.program
        params, colls = (call.params, call.collections) if call.nnx or variables is None \
            else call.split(variables)
        key = None
        if call.slots:
            key = typed_key(rng if rng is not None else call.default_rng)
        pc = prog.collections_to_pipeline(colls) if colls else None
        loss, g = prog.loss_and_grads(prog.to_pipeline(params), self._batch(batch), key, pc)
        return loss, self._module_tree(g)

    def _module_tree(self, pp: Any) -> Any:
        """A tree in the runtime's parameter layout as the module's params tree."""
        return self.call.module_params(self.program.from_pipeline(pp))

    def lower(self, state: dict, *batch: Any) -> Any:
        """``jax.jit(step).lower(state, batch)`` (``.compile().memory_analysis()``)."""
        batch = self._batch(batch)  # (says to call init first)
        return self.jitted.lower(state, batch)

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

    def predicted_memory(self) -> dict[str, int]:
        """The plan's per-device estimate by kind, each on the stage that holds the most of
        it, as :meth:`memory` measures (the pipeline pricing's,
        :attr:`~nnscaler_jax.plan.plan.PlanCost.memory_kinds`): ``params``, ``grads``,
        ``optimizer`` (Adam: two moments per parameter), ``activations`` (the stage inputs
        and cotangents the schedule keeps, one chunk's activations, a split backward's kept
        values; a stage planned by the in-stage search: its plan's) and ``peak``, the
        largest stage's total (the plan's ``memory_bytes_per_device``)."""
        self._check()
        cost = self.plan.cost
        kinds = dict(cost.memory_kinds) if cost is not None else {}
        if not kinds:
            raise PlanError("step.predicted_memory(): the plan has no memory estimate by kind "
                            "(a saved plan without its cost); re-plan, or save the plan "
                            "made by this version")
        return kinds

    def params(self, state: dict) -> Any:
        """The module's params tree of ``state`` (nnx: an ``nnx.State`` of its ``nnx.Param``)."""
        return self._module_tree(state["params"])

    def variables(self, state: dict) -> Any:
        """The module's variables of ``state``: linen ``{'params': ..., **collections}`` (as
        ``module.apply`` takes them), nnx an ``nnx.State`` of its parameters and statistics."""
        colls = state.get("collections")
        colls = {} if colls is None else self.program.collections_from_pipeline(colls)
        return self.call.variables(self.program.from_pipeline(state["params"]), colls)

    def update(self, state: dict) -> None:
        """nnx: write the state's parameters and ``nnx.BatchStat`` back into the module."""
        self._check()
        self.call.update(self.variables(state))
