"""``Constraints(pipeline_stages="auto")``: the stage DP restricted to what the runtime executes
picks micro-batches and schedule for the mesh's stage axis; the pipelined step runs it."""

import jax
import numpy as np
import optax
import pytest
from meshes import make_mesh

import models
from nnscaler_jax import Constraints, Plan, PlanError, auto_parallel
from nnscaler_jax.plan import schedule as sch
from nnscaler_jax.search.pipeline_dp import runtime_time


@pytest.fixture(scope="module")
def gpt():
    spec = models.get("gpt", "tiny", n_layers=4, batch_size=16)
    (tokens,) = spec.make_args()
    return spec, tokens, spec.init(jax.random.PRNGKey(0))["params"]


def _plan(gpt, mesh, **kw):
    spec, tokens, params = gpt
    pm = auto_parallel(mesh, Constraints(pipeline_stages="auto", **kw), policy="dp")(spec.module)
    return pm.make_plan(tokens, variables={"params": params})


def test_step_table_time_closed_form():
    # lock step: every time step lasts its slowest stage's work; GPipe with equal stages:
    # (M + S - 1) (f + b), the bubble (S - 1) (f + b)
    f, b = [1.0, 1.0], [2.0, 2.0]
    assert runtime_time(sch.gpipe(2, 2), f, b, 0.0) == (9.0, 3.0)
    # 1F1B (S=2, M=4) pairs an F with a B in one time step: 2 steps of f, then 8 with a b
    assert runtime_time(sch.one_f_one_b(2, 4), f, b, 0.0)[0] == 2 * 1.0 + 8 * 2.0
    t, _ = runtime_time(sch.gpipe(2, 2), f, b, 0.5)
    assert t == 9.0 + 6 * 0.5  # both ppermutes after each of the 6 time steps


def test_auto_records_choice_and_trains(gpt):
    spec, tokens, params = gpt
    mesh = make_mesh((2, 4), ("stage", "data"))
    pm = auto_parallel(mesh, Constraints(pipeline_stages="auto"))(spec.module)
    opt = optax.adam(1e-2, eps=1e-3)
    step = pm.train_step(spec.loss_fn, opt)
    state = step.init({"params": params}, tokens)
    state, metrics = step(state, tokens)
    plan = pm.plan
    ref = spec.loss_fn(spec.module.apply({"params": params}, tokens), tokens)
    np.testing.assert_allclose(metrics["loss"], ref, rtol=1e-4)
    assert plan.stages == 2 and plan.schedule in ("gpipe", "1f1b", "interleaved")
    assert step.program.schedule.microbatches == plan.microbatches
    assert 16 % (plan.microbatches * 4) == 0
    assert plan.virtual == (2 if plan.schedule == "interleaved" else 1)
    text = str(plan)
    assert "stage DP" in text and f"chose {plan.schedule} x {plan.microbatches}" in text
    assert Plan.from_json(plan.to_json()) == plan
    assert Plan.from_json(plan.to_json()).pipeline_report == plan.pipeline_report


def _chosen(plan):
    head = plan.pipeline_report.splitlines()[0]
    ms = float(head.split("predicted ")[1].split(" ms")[0])
    mib = float(head.split("peak ")[1].split(" MiB")[0])
    return (plan.schedule, plan.microbatches), ms, mib


def test_memory_budget_changes_choice(gpt):
    mesh = make_mesh((2, 4), ("stage", "data"))
    free = _plan(gpt, mesh)
    choice, ms, mib = _chosen(free)
    rows = [r.split() for r in free.pipeline_report.splitlines()[2:] if "x" in r]
    mems = sorted({float(r[-1]) for r in rows if r[-1] != "budget"})
    assert mems[0] < mib  # a cheaper-in-memory candidate exists, so a budget can bind
    budget = int((mems[0] + 1e-3) * 2**20)
    tight = _plan(gpt, mesh, max_memory_per_device=budget)
    c2, ms2, mib2 = _chosen(tight)
    assert c2 != choice and mib2 <= budget / 2**20 + 1e-6 and ms2 >= ms
    with pytest.raises(PlanError, match="smallest estimate is"):
        _plan(gpt, mesh, max_memory_per_device=int(mems[0] * 0.9 * 2**20))


def test_explicit_fields_respected(gpt):
    mesh = make_mesh((2, 4), ("stage", "data"))
    p = _plan(gpt, mesh, microbatches=2)
    assert p.microbatches == 2
    p = _plan(gpt, mesh, schedule="1f1b")
    assert p.schedule == "1f1b" and p.virtual == 1
    p = _plan(gpt, mesh, schedule="interleaved", microbatches=4)
    assert (p.schedule, p.virtual, p.microbatches) == ("interleaved", 2, 4)
    with pytest.raises(PlanError, match="no schedule the runtime can execute"):
        _plan(gpt, mesh, microbatches=3)


def test_auto_needs_stage_axis(gpt):
    mesh = make_mesh((2, 4), ("data", "model"))
    with pytest.raises(PlanError, match="Add one"):
        _plan(gpt, mesh)
