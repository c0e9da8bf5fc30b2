"""``Constraints``: what users fix or forbid; validated against the graph and mesh."""

from __future__ import annotations

import fnmatch
import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from nnscaler_jax.capture.precision import precision_name
from nnscaler_jax.errors import ConstraintError
from nnscaler_jax.ir.graph import Graph
from nnscaler_jax.ir.remat import selective
from nnscaler_jax.mesh.axes import data_axes, stage_axis

__all__ = ["Constraints", "Rule", "parse_bytes"]


@dataclass(frozen=True)
class Rule:
    """A per-op rule, selecting ops by module path glob and/or primitive.

    Attributes:
        module: glob over module paths (``'blk*/mlp/*'``), None for any: the ops whose own
            module path it matches (``*`` crosses ``/``: ``'layers_0*'`` selects
            ``layers_0/blocks_1/attn``'s ops; ``'layers_0'`` only ops directly in
            ``layers_0``, and a rule that matches none names the glob that would).
        primitive: primitive name, None for any.
        dims: the op may be split only along these annotated dims.
        axes: ... and only over these mesh axes.
        replicate: the op is not split at all.
        recompute: True: the module paths this rule selects are recomputed in the backward pass
            (their activations are not kept; one remat group per top module); ``"selective"``:
            recomputed keeping their matmul outputs but the attention scores (Megatron-LM's
            selective recompute, :func:`nnscaler_jax.ir.remat.no_growing_dots_saveable`;
            SPMD plans only); False: the search may not recompute them; None (default): the
            search decides (it recomputes layers, selectively or fully, only when no plan fits
            the memory budget otherwise).
    """

    module: str | None = None
    primitive: str | None = None
    dims: tuple[str, ...] | None = None
    axes: tuple[str, ...] | None = None
    replicate: bool = False
    recompute: bool | str | None = None

    def __post_init__(self) -> None:
        if self.recompute not in (None, True, False, "selective"):
            raise ConstraintError(
                f"Rule(recompute={self.recompute!r}): recompute is True (the whole module), "
                "'selective' (keeping its matmul outputs), False (never) or None (the search "
                "decides)")
        for name in ("dims", "axes"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, str) or not all(isinstance(v, str) for v in _iter(value)):
                raise ConstraintError(_rule_names_error(name, value))
            object.__setattr__(self, name, tuple(value))

    def matches(self, op) -> bool:
        if self.primitive is not None and op.primitive != self.primitive:
            return False
        return self.module is None or fnmatch.fnmatchcase(op.module_path, self.module)

    def __str__(self) -> str:
        parts = [f"{k}={v!r}" for k, v in vars(self).items() if v not in (None, False)]
        return f"Rule({', '.join(parts)})"


def _iter(value: object) -> tuple:
    try:
        return tuple(value)  # type: ignore[arg-type]
    except TypeError:
        return (value,)


def _rule_names_error(field_name: str, value: object) -> str:
    """A ``Rule(dims=...)`` / ``Rule(axes=...)`` that is not a tuple of names."""
    example = {"dims": "('m0', 'n0')", "axes": "('model',)"}[field_name]
    what = {"dims": "annotated dim names", "axes": "mesh axis names"}[field_name]
    one = f"({value!r},)" if isinstance(value, str) else example
    return (f"Rule({field_name}={value!r}): {field_name} is a tuple of {what}, e.g. "
            f"{field_name}={one}")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: float | str) -> int:
    """A positive byte count from an int / float or a string such as ``"32GiB"``, ``"80 GB"``.

    >>> parse_bytes("32GiB"), parse_bytes("1.5 MB"), parse_bytes(4096)
    (34359738368, 1500000, 4096)

    Raises:
        ConstraintError: not a positive size, or an unknown unit.
    """
    bad = ConstraintError(
        f"Constraints(max_memory_per_device={value!r}): give a positive byte count (e.g. "
        f"34359738368) or a size string such as '32GiB' or '80GB' (units: B, KB, MB, GB, TB, "
        "KiB, MiB, GiB, TiB)")
    if isinstance(value, bool):
        raise bad
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        if m is None or m.group(2).lower() not in _UNITS:
            raise bad
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not isinstance(value, int | float) or not (value > 0 and math.isfinite(value)):
        raise bad
    return int(value)


def _iterable(value: object) -> bool:
    try:
        iter(value)  # type: ignore[call-overload]
    except TypeError:
        return False
    return True


def _is_int(value: object) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _shares(value: object) -> tuple[int, ...] | None:
    """``batch_shares``: None, or a tuple of two or more positive ints."""
    if value is None:
        return None
    if isinstance(value, str) or not _iterable(value) or len(tuple(value)) < 2 or not all(
            _is_int(v) and v > 0 for v in value):  # type: ignore[union-attr]
        raise ConstraintError(
            f"Constraints(batch_shares={value!r}): give each data-parallel group's rows of a "
            "step's batch, one positive int per index of the mesh's first data axis (two or "
            "more), e.g. batch_shares=(10, 6) on jax.make_mesh((2, 4), ('data', 'model'))")
    return tuple(int(v) for v in value)  # type: ignore[union-attr]


def _logical_rules(value: object) -> tuple[tuple[str, str | None], ...]:
    """``logical_rules`` as a tuple of ``(logical name, mesh axis or None)`` pairs."""
    bad = ConstraintError(
        f"Constraints(logical_rules={value!r}): give (logical name, mesh axis or None) pairs, "
        "e.g. logical_rules=(('embed', 'model'), ('batch', 'data'), ('mlp', None))")
    if isinstance(value, str) or not _iterable(value):
        raise bad
    pairs = []
    for r in value:  # type: ignore[union-attr]
        if isinstance(r, str) or not _iterable(r):
            raise bad
        r = tuple(r)
        if len(r) != 2 or not isinstance(r[0], str) or not (r[1] is None
                                                             or isinstance(r[1], str)):
            raise bad
        pairs.append(r)
    return tuple(pairs)


@dataclass(frozen=True)
class Constraints:
    """What a plan must satisfy. All fields optional (see the contract).

    ``logical_rules``: ``(logical name, mesh axis or None)`` pairs mapping the names of
    ``nn.with_logical_partitioning`` params to mesh axes (default: the rules in the box).

    ``precision``: the compute precision, ``"bfloat16"``, ``"float16"`` or ``"float32"`` (a
    dtype such as ``jnp.bfloat16`` or ``"bf16"`` too; None, the default: the model's own
    dtypes). Params and floating inputs are cast to it on entry; variables, gradients and
    optimizer state stay in their stored dtype (float32 master weights), and the plan records it
    (:mod:`nnscaler_jax.capture.precision`).

    ``pipeline_pivots``: module path globs (matching whole path segments: ``'h_*'``,
    ``'encoder/block_*'``) whose starts may begin a pipeline stage; with them (or for a model
    that is not a stack of identical layers) stages are cut at module boundaries
    (:mod:`nnscaler_jax.pipeline.cut`). A glob matching no module is a ``ConstraintError``.

    ``attention``: ``"fused"`` runs every attention block the graph holds
    (:mod:`nnscaler_jax.ir.attention`) as one fused op, a flash-attention kernel on GPUs
    (Pallas' Triton ``mha``), priced as one: its causal half of two matmuls forward, five
    backward, no score-sized buffer. Where the model splits the sequence, the search chooses
    per attention op between moving it to the heads around attention (all-to-all, as
    DeepSpeed-Ulysses) and context parallelism: the op split on its sequence, K / V rotated
    around the devices (:mod:`nnscaler_jax.lower.ring`), zigzag-balanced when causal, ring
    otherwise. ``"ring"`` / ``"zigzag"``: fused, and a sequence-split op runs with that layout
    (the search prices it so). None (the default): attention runs as the model writes it.

    ``pipeline_executor``: how a pipelined plan runs. ``"in-graph"``: one program over the
    stage axis walking the schedule's step table in lock step (a time step lasts as long as
    its slowest stage); ``"per-stage"``: one program per stage dispatched from the host, each
    stage running its blocks as their inputs arrive (1F1B then takes GPipe's time), a model
    cut at module boundaries; the only one for tensor-parallel stages of a cut model. None
    (the default): in-graph where it runs, but with ``pipeline_stages="auto"`` the stage DP
    prices both where both run and keeps the faster (ties: in-graph). The plan records it
    (``plan.pipeline.executor``).

    ``pipeline_overlap``: the in-graph runtime sends each time step's activations and
    cotangents to the neighbouring stages during the next step, beside its compute (True),
    or after the step (False). Overlapped, a step lasts its compute or its transfers,
    whichever is longer, but a result reaches the next stage a step later (a longer step
    table). None (the default): the planner prices both and keeps the faster (ties: after
    the step). The plan records it (``plan.pipeline.overlap``).

    ``stage_plans``: per pipeline stage, the in-stage plan its runtime runs (a
    :class:`~nnscaler_jax.plan.plan.Plan` of the stage's ops on its tensor-parallel axes, e.g.
    planned for the stage's own device kind: :meth:`~nnscaler_jax.pipeline.hetero.HeteroPlan.
    constraints` sets them), matched to the traced stage by its ops and variables (one that
    does not match is planned again, with a warning). Empty (the default): the planner's and
    the runtime's own. The plan records them (``plan.pipeline.stage_plans``).

    ``batch_shares``: uneven data parallelism over groups of devices of different speed (a
    cluster of several GPU kinds): the mesh's first data axis indexes the groups, group ``i``
    takes ``batch_shares[i]`` consecutive rows of each step's batch (they sum to it) and runs
    the whole model on them as its own program on its devices (the other mesh axes: the
    policy's plan of its rows), and the groups' gradients are averaged weighted by their rows
    before every group applies the same update (``pm.train_step``:
    :class:`~nnscaler_jax.train.grouped_step.GroupStep`). None (the default): even shares,
    one program.

    >>> Constraints(precision="bf16").precision
    'bfloat16'
    """

    max_memory_per_device: int | str | None = None
    pipeline_stages: int | Literal["auto"] | None = None
    microbatches: int | None = None
    schedule: Literal["1f1b", "gpipe", "interleaved", "interlaced", "nf1b"] | Any | None = None
    zero: int | None = None
    rules: tuple[Rule, ...] = field(default_factory=tuple)
    logical_rules: tuple[tuple[str, str | None], ...] = ()
    precision: Literal["float32", "bfloat16", "float16"] | None = None
    pipeline_pivots: tuple[str, ...] = ()
    attention: Literal["fused", "ring", "zigzag"] | None = None
    pipeline_executor: Literal["in-graph", "per-stage"] | None = None
    pipeline_overlap: bool | None = None
    batch_shares: tuple[int, ...] | None = None
    stage_plans: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.rules, Rule | str) or not _iterable(self.rules):
            raise ConstraintError(
                f"Constraints(rules={self.rules!r}): rules is a tuple of Rule values, e.g. "
                "rules=(Rule(module='fc1', replicate=True),)")
        object.__setattr__(self, "rules", tuple(self.rules))
        object.__setattr__(self, "logical_rules", _logical_rules(self.logical_rules))
        object.__setattr__(self, "pipeline_pivots", _pivots(self.pipeline_pivots))
        if self.zero is not None and (not _is_int(self.zero) or self.zero not in (0, 1, 2, 3)):
            raise ConstraintError(f"Constraints(zero={self.zero!r}): ZeRO stage is 0, 1, 2 or 3")
        if self.microbatches is not None and (not _is_int(self.microbatches)
                                              or self.microbatches < 1):
            raise ConstraintError(
                f"Constraints(microbatches={self.microbatches!r}): use a positive int (the "
                "micro-batches a step's batch is split into), or None to let the planner choose")
        stages = self.pipeline_stages
        if stages is not None and stages != "auto" and (not _is_int(stages) or stages < 1):
            raise ConstraintError(f"Constraints(pipeline_stages={stages!r}): use a positive int "
                                  "or 'auto'")
        for name in ("zero", "microbatches", "pipeline_stages"):  # numpy ints as plain ints
            if _is_int(getattr(self, name)):
                object.__setattr__(self, name, int(getattr(self, name)))
        object.__setattr__(self, "schedule", _schedule(self.schedule, self.pipeline_stages,
                                                       self.microbatches))
        object.__setattr__(self, "precision",
                           precision_name(self.precision,
                                          f"Constraints(precision={self.precision!r})"))
        if self.attention not in (None, "fused", "ring", "zigzag"):
            raise ConstraintError(f"Constraints(attention={self.attention!r}): use 'fused' (each "
                                  "attention block as one flash kernel, the search choosing how "
                                  "a split sequence runs), 'ring' or 'zigzag' (fused, a split "
                                  "sequence runs that way) or None (as written)")
        if self.pipeline_executor not in (None, "in-graph", "per-stage"):
            raise ConstraintError(
                f"Constraints(pipeline_executor={self.pipeline_executor!r}): use 'in-graph' "
                "(one program over the stage axis, in lock step), 'per-stage' (one program per "
                "stage, each running as its inputs arrive) or None (the planner picks)")
        if self.pipeline_overlap not in (None, True, False):
            raise ConstraintError(
                f"Constraints(pipeline_overlap={self.pipeline_overlap!r}): use True (the "
                "in-graph runtime sends a time step's results during the next step), False "
                "(after it) or None (the planner prices both)")
        if self.pipeline_overlap and self.pipeline_executor == "per-stage":
            raise ConstraintError(
                "Constraints(pipeline_overlap=True, pipeline_executor='per-stage'): the "
                "per-stage runtime sends each result as its block ends; overlap is the "
                "in-graph runtime's. Drop one of them")
        object.__setattr__(self, "batch_shares", _shares(self.batch_shares))
        self._check_stage_plans()
        if self.batch_shares is not None and self.pipeline_stages not in (None, 1):
            raise ConstraintError(
                f"Constraints(batch_shares={self.batch_shares}, pipeline_stages="
                f"{self.pipeline_stages!r}): uneven batch shares run whole-model groups side "
                "by side; pipeline stages are the other answer. Drop one of them")
        if self.max_memory_per_device is not None:
            object.__setattr__(self, "max_memory_per_device",
                               parse_bytes(self.max_memory_per_device))
        for r in self.rules:
            if not isinstance(r, Rule):
                raise ConstraintError(f"Constraints(rules=...) takes Rule values, got {r!r}")

    def check(self, graph: Graph, mesh_axes: dict[str, int]) -> None:
        """Raise ``ConstraintError`` (a ``PlanError``) for a rule or field that cannot be met on
        this graph and mesh.

        The pipeline fields are checked against the mesh here; whether the model's layers can
        be staged is the pipeline's business (:mod:`nnscaler_jax.pipeline.configure`).
        """
        self._check_pipeline(mesh_axes)
        self.share_axis(mesh_axes)
        _check_pivots(self.pipeline_pivots, graph)
        for r in self.rules:
            if r.replicate and (r.dims or r.axes):
                raise ConstraintError(f"{r} contradicts itself: it replicates its ops and names "
                                      "dims / axes to split them over; drop one")
            for a in r.axes or ():
                if a not in mesh_axes:
                    raise ConstraintError(f"{r}: mesh axis '{a}' is not in the mesh {mesh_axes}",
                                          axis=a)
            ops = [op for op in graph.walk() if r.matches(op)]
            if not ops:
                under = r.module is not None and any(
                    fnmatch.fnmatchcase(p, r.module.rstrip("/") + "/*") for p in graph.module_paths)
                m = (r.module or "").rstrip("/")
                hint = (f" ('{m}' has no ops of its own, and a rule selects the ops whose own "
                        f"path it matches: for the modules under it use module='{m}*' (or "
                        f"'{m}/*'))" if under else "")
                raise ConstraintError(f"{r} matches no op{hint}; module paths include "
                                      f"{sorted(graph.module_paths)[:12]}")
            if r.dims:
                for op in ops:
                    missing = set(r.dims) - set(op.annotation.kinds())
                    if missing == set(r.dims):
                        raise ConstraintError(
                            f"{r}: op '{op.primitive}' at '{op.module_path}' (annotation "
                            f"'{op.anno}', shapes {[t.shape for t in op.inputs]}) has none of the "
                            f"dims {list(r.dims)}", op=op.primitive, module_path=op.module_path,
                            shapes=tuple(t.shape for t in op.inputs))
                    _check_divisible(r, op, mesh_axes)
        for r in self.rules:
            if r.recompute is not None and r.primitive is not None:
                raise ConstraintError(
                    f"{r}: recompute selects module paths, not primitives (a remat group is a "
                    f"module's ops); use Rule(module='{r.module or '*'}', recompute="
                    f"{r.recompute})", op=r.primitive)
        for i, a in enumerate(self.rules):
            for b in self.rules[i + 1:]:
                op = next((op for op in graph.walk() if a.matches(op) and b.matches(op)), None)
                why = _contradiction(a, b) if op is not None else None
                if why:
                    raise ConstraintError(
                        f"{a} and {b} contradict on op '{op.primitive}' at "
                        f"'{op.module_path or '<top>'}' (annotation '{op.anno}', input shapes "
                        f"{[t.shape for t in op.inputs]}): {why}. Narrow one rule's module glob "
                        "/ primitive, or merge them into one Rule", op=op.primitive,
                        module_path=op.module_path, shapes=tuple(t.shape for t in op.inputs))

    def recompute_groups(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """``(forced, forbidden)`` module path globs of the recompute rules."""
        forced = tuple((r.module or "*") if r.recompute is True else selective(r.module or "*")
                       for r in self.rules if r.recompute in (True, "selective"))
        forbidden = tuple(r.module or "*" for r in self.rules if r.recompute is False)
        return forced, forbidden

    def _check_stage_plans(self) -> None:
        from nnscaler_jax.plan.plan import Plan

        plans = self.stage_plans
        if isinstance(plans, Plan) or not _iterable(plans) or not all(
                isinstance(p, Plan) for p in plans):
            raise ConstraintError(
                f"Constraints(stage_plans={plans!r}): give one Plan per pipeline stage (each "
                "stage's in-stage plan of its ops on its tensor-parallel axes, e.g. "
                "HeteroPlan.constraints(graph)'s), or () for the runtime to plan them")
        object.__setattr__(self, "stage_plans", tuple(plans))
        stages = self.pipeline_stages
        if self.stage_plans and (not _is_int(stages) or len(self.stage_plans) != stages):
            raise ConstraintError(
                f"Constraints(stage_plans=<{len(self.stage_plans)} plans>, pipeline_stages="
                f"{stages!r}): one plan per stage of a fixed stage count; give "
                f"pipeline_stages={len(self.stage_plans)}")

    def share_axis(self, mesh_axes: dict[str, int]) -> str | None:
        """The mesh axis whose indices take :attr:`batch_shares` (its first data axis, of
        their count), None without shares.

        Raises:
            ConstraintError: no data axis, or one of another size.
        """
        if self.batch_shares is None:
            return None
        axes = data_axes(mesh_axes)
        n = len(self.batch_shares)
        if not axes or mesh_axes[axes[0]] != n:
            raise ConstraintError(
                f"Constraints(batch_shares={self.batch_shares}) gives {n} groups' rows; they "
                f"are the indices of the mesh's first data axis, and the mesh has {mesh_axes}. "
                f"Build the mesh with a first data axis of size {n}, e.g. "
                f"jax.make_mesh(({n}, 4), ('data', 'model'))")
        return axes[0]

    def _check_pipeline(self, mesh_axes: dict[str, int]) -> None:
        stages, axis = self.pipeline_stages, stage_axis(mesh_axes)
        if stages in (None, 1):
            return
        if stages == "auto":
            if axis is None:
                raise ConstraintError(
                    "Constraints(pipeline_stages='auto') chooses micro-batches and schedule for "
                    "the stages of the mesh's 'stage' (or 'pipe') axis; the mesh has "
                    f"{mesh_axes}. Add one, e.g. jax.make_mesh((4, 2), ('stage', 'data')), or "
                    "run nnscaler_jax.pipeline.stage_dp.search_stages to choose a stage count")
            return
        if axis is None or mesh_axes[axis] != stages:
            raise ConstraintError(
                f"Constraints(pipeline_stages={stages}) needs a mesh axis 'stage' (or 'pipe') "
                f"of size {stages}; the mesh has {mesh_axes}. E.g. "
                f"jax.make_mesh(({stages}, 2), ('stage', 'data'))")


SCHEDULE_NAMES = ("1f1b", "eager-1f1b", "gpipe", "interleaved", "interlaced", "nf1b", "zb-h1")


def _schedule(sched: Any, stages: Any, microbatches: int | None) -> Any:
    """``Constraints(schedule=...)``: a built-in name, or a schedule written with ``op_order``
    (a draft with ``finish()`` is finished here; a finished one has ``steps``), whose stage and
    micro-batch counts must agree with the other fields."""
    if sched is None or isinstance(sched, str):
        if sched not in (None, *SCHEDULE_NAMES):
            raise ConstraintError(f"Constraints(schedule={sched!r}): use one of "
                                  f"{', '.join(map(repr, SCHEDULE_NAMES))}, or a schedule "
                                  "written with op_order (nnscaler_jax.pipeline.order."
                                  "ScheduleDraft)")
        return sched
    if callable(getattr(sched, "finish", None)):
        sched = sched.finish()
    if not all(hasattr(sched, a) for a in ("steps", "stages", "microbatches", "name")):
        raise ConstraintError(f"Constraints(schedule={sched!r}): use a schedule name or a "
                              "Schedule / ScheduleDraft (nnscaler_jax.pipeline.order)")
    if _is_int(stages) and stages != sched.stages:
        raise ConstraintError(f"Constraints(pipeline_stages={stages}) contradicts the "
                              f"schedule's {sched.stages} stages; drop one or make them agree")
    if microbatches is not None and microbatches != sched.microbatches:
        raise ConstraintError(f"Constraints(microbatches={microbatches}) contradicts the "
                              f"schedule's {sched.microbatches} micro-batches; drop one or make "
                              "them agree")
    return sched


def _contradiction(a: Rule, b: Rule) -> str | None:
    """Why two rules on one op leave nothing to choose (None: they do not contradict)."""
    if a.replicate != b.replicate and (a.dims or a.axes or b.dims or b.axes):
        return "one replicates, the other splits"
    if a.dims is not None and b.dims is not None and not set(a.dims) & set(b.dims):
        return f"no dim is allowed by both ({list(a.dims)} vs {list(b.dims)})"
    if a.axes is not None and b.axes is not None and not set(a.axes) & set(b.axes):
        return f"no mesh axis is allowed by both ({list(a.axes)} vs {list(b.axes)})"
    return None


def _check_divisible(rule: Rule, op, mesh_axes: dict[str, int]) -> None:
    """Raise unless some dim ``rule`` lets ``op`` split divides by some mesh axis it allows
    (ops with none of its dims splittable are the business of the other checks)."""
    anno = op.annotation
    dims = [d for d in rule.dims or () if d in anno.splittable()]
    axes = [a for a in (rule.axes or mesh_axes) if mesh_axes.get(a, 1) > 1]
    if not dims or not axes:
        return
    sizes = op.dim_sizes()
    if any(sizes[d] % mesh_axes[a] == 0 for d in dims for a in axes):
        return
    shapes = tuple(t.shape for t in op.inputs)
    what = " or ".join(f"dim '{d}' (size {sizes[d]})" for d in dims)
    over = ", ".join(f"'{a}' ({mesh_axes[a]})" for a in axes)
    raise ConstraintError(
        f"{rule} cannot be met on op '{op.primitive}' at '{op.module_path or '<top>'}' "
        f"(annotation '{op.anno}', shapes {list(shapes)}): no mesh axis it allows ({over}) "
        f"divides {what}. Use sizes those axes divide, allow other dims or axes, or keep the "
        f"op whole with Rule(module={rule.module!r}, replicate=True)",
        op=op.primitive, module_path=op.module_path, axis=",".join(axes), shapes=shapes)


def _pivots(value: object) -> tuple[str, ...]:
    """``pipeline_pivots`` as a tuple of module path globs."""
    if isinstance(value, str) or not _iterable(value) or not all(
            isinstance(g, str) and g for g in value):  # type: ignore[union-attr]
        one = f"({value!r},)" if isinstance(value, str) else "('encoder/block_*', 'h_*')"
        raise ConstraintError(
            f"Constraints(pipeline_pivots={value!r}): give a tuple of module path globs whose "
            f"starts may begin a pipeline stage, e.g. pipeline_pivots={one}")
    return tuple(value)  # type: ignore[arg-type]


def pivot_paths(glob: str, module_paths: set[str] | list[str]) -> list[str]:
    """The module paths (and their ancestors) ``glob`` matches, segment by segment (``*`` does
    not cross ``/``: ``'h_*'`` matches ``h_0`` but not ``h_0/attn``).

    >>> pivot_paths("enc/block_*", ["enc/block_0/attn", "enc/block_1/mlp", "enc/norm"])
    ['enc/block_0', 'enc/block_1']
    """
    want = glob.strip("/").split("/")
    found: dict[str, None] = {}
    for path in module_paths:
        parts = path.split("/") if path else []
        if len(parts) >= len(want) and all(
                fnmatch.fnmatchcase(p, g) for p, g in zip(parts, want, strict=False)):
            found["/".join(parts[:len(want)])] = None
    return sorted(found)


def _check_pivots(pivots: tuple[str, ...], graph: Graph) -> None:
    paths = graph.module_paths
    for glob in pivots:
        if not pivot_paths(glob, paths):
            tops = sorted({p.split("/")[0] for p in paths if p})
            raise ConstraintError(
                f"Constraints(pipeline_pivots=...): glob {glob!r} matches no module; module "
                f"paths include {tops[:12]} (globs match whole path segments: 'h_*', "
                "'encoder/block_*')", module_path=glob)
