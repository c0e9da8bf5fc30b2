"""Jaxpr walking helpers for the rule tests (a uniquely named module, imported by the tests)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from jax.extend import core as jcore

from nnscaler_jax.rules import annotate

# Call / control-flow primitives: handled by the capture layer, not by per-primitive rules.
CONTROL_FLOW = frozenset({
    "pjit", "jit", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "checkpoint",
    "remat", "remat2", "scan", "while", "cond", "closed_call", "core_call", "shard_map",
})


def sub_jaxprs(eqn: Any) -> Iterator[jcore.Jaxpr]:
    """The sub-jaxprs held in an equation's params."""
    for v in eqn.params.values():
        for s in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(s, jcore.ClosedJaxpr):
                yield s.jaxpr
            elif isinstance(s, jcore.Jaxpr):
                yield s


def walk(jaxpr: jcore.Jaxpr) -> Iterator[Any]:
    """Every equation of ``jaxpr`` and of its sub-jaxprs, depth first."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in sub_jaxprs(eqn):
            yield from walk(sub)


def eqn_anno(eqn: Any):
    """The annotation of one equation (None when its primitive has no rule)."""
    return annotate(eqn.primitive.name, eqn.params, [v.aval for v in eqn.invars],
                    [v.aval for v in eqn.outvars])
