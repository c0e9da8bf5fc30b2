"""How a training step calls the user's module: one adapter, linen or nnx, for both steps.

``pm.train_step`` runs the module one of two ways, and both go through :class:`ModuleCall`
(:class:`LinenCall`, :class:`NnxCall`):

- **Through the wrapper's plan** (the SPMD step, :class:`~nnscaler_jax.train.step.SpmdStep`):
  the module and the loss planned as one graph (:meth:`ModuleCall.plan_with_loss`), the state's
  layouts read off that program (:meth:`ModuleCall.shardings`), one (micro-)batch's loss run
  through it (:meth:`ModuleCall.loss`) on the trees :meth:`ModuleCall.split` takes apart.
- **As written** (the pipelined step, :class:`~nnscaler_jax.train.pipelined_step.
  PipelineStep`, whose runtimes trace one micro-batch's call and cut it into chunks):
  :meth:`ModuleCall.bind` takes the variables and the step's key, :meth:`ModuleCall.make_plan`
  plans the module alone (the stages), and calling the adapter runs the module on plain trees.

What both share: the step's options (:class:`StepOptions`: ``inputs``, ``module_kwargs``,
``rng_streams``), how a micro-batch's keys derive from the step's (:func:`microbatch_rngs`),
the module's variables rebuilt from a state's trees (:meth:`ModuleCall.variables`), an nnx
module's state written back (:meth:`ModuleCall.update`), and the errors a user's call causes
said with their fix (a missing rng key: :func:`rng_error`; a module that takes fewer arrays
than the batch: :func:`inputs_error`).

**Keys.** A micro-batch ``g`` of a step with rng streams gets :func:`microbatch_rngs` ``(key,
g, streams)``. In the pipelined program the keys are inputs of the traced call, one per stream
(linen) or per ``nnx.RngStream`` (nnx: the ``i``-th stream named ``s`` gets ``fold_in(rngs[s],
i)``, what ``nnx.reseed(model, s=rngs[s])`` sets; besides ``rng_streams``, the ``'default'``
stream of an ``nnx.Rngs(0)`` is keyed, as the last stream); an nnx module in the SPMD step
draws from its own ``nnx.Rngs``, carried in the state, unless ``init`` gets ``rng=`` (then
its streams are keyed per micro-batch as the pipelined step keys them).

**Collections.** Mutable collections (BatchNorm statistics: linen's variables besides
``params``, called with ``mutable=[...]``; an nnx module's ``nnx.BatchStat``) are carried
beside the parameters: the SPMD step carries every one (an nnx module: its whole state besides
``nnx.Param``); the pipelined step carries linen's collections and nnx's ``nnx.BatchStat`` as
plain trees and refuses ``nnx.Cache`` (:func:`collections_error`).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import flax.errors
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.traverse_util import flatten_dict

from nnscaler_jax.capture.flax import assigned_state, nnx_call_scopes, with_loss
from nnscaler_jax.capture.metadata import unbox
from nnscaler_jax.capture.precision import Cast
from nnscaler_jax.errors import PlanError

__all__ = ["LinenCall", "ModuleCall", "NnxCall", "StepOptions", "collections_error",
           "empty_collection_error", "inputs_error", "key_like", "microbatch_rngs",
           "rng_error", "typed_key"]


def microbatch_rngs(key: Any, index: Any, streams: Sequence[str]) -> dict:
    """The rng streams of micro-batch ``index`` for a step's ``key``: ``{s: fold_in(fold_in(key,
    index), j)}`` for the ``j``-th stream ``s`` (what the SPMD step passes its micro-batches)."""
    key = jax.random.fold_in(key, index)
    return {s: jax.random.fold_in(key, j) for j, s in enumerate(streams)}


def typed_key(key: Any) -> Any:
    """``key`` as a typed key array (raw ``PRNGKey`` data of the default impl is wrapped).

    Raises:
        PlanError: raw data of another shape (another impl's: ``PRNGKey(0, impl='rbg')`` is
            ``uint32[4]``), which cannot say its impl.
    """
    if jnp.issubdtype(jnp.result_type(key), jax.dtypes.prng_key):
        return key
    want = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
    shape, dtype = tuple(np.shape(key)), jnp.result_type(key)
    if shape[len(shape) - len(want.shape):] != want.shape or dtype != want.dtype:
        raise PlanError(
            f"rng: raw key data {dtype}{list(shape)} is not a key of the default impl "
            f"({jax.config.jax_default_prng_impl}: {want.dtype}{list(want.shape)}), and raw "
            "data does not say its impl; pass a typed key, e.g. rng=jax.random.key(0, "
            "impl='rbg'), or set jax_default_prng_impl to the key's impl")
    return jax.random.wrap_key_data(key)


def key_like(key: Any) -> Any:
    """``jax.random.key(0)`` of ``key``'s impl (``key`` typed, raw or abstract): what a step
    traces and plans its calls with, so that they take keys of that impl."""
    impls: list = []
    jax.eval_shape(lambda k: impls.append(jax.random.key_impl(typed_key(k))), key)
    return jax.random.key(0, impl=impls[0])


@dataclass(frozen=True)
class StepOptions:
    """The options of ``pm.train_step`` (:class:`~nnscaler_jax.train.step.TrainStep`), SPMD or
    pipelined.

    Attributes:
        inputs: how many leading batch arrays the module takes (None: all).
        module_kwargs: static keyword arguments of the module call, as sorted items.
        rng_streams: the rng streams each micro-batch gets a key for (with ``init(..., rng=)``,
            or an nnx module's own streams of these names).
    """

    inputs: int | None = None
    module_kwargs: tuple[tuple[str, Any], ...] = ()
    rng_streams: tuple[str, ...] = ("dropout",)
    precision: str | None = None  # the plan's compute precision (Constraints, not an option)

    @classmethod
    def of(cls, options: dict) -> StepOptions:
        """Validated options (PlanError naming the bad one and the fix)."""
        known = {"inputs", "module_kwargs", "rng_streams"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise PlanError(f"train_step takes the options {sorted(known)} (and return_grads, "
                            f"growth_interval), not {unknown}; drop them")
        inputs = options.get("inputs")
        if inputs is not None and (not isinstance(inputs, int) or isinstance(inputs, bool)
                                   or inputs < 1):
            raise PlanError(f"train_step: inputs={inputs!r} must be a positive int (how many "
                            "leading batch arrays the module takes), e.g. inputs=1 for "
                            "(images, labels) with module(images)")
        kwargs = options.get("module_kwargs") or {}
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise PlanError(f"train_step: module_kwargs={kwargs!r} must be a dict of keyword "
                            "arguments, e.g. module_kwargs={'train': True}")
        arrays = sorted(k for k, v in kwargs.items()
                        if any(isinstance(x, (jax.Array, np.ndarray)) for x in jax.tree.leaves(v)))
        if arrays:
            raise PlanError(f"train_step: module_kwargs {arrays} are arrays; module_kwargs are "
                            "static flags (train=True). Pass arrays in the batch and the "
                            "module's number of them as inputs=")
        streams = options.get("rng_streams", ("dropout",))
        if isinstance(streams, str) or not all(isinstance(s, str) for s in streams):
            raise PlanError(f"train_step: rng_streams={streams!r} must be a sequence of stream "
                            "names, e.g. rng_streams=('dropout',)")
        return cls(inputs, tuple(sorted(kwargs.items())), tuple(streams))

    def n_inputs(self, batch: Sequence[Any]) -> int:
        """How many leading batch arrays the module takes."""
        return len(batch) if self.inputs is None else self.inputs

    def args(self, batch: Sequence[Any]) -> tuple:
        """The module's arguments of ``batch`` (its first ``inputs`` arrays)."""
        if self.inputs is not None and self.inputs > len(batch):
            raise PlanError(f"train_step: inputs={self.inputs} but the batch has {len(batch)} "
                            f"arrays; use inputs <= {len(batch)}")
        return tuple(batch) if self.inputs is None else tuple(batch[:self.inputs])



def inputs_error(e: Exception, n: int) -> PlanError:
    """``e`` (the module call failed on the whole batch of ``n`` arrays) with the likely fix,
    ``inputs=`` (the pipelined and the SPMD training steps)."""
    return PlanError(
        f"train_step passed all {n} batch arrays to the module (inputs=None) and the call "
        "failed. If the module takes only the leading ones, say how many, e.g. for a batch "
        "(x, y) with module(x) and loss_fn(out, x, y):\n"
        "    step = pm.train_step(loss_fn, optimizer, inputs=1)\n"
        f"The call's error: {e}")


def collections_error(where: str, names: Sequence[str]) -> PlanError:
    return PlanError(
        f"train_step: the pipelined step carries BatchNorm statistics (linen collections, "
        f"nnx.BatchStat); {where} holds {sorted(names)}, which it does not carry. Fix: drop "
        "them from the module for training (decoding caches), or drop "
        "Constraints(pipeline_stages=...) for the SPMD step, which carries every collection")


def empty_collection_error(names: Sequence[str]) -> PlanError:
    return PlanError(
        f"train_step: the variables' collection(s) {sorted(names)} hold no arrays; pass the "
        "variables module.init returned, e.g. step.init(module.init(key, x), x) (with "
        "{'params': ..., 'batch_stats': ...}), or leave the empty collections out")


def rng_error(e: Exception, streams: Sequence[str]) -> PlanError:
    return PlanError(f"train_step: {e}. Give the step a key, step.init(variables, *batch, "
                     f"rng=jax.random.key(0)), with the stream named in rng_streams (now "
                     f"{tuple(streams)}); or call the module deterministically (module_kwargs)")


def _rng_streams(module: Any, names: Sequence[str]) -> list:
    """The ``nnx.RngStream`` s of ``module`` named in ``names``, in graph order (nnx.reseed's)."""
    return [s for _, s in nnx.iter_graph(module)
            if isinstance(s, nnx.RngStream) and s.key.tag in names]



class ModuleCall(abc.ABC):
    """How a training step calls the user's module (see the module docstring): the one adapter
    of the SPMD and the pipelined step, :class:`LinenCall` or :class:`NnxCall`
    (:meth:`of`).

    Attributes:
        pm: the wrapper whose plans the step runs (linen: the ``AutoParallel``; nnx: the
            ``NnxAutoParallel`` in the SPMD step, its core in the pipelined one), None for a
            runtime built without a step (:meth:`plain`).
        module: the user's module; options: the step's :class:`StepOptions`.
        loss_fn: the SPMD step's loss, planned with the module while :attr:`plans_loss`
            (else, a saved plan of the module alone, applied after it); None: the module alone.
        params: (after :meth:`bind`) the parameters as a plain tree.
        collections: (after :meth:`bind`) the mutable collections as a plain tree (linen:
            ``{name: tree}`` of the variables besides ``params``; nnx: the pure dict of its
            ``nnx.BatchStat``), ``{}`` without any.
        streams: the stream names keys derive from (:func:`microbatch_rngs`): ``rng_streams``,
            for nnx then ``'default'`` (the stream of an ``nnx.Rngs(0)``).
        slots: (after :meth:`bind`) per key input of the traced call, ``(stream, index)``: the
            key is ``microbatch_rngs(...)[stream]``, folded with ``index`` (nnx) unless None.
        default_rng: (after :meth:`bind`) the step key when ``init`` got none (nnx: its first
            stream's key).
    """

    nnx = False

    def __init__(self, pm: Any, module: Any, options: StepOptions):
        self.pm, self.module, self.options = pm, module, options
        self.loss_fn: Any = None
        self.plans_loss = True
        self.streams = options.rng_streams
        self.params: Any = None
        self.collections: Any = {}
        self.slots: tuple = ()
        self.default_rng: Any = None

    @staticmethod
    def of(pm: Any, options: StepOptions, module: Any = None) -> ModuleCall:
        """The adapter of ``module`` (default the wrapper ``pm``'s) by its kind."""
        module = pm.module if module is None else module
        kind = NnxCall if isinstance(module, nnx.Module) else LinenCall
        return kind(pm, module, options)

    @staticmethod
    def plain(module: Any, params: Any) -> ModuleCall:
        """The call of a program built without step options: ``module.apply({'params': p},
        *batch)`` (nnx: the module's own state besides its parameters)."""
        call = ModuleCall.of(None, StepOptions(), module)
        return call.bind(None if call.nnx else {"params": params}, None)

    @property
    def core(self) -> Any:
        """The wrapper's ``AutoParallel`` (its mesh, constraints, graph and programs)."""
        return getattr(self.pm, "_core", self.pm)

    @contextmanager
    def errors(self, n: int) -> Iterator[None]:
        """The wrapper's tracing errors of a call on ``n`` batch arrays, caused by flax's or
        Python's, said with their fix (:func:`rng_error`, :func:`inputs_error`)."""
        try:
            yield
        except PlanError as e:
            if isinstance(e.__cause__, flax.errors.InvalidRngError):
                raise rng_error(e.__cause__, self.options.rng_streams) from e
            if self.options.inputs is None and n > 1 and isinstance(e.__cause__, TypeError):
                raise inputs_error(e, n) from e
            raise

    # ---- the call as written (the pipelined step's runtimes trace it) ---------------------------

    @abc.abstractmethod
    def bind(self, variables: Any, rng: Any) -> ModuleCall:
        """Take ``variables`` (nnx: None, or an ``nnx.State`` to update the module with) and
        the step's key ``rng``: sets :attr:`params`, :attr:`collections`, :attr:`slots`,
        :attr:`default_rng`; returns the adapter."""

    @abc.abstractmethod
    def make_plan(self, args: tuple, rng: Any) -> Any:
        """The wrapper's plan of the module alone on ``args`` (the whole batch's), as the
        pipelined step calls it (rng streams keyed by ``rng``, collections mutable)."""

    @abc.abstractmethod
    def module_params(self, params: Any) -> Any:
        """A plain parameter tree as the module takes it (linen: the tree; nnx: an
        ``nnx.State`` of its ``nnx.Param``)."""

    @abc.abstractmethod
    def _call(self, params: Any, colls: Any, args: tuple, keys: Sequence[Any]) -> tuple:
        """``(output, new collections)`` of the module on plain trees."""

    def __call__(self, params: Any, args: tuple, keys: Sequence[Any],
                 collections: Any = None) -> tuple[Any, Any]:
        """``(the module's output, the new collections)`` (``collections`` None: the call's
        own, ``{}`` without any); with a compute precision, float parameters and arguments are
        cast to it on entry and 16-bit results back to float32 (capture/precision.py), the
        new collections back to their dtypes."""
        colls = self.collections if collections is None else collections
        cast = Cast.of(self.options.precision)
        if cast is None:
            return self._call(params, colls, args, keys)
        flat, tree = jax.tree.flatten(params)
        params = jax.tree.unflatten(tree, cast.inputs(flat, [True] * len(flat))[0])
        flat, tree = jax.tree.flatten(args)
        args = jax.tree.unflatten(tree, cast.inputs(flat, [True] * len(flat))[0])
        out, new = self._call(params, colls, args, keys)
        return cast.results(out), jax.tree.map(lambda n, o: n.astype(o.dtype), new, colls)

    # ---- the call through the wrapper's plan (the SPMD step) ------------------------------------

    @abc.abstractmethod
    def _program(self, variables: Any, batch: Sequence[Any], rngs: Any) -> Any:
        """The wrapper's program of the module (and :attr:`loss_fn`) on ``batch``."""

    def plan_with_loss(self, variables: Any, batch: Sequence[Any], rngs: Any) -> Any:
        """The wrapper's plan of the module and :attr:`loss_fn` as one graph on ``batch``."""
        with self.errors(len(batch)):
            return self._program(variables, batch, rngs).plan

    def use(self, plan: Any) -> None:
        """Run the wrapper with ``plan`` (the whole batch's, on micro-batches)."""
        self.pm = self.pm.with_plan(plan)

    @abc.abstractmethod
    def shardings(self, variables: Any, micro: Sequence[Any], rngs: Any) -> tuple[Any, Any]:
        """``(parameters', collections')`` shardings as the program of ``micro``'s shapes
        reads them."""

    @abc.abstractmethod
    def split(self, variables: Any) -> tuple[Any, Any]:
        """``(parameters, the rest)``: the trees the SPMD step trains and carries."""

    @abc.abstractmethod
    def loss(self, params: Any, rest: Any, batch: Sequence[Any], rngs: Any) -> tuple:
        """``(loss, the carried state after the call)`` of one (micro-)batch through the
        wrapper's program."""

    def _with_loss(self, tr: Any, batch: Sequence[Any], has_state: bool) -> Any:
        if self.loss_fn is None or not self.plans_loss:
            return tr
        return with_loss(tr, self.loss_fn, batch, self.options.n_inputs(batch), has_state)

    def _loss_of(self, out: Any, batch: Sequence[Any]) -> Any:
        """The loss of a call's ``out``: the program's (planned with it), or the loss applied
        to the module's output."""
        return out if self.plans_loss else self.loss_fn(out, *batch)

    # ---- both ----------------------------------------------------------------------------------

    @abc.abstractmethod
    def variables(self, params: Any, collections: Any) -> Any:
        """A state's parameters and carried state as the module takes its variables: linen
        ``{'params': ..., **collections}``, nnx one ``nnx.State`` (``nnx.update``)."""

    def update(self, variables: Any) -> None:
        """Write ``variables`` back into the module (nnx)."""
        raise PlanError("step.update(state) writes an nnx module's state; for linen use "
                        "step.variables(state) (or step.params(state)) with apply")

    def keyed(self) -> bool:
        """Whether a step key keys anything of the module (nnx: a stream named in
        :attr:`streams`); a step keeps ``state['rng']`` only then."""
        return True

    def checkpoint_form(self, state: dict) -> dict:
        """The SPMD step's ``state`` as a checkpoint holds it, the pipelined step's form
        (the module's trees): linen's is the state itself."""
        return dict(state)

    def from_checkpoint_form(self, saved: dict, like: dict, rest: Any = None) -> dict:
        """A :meth:`checkpoint_form` (either step's) as the SPMD step keeps its state;
        ``like``: that state's shardings; ``rest``: the carried state at ``init`` (nnx: what
        ``saved`` does not hold keeps its value there)."""
        del like, rest
        return dict(saved)

    def other_state(self, keyed: bool) -> dict | None:
        """The pipelined step's ``other_state`` of a checkpoint (:meth:`checkpoint_form`):
        None for linen (its collections are all it carries)."""
        del keyed
        return None


class LinenCall(ModuleCall):
    """A linen module: ``module.apply({'params': ..., **collections}, *args, rngs=...,
    mutable=[...])``; the state's trees are its variables' ``params`` and the rest."""

    def split(self, variables: Any) -> tuple[Any, Any]:
        # the state holds arrays: partitioning metadata (``nn.with_logical_partitioning``
        # boxes, as ``module.init`` returns them) was read by the plan, the state's
        # shardings keep it; the gradients and optimizer state are the plain arrays' trees
        variables = dict(unbox(variables))
        if "params" not in variables:
            return variables, {}
        return variables["params"], {k: v for k, v in variables.items() if k != "params"}

    def bind(self, variables: Any, rng: Any) -> ModuleCall:
        raw = dict(variables)  # (planned as given: partitioning boxes name storage specs)
        self._planned = raw if "params" in raw else {"params": raw}
        self.params, self.collections = self.split(variables)
        empty = [c for c, x in self.collections.items() if not jax.tree.leaves(x)]
        if empty:
            raise empty_collection_error(empty)
        self.slots = tuple((s, None) for s in self.streams) if rng is not None else ()
        return self

    def make_plan(self, args: tuple, rng: Any) -> Any:
        # checks + records the stages; policy None: stages data-parallel inside
        rngs = microbatch_rngs(typed_key(rng), 0, self.streams) if self.slots else None
        with self.errors(len(args)):
            return self.pm.make_plan(*args, variables=self._planned, rngs=rngs,
                                     mutable=list(self.collections) or False,
                                     **dict(self.options.module_kwargs))

    def module_params(self, params: Any) -> Any:
        return params

    def variables(self, params: Any, collections: Any) -> Any:
        return {"params": params, **collections}

    def _call(self, params: Any, colls: Any, args: tuple, keys: Sequence[Any]) -> tuple:
        rngs = {s: k for (s, _), k in zip(self.slots, keys, strict=True)} or None
        try:
            out = self.module.apply({"params": params, **colls}, *args, rngs=rngs,
                                    mutable=list(colls) or False,
                                    **dict(self.options.module_kwargs))
        except flax.errors.InvalidRngError as e:
            raise rng_error(e, self.options.rng_streams) from e
        return out if colls else (out, {})

    def _traceable(self, variables: Any, batch: Sequence[Any], rngs: Any) -> Any:
        colls = [c for c in variables if c != "params"]
        tr = self.pm._linen_traceable(variables, batch[:self.options.n_inputs(batch)],
                                      dict(self.options.module_kwargs), rngs, colls or False)
        return self._with_loss(tr, batch, bool(colls))

    def _program(self, variables: Any, batch: Sequence[Any], rngs: Any) -> Any:
        variables = dict(variables)
        return self.pm._program(self._traceable(variables, batch, rngs),
                                self.pm._specs(variables))

    def shardings(self, variables: Any, micro: Sequence[Any], rngs: Any) -> tuple[Any, Any]:
        prog = self._program(variables, micro, rngs)
        plain = unbox(dict(variables))
        leaves = jax.tree_util.tree_leaves(plain)
        sh = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(plain),
                                          list(prog.in_shardings[:len(leaves)]))
        return sh["params"], {k: v for k, v in sh.items() if k != "params"}

    def loss(self, params: Any, rest: Any, batch: Sequence[Any], rngs: Any) -> tuple:
        variables = self.variables(params, rest)
        out = self.pm._run(self._traceable(variables, batch, rngs), self.pm._specs(variables))
        out = out if rest else (out, {})
        return self._loss_of(out[0], batch), out[1]


class NnxCall(ModuleCall):
    """An nnx module: its ``nnx.Param`` trained, the rest of its state carried. The SPMD step
    splits the wrapper (``pm``, an ``NnxAutoParallel``) into an ``nnx.State`` of its parameters
    and one of everything else (statistics, rng counters), the state its calls update; the
    pipelined step calls ``nnx.merge`` of the module's graph definition with plain trees of its
    parameters and ``nnx.BatchStat`` and the rest of its state (its rng streams re-keyed per
    micro-batch), its sub-modules' calls under their paths' name scopes, as the wrapper traces
    it."""

    nnx = True

    def __init__(self, pm: Any, module: Any, options: StepOptions):
        super().__init__(pm, module, options)
        # the stream names keys derive from: also an `nnx.Rngs(0)`'s 'default' stream
        self.streams += ("default",) if "default" not in self.streams else ()
        self.graphdef: Any = None

    # ---- as written ----

    def bind(self, variables: Any, rng: Any) -> ModuleCall:
        module = self.module
        if variables is not None:
            nnx.update(module, variables)
        caches = {type(v).__name__ for _, v in nnx.iter_graph(module) if isinstance(v, nnx.Cache)}
        if caches:
            raise collections_error(f"the nnx module {type(module).__name__}", caches)
        self.graphdef, self.template, self.stats, self.rest = nnx.split(
            module, nnx.Param, nnx.BatchStat, ...)
        self.params = nnx.to_pure_dict(self.template)
        self.collections = nnx.to_pure_dict(self.stats)
        found = _rng_streams(module, self.streams)
        tags = [s.key.tag for s in found]  # the i-th stream of a tag: (tag, i)
        self.slots = tuple((t, tags[:i].count(t)) for i, t in enumerate(tags))
        if found:
            self.default_rng = jnp.copy(found[0].key[...])
        return self

    def make_plan(self, args: tuple, rng: Any) -> Any:
        with self.errors(len(args)):  # planned on the module's own state (rng streams included)
            return self.pm.make_plan(*args, **dict(self.options.module_kwargs))

    def module_params(self, params: Any) -> Any:
        return _as_state(self.template, params)

    def _call(self, params: Any, colls: Any, args: tuple, keys: Sequence[Any]) -> tuple:
        m = nnx.merge(self.graphdef, self.module_params(params),
                      _as_state(self.stats, colls), self.rest, copy=True)
        if keys:
            _set_keys(_rng_streams(m, self.streams), keys)
        # (sown intermediates are outputs to look at: dropped here as by the SPMD step)
        kept = nnx.Not(nnx.Any(nnx.Param, _apart(self.streams), nnx.Intermediate))
        before = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(m, kept))}
        with nnx_call_scopes(m):
            out = m(*args, **dict(self.options.module_kwargs))
        changed = [(p, v) for p, v in nnx.to_flat_state(nnx.state(m, kept))
                   if v.get_value() is not before.get(p)]
        _check_kept(type(self.module).__name__, changed, self.streams)
        return out, nnx.to_pure_dict(nnx.state(m, nnx.BatchStat)) if colls else {}

    # ---- through the wrapper's plan ----

    def _traceable(self, pm: Any, batch: Sequence[Any]) -> tuple[Any, Any]:
        core = pm._core
        tr = core._nnx_traceable(batch[:self.options.n_inputs(batch)],
                                 dict(self.options.module_kwargs), pm.module)
        return self._with_loss(tr, batch, True), core._nnx_specs()

    def _program(self, variables: Any, batch: Sequence[Any], rngs: Any) -> Any:
        # (with a step key, ``loss`` sets the streams' keys: the program reads them as state)
        if variables is not None:
            nnx.update(self.pm, variables)
        return self.core._program(*self._traceable(self.pm, batch))

    def shardings(self, variables: Any, micro: Sequence[Any], rngs: Any) -> tuple[Any, Any]:
        self.pm.lay_out_as(self.core._program(*self._traceable(self.pm, micro)))
        params, rest = self.split(None)
        sharding = lambda x: x.sharding
        return jax.tree.map(sharding, params), jax.tree.map(sharding, rest)

    def split(self, variables: Any) -> tuple[Any, Any]:
        self.graphdef, params, rest = nnx.split(self.pm, nnx.Param, ...)
        return params, rest

    def loss(self, params: Any, rest: Any, batch: Sequence[Any], rngs: Any) -> tuple:
        """With ``rngs`` (a step key's :func:`microbatch_rngs`), the module's streams named in
        :attr:`streams` are keyed from them as the pipelined step keys them (the ``i``-th
        stream named ``s``: ``fold_in(rngs[s], i)``), else they draw from their own keys."""
        model = nnx.merge(self.graphdef, params, rest, copy=True)
        if rngs is not None:
            found = _rng_streams(model, self.streams)
            tags = [s.key.tag for s in found]
            _set_keys(found, [jax.random.fold_in(rngs[t], tags[:i].count(t))
                              for i, t in enumerate(tags)])
        out, new_state = model._core._run(*self._traceable(model, batch))
        changed = model._core._last.captured.traceable.changed
        nnx.update(model.module, assigned_state(new_state, changed() if changed else None))
        return self._loss_of(out, batch), nnx.split(model, nnx.Param, ...)[2]

    # ---- both ----

    def variables(self, params: Any, collections: Any) -> Any:
        if isinstance(params, nnx.State):  # the SPMD step's: the wrapper's states
            return nnx.merge_state(params, collections)
        return nnx.merge_state(self.module_params(params), _as_state(self.stats, collections))

    def update(self, variables: Any) -> None:
        # the SPMD step's state is the wrapper's, the pipelined step's the module's
        nnx.update(self.pm if isinstance(self.pm, nnx.Module) else self.module, variables)

    def keyed(self) -> bool:
        return bool(_rng_streams(self.module, self.streams))

    def checkpoint_form(self, state: dict) -> dict:
        """The SPMD step's ``nnx.State`` s (the wrapper's) as the pipelined step keeps its
        state: pure dicts of the module's paths for the parameters, each of the optimizer's
        trees of them and the ``nnx.BatchStat`` (``collections``), and the module's other
        variables (buffers, counters, rng streams) as ``other_state``, without the streams'
        keys and counters where a step key keys them (``state['rng']``): the pipelined
        step's form then. Without a step key the streams draw from their own keys, so
        ``other_state`` holds them: a checkpoint only the SPMD step restores."""
        if not isinstance(state["params"], nnx.State):  # (the pipelined step's: as kept)
            return dict(state)
        own = lambda s: nnx.to_pure_dict(s).get(WRAPPED, {})
        out = dict(state)
        out["params"] = own(state["params"])
        out["opt_state"] = jax.tree.map(lambda x: own(x) if _is_state(x) else x,
                                        state["opt_state"], is_leaf=_is_state)
        rest = state["collections"]
        out["collections"] = own(rest.filter(nnx.BatchStat))
        out["other_state"] = own(rest.filter(nnx.Not(
            _apart(self.streams if "rng" in state else ()))))
        return out

    def other_state(self, keyed: bool) -> dict | None:
        """The module's other variables as :meth:`checkpoint_form` keeps them, at their
        values when bound (the pipelined step carries none of them)."""
        return nnx.to_pure_dict(self.rest.filter(nnx.Not(
            _apart(self.streams if keyed else ()))))

    def from_checkpoint_form(self, saved: dict, like: dict, rest: Any = None) -> dict:
        """The wrapper's states of ``saved``; a variable it does not hold (the streams' keys
        and counters, where a step key keys them) keeps its value in ``rest`` (default the
        wrapper's own, which a step that updated the module may have donated)."""
        params, own = self.split(None)  # (params: the structure alone)
        rest = own if rest is None else rest
        have = {tuple(map(str, p)) for p, _ in nnx.to_flat_state(params)}
        want = {(WRAPPED, *map(str, p)) for p in flatten_dict(saved["params"])}
        if have != want:
            diff = sorted(map(str, have ^ want))[:3]
            raise PlanError(f"step.restore_state: the saved parameters are not the module's "
                            f"(paths differ: {diff}); restore a checkpoint of this model")
        wrap = lambda tree: {WRAPPED: tree}
        out = dict(saved)
        out["params"] = _as_state(params, wrap(saved["params"]))
        out["opt_state"] = jax.tree.map(
            lambda t, s: _as_state(t, wrap(s)) if _is_state(t) else s, like["opt_state"],
            saved["opt_state"], is_leaf=_is_state)
        try:
            out["collections"] = _as_state(rest, wrap(saved["collections"]))
            nnx.replace_by_pure_dict(out["collections"], wrap(saved.get("other_state", {})))
        except ValueError as e:  # (a path the module has not)
            raise PlanError(f"step.restore_state: the saved collections or other_state are "
                            f"not the module's ({e}); restore a checkpoint of this model"
                            ) from None
        return out

def _set_keys(streams: Sequence[Any], keys: Sequence[Any]) -> None:
    """Key each ``nnx.RngStream`` of ``streams`` with its key of ``keys``, its count reset."""
    for s, k in zip(streams, keys, strict=True):
        s.key.set_value(typed_key(k))
        s.count.set_value(jnp.zeros((), jnp.uint32))  # (numpy: updated in place)


WRAPPED = "module"
"""The ``NnxAutoParallel`` attribute holding the user's module: the top key of the SPMD
step's states."""


def _is_state(x: Any) -> bool:
    return isinstance(x, nnx.State)


def _check_kept(name: str, changed: Sequence[tuple[Any, Any]], streams: Sequence[str]
                ) -> None:
    """Refuse what a pipelined call updates and the step would drop (``changed``: paths and
    variables): the counters of rng streams no step key keys (every step would draw the same
    numbers), other variables."""
    drawn = sorted({v.tag for _, v in changed if isinstance(v, nnx.RngState)})
    if drawn:
        raise PlanError(
            f"train_step: the nnx module {name} draws from rng stream(s) {drawn}, which the "
            f"pipelined step does not key (each step would draw the same numbers). Fix: "
            f"train_step(..., rng_streams={tuple(dict.fromkeys((*streams, *drawn)))!r})")
    if changed:  # (a value the step would drop: said, not silently lost)
        raise collections_error(f"the nnx module {name}",
                                ["/".join(map(str, p)) + " (updated by the call)"
                                 for p, _ in changed])


def _apart(keyed: Sequence[str]) -> Any:
    """The variables a checkpoint's ``other_state`` leaves out: the statistics (its
    ``collections``) and the keys and counters of the streams a step key keys (``keyed``:
    their names; the step sets them each micro-batch). Other streams draw on from their own
    state, which the checkpoint keeps."""
    names = set(keyed)
    return nnx.Any(nnx.BatchStat,
                   lambda _, v: isinstance(v, nnx.RngState) and getattr(v, "tag", None) in names)


def _as_state(template: Any, tree: Any) -> Any:
    """A copy of the ``nnx.State`` ``template`` holding the pure dict ``tree``'s values."""
    state = jax.tree.map(lambda x: x, template)
    nnx.replace_by_pure_dict(state, tree)
    return state
