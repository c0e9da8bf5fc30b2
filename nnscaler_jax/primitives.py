"""nnScaler's three primitives, op_trans / op_assign / op_order, on a plan draft.

A policy is a plain function ``policy(graph, mesh) -> Plan`` that receives a :class:`Draft` (a
graph plus the decisions made so far) and calls the primitives::

    def my_dp(graph, mesh):
        for op in graph.ops:
            dim = batch_dim(op)                   # an identifier of op.anno
            if dim:
                subs = op_trans(graph, op, dim, mesh.shape["data"])
                op_assign(graph, subs, "data")    # sub-op i on data coordinate i
        return graph.finish()

- ``op_trans(graph, op, algo, n)``: split ``op`` into ``n`` sub-ops along the annotated dim
  ``algo`` (an identifier; a ``+`` identifier yields partial sums), ``"value"`` (an op linear in
  its inputs takes partial sums and yields partial sums: a value-split chain), or
  ``"replicate"``.
  Sub-ops can be split again (2-D partitions).
- ``op_assign(graph, sub_op, devices)``: place a sub-op on mesh coordinates (``{"data": 1}``), or
  a list of sub-ops along a mesh axis (``"data"``: sub-op i on coordinate i). More sub-ops than
  devices along an axis (k per device) co-shard: each device runs its k chunks in turn.
- ``op_order(graph, a, b)``: ``a`` runs before ``b`` on their shared devices; on a pipeline
  schedule draft (``op_order(sched, sched.F(0, 1), sched.B(0, 0))``) it orders pipeline blocks.

Only placements an SPMD program can express are accepted (sub-op i of an n-way split on
coordinate i // k of an axis of size n / k); anything else is a ``PlanError`` saying so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.anno import DimKind, parse_anno
from nnscaler_jax.ir.graph import Graph, Op
from nnscaler_jax.plan.plan import VALUE, OpPlan, Plan, Unsplit, graph_fingerprint
from nnscaler_jax.rules.linear import VALUE_SPLIT_LINEAR

__all__ = ["Draft", "SubOp", "op_assign", "op_order", "op_trans"]


@dataclass(frozen=True, slots=True)
class SubOp:
    """One sub-operator: ``op`` restricted to chunk ``index`` of each split in ``splits``."""

    op: Op
    splits: tuple[tuple[str, int, int], ...]  # (identifier, n, index)

    def __str__(self) -> str:
        parts = ", ".join(f"{d}[{i}/{n}]" for d, n, i in self.splits)
        return f"{self.op.primitive}@{self.op.module_path or '<top>'}({parts})"


def _op_error(op: Op, what: str, fix: str, *, axis: str | None = None,
              kind: type[PlanError] | None = None) -> PlanError:
    """An error naming ``op`` (a ``ShardingError`` unless ``kind`` says otherwise)."""
    from nnscaler_jax.errors import ShardingError

    return (kind or ShardingError)(
        f"op {op.id} '{op.primitive}' at '{op.module_path or '<top>'}' with annotation "
        f"'{op.anno}' and input shapes {[t.shape for t in op.inputs]}: {what}. {fix}",
        op=op.primitive, module_path=op.module_path, axis=axis,
        shapes=tuple(t.shape for t in op.inputs),
    )


def _unsplittable(anno: Any, dim: str) -> str:
    """Why ``dim`` of ``anno`` cannot be split."""
    kinds = anno.kinds()
    if kinds.get(dim) is DimKind.FROZEN:
        return "it is frozen ('^')"
    return "it is not the first dim of its group" if dim in kinds else "it is not in the annotation"


@dataclass
class Draft:
    """A graph and the decisions of a policy in progress (what policies receive as ``graph``).

    Attributes of the graph (``ops``, ``walk``, ``inputs``...) are available directly.
    """

    graph: Graph
    mesh_axes: dict[str, int]
    policy: str = ""
    zero: int = 0
    constraints: Any = None  # the user's Constraints, for policies that search
    partitioning: Any = None  # {variable path: mesh axes per dim} from Flax metadata
    beat_s: float | None = None  # a search may give up once its plan cannot be this fast
    decisions: dict[int, OpPlan] = field(default_factory=dict)
    variables: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    order: list[tuple[int, int]] = field(default_factory=list)
    unsplit: list[Unsplit] = field(default_factory=list)
    _assigned: dict[int, dict[tuple, dict[str, int]]] = field(default_factory=dict)
    _splits: dict[int, list[tuple[str, int]]] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.graph, name)

    # ---- direct decisions (what the primitives compile to) ------------------------------------

    def decide(self, op: Op, split: Mapping[str, str] | Sequence[tuple[str, str]],
               *, chunks: tuple[str, int] | None = None, keep_partial: bool = False) -> None:
        """Record that ``op`` splits identifier ``split[axis]`` over each mesh ``axis``."""
        pairs = tuple(split.items()) if isinstance(split, Mapping) else tuple(split)
        anno = parse_anno(op.anno)
        names = anno.splittable()
        for axis, dim in pairs:
            if axis not in self.mesh_axes:
                raise _op_error(op, f"mesh axis '{axis}' is not in the mesh "
                                f"{self.mesh_axes}", "Use one of the mesh's axis names.",
                                axis=axis)
            if dim == VALUE:
                if op.primitive not in VALUE_SPLIT_LINEAR:
                    raise _op_error(op, "cannot value-split it: it is not linear in its inputs",
                                    f"Value-split only {sorted(VALUE_SPLIT_LINEAR)}.")
                continue
            if dim not in names:
                raise _op_error(op, f"cannot split dim '{dim}': {_unsplittable(anno, dim)}",
                                f"Splittable dims: {names or 'none (replicate it)'}.")
        dims = [d for _, d in pairs]
        if len(set(dims)) != len(dims):
            # Same dim over several axes: allowed (major-to-minor), but check divisibility.
            pass
        sizes = anno.bind([t.shape for t in op.inputs], [t.shape for t in op.outputs],
                          op=op.primitive, module_path=op.module_path)
        for d in set(dims) - {VALUE}:
            ways = math.prod(self.mesh_axes[a] for a, x in pairs if x == d)
            ways *= chunks[1] if chunks and chunks[0] == d else 1
            if sizes[d] % ways:
                raise _op_error(op, f"dim '{d}' of size {sizes[d]} is not divisible into "
                                f"{ways} parts", "Choose mesh axes whose sizes divide it, or "
                                "another dim.", axis=",".join(a for a, x in pairs if x == d))
        if chunks and chunks[0] not in names:
            raise _op_error(op, f"cannot co-shard along '{chunks[0]}'",
                            f"Splittable dims: {names}.")
        self.decisions[op.id] = OpPlan(op.id, op.primitive, op.module_path, pairs, chunks,
                                       keep_partial)

    def store_variable(self, name: str, spec: Sequence[Any]) -> None:
        """How the model variable ``name`` is stored (PartitionSpec entries)."""
        known = {t.name for t in self.graph.variables}
        if name not in known:
            raise PlanError(f"no model variable '{name}'; variables: {sorted(known)[:10]}...")
        self.variables[name] = tuple(spec)

    def note_unsplit(self, op: Op, dim: str, axis: str, size: int | None = None) -> None:
        """Record that the policy leaves ``dim`` of ``op`` unsplit over mesh ``axis`` because
        the axis does not divide it (``size``: the dim's size, or its per-shard size when other
        axes already split it; default its size). The plan lists it (``plan.unsplit``) and
        planning warns once per plan."""
        if size is None:
            size = op.dim_sizes()[dim]
        self.unsplit.append(Unsplit(op.id, op.primitive, op.module_path, dim, int(size), axis,
                                    self.mesh_axes[axis]))

    def finish(self) -> Plan:
        """The frozen plan (undecided ops follow their neighbours, see ``propagate``)."""
        from nnscaler_jax.plan.propagate import propagate

        decisions = dict(self.decisions)
        for op_id, assigned in self._assigned.items():
            decisions[op_id] = self._compile_assignment(op_id, assigned)
        decisions = propagate(self.graph, decisions, self.mesh_axes)
        decisions = _mark_partial_producers(self.graph, decisions)
        variables = dict(self.variables)
        variables.update(_consumer_storage(self.graph, decisions, variables))
        order = tuple(self.order)
        return Plan(
            mesh=tuple(self.mesh_axes.items()),
            fingerprint=graph_fingerprint(self.graph),
            ops=tuple(decisions[op.id] for op in self.graph.walk() if op.id in decisions),
            variables=tuple(sorted(variables.items())),
            zero=self.zero,
            order=order,
            policy=self.policy,
            unsplit=tuple(self.unsplit),
        )

    def _compile_assignment(self, op_id: int, assigned: dict[tuple, dict[str, int]]) -> OpPlan:
        op = self.graph.op(op_id)
        splits = self._splits.get(op_id, [])  # replicas only: no split level, replicated
        total = math.prod(n for _, n in splits)
        if len(assigned) != total:
            raise _op_error(op, f"{len(assigned)} of its {total} sub-ops are assigned",
                            "op_assign every sub-op returned by op_trans.")
        pairs: list[tuple[str, str]] = []
        chunks = None
        for level, (dim, n) in enumerate(splits):
            axes = {a for coords in assigned.values() for a in coords}
            axis = None
            for a in axes:
                if all(coords.get(a) is not None for coords in assigned.values()) \
                        and all(coords[a] == key[level] * self.mesh_axes[a] // n
                                for key, coords in assigned.items()) \
                        and n % self.mesh_axes[a] == 0 and a not in [x for x, _ in pairs]:
                    axis = a
                    break
            if axis is None:
                raise _op_error(op, f"the {n} sub-ops of its split along '{dim}' are not "
                                "placed along one mesh axis (sub-op i on coordinate "
                                "i // (n / axis size))",
                                "Use op_assign(graph, sub_ops, '<axis>').")
            pairs.append((axis, dim))
            k = n // self.mesh_axes[axis]
            if k > 1:
                chunks = (dim, k)
        self.decide(op, pairs, chunks=chunks)
        return self.decisions[op_id]


def op_trans(graph: Draft, op: Op | SubOp, algo: str, n: int) -> tuple[SubOp, ...]:
    """Split ``op`` into ``n`` sub-ops along annotated dim ``algo`` (or ``"replicate"``).

    Raises:
        PlanError: the dim is not in the annotation, is frozen, or ``n`` does not divide it.
    """
    _check_draft(graph)
    base = op.op if isinstance(op, SubOp) else op
    prefix = op.splits if isinstance(op, SubOp) else ()
    if algo == "replicate":
        return tuple(SubOp(base, prefix + (("replicate", n, i),)) for i in range(n))
    if algo == "value":
        if base.primitive not in VALUE_SPLIT_LINEAR:
            raise _op_error(base, "cannot value-split it: it is not linear in its inputs",
                            f"Value-split only {sorted(VALUE_SPLIT_LINEAR)}.")
        algo = VALUE
    anno = parse_anno(base.anno)
    if algo != VALUE and algo not in anno.splittable():
        raise _op_error(base, f"op_trans along '{algo}': {_unsplittable(anno, algo)}",
                        f"Splittable dims: {anno.splittable() or 'none'}; or 'replicate'.")
    sizes = anno.bind([t.shape for t in base.inputs], [t.shape for t in base.outputs],
                      op=base.primitive, module_path=base.module_path)
    sizes[VALUE] = n * math.prod(m for d, m, _ in prefix if d == VALUE)  # any n divides
    done = math.prod(m for d, m, _ in prefix if d == algo)
    if n < 1 or sizes[algo] % (n * done):
        raise _op_error(base, f"op_trans along '{algo}' into {n}: size {sizes[algo]} is not "
                        f"divisible by {n * done}", "Choose n dividing the dim's size.")
    splits = graph._splits.setdefault(base.id, [])
    level = len(prefix)
    if len(splits) == level:
        splits.append((algo, n))
    elif splits[level] != (algo, n):
        raise _op_error(base, "sub-ops of one op must be split the same way at each level",
                        "op_trans every sub-op with the same algo and n.")
    subs = tuple(SubOp(base, prefix + ((algo, n, i),)) for i in range(n))
    # Children inherit the placement of an already-assigned parent.
    assigned = graph._assigned.get(base.id, {})
    parent_key = tuple(idx for d, _, idx in prefix if d != "replicate")
    if parent_key in assigned and prefix:
        coords = assigned.pop(parent_key)
        for s in subs:
            assigned[parent_key + (s.splits[-1][2],)] = dict(coords)
    return subs


def op_assign(graph: Draft, sub_op: SubOp | Sequence[SubOp],
              devices: str | Mapping[str, int]) -> None:
    """Place sub-op(s) on devices: a mesh axis (for a list) or mesh coordinates (for one).

    Raises:
        PlanError: unknown axis, coordinates outside the mesh, a placement SPMD cannot express.
    """
    _check_draft(graph)
    subs = list(sub_op) if isinstance(sub_op, Sequence) else [sub_op]
    for i, s in enumerate(subs):
        if not isinstance(s, SubOp):
            raise PlanError(f"op_assign takes sub-ops from op_trans, got {type(s).__name__}")
        if isinstance(devices, str):
            if devices not in graph.mesh_axes:
                raise _op_error(s.op, f"mesh axis '{devices}' is not in the mesh "
                                f"{graph.mesh_axes}", "Use one of the mesh's axis names.",
                                axis=devices)
            n = s.splits[-1][1]
            coords = {devices: s.splits[-1][2] * graph.mesh_axes[devices] // n}
        else:
            coords = dict(devices)
        for a, c in coords.items():
            if a not in graph.mesh_axes or not 0 <= int(c) < graph.mesh_axes[a]:
                raise _op_error(s.op, f"devices {dict(coords)} are outside the mesh "
                                f"{graph.mesh_axes}",
                                "Give coordinates 0 <= c < size for mesh axes of the mesh.",
                                axis=str(a))
        key = tuple(idx for d, _, idx in s.splits if d != "replicate")
        prev = graph._assigned.setdefault(s.op.id, {}).setdefault(key, {})
        prev.update(coords)


def op_order(graph: Draft | Any, a: Op | SubOp | Any, b: Op | SubOp | Any) -> None:
    """``a`` runs before ``b`` on their shared devices.

    ``graph`` may also be a pipeline schedule draft (any object with an ``order(a, b)`` method,
    e.g. :class:`nnscaler_jax.pipeline.order.ScheduleDraft`) and ``a`` / ``b`` its blocks
    (``sched.F(stage, m)``, ``sched.B(stage, m)``): the order then goes into the step table
    each device runs.

    Raises:
        PlanError: ``b`` produces (directly or not) something ``a`` needs.
    """
    if not isinstance(graph, Draft) and callable(getattr(graph, "order", None)):
        graph.order(a, b)  # a schedule draft: blocks ordered per device
        return
    _check_draft(graph)
    oa = a.op if isinstance(a, SubOp) else a
    ob = b.op if isinstance(b, SubOp) else b
    if oa.id == ob.id:
        return
    g = graph.graph.to_networkx()
    import networkx as nx

    if oa.id in g and ob.id in g and nx.has_path(g, ob.id, oa.id):
        raise _op_error(oa, f"op_order puts it before op {ob.id} '{ob.primitive}' at "
                        f"'{ob.module_path}', but it depends on that op's output",
                        "Order ops along their data dependencies (producer first).",
                        kind=PlanError)
    graph.order.append((oa.id, ob.id))


def _check_draft(graph: Any) -> None:
    if not isinstance(graph, Draft):
        raise PlanError("primitives take the draft a policy receives (policy(graph, mesh)); "
                        "make one with nnscaler_jax.primitives.Draft(graph, mesh_axes)")


def _consumer_storage(graph: Graph, decisions: dict[int, OpPlan],
                      fixed: dict[str, tuple[Any, ...]]) -> dict[str, tuple[Any, ...]]:
    """Store each variable the way its first consumer reads it (Megatron keeps weight shards
    where they are used; data-parallel weights stay replicated)."""
    from nnscaler_jax.plan.layouts import plan_layouts, sole_read_variables

    sole = sole_read_variables(graph)
    want = {t.id: t for t in graph.variables if t.name not in fixed}
    out: dict[str, tuple[Any, ...]] = {}
    for op in graph.walk():
        if not want:
            break
        if not any(t.id in want for t in op.inputs):
            continue
        ins, _ = plan_layouts(op, decisions, sole)
        for t, lay in zip(op.inputs, ins, strict=True):
            if t.id in want:
                spec = tuple(lay.to_pspec())
                out[t.name] = spec + (None,) * (t.ndim - len(spec))
                del want[t.id]
    return out


def _mark_partial_producers(graph: Graph, decisions: dict[int, OpPlan]) -> dict[int, OpPlan]:
    """Producers whose partial sums feed value-split ops keep them partial (one chain)."""
    from dataclasses import replace

    from nnscaler_jax.plan.layouts import op_layouts

    out = dict(decisions)
    for op in graph.ops:
        p = decisions.get(op.id)
        value_axes = {a for a, d in (p.split if p else ()) if d == VALUE}
        for t in op.inputs if value_axes else ():
            prod = graph.producer.get(t.id)
            if prod is None or out[prod.id].keep_partial:
                continue
            _, outs = op_layouts(prod, out[prod.id])
            lay = outs[[x.id for x in prod.outputs].index(t.id)]
            if set(lay.partial) & value_axes:
                out[prod.id] = replace(out[prod.id], keep_partial=True)
    return out
