"""The schedule's step table as the tables the pipeline runtime's loop reads.

:class:`~nnscaler_jax.pipeline.stacked.PipelineProgram` and :class:`~nnscaler_jax.pipeline.
cut_program.CutProgram` run one ``lax.fori_loop`` over time steps; at step ``t`` a device of stage
``s`` reads row ``[t, s]`` of each table: what to do (:data:`CODES`), which micro-batch, virtual
chunk and recycling pass, which buffer slot holds its input (and, in a backward, its cotangent),
into which slot the activation / cotangent the neighbours send after the step goes, and into
which slot it keeps its own result (a value that stays on the device: the last chunk's output
for the head ``H``, the head's cotangent, chunk 0's input cotangent for the embedding backward
``W``). Slots are reused as soon as a block frees them, so the input buffer holds the
schedule's peak in-flight micro-batches.

All-device blocks (``E`` / ``H`` / ``W``) run where their data is: ``E`` and ``W`` on stage 0
(chunk 0's input and its cotangent live there), ``H`` on the last chunk's stage; the other
stages wait for that time step, as the table places the block on every stage at once.

>>> t = loop_tables(sch.one_f_one_b(2, 4))
>>> t.kind.shape, t.n_in
((10, 2), 2)
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np

from nnscaler_jax.pipeline import schedule as sch

__all__ = ["CODES", "LoopTables", "loop_tables"]

CODES = {None: 0, "F": 1, "B": 2, "N": 3, "E": 4, "H": 5, "W": 6, "G": 7}  # table value per block kind


@dataclass(frozen=True)
class LoopTables:
    """Per (time step, stage) int32 tables driving the runtime's interpreter loop.

    Attributes:
        n_in / n_g: input / cotangent buffer slots per stage (at least 1).
    """

    kind: np.ndarray      # CODES: 0 idle, 1 forward, 2 backward, 3 no-grad, 4 E, 5 H, 6 W, 7 G
    mb: np.ndarray        # micro-batch
    virt: np.ndarray      # virtual chunk on the stage
    in_slot: np.ndarray   # input-buffer slot the step reads
    g_slot: np.ndarray    # cotangent-buffer slot a backward (B, W) reads
    rf_slot: np.ndarray   # slot to store the activation received after the step (-1: none)
    rb_slot: np.ndarray   # slot to store the cotangent received after the step (-1: none)
    n_in: int
    n_g: int
    it: np.ndarray | None = None      # recycling pass of an 'N' block
    keep_f: np.ndarray | None = None  # input slot to keep the step's own output in (-1: none)
    keep_b: np.ndarray | None = None  # cotangent slot to keep its own cotangent in (-1: none)
    # the backward of a pair (steps.Pair; the tables above hold its forward): its code
    # (CODES['B'], or 0 where the stage runs no pair), micro-batch, chunk and slots
    b_kind: np.ndarray | None = None
    b_mb: np.ndarray | None = None
    b_virt: np.ndarray | None = None
    b_in: np.ndarray | None = None
    b_g: np.ndarray | None = None
    # split backwards (G blocks): the slot of the kept-values buffer a B fills after the step
    # (-1: none) and the one a G reads
    keep_s: np.ndarray | None = None
    s_slot: np.ndarray | None = None
    n_s: int = 0
    # the neighbours' results arrive one step late (``loop_tables(..., overlap=True)``): what
    # a stage sends after step t moves during step t + 1 (``rf_slot`` / ``rb_slot`` row t + 1)
    overlap: bool = False

    @property
    def paired(self) -> bool:
        """Some step runs a pair (the loop runs a second, backward-only branch)."""
        return self.b_kind is not None and bool(self.b_kind.any())

    @property
    def sends(self) -> np.ndarray:
        """``[T, 2]`` bool: at step ``t`` some stage receives an activation (``[:, 0]``) / a
        cotangent (``[:, 1]``) from a neighbour; the runtime skips the other ``ppermute``s."""
        return np.stack([self.rf_slot.max(axis=1) >= 0, self.rb_slot.max(axis=1) >= 0], 1)

    @property
    def transfers(self) -> np.ndarray:
        """``[T]`` bool: the runtime moves values between the stages at step ``t``: where
        some stage receives one, or at every step with :attr:`overlap` (the ``ppermute`` then
        runs outside any branch, so that XLA can run it beside the step's blocks)."""
        if self.overlap:
            return np.ones(self.kind.shape[0], bool)
        return self.sends.any(axis=1)


def loop_tables(sched: sch.Schedule, kinds: str = "FB", *, overlap: bool = False,
                table: list | None = None) -> LoopTables:
    """The tables of ``sched``'s step table (:func:`~nnscaler_jax.pipeline.schedule.timeline`):
    what each stage does at each time step and which buffer slots it reads and fills.

    Args:
        kinds: the block kinds the calling runtime executes (``'FB'``: the identical-layer
            runtime; ``'FBNEHWG'``: the cut-program runtime).
        overlap: the runtime sends a step's results to the neighbours during the next step,
            beside its compute (the step table placed with ``lag=1``, so no block reads a
            neighbour's result before it arrives): ``rf_slot`` / ``rb_slot`` move one row down.
        table: the step table, ``timeline(sched, lag=overlap)``, when already made.

    Raises:
        PlanError: the schedule has blocks the calling runtime does not execute.
    """
    sch.require_runnable(sched, kinds)
    table = sch.timeline(sched, lag=int(overlap)) if table is None else table
    T, S, C, V = len(table), sched.stages, sched.chunks, sched.virtual
    z = lambda fill=0: np.full((T, S), fill, np.int32)
    kind, mb, virt, it, in_slot, g_slot = z(), z(), z(), z(), z(), z()
    rf, rb, keep_f, keep_b = z(-1), z(-1), z(-1), z(-1)
    last = (C - 1) % S
    bufs = {"in": _Slots(S), "g": _Slots(S), "s": _Slots(S)}
    keep_s, s_slot = z(-1), z()
    b_kind, b_mb, b_virt, b_in, b_g = z(), z(), z(), z(), z()
    lanes = ((kind, mb, virt, in_slot, g_slot), (b_kind, b_mb, b_virt, b_in, b_g))
    later: list = []  # (overlap) values on their way: their slots taken once they arrive

    def arrive(table_: np.ndarray, t: int, d: int, buf: str, key: tuple) -> None:
        later.append((table_, t, d, buf, key))
        if not overlap:  # (a value sent after step t is there at its end)
            _flush(later, bufs)

    for t, row in enumerate(table):
        done = []  # (stage, step) each stage runs at t
        for s, cell in enumerate(row):
            for lane, st in zip(lanes, sch.blocks(cell), strict=False):
                if st.all_device and s != {"E": 0, "H": last, "W": 0}[st.kind]:
                    continue  # runs on the stage holding its data; the others wait
                done.append((s, st))
                _read(lane, bufs, t, s, st)
                if lane is lanes[0]:
                    it[t, s] = st.it
                if st.kind == "G":
                    s_slot[t, s] = bufs["s"].read(s, ("G", st.microbatch, st.virtual), free=True)
        _flush(later, bufs)  # (overlap: what step t - 1 sent arrives at the end of step t)
        for s, st in done:  # after the step: what arrives from the neighbours, what is kept
            m, c = st.microbatch, st.virtual * S + s
            if st.kind in "FN" and c + 1 < C:
                d, key = (c + 1) % S, (st.kind, m, (c + 1) // S) + ((st.it,) * (st.kind == "N"))
                arrive(rf, t, d, "in", key)
            elif st.kind == "N":  # last chunk: the recycled state goes to chunk 0 (stage 0)
                nxt = ("N", m, 0, st.it + 1) if st.it + 1 < sched.recycles else ("F", m, 0)
                arrive(rf, t, 0, "in", nxt)
            elif st.kind == "F" and sched.all_device:  # last chunk: its output feeds H here
                keep_f[t, s] = bufs["in"].put(s, ("H", m))
            elif st.kind == "E":
                keep_f[t, s] = bufs["in"].put(s, ("F", m, 0))
            if st.kind == "B" and sched.split_backward:  # what its G reads
                keep_s[t, s] = bufs["s"].put(s, ("G", m, st.virtual))
            if st.kind == "B" and c > 0:
                d = (c - 1) % S
                arrive(rb, t, d, "g", ("B", m, (c - 1) // S))
            elif st.kind == "B" and sched.all_device:
                keep_b[t, s] = bufs["g"].put(s, ("W", m))
            elif st.kind == "H":
                keep_b[t, s] = bufs["g"].put(s, ("B", m, V - 1))
    _flush(later, bufs)
    tb = LoopTables(kind, mb, virt, in_slot, g_slot, rf, rb, bufs["in"].size,
                    bufs["g"].size, it, keep_f, keep_b, b_kind, b_mb, b_virt, b_in, b_g,
                    keep_s, s_slot, bufs["s"].size if sched.split_backward else 0)
    return _deferred(tb) if overlap else tb


def _flush(later: list, bufs: dict) -> None:
    """Give the values in ``later`` their slots (row ``t`` of the table each was sent at)."""
    for table, t, d, buf, key in later:
        table[t, d] = bufs[buf].put(d, key)
    later.clear()


_SLOTS = ("rf_slot", "rb_slot", "keep_f", "keep_b", "keep_s")  # (-1: no slot)


def _deferred(tb: LoopTables) -> LoopTables:
    """``tb`` with the receive slots one row later (sent during the next step); a last row
    that sends adds an idle step for its transfer. A slot is taken where the value arrives
    (after the reads of the step it moves in: a slot read then is free for it)."""
    steps = {f.name: getattr(tb, f.name) for f in fields(tb)
             if isinstance(getattr(tb, f.name), np.ndarray)}
    idle = lambda name, a: np.full((1, a.shape[1]), -1 if name in _SLOTS else 0, a.dtype)
    moved = {k: np.concatenate([idle(k, steps[k]), steps[k]]) for k in ("rf_slot", "rb_slot")}
    if moved["rf_slot"][-1].max() < 0 and moved["rb_slot"][-1].max() < 0:
        moved = {k: a[:-1] for k, a in moved.items()}
    else:
        moved.update((k, np.concatenate([a, idle(k, a)])) for k, a in steps.items()
                     if k not in moved)
    return replace(tb, overlap=True, **moved)


def _read(lane: tuple, bufs: dict, t: int, s: int, st: sch.Step) -> None:
    """Fill one lane's row ``[t, s]`` for block ``st``: its code, micro-batch and chunk, and the
    slots it reads (an input stays for the backward after a forward; a backward frees it)."""
    kind, mb, virt, in_slot, g_slot = lane
    m, v = st.microbatch, st.virtual
    kind[t, s], mb[t, s], virt[t, s] = CODES[st.kind], m, v
    read_in = {"F": ("F", m, v), "B": ("F", m, v), "N": ("N", m, v, st.it),
               "H": ("H", m)}.get(st.kind)
    if read_in is not None:
        in_slot[t, s] = bufs["in"].read(s, read_in, free=st.kind != "F")
    read_g = {"B": ("B", m, v), "W": ("W", m)}.get(st.kind)
    if read_g is not None:
        g_slot[t, s] = bufs["g"].read(s, read_g, free=True)


class _Slots:
    """Per stage, buffer slots by key: allocated when a value arrives, freed when read."""

    def __init__(self, stages: int):
        self.free: list[list[int]] = [[] for _ in range(stages)]
        self.used = [0] * stages
        self.at: list[dict] = [{} for _ in range(stages)]

    def put(self, s: int, key: tuple) -> int:
        slot = self.free[s].pop() if self.free[s] else self.used[s]
        self.used[s] = max(self.used[s], slot + 1)
        self.at[s][key] = slot
        return slot

    def read(self, s: int, key: tuple, *, free: bool) -> int:
        if key not in self.at[s]:
            return 0  # chunk 0's fresh input (the batch) or a cotangent the loss seeds
        slot = self.at[s].pop(key) if free else self.at[s][key]
        if free:
            self.free[s].append(slot)
        return slot

    @property
    def size(self) -> int:
        return max(max(self.used), 1)
