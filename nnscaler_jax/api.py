"""``auto_parallel``: wrap a Flax module so it runs as one program over a device mesh.

Orchestration only: capture (``capture/``), plan (``plan/``, ``primitives``), lower (``lower/``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import flax.errors
import flax.linen as nn
import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from nnscaler_jax.capture.flax import (
    CallArgs,
    ModuleAttributes,
    Traceable,
    assigned_state,
    linen_traceable,
    nnx_traceable,
    original_calls,
    rng_streams,
)
from nnscaler_jax.capture.jaxpr import graph_from_jaxpr
from nnscaler_jax.capture.metadata import is_boxed, partitioning_specs, unbox
from nnscaler_jax.capture.precision import with_precision
from nnscaler_jax.capture.trace import (
    Captured,
    abstract_init,
    warn_float32_matmuls,
    warn_unannotated,
)
from nnscaler_jax.constraints import Constraints
from nnscaler_jax.errors import ConstraintError, PlanError, shapes_summary
from nnscaler_jax.ir.graph import Graph, Role
from nnscaler_jax.lower.explicit import result_specs
from nnscaler_jax.lower.program import Program, place, signature
from nnscaler_jax.lower.replay import Lowering, explicit_context, explicitly_typed
from nnscaler_jax.lower.verify import compare_outputs
from nnscaler_jax.mesh.axes import mesh_axes
from nnscaler_jax.plan.plan import Plan
from nnscaler_jax.plan.reuse import saved_plan
from nnscaler_jax.planner import make_plan
from nnscaler_jax.train.grouped_step import GroupStep
from nnscaler_jax.train.pipelined_step import PipelineStep
from nnscaler_jax.train.step import SpmdStep

__all__ = ["AutoParallel", "auto_parallel"]

# Wrapper state that is not nnx state: keyed weakly by the wrapper / decorated instance.
_CORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# The wrapper of an instance of a decorated linen class, kept in the instance's __dict__: linen
# modules are frozen dataclasses hashed by value (unhashable fields are allowed), and a weak map
# whose value (the wrapper) holds its key (the instance) would never let the key go.
_LINEN_CORE = "_nnscaler_jax_core"


def _abstract(x: Any) -> Any:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    return jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x))


_NO_MESH = jax.sharding.AbstractMesh((), ())
_INIT_MUTABLE = nn.DenyList("intermediates")  # module.init's default


@dataclass(eq=False)
class AutoParallel:
    """A module wrapped for a mesh. See ``auto_parallel``."""

    module: Any
    mesh: Any
    constraints: Constraints | None = None
    policy: Any = None
    fixed_plan: Plan | None = None
    verify: bool = False
    _programs: dict[tuple, Program] = field(default_factory=dict)
    _last: Program | None = None
    _nnx_metadata: dict | None = None  # sharding_names of the nnx module's variables (static)
    _verified: bool = False

    def __post_init__(self) -> None:
        asked = self.constraints.precision if self.constraints is not None else None
        saved = self.fixed_plan.precision if self.fixed_plan is not None else None
        if self.fixed_plan is not None and asked is not None and asked != saved:
            raise ConstraintError(
                f"Constraints(precision={asked!r}) contradicts the saved plan's precision "
                f"({saved!r}): a saved plan runs at the precision it was made for; drop one")

    @property
    def precision(self) -> str | None:
        """The compute precision calls are captured at: ``Constraints(precision=...)``, else the
        saved plan's (None: the model's own dtypes)."""
        if self.fixed_plan is not None:
            return self.fixed_plan.precision
        return self.constraints.precision if self.constraints is not None else None

    @property
    def pipelined(self) -> bool:
        """Whether calls train through pipeline stages: ``Constraints(pipeline_stages=...)``, or
        a saved plan with pipeline settings."""
        c = self.constraints
        return (c is not None and c.pipeline_stages not in (None, 1)) or (
            self.fixed_plan is not None and self.fixed_plan.pipeline is not None)

    @property
    def plan(self) -> Plan:
        if self._last is None:
            raise PlanError("no plan yet: call init/apply first, or make_plan(*args)")
        return self._last.plan

    @property
    def graph(self) -> Graph:
        """The captured, annotated graph of the last planned call."""
        if self._last is None:
            raise PlanError("no graph yet: call init/apply or make_plan first")
        return self._last.captured.graph

    # ---- planning -------------------------------------------------------------------------------

    def _program(self, tr: Traceable, partitioning: Any = None) -> Program:
        """The program of a call: planned, lowered and jitted once per input signature, static
        arguments (``train=True``, ``mutable=``, an nnx module's mode) and layout metadata."""
        explicit = any(explicitly_typed(x) for x in tr.flat_inputs) or explicit_context()
        specs = tuple(sorted((partitioning or {}).items()))
        key = signature(tr.flat_inputs, (tr.static_key, explicit, specs))
        prog = self._programs.get(key)
        if prog is None:
            abstract = [_abstract(x) for x in tr.flat_inputs]
            try:
                # captured outside the caller's context mesh: constants of the graph must
                # not carry its (Explicit) types into the program's auto_axes replay
                with jax.sharding.use_abstract_mesh(_NO_MESH):
                    jaxpr = jax.make_jaxpr(tr.fn)(*abstract)
            except PlanError:
                raise
            except Exception as e:
                raise PlanError(f"{type(self.module).__name__}: the call failed while tracing: "
                                f"{type(e).__name__}: {e}\n(traced on the variables and "
                                f"arguments, {shapes_summary(abstract)})") from e
            graph, missing = graph_from_jaxpr(jaxpr, tr.infos, root=tr.root)
            graph = with_precision(graph, self.precision)
            warn_unannotated(missing, f"auto_parallel({type(self.module).__name__})")
            warn_float32_matmuls(graph, self.precision,
                                 f"auto_parallel({type(self.module).__name__})")
            captured = Captured(tr, jaxpr, graph, tr.out_tree())
            plan = make_plan(graph, self.mesh, policy=self.policy, plan=self.fixed_plan,
                             constraints=self.constraints, partitioning=dict(specs))
            results = None
            if explicit:  # results typed as the plain module would type them
                n = tr.n_results() if tr.n_results is not None else len(graph.outputs)
                results = result_specs(tr.fn, graph, tr.flat_inputs, self.mesh, n)
            lowering = Lowering(graph, plan, self.mesh, explicit=explicit, result_specs=results)
            prog = Program.of(captured, plan, lowering)
            self._programs[key] = prog
        self._last = prog
        return prog

    def _run(self, tr: Traceable, partitioning: Any = None) -> Any:
        prog = self._program(tr, partitioning)
        out = prog(tr.flat_inputs)
        if self.verify and not self._verified:
            ref = jax.jit(tr.fn)(*tr.flat_inputs)
            compare_outputs(out, ref, where=f"{type(self.module).__name__} under "
                            f"{prog.plan.policy}", mesh=mesh_axes(self.mesh),
                            precision=self.precision)
            self._verified = True
        return jax.tree_util.tree_unflatten(prog.captured.out_tree, out)

    # ---- linen --------------------------------------------------------------------------------

    def _linen_traceable(self, variables, args, kwargs, rngs=None, mutable=False, method=None,
                         capture_intermediates=False):
        return linen_traceable(self.module, args, kwargs, variables=unbox(variables), rngs=rngs,
                               mutable=mutable, method=method,
                               capture_intermediates=capture_intermediates,
                               compute_dtype=self.precision)

    def _nnx_traceable(self, args, kwargs, module=None):
        """The traceable of an nnx call on ``module`` (default the wrapped one; the nnx wrapper
        passes its own ``self.module``, which under ``nnx.grad`` / ``nnx.jit`` is the merged
        copy holding the traced state, not the object this core was built with)."""
        return nnx_traceable(self.module if module is None else module, args, kwargs,
                             compute_dtype=self.precision)

    def _specs(self, variables: Any) -> dict:
        """Storage specs named by boxed (``nn.with_partitioning``...) linen variables."""
        if not is_boxed(variables):
            return {}
        rules = (self.constraints.logical_rules if self.constraints is not None else ()) or None
        return partitioning_specs(variables, rules)

    def _nnx_specs(self) -> dict:
        """Storage specs named by ``nnx.with_partitioning`` metadata (``sharding_names``); read
        once: the metadata is fixed when the variables are created, and calls are a hot path."""
        if self._nnx_metadata is None:
            _, state = nnx.split(self.module)
            rules = (self.constraints.logical_rules if self.constraints is not None else ()) \
                or None
            self._nnx_metadata = partitioning_specs(state, rules)
        return self._nnx_metadata

    def make_plan(self, *args: Any, variables: Any = None, rngs: Any = None,
                  mutable: Any = False, method: Any = None, capture_intermediates: Any = False,
                  **kwargs: Any) -> Plan:
        """Plan for ``apply(variables, *args, **kwargs)`` without running it (args may be
        abstract; non-array arguments are static, as in ``apply``)."""
        if isinstance(self.module, nnx.Module):
            tr = self._nnx_traceable(args, kwargs)
            return self._program(tr, self._nnx_specs()).plan
        if variables is None:
            variables = abstract_init(self.module, args, kwargs, rngs, method)
        tr = self._linen_traceable(variables, args, kwargs, rngs, mutable, method,
                                   capture_intermediates)
        return self._program(tr, self._specs(variables)).plan

    def init(self, rngs: Any, *args: Any, method: Any = None,
             mutable: Any = _INIT_MUTABLE, capture_intermediates: Any = False,
             **kwargs: Any) -> Any:
        """``module.init`` with every leaf laid out over the mesh as the plan says.

        Returns the same structure ``module.init`` does: params boxed by
        ``nn.with_partitioning`` / ``nn.with_logical_partitioning`` stay boxed (``nn.Partitioned``
        around the laid-out array), so both ``pm.apply`` and ``module.apply`` take the result.
        Their specs pin the variables' storage in the search (``policy="auto"``). Non-array
        arguments (``train=False``) are static; ``method=``, ``mutable=`` and
        ``capture_intermediates=`` are ``module.init``'s; rng streams besides ``params``
        (``dropout``) are passed to the planned call as ``apply`` would get them.
        """
        rngs = rng_streams(rngs)
        call = CallArgs.of(args, kwargs, type(self.module).__name__)
        # Example args only give shapes; on an Explicit mesh they are initialised from a
        # replicated copy (the plain module.init may not type-check on split ones).
        arrays = [jax.device_put(x, jax.sharding.NamedSharding(self.mesh, P()))
                  if explicitly_typed(x) else x for x in call.arrays]

        def init_fn(r, arrays):
            a, kw = call.rebuild(arrays)
            return nn.Module.init(self.module, r, *a, method=method, mutable=mutable,
                                  capture_intermediates=capture_intermediates, **kw)

        variables = jax.eval_shape(init_fn, rngs, [_abstract(x) for x in arrays])
        prog = self._init_program(variables, args, kwargs, rngs, method)
        var_shardings = prog.in_shardings[: len(jax.tree_util.tree_leaves(variables))]
        out_shardings = jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(variables), list(var_shardings))
        return jax.jit(init_fn, out_shardings=out_shardings)(rngs, arrays)

    def _init_program(self, variables, args, kwargs, rngs: dict, method: Any) -> Program:
        """The program whose plan lays out ``init``'s variables: the call ``apply`` gets, with
        the rng streams besides ``params``; with ``params`` too when that is the only one and
        the module draws another stream (``dropout``) from it, as flax falls back to it."""
        coll = [c for c in variables if c != "params"] or False
        streams = {k: v for k, v in rngs.items() if k != "params"} or None
        specs = self._specs(variables)
        try:
            return self._program(
                self._linen_traceable(variables, args, kwargs, streams, coll, method), specs)
        except PlanError as e:
            if streams is not None or not isinstance(e.__cause__, flax.errors.InvalidRngError):
                raise
        return self._program(
            self._linen_traceable(variables, args, kwargs, rngs, coll, method), specs)

    def apply(self, variables: Any, *args: Any, rngs: Any = None, mutable: Any = False,
              method: Any = None, capture_intermediates: Any = False, **kwargs: Any) -> Any:
        """``module.apply`` computed as one program over the mesh (``variables`` boxed or not).

        Non-array arguments (``train=True``, ``deterministic=False``, ``method=``,
        ``mutable=``, ``capture_intermediates=``) are static, as ``jax.jit``'s static
        arguments: each combination is planned and compiled once."""
        tr = self._linen_traceable(variables, args, kwargs, rngs, mutable, method,
                                   capture_intermediates)
        return self._run(tr, self._specs(variables))

    def compiled(self, variables: Any, *args: Any, rngs: Any = None, mutable: Any = False,
                 method: Any = None, capture_intermediates: Any = False, **kwargs: Any) -> Any:
        """The compiled forward program of ``apply(variables, *args)`` (``.as_text()``,
        ``.memory_analysis()``), for checking what XLA made of the plan."""
        tr = self._linen_traceable(variables, args, kwargs, rngs, mutable, method,
                                   capture_intermediates)
        prog = self._program(tr, self._specs(variables))
        flat = prog.placed(tr.flat_inputs)
        return prog.fn(flat).lower(*flat).compile()

    def with_plan(self, plan: Plan) -> AutoParallel:
        """The same module and mesh running ``plan`` (e.g. at a micro-batch's sizes: a plan
        applies at other sizes while its splits divide)."""
        return AutoParallel(self.module, self.mesh, self.constraints, self.policy, plan,
                            self.verify)

    def on_mesh(self, mesh: Any, constraints: Constraints | None) -> AutoParallel:
        """The same module and policy wrapped for ``mesh`` under ``constraints`` (a group of
        devices' own program: :class:`~nnscaler_jax.train.grouped_step.GroupStep`)."""
        return AutoParallel(self.module, mesh, constraints, self.policy, None, self.verify)

    def variable_shardings(self, variables: Any, *args: Any, rngs: Any = None,
                           mutable: Any = False, **kwargs: Any) -> Any:
        """Where the plan of ``apply(variables, *args, **kwargs)`` stores each variable: a tree
        like ``variables`` (unboxed) of ``NamedSharding`` (args may be abstract)."""
        tr = self._linen_traceable(variables, args, kwargs, rngs, mutable)
        prog = self._program(tr, self._specs(variables))
        plain = unbox(variables)
        n = len(jax.tree_util.tree_leaves(plain))
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(plain),
                                            list(prog.in_shardings[:n]))

    def argument_shardings(self) -> tuple[Any, ...]:
        """Where the last planned call reads its array arguments (``NamedSharding``, None for
        non-array ones), in the order ``apply`` takes them."""
        if self._last is None:
            raise PlanError("no plan yet: call init/apply or make_plan first")
        prog = self._last
        return tuple(s for t, s in zip(prog.captured.graph.inputs, prog.in_shardings,
                                       strict=True) if t.role is Role.INPUT)

    def train_step(self, loss_fn: Callable[..., Any], optimizer: Any, *,
                   return_grads: bool = False, **options: Any) -> Any:
        """One jitted training step for the plan: ``state = step.init(variables, *batch)``,
        then ``state, metrics = step(state, *batch)`` (``metrics['loss']``);
        ``step.params(state)`` gives the module's params tree.

        A :class:`~nnscaler_jax.train.step.TrainStep`. Without pipeline stages: a
        :class:`~nnscaler_jax.train.step.SpmdStep` (the module and its loss planned as one
        graph; the plan's ZeRO stage, micro-batches as gradient accumulation, precision). With
        ``Constraints(pipeline_stages=...)``: a :class:`~nnscaler_jax.train.pipelined_step.
        PipelineStep`. Both take the ``options`` ``inputs``, ``module_kwargs``
        (``train=True``) and ``rng_streams`` (``'dropout'``: a key per micro-batch with
        ``init(..., rng=key)``), validated alike.

        Args:
            loss_fn: ``loss_fn(module_output, *batch) -> scalar`` (mean over the batch).
            optimizer: an ``optax.GradientTransformation``.
            return_grads: also return the gradients in the metrics.
        """
        if self.pipelined:
            return PipelineStep(self, loss_fn, optimizer, return_grads=return_grads, **options)
        if self.constraints is not None and self.constraints.batch_shares is not None:
            return GroupStep(self, loss_fn, optimizer, return_grads=return_grads, **options)
        return SpmdStep(self, loss_fn, optimizer, return_grads=return_grads, **options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self.module, nnx.Module):
            raise PlanError("use the nnx wrapper (auto_parallel(mesh)(nnx_module)) to call it")
        raise PlanError("a wrapped linen module is used through .init / .apply, like the module")


class NnxAutoParallel(ModuleAttributes, nnx.Module):
    """An nnx module whose calls run as one program over the mesh; its state is the wrapped
    module's state (``pm.module``), laid out by the plan."""

    def __init__(self, module: nnx.Module, mesh: Any, constraints=None, policy=None, plan=None,
                 verify=False):
        self.module = module
        # Static (non-state) attribute: survives nnx.split / merge (nnx.grad, nnx.jit).
        self._core = AutoParallel(module, mesh, constraints, policy, plan, verify)
        self._laid_out = False

    @property
    def plan(self) -> Plan:
        return self._core.plan

    @property
    def graph(self) -> Graph:
        """The captured, annotated graph of the last planned call."""
        return self._core.graph

    def make_plan(self, *args, **kwargs) -> Plan:
        return self._core.make_plan(*args, **kwargs)

    def with_plan(self, plan: Plan) -> NnxAutoParallel:
        """A wrapper of the same module object (its state shared) running ``plan``."""
        core = self._core
        return NnxAutoParallel(self.module, core.mesh, core.constraints, core.policy, plan,
                               core.verify)

    def on_mesh(self, mesh: Any, constraints: Constraints | None) -> NnxAutoParallel:
        """A wrapper of the same module object for ``mesh`` under ``constraints`` (a group of
        devices' own program: :class:`~nnscaler_jax.train.grouped_step.GroupStep`)."""
        core = self._core
        return NnxAutoParallel(self.module, mesh, constraints, core.policy, None, core.verify)

    def lay_out(self, *args: Any, **kwargs: Any) -> Plan:
        """Plan the call ``self(*args, **kwargs)`` (args may be abstract) and lay the module's
        state out as that plan stores it, without running it."""
        core = self._core
        tr = core._nnx_traceable(args, kwargs, self.module)
        return self.lay_out_as(core._program(tr, core._nnx_specs()))

    def lay_out_as(self, prog: Program) -> Plan:
        """Lay the module's state out as ``prog`` (a program of a call on it, its state the
        leading inputs) reads it, once."""
        if not self._laid_out:
            _, state = nnx.split(self.module)
            leaves, tree = jax.tree_util.tree_flatten(state)
            placed = [place(x, s) for x, s in zip(leaves, prog.in_shardings, strict=False)]
            moved = tuple(p is not x for p, x in zip(placed, leaves, strict=True))
            try:
                nnx.update(self.module, assigned_state(tree.unflatten(placed), moved))
            except flax.errors.TraceContextError:
                # called first inside a caller's jax.jit: the module made outside it cannot be
                # written here (each call places its state); laid out at a call outside
                return prog.plan
            self._laid_out = True
        return prog.plan

    def train_step(self, loss_fn: Callable[..., Any], optimizer: Any, *,
                   return_grads: bool = False, **options: Any) -> Any:
        """One jitted training step (see :meth:`AutoParallel.train_step`): ``loss_fn(self(*inputs),
        *batch)``; ``state = step.init(None, *batch)`` takes the module's state (or the
        ``nnx.State`` given), ``step.update(state)`` writes the trained state back into it
        (pipelined: its parameters; dropout keys from its own rng streams)."""
        if self._core.pipelined:
            return PipelineStep(self._core, loss_fn, optimizer, return_grads=return_grads,
                                **options)
        if self._core.constraints is not None and self._core.constraints.batch_shares:
            return GroupStep(self, loss_fn, optimizer, core=self._core,
                             return_grads=return_grads, **options)
        return SpmdStep(self, loss_fn, optimizer, return_grads=return_grads, **options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        core = self._core
        specs = core._nnx_specs()
        self.lay_out(*args, **kwargs)
        tr = core._nnx_traceable(args, kwargs, self.module)
        out, new_state = core._run(tr, specs)
        # only what the call assigned, as the plain module would: a stateless call inside a
        # caller's jax.jit / jax.grad writes nothing (its params stay the caller's)
        changed = core._last.captured.traceable.changed
        nnx.update(self.module, assigned_state(new_state, changed() if changed else None))
        return out


def auto_parallel(mesh: Any, constraints: Constraints | None = None, *, policy: Any = None,
                  plan: Plan | str | dict | None = None,
                  verify: bool = False) -> Callable[[Any], Any]:
    """Wrap a Flax module (instance or class) to run as one program over ``mesh``.

    Args:
        mesh: a ``jax.sharding.Mesh`` (Explicit or Auto axis types).
        constraints: ``Constraints`` narrowing the plan.
        policy: a function ``policy(graph, mesh) -> Plan`` or ``"dp"``, ``"zero3"``,
            ``"megatron"``, ``"auto"`` (default).
        plan: a saved ``Plan`` to reuse: the Plan, its ``to_json()`` text, that text parsed as
            a dict, or the path of a file holding it. It applies at other batch sizes /
            sequence lengths while its splits divide.
        verify: on the first call also run the single-device program and raise
            ``PlanError`` if the results differ.

    Returns:
        ``wrap(module_or_class)``.
    """
    if not isinstance(mesh, jax.sharding.Mesh):
        raise PlanError(f"auto_parallel needs a jax.sharding.Mesh, got {type(mesh).__name__}; "
                        "make one with jax.make_mesh((2, 4), ('data', 'model'))")
    if constraints is not None and not isinstance(constraints, Constraints):
        raise PlanError(f"constraints must be a Constraints, got {type(constraints).__name__}")
    plan = saved_plan(plan)

    def wrap(target: Any) -> Any:
        if isinstance(target, type):
            return _decorate_class(target, mesh, constraints, policy, plan, verify)
        if isinstance(target, nnx.Module):
            return NnxAutoParallel(target, mesh, constraints, policy, plan, verify)
        if isinstance(target, nn.Module):
            return AutoParallel(target, mesh, constraints, policy, plan, verify)
        name = type(target).__name__
        if isinstance(getattr(target, "module", None), nn.Module) and \
                hasattr(type(target), "params"):  # (a property: not read, it may raise)
            # a transformers Flax model (FlaxPreTrainedModel): a linen module and its params
            raise PlanError(
                f"auto_parallel wraps a flax.linen or flax.nnx Module; {name} is a model "
                "object holding one (transformers' Flax models). Fix: wrap its module and pass "
                "its parameters as the variables:\n"
                "    pm = auto_parallel(mesh)(model.module)\n"
                "    out = pm.apply({'params': model.params}, input_ids, attention_mask, "
                "position_ids)\n(the module takes every input positionally, as "
                f"{name}.module.__call__ lists them)")
        raise PlanError(f"auto_parallel wraps a flax.linen or flax.nnx Module (instance or "
                        f"class), got {name}")

    return wrap


# What instances of a decorated class answer as their wrapper does (besides init / apply /
# __call__): they behave like wrapped instances. A name the class defines itself is kept.
_LINEN_API = ("plan", "graph", "make_plan", "train_step", "compiled", "variable_shardings",
              "with_plan")
_NNX_API = ("plan", "graph", "make_plan", "train_step", "lay_out", "with_plan")


def _delegates(cls: type, core_of: Callable[[Any], Any], names: tuple[str, ...]) -> dict:
    def one(name: str) -> property:
        return property(lambda self: getattr(core_of(self), name),
                        doc=f"The instance's wrapper's ``{name}`` (see ``auto_parallel``).")

    return {n: one(n) for n in names if not hasattr(cls, n)}


def _decorate_class(cls: type, mesh, constraints, policy, plan, verify) -> type:
    if issubclass(cls, nnx.Module):
        orig_call = cls.__call__

        def _core(self):
            core = _CORES.get(self)
            if core is None:
                core = _CORES[self] = NnxAutoParallel(self, mesh, constraints, policy, plan,
                                                      verify)
            return core

        def __call__(self, *args, **kwargs):
            if original_calls():
                return orig_call(self, *args, **kwargs)
            return _core(self)(*args, **kwargs)

        return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                            **_delegates(cls, _core, _NNX_API)})
    if issubclass(cls, nn.Module):
        def _core(self):
            # One wrapper per instance, so repeated init / apply reuse its programs.
            core = self.__dict__.get(_LINEN_CORE)
            if core is None:
                core = AutoParallel(self, mesh, constraints, policy, plan, verify)
                object.__setattr__(self, _LINEN_CORE, core)  # frozen dataclass: no plain set
            return core

        def init(self, rngs, *args, **kwargs):
            return _core(self).init(rngs, *args, **kwargs)

        def apply(self, variables, *args, **kwargs):
            return _core(self).apply(variables, *args, **kwargs)

        return type(cls.__name__, (cls,), {"init": init, "apply": apply,
                                            "__module__": cls.__module__,
                                            **_delegates(cls, _core, _LINEN_API)})
    raise PlanError(f"auto_parallel decorates flax.linen / flax.nnx Module classes, got {cls}")
