"""Transfers overlapped with compute in the in-graph runtimes (``Constraints(pipeline_overlap=)``).

Each time step sends the previous step's activations and cotangents beside its own blocks
(``in_graph.exchange``), so the step table places a result read on another stage one step
later (``steps.timeline(lag=1)``, ``loop_tables(overlap=True)``), and the pricing makes a step
last its compute or its transfers, the longer (``pricing.runtime_time(overlap=True)``).
"""

import jax
import pytest
from meshes import make_mesh

import models
from nnscaler_jax import ConstraintError, Constraints, PlanError, auto_parallel
from nnscaler_jax.mesh.topology import LinkCost
from nnscaler_jax.pipeline import schedule as sch
from nnscaler_jax.pipeline.loop_tables import loop_tables
from nnscaler_jax.pipeline.pricing import runtime_choices, runtime_time
from nnscaler_jax.pipeline.steps import ALL, blocks, deps
from nnscaler_jax.pipeline.units import Unit

RTOL, ATOL = 1e-4, 1e-6

SCHEDULES = [("gpipe", 4, 8), ("1f1b", 4, 8), ("eager-1f1b", 4, 8), ("interleaved", 2, 4),
             ("zb-h1", 3, 6), ("interlaced", 2, 4), ("nf1b", 2, 4)]


@pytest.mark.parametrize("name,S,M", SCHEDULES)
def test_a_result_is_read_on_another_stage_two_steps_after_it_is_made(name, S, M):
    sched = sch.build(name, S, M, 2 if name == "interleaved" else 1)
    table = sch.timeline(sched, lag=1)
    at = {}
    for t, row in enumerate(table):
        for s, cell in enumerate(row):
            for st in blocks(cell):
                at[(st, ALL if st.all_device else s)] = t
    assert len(at) == len({(st, ALL if st.all_device else s)
                           for s, r in enumerate(sched.steps) for st in r})
    crossed = 0
    for (st, s), t in at.items():
        for d, ds in deps(st, max(s, 0), sched):
            far = ds not in (s, ALL) and not st.all_device
            crossed += far
            assert t - at[(d, ds)] >= (2 if far else 1), (st, s, d, ds)
    assert crossed > 0
    tb, plain = loop_tables(sched, "FBNEHWG", overlap=True), loop_tables(sched, "FBNEHWG")
    assert tb.overlap and not plain.overlap
    assert (tb.rf_slot[0] < 0).all() and (tb.rb_slot[0] < 0).all()  # nothing arrives first
    assert tb.transfers.all() and not plain.transfers.all()  # every step, outside a branch
    assert len(tb.kind) >= len(table) >= len(sch.timeline(sched))


def test_overlapped_steps_last_their_compute_or_their_transfers():
    # GPipe, S = 4, M = 16, f = 1, b = 2: each hop takes two steps, so the table has
    # M + 2 (S - 1) forward steps and as many backward steps, each as long as its blocks or
    # the transfers beside them; in lock step after the step, M + S - 1 of each plus the
    # transfers of the steps some stage receives in
    S, M, f, b = 4, 16, [1.0] * 4, [2.0] * 4
    gp = sch.gpipe(S, M)
    for p in (0.0, 0.5, 1.0, 2.0):
        over, _ = runtime_time(gp, f, b, p, overlap=True)
        assert over == pytest.approx((M + 2 * (S - 1)) * (max(1.0, p) + max(2.0, p)))
        moves = int(loop_tables(gp, "FBNEHWG").transfers.sum())
        assert runtime_time(gp, f, b, p)[0] == pytest.approx((M + S - 1) * 3.0 + moves * p)
    assert runtime_time(gp, f, b, 0.0, overlap=True)[0] > runtime_time(gp, f, b, 0.0)[0]
    assert runtime_time(gp, f, b, 0.5, overlap=True)[0] < runtime_time(gp, f, b, 0.5)[0]


def _units():
    # a chunk (one layer) a sample: forward 1 ms, backward 2 ms; 4096 bytes sent on
    return [Unit("<prefix>", 0.0, 0.0, 8.0, 4.0)] + [
        Unit(f"h_{i}", 3e-3, 10.0, 16.0, 4096.0) for i in range(4)] + [
        Unit("<suffix>", 0.0, 0.0, 8.0, 0.0)]


def test_the_pricing_overlaps_where_transfers_are_slow():
    """Priced both ways (overlap=None): where both transfers take half a forward (forward
    1 ms, recomputed forward + backward 3 ms), the rows overlap (GPipe's 88.25 ms against
    94.25); where they are free, they do not (a longer table for nothing: 88.0 against
    76.0 ms). Overlapped rows hold two more stage inputs."""
    def best(link):
        return runtime_choices(_units(), 4, 1, 16, microbatches=16, schedule="gpipe",
                               stage_link=link, overlap=None)
    slow, free = best(LinkCost(2.5e-4, 0.0)), best(LinkCost(0.0, 0.0))
    assert slow[0].overlap and not free[0].overlap
    assert {r.overlap for r in slow} == {True, False}
    over, plain = (next(r for r in free if r.overlap is o and r.recompute == "chunk")
                   for o in (True, False))
    slots = loop_tables(sch.gpipe(4, 16), "FBNEHWG", overlap=True)
    base = loop_tables(sch.gpipe(4, 16), "FBNEHWG")
    extra = (slots.n_in + slots.n_g + 2 - base.n_in - base.n_g) * 4096.0 * 1  # mb of 1 row
    assert max(over.memory_bytes) - max(plain.memory_bytes) == pytest.approx(extra)
    assert "/ov" in over.row() and "/ov" not in plain.row()
    with pytest.raises(PlanError, match="overlap=True"):  # one program per stage: not its
        runtime_choices(_units(), 4, 1, 16, schedule="gpipe", lockstep=False, overlap=True)


def test_overlap_constraint_errors():
    with pytest.raises(ConstraintError, match="pipeline_overlap='yes'"):
        Constraints(pipeline_overlap="yes")
    with pytest.raises(ConstraintError, match="per-stage runtime sends"):
        Constraints(pipeline_overlap=True, pipeline_executor="per-stage")
    spec = models.get("t5", "tiny", batch_size=8)
    args = spec.make_args()
    variables = spec.init(jax.random.PRNGKey(0))
    pm = auto_parallel(make_mesh((2, 4), ("stage", "model")),
                       Constraints(pipeline_stages=2, microbatches=2, pipeline_overlap=True),
                       policy="megatron")(spec.module)
    with pytest.raises(PlanError, match="tensor-parallel over mesh axes \\['model'\\]"):
        pm.make_plan(*args, variables=variables)
