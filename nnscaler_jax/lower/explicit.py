"""Result types on an Explicit mesh: what the single-device program would give the user's code.

With Explicit axis types a sharding is part of an array's type, and the user's own code (an optax
loss under ``jax.jit``) must type-check against the results. The plan's internal layouts are no
such promise: the search may leave logits split over ``(data, model)`` along the vocabulary, and
``softmax_cross_entropy_with_integer_labels(logits, labels)`` with ``labels`` typed ``P('data')``
then fails. So the module's results (not its updated state) get the types the plain module would
have under the user's input types, with the model's variables replicated:

1. abstract evaluation of the plain program on those types (exact, when jax can type it);
2. otherwise (jax cannot type the plain program either, e.g. an embedding lookup with
   data-split token ids) the batch rule: a result whose leading dim is the inputs' batch size
   is split like the inputs' leading dim, every other dim is replicated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnscaler_jax.ir.graph import Graph, Role

__all__ = ["result_specs"]


def _typed_spec(x: Any) -> PartitionSpec | None:
    try:
        spec = jax.typeof(x).sharding.spec
    except (TypeError, AttributeError):
        return None
    return spec if isinstance(spec, PartitionSpec) else None


def _user_types(graph: Graph, flat_inputs: Sequence[Any], mesh: Mesh) -> list[Any]:
    """Abstract inputs typed as the user's: example inputs keep their Explicit types, variables
    and rng keys are replicated."""
    out = []
    for t, x in zip(graph.inputs, flat_inputs, strict=True):
        spec = _typed_spec(x) if t.role is Role.INPUT else None
        sharding = NamedSharding(mesh, spec if spec is not None else PartitionSpec())
        out.append(jax.ShapeDtypeStruct(jax.numpy.shape(x), x.dtype,
                                        sharding=sharding))
    return out


def _batch_rule(graph: Graph, flat_inputs: Sequence[Any], shapes: Sequence[tuple]
                ) -> list[PartitionSpec]:
    lead: tuple[int, Any] | None = None
    for t, x in zip(graph.inputs, flat_inputs, strict=True):
        spec = _typed_spec(x) if t.role is Role.INPUT else None
        if spec and len(spec) and spec[0] is not None and t.ndim:
            lead = (t.shape[0], spec[0])
            break
    if lead is None:
        return [PartitionSpec() for _ in shapes]
    return [PartitionSpec(lead[1]) if len(s) and s[0] == lead[0] else PartitionSpec()
            for s in shapes]


def result_specs(fn: Callable[..., Any], graph: Graph, flat_inputs: Sequence[Any], mesh: Mesh,
                 n_results: int) -> list[PartitionSpec | None]:
    """Specs for the graph outputs on an Explicit ``mesh``: the first ``n_results`` (the
    module's results) typed as the plain ``fn`` would type them; None for the rest (updated
    state: it keeps the plan's layout, so the next call finds it where the plan stores it)."""
    shapes = [t.shape for t in graph.outputs[:n_results]]
    try:
        with jax.set_mesh(mesh):
            outs = jax.eval_shape(fn, *_user_types(graph, flat_inputs, mesh))
        specs = [o.sharding.spec for o in outs[:n_results]]
    except Exception:  # noqa: BLE001 - jax cannot type the plain program: the batch rule
        specs = _batch_rule(graph, flat_inputs, shapes)
    return specs + [None] * (len(graph.outputs) - n_results)
