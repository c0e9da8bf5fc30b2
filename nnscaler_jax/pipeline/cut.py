"""Cutting any model into pipeline stages at module boundaries (heterogeneous stages).

The identical-layer runtime (:mod:`nnscaler_jax.pipeline.stacked`) needs a GPT-like stack. Any
other model (T5's encoder and decoder, Swin's stages of different widths, Evoformer's two
tracks) is cut here into ``stages x virtual`` contiguous *chunks* of its program, each starting
where a module starts (nnScaler's pipeline pivots):

- the cut points are the starts of the modules ``Constraints(pipeline_pivots=(glob, ...))``
  names (globs match whole path segments, :func:`nnscaler_jax.constraints.pivot_paths`), or
  else of the top-level modules and the repeated blocks (:func:`nnscaler_jax.ir.layers.
  block_paths`: ``encoder/block_3``, ``layers_1/blocks_0``; transformers' ``transformer/h/3``);
- among them :func:`balance` picks the cuts that minimise the busiest chunk's compute (the cost
  model's ``op_time``, forward + backward);
- the plan records the cut as ``stage_of``: every cut point in program order with its stage
  (:func:`chunk_starts` reads the chunk starts back, for the graph and the traced program
  alike: chunk ``c`` begins at the first op of its first listed module).

:func:`plan_cut` is what :mod:`nnscaler_jax.pipeline.configure` calls: the cut and a
:class:`~nnscaler_jax.pipeline.pricing.RuntimeSetup` whose units are the chunks, so the stage
DP prices the cut program (:mod:`nnscaler_jax.pipeline.cut_program` runs it).

>>> balance([1, 1, 1, 1, 4, 4], [1, 2, 4, 5], 2)
(0, 4)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from nnscaler_jax.constraints import Constraints, pivot_paths
from nnscaler_jax.cost.compute import TRAINABLE
from nnscaler_jax.cost.fusion import fused_bytes
from nnscaler_jax.cost.model import CostModel, itemsize
from nnscaler_jax.cost.residuals import residual_outputs
from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.graph import Graph, Op, Role
from nnscaler_jax.ir.layers import block_paths, graph_layers, variable_casts
from nnscaler_jax.layout import Layout
from nnscaler_jax.mesh.axes import require_stage_axis
from nnscaler_jax.pipeline import schedule as sch
from nnscaler_jax.pipeline.chunks import ProgramCut, cut_program, param_casts, vars_of
from nnscaler_jax.pipeline.in_stage import part_graph, stage_rules, tensor_axes
from nnscaler_jax.pipeline.pricing import RuntimeSetup
from nnscaler_jax.pipeline.program import why_cut
from nnscaler_jax.pipeline.rules import layer_flags
from nnscaler_jax.pipeline.steps import peak_in_flight
from nnscaler_jax.pipeline.units import TP_COLLECTIVES, Unit, kept_for_weights, largest_output
from nnscaler_jax.search.entry import SEARCHES, plan_spmd

__all__ = ["Cut", "balance", "chunk_starts", "cut_traced", "eqn_path", "first_positions",
           "identical_layers", "plan_cut", "segment_starts", "tp_error"]


def eqn_path(eqn: Any, root: str) -> str:
    """The module path of a jaxpr equation, as :mod:`nnscaler_jax.capture.jaxpr` names ops
    (root module and transform markers dropped, ``'attn/attn._split'`` -> ``'attn'``)."""
    parts = [p.split(".")[0] for p in str(eqn.source_info.name_stack).split("/")
             if p and not any(c in p for c in "(,>")]
    if parts and root and parts[0] == root:
        parts = parts[1:]
    out: list[str] = []
    for p in parts:
        if not out or out[-1] != p:
            out.append(p)
    return "/".join(out)


def first_positions(paths: Sequence[str]) -> dict[str, int]:
    """Every module path (with its ancestors) -> the index of its first op in ``paths``."""
    first: dict[str, int] = {}
    for i, p in enumerate(paths):
        parts = p.split("/") if p else []
        for k in range(1, len(parts) + 1):
            first.setdefault("/".join(parts[:k]), i)
    return first


def _candidates(paths: Sequence[str], pivots: tuple[str, ...]) -> list[tuple[int, str]]:
    """``(position, module path)`` of the modules a chunk may start at, one per position (the
    outermost), in program order."""
    first = first_positions(paths)
    if pivots:
        names = []
        for glob in pivots:
            hit = pivot_paths(glob, list(first))
            if not hit:
                raise PlanError(f"pipeline_pivots: glob {glob!r} matches no module; top-level "
                                f"modules are {sorted({p.split('/')[0] for p in first})[:12]}",
                                module_path=glob)
            names += hit
    else:
        names = [p for p in first if "/" not in p] + block_paths(list(paths))
        names += [p for p in first if p.rsplit("/", 1)[-1].isdigit()  # transformers' h/0, h/1
                  and any(q.startswith(p + "/") for q in first)]
    best: dict[int, str] = {}
    for n in names:
        pos = first[n]
        if pos not in best or n.count("/") < best[pos].count("/"):
            best[pos] = n
    return sorted(best.items())


def balance(costs: Sequence[float], positions: Sequence[int], chunks: int) -> tuple[int, ...]:
    """Chunk starts (``0`` and ``chunks - 1`` of ``positions``) minimising the largest chunk's
    summed ``costs`` (a linear-partition DP over the allowed cut positions).

    Raises:
        PlanError: fewer allowed positions than cuts.
    """
    n = len(costs)
    pos = sorted({p for p in positions if 0 < p < n})
    if len(pos) < chunks - 1:
        raise PlanError(f"pipeline: {chunks} chunks need {chunks - 1} cut points, the model "
                        f"has {len(pos)} module starts to cut at; use fewer stages or more "
                        "pipeline_pivots")
    cum = [0.0]
    for c in costs:
        cum.append(cum[-1] + c)
    pts = [0] + pos
    K = len(pts)
    inf = float("inf")
    # best[j][i]: chunks 0..j with chunk j starting at pts[i] -> (max cost so far, prev index)
    best = [[(inf, -1)] * K for _ in range(chunks)]
    best[0][0] = (0.0, -1)
    for j in range(1, chunks):
        for i in range(1, K):
            for k in range(i):
                if best[j - 1][k][0] < inf:
                    v = max(best[j - 1][k][0], cum[pts[i]] - cum[pts[k]])
                    if v < best[j][i][0]:
                        best[j][i] = (v, k)
    tail = [max(best[chunks - 1][i][0], cum[n] - cum[pts[i]]) for i in range(K)]
    i = min(range(K), key=lambda q: tail[q])
    starts = []
    for j in range(chunks - 1, -1, -1):
        starts.append(pts[i])
        i = best[j][i][1]
    return tuple(reversed(starts))


def chunk_starts(paths: Sequence[str], stage_of: Sequence[tuple[str, int]], stages: int,
                 chunks: int) -> tuple[int, ...]:
    """The op index each chunk starts at, read from a plan's ``stage_of`` (module paths in
    program order with their stage; chunk ``c`` runs on stage ``c % stages`` and starts at the
    first op of its first listed module; chunk 0 at op 0).

    Raises:
        PlanError: a listed module is not in the program, or the list does not describe
            ``chunks`` contiguous chunks.
    """
    first = first_positions(paths)
    runs: list[tuple[int, str]] = []
    for name, st in stage_of:
        if not runs or runs[-1][0] != st:
            runs.append((st, name))
    if runs and runs[0][0] != 0:
        runs.insert(0, (0, ""))
    missing = [n for _, n in runs[1:] if n not in first]
    starts = [0] + [first.get(n, -1) for _, n in runs[1:]]
    if (missing or len(runs) != chunks or any(st != c % stages for c, (st, _) in enumerate(runs))
            or any(b <= a for a, b in itertools.pairwise(starts))):
        raise PlanError(f"pipeline: the plan's stage split {list(stage_of)[:8]} does not cut "
                        f"this program into {chunks} contiguous chunks over {stages} stages"
                        + (f" (modules {missing} are not in it)" if missing else "")
                        + "; re-plan for this model")
    return tuple(starts)


def _pipelined(paths: Sequence[str], stage_of: Sequence[tuple[str, int]]) -> list[str]:
    """The modules a pipeline cuts between: the repeated blocks, else the recorded cut points."""
    return block_paths(list(paths)) or [n for n, _ in stage_of]


def segment_starts(paths: Sequence[str], stage_of: Sequence[tuple[str, int]], stages: int,
                   chunks: int, *, all_device: bool = False) -> tuple[int, ...]:
    """The op index each segment of the cut program starts at: the ``chunks`` pipelined
    chunks (:func:`chunk_starts`; without a recorded cut, equal runs of the repeated blocks),
    and with ``all_device`` (``interlaced``) an embedding segment before them (the ops before
    the first pipelined module: the repeated blocks, else the recorded cut points) and a head
    segment after them (the ops after the last pipelined module's last op).

    Raises:
        PlanError: no pipelined modules, or a recorded cut that does not fit between them.
    """
    names = _pipelined(paths, stage_of)
    if not stage_of:  # a stack the identical-layer runtime would run: equal runs of blocks
        if len(names) % chunks:
            raise PlanError(f"pipeline: {len(names)} repeated blocks do not split into "
                            f"{chunks} equal chunks; use a stage count dividing it, or "
                            "Constraints(pipeline_pivots=...)")
        k = len(names) // chunks
        stage_of = tuple((n, i // k % stages) for i, n in enumerate(names))
    starts = chunk_starts(paths, stage_of, stages, chunks)
    if not all_device:
        return starts
    if not names:
        raise PlanError("pipeline: a schedule with all-device blocks (interlaced) runs the "
                        "ops before the first repeated block on all devices and the ops after "
                        "the last one too; this model has no repeated blocks: name the "
                        "pipelined modules with Constraints(pipeline_pivots=(...))")
    first = first_positions(paths)
    inside = lambda p: any(p == n or p.startswith(n + "/") for n in names)
    e = min(first[n] for n in names)
    h = 1 + max(i for i, p in enumerate(paths) if inside(p))
    if (len(starts) > 1 and starts[1] <= e) or starts[-1] >= h:
        raise PlanError(f"pipeline: the stage split {list(stage_of)[:6]} does not leave the "
                        f"embedding (ops 0..{e - 1}) and the head (ops {h}..) outside the "
                        "pipelined chunks; re-plan with schedule='interlaced'")
    return (0, e) + tuple(starts[1:]) + (h,)


def taken_by_embedding(paths: Sequence[str], ins: Sequence[set], outs: Sequence[set],
                       params: set, free: set, names: Sequence[str], e: int,
                       h: int) -> list[int]:
    """The ops of ``e:h`` (between interlaced's embedding and head segments) its embedding
    block ``E`` takes over, nnScaler's T5 plan (both embeddings in ``E``): outside the
    pipelined modules ``names``, computable from ``free`` values alone (parameters, batch
    inputs, constants, the embedding segment's values, or ops taken), and reading a parameter
    (of ``params``) the embedding or head segments read (``ops[:e]`` / ``ops[h:]``: the tied table T5's
    decoder embeds its tokens with), or feeding such an op. Moved before ``e``, their
    parameters stay with the all-device blocks and their outputs cross the boundaries.

    ``ins`` / ``outs``: per op the keys of the values it reads (a parameter's cast keyed as
    the parameter) and writes.

    >>> taken_by_embedding(["emb", "blk_0", "glue", "emb2", "blk_1", "head"],
    ...                    [{"tab", "x"}, {"e"}, {"y"}, {"tab", "y2"}, {"b0", "d"}, {"tab", "b1"}],
    ...                    [{"e"}, {"b0"}, {"y2"}, {"d"}, {"b1"}, {"out"}],
    ...                    {"tab", "b0", "b1"}, {"tab", "x", "y", "e", "b0", "b1"},
    ...                    ["blk_0", "blk_1"], 1, 5)
    [2, 3]
    """
    inside = lambda p: any(p == n or p.startswith(n + "/") for n in names)
    wanted = set().union(set(), *ins[:e], *ins[h:]) & params
    ok, cands = set(free), []
    for i in range(e, h):
        if not inside(paths[i]) and ins[i] <= ok:
            cands.append(i)
            ok |= outs[i]
    taken, need = set(), set()
    for i in reversed(cands):
        if ins[i] & wanted or outs[i] & need:
            taken.add(i)
            need |= ins[i]
    return sorted(taken)


def embedding_first(closed: Any, n_params: int, root: str, stage_of: Sequence[tuple[str, int]],
                    stages: int, chunks: int) -> Any:
    """``closed`` (the micro-batch program, ``n_params`` parameters first) with the equations
    interlaced's embedding block takes over (:func:`taken_by_embedding`) moved into its
    segment, before the first pipelined module (the parameters' casts first); ``closed``
    itself when none is. Both runtimes cut this program (:func:`segment_starts`)."""
    eqns, casts = param_casts(closed, n_params)
    paths = [eqn_path(q, root) for q in eqns]
    starts = segment_starts(paths, stage_of, stages, chunks, all_device=True)
    e, h = starts[1], starts[-1]
    key = {v: q.invars[0] for v, q in casts.items()}  # (a cast read as its parameter)
    ins = [{key.get(v, v) for v in vars_of(q.invars)} for q in eqns]
    outs = [set(q.outvars) for q in eqns]
    jx = closed.jaxpr
    free = set(jx.invars) | set(jx.constvars) | {v for q in eqns[:e] for v in q.outvars}
    taken = taken_by_embedding(paths, ins, outs, set(jx.invars[:n_params]), free,
                               _pipelined(paths, stage_of), e, h)
    if not taken:
        return closed
    rest = [q for i, q in enumerate(eqns) if i >= e and i not in set(taken)]
    order = list(casts.values()) + eqns[:e] + [eqns[i] for i in taken] + rest
    return closed.replace(jaxpr=jx.replace(eqns=order))


def cut_traced(closed: Any, n_params: int, root: str, stage_of: Sequence[tuple[str, int]],
               sched: sch.Schedule, *, layer_rules: Mapping[str, bool], recompute: str,
               made_first: Sequence[Any] = (),
               carried: Sequence[tuple[int, int]] = ()) -> tuple[ProgramCut, dict]:
    """The traced micro-batch program ``closed`` (``n_params`` parameter-like inputs first)
    cut where the plan's ``stage_of`` says, as both cut runtimes run it: its segments (with
    all-device blocks the embedding segment first and the head last, interlaced's E / H,
    :func:`segment_starts`; :func:`~nnscaler_jax.pipeline.chunks.cut_program` for
    ``made_first`` and ``carried``) and each recorded module's first equation (by id) with
    whether its layer runs under ``jax.checkpoint`` (``layer_rules``, else ``recompute ==
    'layer'``), for :func:`~nnscaler_jax.pipeline.chunks.run_chunk`."""
    S, C = sched.stages, sched.chunks
    if sched.all_device:  # (the decoder's embedding too: T5's tied table)
        closed = embedding_first(closed, n_params, root, stage_of, S, C)
    eqns, _ = param_casts(closed, n_params)  # (casts go where they are read)
    paths = [eqn_path(e, root) for e in eqns]
    starts = segment_starts(paths, stage_of, S, C, all_device=sched.all_device)
    first = first_positions(paths)  # layers: the recorded cut points' modules
    layer = recompute == "layer"
    layer_starts = {id(eqns[first[m]]): layer_rules.get(m, layer)
                    for m, _ in stage_of if m in first}
    return cut_program(closed, n_params, starts, made_first=made_first,
                       carried=carried), layer_starts


def identical_layers(graph: Graph, bounds: Sequence[tuple[int, int]]) -> bool:
    """Whether the layers at these op ranges are what the identical-layer runtime runs
    (:func:`~nnscaler_jax.pipeline.split.split_program`): the same primitives on the same
    shapes and dtypes, each reading one activation made before it (besides variables and
    constants). Swin's stages ``layers_0 .. layers_3`` are numbered like a stack but differ in
    width, Evoformer's blocks read the MSA and the pair tracks: both are cut at module
    boundaries by the runtime, and priced so."""
    def signature(a: int, b: int) -> tuple:
        return tuple((op.primitive, tuple((t.shape, t.dtype) for t in op.inputs),
                      tuple((t.shape, t.dtype) for t in op.outputs)) for op in graph.ops[a:b])

    a, b = bounds[0]
    made = {t.id for op in graph.ops[a:b] for t in op.outputs}
    reads = {t.id for op in graph.ops[a:b] for t in op.inputs
             if t.id not in made and t.role in (Role.VALUE, Role.INPUT)}
    return len(reads) == 1 and len({signature(a, b) for a, b in bounds}) == 1


#: nnx's rng stream state: the pipelined step keys the streams itself (per micro-batch), it
#: carries no such collection.
_RNG_STATE = ("rngcount", "rngkey")


def _carries_collections(graph: Graph) -> bool:
    """Whether the pipelined step carries mutable collections for this model (BatchNorm
    statistics: linen's ``batch_stats``, nnx's ``BatchStat``): variables neither trained
    nor rng stream state (the step's rule, :attr:`~nnscaler_jax.capture.module_call.
    ModuleCall.collections`)."""
    return any(t.collection not in (*TRAINABLE, *_RNG_STATE) for t in graph.variables)


def tp_error(tensor: Sequence[str], schedule: str, collections: Sequence[str] = ()
             ) -> PlanError:
    """What the one-program cut runtime does not run on tensor-parallel stages: all-device
    blocks and mutable collections (the per-stage runtime,
    :class:`~nnscaler_jax.pipeline.mpmd.MpmdProgram`, runs the first)."""
    what = (f"mutable collections ({list(collections)[:3]})" if collections else
            f"schedule {schedule!r} (its all-device blocks)")
    return PlanError(
        f"pipeline: tensor-parallel stages (mesh axes {list(tensor)}) in one program "
        f"(pipeline_executor='in-graph') do not run {what}. Use "
        "Constraints(pipeline_executor='per-stage') (one program per stage), another "
        "schedule, or policy='dp'")


@dataclass(frozen=True)
class Cut:
    """A model cut into chunks at module starts.

    Attributes:
        starts: the graph op index each chunk starts at.
        stage_of: the cut points in program order with their stage (the plan's record).
        setup: the runtime pricing setup, one unit per chunk.
        layer_rules: ``(module, recomputed on its own)`` per cut point a recompute rule
            selects (``PipelineSettings.layer_rules``).
    """

    starts: tuple[int, ...]
    stage_of: tuple[tuple[str, int], ...]
    setup: RuntimeSetup
    layer_rules: tuple[tuple[str, bool], ...] = ()


def _op_cost(model: CostModel, op: Op, traffic: Mapping[int, float],
             splits: Mapping[int, Any] | None = None) -> float:
    """Forward + backward seconds of ``op`` on one device, split as ``splits`` says (op id ->
    split; default whole)."""
    split = (splits or {}).get
    if not op.regions:
        return model.op_time(op, split(op.id, ()), None, traffic)
    inner = sum(model.op_time(o, split(o.id, ()), None, traffic) for r in op.regions
                for o in r.walk() if not o.regions)
    return inner * int(op.params.get("length", 1) or 1)


def _in_stage_splits(graph: Graph, axes: dict[str, int], constraints: Constraints,
                     policy: Any) -> tuple[dict[int, Any], dict[int, int]]:
    """The policy's plan on the tensor-parallel ``axes`` alone, the in-stage plan the runtime
    makes for one micro-batch (:func:`~nnscaler_jax.pipeline.in_stage.plan_in_stage`), here
    of the whole graph: op id -> split, and variable id -> the devices it is stored split
    over (Megatron leaves norms, biases and a tied embedding whole)."""
    plan = plan_spmd(graph, axes, policy=policy,
                     constraints=Constraints(rules=stage_rules(constraints.rules))).plan
    ways = {t.id: math.prod(axes[a] for a in Layout.from_pspec(
        plan.variable_spec(t.name) or (), t.ndim).split_axes) for t in graph.variables}
    return {p.op: p.split for p in plan.ops}, ways


def plan_cut(graph: Graph, mesh_axes: dict[str, int], constraints: Constraints, policy: Any,
             virtual: int, model: CostModel | None = None) -> Cut | None:
    """The cut of ``graph`` into ``stages x virtual`` chunks, or None when the model is a stack
    of layers the identical-layer runtime runs (nothing asks for a cut:
    :func:`~nnscaler_jax.pipeline.program.why_cut`, the step's rule too).

    Raises:
        PlanError: a pivot matching nothing, too few cut points, or a tensor-parallel policy.
    """
    axis = require_stage_axis(mesh_axes)
    S = mesh_axes[axis]
    colls = _carries_collections(graph)
    keys = any(t.role is Role.RNG for t in graph.inputs)
    if why_cut(pivots=bool(constraints.pipeline_pivots), schedule=constraints.schedule,
               precision=constraints.precision, collections=colls, keys=keys) is None \
            and constraints.pipeline_executor != "per-stage":
        try:
            layers = graph_layers(graph)
        except PlanError:
            layers = None
        if (layers is not None and layers.stack.count % (S * virtual) == 0
                and identical_layers(graph, layers.bounds)):
            return None
    tensor = tensor_axes(mesh_axes, axis, policy)  # (tensor-parallel stages: mpmd.py)
    model = model or CostModel.for_axes(mesh_axes)
    casts = variable_casts(graph)  # (they come first; the runtime makes them where read)
    paths = ["" if op.id in casts else op.module_path for op in graph.ops]
    cands = _candidates(paths, constraints.pipeline_pivots)
    traffic = fused_bytes(graph)
    starts = balance([_op_cost(model, op, traffic) for op in graph.ops], [p for p, _ in cands],
                     S * virtual)
    chunk_of = lambda i: sum(1 for s in starts if s <= i) - 1
    stage_of = tuple((n, chunk_of(p) % S) for p, n in cands)
    data = tuple(a for a in mesh_axes if a != axis and a not in tensor)
    link = model.mesh.link
    batch = next((t.shape[0] for t in graph.inputs if t.role is Role.INPUT and t.shape), 1)
    ends = _outside(paths, stage_of, starts)
    taken = _taken_ops(graph, paths, _pipelined(paths, stage_of), ends, casts)
    flags = layer_flags([n for _, n in cands], paths, constraints.rules)
    tp = math.prod(mesh_axes[a] for a in tensor)
    splits, ways = (_in_stage_splits(graph, {a: mesh_axes[a] for a in tensor}, constraints,
                                     policy) if tensor else (None, None))
    units = _chunk_units(graph, starts, batch, model, ends,
                         {p: flags.get(n) for p, n in cands}, splits, tp, taken, ways)
    searched = _stage_search(graph, starts, S, {a: mesh_axes[a] for a in tensor}, policy,
                             constraints, model, units, batch) \
        if tensor and policy in SEARCHES and constraints.max_memory_per_device else None
    setup = RuntimeSetup(units, axis, data, tensor, S,
                         math.prod(mesh_axes[a] for a in data), tp, batch, link(axis),
                         link(data[0]) if data else link(axis),
                         link(tensor[0]) if tensor else link(axis),
                         executors=_executors(tensor, colls, constraints), searched=searched)
    return Cut(starts, stage_of, setup, tuple((n, flags[n]) for _, n in cands if n in flags))


def _stage_search(graph: Graph, starts: tuple[int, ...], S: int, tensor: dict[str, int],
                  policy: Any, constraints: Constraints, model: CostModel,
                  units: Sequence[Unit], batch: int) -> Callable:
    """``memory(row, budget)``: per stage, the bytes a device holds when the in-stage search
    plans the stage's part (the ops of its chunks, as the runtime plans it:
    :func:`~nnscaler_jax.pipeline.in_stage.plan_in_stage`) for one micro-batch under the
    budget less the chunk inputs the schedule keeps for its other micro-batches in flight,
    plus those inputs, the stages' plans, the seconds the busiest stage's plan adds to
    a step (its recompute and co-sharded chunks against its plan without a budget, one data
    shard's share) and each stage's bytes by kind (:attr:`~nnscaler_jax.pipeline.pricing.
    RuntimeChoice.memory_kinds`: its plan's breakdown, the inputs with its activations);
    None when a stage's search finds nothing (or the row's schedule runs all-device blocks,
    which the stages' parts leave out). The search prices one
    micro-batch's activations of this full-batch graph (``CostModel.microbatches``)."""
    bounds = list(zip(starts, list(starts[1:]) + [len(graph.ops)], strict=True))
    casts = variable_casts(graph)
    sub = model.mesh
    links = tuple(sub.links[sub.axis_names.index(a)] for a in tensor)
    mesh = replace(sub, axis_names=tuple(tensor), axis_sizes=tuple(tensor.values()),
                   links=links)
    parts: dict[int, Graph] = {}

    def part(s: int) -> Graph:
        if s not in parts:
            ids = {graph.ops[i].id for c in range(s, len(bounds), S) for i in range(*bounds[c])
                   if graph.ops[i].id not in casts}  # (casts: made where read, as the runtime)
            reads = {t.id for op in graph.ops if op.id in ids for t in op.inputs}
            ids |= {op.id for op in graph.ops if op.id in casts and op.outputs[0].id in reads}
            parts[s] = part_graph(graph, ids)
        return parts[s]

    free: dict[tuple[int, int], float] = {}

    def extra_s(s: int, m: int, plan: Any, cost: CostModel, mine: tuple) -> float:
        """Seconds a step of stage ``s`` spends on what ``plan`` recomputes or runs in chunks
        beyond the stage's plan without a budget (their priced steps, over the whole batch:
        all data shards')."""
        if (s, m) not in free:
            free[s, m] = plan_spmd(part(s), tensor, policy=policy, cost_model=cost,
                                   constraints=Constraints(rules=mine)).plan.cost.step_time_s
        return max(0.0, plan.cost.step_time_s - free[s, m])

    def memory(row: Any, budget: float) -> tuple[tuple[float, ...], tuple, float, tuple] | None:
        if row.schedule in ("interlaced",) or len(bounds) != S * row.virtual:
            return None
        flight = peak_in_flight(sch.build(row.schedule, S, row.microbatches, row.virtual))
        cost = replace(model, mesh=mesh, microbatches=max(1, batch // row.microbatch_size))
        out, plans, kinds, extra = [], [], [], 0.0
        for s in range(S):
            inputs = max((units[1 + c - 1].out_bytes for c in range(s, len(bounds), S) if c),
                         default=0.0) * row.microbatch_size * (flight[s] - 1)
            g = part(s)
            mine = stage_rules(constraints.rules, g)
            try:
                plan = plan_spmd(g, tensor, policy=policy, cost_model=cost, constraints=(
                    Constraints(rules=mine, max_memory_per_device=budget - inputs))).plan
            except PlanError:
                return None
            out.append(plan.cost.memory_bytes_per_device + inputs)
            plans.append(plan)
            b = cost.memory_breakdown(plan, g)
            kinds.append({"params": b["params"], "grads": b["grads"],
                          "optimizer": b["optimizer"],
                          "activations": b["activations"] + b["transient"] + inputs,
                          "peak": out[-1]})
            extra = max(extra, extra_s(s, cost.microbatches, plan, cost, mine))
        return tuple(out), tuple(plans), extra, tuple(kinds)

    return memory


def _executors(tensor: Sequence[str], collections: bool,
               constraints: Constraints) -> tuple[str, ...]:
    """The runtimes a cut is priced for (:attr:`~nnscaler_jax.pipeline.pricing.RuntimeSetup.
    executors`): those that can run it, narrowed to ``Constraints.pipeline_executor``, or
    without it to the first (one program where it runs) unless ``pipeline_stages="auto"``
    (the stage DP weighs both). Tensor-parallel stages run one program per stage unless
    asked (``pipeline_executor='in-graph'``: one program, each stage on its devices' blocks,
    which runs only plans without shard_map regions of their own, co-sharded blocks
    aside);
    stages data-parallel inside either, but only the one program carries mutable
    collections. In a run of several processes only one program runs
    (:func:`per_stage_error`).

    Raises:
        PlanError: the executor asked is not one of them.
    """
    can = ("per-stage", "in-graph") if tensor and not collections else ("per-stage",) \
        if tensor else ("in-graph",) if collections else ("in-graph", "per-stage")
    asked = constraints.pipeline_executor
    err = per_stage_error()
    if err is not None and asked == "per-stage":
        raise err
    if err is not None:  # (several processes: one program, where it runs)
        can = tuple(e for e in can if e != "per-stage") or can
    if constraints.pipeline_overlap and tensor and asked != "in-graph":
        raise PlanError(
            f"Constraints(pipeline_overlap=True): this pipelined plan's stages are "
            f"tensor-parallel over mesh axes {list(tensor)}, which only the per-stage runtime "
            "runs by default, and it sends each result as its block ends; overlap is the "
            "in-graph runtime's. Drop pipeline_overlap, add "
            "Constraints(pipeline_executor='in-graph'), or use policy='dp'")
    if asked is None and constraints.pipeline_overlap:
        return ("in-graph",)
    if asked is None:  # (tensor-parallel stages in one program: only where asked)
        return can[:1] if tensor or constraints.pipeline_stages != "auto" else can
    if asked in can:
        return (asked,)
    why = (f"its stages are tensor-parallel over mesh axes {list(tensor)} and the model has "
           "mutable collections, which one program does not carry on such stages" if tensor else
           "the model has mutable collections (BatchNorm statistics), which only the one "
           "program carries")
    raise PlanError(f"Constraints(pipeline_executor={asked!r}): this pipelined plan runs only "
                    f"{can[0]!r}: {why}. Drop pipeline_executor, or use "
                    + ("policy='dp'" if tensor else "a model without mutable collections"))


def per_stage_error() -> PlanError | None:
    """The error of the per-stage runtime in a run of several processes (None: one process):
    it dispatches every stage's programs from one process, moving values between the stages'
    sub-meshes with ``jax.device_put``, which JAX does not do between processes."""
    import jax

    n = jax.process_count()
    if n == 1:
        return None
    err = PlanError(f"pipeline: this run has {n} processes, and the per-stage runtime "
                    "(pipeline_executor='per-stage') dispatches every stage's programs from "
                    "one process, moving values between the stages' devices, which JAX does "
                    "not do between processes; use Constraints(pipeline_executor='in-graph') "
                    "(tensor-parallel stages run there on each device's blocks)")
    return err


def _taken_ops(graph: Graph, paths: list[str], names: list[str], ends: tuple[int, int],
               casts: Mapping[int, int]) -> frozenset[int]:
    """The op indices interlaced's embedding block takes over (:func:`taken_by_embedding`,
    the runtime's :func:`embedding_first`), given the ops ``ends`` leaves outside the
    pipelined modules ``names``."""
    e, h = ends
    if (e, h) == (0, len(paths)):
        return frozenset()
    ops = graph.ops
    alias = {op.outputs[0].id: casts[op.id] for op in ops if op.id in casts}
    ins = [{alias.get(t.id, t.id) for t in op.inputs} for op in ops]
    outs = [{t.id for t in op.outputs} for op in ops]
    params = {t.id for t in graph.variables}
    free = {t.id for op in ops for t in op.inputs if t.role is not Role.VALUE} \
        | {t for o in outs[:e] for t in o} | set(alias)
    return frozenset(taken_by_embedding(paths, ins, outs, params, free, names, e, h))


def _outside(paths: list[str], stage_of: tuple, starts: tuple[int, ...]) -> tuple[int, int]:
    """``(e, h)``: the ops before ``e`` (embedding) and from ``h`` (head, loss) are outside the
    pipelined modules, as the runtime's :func:`segment_starts` cuts them for interlaced;
    ``(0, len(paths))`` when the chunk starts leave no room for them."""
    names = _pipelined(paths, stage_of)
    if not names:
        return 0, len(paths)
    first = first_positions(paths)
    e = min(first[n] for n in names)
    h = 1 + max(i for i, p in enumerate(paths) if any(p == n or p.startswith(n + "/")
                                                       for n in names))
    if (len(starts) > 1 and starts[1] <= e) or starts[-1] >= h:
        return 0, len(paths)
    return e, h


def _chunk_units(graph: Graph, starts: tuple[int, ...], batch: int,
                 model: CostModel, ends: tuple[int, int] | None = None,
                 groups: Mapping[int, bool | None] | None = None,
                 splits: Mapping[int, Any] | None = None, tp: int = 1,
                 taken: frozenset[int] = frozenset(),
                 ways: Mapping[int, int] | None = None) -> list[Unit]:
    """``[prefix, chunk 0, ..., chunk C-1, suffix]`` priced per sample: compute, kept
    activations, owned parameter bytes and the bytes sent to the next chunk. The prefix / suffix
    are the ops before / from ``ends`` (the embedding and the head + loss: interlaced runs them
    as its all-device blocks, the other schedules in the first / last chunk); the prefix
    carries the shared parameters. A parameter's cast to the compute precision is made by each
    chunk reading it (not sent, not kept). ``groups``: the op indices where a module a chunk
    may start at begins, with the recompute rules' flag of the module there
    (:func:`~nnscaler_jax.pipeline.rules.layer_flags`): each such run of ops is one layer,
    recomputed on its own inside its chunk's backward with ``recompute='layer'`` unless a rule
    forbids it, and with ``'chunk'`` when a rule asks for it (``_layer_kept``).

    ``splits`` (tensor-parallel stages, ``tp`` ways): compute and activations are one device's
    under the in-stage plan's splits (an op it leaves whole counts whole), times ``tp``: the
    runtime's pricing divides units by ``tp`` (:func:`~nnscaler_jax.pipeline.pricing.
    runtime_choices`), as for a Megatron layer split evenly; so are parameters, as the plan
    stores them (``ways``: variable id -> devices it is split over; a whole one counts ``tp``
    times), but the prefix's ``whole_param_bytes`` (interlaced's all-device blocks split
    them over every device themselves). ``taken``: the ops interlaced's
    embedding block takes over (:func:`taken_by_embedding`): a chunk's ``shared_bytes``
    leave out what they read (their compute, tiny, stays with the chunk)."""
    groups = groups or {}
    ops = graph.ops
    e, h = ends or (0, len(ops))
    bounds = list(zip(starts, list(starts[1:]) + [len(ops)], strict=True))
    casts = variable_casts(graph)
    sizes = {t.id: math.prod(t.shape) * itemsize(t) for op in ops for t in op.outputs}
    skip = taken | set(range(e)) | set(range(h, len(ops)))  # (read: the chunks' own ops)
    stored = (lambda t: tp / ways.get(t.id, tp)) if ways else (lambda t: 1.0)
    sent, owned, shared, read, whole = _crossing(graph, bounds, casts, sizes, skip, stored)
    saved, traffic = residual_outputs(graph), fused_bytes(graph)

    split = (splits or {}).get

    def act(a: int, b: int) -> float:
        return tp * sum(model.activation_bytes(o, split(o.id, ()), saved.get(o.id, ()))
                        for o in ops[a:b] if not o.regions and o.id not in casts) / batch

    def seconds(a: int, b: int) -> float:  # forward + backward, per sample
        return tp * sum(_op_cost(model, op, traffic, splits) for op in ops[a:b]) / batch

    priced = lambda a, b: (seconds(a, b), act(a, b))
    fwd = lambda a, b: seconds(a, b) / 3
    pre_out = _made_before(ops, e, casts, sizes)
    transient = lambda a, b: largest_output([op for op in ops[a:b] if op.id not in casts]) \
        / batch

    params = {t.id for t in graph.variables} | {op.outputs[0].id for op in ops
                                                 if op.id in casts}
    made_at = {t.id: i for i, op in enumerate(ops) for t in op.outputs if op.id not in casts}
    made_at.update((t.id, -1) for t in graph.inputs if t.role is Role.INPUT)
    units = [Unit("<prefix>", *priced(0, e), shared, pre_out / batch,
                  transient_bytes=transient(0, e),
                  wgrad_bytes=kept_for_weights(ops[:e], params) / batch,
                  whole_param_bytes=whole if ways else None)]
    for c, (a, b) in enumerate(bounds):
        a, b = max(a, e), min(b, h)
        cuts = [a] + sorted(g for g in groups if a < g < b) + [b]
        flag = [groups.get(g) for g in cuts[:-1]]
        kc, lc, again_c = _layer_kept(ops, cuts, made_at, act, fwd, [f is True for f in flag])
        kl, ll, again_l = _layer_kept(ops, cuts, made_at, act, fwd,
                                      [f is not False for f in flag])
        units.append(Unit(f"<chunk {c}>", seconds(a, b), kc / batch + lc, owned[c],
                          sent[c] / batch, TP_COLLECTIVES * (len(cuts) - 1),
                          layer_in_bytes=kl / batch, layer_act_bytes=ll,
                          transient_bytes=transient(a, b), chunk_again_s=again_c,
                          layer_again_s=again_l,
                          wgrad_bytes=kept_for_weights(ops[a:b], params) / batch,
                          shared_bytes=read[c]))
    return units + [Unit("<suffix>", *priced(h, len(ops)), 0.0, 0.0,
                         transient_bytes=transient(h, len(ops)),
                         wgrad_bytes=kept_for_weights(ops[h:], params) / batch)]


def _made_before(ops: Sequence[Op], e: int, casts: Mapping[int, int],
                 sizes: Mapping[int, int]) -> float:
    """Bytes of the values ops ``[:e]`` make (not parameter casts) that ops from ``e`` on
    read: what the prefix passes on."""
    last_read: dict[int, int] = {}
    for i, op in enumerate(ops):
        for t in op.inputs:
            last_read[t.id] = i
    return sum(sizes[t.id] for op in ops[:e] if op.id not in casts for t in op.outputs
               if last_read.get(t.id, -1) >= e)


def _crossing(graph: Graph, bounds: Sequence[tuple[int, int]], casts: Mapping[int, int],
              sizes: Mapping[int, int], skip: frozenset[int] | set[int] = frozenset(),
              weigh: Callable[[Any], float] = lambda t: 1.0,
              ) -> tuple[list[float], list[float], float, list[float], float]:
    """Per chunk the bytes it sends on (values later chunks read) and the parameter bytes only
    it reads; the bytes of the parameters several chunks (or none) read; and per chunk the
    bytes of those its ops read, but the ops at ``skip`` (the embedding / head segments and
    what interlaced's embedding block takes over); then the shared bytes again, unweighed. A
    parameter's bytes count ``weigh(t)`` times."""
    ops, C = graph.ops, len(bounds)
    chunk = [c for c, (a, b) in enumerate(bounds) for _ in range(a, b)]
    alias = {op.outputs[0].id: casts[op.id] for op in ops if op.id in casts}
    made: dict[int, int] = {}
    readers: dict[int, set[int]] = {}
    kept: dict[int, set[int]] = {}  # (the readers but the taken ops)
    for i, op in enumerate(ops):
        if op.id in casts:
            continue
        for t in op.inputs:
            readers.setdefault(alias.get(t.id, t.id), set()).add(chunk[i])
            if i not in skip:
                kept.setdefault(alias.get(t.id, t.id), set()).add(chunk[i])
        made.update((t.id, chunk[i]) for t in op.outputs)
    for t in graph.outputs:
        readers.setdefault(t.id, set()).add(C)
    sent = [0.0] * C
    for tid, c0 in made.items():
        last = max(readers.get(tid, {c0}))
        for c in range(c0, min(last, C - 1)):
            sent[c] += sizes[tid]
    owned, shared, whole, read = [0.0] * C, 0.0, 0.0, [0.0] * C
    for t in graph.variables:
        users = readers.get(t.id, set()) - {C}  # (an output that is a variable: nnx state)
        size = t.nbytes * weigh(t)
        if len(users) == 1:
            owned[next(iter(users))] += size
            continue
        shared, whole = shared + size, whole + t.nbytes
        for c in kept.get(t.id, set()) - {C}:
            read[c] += size
    return sent, owned, shared, read, whole


def _layer_kept(ops: Sequence[Op], cuts: Sequence[int], made_at: Mapping[int, int],
                act: Callable[[int, int], float], fwd: Callable[[int, int], float],
                again: Sequence[bool]) -> tuple[float, float, float]:
    """``(bytes kept, activations kept per sample, forward seconds recomputed again)`` of the
    ops ``cuts[0]:cuts[-1]`` run as the layers ``cuts[k]:cuts[k + 1]``, those ``again[k]``
    recomputed on their own in the backward (``jax.checkpoint``). Such a layer keeps the values
    it reads that earlier ops made (``made_at``: tensor id -> the index of the op making it, -1
    for example inputs; variables, constants and parameter casts are not in it; each value
    once), and one of them has its activations (``act(i, j)``, per sample) live at a time; the
    other layers keep their activations."""
    kept, plain, seen = 0.0, 0.0, set()
    for (a, b), ck in zip(itertools.pairwise(cuts), again, strict=True):
        if not ck:
            plain += act(a, b)
            continue
        for op in ops[a:b]:
            for t in op.inputs:
                if made_at.get(t.id, a) < a and t.id not in seen:
                    seen.add(t.id)
                    kept += math.prod(t.shape) * itemsize(t)
    pairs = [p for p, ck in zip(itertools.pairwise(cuts), again, strict=True) if ck]
    return (kept, plain + max((act(a, b) for a, b in pairs), default=0.0),
            sum(fwd(a, b) for a, b in pairs))
