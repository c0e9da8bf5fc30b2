"""Run one op on local pieces of its operands (inside ``shard_map`` regions and chunks).

A jaxpr equation's params sometimes spell global shapes (``reshape.new_sizes``,
``broadcast_in_dim.shape``, ``iota.shape``); on a shard or a chunk they must be the local ones.
The local output shapes follow from the annotation: every identifier split ``n`` ways shrinks
the axes it leads by ``n``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.coshard import PARAM_SHAPED
from nnscaler_jax.ir.graph import Op

__all__ = ["bind_eqn", "bind_local", "call_on_blocks", "gather_on_slices", "local_out_shapes",
           "runs_elementwise", "runs_on_pieces"]

# params that spell the (global) output shape
_SHAPE_PARAMS = {"reshape": "new_sizes", "broadcast_in_dim": "shape", "iota": "shape"}
# params that depend on shapes in ways we do not rewrite
_UNSUPPORTED = PARAM_SHAPED


def bind_eqn(eqn: Any, ins: Sequence[Any]) -> list[Any]:
    """Bind a jaxpr equation's primitive on ``ins`` as ``jax.core.eval_jaxpr`` does."""
    params = eqn.primitive.get_bind_params(eqn.params)
    outs = eqn.primitive.bind(*ins, **params)
    return list(outs) if eqn.primitive.multiple_results else [outs]


def local_out_shapes(op: Op, ways: Mapping[str, int]) -> list[tuple[int, ...]]:
    """Output shapes of ``op`` when identifier ``name`` is split ``ways[name]`` ways."""
    anno = op.annotation
    out = []
    for operand, t in zip(anno.outputs, op.outputs, strict=True):
        shape = list(t.shape)
        for i, ax in enumerate(operand.axes or ()):
            n = ways.get(ax.dims[0].name, 1)
            if shape[i] % n:
                raise PlanError(f"op '{op.primitive}' at '{op.module_path}': output axis {i} of "
                                f"size {shape[i]} does not split {n} ways")
            shape[i] //= n
        out.append(tuple(shape))
    return out


def runs_on_pieces(op: Op) -> bool:
    """Whether a split ``op`` must run on each device's pieces (a ``shard_map``) instead of
    under GSPMD: grouped convolutions, which XLA's SPMD partitioner gets wrong (jax 0.10: a
    1-D conv with 2 feature groups split along the groups computes wrong outputs; its kernel
    gradient, a ``batch_group_count`` conv, is all-reduced over every device when the batch is
    split over one mesh axis and replicated over another (2x / 4x the gradient on a 2x2 / 2x4
    mesh), and aborts the process (``new_input_batch_size % new_output_batch_size``) when the
    batch is split down to one example per device)."""
    return op.primitive == "conv_general_dilated" and (
        op.params.get("feature_group_count", 1) > 1 or op.params.get("batch_group_count", 1) > 1)


def _local_conv_params(op: Op, ways: Mapping[str, int]) -> dict[str, Any]:
    """A grouped conv's group counts on pieces: splitting the group identifier (the first dim
    of the lhs feature axis for feature groups, of the lhs batch axis for batch groups) ``n``
    ways leaves ``1 / n`` of the groups on each piece."""
    p = op.eqn.params
    dn = p["dimension_numbers"]
    lhs = op.annotation.inputs[0].axes
    out = {}
    for key, pos in (("feature_group_count", dn.lhs_spec[1]), ("batch_group_count",
                                                                dn.lhs_spec[0])):
        if p[key] > 1:
            n = ways.get(lhs[pos].dims[0].name, 1)
            if p[key] % n:
                raise PlanError(f"op '{op.primitive}' at '{op.module_path or '<top>'}': "
                                f"{key}={p[key]} does not split {n} ways")
            out[key] = p[key] // n
    return out


def gather_on_slices(op: Op, names: Sequence[str]) -> bool:
    """Whether gather ``op`` runs on pieces of the dims ``names``, its slice sizes made the
    pieces' (:func:`bind_local`): each is an operand dim it takes whole (a looked-up table's
    features: neither indexed nor collapsed; a lookup of rows of a table split on its
    features, Swin's relative position bias split on its heads), an operand batching dim
    (:func:`~nnscaler_jax.ir.coshard.gather_on_batch`), or not an operand dim at all."""
    if op.primitive != "gather":
        return False
    dn, sizes = op.params["dimension_numbers"], op.params["slice_sizes"]
    shape = op.inputs[0].shape
    indexed = {*dn.collapsed_slice_dims, *dn.start_index_map}
    for n in names:
        a = op.annotation.inputs[0].axis_of(n)
        if a is not None and a not in dn.operand_batching_dims and (
                a in indexed or sizes[a] != shape[a]):
            return False
    return True


def _local_gather_params(op: Op, ways: Mapping[str, int]) -> dict[str, Any]:
    """A :func:`gather_on_slices` gather's slice sizes on pieces: a dim taken whole, the
    piece's size."""
    sizes = list(op.params["slice_sizes"])
    batching = op.params["dimension_numbers"].operand_batching_dims
    for n, k in ways.items():
        a = op.annotation.inputs[0].axis_of(n)
        if a is not None and a not in batching:
            sizes[a] //= k
    return {"slice_sizes": tuple(sizes)}


def bind_local(op: Op, ins: Sequence[Any], ways: Mapping[str, int]) -> list[Any]:
    """Bind ``op``'s primitive on local pieces, rewriting shape params for the local shapes."""
    if not any(n > 1 for n in ways.values()):
        return bind_eqn(op.eqn, ins)
    split = [n for n, k in ways.items() if k > 1]
    if gather_on_slices(op, split):
        return bind_eqn(op.eqn.replace(params={**op.eqn.params,
                                               **_local_gather_params(op, ways)}), ins)
    if op.primitive in _UNSUPPORTED or op.regions:
        raise PlanError(
            f"op '{op.primitive}' at '{op.module_path or '<top>'}' (annotation '{op.anno}') "
            "cannot run on local pieces inside a shard_map region (its params spell global "
            "shapes). Leave it out of co-sharding / value-split chains.")
    if runs_on_pieces(op):
        return bind_eqn(op.eqn.replace(params={**op.eqn.params,
                                               **_local_conv_params(op, ways)}), ins)
    key = _SHAPE_PARAMS.get(op.primitive)
    if key is None:
        return bind_eqn(op.eqn, ins)
    (shape,) = local_out_shapes(op, ways)
    eqn = op.eqn.replace(params={**op.eqn.params, key: tuple(shape)})
    return bind_eqn(eqn, ins)


# ---- a custom-derivative call on blocks ------------------------------------------------------

# primitives that act element by element (broadcast_in_dim: a scalar to the whole shape)
_ELEMENTWISE = frozenset({
    "abs", "add", "and", "atan2", "broadcast_in_dim", "cbrt", "ceil", "clamp",
    "convert_element_type", "copy", "copy_p", "cos", "div", "eq", "erf", "erf_inv", "erfc",
    "exp", "exp2", "expm1", "floor", "ge", "gt", "integer_pow", "is_finite", "le", "log",
    "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter", "not", "or",
    "pow", "reduce_precision", "rem", "round", "rsqrt", "select_n", "sign", "sin", "sqrt",
    "square", "sub", "tan", "tanh", "xor"})
_CALLS = {"jit": "jaxpr", "pjit": "jaxpr", "custom_jvp_call": "call_jaxpr"}


def _jvp_jaxpr(eqn: Any) -> tuple[Any, Sequence[Any], Sequence[bool]]:
    """A ``custom_jvp_call``'s rule as a jaxpr of its primals and every tangent (consts'
    excluded): ``(jaxpr, consts, which output tangents are zero)``."""
    n = len(eqn.invars) - eqn.params["num_consts"]
    return eqn.params["jvp_jaxpr_fun"].call_wrapped(*[False] * n)


def _elementwise(jaxpr: Any, consts: Sequence[Any], shape: tuple[int, ...]) -> bool:
    """Whether ``jaxpr`` computes element by element on arrays of ``shape`` (every value
    of that shape or a scalar; calls inside looked into)."""
    from jax.extend import core as jcore

    fits = lambda v: tuple(v.aval.shape) in (shape, ()) if hasattr(v.aval, "shape") else False
    if any(tuple(getattr(c, "shape", ())) != () for c in consts) or \
            not all(fits(v) for v in jaxpr.invars):
        return False
    for e in jaxpr.eqns:
        name = e.primitive.name
        if not all(fits(v) for v in e.outvars) or not all(
                isinstance(v, jcore.Literal) or fits(v) for v in e.invars):
            return False
        if name in _CALLS:
            inner = e.params[_CALLS[name]]
            if not _elementwise(inner.jaxpr, inner.consts, shape):
                return False
        elif name not in _ELEMENTWISE or (name == "broadcast_in_dim" and e.invars[0].aval.shape):
            return False
    return True


def runs_elementwise(eqn: Any, shape: tuple[int, ...]) -> bool:
    """Whether a ``custom_jvp_call`` equation and its derivative rule compute element by
    element on arrays of ``shape`` (``jax.nn.relu``, ``jnp.logaddexp``): then it runs on any
    blocks of them (:func:`call_on_blocks`)."""
    if eqn.primitive.name != "custom_jvp_call":
        return False
    call = eqn.params["call_jaxpr"]
    jaxpr, consts, _ = _jvp_jaxpr(eqn)
    return _elementwise(call.jaxpr, call.consts, shape) and _elementwise(jaxpr, consts, shape)


def _run_local(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], shape: tuple[int, ...],
               local: tuple[int, ...]) -> list[Any]:
    """An element-by-element ``jaxpr`` on blocks of ``local`` shape (its params spelling the
    whole ``shape`` rewritten); a call inside is run inline (only its primal: the
    derivative is the enclosing call's rule)."""
    from jax.extend import core as jcore

    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
    for e in jaxpr.eqns:
        ins = [read(v) for v in e.invars]
        if e.primitive.name in _CALLS:
            inner = e.params[_CALLS[e.primitive.name]]
            outs = _run_local(inner.jaxpr, inner.consts, ins, shape, local)
        else:
            key = _SHAPE_PARAMS.get(e.primitive.name)
            if key is not None and tuple(e.params[key]) == shape:
                e = e.replace(params={**e.params, key: local})
            outs = bind_eqn(e, ins)
        env.update(zip(e.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def call_on_blocks(eqn: Any, shape: tuple[int, ...], local: tuple[int, ...]) -> Any:
    """A ``custom_jvp_call`` equation that :func:`runs_elementwise` on ``shape``, as a
    function of blocks of ``local`` shape, its derivative still its own rule (``relu``'s
    gradient at 0 is 0, where ``max``'s would be 1/2)."""
    import jax
    import jax.numpy as jnp

    call, nc = eqn.params["call_jaxpr"], eqn.params["num_consts"]

    @jax.custom_jvp
    def fn(*xs):
        return _run_local(call.jaxpr, call.consts, xs, shape, local)

    def rule(primals, tangents):
        jaxpr, consts, zero = _jvp_jaxpr(eqn)
        outs = _run_local(jaxpr, consts, [*primals[nc:], *tangents[nc:]], shape, local)
        ys, nonzero = outs[:len(zero)], iter(outs[len(zero):])
        return ys, [jnp.zeros_like(y) if z else next(nonzero) for y, z in zip(ys, zero,
                                                                                strict=True)]

    fn.defjvp(rule)
    return fn
