"""Which pipeline runtime runs a plan is decided once, by the planner, and priced as it runs
(issue 46): ``'in-graph'`` (one program over the stage axis, in lock step) or ``'per-stage'``
(one program per stage dispatched from the host, each stage as its inputs arrive). Stages
data-parallel inside can run either; the planner prices both and records its choice in
``plan.pipeline.executor``, which the step follows. In lock step 1F1B lasts a backward per
time step; per stage it takes GPipe's time at equal micro-batches.
"""


import jax
import optax
import pytest
from meshes import make_mesh
from one_device import assert_trains_like_one_device

import models
from nnscaler_jax import ConstraintError, Constraints, PlanError, auto_parallel
from nnscaler_jax.cost.devices import NVLINK_H100
from nnscaler_jax.pipeline.pricing import HOST_DISPATCH_S, RuntimeSetup
from nnscaler_jax.pipeline.units import Unit
from nnscaler_jax.plan.plan import Plan


def _setup(seconds: float, executors=("in-graph", "per-stage")) -> RuntimeSetup:
    """A prefix, 4 layers of ``seconds`` forward each and a suffix on 2 stages x 2 data."""
    u = lambda name, t: Unit(name, t, 1e5, 4e6, 1e4)
    units = [u("pre", seconds / 4)] + [u(f"h_{i}", seconds) for i in range(4)] + [
        u("post", seconds / 2)]
    return RuntimeSetup(units, "stage", ("data",), (), 2, 2, 1, 16, NVLINK_H100, NVLINK_H100,
                        NVLINK_H100, modes=("chunk",), executors=executors)


def test_both_runtimes_priced_and_1f1b_not_slower_than_gpipe_per_stage():
    setup = _setup(1.0)
    rows = setup.choices(microbatches=8)
    by = {(r.schedule, r.executor): r for r in rows if r.virtual == 1}
    one, gpipe = by["1f1b", "in-graph"], by["gpipe", "in-graph"]
    assert one.step_time_s > 1.2 * gpipe.step_time_s  # (lock step: a backward a time step)
    assert by["1f1b", "per-stage"].step_time_s == pytest.approx(
        by["gpipe", "per-stage"].step_time_s, rel=1e-9)
    assert by["1f1b", "per-stage"].step_time_s <= gpipe.step_time_s
    # 1F1B's memory: fewer inputs held than GPipe's, per stage as in one program
    assert max(by["1f1b", "per-stage"].memory_bytes) < max(by["gpipe", "per-stage"].memory_bytes)
    # no all-device schedule without a tensor axis to fold the stages into
    assert ("interlaced", "per-stage") not in by and ("interlaced", "in-graph") in by
    assert rows[0].executor == "per-stage"  # (the fastest: nothing waits for a lock step)


def test_host_dispatch_bounds_the_per_stage_runtime():
    """Blocks shorter than the host takes to dispatch them: the one program wins (a tie would
    too), and the per-stage row is no faster than its dispatches."""
    setup = _setup(1e-7)
    rows = setup.choices(microbatches=8, schedule="1f1b")
    per = next(r for r in rows if r.executor == "per-stage")
    assert rows[0].executor == "in-graph"
    # 1F1B on 2 stages x 8 micro-batches: 32 blocks, 16 sends, 2 updates
    assert per.step_time_s >= 50 * HOST_DISPATCH_S
    with pytest.raises(PlanError, match="no schedule"):
        _setup(1.0, ("per-stage",)).choices(schedule="interlaced")


def test_executor_constraint_is_checked():
    """An unknown executor is refused; tensor-parallel cut stages run one program per stage
    unless one program is asked (then it is kept: the plan runs them on each device's
    blocks)."""
    with pytest.raises(ConstraintError, match="pipeline_executor='host'"):
        Constraints(pipeline_executor="host")
    spec = models.get("gpt", "tiny", n_layers=4, batch_size=16)
    mesh = make_mesh((2, 2, 2), ("stage", "data", "model"))
    for asked, want in ((None, "per-stage"), ("in-graph", "in-graph")):
        pm = auto_parallel(mesh, Constraints(pipeline_stages=2, pipeline_pivots=("h_*",),
                                             pipeline_executor=asked),
                           policy="megatron")(spec.module)
        plan = pm.make_plan(*spec.make_args(abstract=True), variables=spec.init_abstract())
        assert plan.pipeline.executor == want


def test_several_processes_run_cut_stages_in_one_program(monkeypatch):
    """Across processes the per-stage runtime cannot move values between the stages' devices
    (JAX does not device_put between processes: a 2-process run failed at its first step).
    The planner then runs tensor-parallel cut stages in one program, and the per-stage
    runtime, asked or saved in a plan, is refused with the fix."""
    spec = models.get("gpt", "tiny", n_layers=4, batch_size=16)
    mesh = make_mesh((2, 2, 2), ("stage", "data", "model"))
    args, variables = spec.make_args(abstract=True), spec.init_abstract()
    one = auto_parallel(mesh, Constraints(pipeline_stages=2, pipeline_pivots=("h_*",)),
                        policy="megatron")(spec.module).make_plan(*args, variables=variables)
    assert one.pipeline.executor == "per-stage"
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    pm = auto_parallel(mesh, Constraints(pipeline_stages=2, pipeline_pivots=("h_*",)),
                       policy="megatron")(spec.module)
    assert pm.make_plan(*args, variables=variables).pipeline.executor == "in-graph"
    asked = auto_parallel(mesh, Constraints(pipeline_stages=2, pipeline_pivots=("h_*",),
                                            pipeline_executor="per-stage"),
                          policy="megatron")(spec.module)
    with pytest.raises(PlanError, match="2 processes.*pipeline_executor='in-graph'"):
        asked.make_plan(*args, variables=variables)
    step = auto_parallel(mesh, Constraints(pipeline_stages=2), plan=one)(spec.module) \
        .train_step(spec.loss_fn, optax.sgd(0.1))
    with pytest.raises(PlanError, match="2 processes"):
        step.build(variables, *args)


@pytest.mark.slow
def test_per_stage_data_parallel_stages_train_like_one_device():
    """A stack of identical layers cut into stages run one program each (the user's choice),
    data-parallel inside: 2 Adam steps equal one device's; the plan says so and keeps it when
    saved. An optimizer coupling the stages' leaves (global-norm clipping) runs as priced, one
    program per stage, its update on the module's whole tree, and trains the same."""
    spec = models.get("gpt", "tiny", n_layers=4, batch_size=16)
    variables, args = spec.init(jax.random.PRNGKey(0)), spec.make_args()
    mesh = make_mesh((2, 4), ("stage", "data"))
    pm = auto_parallel(mesh, Constraints(pipeline_stages=2, microbatches=4, schedule="1f1b",
                                         pipeline_executor="per-stage"),
                       policy="dp")(spec.module)
    opt = optax.adam(1e-2, eps=1e-3)
    step = pm.train_step(spec.loss_fn, opt)
    assert_trains_like_one_device(step, spec, variables, args, opt, steps=2)
    assert type(step.program).__name__ == "MpmdProgram" and step.program.tp_axes == ()
    plan = step.plan
    assert plan.pipeline.executor == "per-stage"
    assert "one program per stage" in str(plan)
    assert Plan.from_json(plan.to_json()).pipeline.executor == "per-stage"
    clipped = optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(0.1))
    step = pm.train_step(spec.loss_fn, clipped)
    assert_trains_like_one_device(step, spec, variables, args, clipped, steps=2)
    assert type(step.program).__name__ == "MpmdProgram"


def test_auto_weighs_a_stack_run_one_program_per_stage():
    """``pipeline_stages="auto"`` on a stack of identical layers (the stacked program in lock
    step) also prices it cut into one program per stage, and keeps that where it is faster;
    the plan records it and names it in its report."""
    spec = models.get("gpt", "tiny", batch_size=32, n_layers=4, d_model=256)
    args, variables = spec.make_args(abstract=True), spec.init_abstract()
    mesh = make_mesh((2, 4), ("stage", "data"))
    plans = {}
    for ex in ("in-graph", "per-stage", None):
        pm = auto_parallel(mesh, Constraints(pipeline_stages="auto", microbatches=8,
                                             schedule="1f1b", pipeline_executor=ex),
                           policy="dp")(spec.module)
        plans[ex] = pm.make_plan(*args, variables=variables)
    lock, per, auto = plans["in-graph"], plans["per-stage"], plans[None]
    assert lock.pipeline.executor == "in-graph" and per.pipeline.executor == "per-stage"
    assert per.cost.step_time_s < lock.cost.step_time_s  # (1F1B: no lock step)
    assert auto.pipeline.executor == "per-stage"
    assert auto.cost.step_time_s == pytest.approx(per.cost.step_time_s, rel=1e-9)
    assert "one program per stage" in auto.pipeline.report
    where = dict(auto.pipeline.stage_of)  # (cut at module boundaries, 2 layers a stage)
    assert [where[f"h_{i}"] for i in range(4)] == [0, 0, 1, 1]
