"""Running cuts of a traced program's equations: as they are, or as the plan lowers their ops.

The pipeline's chunks are ranges of the micro-batch program's equations (a prefix, one layer
template, a suffix; or a cut at module boundaries, :mod:`nnscaler_jax.pipeline.chunks`). An
:class:`EqnEvaluator` runs such a range on an environment of jaxpr variables:
:data:`NO_CONSTRAINTS` binds the equations as they are (data-parallel stages, where GSPMD has
nothing to decide), :class:`LoweredEqns` runs the graph ops the equations became through the
one :class:`~nnscaler_jax.lower.replay.Lowering` of the in-stage plan, so a chunk runs what a
flat plan runs: the layouts and their priced relayout paths, partial sums, co-sharded blocks,
recompute groups, ``shard_map`` regions (manual over the stage's axes, inside the pipeline's
``shard_map`` over the stage and data axes).
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.extend import core as jcore

from nnscaler_jax.capture.jaxpr import INLINE, Sources
from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.graph import REMAT_KINDS, Graph, Op, Role
from nnscaler_jax.layout import Layout
from nnscaler_jax.lower.local import bind_eqn
from nnscaler_jax.lower.replay import Lowering
from nnscaler_jax.plan.layouts import op_layouts

__all__ = ["NO_CONSTRAINTS", "EqnEvaluator", "LoweredEqns"]


class EqnEvaluator(abc.ABC):
    """Runs lists of a traced program's equations on ``env`` (jaxpr variable -> value)."""

    @abc.abstractmethod
    def evaluate(self, eqns: Sequence[Any], env: dict) -> None:
        """Evaluate ``eqns`` into ``env``."""

    def call(self, sub: Any, ins: list[Any]) -> list[Any]:
        """Evaluate a (closed) jaxpr on ``ins``; its outputs."""
        closed = sub if isinstance(sub, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(sub, ())
        env = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(closed.jaxpr.invars, ins, strict=True))
        self.evaluate(closed.jaxpr.eqns, env)
        return [v.val if isinstance(v, jcore.Literal) else env[v]
                for v in closed.jaxpr.outvars]


class _Plain(EqnEvaluator):
    """The equations as they are: calls (``pjit``...) inlined, remat bodies under
    ``jax.checkpoint``."""

    def evaluate(self, eqns: Sequence[Any], env: dict) -> None:
        for e in eqns:
            ins = [v.val if isinstance(v, jcore.Literal) else env[v] for v in e.invars]
            for v, o in zip(e.outvars, self.bind(e, ins), strict=True):
                env[v] = o

    def bind(self, e: Any, ins: list[Any]) -> list[Any]:
        name = e.primitive.name
        sub = e.params.get("jaxpr") if name in INLINE else None
        if sub is not None:
            return self.call(sub, ins)
        if name in REMAT_KINDS:
            body = e.params["jaxpr"]
            fn: Callable = lambda *a: self.call(body, list(a))
            return jax.checkpoint(fn, prevent_cse=e.params.get("prevent_cse", True),
                                  policy=e.params.get("policy"))(*ins)
        with e.ctx.manager:
            return bind_eqn(e, ins)


#: Evaluates equations as they are (no constraints).
NO_CONSTRAINTS = _Plain()


@dataclass(eq=False)
class LoweredEqns(EqnEvaluator):
    """Equations run as the graph ops they became (``sources``), through ``lowering``.

    ``lowering``'s graph is the one built from the equations' program
    (:func:`~nnscaler_jax.capture.jaxpr.graph_with_sources`); an equation it has no ops for
    (made after the graph, e.g. a rewritten program's) is bound as it is. Every value's layout
    where it is made is known before any chunk runs, so a chunk reads a value another chunk
    made along the priced path from that layout."""

    lowering: Lowering
    sources: Sources
    _ops: dict[int, Op] = field(default_factory=dict, init=False)
    _home: dict[int, tuple[Graph, int]] = field(default_factory=dict, init=False)
    _members: dict[int, set[int]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        low = self.lowering
        levels = [low.graph]
        for g in levels:
            for i, op in enumerate(g.ops):
                self._ops[op.id] = op
                self._home[op.id] = (g, i)
                for b in op.boundary:
                    self._members.setdefault(b, set()).add(op.id)
                levels.extend(op.regions)
        for t in low.graph.inputs:  # where each value is made (the start of its relayouts)
            low.layouts.setdefault(t.id, Layout(low.input_layout(t).dims))
        for op in low.graph.walk():
            _, outs = op_layouts(op, low.plan_of(op))
            for t, lay in zip(op.outputs, outs, strict=True):
                low.layouts.setdefault(t.id, Layout(low.resolve(t, lay).dims))

    def evaluate(self, eqns: Sequence[Any], env: dict) -> None:
        run: list[Any] = []
        for e in eqns:
            if self.sources.ops.get(id(e)) is None:
                self._lowered(run, env)
                run = []
                if self.lowering.manual:
                    self._whole_inputs(e)
                NO_CONSTRAINTS.evaluate([e], env)
            else:
                run.append(e)
        self._lowered(run, env)

    def _whole_inputs(self, e: Any) -> None:
        """An equation bound as it is on each device's blocks reads only whole values (its
        params spell global shapes)."""
        for v in e.invars:
            t = None if isinstance(v, jcore.Literal) else self.sources.tensors.get(v)
            lay = None if t is None else self.lowering.layouts.get(t.id)
            if lay is not None and lay.split_axes:
                raise PlanError(
                    f"pipeline stage on each device's blocks: equation '{e.primitive}' has no "
                    f"op of the plan and reads {t} split as {lay}. Fix: run the stages one "
                    "program each (Constraints(pipeline_executor='per-stage'))")

    def _lowered(self, eqns: list[Any], env: dict) -> None:
        """Run the ops of ``eqns`` (in their graph's order) on ``env``."""
        if not eqns:
            return
        ids = {i for e in eqns for i in self.sources.ops[id(e)] if i in self._ops}
        ops = sorted((self._ops[i] for i in ids), key=lambda op: self._home[op.id][1])
        graphs = {id(self._home[op.id][0]): self._home[op.id][0] for op in ops}
        if len(graphs) > 1:
            raise PlanError("a pipeline chunk's equations span a loop body and its program")
        ops = [self._whole(op, ids) for op in ops]
        tensors = self.sources.tensors
        tenv: dict[Any, Any] = {}
        for v, x in env.items():
            t = tensors.get(v)
            if t is not None:
                tenv[t.id] = x
        (graph,) = graphs.values() or (self.lowering.graph,)
        self.lowering.run(ops, tenv, {b.id: b for b in graph.boundaries})
        for e in eqns:
            for v in e.outvars:
                t = tensors.get(v)
                if t is not None and t.id in tenv and not isinstance(v, jcore.DropVar):
                    env[v] = tenv[t.id]

    def _whole(self, op: Op, ids: set[int]) -> Op:
        """``op``, checked to run with the rest of its block: a parameter's cast another
        chunk re-makes (:func:`~nnscaler_jax.pipeline.chunks.cut_program`) runs outside it."""
        if not op.boundary or self._members[op.boundary[0]] <= ids:
            return op
        if op.primitive == "convert_element_type" and op.inputs[0].role is Role.VARIABLE:
            return dataclasses.replace(op, boundary=())
        raise PlanError(
            f"pipeline stages: a chunk cut at '{op.module_path}' splits a co-sharded or "
            f"recomputed block (op '{op.primitive}'). Fix: cut the stages at another module, "
            "or leave the block whole (its rule's module path)")
