"""Schedules as step tables: builders valid, hand-written errors named, in-flight counts."""

import pytest

from nnscaler_jax.errors import PlanError
from nnscaler_jax.pipeline import schedule as sch
from nnscaler_jax.pipeline.pricing import runtime_time
from nnscaler_jax.pipeline.schedule import Schedule, Step


@pytest.mark.parametrize("stages,mbs", [(1, 1), (2, 4), (4, 4), (4, 8), (3, 5)])
def test_builders_valid(stages, mbs):
    for s in (sch.gpipe(stages, mbs), sch.one_f_one_b(stages, mbs)):
        sch.validate(s)
        table = sch.timeline(s)
        assert sum(st is not None for row in table for st in row) == 2 * stages * mbs


@pytest.mark.parametrize("stages,mbs,v", [(2, 4, 2), (4, 8, 2), (2, 4, 3)])
def test_interleaved_valid(stages, mbs, v):
    s = sch.interleaved(stages, mbs, v)
    sch.validate(s)
    assert len(s.steps[0]) == 2 * mbs * v


def test_peak_in_flight():
    assert sch.peak_in_flight(sch.one_f_one_b(4, 8)) == (4, 3, 2, 1)
    assert sch.peak_in_flight(sch.gpipe(4, 8)) == (8,) * 4
    assert sch.peak_in_flight(sch.one_f_one_b(4, 2)) == (2, 2, 2, 1)


def test_1f1b_timeline_closed_form():
    # 1F1B with unit steps: 2 (M + S - 1) time steps, same as GPipe; stage s starts at step s.
    for S, M in ((2, 4), (4, 8)):
        t = sch.timeline(sch.one_f_one_b(S, M))
        assert len(t) == 2 * (M + S - 1) == len(sch.timeline(sch.gpipe(S, M)))
        for s in range(S):
            assert next(i for i, row in enumerate(t) if row[s] is not None) == s


def _custom(rows, stages=2, mbs=2):
    return Schedule("custom", stages, mbs, 1, tuple(tuple(Step(k, m) for k, m in r)
                                                   for r in rows))


def test_invalid_backward_before_forward():
    bad = _custom([[("B", 0), ("F", 0), ("F", 1), ("B", 1)],
                   [("F", 0), ("B", 0), ("F", 1), ("B", 1)]])
    with pytest.raises(PlanError, match=r"stage 0 step 0 'B0' comes before its forward"):
        sch.validate(bad)


def test_invalid_deadlock_names_step():
    # stage 0 wants B0 before sending F1; stage 1 wants F1 before F0 -> a cycle
    bad = _custom([[("F", 0), ("B", 0), ("F", 1), ("B", 1)],
                   [("F", 1), ("F", 0), ("B", 0), ("B", 1)]])
    with pytest.raises(PlanError, match=r"deadlocks.*stage 1 step 0 'F1' waits for F1 on stage 0"):
        sch.validate(bad)


def test_invalid_missing_and_duplicate():
    with pytest.raises(PlanError, match="never runs 'B1'"):
        sch.validate(_custom([[("F", 0), ("F", 1), ("B", 0)],
                              [("F", 0), ("F", 1), ("B", 0), ("B", 1)]]))
    with pytest.raises(PlanError, match="runs 'F0' twice"):
        sch.validate(_custom([[("F", 0), ("F", 0), ("F", 1), ("B", 0), ("B", 1)],
                              [("F", 0), ("F", 1), ("B", 0), ("B", 1)]]))


def test_printer_and_gantt(tmp_path):
    text = sch.format_schedule(sch.one_f_one_b(2, 4))
    assert text.splitlines()[1] == "stage 0 | F0 F1 .  B0 F2 B1 F3 B2 .  B3"
    out = sch.plot_gantt(sch.interleaved(2, 4, 2), str(tmp_path / "g.png"))
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("S,M", [(2, 4), (4, 8), (3, 5), (4, 2), (8, 16)])
def test_eager_1f1b_pairs_a_forward_and_a_backward_per_step(S, M):
    """Eager 1F1B in lock step: GPipe's time (f = 1, b = 2 per chunk) in M + 2S - 1 time steps
    (GPipe: 2 (M + S - 1); fewer ppermute rounds where the steps send, M > S), with
    2 (S - s) - 1 micro-batches in flight on stage s; 1F1B (unpaired: a forward and a backward of different stages share a
    step and wait for the slower) is slower whenever the pipeline has a steady state."""
    eager, gpipe, one = sch.eager_one_f_one_b(S, M), sch.gpipe(S, M), sch.one_f_one_b(S, M)
    table = sch.timeline(eager)
    assert sum(len(sch.blocks(c)) for row in table for c in row) == 2 * S * M
    assert len(table) == M + 2 * S - 1 < len(sch.timeline(gpipe)) or M < 2
    assert sch.peak_in_flight(eager) == tuple(min(2 * (S - s) - 1, M) for s in range(S))
    f, b = [1.0] * S, [2.0] * S
    t_eager, t_gpipe = runtime_time(eager, f, b, 0.0)[0], runtime_time(gpipe, f, b, 0.0)[0]
    assert t_eager == t_gpipe == (M + S - 1) * 3.0
    slower = runtime_time(gpipe, f, b, 0.1)[0] - runtime_time(eager, f, b, 0.1)[0]
    assert slower > 0.05 if M > S else slower >= 0
    if M > S:
        assert runtime_time(one, f, b, 0.0)[0] > t_eager
    # the steady state: a Pair on every stage (each stage's forward then its backward)
    pairs = [row for row in table if all(isinstance(c, sch.Pair) for c in row)]
    assert len(pairs) == max(M - 2 * S + 1, 0)
    assert all(p.forward.kind == "F" and p.backward.kind == "B" for row in pairs for p in row)
    # 1F1B's own table is not paired
    assert not any(isinstance(c, sch.Pair) for row in sch.timeline(one) for c in row)


def test_a_paired_schedule_written_with_op_order_keeps_its_pairs_in_a_saved_plan():
    from nnscaler_jax.pipeline.order import ScheduleDraft
    from nnscaler_jax.plan.plan import PipelineSettings

    d = ScheduleDraft(2, 4, name="mine", paired=True)
    for s in range(2):
        d.chain(*sch._one_f_one_b_row(d, s, 2 * (1 - s)))
    mine = d.finish()
    settings = PipelineSettings(2, 4, "mine", steps=sch.settings_steps(mine), paired=True)
    back = PipelineSettings.from_dict(settings.to_dict())
    again = sch.from_settings(back)
    assert again.paired and sch.timeline(again) == sch.timeline(sch.eager_one_f_one_b(2, 4))
