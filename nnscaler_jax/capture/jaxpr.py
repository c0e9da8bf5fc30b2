"""ClosedJaxpr -> annotated Graph.

Calls (``jit``/``pjit``, ``closed_call``) are inlined; ``checkpoint`` (remat) and custom derivative
calls are inlined for analysis while their boundary is remembered (``Op.boundary``), so lowering
can rebind them whole; ``scan``, ``while`` and ``cond`` stay ops whose bodies are graphs, with an
annotation composed from the body (:func:`nnscaler_jax.ir.dims.compose_anno`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jax.extend import core as jcore

from nnscaler_jax.ir.dims import compose_anno, dim_classes
from nnscaler_jax.ir.graph import REMAT_KINDS, Boundary, Graph, Op, Role, Tensor
from nnscaler_jax.rules import annotate as rules_annotate

log = logging.getLogger(__name__)

__all__ = ["InputInfo", "Sources", "graph_from_jaxpr", "graph_with_sources"]

INLINE = {"jit", "pjit", "closed_call", "core_call"}
BOUNDARY = REMAT_KINDS | {"custom_jvp_call", "custom_vjp_call",
            "custom_vjp_call_jaxpr"}
REGIONS = {"scan", "while", "cond"}


@dataclass(frozen=True)
class InputInfo:
    """Role, name and collection of one flattened graph input."""

    role: Role
    name: str = ""
    collection: str | None = None


def _dtype_name(aval: Any) -> str:
    try:
        return np.dtype(aval.dtype).name
    except TypeError:
        return str(aval.dtype)


def _sub_jaxpr(params: dict, *keys: str) -> jcore.ClosedJaxpr | jcore.Jaxpr | None:
    for k in keys:
        if k in params and params[k] is not None:
            return params[k]
    return None


def _closed(j: Any) -> jcore.ClosedJaxpr:
    return j if isinstance(j, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(j, ())


@dataclass(frozen=True)
class Sources:
    """Where a graph came from in its jaxpr: what runs a cut of the jaxpr's equations (the
    pipeline's chunks) as a range of the graph's ops.

    Attributes:
        tensors: jaxpr variable -> the tensor it is (the program's and its bodies' variables;
            a sub-jaxpr inlined at several calls keeps its first).
        ops: ``id(eqn)`` -> the ids of the ops the equation became (a call or a remat
            boundary: every op inside it; a ``scan``: the one op, its body's equations have
            their own entries).
    """

    tensors: dict[Any, Tensor] = field(default_factory=dict)
    ops: dict[int, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class _Builder:
    annotate: Callable[[str, dict, list, list], str | None]
    root: str
    ids: itertools.count = field(default_factory=itertools.count)
    missing: dict[str, set[str]] = field(default_factory=dict)
    sources: Sources = field(default_factory=Sources)

    def bind(self, env: dict, v: Any, t: Tensor) -> None:
        env[v] = t
        self.sources.tensors.setdefault(v, t)

    def tensor(self, aval: Any, role: Role = Role.VALUE, name: str = "", collection=None,
               value=None) -> Tensor:
        shape = tuple(int(d) for d in getattr(aval, "shape", ()))
        return Tensor(next(self.ids), shape, _dtype_name(aval), role, name, collection, value)

    def module_path(self, stack: str) -> str:
        parts = [p for p in stack.split("/") if p]
        # Transform markers ("jvp(...)") and einsum specs ("bqhd,bkhd->bhqk") are not module
        # names; a linen method scope "wte.attend" belongs to module "wte".
        parts = [p.split(".")[0] for p in parts if not any(c in p for c in "(,>")]
        if parts and self.root and parts[0] == self.root:
            parts = parts[1:]
        out: list[str] = []
        for p in parts:
            if not out or out[-1] != p:  # "attn/attn._split_heads" -> "attn"
                out.append(p)
        return "/".join(out)

    def build(self, jaxpr: jcore.Jaxpr, consts: Sequence[Any], in_tensors: Sequence[Tensor],
              stack: str = "") -> Graph:
        env: dict[Any, Tensor] = {}
        const_tensors = []
        for v, c in zip(jaxpr.constvars, consts, strict=True):
            t = self.tensor(v.aval, Role.CONST, value=c)
            self.bind(env, v, t)
            const_tensors.append(t)
        for v, t in zip(jaxpr.invars, in_tensors, strict=True):
            self.bind(env, v, t)
        ops: list[Op] = []
        boundaries: list[Boundary] = []
        self._eqns(jaxpr.eqns, env, ops, boundaries, stack, ())
        outs = tuple(self.read(env, v) for v in jaxpr.outvars)
        return Graph(tuple(ops), tuple(in_tensors), outs, tuple(boundaries), tuple(const_tensors))

    def read(self, env: dict, v: Any) -> Tensor:
        if isinstance(v, jcore.Literal):
            return self.tensor(v.aval, Role.CONST, value=v.val)
        return env[v]

    def _eqns(self, eqns, env, ops, boundaries, stack, boundary) -> None:
        for eqn in eqns:
            first = len(ops)
            self._eqn(eqn, env, ops, boundaries, stack, boundary)
            self.sources.ops.setdefault(id(eqn), tuple(op.id for op in ops[first:]))

    def _eqn(self, eqn, env, ops, boundaries, stack, boundary) -> None:
        name = eqn.primitive.name
        here = "/".join(p for p in (stack, str(eqn.source_info.name_stack)) if p)
        ins = [self.read(env, v) for v in eqn.invars]
        if name in INLINE or name in BOUNDARY:
            sub = _sub_jaxpr(eqn.params, "jaxpr", "call_jaxpr", "fun_jaxpr")
            if sub is not None:
                closed = _closed(sub)
                inner_env: dict[Any, Tensor] = {}
                for v, c in zip(closed.jaxpr.constvars, closed.consts, strict=True):
                    inner_env[v] = self.tensor(v.aval, Role.CONST, value=c)
                for v, t in zip(closed.jaxpr.invars, ins, strict=True):
                    inner_env[v] = t
                inner_boundary = boundary
                if name in BOUNDARY:
                    bid = next(self.ids)
                    inner_boundary = boundary + (bid,)
                self._eqns(closed.jaxpr.eqns, inner_env, ops, boundaries, here,
                           inner_boundary)
                outs = [self.read(inner_env, v) for v in closed.jaxpr.outvars]
                for v, t in zip(eqn.outvars, outs, strict=True):
                    self.bind(env, v, t)
                if name in BOUNDARY:
                    boundaries.append(Boundary(bid, name, tuple(ins), tuple(outs), eqn))
                return
        outs = [self.tensor(v.aval) for v in eqn.outvars]
        for v, t in zip(eqn.outvars, outs, strict=True):
            self.bind(env, v, t)
        regions: tuple[Graph, ...] = ()
        if name in REGIONS:
            regions = self._regions(eqn, here)
            anno, annotated = _region_anno(eqn, regions, ins, outs)
        else:
            anno = self.annotate(name, eqn.params, [v.aval for v in eqn.invars],
                                 [v.aval for v in eqn.outvars])
            annotated = anno is not None
            if anno is None:
                anno = ", ".join("?" for _ in ins) + " -> " + ", ".join("?" for _ in outs)
                self.missing.setdefault(name, set()).add(self.module_path(here))
        path = self.module_path(here)
        if regions and not path:  # a region belongs to the module all its body ops share
            body_paths = [op.module_path for g in regions for op in g.walk()]
            path = _common_prefix(body_paths)
        ops.append(Op(next(self.ids), name, tuple(ins), tuple(outs), str(anno), annotated,
                      path, boundary, regions, eqn))

    def _regions(self, eqn, stack: str) -> tuple[Graph, ...]:
        p = eqn.params
        if eqn.primitive.name == "scan":
            jaxprs = [p["jaxpr"]]
        elif eqn.primitive.name == "while":
            jaxprs = [p["cond_jaxpr"], p["body_jaxpr"]]
        else:
            jaxprs = list(p["branches"])
        graphs = []
        for j in jaxprs:
            closed = _closed(j)
            ins = [self.tensor(v.aval) for v in closed.jaxpr.invars]
            graphs.append(self.build(closed.jaxpr, closed.consts, ins, stack))
        return tuple(graphs)


def _common_prefix(paths: list[str]) -> str:
    split = [p.split("/") for p in paths if p]
    if not split or len(split) != len(paths):
        return ""
    out = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        out.append(parts[0])
    return "/".join(out)


def _region_anno(eqn, regions: tuple[Graph, ...], ins, outs) -> tuple[str, bool]:
    """Compose a control-flow op's annotation from its body (see ``compose_anno``)."""
    name, p = eqn.primitive.name, eqn.params
    ops = [op for g in regions for op in g.walk()]
    unions = []
    if name == "scan":
        (body,) = regions
        nc, ncarry = p["num_consts"], p["num_carry"]
        carry_in = body.inputs[nc:nc + ncarry]
        for a, b in zip(carry_in, body.outputs[:ncarry], strict=True):
            unions += [((a.id, i), (b.id, i)) for i in range(a.ndim)]
        in_keys = [tuple((t.id, i) for i in range(t.ndim)) for t in body.inputs[:nc + ncarry]]
        in_keys += [(None,) + tuple((t.id, i) for i in range(t.ndim))
                    for t in body.inputs[nc + ncarry:]]
        out_keys = [tuple((t.id, i) for i in range(t.ndim)) for t in body.outputs[:ncarry]]
        out_keys += [(None,) + tuple((t.id, i) for i in range(t.ndim))
                     for t in body.outputs[ncarry:]]
    elif name == "while":
        cond, body = regions
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        carry_b = body.inputs[bn:]
        for a, b in zip(carry_b, body.outputs, strict=True):
            unions += [((a.id, i), (b.id, i)) for i in range(a.ndim)]
        for a, b in zip(cond.inputs[cn:], carry_b, strict=True):
            unions += [((a.id, i), (b.id, i)) for i in range(a.ndim)]
        keys = lambda ts: [tuple((t.id, i) for i in range(t.ndim)) for t in ts]
        in_keys = keys(cond.inputs[:cn]) + keys(body.inputs[:bn]) + keys(carry_b)
        out_keys = keys(body.outputs)
    else:  # cond: operand 0 is the branch index
        first = regions[0]
        for other in regions[1:]:
            for a, b in zip(first.inputs, other.inputs, strict=True):
                unions += [((a.id, i), (b.id, i)) for i in range(a.ndim)]
            for a, b in zip(first.outputs, other.outputs, strict=True):
                unions += [((a.id, i), (b.id, i)) for i in range(a.ndim)]
        in_keys = [None] + [tuple((t.id, i) for i in range(t.ndim)) for t in first.inputs]
        out_keys = [tuple((t.id, i) for i in range(t.ndim)) for t in first.outputs]
    # Body outputs that are body inputs directly, or constants: tie nothing more.
    # A scan's split sets only the layouts at its boundary (its body ops are planned, or
    # propagated, op by op; GSPMD reduces what a body op leaves partial), so a carried dim that
    # some body op contracts stays splittable there: the carried activation may cross layer
    # boundaries split (as the unrolled model's layer outputs may).
    classes = dim_classes(ops, unions, reduce_frozen=name != "scan")
    if len(in_keys) != len(ins) or len(out_keys) != len(outs):
        return (", ".join("?" for _ in ins) + " -> " + ", ".join("?" for _ in outs)), False
    # Extended dtypes (rng keys) and scalars stay as they are; an axis key absent from the body
    # is simply a fresh identifier.
    return compose_anno(classes, in_keys, out_keys), True


def graph_from_jaxpr(
    closed: jcore.ClosedJaxpr,
    inputs: Sequence[InputInfo],
    *,
    root: str = "",
    annotate: Callable[[str, dict, list, list], Any] | None = None,
) -> tuple[Graph, dict[str, set[str]]]:
    """Build the annotated graph of a closed jaxpr.

    Args:
        closed: the program.
        inputs: one ``InputInfo`` per flattened input.
        root: the root module's name in name stacks (stripped from module paths).
        annotate: ``annotate(primitive, params, in_avals, out_avals) -> Anno | str | None``.

    Returns:
        The graph and, per primitive without a rule, the module paths where it appears.
    """
    graph, missing, _ = graph_with_sources(closed, inputs, root=root, annotate=annotate)
    return graph, missing


def graph_with_sources(
    closed: jcore.ClosedJaxpr,
    inputs: Sequence[InputInfo],
    *,
    root: str = "",
    annotate: Callable[[str, dict, list, list], Any] | None = None,
) -> tuple[Graph, dict[str, set[str]], Sources]:
    """:func:`graph_from_jaxpr`, and where each of the graph's tensors and ops came from."""
    b = _Builder(annotate or rules_annotate, root)
    in_tensors = [b.tensor(v.aval, info.role, info.name, info.collection)
                  for v, info in zip(closed.jaxpr.invars, inputs, strict=True)]
    graph = b.build(closed.jaxpr, closed.consts, in_tensors)
    return graph, b.missing, b.sources
