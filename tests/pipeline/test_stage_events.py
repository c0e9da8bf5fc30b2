"""The per-stage runtime is priced as it runs: by events, not in lock step (issue 46).

Tensor-parallel cut stages run one program per stage (pipeline/mpmd.py), dispatched from the
host: each stage runs its blocks in its order as their inputs arrive. Priced so, 1F1B takes
GPipe's time at equal micro-batches (in lock step it takes up to a backward per time step),
zb-h1 less, and a stage holds the inputs that have arrived, not the in-graph loop's slots.
"""

import pytest
from meshes import make_mesh

import models
from nnscaler_jax import Constraints, auto_parallel
from nnscaler_jax.pipeline import schedule as sch
from nnscaler_jax.pipeline.pricing import runtime_time

GRID = [(2, 4), (4, 8), (4, 16), (8, 16)]


@pytest.mark.parametrize("S,M", GRID)
def test_1f1b_takes_gpipes_time_when_stages_run_as_inputs_arrive(S, M):
    f, b = [1.0] * S, [3.0] * S
    want = (M + S - 1) * (1.0 + 3.0)  # equal stages, free sends
    for name in ("gpipe", "1f1b", "eager-1f1b"):
        step, bubble = runtime_time(sch.build(name, S, M), f, b, 0.0, lockstep=False)
        assert step == pytest.approx(want) and bubble == pytest.approx(want - 4.0 * M)
    lock, _ = runtime_time(sch.build("1f1b", S, M), f, b, 0.0)
    assert lock > want  # (lock step: a forward beside a backward lasts the backward)


@pytest.mark.parametrize("S,M", GRID)
def test_zb_h1_below_1f1b_when_stages_run_as_inputs_arrive(S, M):
    f, b = [1.0] * S, [3.0] * S
    zb, zb_bubble = runtime_time(sch.zb_h1(S, M), f, b, 0.0, wgrad=[1.0] * S, lockstep=False)
    one, one_bubble = runtime_time(sch.one_f_one_b(S, M), f, b, 0.0, lockstep=False)
    assert zb < one and zb_bubble < one_bubble
    assert zb_bubble >= (S - 1) * (1.0 + 2.0 - 1.0) - 1e-9  # ZB-H1's bound: (S-1)(F + B - W)


def test_sends_delay_the_next_stage():
    # one micro-batch over 2 stages: F, send, F, B, send, B
    step, _ = runtime_time(sch.one_f_one_b(2, 1), [1.0, 1.0], [3.0, 3.0], 2 * 0.5,
                           lockstep=False)
    assert step == pytest.approx(1 + 0.5 + 1 + 3 + 0.5 + 3)


@pytest.mark.slow
def test_tensor_parallel_cut_stages_priced_by_events():
    # GPT cut into 2 stages of 2 layers, wider than the zoo's tiny: its blocks take less than
    # the host takes to dispatch them (the per-stage runtime's floor, HOST_DISPATCH_S)
    spec = models.get("gpt", "tiny", batch_size=32, n_layers=4, d_model=256)
    variables, args = spec.init_abstract(), spec.make_args(abstract=True)
    mesh = make_mesh((2, 2, 2), ("stage", "data", "model"))
    cost = {}
    for name in ("gpipe", "1f1b", "zb-h1"):
        pm = auto_parallel(mesh, Constraints(pipeline_stages=2, microbatches=8, schedule=name,
                                             pipeline_pivots=("h_*",)),
                           policy="megatron")(spec.module)
        cost[name] = pm.make_plan(*args, variables=variables).cost
    assert cost["1f1b"].step_time_s == pytest.approx(cost["gpipe"].step_time_s, rel=1e-9)
    assert cost["zb-h1"].step_time_s < cost["1f1b"].step_time_s
    # stage 1 holds the inputs that arrived: all 8 under GPipe, fewer under 1F1B
    assert cost["1f1b"].memory_bytes_per_device < cost["gpipe"].memory_bytes_per_device
    # the stage DP weighs zb-h1 (and interleaved, the model cut into 2 chunks a stage)
    pm = auto_parallel(mesh, Constraints(pipeline_stages="auto", microbatches=8,
                                         pipeline_pivots=("h_*",)),
                       policy="megatron")(spec.module)
    auto = pm.make_plan(*args, variables=variables)
    assert "zb-h1" in auto.pipeline.report
    assert auto.cost.step_time_s <= cost["zb-h1"].step_time_s
