"""A plan's sharding constraints on raw jaxpr equations, and the evaluator that applies them.

:class:`~nnscaler_jax.lower.replay.Lowering` replays a whole :class:`~nnscaler_jax.ir.graph.Graph`
op by op. The pipeline runtime instead runs pieces of a program cut by module path (a prefix,
one layer template, a suffix: lists of equations, :mod:`nnscaler_jax.pipeline.split`), so it
needs the same constraints keyed by equation. :class:`EqnConstraints` derives them from a
``Lowering`` (the same layouts: ``op_layouts`` with partial sums resolved to what the first
consumer needs) and evaluates equation lists under them; :data:`NO_CONSTRAINTS` evaluates
without any (data-parallel stages). An input whose producer is known reaches its layout along
the priced path, one constraint per step (:func:`nnscaler_jax.lower.relayout.relayout_steps`),
as in the replay.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import PartitionSpec as P

from nnscaler_jax.capture.jaxpr import BOUNDARY, INLINE
from nnscaler_jax.ir.graph import REMAT_KINDS, Graph, Op, Role, Tensor
from nnscaler_jax.layout import Layout
from nnscaler_jax.lower.local import bind_eqn
from nnscaler_jax.lower.relayout import relayout_steps
from nnscaler_jax.lower.replay import Lowering
from nnscaler_jax.plan.layouts import op_layouts

__all__ = ["NO_CONSTRAINTS", "EqnConstraints"]

Specs = tuple[P | None, ...]


@dataclass(frozen=True)
class EqnConstraints:
    """Sharding constraints keyed by equation.

    Attributes:
        op_specs: ``id(eqn) -> (input specs, output specs)`` (None: leave unconstrained).
        boundary_specs: ``id(eqn) -> output specs`` of custom-derivative calls bound whole.
        steps: ``id(eqn) -> per input, the specs it passes through before its input spec``
            (the relayout path from its producer's layout; empty: none).
    """

    op_specs: dict[int, tuple[Specs, Specs]] = field(default_factory=dict)
    boundary_specs: dict[int, Specs] = field(default_factory=dict)
    steps: dict[int, tuple[Specs, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, lowering: Lowering) -> EqnConstraints:
        """The constraints ``lowering`` applies, keyed by its graph's equations."""
        graph = lowering.graph
        producer = graph.writers

        def out_specs(op: Op) -> list[P | None]:
            _, outs = op_layouts(op, lowering.plan_of(op))
            return [_spec(t, lowering.resolve(t, lay))
                    for t, lay in zip(op.outputs, outs, strict=True)]

        made = {t.id: lowering.input_layout(t) for t in graph.inputs}
        for op in graph.walk():
            _, outs = op_layouts(op, lowering.plan_of(op))
            made.update((t.id, lowering.resolve(t, lay))
                        for t, lay in zip(op.outputs, outs, strict=True))
        op_specs, steps = {}, {}
        for op in graph.walk():
            if op.eqn is not None:
                ins, _ = op_layouts(op, lowering.plan_of(op))
                op_specs[id(op.eqn)] = (
                    tuple(_spec(t, lay) for t, lay in zip(op.inputs, ins, strict=True)),
                    tuple(out_specs(op)))
                path = tuple(_steps(lowering, t, made.get(t.id), lay)
                             for t, lay in zip(op.inputs, ins, strict=True))
                n = max((len(x) for x in path), default=0)
                if n:  # shorter paths wait (None: no constraint) and end with the others
                    steps[id(op.eqn)] = tuple((None,) * (n - len(x)) + x for x in path)
        boundary_specs = {}
        for g in _graphs(graph):
            for b in g.boundaries:
                boundary_specs[id(b.eqn)] = tuple(
                    out_specs(producer[t.id][0])[producer[t.id][1]] if t.id in producer else None
                    for t in b.outputs)
        return cls(op_specs, boundary_specs, steps)

    def evaluate(self, eqns: Any, env: dict) -> None:
        """Evaluate ``eqns`` into ``env`` (jaxpr var -> value) under the constraints: calls
        (``pjit``...) are inlined, remat bodies evaluated under ``jax.checkpoint``."""
        def read(v):
            return v.val if isinstance(v, jcore.Literal) else env[v]

        for e in eqns:
            name = e.primitive.name
            ins = [read(v) for v in e.invars]
            sub = e.params.get("jaxpr") if name in INLINE else None
            if sub is not None:
                outs = self.call(sub, ins)
            elif name in REMAT_KINDS:
                body = e.params["jaxpr"]
                fn: Callable = lambda *a, body=body: self.call(body, list(a))
                outs = jax.checkpoint(fn, prevent_cse=e.params.get("prevent_cse", True),
                                      policy=e.params.get("policy"))(*ins)
            else:
                in_specs, out_specs = self.op_specs.get(id(e), (None, None))
                for specs in zip(*self.steps.get(id(e), ())):  # the relayouts' steps, in order
                    ins = _constrain(ins, specs)
                ins = _constrain(ins, in_specs)  # outside the equation's context (its mesh)
                with e.ctx.manager:
                    outs = bind_eqn(e, ins)
                if name in BOUNDARY:
                    out_specs = self.boundary_specs.get(id(e))
                outs = _constrain(outs, out_specs)
            for v, o in zip(e.outvars, outs, strict=True):
                env[v] = o

    def call(self, sub: Any, ins: list[Any]) -> list[Any]:
        """Evaluate a (closed) jaxpr on ``ins``; its outputs."""
        closed = sub if isinstance(sub, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(sub, ())
        env = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(closed.jaxpr.invars, ins, strict=True))
        self.evaluate(closed.jaxpr.eqns, env)
        return [v.val if isinstance(v, jcore.Literal) else env[v]
                for v in closed.jaxpr.outvars]


#: Evaluates equations as they are (no constraints).
NO_CONSTRAINTS = EqnConstraints()


def _graphs(graph: Graph) -> list[Graph]:
    out = [graph]
    for g in out:
        for op in g.ops:
            out.extend(op.regions)
    return out


def _spec(t: Tensor, lay: Layout) -> P | None:
    if t.role is Role.CONST or t.ndim == 0:
        return None
    try:
        np.dtype(t.dtype)
    except TypeError:
        return None
    return lay.to_pspec(allow_partial=True)


def _steps(lowering: Lowering, t: Tensor, src: Layout | None, lay: Layout) -> Specs:
    """The specs ``t`` passes through from ``src`` before it is read as ``lay`` (the last
    step, ``lay`` itself, is the input spec)."""
    if src is None or _spec(t, lay) is None:
        return ()
    path = relayout_steps(src, lay, t.shape, np.dtype(t.dtype).itemsize, lowering.mesh_spec)
    return tuple(step.to_pspec() for step in path[:-1])


def _constrain(xs: list[Any], specs: Specs | None) -> list[Any]:
    if specs is None:
        return xs
    return [x if s is None else jax.lax.with_sharding_constraint(x, s)
            for x, s in zip(xs, specs, strict=True)]
