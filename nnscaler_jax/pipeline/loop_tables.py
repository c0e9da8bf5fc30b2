"""The schedule's step table as the tables the pipeline runtime's loop reads.

:class:`~nnscaler_jax.pipeline.runtime.PipelineProgram` runs one ``lax.fori_loop`` over time
steps; at step ``t`` a device of stage ``s`` reads row ``[t, s]`` of each table: what to do
(idle / forward / backward), which micro-batch and virtual chunk, which buffer slot holds its
input (and, in a backward, its cotangent), and into which slot the activation / cotangent the
neighbours send after the step goes. Slots are reused as soon as a backward frees them, so the
input buffer holds the schedule's peak in-flight micro-batches.

>>> t = loop_tables(sch.one_f_one_b(2, 4))
>>> t.kind.shape, t.n_in
((10, 2), 2)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nnscaler_jax.pipeline import schedule as sch

__all__ = ["LoopTables", "loop_tables"]


@dataclass(frozen=True)
class LoopTables:
    """Per (time step, stage) int32 tables driving the runtime's interpreter loop.

    Attributes:
        n_in / n_g: input / cotangent buffer slots per stage (at least 1).
    """

    kind: np.ndarray      # 0 idle, 1 forward, 2 backward
    mb: np.ndarray        # micro-batch
    virt: np.ndarray      # virtual chunk on the stage
    in_slot: np.ndarray   # input-buffer slot the step reads
    g_slot: np.ndarray    # cotangent-buffer slot a backward reads
    rf_slot: np.ndarray   # slot to store the activation received after the step (-1: none)
    rb_slot: np.ndarray   # slot to store the cotangent received after the step (-1: none)
    n_in: int
    n_g: int


def loop_tables(sched: sch.Schedule) -> LoopTables:
    """The tables of ``sched``'s step table (:func:`~nnscaler_jax.pipeline.schedule.timeline`):
    what each stage does at each time step and which buffer slots it reads and fills.

    Raises:
        PlanError: the schedule has blocks the runtime does not execute yet (no-grad forwards
            ``N``, all-device blocks ``E`` / ``H`` / ``W``).
    """
    sch.require_runnable(sched)
    table = sch.timeline(sched)
    T, S, C = len(table), sched.stages, sched.chunks
    z = lambda fill=0: np.full((T, S), fill, np.int32)
    kind, mb, virt, in_slot, g_slot, rf, rb = z(), z(), z(), z(), z(), z(-1), z(-1)
    free_in: list[list[int]] = [[] for _ in range(S)]
    free_g: list[list[int]] = [[] for _ in range(S)]
    used_in, used_g = [0] * S, [0] * S
    slot_in: list[dict] = [{} for _ in range(S)]
    slot_g: list[dict] = [{} for _ in range(S)]

    def alloc(free, used, s):
        if free[s]:
            return free[s].pop()
        used[s] += 1
        return used[s] - 1

    for t, row in enumerate(table):
        for s, st in enumerate(row):
            if st is None:
                continue
            kind[t, s] = 1 if st.kind == "F" else 2
            mb[t, s], virt[t, s] = st.microbatch, st.virtual
            key = (st.microbatch, st.virtual)
            in_slot[t, s] = slot_in[s].get(key, 0)
            if st.kind == "B":
                if key in slot_in[s]:
                    free_in[s].append(slot_in[s].pop(key))
                if key in slot_g[s]:
                    g_slot[t, s] = slot_g[s][key]
                    free_g[s].append(slot_g[s].pop(key))
        # after the step: what arrives from the neighbours
        for s, st in enumerate(row):
            if st is None:
                continue
            c = st.virtual * S + s
            if st.kind == "F" and c + 1 < C:
                d, key = (c + 1) % S, (st.microbatch, (c + 1) // S)
                slot_in[d][key] = rf[t, d] = alloc(free_in, used_in, d)
            if st.kind == "B" and c > 0:
                d, key = (c - 1) % S, (st.microbatch, (c - 1) // S)
                slot_g[d][key] = rb[t, d] = alloc(free_g, used_g, d)
    return LoopTables(kind, mb, virt, in_slot, g_slot, rf, rb, max(max(used_in), 1),
                   max(max(used_g), 1))

