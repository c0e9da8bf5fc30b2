"""``shard_map`` regions for what sharding annotations cannot say.

- Co-sharding (``OpPlan.chunks``): an op split into k x (devices) sub-ops, k per device, run one
  after another (``lax.map`` over chunks, each under ``jax.checkpoint`` so the backward pass
  recomputes a chunk instead of keeping all of them).
- Value-split chains (``OpPlan.keep_partial`` / value-split ops): partial sums flow through ops
  that are linear in them (``(x1 + x2) * c == x1 * c + x2 * c``) without being reduced; the
  reduction (``psum``) happens once, where the chain's values leave the region.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.anno import DimKind
from nnscaler_jax.ir.graph import Op, Role, Tensor
from nnscaler_jax.layout import Layout
from nnscaler_jax.lower.coshard import chunk_loop
from nnscaler_jax.lower.local import bind_local
from nnscaler_jax.mesh.axes import mesh_axes
from nnscaler_jax.plan.layouts import op_layouts
from nnscaler_jax.plan.plan import VALUE, OpPlan
from nnscaler_jax.rules.linear import VALUE_SPLIT_LINEAR

__all__ = ["chain_prefix", "run_cosharded", "run_sharded", "run_value_chain"]


def _ways(plan: OpPlan, sizes: dict[str, int]) -> dict[str, int]:
    ways: dict[str, int] = {}
    for axis, name in plan.split:
        if name != VALUE:
            ways[name] = ways.get(name, 1) * sizes[axis]
    return ways


def _spec(lay: Layout) -> PartitionSpec:
    return Layout(lay.dims).to_pspec()


def _as_array(x: Any) -> Any:
    return x if hasattr(x, "shape") and hasattr(x, "dtype") else jnp.asarray(x)


def run_cosharded(lw: Any, op: Op, plan: OpPlan, ins: Sequence[Any],
                  in_lays: Sequence[Layout], out_lays: Sequence[Layout]) -> list[Any]:
    """Run ``op`` as ``plan.chunks[1]`` sequential, recomputed chunks per device."""
    dim, k = plan.chunks
    anno = op.annotation
    sizes = mesh_axes(lw.mesh)
    ways = _ways(plan, sizes)
    chunk_ways = {**ways, dim: ways.get(dim, 1) * k}
    pos_in = [operand.axis_of(dim) for operand in anno.inputs]
    pos_out = [operand.axis_of(dim) for operand in anno.outputs]
    reduce = anno.kinds()[dim] is DimKind.REDUCE and all(p is None for p in pos_out)
    partial = sorted({a for lay in out_lays for a in lay.partial})

    def split(x, pos):
        shape = x.shape
        x = x.reshape(shape[:pos] + (k, shape[pos] // k) + shape[pos + 1:])
        return jnp.moveaxis(x, pos, 0)

    def merge(y, pos):
        y = jnp.moveaxis(y, 0, pos)
        return y.reshape(y.shape[:pos] + (y.shape[pos] * y.shape[pos + 1],) + y.shape[pos + 2:])

    def body(*local):
        chunked = [split(x, p) for x, p in zip(local, pos_in, strict=True) if p is not None]

        def args(chunks, whole):
            it = iter(chunks)
            return [next(it) if p is not None else whole[j]
                    for j, p in enumerate(pos_in)]

        if reduce:
            one = jax.checkpoint(lambda chunks: bind_local(op, args(chunks, local), chunk_ways))
            first = one([c[0] for c in chunked])
            rest = jax.lax.map(one, [c[1:] for c in chunked]) if k > 1 else None
            outs = [f + (jnp.sum(r, axis=0) if rest is not None else 0)
                    for f, r in zip(first, rest or [None] * len(first), strict=True)]
        else:
            # (an op whose inputs lack the dim (iota, random_bits) runs k times all the same)
            whole = {j: x for j, (x, p) in enumerate(zip(local, pos_in, strict=True))
                     if p is None}
            ys = chunk_loop(lambda _c, chunks, whole: bind_local(op, args(chunks, whole),
                                                                 chunk_ways), k)(whole, chunked)
            outs = [merge(y, p) if p is not None else y[0] for y, p in
                    zip(ys, pos_out, strict=True)]
        return [jax.lax.psum(o, tuple(partial)) if partial else o for o in outs]

    local_ins = [_as_array(x) for x in ins]
    fn = lw.shard_map(body, tuple(_spec(l) for l in in_lays),
                      [_spec(l) for l in out_lays])
    return list(fn(*local_ins))


def run_sharded(lw: Any, op: Op, plan: OpPlan, ins: Sequence[Any],
                in_lays: Sequence[Layout], out_lays: Sequence[Layout]) -> list[Any]:
    """Run ``op`` on each device's pieces in one ``shard_map`` (partial sums reduced there):
    for ops XLA's SPMD partitioner does not partition correctly
    (:func:`~nnscaler_jax.lower.local.runs_on_pieces`); the backward pass is the region's
    transpose, local too."""
    sizes = mesh_axes(lw.mesh)
    ways = _ways(plan, sizes)
    partial = tuple(sorted({a for lay in out_lays for a in lay.partial}))

    def body(*local):
        outs = bind_local(op, local, ways)
        return [jax.lax.psum(o, partial) if partial else o for o in outs]

    fn = lw.shard_map(body, tuple(_spec(l) for l in in_lays),
                      [_spec(l) for l in out_lays])
    return list(fn(*[_as_array(x) for x in ins]))


def chain_prefix(lw: Any, ops: Sequence[Op]) -> int:
    """How many of ``ops`` (consecutive ops that keep or take partial sums) run as one region:
    up to the first that reads a value made before it in the run in another layout than it
    was made in (a region cannot move values between devices: that value leaves the region,
    reduced, and the reader starts the next one, reading it along the priced path)."""
    made: dict[int, Layout] = {}
    for k, op in enumerate(ops):
        ins, outs = op_layouts(op, lw.plan_of(op))
        if k and any(t.id in made and made[t.id].dims != lay.dims
                     for t, lay in zip(op.inputs, ins, strict=True)):
            return k
        made.update({t.id: lay for t, lay in zip(op.outputs, outs, strict=True)})
    return len(ops)


def run_value_chain(lw: Any, ops: Sequence[Op], env: dict[int, Any]) -> None:
    """Run a chain of ops that keep partial sums, in one ``shard_map``; reduce at its exits.

    A value the chain reads from outside enters once per layout its readers read it in (two
    readers may split it differently); a value made inside is read in the layout it is made
    in (:func:`chain_prefix` cuts a run of ops where it would not be).
    """
    sizes = mesh_axes(lw.mesh)
    ids = {op.id for op in ops}
    in_lays = {op.id: op_layouts(op, lw.plan_of(op))[0] for op in ops}
    made: dict[int, tuple[Op, Layout]] = {}
    ext: dict[tuple[int, Layout], tuple[Tensor, Layout, tuple]] = {}
    for op in ops:
        for t, lay in zip(op.inputs, in_lays[op.id], strict=True):
            if t.id in made:
                _check_internal_edge(made[t.id], op, t, lay)
            elif not (t.role is Role.CONST and t.ndim == 0):
                ext.setdefault((t.id, Layout(lay.dims)), (t, lay, lw.plan_of(op).split))
        for t, lay in zip(op.outputs, op_layouts(op, lw.plan_of(op))[1], strict=True):
            made[t.id] = (op, lay)
    keys = list(ext)
    exits = [t for op in ops for t in op.outputs
             if any(c not in ids for c in lw.consumers(t.id)) or lw.is_output(t.id)]
    exit_lays = [made[t.id][1] for t in exits]

    def body(*local):
        outside = dict(zip(keys, local, strict=True))
        vals: dict[int, Any] = {}
        part: dict[int, frozenset[str]] = {}
        for op in ops:
            plan = lw.plan_of(op)
            args = [vals[t.id] if t.id in vals else
                    outside.get((t.id, Layout(lay.dims)), t.value)
                    for t, lay in zip(op.inputs, in_lays[op.id], strict=True)]
            in_part = [part.get(t.id, frozenset()) for t in op.inputs]
            outs = bind_local(op, args, _ways(plan, sizes))
            _check_linear(op, in_part)
            out_part = set().union(*in_part) | _reduced_axes(op, plan)
            for t, x in zip(op.outputs, outs, strict=True):
                vals[t.id] = x
                part[t.id] = frozenset(out_part)
        return [jax.lax.psum(vals[t.id], tuple(sorted(part[t.id]))) if part[t.id]
                else vals[t.id] for t in exits]

    # external inputs reach the region's layouts along the plan's paths (lower/relayout.py)
    args = [_as_array(lw.read_as(env, t, lay, split) if t.id in env else t.value)
            for t, lay, split in ext.values()]
    fn = lw.shard_map(body, tuple(_spec(lay) for _, lay, _ in ext.values()),
                      [_spec(l) for l in exit_lays])
    for t, x, lay in zip(exits, fn(*args), exit_lays, strict=True):
        env[t.id] = x
        lw.layouts[t.id] = Layout(lay.dims)


def _reduced_axes(op: Op, plan: OpPlan) -> set[str]:
    """The mesh axes over which ``op``'s plan splits a reduced dim (its outputs partial)."""
    anno = op.annotation
    kinds = anno.kinds()
    out_names = {n for o in anno.outputs for n in o.names()}
    return {axis for axis, name in plan.split if name != VALUE
            and kinds.get(name) is DimKind.REDUCE and name not in out_names}


def _check_internal_edge(made: tuple[Op, Layout], reader: Op, t: Tensor, lay: Layout) -> None:
    """A value made inside a value-split chain is read there as it was made (a ``shard_map``
    region holds each device's piece and cannot move it)."""
    op, have = made
    if have.dims != lay.dims:
        raise PlanError(
            f"value-split chain: op '{reader.primitive}' at '{reader.module_path or '<top>'}' "
            f"reads {t} as {Layout(lay.dims)} but op '{op.primitive}' at "
            f"'{op.module_path or '<top>'}' makes it as {Layout(have.dims)} inside the same "
            "shard_map region. Split the chain's ops along the same dims over the same mesh "
            "axes, or end the chain (do not value-split the reader).")


def _check_linear(op: Op, in_part: list[frozenset[str]]) -> None:
    partial = [i for i, p in enumerate(in_part) if p]
    if not partial:
        return
    kind = VALUE_SPLIT_LINEAR.get(op.primitive)
    ok = kind is not None and (
        kind == "all" and len({in_part[i] for i in range(len(in_part))
                               if op.inputs[i].role is not Role.CONST}) == 1
        or kind == "one" and len(partial) == 1
        or kind == "first" and partial == [0])
    if not ok:
        raise PlanError(
            f"op '{op.primitive}' at '{op.module_path or '<top>'}' (annotation '{op.anno}') "
            f"is not linear in its partial-sum inputs {partial}; it cannot be value-split. "
            "End the value-split chain before it (do not value-split this op).")

