"""Pipeline blocks and step tables: what a schedule is, its data dependencies, its timeline.

A :class:`Schedule` lists, per stage (one device group along the mesh's stage axis), the order of
its blocks ``Step(kind, microbatch, virtual, it)`` on its model chunks (chunk ``c = v * stages +
stage``). Block kinds (:data:`KINDS`):

- ``'F'`` / ``'B'``: forward / backward of micro-batch ``m`` on the stage's chunk ``v``;
- ``'G'``: the weight gradient of micro-batch ``m`` on chunk ``v``, in a schedule that splits the
  backward (``split_backward``, zero-bubble ``zb-h1``; the zero-bubble papers' ``W``): ``B`` then
  computes only the cotangent of the chunk's input (what the previous stage waits for) and
  keeps what the weight gradients read for ``G``, which may run later, in a bubble;
- ``'N'``: forward without gradient of recycling pass ``it`` (AlphaFold2 recycling, ``nf1b``):
  pass ``it`` of chunk 0 reads pass ``it - 1``'s output of the last chunk, and ``F`` of chunk 0
  reads the last pass's;
- ``'E'`` / ``'H'`` / ``'W'``: blocks on all devices at once (``interlaced``, nnScaler's T5
  plan: the vocabulary-split embedding and LM head): ``E`` embedding forward (before chunk 0's
  ``F``), ``H`` head + loss forward and backward (after the last chunk's ``F``, before its
  ``B``), ``W`` embedding backward (after chunk 0's ``B``). They appear in every stage's order.

:func:`timeline` places every block at the earliest unit time step at which its data
dependencies are done (a result sent at step ``t`` is usable at ``t + 1``; an all-device block
runs when it heads every stage's order). A cycle between the per-stage orders and the data
dependencies is a deadlock: :func:`validate` raises :class:`PlanError` naming its blocks.

>>> s = Schedule("custom", 2, 1, 1, ((Step("F", 0), Step("B", 0)),) * 2)
>>> [[str(x) if x else "." for x in row] for row in timeline(s)]
[['F0', '.'], ['.', 'F0'], ['.', 'B0'], ['B0', '.']]
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import networkx as nx

from nnscaler_jax.errors import PlanError

__all__ = ["ALL", "KINDS", "Cell", "Pair", "Schedule", "Step", "blocks", "check_split",
           "cycle_text", "deps", "expected_steps", "peak_in_flight", "peak_pending_weights",
           "timeline", "validate"]

KINDS = ("F", "B", "N", "E", "H", "W", "G")
ALL_DEVICE = frozenset("EHW")
ALL = -1  # the "stage" of an all-device block
_FIX = ("Order each stage's blocks along the data dependencies: F of (m, chunk c) after F of "
        "(m, c-1); B of (m, c) after F of (m, c) and B of (m, c+1)")
_WHAT = {"F": "forward", "B": "backward", "N": "no-grad forward", "E": "all-device embedding "
         "forward", "H": "all-device head + loss", "W": "all-device embedding backward",
         "G": "weight gradient"}


class Step(NamedTuple):
    """One block: ``kind`` (see :data:`KINDS`) of ``microbatch`` on virtual chunk ``virtual``
    (recycling pass ``it`` for ``'N'``). A named tuple (immutable, hashed in C: step tables
    of thousands of blocks are built, checked and priced per planning candidate)."""

    kind: str
    microbatch: int
    virtual: int = 0
    it: int = 0

    def __str__(self) -> str:
        v = f".{self.virtual}" if self.virtual else ""
        r = f"#{self.it}" if self.kind == "N" else ""
        return f"{self.kind}{self.microbatch}{v}{r}"

    @property
    def all_device(self) -> bool:
        return self.kind in ALL_DEVICE


@dataclass(frozen=True, slots=True)
class Schedule:
    """Per-stage block orders.

    Attributes:
        name: ``'gpipe'``, ``'1f1b'``, ``'eager-1f1b'``, ``'interleaved'``, ``'interlaced'``, ``'nf1b'`` or a
            user's name (``'custom'``).
        stages: devices groups along the stage axis.
        microbatches: micro-batches per training step.
        virtual: model chunks per stage (interleaved 1F1B), 1 otherwise.
        steps: ``steps[s]`` is stage ``s``'s ordered blocks (all-device blocks in every row).
        recycles: no-grad forward passes per micro-batch before its ``F`` (``'N'`` blocks).
        all_device: the schedule has the all-device blocks ``E`` / ``H`` / ``W``.
        paired: a stage runs a forward and a backward next to each other in its order in one
            time step when both are ready (:class:`Pair`; ``eager-1f1b``).
        split_backward: each backward is split into ``B`` (the input's cotangent) and ``G``
            (the chunk's weight gradients), two blocks of the orders (``zb-h1``).
    """

    name: str
    stages: int
    microbatches: int
    virtual: int
    steps: tuple[tuple[Step, ...], ...]
    recycles: int = 0
    all_device: bool = False
    paired: bool = False
    split_backward: bool = False

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    def to_lists(self) -> list[list[list]]:
        """JSON-ready ``[[kind, m, v], ...]`` per stage (``[kind, m, v, it]`` for ``'N'``)."""
        return [[[x.kind, x.microbatch, x.virtual] + ([x.it] if x.kind == "N" else [])
                 for x in row] for row in self.steps]

    @classmethod
    def from_lists(cls, name: str, stages: int, microbatches: int, virtual: int,
                   rows: Sequence[Sequence[Sequence]], *, paired: bool = False) -> Schedule:
        """The inverse of :meth:`to_lists` (recycles / all-device blocks read off the rows)."""
        steps = tuple(tuple(Step(str(x[0]), int(x[1]), int(x[2]) if len(x) > 2 else 0,
                                 int(x[3]) if len(x) > 3 else 0) for x in row) for row in rows)
        flat = [x for row in steps for x in row]
        recycles = max((x.it + 1 for x in flat if x.kind == "N"), default=0)
        return cls(name, stages, microbatches, virtual, steps, recycles,
                   any(x.all_device for x in flat), paired, any(x.kind == "G" for x in flat))


def expected_steps(sched: Schedule, stage: int) -> Iterator[Step]:
    """Every block stage ``stage`` must run exactly once (all-device blocks included)."""
    for m in range(sched.microbatches):
        if sched.all_device:
            yield from (Step(k, m) for k in "EHW")
        for v in range(sched.virtual):
            yield Step("F", m, v)
            yield Step("B", m, v)
            if sched.split_backward:
                yield Step("G", m, v)
            yield from (Step("N", m, v, r) for r in range(sched.recycles))


def deps(step: Step, stage: int, sched: Schedule) -> list[tuple[Step, int]]:
    """Blocks (with their stage, :data:`ALL` for all-device ones) that must finish before
    ``step`` on ``stage`` starts."""
    S, C = sched.stages, sched.chunks
    m = step.microbatch
    at = lambda kind, c2, it=0: (Step(kind, m, c2 // S, it), c2 % S)
    if step.all_device:
        return {"E": [], "H": [at("F", C - 1)], "W": [at("B", 0)]}[step.kind]
    c = step.virtual * S + stage
    if step.kind == "G":  # (B keeps what the weight gradients read)
        return [at("B", c)]
    if step.kind in ("F", "N"):
        if c > 0:
            return [at(step.kind, c - 1, step.it)]
        last = step.it - 1 if step.kind == "N" else sched.recycles - 1
        if last >= 0:
            return [at("N", C - 1, last)]
        return [(Step("E", m), ALL)] if sched.all_device else []
    out = [at("F", c)]
    if c < C - 1:
        out.append(at("B", c + 1))
    elif sched.all_device:
        out.append((Step("H", m), ALL))
    return out


def _where(stage: int) -> str:
    return "all devices" if stage == ALL else f"stage {stage}"


def cycle_text(g: nx.DiGraph) -> str | None:
    """A cycle of ``g`` in words, or None when ``g`` has none.

    Nodes are ``(stage, Step)``; an edge goes from a block to one that waits for it, with
    ``stage`` set on order edges (that stage's order) and None on data edges. Consecutive order
    edges on one stage are shown as one.
    """
    try:
        cyc = list(nx.find_cycle(g))
    except nx.NetworkXNoCycle:
        return None
    first = next((i for i, e in enumerate(cyc) if g.edges[e]["stage"] is not None), 0)
    cyc = cyc[first:] + cyc[:first]
    parts, i = [], 0
    while i < len(cyc):
        a, b = cyc[i]
        st = g.edges[a, b]["stage"]
        if st is None:
            parts.append(f"{b[1]} on {_where(b[0])} needs {a[1]} on {_where(a[0])}")
            i += 1
            continue
        run = [a[1], b[1]]
        while i + 1 < len(cyc) and g.edges[cyc[i + 1]]["stage"] == st:
            i += 1
            run.append(cyc[i][1][1])
        if len(run) > 4:
            run = [run[0], "...", run[-1]]
        parts.append(f"{_where(st)} runs {' before '.join(map(str, run))}")
        i += 1
    return "; ".join(parts)


def _order_graph(sched: Schedule) -> nx.DiGraph:
    g = nx.DiGraph()
    for s, row in enumerate(sched.steps):
        nodes = [(ALL if x.all_device else s, x) for x in row]
        g.add_nodes_from(nodes)
        for a, b in itertools.pairwise(nodes):
            g.add_edge(a, b, stage=s)
    for node in list(g.nodes):
        for d in deps(node[1], max(node[0], 0), sched):
            if not g.has_edge(d[::-1], node):  # an order edge too: keep it as one
                g.add_edge(d[::-1], node, stage=None)
    return g


class Pair(NamedTuple):
    """Two blocks one stage runs in one time step (:func:`timeline`): consecutive in its order,
    both ready at the step's start: a backward ``B`` and ``forward``, a forward ``F`` or a
    weight gradient ``G`` (of an earlier backward: split-backward schedules). The forward's
    activation and the backward's cotangent go to the neighbours together after the step."""

    forward: Step
    backward: Step

    def __str__(self) -> str:
        return f"{self.forward}+{self.backward}"


Cell = Step | Pair | None  # what one stage does in one time step


def blocks(cell: Cell) -> tuple[Step, ...]:
    """The blocks of a :func:`timeline` cell: none, one, or a :class:`Pair`'s two."""
    if cell is None:
        return ()
    return tuple(cell) if isinstance(cell, Pair) else (cell,)


def timeline(sched: Schedule, lag: int = 0) -> list[list[Cell]]:
    """The step table: ``table[t][s]`` is what stage ``s`` does at time step ``t``: a block, a
    :class:`Pair` of a forward and a backward, or None (idle).

    Each stage runs its blocks in its order, each at the earliest step after its dependencies'
    steps (unit time per block; results reach the neighbour for the next step); in a
    ``paired`` schedule a forward and a backward next to each other in a stage's order that are
    both ready run in one step (the runtime's loop runs both in it: in lock step the step lasts
    their sum on that stage, where a forward and a backward of different stages in one step
    each wait for the slower one). An all-device block runs on every stage at once, when it heads every stage's
    order.

    ``lag``: time steps a result takes to reach another stage beyond the next step (1: the
    runtime sends a step's results during the next step, overlapping its compute, so they
    are read two steps later; results a stage keeps, and those of all-device blocks, are
    read the next step).

    Raises:
        PlanError: the schedule is invalid (see :func:`validate`).
    """
    validate(sched, _table=False)
    return _place(sched, lag)


def _ready(st: Step | None, s: int, sched: Schedule, done: dict, t: int, lag: int = 0
           ) -> bool:
    if st is None:
        return False
    late = lambda ds: lag if ds not in (s, ALL) and not st.all_device else 0
    return all(done.get((d, ds), t) < t - late(ds) for d, ds in deps(st, s, sched))


def _place(sched: Schedule, lag: int = 0) -> list[list[Cell]]:
    """:func:`timeline` of a schedule whose blocks are checked (a deadlock still raises)."""
    S = sched.stages
    done: dict[tuple[Step, int], int] = {}
    pos = [0] * S
    table: list[list[Cell]] = []
    total, t = sum(len(r) for r in sched.steps), 0
    at = lambda s, i: sched.steps[s][i] if i < len(sched.steps[s]) else None
    while sum(pos) < total:
        heads = [at(s, pos[s]) for s in range(S)]
        row: list[Cell] = [None] * S
        for s, st in enumerate(heads):
            if not _ready(st, s, sched, done, t, lag):
                continue
            if st.all_device:
                row[s] = st if all(h == st for h in heads) else None
                continue
            row[s] = st
            nxt = at(s, pos[s] + 1)
            kinds = {st.kind, getattr(nxt, "kind", None)}
            if (sched.paired and kinds in ({"F", "B"}, {"G", "B"})
                    and _ready(nxt, s, sched, done, t, lag)):
                row[s] = Pair(nxt, st) if st.kind == "B" else Pair(st, nxt)
        if not any(row) and not (lag and any(_ready(h, s, sched, done, t + lag, lag)
                                             for s, h in enumerate(heads))):
            raise _deadlock(sched, heads, pos, done, t)
        for s, cell in enumerate(row):
            for st in blocks(cell):
                done[(st, ALL if st.all_device else s)] = t
                pos[s] += 1
        table.append(row)
        t += 1
    return table


def _deadlock(sched: Schedule, heads: list, pos: list[int], done: dict, t: int) -> PlanError:
    blocked = []
    for s, st in enumerate(heads):
        if st is None:
            continue
        miss = [f"{d} on {_where(ds)}" for d, ds in deps(st, s, sched) if (d, ds) not in done]
        if st.all_device and not miss:
            others = ", ".join(f"stage {k} is at {h}" for k, h in enumerate(heads) if h != st)
            miss = [f"every stage to reach it ({others})"]
        blocked.append(f"stage {s} step {pos[s]} '{st}' waits for {', '.join(miss)}")
    cyc = cycle_text(_order_graph(sched))
    return PlanError(f"schedule {sched.name!r} deadlocks at time step {t}"
                     + (f" ({cyc}: a cycle)" if cyc else "") + ": " + "; ".join(blocked)
                     + ". " + _FIX)


def check_split(name: str, split_backward: bool, all_device: bool, recycles: int) -> None:
    """Backwards are split (``G`` blocks) only in schedules of ``F`` / ``B`` blocks.

    Raises:
        PlanError: a split schedule with all-device blocks or no-grad passes.
    """
    if split_backward and (all_device or recycles):
        other = "all-device blocks (E / H / W)" if all_device else "no-grad passes (N)"
        raise PlanError(f"schedule {name!r} splits backwards into B and G blocks and has "
                        f"{other}; the runtime splits the backwards of F / B schedules only: "
                        "drop split_backward, or the other blocks")


def validate(sched: Schedule, *, _table: bool = True) -> None:
    """Check that ``sched`` is a complete, executable schedule.

    Every block :func:`expected_steps` lists appears exactly once on its stage, and the
    per-stage orders respect the data dependencies (:func:`deps`) without a cycle.

    Raises:
        PlanError: naming the offending block and stage (a deadlock: the blocks of the cycle).
    """
    check_split(sched.name, sched.split_backward, sched.all_device, sched.recycles)
    if len(sched.steps) != sched.stages:
        raise PlanError(f"schedule {sched.name!r} lists {len(sched.steps)} stages, declares "
                        f"{sched.stages}")
    for s, row in enumerate(sched.steps):
        seen: dict[Step, int] = {}
        for i, st in enumerate(row):
            if st.kind not in KINDS:
                raise PlanError(f"schedule {sched.name!r}: stage {s} step {i} has kind "
                                f"{st.kind!r}; use one of {', '.join(KINDS)}")
            if st in seen:
                raise PlanError(f"schedule {sched.name!r}: stage {s} runs '{st}' twice (steps "
                                f"{seen[st]} and {i}); every block runs exactly once")
            seen[st] = i
        expected = list(expected_steps(sched, s))
        want = set(expected)
        for i, st in enumerate(row):
            if st not in want:
                raise PlanError(f"schedule {sched.name!r}: stage {s} step {i} '{st}' is not a "
                                f"block of {sched.microbatches} micro-batches x {sched.virtual} "
                                f"chunks x {sched.recycles} recycles"
                                + (" with all-device blocks" if sched.all_device else ""))
        for st in expected if len(seen) < len(expected) else ():
            if st not in seen:
                raise PlanError(f"schedule {sched.name!r}: stage {s} never runs '{st}' "
                                f"({_WHAT[st.kind]} of micro-batch {st.microbatch}, chunk "
                                f"{st.virtual})")
        for i, st in enumerate(row):
            before = {"B": ("F", "forward"), "G": ("B", "backward")}.get(st.kind)
            if before and seen[Step(before[0], st.microbatch, st.virtual)] > i:
                first = Step(before[0], st.microbatch, st.virtual)
                raise PlanError(f"schedule {sched.name!r}: stage {s} step {i} '{st}' comes "
                                f"before its {before[1]} '{first}' (step {seen[first]})")
    if _table:
        _place(sched)


def peak_pending_weights(sched: Schedule) -> tuple[int, ...]:
    """Per stage, the most backwards whose weight gradient (``G``) has not run yet at once: the
    sets of values a ``B`` keeps for its ``G`` (0 where the schedule does not split backwards)."""
    peaks = []
    for row in sched.steps:
        live = peak = 0
        for st in row:
            live += {"B": 1, "G": -1}.get(st.kind, 0) if sched.split_backward else 0
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)


def peak_in_flight(sched: Schedule) -> tuple[int, ...]:
    """Per stage, the most micro-batch chunks forwarded but not yet backwarded at once (the
    stage inputs a step keeps for its backward; no-grad and all-device blocks keep none)."""
    peaks = []
    for row in sched.steps:
        live = peak = 0
        for st in row:
            live += {"F": 1, "B": -1}.get(st.kind, 0)
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)
