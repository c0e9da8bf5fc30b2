"""Pipeline schedules as validated step tables (nnScaler's ``op_order`` across stages).

A :class:`Schedule` lists, per stage (one device group along the mesh's stage axis), the order of
its steps ``Step(kind, microbatch, virtual)``: ``'F'`` / ``'B'`` of micro-batch ``m`` on the
stage's virtual chunk ``v`` (model chunk ``c = v * stages + stage``; ``virtual == 1`` unless
interleaved). :func:`timeline` places every step at the earliest unit time step at which its
data dependencies are done (a result sent at step ``t`` is usable at ``t + 1``); the runtime
(:mod:`nnscaler_jax.pipeline.runtime`) executes exactly that table.

>>> s = one_f_one_b(2, 4)
>>> print(format_schedule(s))
schedule 1f1b: 2 stages x 4 micro-batches, 10 steps
stage 0 | F0 F1 .  B0 F2 B1 F3 B2 .  B3
stage 1 | .  F0 B0 F1 B1 F2 B2 F3 B3 .
>>> peak_in_flight(s), peak_in_flight(gpipe(2, 4))
((2, 1), (4, 4))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from nnscaler_jax.errors import PlanError

__all__ = [
    "Schedule",
    "Step",
    "build",
    "format_schedule",
    "gpipe",
    "interleaved",
    "one_f_one_b",
    "peak_in_flight",
    "plot_gantt",
    "timeline",
    "validate",
]

Kind = Literal["F", "B"]
SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True, slots=True)
class Step:
    """One unit of work: forward or backward of ``microbatch`` on virtual chunk ``virtual``."""

    kind: Kind
    microbatch: int
    virtual: int = 0

    def __str__(self) -> str:
        v = f".{self.virtual}" if self.virtual else ""
        return f"{self.kind}{self.microbatch}{v}"


@dataclass(frozen=True, slots=True)
class Schedule:
    """Per-stage step orders.

    Attributes:
        name: ``'gpipe'``, ``'1f1b'``, ``'interleaved'`` or ``'custom'``.
        stages: devices groups along the stage axis.
        microbatches: micro-batches per training step.
        virtual: model chunks per stage (interleaved 1F1B), 1 otherwise.
        steps: ``steps[s]`` is stage ``s``'s ordered steps.
    """

    name: str
    stages: int
    microbatches: int
    virtual: int
    steps: tuple[tuple[Step, ...], ...]

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    def to_lists(self) -> list[list[list]]:
        """JSON-ready ``[[kind, m, v], ...]`` per stage."""
        return [[[x.kind, x.microbatch, x.virtual] for x in row] for row in self.steps]


def _check_sizes(stages: int, microbatches: int, virtual: int = 1) -> None:
    if stages < 1 or microbatches < 1 or virtual < 1:
        raise PlanError(f"a schedule needs stages >= 1, microbatches >= 1 and virtual >= 1, got "
                        f"stages={stages}, microbatches={microbatches}, virtual={virtual}")


def gpipe(stages: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards: every micro-batch is in flight on every stage."""
    _check_sizes(stages, microbatches)
    row = tuple(Step("F", m) for m in range(microbatches)) + tuple(
        Step("B", m) for m in range(microbatches))
    return Schedule("gpipe", stages, microbatches, 1, (row,) * stages)


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B: stage ``s`` runs ``stages - s - 1`` warm-up forwards, then alternates F and B."""
    _check_sizes(stages, microbatches)
    rows = []
    for s in range(stages):
        warm = min(stages - s - 1, microbatches)
        row = [Step("F", m) for m in range(warm)]
        for i in range(microbatches - warm):
            row += [Step("F", warm + i), Step("B", i)]
        row += [Step("B", m) for m in range(microbatches - warm, microbatches)]
        rows.append(tuple(row))
    return Schedule("1f1b", stages, microbatches, 1, tuple(rows))


def interleaved(stages: int, microbatches: int, virtual: int) -> Schedule:
    """Interleaved 1F1B (Megatron): ``virtual`` model chunks per stage, chunk ``v * stages + s``
    on stage ``s``; micro-batches go through in groups of ``stages``.

    Raises:
        PlanError: ``microbatches`` is not a multiple of ``stages``.
    """
    _check_sizes(stages, microbatches, virtual)
    if microbatches % stages:
        raise PlanError(f"interleaved({stages}, {microbatches}, {virtual}): micro-batches must be "
                        f"a multiple of the stages; use "
                        f"microbatches={stages * max(1, microbatches // stages)}")
    total = microbatches * virtual

    def unit(i: int, backward: bool) -> tuple[int, int]:
        group, r = divmod(i, stages * virtual)
        v, k = divmod(r, stages)
        return group * stages + k, (virtual - 1 - v) if backward else v

    rows = []
    for s in range(stages):
        warm = min((stages - s - 1) * 2 + (virtual - 1) * stages, total)
        row = [Step("F", *unit(i, False)) for i in range(warm)]
        for i in range(total - warm):
            row += [Step("F", *unit(warm + i, False)), Step("B", *unit(i, True))]
        row += [Step("B", *unit(i, True)) for i in range(total - warm, total)]
        rows.append(tuple(row))
    return Schedule("interleaved", stages, microbatches, virtual, tuple(rows))


def build(name: str, stages: int, microbatches: int, virtual: int = 2) -> Schedule:
    """The built-in schedule ``name`` (``'gpipe'``, ``'1f1b'``, ``'interleaved'``)."""
    if name == "gpipe":
        return gpipe(stages, microbatches)
    if name == "1f1b":
        return one_f_one_b(stages, microbatches)
    if name == "interleaved":
        return interleaved(stages, microbatches, virtual)
    raise PlanError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}")


def _deps(step: Step, stage: int, sched: Schedule) -> list[tuple[Step, int]]:
    """Steps (with their stage) that must finish before ``step`` on ``stage`` starts."""
    S, C = sched.stages, sched.chunks
    c = step.virtual * S + stage
    m = step.microbatch
    at = lambda kind, c2: (Step(kind, m, c2 // S), c2 % S)
    if step.kind == "F":
        return [at("F", c - 1)] if c > 0 else []
    deps = [at("F", c)]
    if c < C - 1:
        deps.append(at("B", c + 1))
    return deps


def timeline(sched: Schedule) -> list[list[Step | None]]:
    """The step table: ``table[t][s]`` is what stage ``s`` does at time step ``t`` (or idle).

    Each stage runs its steps in its order, each at the earliest step after its dependencies'
    steps (unit time per step; results reach the neighbour for the next step).

    Raises:
        PlanError: the schedule is invalid (see :func:`validate`).
    """
    validate(sched, _table=False)
    S = sched.stages
    done: dict[tuple[Step, int], int] = {}
    pos = [0] * S
    table: list[list[Step | None]] = []
    remaining = sum(len(r) for r in sched.steps)
    t = 0
    while remaining:
        row: list[Step | None] = [None] * S
        for s in range(S):
            if pos[s] < len(sched.steps[s]):
                st = sched.steps[s][pos[s]]
                if all(done.get(d, t) < t for d in _deps(st, s, sched)):
                    row[s] = st
        if not any(row):
            blocked = []
            for s in range(S):
                if pos[s] < len(sched.steps[s]):
                    st = sched.steps[s][pos[s]]
                    miss = [f"{d} on stage {ds}" for d, ds in _deps(st, s, sched)
                            if (d, ds) not in done]
                    blocked.append(f"stage {s} step {pos[s]} '{st}' waits for {', '.join(miss)}")
            raise PlanError(f"schedule {sched.name!r} deadlocks at time step {t}: "
                            + "; ".join(blocked)
                            + ". Each stage's order must let every dependency run first: F of "
                            "(m, chunk c) after F of (m, c-1); B of (m, c) after F of (m, c) and "
                            "B of (m, c+1)")
        for s, st in enumerate(row):
            if st is not None:
                done[(st, s)] = t
                pos[s] += 1
                remaining -= 1
        table.append(row)
        t += 1
    return table


def validate(sched: Schedule, *, _table: bool = True) -> None:
    """Check that ``sched`` is a complete, executable schedule.

    Every ``(F|B, microbatch, chunk)`` appears exactly once on the stage holding the chunk, and
    the per-stage orders respect the data dependencies (F of ``(m, c)`` after F of
    ``(m, c-1)``; B of ``(m, c)`` after F of ``(m, c)`` and B of ``(m, c+1)``).

    Raises:
        PlanError: naming the offending step and stage.
    """
    if len(sched.steps) != sched.stages:
        raise PlanError(f"schedule {sched.name!r} lists {len(sched.steps)} stages, declares "
                        f"{sched.stages}")
    for s, row in enumerate(sched.steps):
        seen: dict[Step, int] = {}
        for i, st in enumerate(row):
            if st.kind not in ("F", "B"):
                raise PlanError(f"schedule {sched.name!r}: stage {s} step {i} has kind "
                                f"{st.kind!r}; use 'F' or 'B'")
            if not (0 <= st.microbatch < sched.microbatches and 0 <= st.virtual < sched.virtual):
                raise PlanError(f"schedule {sched.name!r}: stage {s} step {i} '{st}' names "
                                f"micro-batch {st.microbatch} / chunk {st.virtual}, outside "
                                f"{sched.microbatches} micro-batches x {sched.virtual} chunks")
            if st in seen:
                raise PlanError(f"schedule {sched.name!r}: stage {s} runs '{st}' twice (steps "
                                f"{seen[st]} and {i}); every (kind, micro-batch, chunk) runs "
                                "exactly once")
            seen[st] = i
        for m in range(sched.microbatches):
            for v in range(sched.virtual):
                for k in ("F", "B"):
                    if Step(k, m, v) not in seen:
                        raise PlanError(f"schedule {sched.name!r}: stage {s} never runs "
                                        f"'{Step(k, m, v)}' ({k} of micro-batch {m}, chunk {v})")
        for i, st in enumerate(row):
            if st.kind == "B" and seen[Step("F", st.microbatch, st.virtual)] > i:
                raise PlanError(f"schedule {sched.name!r}: stage {s} step {i} '{st}' comes "
                                f"before its forward 'F{st.microbatch}' (step "
                                f"{seen[Step('F', st.microbatch, st.virtual)]})")
    if _table:
        timeline(sched)


def peak_in_flight(sched: Schedule) -> tuple[int, ...]:
    """Per stage, the most micro-batch chunks forwarded but not yet backwarded at once (the
    stage inputs a step keeps for its backward)."""
    peaks = []
    for row in sched.steps:
        live = peak = 0
        for st in row:
            live += 1 if st.kind == "F" else -1
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)


def format_schedule(sched: Schedule) -> str:
    """A per-device timeline, one line per stage (``.`` = idle)."""
    table = timeline(sched)
    w = max(len(str(st)) for row in table for st in row if st is not None)
    lines = [f"schedule {sched.name}: {sched.stages} stages x {sched.microbatches} micro-batches"
             + (f" x {sched.virtual} chunks" if sched.virtual > 1 else "")
             + f", {len(table)} steps"]
    for s in range(sched.stages):
        cells = [f"{str(row[s]) if row[s] else '.':<{w}}" for row in table]
        lines.append(f"stage {s} | " + " ".join(cells).rstrip())
    return "\n".join(lines)


def plot_gantt(sched: Schedule, path: str) -> str:
    """Write a PNG Gantt chart of the step table (stages down, time across) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = timeline(sched)
    fig, ax = plt.subplots(figsize=(max(6, len(table) * 0.35), 0.6 * sched.stages + 1.2))
    cmap = plt.get_cmap("tab20")
    for t, row in enumerate(table):
        for s, st in enumerate(row):
            if st is None:
                continue
            color = cmap((st.microbatch * 2 + (st.kind == "B")) % 20)
            ax.barh(s, 1, left=t, color=color, edgecolor="black",
                    hatch="//" if st.kind == "B" else None)
            ax.text(t + 0.5, s, str(st), ha="center", va="center", fontsize=7)
    ax.set_yticks(range(sched.stages), [f"stage {s}" for s in range(sched.stages)])
    ax.invert_yaxis()
    ax.set_xlabel("time step")
    ax.set_title(f"{sched.name}: {sched.stages} stages x {sched.microbatches} micro-batches"
                 + (f" x {sched.virtual} chunks" if sched.virtual > 1 else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
