"""Schedules written with ``op_order``: pipeline blocks ordered per device, completed, checked.

nnScaler expresses a pipeline schedule as ``op_order`` between blocks (stage x micro-batch x
forward / backward); :class:`ScheduleDraft` is that for the pipeline runtime's step tables::

    from nnscaler_jax.primitives import op_order
    sched = ScheduleDraft(stages=2, microbatches=2)
    op_order(sched, sched.F(1, 0), sched.B(1, 0))   # stage 1: F0, then B0,
    op_order(sched, sched.B(1, 0), sched.F(1, 1))   # then F1 (1F1B on stage 1)
    table = sched.finish()                          # a validated Schedule

``op_order(sched, a, b)``: ``a`` runs before ``b`` on their shared devices (the blocks' stage;
an all-device block shares every stage). Blocks on two different stages share no device:
``PlanError``. ``sched.chain(a, b, c, ...)`` orders consecutive blocks.

**Completion.** :meth:`ScheduleDraft.finish` orders every block. On each stage, blocks of one
kind (and chunk / pass) run in micro-batch order unless the user's pairs put a later one first;
beyond that and the data dependencies (:func:`~nnscaler_jax.pipeline.steps.deps`), ties go to
forwards (no-grad passes, all-device forwards, ``F``) before backwards (``B``, then ``W``), then
to the lower micro-batch: one topological order of all these edges, which each stage runs in.
With no pairs that is GPipe; a total order per stage is kept exactly. A cycle between the pairs
and the data dependencies (e.g. ``B0`` before ``F0`` on a stage, or stage 0 waiting for ``B0``
before sending ``F1`` while stage 1 runs ``F1`` before ``B0``) raises :class:`PlanError`
naming its blocks; such an order is never reordered silently.

>>> d = ScheduleDraft(stages=2, microbatches=2)
>>> d.chain(d.F(1, 0), d.B(1, 0), d.F(1, 1), d.B(1, 1))
>>> [" ".join(map(str, row)) for row in d.finish().steps]
['F0 F1 B0 B1', 'F0 B0 F1 B1']
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import NamedTuple

import networkx as nx

from nnscaler_jax.errors import PlanError
from nnscaler_jax.pipeline.steps import (
    ALL,
    Schedule,
    Step,
    check_split,
    cycle_text,
    deps,
    validate,
)

__all__ = ["Block", "ScheduleDraft"]


class Block(NamedTuple):
    """One block of a draft: ``step`` on ``stage`` (:data:`~nnscaler_jax.pipeline.steps.ALL`
    for all-device blocks)."""

    stage: int
    step: Step

    def __str__(self) -> str:
        where = "all devices" if self.stage == ALL else f"stage {self.stage}"
        return f"{self.step} on {where}"


def _shared(a: Block, b: Block) -> int:
    """The stage whose order a pair constrains (:data:`ALL`: both blocks are all-device)."""
    return b.stage if a.stage == ALL else a.stage


def _priority(b: Block, chunks: int, stages: int) -> tuple:
    """Default order: forwards in micro-batch order, then backwards in micro-batch order."""
    st = b.step
    c = st.virtual * stages + max(b.stage, 0)
    sub = {"N": (0, st.it, c), "E": (1, 0, 0), "F": (2, 0, c), "H": (3, 0, 0),
           "B": (0, 0, chunks - c), "W": (1, 0, 0), "G": (2, 0, chunks - c)}[st.kind]
    return (st.kind in "BWG", st.microbatch) + sub + (b.stage,)


class ScheduleDraft:
    """A pipeline schedule in progress: blocks ordered with ``op_order``, then :meth:`finish`.

    Args:
        stages: stages along the mesh's stage axis.
        microbatches: micro-batches per training step.
        virtual: model chunks per stage (chunk ``v * stages + stage``), 1 unless interleaved.
        recycles: no-grad forward passes (``'N'`` blocks) per micro-batch before its ``F``.
        all_device: the all-device blocks ``E`` / ``H`` / ``W`` exist (interlaced).
        name: the schedule's name (in tables, plans and errors).
        paired: a stage runs a forward and a backward next to each other in its order in one
            time step when both are ready (:class:`~nnscaler_jax.pipeline.steps.Pair`).
        split_backward: each backward is two blocks, ``B`` (the chunk input's cotangent) and
            ``G`` (the chunk's weight gradients, :meth:`G`), ordered like the others.
    """

    def __init__(self, stages: int, microbatches: int, *, virtual: int = 1, recycles: int = 0,
                 all_device: bool = False, name: str = "custom", paired: bool = False,
                 split_backward: bool = False):
        if stages < 1 or microbatches < 1 or virtual < 1 or recycles < 0:
            raise PlanError(f"a schedule needs stages >= 1, microbatches >= 1, virtual >= 1 and "
                            f"recycles >= 0, got stages={stages}, microbatches={microbatches}, "
                            f"virtual={virtual}, recycles={recycles}")
        self.stages, self.microbatches, self.virtual = stages, microbatches, virtual
        self.recycles, self.all_device, self.name = recycles, all_device, name
        self.paired, self.split_backward = paired, split_backward
        check_split(name, split_backward, all_device, recycles)
        self.pairs: list[tuple[Block, Block]] = []

    # ---- blocks --------------------------------------------------------------------------------

    def _block(self, kind: str, stage: int, m: int, virtual: int = 0, it: int = 0) -> Block:
        if stage != ALL and not 0 <= stage < self.stages:
            raise PlanError(f"{kind}({stage}, {m}): stage {stage} is outside the draft's "
                            f"{self.stages} stages")
        if not 0 <= m < self.microbatches or not 0 <= virtual < self.virtual:
            raise PlanError(f"{kind}({stage}, {m}, virtual={virtual}): micro-batch / chunk "
                            f"outside the draft's {self.microbatches} micro-batches x "
                            f"{self.virtual} chunks per stage")
        if kind == "N" and not 0 <= it < self.recycles:
            raise PlanError(f"N({stage}, {m}, it={it}): the draft has {self.recycles} no-grad "
                            "passes per micro-batch; use ScheduleDraft(..., recycles=R)")
        if kind == "G" and not self.split_backward:
            raise PlanError(f"G({stage}, {m}): a weight-gradient block; use ScheduleDraft(..., "
                            "split_backward=True)")
        if stage == ALL and not self.all_device:
            raise PlanError(f"{kind}({m}): an all-device block; use ScheduleDraft(..., "
                            "all_device=True)")
        return Block(stage, Step(kind, m, virtual, it))

    def F(self, stage: int, m: int, virtual: int = 0) -> Block:
        """Forward of micro-batch ``m`` on ``stage``'s chunk ``virtual``."""
        return self._block("F", stage, m, virtual)

    def B(self, stage: int, m: int, virtual: int = 0) -> Block:
        """Backward of micro-batch ``m`` on ``stage``'s chunk ``virtual``."""
        return self._block("B", stage, m, virtual)

    def G(self, stage: int, m: int, virtual: int = 0) -> Block:
        """Weight gradient of micro-batch ``m`` on ``stage``'s chunk ``virtual`` (after its
        ``B``; ``split_backward`` drafts)."""
        return self._block("G", stage, m, virtual)

    def N(self, stage: int, m: int, it: int = 0, virtual: int = 0) -> Block:
        """No-grad forward (recycling pass ``it``) of micro-batch ``m`` on ``stage``."""
        return self._block("N", stage, m, virtual, it)

    def E(self, m: int) -> Block:
        """All-device embedding forward of micro-batch ``m``."""
        return self._block("E", ALL, m)

    def H(self, m: int) -> Block:
        """All-device head + loss, forward and backward, of micro-batch ``m``."""
        return self._block("H", ALL, m)

    def W(self, m: int) -> Block:
        """All-device embedding backward of micro-batch ``m``."""
        return self._block("W", ALL, m)

    def blocks(self) -> list[Block]:
        """Every block of the schedule (all-device ones once)."""
        out = []
        for m in range(self.microbatches):
            if self.all_device:
                out += [self.E(m), self.H(m), self.W(m)]
            for s in range(self.stages):
                for v in range(self.virtual):
                    out += [self.F(s, m, v), self.B(s, m, v)]
                    out += [self.G(s, m, v)] if self.split_backward else []
                    out += [self.N(s, m, r, v) for r in range(self.recycles)]
        return out

    # ---- order ---------------------------------------------------------------------------------

    def order(self, a: Block, b: Block) -> None:
        """``a`` runs before ``b`` on their shared devices (what ``op_order(sched, a, b)`` does).

        Raises:
            PlanError: not blocks of this draft, or on two different stages (no shared device).
        """
        for x in (a, b):
            if not isinstance(x, Block):
                raise PlanError(f"op_order on a schedule draft takes its blocks (sched.F(stage, "
                                f"m), sched.B(...)), got {type(x).__name__}")
        if a.stage != b.stage and ALL not in (a.stage, b.stage):
            raise PlanError(f"op_order({a.step} on stage {a.stage}, {b.step} on stage "
                            f"{b.stage}): the blocks share no device; order blocks of one stage "
                            "(or an all-device block with any). Across stages the data "
                            "dependencies order them")
        if a != b:
            self.pairs.append((a, b))

    def chain(self, *blocks: Block) -> None:
        """``op_order`` each consecutive pair: ``blocks`` run in this order."""
        for a, b in itertools.pairwise(blocks):
            self.order(a, b)

    def finish(self) -> Schedule:
        """The completed, validated :class:`~nnscaler_jax.pipeline.steps.Schedule`.

        Raises:
            PlanError: the pairs and the data dependencies form a cycle (naming its blocks).
        """
        rows = self._total_rows()
        if rows is not None:  # a total order per stage: run as given, checked for deadlocks
            sched = Schedule(self.name, self.stages, self.microbatches, self.virtual, rows,
                             self.recycles, self.all_device, self.paired, self.split_backward)
            validate(sched)
            return sched
        shell = Schedule(self.name, self.stages, self.microbatches, self.virtual, (),
                         self.recycles, self.all_device, self.paired, self.split_backward)
        succ: dict[Block, list[tuple[Block, int | None]]] = {b: [] for b in self.blocks()}
        for b in succ:
            for d, ds in deps(b.step, max(b.stage, 0), shell):
                succ[Block(ds, d)].append((b, None))
        for a, b in self.pairs:
            succ[a].append((b, _shared(a, b)))
        self._default_chains(succ)
        order = self._toposort(succ, lambda b: _priority(b, self.stages * self.virtual,
                                                         self.stages))
        rows = tuple(tuple(b.step for b in order if b.stage in (s, ALL))
                     for s in range(self.stages))
        # complete by construction, and deadlock-free: every stage runs its blocks in the order
        # of one topological order of the pairs and the data dependencies
        sched = Schedule(self.name, self.stages, self.microbatches, self.virtual, rows,
                         self.recycles, self.all_device, self.paired, self.split_backward)
        return sched

    def _total_rows(self) -> tuple[tuple[Step, ...], ...] | None:
        """Each stage's blocks in the order of its pairs when they chain all of them (one pair
        per consecutive two, as :meth:`chain` gives), else None."""
        per = self.microbatches * (self.virtual * (2 + self.recycles + self.split_backward)
                                   + (3 if self.all_device else 0))
        nxt: list[dict[Block, Block]] = [{} for _ in range(self.stages)]
        for a, b in self.pairs:
            if a.stage == b.stage == ALL:
                return None
            row = nxt[b.stage if a.stage == ALL else a.stage]
            if a in row:
                return None
            row[a] = b
        rows = []
        for row in nxt:
            heads = set(row) - set(row.values())
            if len(row) != per - 1 or len(heads) != 1:
                return None
            (b,) = heads
            out = [b.step]
            while b in row and len(out) <= per:  # a cycle among the pairs: stop
                b = row[b]
                out.append(b.step)
            if len(out) != per:
                return None
            rows.append(tuple(out))
        return tuple(rows)

    def _default_chains(self, succ: dict) -> None:
        """Add the default micro-batch order of same-kind blocks (one stage, chunk, pass):
        ``m`` before ``m + 1`` unless the user's pairs put ``m + 1`` first (in a topological
        order of the pairs alone, micro-batch first), so these edges never close a cycle with
        the pairs."""
        user = {b: [] for b in succ}
        for a, b in self.pairs:
            user[a].append((b, _shared(a, b)))
        pos = {b: i for i, b in enumerate(self._toposort(
            user, lambda b: (b.step.microbatch,) + _priority(b, self.stages * self.virtual,
                                                             self.stages)))}
        for b, outs in succ.items():
            st = b.step
            if st.microbatch + 1 < self.microbatches:
                nxt = Block(b.stage, Step(st.kind, st.microbatch + 1, st.virtual, st.it))
                if pos[b] < pos[nxt]:
                    outs.append((nxt, b.stage))

    def _toposort(self, succ: dict, key: Callable[[Block], tuple]) -> list[Block]:
        indeg = dict.fromkeys(succ, 0)
        for outs in succ.values():
            for b, _ in outs:
                indeg[b] += 1
        ready = [(key(b), b) for b, n in indeg.items() if n == 0]
        heapq.heapify(ready)
        order = []
        while ready:
            _, b = heapq.heappop(ready)
            order.append(b)
            for c, _ in succ[b]:
                indeg[c] -= 1
                if indeg[c] == 0:
                    heapq.heappush(ready, (key(c), c))
        if len(order) < len(succ):
            raise self._cycle(succ, {b for b, n in indeg.items() if n > 0})
        return order

    def _cycle(self, succ: dict, left: set[Block]) -> PlanError:
        g = nx.DiGraph()
        for a in left:
            for b, st in succ[a]:
                if b in left and not g.has_edge((a.stage, a.step), (b.stage, b.step)):
                    g.add_edge((a.stage, a.step), (b.stage, b.step), stage=st)
        text = cycle_text(g) or "a cycle"
        return PlanError(f"schedule {self.name!r}: op_order deadlocks: {text}: the pairs and "
                         "the data dependencies form a cycle (F of (m, chunk c) after F of "
                         "(m, c-1); B of (m, c) after F of (m, c) and B of (m, c+1)). Drop or "
                         "reverse one of its op_order pairs")
