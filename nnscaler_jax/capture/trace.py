"""``trace(module, *args, **kwargs) -> Graph``: capture a Flax module as an annotated graph."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import warnings
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax
import numpy as np
from flax import nnx

from nnscaler_jax.capture.flax import (
    CallArgs,
    Traceable,
    linen_traceable,
    nnx_traceable,
    rng_streams,
    with_loss,
)
from nnscaler_jax.capture.jaxpr import graph_from_jaxpr
from nnscaler_jax.capture.precision import float32_matmuls, precision_name, with_precision
from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.graph import Graph

log = logging.getLogger(__name__)

__all__ = ["Captured", "abstract_init", "capture", "capture_spec", "spec_at_precision",
           "spec_inputs", "spec_rngs", "trace", "warn_float32_matmuls", "warn_unannotated"]


@dataclass(frozen=True)
class Captured:
    """A traced program: the flat function, its jaxpr and its annotated graph."""

    traceable: Traceable
    jaxpr: jax.extend.core.ClosedJaxpr
    graph: Graph
    out_tree: Any


def abstract_init(module: nn.Module, args: tuple, kwargs: dict, rngs: Any = None,
                  method: Any = None) -> Any:
    """Variables of a linen module as ``ShapeDtypeStruct`` values (no allocation); non-array
    arguments (``train=True``) are static; ``params`` and ``dropout`` get fixed keys unless
    ``rngs`` names the streams. Initialised by the module's ``__call__`` (all its variables,
    as a full ``module.init`` makes them), else, when that does not take the args, by
    ``method`` (those ``module.init(..., method=method)`` makes)."""
    keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    keys.update({k: jax.random.key(2 + i) for i, k in enumerate(sorted(rng_streams(rngs)))
                 if k not in keys})
    call = CallArgs.of(args, kwargs, type(module).__name__)

    def init(arrays, method=None):
        a, kw = call.rebuild(arrays)
        # nn.Module.init itself, so a class decorated by auto_parallel runs its original code.
        return nn.Module.init(module, keys, *a, method=method, **kw)

    try:
        return jax.eval_shape(init, call.arrays)
    except Exception as e:  # re-raised with context a user can act on
        if method is not None:
            with contextlib.suppress(Exception):  # else the __call__ error is the one reported
                return jax.eval_shape(functools.partial(init, method=method), call.arrays)
        raise PlanError(
            f"{type(module).__name__}.init failed on the example args "
            f"{jax.tree_util.tree_map(lambda x: (tuple(x.shape), str(x.dtype)), call.arrays)} "
            f"(options {dict(call.static) or 'none'}): {type(e).__name__}: {e}") from e


def warn_unannotated(missing: dict[str, set[str]], model: str, stacklevel: int = 2) -> None:
    """One warning per new program naming every primitive without an annotation rule, where it
    appears and how to register one (such ops are planned replicated; not an error)."""
    if not missing:
        return
    lines = []
    for prim, paths in sorted(missing.items()):
        where = sorted(p or "<top>" for p in paths)
        more = f" and {len(where) - 5} more" if len(where) > 5 else ""
        lines.append(f"  '{prim}' at {', '.join(where[:5])}{more}")
    first = min(missing)
    warnings.warn(
        f"{model}: no annotation rule for these primitives; their ops are planned "
        "replicated (every device computes them whole):\n" + "\n".join(lines) + "\n"
        f"Register a rule to let them be split, e.g. nnscaler_jax.register_rule('{first}', "
        "'a b -> a b') or a function (params, in_avals, out_avals) -> str.",
        UserWarning, stacklevel=stacklevel)


def warn_float32_matmuls(graph: Graph, precision: str | None, model: str,
                         stacklevel: int = 2) -> None:
    """One warning when a 16-bit ``precision`` leaves matmuls in float32: layers that pin
    ``dtype=jnp.float32`` compute in it whatever their inputs (the plan is then priced, and
    runs, in float32 there)."""
    paths = float32_matmuls(graph, precision)
    if not paths:
        return
    where = sorted(set(paths))
    more = f" and {len(where) - 5} more" if len(where) > 5 else ""
    warnings.warn(
        f"{model}: precision={precision!r}, but {len(paths)} matmuls still compute in float32 "
        f"(at {', '.join(where[:5])}{more}): their layers set dtype=jnp.float32. Leave the "
        f"layers' dtype None (flax's default: computed in the dtype of their inputs and params) "
        f"or set it to jnp.{precision}", UserWarning, stacklevel=stacklevel)


def capture(module: Any, *args: Any, variables: Any = None, rngs: Any = None,
            mutable: Any = None, method: Any = None, capture_intermediates: Any = False,
            precision: Any = None, loss_fn: Any = None, **kwargs: Any) -> Captured:
    """Trace a linen or nnx module on example args (arrays or ``ShapeDtypeStruct``).

    Args:
        module: a ``flax.linen.Module`` or ``flax.nnx.Module`` instance.
        *args, **kwargs: example arguments of the call; non-array ones (``train=True``) are
            static options of the traced call.
        variables: linen variables (default: ``module.init`` evaluated abstractly).
        rngs: linen rng streams for ``apply`` (e.g. ``{'dropout': key}``).
        mutable: linen mutable collections; default: every collection except ``params``.
        method: linen method to call instead of ``__call__``.
        capture_intermediates: linen's ``apply`` option (the sown intermediates are outputs).
        precision: compute precision (``'bfloat16'``, ``'float16'``, ``'float32'``): params
            and floating args cast to it on entry, variables stored as they are
            (:mod:`nnscaler_jax.capture.precision`); None: the model's own dtypes.
        loss_fn: ``loss_fn(outputs, *args) -> scalar``: the graph of a training step's
            loss, the module and its loss as one graph, as ``pm.train_step(loss_fn, ...)``
            plans them (:func:`~nnscaler_jax.capture.flax.with_loss`); args are arrays.
    """
    precision = precision_name(precision)
    if isinstance(module, nnx.Module):
        tr = nnx_traceable(module, args, kwargs, compute_dtype=precision)
    elif isinstance(module, nn.Module):
        if variables is None:
            variables = abstract_init(module, args, kwargs, rngs, method)
        if mutable is None:
            mutable = [c for c in variables if c != "params"] or False
        tr = linen_traceable(module, args, kwargs, variables=variables, rngs=rngs,
                             mutable=mutable, method=method,
                             capture_intermediates=capture_intermediates,
                             compute_dtype=precision)
    else:
        raise PlanError(
            f"cannot trace a {type(module).__name__}: pass a flax.linen.Module or a "
            "flax.nnx.Module instance (for a plain function, wrap it in a linen module)."
        )
    if loss_fn is not None:
        tr = with_loss(tr, loss_fn, args, len(args),
                       has_state=isinstance(module, nnx.Module) or mutable is not False)
    try:
        jaxpr = jax.make_jaxpr(tr.fn)(*tr.flat_inputs)
    except PlanError:
        raise
    except Exception as e:  # re-raised with context a user can act on
        shapes = [(tuple(x.shape), str(x.dtype)) for x in CallArgs.of(args, kwargs, "").arrays]
        raise PlanError(f"tracing {type(module).__name__} on args {shapes} failed: "
                        f"{type(e).__name__}: {e}") from e
    graph, missing = graph_from_jaxpr(jaxpr, tr.infos, root=tr.root)
    graph = with_precision(graph, precision)
    warn_unannotated(missing, f"trace({type(module).__name__})", stacklevel=3)
    warn_float32_matmuls(graph, precision, f"trace({type(module).__name__})", stacklevel=3)
    return Captured(tr, jaxpr, graph, tr.out_tree())


def trace(module: Any, *args: Any, **kwargs: Any) -> Graph:
    """The annotated operator graph of ``module(*args, **kwargs)``.

    Accepts the keyword options of :func:`capture` (``variables``, ``rngs``, ``mutable``,
    ``method``); other keywords are passed to the module.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> g = trace(nn.Dense(4), jax.ShapeDtypeStruct((2, 8), jnp.float32))
    >>> [op.anno for op in g.ops if op.primitive == 'dot_general']
    ['m0 k0+, k0+ n0 -> m0 n0']
    """
    return capture(module, *args, **kwargs).graph


def spec_inputs(spec: Any) -> tuple[tuple[Any, ...], Any]:
    """A ``ModelSpec``'s abstract example args and (linen) abstract variables, nothing
    allocated. Variables are built here (not left to capture) so abstract args never reach
    ``module.init`` outside a trace."""
    args = spec.make_args(abstract=True)
    return args, (spec.init_abstract() if spec.kind == "linen" else None)


def spec_rngs(spec: Any) -> dict[str, Any] | None:
    """Fixed keys for the rng streams a ``ModelSpec``'s ``apply`` needs (None when none)."""
    if not spec.rng_streams:
        return None
    keys = jax.random.split(jax.random.PRNGKey(1), len(spec.rng_streams))
    return dict(zip(spec.rng_streams, keys, strict=True))


def capture_spec(spec: Any, *, precision: Any = None, loss: bool = False, **kw: Any
                 ) -> Captured:
    """Capture a model-zoo ``ModelSpec`` (``models.get(...)``) on abstract args, nothing
    allocated, with missing-rule warnings silenced (callers list unannotated ops themselves);
    rng streams the model needs get fixed keys; ``precision`` as :func:`capture`'s, and also the
    compute dtype of the zoo's layers (:func:`spec_at_precision`); ``kw`` goes to
    :func:`capture` for linen. ``loss``: the training step's graph, the module and the spec's
    ``loss_fn`` (the one ``pm.train_step(spec.loss_fn, ...)`` plans)."""
    precision = precision_name(precision)
    spec = spec_at_precision(spec, precision)
    args, variables = spec_inputs(spec)
    rngs = spec_rngs(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss_fn = spec.loss_fn if loss else None
        if spec.kind == "nnx":
            return capture(spec.module, *args, precision=precision, loss_fn=loss_fn)
        return capture(spec.module, *args, variables=variables, rngs=rngs,
                       precision=precision, loss_fn=loss_fn, **kw)


def spec_at_precision(spec: Any, precision: str | None) -> Any:
    """``spec`` with its layers computing at ``precision``.

    The zoo's configs pin their layers' compute dtype (``dtype``, float32 by default; params
    stay float32), which the cast on entry alone does not change. A linen spec is rebuilt with
    the config's ``dtype`` replaced (the module field holding the config); an nnx module holds
    its layers built already, so its spec must be made at that dtype.

    Raises:
        PlanError: an nnx spec whose config computes in another dtype.
    """
    cfg = getattr(spec, "config", None)
    dtype = getattr(cfg, "dtype", None)
    if precision is None or dtype is None or np.dtype(dtype).name == precision:
        return spec
    new_cfg = dataclasses.replace(cfg, dtype=jax.numpy.dtype(precision))
    fields = [f.name for f in dataclasses.fields(spec.module)
              if getattr(spec.module, f.name, None) is cfg] if spec.kind == "linen" else []
    if not fields:
        raise PlanError(
            f"{spec.name}:{spec.preset} computes in its config's dtype {np.dtype(dtype).name}; "
            f"build it at precision {precision!r}: models.get({spec.name!r}, {spec.preset!r}, "
            f"dtype=jnp.{precision})")
    module = spec.module.clone(**{fields[0]: new_cfg})
    return dataclasses.replace(spec, module=module, config=new_cfg)
