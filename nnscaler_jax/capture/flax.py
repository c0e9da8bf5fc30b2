"""Flax linen / nnx module + example args -> a pure function, its inputs and their paths.

The result (:class:`Traceable`) is what both the graph capture and the lowering use: one flat
function of flat inputs, so the planned program and the single-device program are the same code.
With a ``compute_dtype`` (mixed precision) both traceables cast their params and floating array
arguments on entry, and what they return back, in one place: :class:`~nnscaler_jax.capture.
precision.Cast`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from nnscaler_jax.capture.jaxpr import InputInfo
from nnscaler_jax.capture.precision import Cast
from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.graph import Role

__all__ = ["CallArgs", "ModuleAttributes", "Traceable", "assigned_state", "linen_traceable",
           "nnx_call_scopes", "nnx_traceable", "original_calls", "path_str", "rng_streams"]

_TRACING = threading.local()


def original_calls() -> bool:
    """True while a traceable runs the user's module (decorated classes call the original)."""
    return getattr(_TRACING, "depth", 0) > 0


@contextlib.contextmanager
def _original():
    _TRACING.depth = getattr(_TRACING, "depth", 0) + 1
    try:
        yield
    finally:
        _TRACING.depth -= 1


def path_str(path: Sequence[Any]) -> str:
    """``(DictKey('params'), DictKey('fc1'), ...)`` -> ``'params/fc1/kernel'``."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


@dataclass(frozen=True)
class Traceable:
    """A flat function ``fn(*flat_inputs) -> flat_outputs`` and what its inputs are.

    Attributes:
        fn: the flat function.
        flat_inputs: arrays or ``ShapeDtypeStruct`` values, one per input.
        infos: role / path / collection per input (computed on first use: ``apply`` rebuilds a
            Traceable on every call, but only a new input signature needs the paths).
        in_tree: treedef of the structured inputs (``(variables, rngs, arrays)`` for linen,
            ``(state, arrays)`` for nnx; ``arrays`` are the call's array arguments).
        out_tree: a thunk giving the output treedef once ``fn`` has been traced.
        root: the root module name in name stacks.
        static_key: what selects the program besides the inputs' shapes and dtypes (input tree,
            static call arguments, apply options; an nnx module's graphdef).
        n_results: a thunk giving how many leading outputs are the module's results (the rest
            is updated state the wrapper writes back: an nnx module's); None: all of them.
        changed: a thunk giving, per leaf of that updated state, whether the call assigned it
            (an nnx module's batch statistics, rng counts; not its untouched parameters);
            None: unknown (all of it is written back).
    """

    fn: Callable[..., Any]
    flat_inputs: tuple[Any, ...]
    make_infos: Callable[[], list[InputInfo]]
    in_tree: Any
    out_tree: Callable[[], Any]
    root: str
    static_key: Any = ()
    n_results: Callable[[], int] | None = None
    changed: Callable[[], tuple[bool, ...] | None] | None = None

    @functools.cached_property
    def infos(self) -> tuple[InputInfo, ...]:
        return tuple(self.make_infos())


def _infos(tree: Any, role: Role, prefix: str, collection_from_path: bool) -> list[InputInfo]:
    out = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        p = path_str(path)
        coll = p.split("/")[0] if collection_from_path and p else None
        out.append(InputInfo(role, f"{prefix}{p}" if prefix else p, coll))
    return out


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


@dataclass(frozen=True)
class CallArgs:
    """A call's ``(args, kwargs)`` split as ``jax.jit`` splits traced and static arguments.

    Array leaves (arrays, tracers, ``ShapeDtypeStruct``) are traced inputs; every other leaf
    (``train=True``, ``deterministic=False``, a string, ...) is a static option baked into the
    traced program and part of its cache :attr:`key`, with the tree structure (keyword names,
    ``None`` arguments).

    >>> import jax.numpy as jnp
    >>> c = CallArgs.of((jnp.ones(2),), {"train": True}, "M")
    >>> len(c.arrays), c.static, c.rebuild(c.arrays)[1]
    (1, ((1, True),), {'train': True})
    """

    arrays: tuple[Any, ...]
    paths: tuple[str, ...]
    treedef: Any
    static: tuple[tuple[int, Any], ...]

    @classmethod
    def of(cls, args: Sequence[Any], kwargs: dict, where: str) -> CallArgs:
        """Split ``args`` / ``kwargs``.

        Raises:
            PlanError: a non-array leaf that is not hashable (it cannot select a program).
        """
        tree = (tuple(args), dict(kwargs))
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        arrays, paths, static = [], [], []
        for i, (path, leaf) in enumerate(flat):
            name = ("args/" if path[0].idx == 0 else "kwargs/") + path_str(path[1:])
            if _is_array(leaf):
                arrays.append(leaf)
                paths.append(name)
                continue
            try:
                hash(leaf)
            except TypeError:
                raise PlanError(
                    f"{where}: argument {name} (of type {type(leaf).__name__}) is neither an "
                    "array nor a hashable option (bool, int, float, str, a frozen dataclass); "
                    "non-array arguments are static, as jax.jit's static arguments, and select "
                    "the program. Pass arrays or jax.ShapeDtypeStruct values, options as hashable "
                    "Python values, and containers of arrays as lists / tuples / dicts") from None
            static.append((i, leaf))
        return cls(tuple(arrays), tuple(paths), treedef, tuple(static))

    @property
    def key(self) -> tuple:
        """What selects the program besides the arrays' shapes and dtypes."""
        return (self.treedef, self.static)

    def rebuild(self, arrays: Sequence[Any]) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with ``arrays`` in the array positions."""
        it = iter(arrays)
        static = dict(self.static)
        leaves = [static[i] if i in static else next(it)
                  for i in range(self.treedef.num_leaves)]
        args, kwargs = jax.tree_util.tree_unflatten(self.treedef, leaves)
        return args, kwargs

    def infos(self) -> list[InputInfo]:
        return [InputInfo(Role.INPUT, p, None) for p in self.paths]


def rng_streams(rngs: Any) -> dict[str, Any]:
    """The rng streams of a linen call as ``Module.apply`` / ``init`` read ``rngs=``: None ->
    none, a mapping -> its streams, a single key -> ``{'params': key}`` (``make_rng`` of another
    stream falls back to it, as in flax).

    >>> import jax
    >>> sorted(rng_streams(jax.random.key(0))), rng_streams(None)
    (['params'], {})
    """
    if rngs is None:
        return {}
    if isinstance(rngs, Mapping):
        return dict(rngs)
    return {"params": rngs}


def linen_traceable(module: nn.Module, args: Sequence[Any], kwargs: dict, *,
                    variables: Any, rngs: Any = None, mutable: Any = False,
                    method: Any = None, capture_intermediates: Any = False,
                    compute_dtype: Any = None) -> Traceable:
    """The flat function of ``module.apply(variables, *args, rngs=rngs, mutable=mutable,
    method=method, capture_intermediates=...)``; non-array arguments are static (:class:`CallArgs`).

    ``compute_dtype``: a precision (``'bfloat16'``...) the ``params`` collection and the
    floating array arguments are cast to on entry (:mod:`nnscaler_jax.capture.precision`);
    None: none.
    """
    call = CallArgs.of(args, kwargs, type(module).__name__)
    rngs = rng_streams(rngs)
    structured = (variables, rngs, call.arrays)
    flat, in_tree = jax.tree_util.tree_flatten(structured)
    cast = Cast.of(compute_dtype)
    mask, scopes = (_linen_cast_mask(variables, len(flat), len(call.arrays)) if cast
                    else (None, None))

    def infos() -> list[InputInfo]:
        return (_infos(variables, Role.VARIABLE, "", True) + _infos(rngs, Role.RNG, "rngs/", False)
                + call.infos())

    store: dict[str, Any] = {}

    def fn(*flat_in):
        cast_in, stored = cast.inputs(flat_in, mask, scopes) if cast else (flat_in, {})
        v, r, arrays = jax.tree_util.tree_unflatten(in_tree, cast_in)
        a, kw = call.rebuild(arrays)
        # nn.Module.apply itself, so a class decorated by auto_parallel runs its original code.
        out = nn.Module.apply(module, v, *a, rngs=r or None, mutable=mutable, method=method,
                              capture_intermediates=capture_intermediates, **kw)
        if cast:
            out = cast.restore(out, stored)
            if mutable is not False or capture_intermediates:  # (results, updated collections)
                out = (cast.results(out[0]), cast.state(
                    out[1], jax.tree_util.tree_unflatten(in_tree, flat_in)[0], stored))
            else:
                out = cast.results(out)
        leaves, store["tree"] = jax.tree_util.tree_flatten(out)
        return leaves

    key = (in_tree, call.key, _hashable(mutable), method, _hashable(capture_intermediates),
           cast.precision if cast else None)
    return Traceable(fn, tuple(flat), infos, in_tree, lambda: store["tree"],
                     type(module).__name__, key)


def _linen_cast_mask(variables: Any, n_flat: int, n_arrays: int
                     ) -> tuple[list[bool], list[str]]:
    """Which flat inputs a compute precision casts: the ``params`` collection's leaves and the
    array arguments (rng keys and other collections never); and each one's module path."""
    paths = [path_str(p).removesuffix("/value").split("/")  # boxed: nn.Partitioned(...).value
             for p, _ in jax.tree_util.tree_flatten_with_path(variables)[0]]
    rest = n_flat - len(paths)
    return ([p[0] == "params" for p in paths] + [False] * (rest - n_arrays) + [True] * n_arrays,
            ["/".join(p[1:-1]) for p in paths] + [""] * rest)


def _hashable(x: Any) -> Any:
    return tuple(x) if isinstance(x, list) else x


@contextlib.contextmanager
def _nnx_named_scopes(root: Any):
    """Run each sub-module's ``__call__`` under ``jax.named_scope(<its path>)``.

    nnx does not record module paths in name stacks; this patches the classes of the modules
    reachable from ``root`` for the duration of a trace, looking up each instance's path.
    """
    paths: dict[int, str] = {}
    classes: set[type] = set()
    for path, node in nnx.iter_graph(root):
        if isinstance(node, nnx.Module) and id(node) not in paths:
            paths[id(node)] = "/".join(str(p) for p in path)
            classes.add(type(node))
    originals = {}
    stack: list[str] = []
    for cls in classes:
        if "__call__" not in vars(cls):
            continue
        orig = vars(cls)["__call__"]
        originals[cls] = orig

        def call(self, *a, __orig=orig, **kw):
            p = paths.get(id(self))
            if not p:
                return __orig(self, *a, **kw)
            outer = stack[-1] if stack else ""
            rel = p[len(outer) + 1:] if outer and p.startswith(outer + "/") else p
            stack.append(p)
            try:
                with jax.named_scope(rel):
                    return __orig(self, *a, **kw)
            finally:
                stack.pop()

        cls.__call__ = call
    try:
        yield
    finally:
        for cls, orig in originals.items():
            cls.__call__ = orig


@contextlib.contextmanager
def nnx_call_scopes(module: Any):
    """Calls of ``module`` as :func:`nnx_traceable` traces them: each sub-module's under its
    path's name scope, a class decorated by ``auto_parallel`` running its original code."""
    with _nnx_named_scopes(module), _original():
        yield


def nnx_traceable(module: nnx.Module, args: Sequence[Any], kwargs: dict, *,
                  compute_dtype: Any = None) -> Traceable:
    """The flat function ``(state, args) -> (outputs, new state)`` of an nnx module call.

    The module's graphdef (its structure and static attributes: ``deterministic``,
    ``use_running_average``, whatever ``.eval()`` / ``.train()`` switch) and the call's non-array
    arguments select the program (:attr:`Traceable.static_key`). ``compute_dtype``: as
    :func:`linen_traceable`'s, for the ``nnx.Param`` leaves; the new state keeps the stored
    dtypes (BatchNorm statistics stay float32)."""
    call = CallArgs.of(args, kwargs, type(module).__name__)
    graphdef, state = nnx.split(module)
    structured = (state, call.arrays)
    flat, in_tree = jax.tree_util.tree_flatten(structured)
    cast = Cast.of(compute_dtype)
    mask, scopes = _nnx_cast_mask(state, len(call.arrays)) if cast else (None, None)

    def infos() -> list[InputInfo]:
        var_infos = []
        for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
            p = path_str(path)
            p = p.removesuffix("/value")
            var_infos.append(InputInfo(Role.VARIABLE, p, _nnx_collection(state, path)))
        return var_infos + call.infos()
    store: dict[str, Any] = {}

    def fn(*flat_in):
        cast_in, stored = cast.inputs(flat_in, mask, scopes) if cast else (flat_in, {})
        s, arrays = jax.tree_util.tree_unflatten(in_tree, cast_in)
        a, kw = call.rebuild(arrays)
        given = jax.tree_util.tree_flatten(s)  # before the call: merge shares s's variables
        m = nnx.merge(graphdef, s)
        with _nnx_named_scopes(m), _original():
            out = m(*a, **kw)
        _, new_state = nnx.split(m)
        store["changed"] = _assigned(given, new_state)
        if cast:
            out = cast.results(cast.restore(out, stored))
            new_state = cast.state(new_state, jax.tree_util.tree_unflatten(in_tree, flat_in)[0],
                                   stored)
        leaves, store["tree"] = jax.tree_util.tree_flatten((out, new_state))
        store["n"] = len(jax.tree_util.tree_leaves(out))
        return leaves

    return Traceable(fn, tuple(flat), infos, in_tree, lambda: store["tree"], "",
                     (graphdef, in_tree, call.key, cast.precision if cast else None),
                     lambda: store["n"], lambda: store["changed"])


def with_loss(tr: Traceable, loss_fn: Callable[..., Any], batch: Sequence[Any],
              n_inputs: int, has_state: bool) -> Traceable:
    """The flat function of a training step's loss: ``loss_fn(results, *batch)`` after the
    module call ``tr``, whose array arguments are ``batch[:n_inputs]`` (the last flat inputs of
    both a linen and an nnx call), so one graph holds the module and its loss and the plan lays
    out both (the logits, the loss's softmax and their gradients are the step's activations).

    Inputs: ``tr``'s, then ``batch[n_inputs:]`` (the loss's own arrays: labels, masks).
    Results: the loss, then (``has_state``: a linen call with ``mutable=`` / an nnx call) the
    call's updated state, as ``tr`` returns it. The loss reads the batch as given (a compute
    precision casts the module's copy of its inputs only)."""
    k, extra = len(tr.flat_inputs), tuple(batch[n_inputs:])
    store: dict[str, Any] = {}

    def infos() -> list[InputInfo]:
        return list(tr.infos) + [InputInfo(Role.INPUT, f"loss_fn/args/{i}", None)
                                 for i in range(n_inputs + 1, len(batch) + 1)]

    def fn(*flat_in):
        leaves = tr.fn(*flat_in[:k])
        out = jax.tree_util.tree_unflatten(tr.out_tree(), leaves)
        results, state = out if has_state else (out, None)
        loss = loss_fn(results, *flat_in[k - n_inputs:k], *flat_in[k:])
        leaves, store["tree"] = jax.tree_util.tree_flatten((loss, state) if has_state else loss)
        return leaves

    return Traceable(fn, tr.flat_inputs + extra, infos, tr.in_tree, lambda: store["tree"],
                     tr.root, (tr.static_key, "loss", loss_fn, has_state, len(extra)),
                     (lambda: 1) if tr.n_results is not None else None, tr.changed)


def _assigned(given: tuple[list, Any], new_state: Any) -> tuple[bool, ...] | None:
    """Per leaf of ``new_state``: whether the call assigned it (not the very value it was
    given: ``given`` is the flattened state before the call); None when the call changed the
    state's structure."""
    old, tree = given
    new, new_tree = jax.tree_util.tree_flatten(new_state)
    if new_tree != tree:
        return None
    return tuple(a is not b for a, b in zip(new, old, strict=True))


def _nnx_cast_mask(state: Any, n_arrays: int) -> tuple[list[bool], list[str]]:
    """Which flat inputs a compute precision casts: ``nnx.Param`` leaves and the array
    arguments (batch statistics, rng state and other variables never); and each one's module
    path."""
    mask, scopes = [], []
    variables = jax.tree_util.tree_flatten_with_path(
        state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    for path, var in variables:
        n = len(jax.tree_util.tree_leaves(var)) if isinstance(var, nnx.Variable) else 1
        mask += [isinstance(var, nnx.Param)] * n
        scopes += ["/".join(path_str(path).split("/")[:-1])] * n
    return mask + [True] * n_arrays, scopes + [""] * n_arrays


def _nnx_collection(state: Any, path: Sequence[Any]) -> str:
    node = state
    for k in path:
        try:
            node = node[getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))]
        except (KeyError, TypeError, IndexError, AttributeError):
            break
    return type(node).__name__.lower() if isinstance(node, nnx.Variable) else "variable"


def assigned_state(state: nnx.State, changed: tuple[bool, ...] | None) -> nnx.State:
    """The variables of ``state`` with a leaf in ``changed`` (None: all of them)."""
    if changed is None:
        return state
    flat, i = [], 0
    for path, var in nnx.to_flat_state(state):
        n = len(jax.tree_util.tree_leaves(var))
        if any(changed[i:i + n]):
            flat.append((path, var))
        i += n
    return nnx.from_flat_state(flat)


class ModuleAttributes:
    """Mixin of a wrapper holding an nnx module as ``self.module``: the attributes the wrapper
    lacks are the module's (``pm.fc``, ``pm.encode(x)``), and setting one the module has
    (``pm.temperature = 2.0``) sets it on the module, as on the plain module (the next call
    captures the module with it)."""

    def __getattr__(self, name: str) -> Any:  # (only for names the wrapper lacks)
        module = self.__dict__.get("module")
        if module is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(module, name)

    def __setattr__(self, name: str, value: Any) -> None:
        module = self.__dict__.get("module")
        if (module is not None and not name.startswith("_") and name not in self.__dict__
                and not hasattr(type(self), name) and hasattr(module, name)):
            setattr(module, name, value)
        else:
            super().__setattr__(name, value)
