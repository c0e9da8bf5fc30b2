"""Schedules written with ``op_order``: user orders become the step table each device runs.

Built-in tables come out of the same mechanism; orders that deadlock or break a data dependency
raise ``PlanError`` naming the blocks of the cycle; interlaced / NF1B tables validate, draw and
are priced; a custom schedule survives a saved plan and trains like the single-device step.
"""

import dataclasses
import itertools

import jax
import numpy as np
import optax
import pytest
from meshes import make_mesh
from one_device import assert_same_params, updated

import models
from nnscaler_jax import Constraints, Plan, PlanError, auto_parallel
from nnscaler_jax.constraints import SCHEDULE_NAMES
from nnscaler_jax.pipeline import schedule as sch
from nnscaler_jax.pipeline.order import ScheduleDraft
from nnscaler_jax.pipeline.pricing import runtime_choices, runtime_time
from nnscaler_jax.pipeline.steps import Schedule, Step, deps
from nnscaler_jax.pipeline.units import Unit
from nnscaler_jax.primitives import op_order

RTOL, ATOL = 1e-4, 1e-6  # float32


def _user_1f1b(stages: int, microbatches: int) -> ScheduleDraft:
    """1F1B written by hand: per stage, warm-up forwards, then F and B alternate."""
    sched = ScheduleDraft(stages=stages, microbatches=microbatches)
    for s in range(stages):
        warm = min(stages - s - 1, microbatches)
        row = [sched.F(s, m) for m in range(warm)]
        for i in range(microbatches - warm):
            row += [sched.F(s, warm + i), sched.B(s, i)]
        row += [sched.B(s, m) for m in range(microbatches - warm, microbatches)]
        for a, b in itertools.pairwise(row):
            op_order(sched, a, b)
    return sched


@pytest.mark.parametrize("stages,mbs", [(2, 4), (4, 8), (3, 5), (4, 2)])
def test_user_1f1b_equals_builtin_table(stages, mbs):
    mine, ref = _user_1f1b(stages, mbs).finish(), sch.one_f_one_b(stages, mbs)
    assert mine.steps == ref.steps
    assert sch.timeline(mine) == sch.timeline(ref)


def test_builtins_pinned_tables():
    assert sch.format_schedule(sch.one_f_one_b(2, 4)).splitlines()[1:] == [
        "stage 0 | F0 F1 .  B0 F2 B1 F3 B2 .  B3",
        "stage 1 | .  F0 B0 F1 B1 F2 B2 F3 B3 ."]
    assert [" ".join(map(str, r)) for r in sch.interleaved(2, 2, 2).steps] == [
        "F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1", "F0 F1 F0.1 B0.1 F1.1 B1.1 B0 B1"]


def test_completion_is_documented_default():
    # no pairs: every stage runs its forwards in micro-batch order, then its backwards (GPipe)
    assert ScheduleDraft(3, 4).finish().steps == sch.gpipe(3, 4).steps
    # stage 1 ordered by hand (1F1B-like start); the rest keeps micro-batch order per kind
    d = ScheduleDraft(2, 4)
    d.chain(d.F(1, 0), d.B(1, 0), d.F(1, 1))
    rows = [" ".join(map(str, r)) for r in d.finish().steps]
    assert rows == ["F0 F1 F2 F3 B0 B1 B2 B3", "F0 B0 F1 F2 F3 B1 B2 B3"]


def test_backward_before_forward_names_blocks():
    d = ScheduleDraft(stages=2, microbatches=4)
    op_order(d, d.B(1, 0), d.F(1, 0))
    with pytest.raises(PlanError, match=r"stage 1 runs B0 before F0; B0 on stage 1 needs F0 "
                                        r"on stage 1"):
        d.finish()


def test_cross_stage_deadlock_names_blocks():
    # stage 0 waits for B0 before sending F1; stage 1 needs F1 before it runs B0
    d = ScheduleDraft(stages=2, microbatches=2)
    d.chain(d.F(0, 0), d.B(0, 0), d.F(0, 1), d.B(0, 1))
    d.chain(d.F(1, 0), d.F(1, 1), d.B(1, 0), d.B(1, 1))
    with pytest.raises(PlanError, match="deadlocks") as e:
        d.finish()
    msg = str(e.value)
    for part in ("stage 0 runs B0 before F1", "F1 on stage 1 needs F1 on stage 0",
                 "stage 1 runs F1 before B0", "B0 on stage 0 needs B0 on stage 1"):
        assert part in msg, msg


def test_hand_made_table_deadlock_names_cycle():
    rows = [["F0", "B0", "F1", "B1"], ["F1", "F0", "B0", "B1"]]
    bad = Schedule("custom", 2, 2, 1, tuple(tuple(Step(x[0], int(x[1])) for x in r)
                                            for r in rows))
    with pytest.raises(PlanError, match=r"deadlocks.*stage 0 runs B0 before F1; F1 on stage 1 "
                                        r"needs F1 on stage 0"):
        sch.validate(bad)


def test_all_device_blocks_in_different_orders_deadlock():
    rows = [list(r) for r in sch.interlaced(2, 2).steps]
    r = rows[1]
    i, j = r.index(Step("E", 0)), r.index(Step("E", 1))
    r[i], r[j] = r[j], r[i]
    with pytest.raises(PlanError, match=r"stage 0 runs E0 before F0 before E1; stage 1 runs E1 before E0"):
        sch.validate(Schedule("x", 2, 2, 1, tuple(map(tuple, rows)), 0, True))
    d = ScheduleDraft(2, 2, all_device=True)
    op_order(d, d.H(0), d.F(1, 0))
    with pytest.raises(PlanError, match="stage 1 runs H0 before F0; H0 on all devices needs F0 "
                                        "on stage 1"):
        d.finish()


def test_bad_pairs_and_blocks():
    d = ScheduleDraft(stages=2, microbatches=2)
    with pytest.raises(PlanError, match="share no device"):
        op_order(d, d.F(0, 0), d.F(1, 1))
    with pytest.raises(PlanError, match="outside the draft's 2 stages"):
        d.F(2, 0)
    with pytest.raises(PlanError, match="all_device=True"):
        d.E(0)
    with pytest.raises(PlanError, match="takes its blocks"):
        op_order(d, d.F(0, 0), "F1")


def test_constraints_take_drafts_and_names():
    d = _user_1f1b(2, 4)
    c = Constraints(pipeline_stages=2, schedule=d)
    assert isinstance(c.schedule, Schedule) and c.schedule.steps == sch.one_f_one_b(2, 4).steps
    assert Constraints(schedule="interlaced").schedule == "interlaced"
    assert Constraints(schedule="nf1b").schedule == "nf1b"
    with pytest.raises(PlanError, match="contradicts the schedule's 2 stages"):
        Constraints(pipeline_stages=4, schedule=d)
    with pytest.raises(PlanError, match="contradicts the schedule's 4 micro-batches"):
        Constraints(microbatches=8, schedule=d)
    with pytest.raises(PlanError, match="'interlaced', 'nf1b'"):
        Constraints(schedule="zero-bubble")
    assert set(SCHEDULE_NAMES) == set(sch.SCHEDULES)  # constraints cannot import pipeline/


def test_interlaced_table_validates_and_draws(tmp_path):
    sched = sch.interlaced(4, 8)
    sch.validate(sched)
    table = sch.timeline(sched)
    for row in table:  # an all-device block runs on every stage at once
        if {st.kind for st in row if st is not None} & {"E", "H", "W"}:
            assert len(set(row)) == 1
    when = {(st, -1 if st.all_device else s): t for t, row in enumerate(table)
            for s, st in enumerate(row) if st is not None}
    for (st, stage), t in when.items():  # every block after what it needs
        for d in deps(st, max(stage, 0), sched):
            assert when[d] < t, (st, stage, d)
    # steady state: 5 slots per micro-batch (E, F, H, B, W); the last stage keeps one in flight
    assert len(table) < 5 * 8 + 4 * 4 and sch.peak_in_flight(sched)[-1] == 1
    text = sch.format_schedule(sch.interlaced(2, 2))
    assert text.splitlines()[1] == "stage 0 | E0 F0 E1 F1 H0 .  .  H1 B0 W0 B1 W1"
    _png(sch.plot_gantt(sched, str(tmp_path / "interlaced.png")))


def test_nf1b_table_validates_and_draws(tmp_path):
    s = sch.nf1b(2, 4, recycles=2)
    sch.validate(s)
    assert s.recycles == 2 and len(s.steps[0]) == 4 * (2 + 2)
    row0 = [str(x) for x in s.steps[0]]
    assert row0[:8] == ["N0#0", "N1#0", "N2#0", "N3#0", "N0#1", "N1#1", "N2#1", "N3#1"]
    assert [x for x in row0 if x[0] != "N"] == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert sch.peak_in_flight(s) == sch.peak_in_flight(sch.one_f_one_b(2, 4))
    assert sch.nf1b(2, 4).recycles == 3  # "3F1B"
    # what a plan keeps: the name of the default, the table of any other recycle count
    assert sch.settings_steps(sch.nf1b(2, 4)) == ()
    assert sch.Schedule.from_lists("nf1b", 2, 4, 1, sch.settings_steps(s)) == s
    _png(sch.plot_gantt(s, str(tmp_path / "nf1b.png")))
    # N of pass r + 1 on chunk 0 waits for pass r's last chunk; F waits for the last pass
    assert deps(Step("N", 1, 0, 1), 0, s) == [(Step("N", 1, 0, 0), 1)]
    assert deps(Step("F", 1), 0, s) == [(Step("N", 1, 0, 1), 1)]


def test_gantt_of_a_user_schedule(tmp_path):
    _png(sch.plot_gantt(_user_1f1b(2, 4).finish(), str(tmp_path / "mine.png")))


def _png(path):
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _units(n_layers=4):
    u = lambda name, t, p: Unit(name, t, 1e5, p, 1e4)
    return [u("pre", 1e-3, 1e6)] + [u(f"h_{i}", 4e-3, 4e6) for i in range(n_layers)] + [
        u("post", 2e-3, 1e6)]


def test_pricing_new_and_custom_schedules():
    units = _units()
    base = runtime_choices(units, 2, 1, 8, microbatches=4, schedule="1f1b")[0]
    mine = runtime_choices(units, 2, 1, 8, schedule=_user_1f1b(2, 4).finish())[0]
    assert (mine.step_time_s, mine.memory_bytes) == (base.step_time_s, base.memory_bytes)
    nf = runtime_choices(units, 2, 1, 8, microbatches=4, schedule="nf1b")[0]
    assert nf.schedule == "nf1b" and nf.step_time_s > base.step_time_s
    il = runtime_choices(units, 2, 1, 8, microbatches=4, schedule="interlaced")[0]
    assert il.schedule == "interlaced"
    assert max(il.memory_bytes) < max(base.memory_bytes)  # embedding / head split 2 ways
    # the all-device blocks cost what they are given, on every stage at once
    t, _ = runtime_time(sch.interlaced(1, 1), [1.0], [2.0], 0.0, {"E": 0.5, "H": 3.0, "W": 0.25})
    assert t == 0.5 + 1.0 + 3.0 + 2.0 + 0.25
    with pytest.raises(PlanError, match="has 4 stages"):
        runtime_choices(units, 2, 1, 8, schedule=sch.one_f_one_b(4, 4))


def test_stage_dp_weighs_interlaced_as_each_runtime_runs_it():
    # interlaced runs on both runtimes: a candidate whatever the stages' tensor parallelism
    names = lambda tp: {r.schedule for r in runtime_choices(_units(), 2, 1, 8, tp=tp)}
    assert names(1) == names(2) == {"gpipe", "1f1b", "eager-1f1b", "interleaved", "interlaced",
                                    "zb-h1"}
    # the cut program (lock step) runs E / H / W on one stage, their parameters replicated on
    # both; the per-stage runtime (tensor-parallel stages) on every device at once, split over
    # stages x tp: the prefix / suffix parameters per device halve (the rest of the difference:
    # the inputs each runtime holds, 1-2 %), every stage runs them
    units = _units()
    price = lambda lockstep: runtime_choices(units, 2, 1, 8, microbatches=4, tp=2,
                                             schedule="interlaced", lockstep=lockstep,
                                             modes=("chunk",))[0]
    one, every = price(True), price(False)
    shared = (units[0].param_bytes + units[-1].param_bytes) * 4  # (+ gradient, Adam)
    np.testing.assert_allclose(np.subtract(one.memory_bytes, every.memory_bytes), shared / 4,
                               rtol=0.05)
    assert every.compute_s < one.compute_s  # (the busiest stage's share of E / H / W)
    # a chunk reading a shared parameter too (T5's tied table in the decoder) keeps a copy of
    # it on its stage there (with gradient and Adam state, split over tp); in lock step the
    # shared parameters are on every stage anyway
    tied = units[:2] + [dataclasses.replace(units[2], shared_bytes=1e6)] + units[3:]
    again = lambda lockstep: runtime_choices(tied, 2, 1, 8, microbatches=4, tp=2,
                                             schedule="interlaced", lockstep=lockstep,
                                             modes=("chunk",))[0].memory_bytes
    np.testing.assert_allclose(np.subtract(again(False), every.memory_bytes), [2e6, 0])
    assert again(True) == one.memory_bytes


def test_events_run_all_device_blocks_on_every_stage_at_once():
    # one stage, one micro-batch: E, F, H, B, W one after another
    t, _ = runtime_time(sch.interlaced(1, 1), [1.0], [2.0], 0.0,
                        {"E": 0.5, "H": 3.0, "W": 0.25}, lockstep=False)
    assert t == 0.5 + 1.0 + 3.0 + 2.0 + 0.25
    # two stages: a block of every device waits for both stages to be free
    t2, bubble = runtime_time(sch.interlaced(2, 2), [1.0] * 2, [2.0] * 2, 0.0,
                              {"E": 0.5, "H": 3.0, "W": 0.25}, lockstep=False)
    lock, _ = runtime_time(sch.interlaced(2, 2), [1.0] * 2, [2.0] * 2, 0.0,
                           {"E": 0.5, "H": 3.0, "W": 0.25})
    assert 2 * (0.5 + 3.0 + 0.25) + 2 * 3.0 < t2 <= lock and bubble > 0


@pytest.fixture(scope="module")
def gpt():
    spec = models.get("gpt", "tiny", n_layers=4, batch_size=16)
    (tokens,) = spec.make_args()
    return spec, tokens, spec.init(jax.random.PRNGKey(0))["params"]


def test_saved_plan_keeps_custom_schedule(gpt):
    spec, tokens, params = gpt
    d = ScheduleDraft(2, 4, name="mine")
    d.chain(d.F(1, 0), d.B(1, 0), d.F(1, 1), d.B(1, 1), d.F(1, 2), d.B(1, 2))
    mine = d.finish()
    pm = auto_parallel(make_mesh((2, 4), ("stage", "data")),
                       Constraints(pipeline_stages=2, schedule=mine))(spec.module)
    plan = pm.make_plan(tokens, variables={"params": params})
    pipe = plan.pipeline
    assert (pipe.schedule, pipe.microbatches) == ("mine", 4) and pipe.steps
    again = Plan.from_json(plan.to_json())
    assert again == plan and sch.from_settings(again.pipeline) == mine
    assert "schedule mine (written with op_order)" in str(plan)
    reused = auto_parallel(make_mesh((2, 4), ("stage", "data")), plan=again)(spec.module)
    assert reused.make_plan(tokens).pipeline == pipe  # re-priced, same table
    # a built-in's table is not stored: its name is enough
    pm2 = auto_parallel(make_mesh((2, 4), ("stage", "data")),
                        Constraints(pipeline_stages=2, schedule=sch.one_f_one_b(2, 4)))(
        spec.module)
    pipe2 = pm2.make_plan(tokens, variables={"params": params}).pipeline
    assert (pipe2.schedule, pipe2.steps) == ("1f1b", ())


@pytest.mark.slow
def test_user_order_trains_like_single_device(gpt):
    spec, tokens, params = gpt
    d = ScheduleDraft(stages=2, microbatches=4, name="mine")
    for s, row in enumerate([[("F", 0), ("F", 1), ("B", 0), ("F", 2), ("F", 3), ("B", 1),
                              ("B", 2), ("B", 3)],
                             [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2),
                              ("F", 3), ("B", 3)]]):
        d.chain(*[(d.F if k == "F" else d.B)(s, m) for k, m in row])
    opt = optax.sgd(0.1)
    pm = auto_parallel(make_mesh((2, 4), ("stage", "data")),
                       Constraints(pipeline_stages=2, schedule=d))(spec.module)
    step = pm.train_step(spec.loss_fn, opt)
    state = step.init({"params": params}, tokens)
    assert " ".join(map(str, step.program.schedule.steps[0])) == "F0 F1 B0 F2 F3 B1 B2 B3"
    state, metrics = step(state, tokens)
    loss_fn = lambda p: spec.loss_fn(spec.module.apply({"params": p}, tokens), tokens)
    ref_loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    ref = updated(opt, params, grads)
    np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=RTOL)
    assert_same_params(step.params(state), ref, RTOL, ATOL)

