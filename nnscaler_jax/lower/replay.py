"""Plan -> program: replay the graph with the plan's layouts as sharding constraints.

Every op's inputs and outputs are constrained to the layouts its partition implies
(:func:`nnscaler_jax.plan.layouts.op_layouts`). Between a producer's layout and a consumer's the
value is constrained once per step of the collective path the cost model priced
(:func:`nnscaler_jax.lower.relayout.relayout_steps`), so GSPMD / Shardy insert exactly those
collectives, one at a time, and never fall back to a full rematerialization. Partial-sum (V)
outputs are constrained to the first layout without partial sums on the path to their first
consumer (all-reduce for R, reduce-scatter for D); their gradients are carried back from there
to the op's layout without partial sums, step by step, before the op's transpose reads them
(the backward the cost model priced; left to XLA, the transpose may read them in a layout it
can reach only by a full rematerialization). Remat boundaries are replayed under
``jax.checkpoint``; custom-derivative calls are bound whole (on each device's blocks, where
they compute element by element); ``scan`` / ``while`` / ``cond`` are
rebuilt with ``jax.lax`` around a replay of their bodies. Co-sharded ops and value-split chains
run inside ``jax.shard_map`` regions (:mod:`nnscaler_jax.lower.regions`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnscaler_jax.cost.relayout import partial_grad_axes
from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.attention import FUSED, with_fused_attention
from nnscaler_jax.ir.coshard import COSHARD, PARAM_SHAPED, with_boundaries
from nnscaler_jax.ir.graph import REMAT_KINDS, Graph, Op, Role, Tensor
from nnscaler_jax.layout import Layout
from nnscaler_jax.lower.attention import run_fused_attention
from nnscaler_jax.lower.coshard import run_coshard
from nnscaler_jax.lower.local import (
    bind_eqn,
    bind_local,
    call_on_blocks,
    gather_on_slices,
    runs_elementwise,
    runs_on_pieces,
)
from nnscaler_jax.lower.manual import grad_reduced
from nnscaler_jax.lower.manual import relayout as manual_relayout
from nnscaler_jax.lower.regions import chain_prefix, run_cosharded, run_sharded, run_value_chain
from nnscaler_jax.lower.relayout import (
    backward_steps,
    constrain_along,
    reduced_layout,
    relayout_steps,
)
from nnscaler_jax.mesh.axes import auto_view, is_explicit
from nnscaler_jax.mesh.topology import MeshSpec
from nnscaler_jax.plan.layouts import op_layouts, plan_layouts, sole_read_variables
from nnscaler_jax.plan.plan import VALUE, OpPlan, Plan

__all__ = ["Lowering", "explicit_context", "explicitly_typed"]


def explicit_context() -> bool:
    """Whether the caller runs under an Explicit context mesh (``with jax.set_mesh(mesh):``):
    then a program must run as on Explicit-typed inputs (under ``auto_axes``), whatever its
    inputs' types."""
    ctx = jax.sharding.get_abstract_mesh()
    return not getattr(ctx, "empty", True) and is_explicit(ctx)


def explicitly_typed(x: Any) -> bool:
    """Whether ``x`` carries an Explicit-axis sharding in its type (jax 0.10 sharding in types)."""
    try:
        sharding = jax.typeof(x).sharding
    except (TypeError, AttributeError):
        return False
    mesh = getattr(sharding, "mesh", None)
    return mesh is not None and not getattr(mesh, "empty", True) and is_explicit(mesh)


@dataclass(eq=False)
class Lowering:
    """Replays ``graph`` under ``plan`` on ``mesh`` (``explicit``: inputs carry Explicit
    sharding types; ``in_context``: it runs inside a program
that sets the mesh (the pipeline's stages: constraints are specs of the context mesh, regions
manual over its axes not yet manual); ``result_specs``: on an Explicit mesh, the types of the outputs the user's
    code reads (:func:`nnscaler_jax.lower.explicit.result_specs`; None entries: the plan's);
    ``mesh_spec``: the link costs the plan was priced with, which choose each relayout's path
    (None: :data:`~nnscaler_jax.mesh.topology.DEFAULT_LINK` on every axis, as the default
    cost model); ``manual``: it runs inside a ``shard_map`` manual over the plan's axes, on
    each device's blocks, its relayouts explicit collectives (:mod:`nnscaler_jax.lower.manual`:
    the graph's inputs other than variables enter replicated; co-sharded blocks run as each
    device's blocks chunked; an op co-sharded alone, value-split chains, fused attention, ops
    run on pieces and loops are refused))."""

    graph: Graph
    plan: Plan
    mesh: Mesh

    explicit: bool = False
    in_context: bool = False
    result_specs: Sequence[PartitionSpec | None] | None = None
    mesh_spec: MeshSpec | None = None
    manual: bool = False

    def __post_init__(self) -> None:
        # Untyped inputs: run on an Auto view of the mesh. Explicitly typed inputs: run on the
        # user's Explicit mesh under auto_axes, so results are typed like the plan's layouts.
        self.mesh = self.mesh if self.explicit else auto_view(self.mesh)
        self.mesh_spec = self.mesh_spec or MeshSpec.from_mesh(self.mesh)
        # the layout each value was constrained to where it was made (the start of its relayouts)
        self.layouts: dict[int, Layout] = {}
        # remat boundaries: recompute groups and co-sharded blocks
        fused = with_fused_attention(self.graph, self.plan.fused_attention,
                                     dict(self.plan.ring_layouts))
        self.graph = with_boundaries(fused, self.plan.coshard, self.plan.recompute)
        self._plans = {p.op: p for p in self.plan.ops}
        self._sole = sole_read_variables(self.graph)
        self._consumer_layout: dict[int, Layout] = {}
        self._consumers: dict[int, list[int]] = {}
        for op in self.graph.walk():
            ins, _ = plan_layouts(op, self._plans, self._sole)
            for t, lay in zip(op.inputs, ins, strict=True):
                self._consumer_layout.setdefault(t.id, lay)
                self._consumers.setdefault(t.id, []).append(op.id)
        self._outputs = {t.id for t in self.graph.outputs}
        if self.manual:
            self._check_manual()

    def _check_manual(self) -> None:
        """Refuse, before anything runs, what a program on each device's blocks cannot hold:
        ops that run as ``shard_map`` regions of their own, and loops or branches
        (co-sharded blocks run, each device chunking its own block)."""
        for op in self.graph.walk():
            p = self._plans.get(op.id)
            if self._in_chain(op):
                raise self._not_manual(op, "in a value-split chain")
            if op.primitive == FUSED:
                raise self._not_manual(op, "a fused attention kernel")
            if p is not None and p.chunks:
                raise self._not_manual(op, "co-sharded")
            if op.regions:
                raise self._not_manual(op, "a loop or a branch")
            if p is not None and p.split and runs_on_pieces(op):
                raise self._not_manual(op, "run on pieces")

    def plan_of(self, op: Op) -> OpPlan:
        return self._plans.get(op.id) or OpPlan(op.id, op.primitive, op.module_path)

    def consumers(self, tensor_id: int) -> list[int]:
        return self._consumers.get(tensor_id, [])

    def is_output(self, tensor_id: int) -> bool:
        return tensor_id in self._outputs

    def _in_chain(self, op: Op) -> bool:
        p = self._plans.get(op.id)
        return p is not None and (p.keep_partial or any(d == VALUE for _, d in p.split))

    def _not_manual(self, op: Op, what: str) -> PlanError:
        return PlanError(
            f"op '{op.primitive}' at '{op.module_path or '<top>'}' is {what}, which runs as a "
            "shard_map region of its own; a program run on each device's blocks "
            "(tensor-parallel pipeline stages in one program) cannot hold one. Fix: plan the "
            "stages without it (no co-sharding / value-split rules there), or run the stages "
            "one program each (Constraints(pipeline_executor='per-stage'))")

    # ---- layouts ------------------------------------------------------------------------------

    def sharding(self, layout: Layout) -> NamedSharding | PartitionSpec:
        """What ``with_sharding_constraint`` takes inside the program: on an Explicit mesh the
        program runs under ``auto_axes`` and constraints are specs of the context mesh."""
        spec = layout.to_pspec(allow_partial=True)
        return spec if self.explicit or self.in_context else NamedSharding(self.mesh, spec)

    def region_mesh(self) -> Any:
        """The mesh ``shard_map`` regions use: the context (Auto) mesh under ``auto_axes``."""
        return jax.sharding.get_abstract_mesh() if self.explicit or self.in_context \
            else self.mesh

    def shard_map(self, body: Any, in_specs: Any, out_specs: Any) -> Any:
        """``body`` as a region: manual over the mesh axes not already manual (a stage's
        region inside the pipeline's ``shard_map`` over its stage and data axes)."""
        mesh = self.region_mesh()
        manual = jax.sharding.AxisType.Manual
        names = frozenset(a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
                          if t != manual)
        return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names=names, check_vma=False)

    def run(self, ops: Sequence[Op], env: dict, boundaries: dict) -> None:
        """Run ``ops`` (consecutive ops of one graph, whole boundaries) on ``env`` (tensor id
        -> value): what the pipeline's chunks run (:mod:`nnscaler_jax.lower.eqns`)."""
        self._run(list(ops), 0, env, boundaries)

    def named(self, layout: Layout) -> NamedSharding:
        return NamedSharding(self.mesh, layout.to_pspec(allow_partial=True))

    def input_layout(self, t: Tensor) -> Layout:
        """Storage layout of a graph input: the plan's for variables, else its first consumer's."""
        if self.manual and t.role is not Role.VARIABLE:
            return Layout.replicated(t.ndim)
        if t.role is Role.VARIABLE:
            spec = self.plan.variable_spec(t.name)
            if spec is not None:
                return Layout.from_pspec(spec, t.ndim)
            return Layout.replicated(t.ndim)
        lay = self._consumer_layout.get(t.id)
        return Layout(lay.dims) if lay is not None else Layout.replicated(t.ndim)

    def input_shardings(self) -> tuple[NamedSharding | None, ...]:
        out = []
        for t in self.graph.inputs:
            if t.role is Role.RNG or not _is_array_dtype(t.dtype):
                out.append(None)
            else:
                out.append(self.named(self.input_layout(t)))
        return tuple(out)

    def output_specs(self) -> list[PartitionSpec]:
        """Layouts of the graph outputs (what their producers leave them in)."""
        lays: dict[int, Layout] = {t.id: self.input_layout(t) for t in self.graph.inputs}
        for op in self.graph.ops:
            _, outs = op_layouts(op, self._plans.get(op.id))
            for t, lay in zip(op.outputs, outs, strict=True):
                lays[t.id] = self.resolve(t, lay)
        return [Layout(lays[t.id].dims).to_pspec() if t.id in lays else PartitionSpec()
                for t in self.graph.outputs]

    def consumer_layout(self, tensor_id: int) -> Layout | None:
        """The layout the first consumer of a tensor reads it in (None: no consumer)."""
        return self._consumer_layout.get(tensor_id)

    def resolve(self, t: Tensor, lay: Layout) -> Layout:
        """Where partial sums are reduced: the first layout without them on the priced path
        to the first consumer's (:func:`~nnscaler_jax.lower.relayout.reduced_layout`)."""
        if not lay.partial or not _is_array_dtype(t.dtype):
            return Layout(lay.dims) if lay.partial else lay
        return reduced_layout(lay, self._consumer_layout.get(t.id), t.shape,
                              np.dtype(t.dtype).itemsize, self.mesh_spec)

    def _constrain(self, x: Any, t: Tensor, lay: Layout) -> Any:
        """Constrain a value where it is made to ``lay`` (the start of its relayouts)."""
        if t.role is Role.CONST or t.ndim == 0 or not _is_array_dtype(t.dtype):
            return x
        self.layouts[t.id] = Layout(lay.dims)
        if self.manual:  # (the device's block, made in that layout)
            return x
        return jax.lax.with_sharding_constraint(x, self.sharding(lay))

    def relayout_key(self, t: Tensor, lay: Layout, split: Sequence = ()) -> tuple | None:
        """Where :meth:`read_as` keeps ``t`` read as ``lay`` by an op split as ``split`` in
        its ``env`` (None: read as it is, a constant, a scalar or a key)."""
        if t.role is Role.CONST or t.ndim == 0 or not _is_array_dtype(t.dtype):
            return None
        return ("relayout", t.id, Layout(lay.dims), partial_grad_axes(lay, tuple(split)))

    def read_as(self, env: dict, t: Tensor, lay: Layout, split: Sequence = ()) -> Any:
        """The value of ``t`` read as ``lay`` by an op split as ``split``: constrained step by
        step along the path the plan priced from where it was made, its gradient along the
        priced backward path (:mod:`nnscaler_jax.lower.relayout`); one constraint when where
        it was made is unknown. Readers of the same layout whose gradients are partial over
        the same axes share one relayout (one gradient reduction, as priced)."""
        x = self._read(env, t)
        key = self.relayout_key(t, lay, split)
        if key is None:
            return self._manual_scalar(x, t, split) if self.manual else x
        src = self.layouts.get(t.id)
        if self.manual:
            src = env.get(("made", t.id), src)  # (a co-sharded block's chunked input)
            if key not in env:
                env[key] = self._manual_read(x, t, src, lay, split)
            return env[key]
        if src is None:
            return jax.lax.with_sharding_constraint(x, self.sharding(lay))
        if key not in env:
            size, mesh = np.dtype(t.dtype).itemsize, self.mesh_spec
            fwd = relayout_steps(src, lay, t.shape, size, mesh) or (Layout(lay.dims),)
            back = backward_steps(src, lay, tuple(split), t.shape, size, mesh) \
                if jnp.issubdtype(np.dtype(t.dtype), jnp.inexact) else ()
            fwd_s = [self.sharding(s) for s in fwd]
            if back and _runs(back) != _runs((*reversed(fwd), src)):
                env[key] = constrain_along(x, fwd_s, [self.sharding(s) for s in back])
            else:  # the constraints' transposes take the priced backward path
                for s in fwd_s:
                    x = jax.lax.with_sharding_constraint(x, s)
                env[key] = x
        return env[key]

    @staticmethod
    def _manual_scalar(x: Any, t: Tensor, split: Sequence) -> Any:
        """A floating scalar read by an op split over axes: its cotangent summed over them
        (each device's op makes a part of it)."""
        axes = partial_grad_axes(Layout(()), tuple(split)) if t.ndim == 0 else ()
        if axes and t.role is not Role.CONST and _is_array_dtype(t.dtype) \
                and jnp.issubdtype(np.dtype(t.dtype), jnp.inexact):
            return grad_reduced(x, axes)
        return x

    def _manual_read(self, x: Any, t: Tensor, src: Layout | None, lay: Layout,
                     split: Sequence) -> Any:
        """:meth:`read_as` on each device's block: along the priced path by explicit
        collectives, the cotangent summed over the axes ``split`` splits and ``lay`` does
        not (:func:`~nnscaler_jax.lower.manual.grad_reduced`)."""
        if src is None:
            raise PlanError(f"manual lowering: where {t} was made is unknown (its block's "
                            f"layout), so it cannot be read as {lay}")
        sizes = dict(self.mesh.shape)
        steps = relayout_steps(src, lay, t.shape, np.dtype(t.dtype).itemsize, self.mesh_spec)
        for step in steps:
            x = manual_relayout(x, src, Layout(step.dims), sizes)
            src = Layout(step.dims)
        axes = partial_grad_axes(Layout(lay.dims), tuple(split))
        if axes and jnp.issubdtype(np.dtype(t.dtype), jnp.inexact):
            x = grad_reduced(x, axes)
        return x

    # ---- replay -------------------------------------------------------------------------------

    def __call__(self, *flat_inputs: Any) -> list[Any]:
        """The planned program (traceable; jit it over the mesh).

        On a mesh with Explicit axes, the replay runs under ``jax.sharding.auto_axes`` (GSPMD
        places what the constraints leave open) and its results get the outputs' layouts.
        """
        if not self.explicit:
            return self._program(*flat_inputs)
        specs = [r if r is not None else s for s, r in
                 zip(self.output_specs(), self.result_specs or [None] * len(self.graph.outputs),
                     strict=True)]
        with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
            fn = jax.sharding.auto_axes(lambda *a: list(self._program(*a, results=specs)),
                                        out_sharding=specs)
            return fn(*flat_inputs)

    def _program(self, *flat_inputs: Any,
                 results: Sequence[PartitionSpec] | None = None) -> list[Any]:
        """The replay; ``results``: the specs the outputs leave in, reached along the priced
        path (one constraint to a far layout makes XLA replicate the tensor first)."""
        env: dict[int, Any] = {}
        for t, x in zip(self.graph.inputs, flat_inputs, strict=True):
            if t.role is not Role.RNG:
                x = self._constrain(x, t, self.input_layout(t))
            env[t.id] = x
        outs = self._replay(self.graph, env)
        if results is None:
            return outs
        return [self.read_as(env, t, Layout.from_pspec(spec, t.ndim)) for t, spec in
                zip(self.graph.outputs, results, strict=True)]

    def _replay(self, graph: Graph, env: dict[int, Any]) -> list[Any]:
        for c in graph.consts:
            env[c.id] = c.value
        boundaries = {b.id: b for b in graph.boundaries}
        self._run(list(graph.ops), 0, env, boundaries)
        return [self._read(env, t) for t in graph.outputs]

    def _read(self, env: dict[int, Any], t: Tensor) -> Any:
        if t.id in env:
            return env[t.id]
        if t.role is Role.CONST:
            return t.value
        raise KeyError(f"tensor {t} has no value")

    def _run(self, ops: Sequence[Op], depth: int, env: dict, boundaries: dict) -> None:
        i = 0
        while i < len(ops):
            op = ops[i]
            if len(op.boundary) > depth:
                bid = op.boundary[depth]
                j = i
                while j < len(ops) and len(ops[j].boundary) > depth and \
                        ops[j].boundary[depth] == bid:
                    j += 1
                self._boundary(ops[i:j], depth, env, boundaries[bid], boundaries)
                i = j
                continue
            if self._in_chain(op):
                j = i
                while j < len(ops) and self._in_chain(ops[j]) and \
                        len(ops[j].boundary) == len(op.boundary):
                    j += 1
                j = i + chain_prefix(self, ops[i:j])
                run_value_chain(self, ops[i:j], env)
                i = j
                continue
            self._op(op, env)
            i += 1

    def _boundary(self, ops, depth, env, b, boundaries) -> None:
        if b.kind == COSHARD:
            run_coshard(self, ops, env, b)
            return
        if self.manual and b.kind not in REMAT_KINDS:
            self._manual_call(ops, env, b)
            return
        ins = [self._read(env, t) for t in b.inputs]
        if b.kind in REMAT_KINDS:
            def body(*vals):  # relayouts made outside are not reused inside (recomputed)
                inner = {k: v for k, v in env.items() if not isinstance(k, tuple)}
                for t, v in zip(b.inputs, vals, strict=True):
                    inner[t.id] = v
                self._run(ops, depth + 1, inner, boundaries)
                return [inner.get(t.id, t.value) for t in b.outputs]

            p = b.eqn.params
            outs = jax.checkpoint(body, prevent_cse=p.get("prevent_cse", True),
                                  policy=p.get("policy"))(*ins)
        else:
            outs = bind_eqn(b.eqn, ins)
            produced = {t.id: op for op in ops for t in op.outputs}
            fixed = []
            for t, x in zip(b.outputs, outs, strict=True):
                op = produced.get(t.id)
                if op is not None:
                    _, lays = op_layouts(op, self._plans.get(op.id))
                    lay = lays[[o.id for o in op.outputs].index(t.id)]
                    x = self._constrain(x, t, self.resolve(t, lay))
                fixed.append(x)
            outs = fixed
        for t, x in zip(b.outputs, outs, strict=True):
            env[t.id] = x

    def _manual_call(self, ops: Sequence[Op], env: dict, b: Any) -> None:
        """A call bound whole (custom derivatives), on each device's blocks: where it and its
        derivative rule compute element by element (``jax.nn.relu``), on the blocks its
        outputs are made in (:func:`~nnscaler_jax.lower.local.call_on_blocks`); else its
        inputs read whole (its equations spell global shapes), its outputs sliced to the
        blocks the plan makes them in (every value's layout is known before anything runs:
        LoweredEqns)."""
        made = {t.id: self.resolve(t, lay) for op in ops for t, lay in
                zip(op.outputs, op_layouts(op, self._plans.get(op.id))[1], strict=True)}
        wants = []
        for t in b.outputs:
            # (an output that is one of the inputs: where that was made)
            at = made.get(t.id) or self.layouts.get(t.id)
            wants.append(Layout(at.dims) if at is not None and t.ndim and
                         _is_array_dtype(t.dtype) else Layout.replicated(t.ndim))
        if self._on_blocks(b, wants):
            lay, shape = wants[0], b.outputs[0].shape
            ins = [self.read_as(env, t, lay) if t.ndim else self._read(env, t)
                   for t in b.inputs]
            outs = call_on_blocks(b.eqn, shape, lay.local_shape(shape, self.mesh_spec))(*ins)
            for t, x in zip(b.outputs, outs, strict=True):
                env[t.id] = self._constrain(x, t, lay)
            return
        ins = [self.read_as(env, t, Layout.replicated(t.ndim)) if t.ndim else
               self._read(env, t) for t in b.inputs]
        sizes = dict(self.mesh.shape)
        for t, x, want in zip(b.outputs, bind_eqn(b.eqn, ins), wants, strict=True):
            x = manual_relayout(x, Layout.replicated(t.ndim), want, sizes)
            env[t.id] = self._constrain(x, t, want)

    @staticmethod
    def _on_blocks(b: Any, wants: Sequence[Layout]) -> bool:
        """Whether call ``b`` runs on blocks: its outputs made in one split layout, every
        array it reads and makes of their shape or a scalar, and it and its derivative rule
        element by element (:func:`~nnscaler_jax.lower.local.runs_elementwise`)."""
        shape = b.outputs[0].shape
        return bool(wants) and bool(wants[0].split_axes) and all(w == wants[0] for w in wants) \
            and all(t.shape in (shape, ()) for t in (*b.inputs, *b.outputs)) \
            and runs_elementwise(b.eqn, tuple(shape))

    def _local_size(self, t: Tensor, lay: Layout | None) -> int:
        shape = t.shape if lay is None else lay.local_shape(t.shape, self.mesh_spec)
        return int(np.prod(shape))

    def _op(self, op: Op, env: dict, ways: dict[str, int] | None = None) -> None:
        """Run ``op`` on the values in ``env``; ``ways``: it runs on chunks of a co-sharded
        block (identifier -> chunks)."""
        plan = self._plans.get(op.id)
        in_lays, out_lays = plan_layouts(op, self._plans, self._sole)
        split = plan.split if plan is not None else ()
        planned = out_lays
        if self.manual and plan is not None and plan.split and self._whole_only(op, plan):
            plan, split = None, ()
            in_lays = [Layout.replicated(t.ndim) for t in op.inputs]
            out_lays = [Layout.replicated(t.ndim) for t in op.outputs]
        ins = [self.read_as(env, t, lay, split) for t, lay in zip(op.inputs, in_lays, strict=True)]
        if self.manual:
            self._manual_op(op, plan, ins, out_lays, env, ways or {}, planned)
            return
        if ways is not None:
            if plan is not None and (plan.chunks or (plan.split and runs_on_pieces(op))):
                raise PlanError(f"op '{op.primitive}' at '{op.module_path or '<top>'}' is in a "
                                "co-sharded block and co-sharded (or run on pieces) itself: "
                                "leave it out of one of the two")
            outs = bind_local(op, ins, ways)
        elif op.primitive == FUSED:
            outs = run_fused_attention(self, op, ins, in_lays, out_lays)
        elif plan is not None and plan.chunks:
            outs = run_cosharded(self, op, plan, ins, in_lays, out_lays)
        elif plan is not None and plan.split and runs_on_pieces(op):
            outs = run_sharded(self, op, plan, ins, in_lays, out_lays)
        elif op.regions:
            outs = self._region(op, ins, in_lays, out_lays)
        else:
            outs = bind_eqn(op.eqn, ins)
            if op.primitive == "gather" and self._local_size(op.inputs[0], in_lays[0]) > \
                    self._local_size(op.outputs[0], out_lays[0]):
                # rows looked up from a table: kept as they are, or XLA fuses the lookup into
                # each reader, the backward's too, and keeps the (gathered) table through the
                # step instead (Llama-3-8B's 1 GiB embedding, measured with XLA:GPU)
                outs = jax.lax.optimization_barrier(list(outs))
        for t, x, lay in zip(op.outputs, outs, out_lays, strict=True):
            reduced = self.resolve(t, lay)
            env[t.id] = self._constrain(self._partial_cotangent(x, t, lay, reduced), t, reduced)

    @staticmethod
    def _whole_only(op: Op, plan: OpPlan) -> bool:
        """Whether split ``op`` cannot run on blocks (its params spell global shapes the
        blocks cannot take: :func:`~nnscaler_jax.lower.local.bind_local`): on each device's
        blocks it then runs whole, on its inputs gathered, its results whole."""
        names = [n for _, n in plan.split if n != VALUE]
        return op.primitive in PARAM_SHAPED and not gather_on_slices(op, names)

    def _manual_op(self, op: Op, plan: OpPlan | None, ins: list[Any],
                   out_lays: Sequence[Layout], env: dict, chunks: dict[str, int],
                   planned: Sequence[Layout]) -> None:
        """``op`` on each device's blocks; its partial sums reduced where the value is made
        whole (:meth:`resolve`), by explicit collectives (what cannot run so was refused
        when the lowering was made: :meth:`_check_manual`)."""
        sizes = dict(self.mesh.shape)
        ways = dict(chunks)  # (a co-sharded block's chunk: identifier -> chunks)
        for axis, name in plan.split if plan is not None else ():
            if name != VALUE:
                ways[name] = ways.get(name, 1) * sizes[axis]
        outs = bind_local(op, ins, ways)
        for t, x, lay, want in zip(op.outputs, outs, out_lays, planned, strict=True):
            # (made where the plan makes it: run whole, an op's results are sliced back, as
            # every value's layout is known before anything runs: LoweredEqns)
            reduced = self.resolve(t, want)
            if _is_array_dtype(t.dtype) and t.ndim:
                x = manual_relayout(x, lay, reduced, sizes)
            elif lay.partial:  # (a scalar's partial sums)
                x = manual_relayout(x, Layout((), lay.partial), Layout(()), sizes)
            env[t.id] = self._constrain(x, t, reduced)

    def _partial_cotangent(self, x: Any, t: Tensor, lay: Layout, reduced: Layout) -> Any:
        """``x`` (an output the op leaves as partial sums ``lay``, reduced to ``reduced``) with
        its cotangent carried from ``reduced`` to ``lay`` without partial sums, step by step
        along the priced path, before the op's transpose reads it; the value is unchanged.

        The gradient of a partial-sum output is replicated over the partial axes: the cost
        model prices its way back from where the value was reduced to ``lay``'s dims
        (``CostModel.reshard_time``), and the op's transpose is planned to read it there. The
        forward has no constraint at ``lay`` (partial sums have no sharding), so without this
        the transpose would read the cotangent as ``reduced`` and XLA would pick its own way to
        its dot, e.g. ``D(2:(data,model))`` read split over ``data`` on another dim, which it
        can only do by gathering the whole tensor ("Involuntary full rematerialization")."""
        if not lay.partial or t.ndim == 0 or not _is_array_dtype(t.dtype) or \
                not jnp.issubdtype(np.dtype(t.dtype), jnp.inexact):
            return x
        steps = relayout_steps(reduced, Layout(lay.dims), t.shape, np.dtype(t.dtype).itemsize,
                               self.mesh_spec)
        if not steps:
            return x
        return constrain_along(x, (), [self.sharding(s) for s in steps])

    def _body_fn(self, body: Graph, in_lays: Sequence[Layout] | None = None,
                 out_lays: Sequence[Layout] | None = None):
        """The body as a function; ``in_lays`` / ``out_lays``: the layouts its operands enter
        in and its results leave in (a ``cond``'s branches must agree on both: the gradients
        of the operands are the results of the backward pass's branches)."""
        def fn(*vals):
            env = {t.id: v for t, v in zip(body.inputs, vals, strict=True)}
            if in_lays is not None:
                for t, lay in zip(body.inputs, in_lays, strict=True):
                    env[t.id] = self._constrain(env[t.id], t, Layout(lay.dims))
            outs = self._replay(body, env)
            if out_lays is None:
                return outs
            return [self.read_as(env, t, Layout(lay.dims)) for t, lay in
                    zip(body.outputs, out_lays, strict=True)]
        return fn

    def _region(self, op: Op, ins: list[Any], in_lays: Sequence[Layout],
                out_lays: Sequence[Layout]) -> list[Any]:
        p = op.params
        if op.primitive == "scan":
            (body,) = op.regions
            nc, ncarry = p["num_consts"], p["num_carry"]
            consts, init, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
            fn = self._body_fn(body)

            def step(carry, x):
                outs = fn(*consts, *carry, *x)
                return list(outs[:ncarry]), list(outs[ncarry:])

            carry, ys = jax.lax.scan(step, list(init), list(xs), length=p["length"],
                                     reverse=p["reverse"], unroll=p["unroll"])
            return list(carry) + list(ys)
        if op.primitive == "while":
            cond, body = op.regions
            cn, bn = p["cond_nconsts"], p["body_nconsts"]
            cc, bc, init = ins[:cn], ins[cn:cn + bn], ins[cn + bn:]
            cf, bf = self._body_fn(cond), self._body_fn(body)
            return list(jax.lax.while_loop(lambda c: cf(*cc, *c)[0],
                                           lambda c: list(bf(*bc, *c)), list(init)))
        # cond: every branch takes its operands in the cond's input layouts and leaves its
        # results in its output layouts (XLA requires the branches to agree on them)
        branches = [self._body_fn(g, in_lays[1:], out_lays) for g in op.regions]
        return list(jax.lax.switch(ins[0], [lambda *a, f=f: list(f(*a)) for f in branches],
                                   *ins[1:]))


def _runs(layouts: Sequence[Layout]) -> list[Layout]:
    """``layouts`` without repeats in a row (constraining twice to one layout is once)."""
    return [lay for k, lay in enumerate(layouts) if k == 0 or lay != layouts[k - 1]]


def _is_array_dtype(dtype: str) -> bool:
    try:
        np.dtype(dtype)
        return True
    except TypeError:
        return False
