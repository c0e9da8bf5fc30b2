"""Zero-bubble pipelines (issue 46): backwards split into ``B`` (the input's cotangent) and
``G`` (the weight gradients), the ``zb-h1`` schedule, and the runtimes that run them.

``B`` runs the equations of the chunk's backward the input's cotangent needs and keeps what
the weight gradients read; ``G`` runs the rest (pipeline/split_backward.py): no equation twice.
A plan with ``schedule="zb-h1"`` trains like one device on the cut program (stages
data-parallel) and on tensor-parallel stages (one program per stage), is priced below 1F1B,
and its kept values cost XLA what the pricing says.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from meshes import make_mesh
from one_device import assert_trains_like_one_device

import models
from nnscaler_jax import Constraints, PlanError, auto_parallel
from nnscaler_jax.pipeline import schedule as sch
from nnscaler_jax.pipeline.pricing import runtime_time
from nnscaler_jax.pipeline.split_backward import split_backward
from nnscaler_jax.pipeline.steps import peak_pending_weights
from nnscaler_jax.primitives import op_order

TOLERANCE = 0.15  # memory: XLA's difference within 15% of the predicted one (as for 1F1B)


def _mlp_backward(params, x, dy):
    def f(p, x):
        h = jnp.tanh(x @ p["w1"] + p["b1"])
        return h @ p["w2"]

    _, vjp = jax.vjp(f, params, x)
    return vjp(dy)


def test_split_backward_runs_each_equation_once_and_equals_the_vjp():
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k[0], (8, 16)), "b1": jnp.zeros(16),
              "w2": jax.random.normal(k[1], (16, 4))}
    x, dy = jax.random.normal(k[2], (5, 8)), jax.random.normal(k[3], (5, 4))
    sp = split_backward(_mlp_backward, (params, x, dy), available=(0,))
    gx, kept = sp.input_grads(params, x, dy)
    gp = sp.weight_grads((params, None, None), kept)
    want_p, want_x = _mlp_backward(params, x, dy)
    np.testing.assert_allclose(gx, want_x, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(gp), jax.tree.leaves(want_p), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert not {id(e) for e in sp.b_eqns} & {id(e) for e in sp.g_eqns}
    dots = lambda eqns: sum(e.primitive.name == "dot_general" for e in eqns)
    # B: the first forward matmul (tanh' reads its output) and the two cotangent ones (the
    # output's forward matmul is read by nothing); G: the two weight gradients
    assert (dots(sp.b_eqns), dots(sp.g_eqns)) == (3, 2)
    # G reads x (not available) through the kept values, the parameters directly
    assert any(tuple(a.shape) == (5, 8) for a in sp.kept_avals)
    assert not any(tuple(a.shape) in ((8, 16), (16, 4)) for a in sp.kept_avals)


@pytest.mark.parametrize("S,M", [(1, 3), (2, 3), (4, 8), (8, 16), (3, 1)])
def test_zb_h1_orders_every_block_and_beats_1f1b_priced(S, M):
    z = sch.zb_h1(S, M)
    assert z.split_backward and z.paired
    for s, row in enumerate(z.steps):
        assert sorted(map(str, row)) == sorted(f"{k}{m}" for m in range(M) for k in "FBG")
    assert sch.peak_in_flight(z) == sch.peak_in_flight(sch.one_f_one_b(S, M))
    assert max(peak_pending_weights(z)) <= 2
    one = sch.one_f_one_b(S, M)
    fwd, bwd = [1.0] * S, [3.0] * S  # backward = recomputed forward + 2 forwards
    zb_step, zb_bubble = runtime_time(z, fwd, bwd, 0.0, wgrad=[1.0] * S)
    step, bubble = runtime_time(one, fwd, bwd, 0.0)
    assert zb_step <= step and zb_bubble <= bubble
    if S > 1 and M > 1:
        assert zb_bubble < bubble
    assert zb_step - zb_bubble == pytest.approx(4.0 * M)  # the busiest stage's work


def test_split_schedule_errors_name_the_block():
    with pytest.raises(PlanError, match=r"G\(0, 0\).*split_backward=True"):
        sch.ScheduleDraft(2, 2).G(0, 0)
    with pytest.raises(PlanError, match="all-device blocks"):
        sch.ScheduleDraft(2, 2, all_device=True, split_backward=True)
    d = sch.ScheduleDraft(1, 1, split_backward=True)
    d.chain(d.F(0, 0), d.G(0, 0), d.B(0, 0))
    with pytest.raises(PlanError, match=r"'G0' comes before its backward 'B0'"):
        d.finish()
    rows = sch.zb_h1(2, 2).to_lists()  # (a saved plan's rows read back as a split schedule)
    assert sch.Schedule.from_lists("mine", 2, 2, 1, rows, paired=True) == sch.Schedule(
        "mine", 2, 2, 1, sch.zb_h1(2, 2).steps, paired=True, split_backward=True)


def _gpt(batch=16, **kw):
    spec = models.get("gpt", "tiny", batch_size=batch, **kw)
    return spec, spec.init(jax.random.PRNGKey(0)), spec.make_args()


@pytest.mark.slow
def test_gpt_zb_h1_trains_like_one_device():
    spec, variables, args = _gpt()
    pm = auto_parallel(make_mesh((2, 4), ("stage", "data")),
                       Constraints(pipeline_stages=2, microbatches=4, schedule="zb-h1"))(
        spec.module)
    step = pm.train_step(spec.loss_fn, optax.sgd(0.1))
    assert_trains_like_one_device(step, spec, variables, args, optax.sgd(0.1), 3)
    assert type(step.program).__name__ == "CutProgram"  # (why_cut: its G blocks)
    assert step.program.tables.n_s >= 1


@pytest.mark.slow
def test_user_written_split_schedule_trains_like_one_device():
    # every weight gradient deferred to the end of each stage's order, written with op_order
    spec, variables, args = _gpt()
    d = sch.ScheduleDraft(2, 2, name="late-g", split_backward=True)
    for s in range(2):
        order = [d.F(s, 0), d.F(s, 1), d.B(s, 0), d.B(s, 1), d.G(s, 0), d.G(s, 1)]
        for a, b in itertools.pairwise(order):
            op_order(d, a, b)
    pm = auto_parallel(make_mesh((2, 4), ("stage", "data")),
                       Constraints(pipeline_stages=2, microbatches=2, schedule=d.finish()))(
        spec.module)
    step = pm.train_step(spec.loss_fn, optax.sgd(0.1))
    assert_trains_like_one_device(step, spec, variables, args, optax.sgd(0.1), 2)
    assert step.program.tables.n_s == 2  # both backwards' kept values wait


@pytest.mark.slow
def test_tensor_parallel_stages_run_zb_h1():
    spec = models.get("t5", "tiny", batch_size=16)
    pm = auto_parallel(make_mesh((2, 2, 2), ("stage", "data", "model")),
                       Constraints(pipeline_stages=2, microbatches=4, schedule="zb-h1"),
                       policy="megatron")(spec.module)
    step = pm.train_step(spec.loss_fn, optax.sgd(0.1))
    assert_trains_like_one_device(step, spec, spec.init(jax.random.PRNGKey(0)),
                                  spec.make_args(), optax.sgd(0.1), 2)
    assert type(step.program).__name__ == "MpmdProgram"


def test_zb_h1_priced_below_1f1b():
    spec, variables, args = _gpt(batch=32)
    cost = {}
    for name in ("1f1b", "zb-h1"):
        pm = auto_parallel(make_mesh((4, 2), ("stage", "data")),
                           Constraints(pipeline_stages=4, microbatches=8, schedule=name))(
            spec.module)
        cost[name] = pm.make_plan(*args, variables=variables).cost
    assert cost["zb-h1"].step_time_s < cost["1f1b"].step_time_s
    assert cost["zb-h1"].memory_bytes_per_device > cost["1f1b"].memory_bytes_per_device


@pytest.mark.slow
def test_kept_values_cost_xla_what_the_pricing_says():
    """zb-h1 over 1F1B, both on the cut program: the kept-values buffer (one slot here: a
    ``G`` frees its slot in the step its neighbour ``B`` fills it) and the ``B``'s result
    beside it, priced from the ops reading parameters (their inputs and output cotangents)."""
    spec, variables, (tokens,) = _gpt(batch=32, n_layers=4, n_heads=2, vocab_size=64,
                                      d_model=32, seq_len=512, n_positions=512)
    pred, xla = {}, {}
    for name in ("1f1b", "zb-h1"):
        mesh = jax.make_mesh((2, 4), ("stage", "data"), devices=jax.devices()[:8])
        pm = auto_parallel(mesh, Constraints(pipeline_stages=2, microbatches=8, schedule=name,
                                             pipeline_pivots=("h_*",)))(spec.module)
        step = pm.train_step(spec.loss_fn, optax.sgd(1e-3))
        state = step.init(variables, tokens)
        mem = step.lower(state, tokens).compile().memory_analysis()
        pred[name] = step.plan.cost.memory_bytes_per_device
        xla[name] = mem.temp_size_in_bytes + mem.argument_size_in_bytes
    predicted, measured = pred["zb-h1"] - pred["1f1b"], xla["zb-h1"] - xla["1f1b"]
    assert predicted > 0 and measured > 0
    assert abs(measured / predicted - 1) <= TOLERANCE, (predicted, measured)
