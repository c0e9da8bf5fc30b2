"""The runtime executes every block kind: interlaced (all-device E / H / W) and NF1B (no-grad
recycling passes N), through ``pm.train_step``, verified against the single-device program.

Interlaced (nnScaler's T5 plan): the embedding before the first repeated block and the head +
loss after the last one run as the all-device blocks, on the stage holding their data.
NF1B (AlphaFold2 recycling): every micro-batch runs R passes without gradient, each on the
previous pass's outputs, then 1F1B; one device computes the same thing with
:func:`nnscaler_jax.pipeline.recycle.reference_loss`.
"""

import jax
import numpy as np
import optax
import pytest
from meshes import make_mesh
from one_device import assert_same_params, global_norm, updated

import models
from nnscaler_jax import Constraints, PlanError, auto_parallel
from nnscaler_jax.pipeline import schedule as sch
from nnscaler_jax.pipeline.loop_tables import CODES, loop_tables
from nnscaler_jax.pipeline.order import ScheduleDraft
from nnscaler_jax.pipeline.recycle import reference_loss

RTOL, ATOL = 1e-4, 1e-6  # float32


def _one_step(spec, schedule, loss=None, batch_size=16, overlap=None):
    """One pipelined SGD step on 2 stages x 4 data against ``jax.grad`` on one device."""
    params = spec.init(jax.random.PRNGKey(0))["params"]
    args = spec.make_args()
    opt = optax.sgd(0.1)
    pm = auto_parallel(make_mesh((2, 4), ("stage", "data")),
                       Constraints(pipeline_stages=2, microbatches=4, schedule=schedule,
                                   pipeline_overlap=overlap))(spec.module)
    step = pm.train_step(spec.loss_fn, opt)
    state = step.init({"params": params}, *args)
    state, metrics = step(state, *args)
    loss = loss or (lambda p, *b: spec.loss_fn(spec.module.apply({"params": p}, *b), *b))
    ref_loss, grads = jax.jit(jax.value_and_grad(loss))(params, *args)
    want = updated(opt, params, grads)
    np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=RTOL)
    np.testing.assert_allclose(metrics["grad_norm"], global_norm(grads), rtol=RTOL)
    assert_same_params(step.params(state), want, RTOL, ATOL)
    return step, float(ref_loss)


@pytest.mark.slow
def test_interlaced_t5_trains_like_one_device():
    step, _ = _one_step(models.get("t5", "tiny", batch_size=16), "interlaced")
    prog = step.program
    assert type(prog).__name__ == "CutProgram" and prog.seg0 == 1
    # embedding, encoder chunk, decoder chunk, head: the head segment reads the tied
    # embedding (LM head), so it is shared; the decoder chunk reads it too
    assert prog.cut.chunks == 4
    kinds = {int(k) for k in np.unique(prog.tables.kind)}
    assert kinds == {CODES[k] for k in (None, "F", "B", "E", "H", "W")}


@pytest.mark.slow
def test_interlaced_gpt_stack_runs_cut():
    """An identical-layer stack runs interlaced through the cut program (equal block runs)."""
    step, _ = _one_step(models.get("gpt", "tiny", batch_size=16), "interlaced")
    assert type(step.program).__name__ == "CutProgram"


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [None, True])  # (True: the recycled state one step late)
def test_nf1b_evoformer_recycles_like_one_device(overlap):
    spec = models.get("evoformer", "tiny", batch_size=16)
    sched = sch.nf1b(2, 4, recycles=2)
    step, loss = _one_step(spec, sched, reference_loss(spec.module, spec.loss_fn, 2),
                           overlap=overlap)
    assert step.program.tables.overlap == step.plan.pipeline.overlap  # (None: by price)
    assert step.program.tables.overlap or not overlap
    # the recycling passes matter: without them the loss is another number
    params = spec.init(jax.random.PRNGKey(0))["params"]
    plain = reference_loss(spec.module, spec.loss_fn, 0)(params, *spec.make_args())
    assert abs(float(plain) - loss) > 1e-3 * abs(loss)


def test_nf1b_needs_outputs_shaped_like_inputs():
    spec = models.get("gpt", "tiny", batch_size=8)
    params = spec.init(jax.random.PRNGKey(0))["params"]
    tokens = spec.make_args()[0]
    pm = auto_parallel(make_mesh((2, 4), ("stage", "data")),
                       Constraints(pipeline_stages=2, microbatches=2,
                                   schedule=sch.nf1b(2, 2, recycles=1)))(spec.module)
    step = pm.train_step(spec.loss_fn, optax.sgd(0.1))
    with pytest.raises(PlanError, match="outputs back as its inputs.*GPT"):
        step.init({"params": params}, tokens)


def test_loop_tables_keep_and_free_slots():
    # interlaced: E keeps chunk 0's input on stage 0, the last chunk keeps its output for H,
    # H keeps the cotangent for the last chunk's B, chunk 0's B keeps its own for W
    t = loop_tables(sch.interlaced(2, 2), "FBNEHW")
    assert t.kind[:, 0].tolist() == [4, 1, 4, 1, 0, 0, 0, 0, 2, 6, 2, 6]
    assert t.kind[:, 1].tolist() == [0, 0, 0, 1, 5, 2, 1, 5, 2, 0, 0, 0]
    assert (t.keep_f[:, 0] >= 0).tolist() == [True, False, True] + [False] * 9   # E0, E1
    assert (t.keep_b[:, 1] >= 0).tolist() == [False] * 4 + [True, False, False, True] \
        + [False] * 4                                                           # H0, H1
    assert t.keep_b[8, 0] >= 0 and t.keep_b[10, 0] >= 0                       # B0, B1 -> W
    assert t.g_slot[9, 0] == t.keep_b[8, 0] and t.g_slot[11, 0] == t.keep_b[10, 0]
    # nf1b: a no-grad pass frees its input at once, but the passes go in waves, so stage 0
    # holds every micro-batch's recycled state between two passes
    nf = sch.nf1b(2, 4, recycles=3)
    t = loop_tables(nf, "FBNEHW")
    assert t.n_in == 4 and loop_tables(sch.one_f_one_b(2, 4)).n_in == 2
    assert t.kind[:, 0].tolist().count(CODES["N"]) == 12
    with pytest.raises(PlanError, match="identical-layer pipeline runtime"):
        loop_tables(nf)


def test_user_written_schedule_with_no_grad_blocks():
    """N blocks written with op_order: pass 0 of both micro-batches, then 1F1B."""
    d = ScheduleDraft(stages=2, microbatches=2, recycles=1, name="mine")
    d.chain(d.N(0, 0), d.N(0, 1), d.F(0, 0), d.F(0, 1), d.B(0, 0), d.B(0, 1))
    d.chain(d.N(1, 0), d.N(1, 1), d.F(1, 0), d.B(1, 0), d.F(1, 1), d.B(1, 1))
    t = loop_tables(d.finish(), "FBNEHW")
    assert sorted(set(t.kind.ravel().tolist())) == [0, 1, 2, 3]


def test_cut_pricing_splits_out_the_embedding_and_the_head():
    """The planner's cut prices the ops before the first repeated block and after the last one
    as the prefix / suffix units (interlaced's E / H / W blocks; the other schedules add them to
    the first / last chunk), as the runtime cuts them; the units still sum to the whole."""
    from nnscaler_jax.capture.trace import capture_spec
    from nnscaler_jax.cost.fusion import fused_bytes
    from nnscaler_jax.cost.model import CostModel
    from nnscaler_jax.pipeline.cut import _op_cost, plan_cut

    spec = models.get("t5", "tiny", batch_size=16)
    graph = capture_spec(spec).graph
    axes = {"stage": 2, "data": 4}
    cut = plan_cut(graph, axes, Constraints(pipeline_stages=2, schedule="interlaced"), None, 1)
    units = cut.setup.units
    pre, post = units[0], units[-1]
    assert pre.time_s > 0 and post.time_s > 0 and pre.out_bytes > 0
    paths = [op.module_path for op in graph.ops]
    first_block = paths.index("encoder/block_0/ln_self")
    model = CostModel.for_axes(axes)
    traffic = fused_bytes(graph)
    want = sum(_op_cost(model, op, traffic) for op in graph.ops[:first_block]) / 16
    assert pre.time_s == pytest.approx(want)
    total = sum(_op_cost(model, op, traffic) for op in graph.ops) / 16
    assert sum(u.time_s for u in units) == pytest.approx(total)
