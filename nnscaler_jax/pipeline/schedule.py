"""Pipeline schedules as validated step tables, written with ``op_order``.

A :class:`Schedule` lists, per stage (one device group along the mesh's stage axis), the order of
its blocks (:mod:`nnscaler_jax.pipeline.steps`): ``'F'`` / ``'B'`` of micro-batch ``m`` on the
stage's virtual chunk ``v`` (model chunk ``c = v * stages + stage``; ``virtual == 1`` unless
interleaved), ``'N'`` no-grad forwards (``nf1b``) and the all-device blocks ``'E'`` / ``'H'`` /
``'W'`` (``interlaced``). Every built-in schedule is a
:class:`~nnscaler_jax.pipeline.order.ScheduleDraft` whose per-stage orders are given with
``op_order`` -- the mechanism users write their own with. :func:`timeline` places every block at
the earliest unit time step at which its data dependencies are done (a result sent at step
``t`` is usable at ``t + 1``); the runtime (:mod:`nnscaler_jax.pipeline.stacked`) executes
exactly that table (every block kind: :mod:`nnscaler_jax.pipeline.cut_program`).

>>> s = one_f_one_b(2, 4)
>>> print(format_schedule(s))
schedule 1f1b: 2 stages x 4 micro-batches, 10 steps
stage 0 | F0 F1 .  B0 F2 B1 F3 B2 .  B3
stage 1 | .  F0 B0 F1 B1 F2 B2 F3 B3 .
>>> peak_in_flight(s), peak_in_flight(gpipe(2, 4))
((2, 1), (4, 4))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nnscaler_jax.errors import PlanError
from nnscaler_jax.pipeline.order import Block, ScheduleDraft
from nnscaler_jax.pipeline.steps import (
    Pair,
    Schedule,
    Step,
    blocks,
    peak_in_flight,
    timeline,
    validate,
)

__all__ = [
    "Pair",
    "Schedule",
    "ScheduleDraft",
    "Step",
    "blocks",
    "build",
    "eager_one_f_one_b",
    "format_schedule",
    "from_settings",
    "gpipe",
    "interlaced",
    "interleaved",
    "nf1b",
    "one_f_one_b",
    "peak_in_flight",
    "plot_gantt",
    "require_runnable",
    "timeline",
    "validate",
    "zb_h1",
]

SCHEDULES = ("gpipe", "1f1b", "eager-1f1b", "interleaved", "interlaced", "nf1b", "zb-h1")
RUNNABLE = ("1f1b", "eager-1f1b", "gpipe", "interleaved", "zb-h1")  # the stage DP's default choices
RECYCLES = 3  # nf1b's default no-grad passes ("3F1B")


def _check_sizes(stages: int, microbatches: int, virtual: int = 1) -> None:
    if stages < 1 or microbatches < 1 or virtual < 1:
        raise PlanError(f"a schedule needs stages >= 1, microbatches >= 1 and virtual >= 1, got "
                        f"stages={stages}, microbatches={microbatches}, virtual={virtual}")


def _from_rows(draft: ScheduleDraft, row: Callable[[int], list[Block]]) -> Schedule:
    """``draft`` with stage ``s``'s blocks ``row(s)`` chained with ``op_order``, finished."""
    for s in range(draft.stages):
        draft.chain(*row(s))
    return draft.finish()


def _one_f_one_b_row(d: ScheduleDraft, s: int, warm: int | None = None) -> list[Block]:
    """1F1B on stage ``s``: ``warm`` (default ``stages - s - 1``) warm-up forwards, then F and
    B alternate."""
    M = d.microbatches
    warm = min(d.stages - s - 1 if warm is None else warm, M)
    row = [d.F(s, m) for m in range(warm)]
    for i in range(M - warm):
        row += [d.F(s, warm + i), d.B(s, i)]
    return row + [d.B(s, m) for m in range(M - warm, M)]


def gpipe(stages: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards: every micro-batch is in flight on every stage."""
    _check_sizes(stages, microbatches)
    d = ScheduleDraft(stages, microbatches, name="gpipe")
    M = microbatches
    return _from_rows(d, lambda s: [d.F(s, m) for m in range(M)] + [d.B(s, m) for m in range(M)])


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B: stage ``s`` runs ``stages - s - 1`` warm-up forwards, then alternates F and B."""
    _check_sizes(stages, microbatches)
    d = ScheduleDraft(stages, microbatches, name="1f1b")
    return _from_rows(d, lambda s: _one_f_one_b_row(d, s))


def eager_one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """Eager 1F1B: stage ``s`` runs ``2 (stages - s - 1)`` warm-up forwards, then alternates F
    and B, a ready forward and backward in one time step (``paired``).

    In the runtime's lock step a result is usable one time step after it is made, so a
    micro-batch's forward on stage 0 and its backward there are ``2 stages - 1`` steps apart:
    with that many micro-batches in flight each stage runs a forward and a backward in every
    steady-state step (a :class:`~nnscaler_jax.pipeline.steps.Pair`). The step takes GPipe's
    time (``(M + S - 1) (f + b)`` for equal stages; 1F1B, whose forwards and backwards of
    different stages share time steps, up to ``2 (M + S - 1) b``) in ``M + 2 S - 1`` time steps
    (GPipe's ``2 (M + S - 1)``: fewer ``ppermute`` rounds), with at most ``2 (S - s) - 1``
    micro-batches in flight on stage ``s`` (1F1B: ``S - s``; GPipe: all ``M``).

    >>> print(format_schedule(eager_one_f_one_b(2, 4)))
    schedule eager-1f1b: 2 stages x 4 micro-batches, 7 steps
    stage 0 | F0    F1    F2    F3+B0 B1    B2    B3
    stage 1 | .     F0    F1+B0 F2+B1 F3+B2 B3    .
    """
    _check_sizes(stages, microbatches)
    d = ScheduleDraft(stages, microbatches, name="eager-1f1b", paired=True)
    return _from_rows(d, lambda s: _one_f_one_b_row(d, s, 2 * (stages - s - 1)))


def zb_h1(stages: int, microbatches: int) -> Schedule:
    """Zero-bubble ZB-H1 (Qi et al., ICLR'24) for the runtime's lock step: 1F1B's micro-batches
    in flight with each backward split into ``B`` (the input's cotangent, what the previous
    stage waits for) and ``G`` (the weight gradients), the ``G`` s run in the time steps a
    stage would idle or beside a ``B`` (``paired``).

    Written per stage by unit-time lock step (the runtime's): each time step a stage runs a
    ready ``B`` and, beside it or alone, the oldest pending ``G`` when more than one is pending,
    else a ready ``F`` while fewer than ``stages - s`` micro-batches are in flight (1F1B's),
    else a pending ``G`` when no ``B`` runs. At most two backwards' kept values wait for their
    ``G`` on a stage. Priced (:func:`~nnscaler_jax.pipeline.pricing.runtime_time`), the
    cool-down's chain of backwards is ``B`` s only and the ``G`` s fill bubbles: below 1F1B's
    step; GPipe / eager 1F1B, which hold more micro-batches in flight, can be faster.

    >>> print(format_schedule(zb_h1(2, 3)))
    schedule zb-h1: 2 stages x 3 micro-batches, 8 steps
    stage 0 | F0    F1    .     F2+B0 G0+B1 G1    B2    G2
    stage 1 | .     F0    F1+B0 G0+B1 F2    G1+B2 G2    .
    """
    _check_sizes(stages, microbatches)
    d = ScheduleDraft(stages, microbatches, name="zb-h1", split_backward=True, paired=True)
    rows = _zb_rows(stages, microbatches)
    return _from_rows(d, lambda s: [getattr(d, k)(s, m) for k, m in rows[s]])


def _zb_rows(S: int, M: int) -> list[list[tuple[str, int]]]:
    """Per stage, ZB-H1's blocks ``(kind, micro-batch)`` by :func:`zb_h1`'s priorities."""
    done: dict[tuple[str, int, int], int] = {}  # (kind, m, stage) -> time step
    nxt = [{"F": 0, "B": 0} for _ in range(S)]
    pending: list[list[int]] = [[] for _ in range(S)]
    rows: list[list[tuple[str, int]]] = [[] for _ in range(S)]
    t = 0
    while any(len(r) < 3 * M for r in rows):
        for s in range(S):
            f, b = nxt[s]["F"], nxt[s]["B"]
            ready = lambda k, m, at, t=t: done.get((k, m, at), t) < t
            b_ok = b < f and (s == S - 1 or ready("B", b, s + 1)) and ready("F", b, s)
            f_ok = f < M and f - b < S - s and (s == 0 or ready("F", f, s - 1))
            cell = []
            if len(pending[s]) > 1 or (pending[s] and not f_ok and not b_ok):
                cell.append(("G", pending[s].pop(0)))
            elif f_ok:
                cell.append(("F", f))
            if b_ok:
                cell.append(("B", b))
                pending[s].append(b)
            for k, m in cell:
                if k != "G":  # (G: the oldest pending, popped above)
                    nxt[s][k] += 1
                done[(k, m, s)] = t
                rows[s].append((k, m))
        t += 1
    return rows


def interleaved(stages: int, microbatches: int, virtual: int) -> Schedule:
    """Interleaved 1F1B (Megatron): ``virtual`` model chunks per stage, chunk ``v * stages + s``
    on stage ``s``; micro-batches go through in groups of ``stages``. Paired: its warm-up is deep
    enough that a stage's forward and backward are both ready in the steady state, and running
    them in one lock-step time step takes (with chunks of ``f / V``, ``b / V``) below GPipe's
    time: 52.5 against 57.0 at 4 stages x 16 micro-batches x 2 chunks (66.0 unpaired).

    Raises:
        PlanError: ``microbatches`` is not a multiple of ``stages``.
    """
    _check_sizes(stages, microbatches, virtual)
    if microbatches % stages:
        raise PlanError(f"interleaved({stages}, {microbatches}, {virtual}): micro-batches must be "
                        f"a multiple of the stages; use "
                        f"microbatches={stages * max(1, microbatches // stages)}")
    total = microbatches * virtual
    d = ScheduleDraft(stages, microbatches, virtual=virtual, name="interleaved", paired=True)

    def unit(s: int, i: int, backward: bool) -> Block:
        group, r = divmod(i, stages * virtual)
        v, k = divmod(r, stages)
        return (d.B if backward else d.F)(s, group * stages + k,
                                          (virtual - 1 - v) if backward else v)

    def row(s: int) -> list[Block]:
        warm = min((stages - s - 1) * 2 + (virtual - 1) * stages, total)
        out = [unit(s, i, False) for i in range(warm)]
        for i in range(total - warm):
            out += [unit(s, warm + i, False), unit(s, i, True)]
        return out + [unit(s, i, True) for i in range(total - warm, total)]

    return _from_rows(d, row)


def interlaced(stages: int, microbatches: int) -> Schedule:
    """nnScaler's interlaced pipeline (its T5 plan): the pipelined stages with blocks that run on
    all devices -- the vocabulary-split embedding and LM head + loss -- woven in between.

    The step goes in rounds; round ``r`` runs the embedding forward ``E(r)`` on all devices, one
    ``F`` per stage, the head ``H`` (forward, loss and backward, all devices), one ``B`` per
    stage, and the embedding backward ``W``. Micro-batch ``m`` enters at round ``m``, runs
    stage ``s``'s ``F`` at round ``m + s``, ``H`` at ``m + S - 1``, stage ``s``'s ``B`` at
    ``m + 2S - 2 - s`` and ``W`` at ``m + 2S - 2``: in the steady state every device is busy
    (one all-device slot for each of ``E`` / ``H`` / ``W``, one ``F`` and one ``B`` per round),
    and stage ``s`` keeps at most ``2 (S - s) - 1`` micro-batches in flight.

    >>> print(format_schedule(interlaced(2, 2)))
    schedule interlaced: 2 stages x 2 micro-batches, 12 steps
    stage 0 | E0 F0 E1 F1 H0 .  .  H1 B0 W0 B1 W1
    stage 1 | E0 .  E1 F0 H0 B0 F1 H1 B1 W0 .  W1
    """
    _check_sizes(stages, microbatches)
    S, M = stages, microbatches
    d = ScheduleDraft(S, M, all_device=True, name="interlaced")

    def row(s: int) -> list[Block]:
        out: list[Block] = []
        for r in range(M + 2 * S - 2):
            for m, block in ((r, d.E), (r - s, lambda m: d.F(s, m)), (r - S + 1, d.H),
                             (r - 2 * S + 2 + s, lambda m: d.B(s, m)), (r - 2 * S + 2, d.W)):
                if 0 <= m < M:
                    out.append(block(m))
        return out

    return _from_rows(d, row)


def nf1b(stages: int, microbatches: int, recycles: int = RECYCLES) -> Schedule:
    """NF1B (nnScaler's AlphaFold2 recycling, "3F1B" for 3): every micro-batch first runs
    ``recycles`` forward passes without gradient through the whole pipeline (pass ``r + 1`` of
    chunk 0 reads pass ``r``'s output of the last chunk), then 1F1B.

    The no-grad passes go through in waves (pass 0 of every micro-batch, then pass 1, ...), like
    GPipe forwards that keep no activations; then each stage runs its 1F1B order.
    """
    _check_sizes(stages, microbatches)
    if recycles < 0:
        raise PlanError(f"nf1b(recycles={recycles}): use recycles >= 0 no-grad passes")
    d = ScheduleDraft(stages, microbatches, recycles=recycles, name="nf1b")
    return _from_rows(d, lambda s: [d.N(s, m, r) for r in range(recycles)
                                    for m in range(microbatches)] + _one_f_one_b_row(d, s))


def build(name: str, stages: int, microbatches: int, virtual: int = 2,
          recycles: int = RECYCLES) -> Schedule:
    """The built-in schedule ``name`` (see :data:`SCHEDULES`); ``virtual`` for interleaved,
    ``recycles`` for nf1b."""
    if name == "gpipe":
        return gpipe(stages, microbatches)
    if name == "1f1b":
        return one_f_one_b(stages, microbatches)
    if name == "eager-1f1b":
        return eager_one_f_one_b(stages, microbatches)
    if name == "interleaved":
        return interleaved(stages, microbatches, virtual)
    if name == "zb-h1":
        return zb_h1(stages, microbatches)
    if name == "interlaced":
        return interlaced(stages, microbatches)
    if name == "nf1b":
        return nf1b(stages, microbatches, recycles)
    raise PlanError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}, or write "
                    "one with ScheduleDraft and op_order")


def from_settings(pipe: Any) -> Schedule:
    """The schedule of a plan's pipeline settings (:class:`~nnscaler_jax.plan.plan.
    PipelineSettings`): its saved per-stage orders (``steps``, a schedule written with
    ``op_order``), else the built-in one it names."""
    rows = getattr(pipe, "steps", ())
    if rows:
        return Schedule.from_lists(pipe.schedule, pipe.stages, pipe.microbatches, pipe.virtual,
                                   rows, paired=getattr(pipe, "paired", False))
    return build(pipe.schedule, pipe.stages, pipe.microbatches, pipe.virtual)


def require_runnable(sched: Schedule, kinds: str = "FBNEHWG") -> Schedule:
    """``sched`` itself when a runtime executing block kinds ``kinds`` runs every block of it.

    :class:`~nnscaler_jax.pipeline.cut_program.CutProgram` runs every kind; the identical-layer
    :class:`~nnscaler_jax.pipeline.stacked.PipelineProgram` runs ``F`` / ``B`` only
    (``pm.train_step`` picks the cut program for the others).

    Raises:
        PlanError: the schedule is invalid, or has blocks outside ``kinds``.
    """
    validate(sched)
    extra = sorted({st.kind for row in sched.steps for st in row} - set(kinds))
    if not extra:
        return sched
    raise PlanError(
        f"schedule {sched.name!r} has blocks {extra} ('N': forwards without gradient, "
        "recycling; 'E' / 'H' / 'W': blocks on all devices; 'G': weight gradients of split "
        "backwards) that the identical-layer pipeline "
        "runtime does not execute; pm.train_step runs them with the cut program "
        "(nnscaler_jax.pipeline.cut_program.CutProgram)")


def settings_steps(sched: Any) -> tuple:
    """What a plan's ``PipelineSettings.steps`` keeps of ``sched``: the per-stage orders of a
    schedule that is not a built-in (hashable lists of :meth:`Schedule.to_lists`), else ``()``.
    """
    if not isinstance(sched, Schedule) or _is_builtin(sched):
        return ()
    return tuple(tuple(tuple(x) for x in row) for row in sched.to_lists())


def _is_builtin(sched: Schedule) -> bool:
    """``sched`` is what :func:`build` makes of its name (and sizes): the name is enough."""
    if sched.name not in SCHEDULES:
        return False
    try:
        return build(sched.name, sched.stages, sched.microbatches, sched.virtual) == sched
    except PlanError:
        return False


def format_schedule(sched: Schedule) -> str:
    """A per-device timeline, one line per stage (``.`` = idle)."""
    table = timeline(sched)
    w = max(len(str(cell)) for row in table for cell in row if cell is not None)
    lines = [f"schedule {sched.name}: {sched.stages} stages x {sched.microbatches} micro-batches"
             + (f" x {sched.virtual} chunks" if sched.virtual > 1 else "")
             + f", {len(table)} steps"]
    for s in range(sched.stages):
        cells = [f"{str(row[s]) if row[s] else '.':<{w}}" for row in table]
        lines.append(f"stage {s} | " + " ".join(cells).rstrip())
    return "\n".join(lines)


def plot_gantt(sched: Schedule, path: str) -> str:
    """Write a PNG Gantt chart of the step table (stages down, time across) to ``path``.

    Colour: micro-batch; fill: block type -- forward solid, backward hatched ``//``, weight
    gradient (split backwards) hatched ``\\\\`` and paler, no-grad forward dotted and pale,
    all-device blocks one grey bar across every stage (with a legend).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    table = timeline(sched)
    S = sched.stages
    fig, ax = plt.subplots(figsize=(max(6, len(table) * 0.35), 0.6 * S + 1.6))
    cmap = plt.get_cmap("tab10")
    style = {"F": (None, 1.0), "B": ("//", 1.0), "N": ("..", 0.45), "G": ("\\\\", 0.6)}
    for t, row in enumerate(table):
        for s, cell in enumerate(row):
            parts = blocks(cell)
            for i, st in enumerate(parts):
                _draw_block(ax, st, s, t + i / len(parts), 1 / len(parts), S, style, cmap)
    kinds = {st.kind for row in sched.steps for st in row}
    legend = [Patch(facecolor="white", edgecolor="black", hatch=h, alpha=a, label=lab)
              for k, (h, a), lab in (("F", style["F"], "F forward"),
                                     ("B", style["B"], "B backward"),
                                     ("N", style["N"], "N no-grad forward"),
                                     ("G", style["G"], "G weight gradient")) if k in kinds]
    if sched.all_device:
        legend.append(Patch(facecolor="0.8", edgecolor="black",
                            label="E / H / W all devices"))
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.25),
              ncol=len(legend), fontsize=7, frameon=False)
    ax.set_yticks(range(S), [f"stage {s}" for s in range(S)])
    ax.invert_yaxis()
    ax.set_xlabel("time step (colour: micro-batch)")
    ax.set_title(f"{sched.name}: {S} stages x {sched.microbatches} micro-batches"
                 + (f" x {sched.virtual} chunks" if sched.virtual > 1 else "")
                 + (f", {sched.recycles} no-grad passes" if sched.recycles else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _draw_block(ax: Any, st: Step, s: int, left: float, width: float, S: int, style: dict,
                cmap: Any) -> None:
    """One block of :func:`plot_gantt` (``width``: half a step for each of a pair)."""
    if st.all_device and s:
        return
    if st.all_device:
        ax.barh((S - 1) / 2, width, height=S - 0.2, left=left, color="0.8",
                edgecolor="black", hatch="xx" if st.kind == "W" else None)
        ax.text(left + width / 2, (S - 1) / 2, str(st), ha="center", va="center", fontsize=7,
                rotation=90 if S > 1 else 0)
        return
    hatch, alpha = style[st.kind]
    ax.barh(s, width, left=left, color=cmap(st.microbatch % 10), alpha=alpha,
            edgecolor="black", hatch=hatch)
    ax.text(left + width / 2, s, str(st), ha="center", va="center", fontsize=6)
