"""``Plan``: the frozen result of planning, printable and JSON round-trippable."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from nnscaler_jax.capture.precision import precision_name
from nnscaler_jax.errors import PlanFormatError, fmt_bytes
from nnscaler_jax.ir.graph import Graph
from nnscaler_jax.ir.remat import SELECTIVE, is_selective
from nnscaler_jax.plan import view as _view

__all__ = ["VALUE", "OpPlan", "PipelineSettings", "Plan", "PlanCost", "Unsplit",
           "graph_fingerprint", "unsplit_summary"]

FORMAT = "nnscaler_jax.plan/1"
FINGERPRINT = "s1-"  # structure fingerprints (no sizes); older plans hashed shapes, no prefix
VALUE = "+"  # pseudo-identifier: value-split (inputs and outputs stay partial sums)


@dataclass(frozen=True, slots=True)
class OpPlan:
    """How one op is partitioned.

    Attributes:
        op: the op id in the graph.
        primitive / module_path: for people reading the plan (checked against the graph).
        split: ``(mesh axis, identifier)`` pairs: the op's annotated dim split over that axis
            (a ``+`` identifier makes the outputs partial sums on that axis; the pseudo-identifier
            ``VALUE`` = ``"+"`` value-splits an op linear in its inputs: partial sums in, partial
            sums out).
        chunks: co-sharding: ``(identifier, k)``: each device runs its part as k sequential
            chunks along that dim, recomputed in the backward pass (op_trans to k x devices
            sub-ops, op_assign k per device, op_order them).
        keep_partial: outputs that are partial sums stay partial sums into the consumers
            (a value-split chain, lowered in a ``shard_map`` region) instead of being reduced.
    """

    op: int
    primitive: str
    module_path: str
    split: tuple[tuple[str, str], ...] = ()
    chunks: tuple[str, int] | None = None
    keep_partial: bool = False

    def axis_dim(self, axis: str) -> str | None:
        return dict(self.split).get(axis)


@dataclass(frozen=True, slots=True)
class PlanCost:
    """Estimates for one training step (see :mod:`nnscaler_jax.cost`)."""

    step_time_s: float
    memory_bytes_per_device: int
    comm_bytes: int
    compute_time_s: float = 0.0
    comm_time_s: float = 0.0
    comm_kinds: tuple[tuple[str, int], ...] = ()
    """``comm_bytes`` by collective kind (``(kind, bytes)``, as XLA's HLO names them:
    ``all_gather``, ``all_reduce``, ``reduce_scatter``, ``all_to_all``, ``ppermute``); empty
    where the pricing does not break it down (a pipeline's stage tables)."""
    largest_gather_bytes: int = 0
    """The largest all-gather result a device receives (bytes): XLA:GPU's rematerialization
    counts it twice where it lands (:func:`~nnscaler_jax.mesh.gpu.slop_factor`); 0 where not
    priced."""
    memory_kinds: tuple[tuple[str, int], ...] = ()
    """A pipelined plan's memory per device by kind (``(kind, bytes)``: ``params``, ``grads``,
    ``optimizer``, ``activations``, each on the stage that holds the most of it, and ``peak``,
    ``memory_bytes_per_device``: :attr:`~nnscaler_jax.pipeline.pricing.RuntimeChoice.
    memory_kinds`); empty for a flat plan
    (:meth:`~nnscaler_jax.cost.model.CostModel.memory_breakdown` walks it)."""


def _cost_dict(cost: PlanCost) -> dict[str, Any]:
    """A cost as its plan's JSON holds it (``memory_kinds`` only where priced: a pipeline's)."""
    d = dataclasses.asdict(cost)
    if not d["memory_kinds"]:
        del d["memory_kinds"]
    return d


@dataclass(frozen=True, slots=True)
class Unsplit:
    """A dim a policy wanted to split over a mesh axis but left replicated there, because the
    axis's size does not divide it (a batch of 3 on a data axis of 2).

    Attributes:
        op / primitive / module_path: the op.
        dim: the annotation identifier.
        size: the dim's size (per shard, when earlier axes already split it).
        axis / axis_size: the mesh axis and its size.
    """

    op: int
    primitive: str
    module_path: str
    dim: str
    size: int
    axis: str
    axis_size: int

    def __str__(self) -> str:
        return (f"op {self.op} {self.primitive} at '{self.module_path or '<top>'}', dim "
                f"'{self.dim}' of size {self.size} over '{self.axis}' ({self.axis_size})")


def unsplit_summary(notes: tuple[Unsplit, ...], limit: int = 6) -> list[str]:
    """One line per (size, mesh axis) group of ``notes``: the op count, the first module
    paths and the first op in full; at most ``limit`` lines and a count of the rest.

    >>> n = [Unsplit(3, "dot_general", "fc1", "m0", 3, "data", 2),
    ...      Unsplit(5, "add", "fc1", "d0", 3, "data", 2)]
    >>> unsplit_summary(tuple(n))
    ["size 3 over 'data' (2): 2 ops in fc1 (e.g. op 3 dot_general at 'fc1', dim 'm0')"]
    """
    groups: dict[tuple[int, str, int], list[Unsplit]] = {}
    for u in notes:
        groups.setdefault((u.size, u.axis, u.axis_size), []).append(u)
    lines = []
    for (size, axis, n), us in list(groups.items())[:limit]:
        paths = list(dict.fromkeys(u.module_path or "<top>" for u in us))
        more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
        first = us[0]
        lines.append(f"size {size} over '{axis}' ({n}): {len(us)} op{'s' * (len(us) > 1)} in "
                     f"{', '.join(paths[:limit])}{more} (e.g. op {first.op} {first.primitive} "
                     f"at '{first.module_path or '<top>'}', dim '{first.dim}')")
    if len(groups) > limit:
        lines.append(f"... and {len(groups) - limit} more (size, axis) groups")
    return lines


@dataclass(frozen=True, slots=True)
class PipelineSettings:
    """How a plan pipelines: stages along the mesh's ``stage``/``pipe`` axis, each running the
    plan's SPMD layouts on its sub-mesh (see :mod:`nnscaler_jax.pipeline`).

    Attributes:
        stages: pipeline stages (the stage axis's size).
        microbatches / schedule / virtual: the pipeline schedule (``'gpipe'``, ``'1f1b'``,
            ``'interleaved'`` with ``virtual`` model chunks per stage, ``'interlaced'``,
            ``'nf1b'``, or the name of one written with ``op_order``; see
            :mod:`nnscaler_jax.pipeline.schedule`).
        stage_of: ``(layer module path, stage)`` pairs (op_assign of layers to stages).
        report: why these settings (``pipeline_stages="auto"``: the stage DP's predicted step
            time and memory per candidate schedule / micro-batch count), or empty.
        steps: a schedule written with ``op_order``: its per-stage block orders (``(kind, m, v)``
            or ``(kind, m, v, it)`` per block, :meth:`nnscaler_jax.pipeline.steps.Schedule.
            to_lists`), so a saved plan keeps it; empty for a built-in schedule.
        recompute: what a chunk's backward keeps: ``'chunk'`` (it recomputes the chunk's
            forward from its saved input, keeping all of the chunk's activations) or
            ``'layer'`` (each layer inside the chunk also recomputed, as ``jax.checkpoint``:
            only the layers' inputs kept, plus one layer's activations at a time; one more
            forward per micro-batch).
        layer_rules: ``(layer module path, recomputed on its own)`` pairs the recompute rules
            set (:mod:`nnscaler_jax.pipeline.rules`; a cut program's layers): those layers
            follow them whatever ``recompute`` says.
        paired: a schedule written with ``op_order`` (``steps``) runs a stage's ready forward
            and backward in one time step (``ScheduleDraft(paired=True)``; built-ins: by name).
        executor: the runtime the plan was priced for and runs on: ``'in-graph'`` (one
            program walking the step table in lock step) or ``'per-stage'`` (one program per
            stage dispatched from the host, each stage running as its inputs arrive; always
            so for tensor-parallel cut stages).
        stage_plans: per stage, the in-stage plan the planner priced it with (tensor-parallel
            cut stages whose Megatron-style pricing did not fit the budget: each stage's part
            planned by the search, recompute and co-sharding included); the runtime runs
            these. Empty: the runtime plans the stages itself.
        overlap: the in-graph runtime sends each time step's results to the neighbouring
            stages during the next step, beside its compute (the step table placed so that
            no block reads a result before it arrives); priced so
            (:func:`~nnscaler_jax.pipeline.pricing.runtime_time`).
    """

    stages: int
    microbatches: int = 1
    schedule: str = ""
    virtual: int = 1
    stage_of: tuple[tuple[str, int], ...] = ()
    report: str = ""
    steps: tuple[tuple[tuple[Any, ...], ...], ...] = ()
    recompute: str = "chunk"
    layer_rules: tuple[tuple[str, bool], ...] = ()
    paired: bool = False
    executor: str = "in-graph"
    stage_plans: tuple[Plan, ...] = ()
    overlap: bool = False

    def recomputed(self) -> list[str]:
        """The layers recomputed on their own inside their chunk's backward."""
        rules = dict(self.layer_rules)
        return [n for n, _ in self.stage_of if rules.get(n, self.recompute == "layer")]

    def to_dict(self) -> dict[str, Any]:
        """The JSON object under a plan's ``"pipeline"`` key."""
        d: dict[str, Any] = {"stages": self.stages, "microbatches": self.microbatches,
                             "schedule": self.schedule, "virtual": self.virtual,
                             "stage_of": [list(x) for x in self.stage_of]}
        if self.report:
            d["report"] = self.report
        if self.steps:
            d["steps"] = [[list(x) for x in row] for row in self.steps]
        if self.recompute != "chunk":
            d["recompute"] = self.recompute
        if self.layer_rules:
            d["layer_rules"] = [list(x) for x in self.layer_rules]
        if self.paired:
            d["paired"] = True
        if self.executor != "in-graph":
            d["executor"] = self.executor
        if self.overlap:
            d["overlap"] = True
        if self.stage_plans:
            d["stage_plans"] = [json.loads(p.to_json()) for p in self.stage_plans]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PipelineSettings:
        return cls(stages=int(d.get("stages", 1)), microbatches=int(d.get("microbatches", 1)),
                   schedule=str(d.get("schedule", "")), virtual=int(d.get("virtual", 1)),
                   stage_of=tuple((str(n), int(st)) for n, st in d.get("stage_of", ())),
                   report=str(d.get("report", "")),
                   steps=tuple(tuple((str(x[0]), *map(int, x[1:])) for x in row)
                               for row in d.get("steps", ())),
                   recompute=str(d.get("recompute", "chunk")),
                   layer_rules=tuple((str(n), bool(f)) for n, f in d.get("layer_rules", ())),
                   paired=bool(d.get("paired", False)),
                   executor=str(d.get("executor", "in-graph")),
                   overlap=bool(d.get("overlap", False)),
                   stage_plans=tuple(Plan.from_json(json.dumps(x))
                                     for x in d.get("stage_plans", ())))

    def lines(self) -> list[str]:
        """The plan text's pipeline section."""
        by: dict[int, list[str]] = {}
        for name, st in self.stage_of:
            by.setdefault(st, []).append(name)
        lines = [f"pipeline: {self.stages} stages, {self.microbatches} micro-batches, "
                 f"schedule {self.schedule}" + (f" x {self.virtual} virtual"
                                                if self.virtual > 1 else "")
                 + (" (written with op_order)" if self.steps else "")
                 + (", one program per stage" if self.executor == "per-stage" else "")
                 + (", transfers overlapped with the next step" if self.overlap else "")
                 + _recomputed_text(self.recomputed(), len(self.stage_of))]
        lines += [f"  stage {st}: {', '.join(ns)}" + _in_stage_text(self.stage_plans, st)
                  for st, ns in sorted(by.items())]
        return lines + (self.report.splitlines() if self.report else [])


def _in_stage_text(plans: tuple, st: int) -> str:
    """What stage ``st``'s in-stage plan recomputes and co-shards (the planner's search)."""
    if st >= len(plans):
        return ""
    sp, out = plans[st], []
    if sp.recompute:
        out.append(f"recomputes {', '.join(sp.recompute)}")
    if sp.coshard:
        paths = {p.op: p.module_path for p in sp.ops}
        out.append("co-shards " + ", ".join(f"{paths.get(i, f'op {i}')} ({k} chunks)"
                                            for i, _, k in sp.coshard))
    return f" ({'; '.join(out)})" if out else ""


def _recomputed_text(names: list[str], of: int) -> str:
    if not names:
        return ""
    if len(names) == of:
        return ", every layer recomputed"
    return (f", {len(names)} layers recomputed ({', '.join(names[:4])}"
            + (", ...)" if len(names) > 4 else ")"))


@dataclass(frozen=True, slots=True)
class Plan:
    """A parallelization plan for one graph on one mesh shape.

    Attributes:
        mesh: ``(axis name, size)`` pairs.
        fingerprint: identifies the graph the plan was made for.
        ops: one ``OpPlan`` per op (top level and region bodies).
        variables: ``(variable path, PartitionSpec entries)``: how each model variable is stored.
        zero: ZeRO stage (0-3) the storage layouts implement.
        order: ``(a, b)`` op ids: ``a`` before ``b`` on their shared devices.
        policy: the policy that made the plan.
        cost: estimates, if computed.
        pipeline: the pipeline settings, None when the plan does not pipeline (the ops,
            variables and order are then the whole SPMD plan; with a pipeline, each stage's).
        unsplit: dims the policy left replicated because a mesh axis does not divide them
            (what it said, not what it decided: not compared).
        recompute: groups (module path globs) whose activations are recomputed in the
            backward pass instead of kept (:mod:`nnscaler_jax.ir.remat`).
        precision: the compute precision the graph was captured at (``"bfloat16"``,
            ``"float16"``, ``"float32"``; params and inputs cast on entry, variables stored as
            they are: :mod:`nnscaler_jax.capture.precision`), None: the model's own dtypes.
            ``auto_parallel(plan=...)`` captures at it.
        microbatches: gradient accumulation of an SPMD plan: the training step runs the batch
            as this many micro-batches (rows ``i::m``) and synchronises gradients once; the
            estimate keeps one micro-batch's activations. A pipelined plan's is its
            ``pipeline.microbatches`` (the micro-batches its schedule runs).
        coshard: co-sharded blocks, ``(seed op id, identifier, chunks)``: the block grown from
            that op along that identifier of its annotation runs as ``chunks`` sequential,
            recomputed chunks per device (:mod:`nnscaler_jax.ir.coshard`).
        fused_attention: the scores op ids of the attention blocks run as one fused op each
            (:mod:`nnscaler_jax.ir.attention`; ``Constraints(attention="fused")``): a flash
            kernel on GPUs; one split on its sequence runs as ring attention.
        ring_layouts: ``(op id, "ring" | "zigzag")`` per fused attention op split on its
            sequence: how it runs (ring attention, :mod:`nnscaler_jax.lower.ring`), the cheaper
            of the two by the cost model unless ``Constraints(attention=...)`` forced one. An op
            split so and not listed runs as ``"ring"``.
    """

    mesh: tuple[tuple[str, int], ...]
    fingerprint: str
    ops: tuple[OpPlan, ...]
    variables: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    zero: int = 0
    order: tuple[tuple[int, int], ...] = ()
    policy: str = ""
    cost: PlanCost | None = field(default=None, compare=False)
    pipeline: PipelineSettings | None = None
    unsplit: tuple[Unsplit, ...] = field(default=(), compare=False)
    recompute: tuple[str, ...] = ()
    precision: str | None = None
    microbatches: int = 1
    coshard: tuple[tuple[int, str, int], ...] = ()
    fused_attention: tuple[int, ...] = ()
    ring_layouts: tuple[tuple[int, str], ...] = ()
    # lookups built once per plan (op id -> OpPlan, variable -> spec); not a field of the plan
    _memo: dict = field(default_factory=dict, init=False, compare=False, repr=False,
                        hash=False)

    def __post_init__(self) -> None:
        # a pipelined plan runs its pipeline's micro-batches (it has no gradient accumulation
        # of its own): one count, read the same way, never stale after a replace()
        if self.pipeline is not None and self.microbatches != self.pipeline.microbatches:
            object.__setattr__(self, "microbatches", self.pipeline.microbatches)

    @property
    def stages(self) -> int:
        """Pipeline stages (1 when the plan does not pipeline)."""
        return self.pipeline.stages if self.pipeline is not None else 1

    def op_plan(self, op_id: int) -> OpPlan | None:
        return self._by_id().get(op_id)

    def _by_id(self) -> dict[int, OpPlan]:
        out = self._memo.get("ops")
        if out is None:
            out = self._memo["ops"] = {p.op: p for p in self.ops}
        return out

    def variable_spec(self, name: str) -> tuple[Any, ...] | None:
        specs = self._memo.get("variables")
        if specs is None:
            specs = self._memo["variables"] = dict(self.variables)
        return specs.get(name)

    def __str__(self) -> str:
        axes = [a for a, _ in self.mesh]
        head = f"Plan[{self.policy or 'custom'}] mesh {dict(self.mesh)} zero={self.zero}" + (
            f" precision={self.precision}" if self.precision else "") + (
            f" microbatches={self.microbatches}" if self.microbatches > 1
            and self.pipeline is None else "")
        rows: dict[tuple, list[str]] = {}
        for p in self.ops:
            key = (p.module_path or "<top>",) + tuple(p.axis_dim(a) or "-" for a in axes) + (
                f"x{p.chunks[1]} seq along {p.chunks[0]}" if p.chunks else "",)
            rows.setdefault(key, []).append(p.primitive)
        width = max([len(k[0]) for k in rows] + [12])
        lines = [head, f"{'module path':<{width}}  " + "  ".join(f"{a:>8}" for a in axes)
                 + "  ops"]
        for key, prims in rows.items():
            counts = {q: prims.count(q) for q in dict.fromkeys(prims)}
            desc = ", ".join(f"{q}x{c}" if c > 1 else q for q, c in counts.items())
            extra = f"  [{key[-1]}]" if key[-1] else ""
            lines.append(f"{key[0]:<{width}}  " + "  ".join(f"{d:>8}" for d in key[1:-1])
                         + f"  {desc}{extra}")
        sharded = [(n, s) for n, s in self.variables if any(e is not None for e in s)]
        if sharded:
            lines.append("variables stored sharded:")
            lines += [f"  {n}: P{tuple(s)}" for n, s in sharded]
        if self.pipeline is not None:
            lines += self.pipeline.lines()
        if self.recompute:
            shown = ", ".join(self.recompute[:8]) + (
                f" and {len(self.recompute) - 8} more" if len(self.recompute) > 8 else "")
            lines.append(f"recompute (activations recomputed in the backward): {shown}")
            if any(is_selective(g) for g in self.recompute):
                lines.append(f"  ('{SELECTIVE}': selective, the group's matmul outputs are kept but "
                             "the attention scores)")
        if self.unsplit:
            lines.append(f"left replicated (size does not divide): {len(self.unsplit)} op dims")
            lines += [f"  {x}" for x in unsplit_summary(self.unsplit)]
        if self.cost:
            c = self.cost
            lines.append(f"estimate: step {c.step_time_s * 1e3:.3f} ms, memory/device "
                         f"{fmt_bytes(c.memory_bytes_per_device)}, comm "
                         f"{fmt_bytes(c.comm_bytes)}")
        return "\n".join(lines)

    def summary(self, graph: Graph | None = None) -> str:
        """A short table: one row per module, consecutive repeated layers with the same layout
        collapsed into one group row (``h_* (x24)``), per mesh axis the dims split (in words
        with ``graph``, the graph the plan was made for: ``pm.graph``), the sharded variables
        grouped the same way, features and the estimate. ``format(plan, "summary")`` too.
        """
        return _view.plan_summary(self, graph)

    def view(self, graph: Graph | None = None) -> _view.PlanView:
        """The plan with its graph, for a notebook: ``plan.view(pm.graph)`` names the split
        dims (``batch (8)``, ``heads (4)``) and shows the variables' shapes."""
        return _view.PlanView(self, graph)

    def _repr_html_(self) -> str:
        """The notebook view (the plan alone: split dims as annotation identifiers)."""
        return _view.plan_html(self)

    def __format__(self, spec: str) -> str:
        if spec == "summary":
            return self.summary()
        if spec:
            raise ValueError(f"unknown format spec {spec!r} for Plan: '' (the table) or "
                             "'summary'")
        return str(self)

    # ---- JSON ------------------------------------------------------------------------------

    def to_json(self) -> str:
        d = {
            "format": FORMAT,
            "mesh": [list(m) for m in self.mesh],
            "fingerprint": self.fingerprint,
            "policy": self.policy,
            "zero": self.zero,
            "order": [list(o) for o in self.order],
            "variables": [[n, list(s)] for n, s in self.variables],
            "ops": [
                {"op": p.op, "primitive": p.primitive, "module_path": p.module_path,
                 "split": [list(s) for s in p.split],
                 "chunks": list(p.chunks) if p.chunks else None,
                 "keep_partial": p.keep_partial}
                for p in self.ops
            ],
            "cost": _cost_dict(self.cost) if self.cost else None,
        }
        if self.pipeline is not None:
            d["pipeline"] = self.pipeline.to_dict()
        if self.recompute:
            d["recompute"] = list(self.recompute)
        if self.precision:
            d["precision"] = self.precision
        if self.microbatches > 1:
            d["microbatches"] = self.microbatches
        if self.coshard:
            d["coshard"] = [list(c) for c in self.coshard]
        if self.fused_attention:
            d["fused_attention"] = list(self.fused_attention)
        if self.ring_layouts:
            d["ring_layouts"] = [list(x) for x in self.ring_layouts]
        if self.unsplit:
            d["unsplit"] = [dataclasses.asdict(u) for u in self.unsplit]
        return json.dumps(d, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Parse ``to_json`` output.

        Raises:
            PlanFormatError: malformed JSON or not a plan.
        """
        try:
            d = json.loads(text)
            if not isinstance(d, dict) or d.get("format") != FORMAT:
                got = d.get("format") if isinstance(d, dict) else type(d).__name__
                raise ValueError(f"format is {got!r}, expected {FORMAT!r}")
            ops = tuple(
                OpPlan(int(o["op"]), str(o["primitive"]), str(o["module_path"]),
                       tuple((str(a), str(x)) for a, x in o["split"]),
                       (str(o["chunks"][0]), int(o["chunks"][1])) if o["chunks"] else None,
                       bool(o["keep_partial"]))
                for o in d["ops"]
            )
            variables = tuple((str(n), tuple(_entry(e) for e in s)) for n, s in d["variables"])
            cost = PlanCost(**{**d["cost"], **{key: tuple(
                (str(k), int(n)) for k, n in d["cost"].get(key, ()))
                for key in ("comm_kinds", "memory_kinds")}}) if d.get("cost") else None
            pipe = d.get("pipeline")
            return cls(
                mesh=tuple((str(a), int(n)) for a, n in d["mesh"]),
                fingerprint=str(d["fingerprint"]),
                ops=ops,
                variables=variables,
                zero=int(d["zero"]),
                order=tuple((int(a), int(b)) for a, b in d["order"]),
                policy=str(d["policy"]),
                cost=cost,
                pipeline=PipelineSettings.from_dict(pipe) if pipe else None,
                unsplit=tuple(_unsplit(u) for u in d.get("unsplit", ())),
                recompute=tuple(str(g) for g in d.get("recompute", ())),
                precision=precision_name(d.get("precision")),
                microbatches=int(d.get("microbatches", 1)),
                coshard=tuple((int(i), str(n), int(k)) for i, n, k in d.get("coshard", ())),
                fused_attention=tuple(int(i) for i in d.get("fused_attention", ())),
                ring_layouts=tuple((int(i), _ring_layout(x))
                                   for i, x in d.get("ring_layouts", ())),
            )
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise PlanFormatError(f"not a valid plan JSON ({type(e).__name__}: {e}); write it "
                                  "with Plan.to_json()") from e

    def check_graph(self, graph: Graph, mesh_axes: dict[str, int]) -> None:
        """Raise ``PlanFormatError`` if the plan was made for another model (structure: ops,
        names, ranks, dtypes; see :func:`graph_fingerprint`) or another mesh shape. Sizes may
        differ: :func:`nnscaler_jax.plan.reuse.check_reuse` also checks that the splits divide
        them (what ``make_plan(plan=...)`` runs).

        A plan saved before fingerprints left sizes out (no ``s1-`` prefix) passes when its ops
        and variables match the graph's by id, primitive, module path and name.
        """
        if dict(self.mesh) != dict(mesh_axes):
            raise PlanFormatError(f"this plan is for mesh {dict(self.mesh)}, not "
                                  f"{dict(mesh_axes)}; re-plan for this mesh")
        legacy = not self.fingerprint.startswith(FINGERPRINT)
        fp = graph_fingerprint(graph)
        if legacy or self.fingerprint != fp:
            diff = self.structure_diff(graph)
            if diff or not legacy:
                diff = diff or ("the ops match by primitive and module path, but the input "
                                "names, roles, ranks or dtypes differ")
                raise PlanFormatError(
                    f"this plan was made for another model (fingerprint {self.fingerprint}, "
                    f"this graph {fp}): {diff}; re-plan with policy=... or make_plan()")

    def structure_diff(self, graph: Graph) -> str:
        """What differs between the graph the plan was made for and ``graph`` ('' if nothing
        it can tell): the op count, the first op whose primitive or module path differs, the
        variable names."""
        ops = {op.id: op for op in graph.walk()}
        parts = []
        if len(self.ops) != len(ops):
            parts.append(f"the plan has {len(self.ops)} ops, this graph {len(ops)}")
        for p in self.ops:
            op = ops.get(p.op)
            if op is None or (op.primitive, op.module_path) != (p.primitive, p.module_path):
                here = f"{op.primitive} at '{op.module_path or '<top>'}'" if op else "no such op"
                parts.append(f"op {p.op} is {p.primitive} at '{p.module_path or '<top>'}' in "
                             f"the plan, {here} in this graph")
                break
        mine = {n for n, _ in self.variables}
        theirs = {t.name for t in graph.variables}
        if mine and mine != theirs:
            parts.append(f"variables only in the plan: {sorted(mine - theirs)[:3] or 'none'}, "
                         f"only in this graph: {sorted(theirs - mine)[:3] or 'none'}")
        return "; ".join(parts)


def _entry(e: Any) -> Any:
    if e is None or isinstance(e, str):
        return e
    return tuple(e)


def _ring_layout(value: Any) -> str:
    if value not in ("ring", "zigzag"):
        raise ValueError(f"ring layout {value!r} is not 'ring' or 'zigzag'")
    return str(value)


def _unsplit(u: dict[str, Any]) -> Unsplit:
    return Unsplit(int(u["op"]), str(u["primitive"]), str(u["module_path"]), str(u["dim"]),
                   int(u["size"]), str(u["axis"]), int(u["axis_size"]))


def graph_fingerprint(graph: Graph) -> str:
    """A short hash of the graph's structure: its ops (id, primitive, module path, operand
    ranks and dtypes) and its inputs' names, roles, ranks and dtypes; no dim sizes, so one plan
    serves every batch size and sequence length its splits divide."""
    h = hashlib.sha1()
    for t in graph.inputs:
        h.update(f"{t.name}:{t.role.value}:{t.ndim}:{t.dtype};".encode())
    for op in graph.walk():
        ins = [(t.ndim, t.dtype) for t in op.inputs]
        outs = [(t.ndim, t.dtype) for t in op.outputs]
        h.update(f"{op.id}:{op.primitive}:{op.module_path}:{ins}->{outs};".encode())
    return FINGERPRINT + h.hexdigest()[:16]
