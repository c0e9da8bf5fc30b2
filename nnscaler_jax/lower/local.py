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
from nnscaler_jax.ir.graph import Op

__all__ = ["bind_eqn", "bind_local", "local_out_shapes"]

# params that spell the (global) output shape
_SHAPE_PARAMS = {"reshape": "new_sizes", "broadcast_in_dim": "shape", "iota": "shape"}
# params that depend on shapes in ways we do not rewrite
_UNSUPPORTED = {"dynamic_slice", "slice", "pad", "gather", "scatter", "scatter-add",
                "concatenate", "dynamic_update_slice", "rng_bit_generator", "random_bits"}


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


def bind_local(op: Op, ins: Sequence[Any], ways: Mapping[str, int]) -> list[Any]:
    """Bind ``op``'s primitive on local pieces, rewriting shape params for the local shapes."""
    if not any(n > 1 for n in ways.values()):
        return bind_eqn(op.eqn, ins)
    if op.primitive in _UNSUPPORTED or op.regions:
        raise PlanError(
            f"op '{op.primitive}' at '{op.module_path or '<top>'}' (annotation '{op.anno}') "
            "cannot run on local pieces inside a shard_map region (its params spell global "
            "shapes). Leave it out of co-sharding / value-split chains.")
    key = _SHAPE_PARAMS.get(op.primitive)
    if key is None:
        return bind_eqn(op.eqn, ins)
    (shape,) = local_out_shapes(op, ways)
    eqn = op.eqn.replace(params={**op.eqn.params, key: tuple(shape)})
    return bind_eqn(eqn, ins)
