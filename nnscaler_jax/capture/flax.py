"""Flax linen / nnx module + example args -> a pure function, its inputs and their paths.

The result (:class:`Traceable`) is what both the graph capture and the lowering use: one flat
function of flat inputs, so the planned program and the single-device program are the same code.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
from flax import nnx

from nnscaler_jax.capture.jaxpr import InputInfo
from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.graph import Role

__all__ = ["Traceable", "linen_traceable", "nnx_traceable", "original_calls", "path_str"]

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
        in_tree: treedef of the structured inputs (``(variables_or_state, rngs, args, kwargs)``).
        out_tree: a thunk giving the output treedef once ``fn`` has been traced.
        root: the root module name in name stacks.
    """

    fn: Callable[..., Any]
    flat_inputs: tuple[Any, ...]
    make_infos: Callable[[], list[InputInfo]]
    in_tree: Any
    out_tree: Callable[[], Any]
    root: str

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


def _check_args(args: Sequence[Any], where: str) -> None:
    for i, leaf in enumerate(jax.tree_util.tree_leaves(args)):
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise PlanError(
                f"{where}: example argument leaf {i} is {type(leaf).__name__}, not an array. "
                "Pass arrays or jax.ShapeDtypeStruct values (non-array options belong in the "
                "module's attributes)."
            )


def linen_traceable(module: nn.Module, args: Sequence[Any], kwargs: dict, *,
                    variables: Any, rngs: Any = None, mutable: Any = False,
                    method: Any = None) -> Traceable:
    """The flat function of ``module.apply(variables, *args, rngs=rngs, mutable=mutable)``."""
    _check_args((args, kwargs), type(module).__name__)
    rngs = dict(rngs) if rngs else {}
    structured = (variables, rngs, tuple(args), dict(kwargs))
    flat, in_tree = jax.tree_util.tree_flatten(structured)
    def infos() -> list[InputInfo]:
        return (_infos(variables, Role.VARIABLE, "", True) + _infos(rngs, Role.RNG, "rngs/", False)
                + _infos(tuple(args), Role.INPUT, "args/", False)
                + _infos(dict(kwargs), Role.INPUT, "kwargs/", False))

    store: dict[str, Any] = {}

    def fn(*flat_in):
        v, r, a, kw = jax.tree_util.tree_unflatten(in_tree, flat_in)
        # nn.Module.apply itself, so a class decorated by auto_parallel runs its original code.
        out = nn.Module.apply(module, v, *a, rngs=r or None, mutable=mutable, method=method,
                              **kw)
        leaves, store["tree"] = jax.tree_util.tree_flatten(out)
        return leaves

    return Traceable(fn, tuple(flat), infos, in_tree, lambda: store["tree"],
                     type(module).__name__)


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

        setattr(cls, "__call__", call)
    try:
        yield
    finally:
        for cls, orig in originals.items():
            setattr(cls, "__call__", orig)


def nnx_traceable(module: nnx.Module, args: Sequence[Any], kwargs: dict) -> Traceable:
    """The flat function ``(state, args) -> (outputs, new state)`` of an nnx module call."""
    _check_args((args, kwargs), type(module).__name__)
    graphdef, state = nnx.split(module)
    structured = (state, {}, tuple(args), dict(kwargs))
    flat, in_tree = jax.tree_util.tree_flatten(structured)

    def infos() -> list[InputInfo]:
        var_infos = []
        for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]:
            p = path_str(path)
            p = p[: -len("/value")] if p.endswith("/value") else p
            var_infos.append(InputInfo(Role.VARIABLE, p, _nnx_collection(state, path)))
        return (var_infos + _infos(tuple(args), Role.INPUT, "args/", False)
                + _infos(dict(kwargs), Role.INPUT, "kwargs/", False))
    store: dict[str, Any] = {}

    def fn(*flat_in):
        s, _, a, kw = jax.tree_util.tree_unflatten(in_tree, flat_in)
        m = nnx.merge(graphdef, s)
        with _nnx_named_scopes(m), _original():
            out = m(*a, **kw)
        _, new_state = nnx.split(m)
        leaves, store["tree"] = jax.tree_util.tree_flatten((out, new_state))
        return leaves

    return Traceable(fn, tuple(flat), infos, in_tree, lambda: store["tree"], "")


def _nnx_collection(state: Any, path: Sequence[Any]) -> str:
    node = state
    for k in path:
        try:
            node = node[getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))]
        except (KeyError, TypeError, IndexError, AttributeError):
            break
    return type(node).__name__.lower() if isinstance(node, nnx.Variable) else "variable"
