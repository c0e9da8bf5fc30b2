"""Pipeline stages for any model: heterogeneous stages cut at module boundaries.

T5 (encoder output forwarded to the decoder stage, tied embeddings), Swin (stages of different
widths), Evoformer (two activations, MSA and pair) and transformers' GPT-2 train through
``pm.train_step`` on 2 stages x 4 data with 1F1B and 4 micro-batches; the parameters after one
SGD step equal the single-device step (float32, rtol 1e-4; loss = mean of the micro-batch
losses = the full batch's mean). T5 on 4 stages forwards its encoder output through the
intermediate stage.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from meshes import make_mesh
from one_device import updated
from tiny_gpt2 import tiny_gpt2

import models
from nnscaler_jax import Constraints, PlanError, auto_parallel
from nnscaler_jax.errors import ConstraintError
from nnscaler_jax.pipeline.cut import balance, chunk_starts

RTOL, ATOL = 1e-4, 1e-6   # float32; ATOL for entries whose true value is ~0
slow = pytest.mark.slow   # compiles and runs programs over the mesh


def _check_one_step(module, loss_fn, params, args, constraints, mesh=None, module_kwargs=None):
    """Train one SGD step pipelined and compare with ``jax.grad`` on one device."""
    mesh = mesh or make_mesh((2, 4), ("stage", "data"))
    opt = optax.sgd(0.1)
    pm = auto_parallel(mesh, constraints)(module)
    kw = module_kwargs or {}
    step = pm.train_step(loss_fn, opt, **({"module_kwargs": kw} if kw else {}))
    state = step.init({"params": params}, *args)
    state, metrics = step(state, *args)
    full = lambda p: loss_fn(module.apply({"params": p}, *args, **kw), *args)
    loss, grads = jax.jit(jax.value_and_grad(full))(params)
    want = updated(opt, params, grads)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=RTOL)
    got = step.params(state)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want),
                            strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=RTOL, atol=ATOL,
                                   err_msg=jax.tree_util.keystr(path))
    return pm, step


@slow
@pytest.mark.parametrize("name", ["t5", "swin", "evoformer"])
def test_any_model_trains_like_one_device(name):
    spec = models.get(name, "tiny", batch_size=16)
    params = spec.init(jax.random.PRNGKey(0))["params"]
    pm, step = _check_one_step(spec.module, spec.loss_fn, params, spec.make_args(),
                               Constraints(pipeline_stages=2, microbatches=4, schedule="1f1b"))
    assert type(step.program).__name__ == "CutProgram"
    assert {st for _, st in pm.plan.pipeline.stage_of} == {0, 1}
    if name == "t5":  # encoder on stage 0, decoder on stage 1: the encoder output crosses
        assert ("decoder", 1) in pm.plan.pipeline.stage_of
        assert ("encoder", 0) in pm.plan.pipeline.stage_of


@slow
def test_t5_on_four_stages_forwards_the_encoder_output():
    """Cut inside the encoder and the decoder: the encoder output crosses two boundaries."""
    spec = models.get("t5", "tiny", batch_size=8)
    params = spec.init(jax.random.PRNGKey(0))["params"]
    _, step = _check_one_step(spec.module, spec.loss_fn, params, spec.make_args(),
                              Constraints(pipeline_stages=4, microbatches=4, schedule="1f1b"),
                              make_mesh((4, 2), ("stage", "data")))
    bounds = [[tuple(v.aval.shape) for v in b] for b in step.program.cut.bounds]
    enc = (1, spec.make_args()[0].shape[1], 32)           # [micro-batch, S_enc, d_model]
    assert len(bounds) == 3 and enc in bounds[1] and enc in bounds[2]


@slow
def test_transformers_gpt2_pipelines():
    model, args, loss_fn = tiny_gpt2(16, 8)
    pm, _ = _check_one_step(model.module, loss_fn, model.params, args,
                            Constraints(pipeline_stages=2, microbatches=4, schedule="1f1b"))
    # found automatically: the numbered blocks transformer/h/0, h/1, one per stage
    assert ("transformer/h/1", 1) in pm.plan.pipeline.stage_of


@slow
def test_transformers_bert_pipelines():
    """FlaxBertForMaskedLM: its required head_mask argument goes in module_kwargs."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                  intermediate_size=64, vocab_size=100,
                                  max_position_embeddings=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.FlaxBertForMaskedLM(cfg, _do_init=True)
    batch, seq = 16, 8
    ids = (jnp.arange(batch * seq).reshape(batch, seq) % 100).astype(jnp.int32)
    args = (ids, jnp.ones_like(ids), jnp.zeros_like(ids),
            jnp.broadcast_to(jnp.arange(seq)[None], (batch, seq)))
    pm, _ = _check_one_step(model.module, lambda out, *a: jnp.mean(out[0] ** 2), model.params,
                            args, Constraints(pipeline_stages=2, microbatches=4,
                                              schedule="1f1b"),
                            module_kwargs={"head_mask": None})
    assert ("bert/encoder/layer/1", 1) in pm.plan.pipeline.stage_of


@slow
def test_pivots_cut_a_gpt_with_gpipe():
    spec = models.get("gpt", "tiny", n_layers=4, batch_size=16)
    params = spec.init(jax.random.PRNGKey(0))["params"]
    pm, step = _check_one_step(spec.module, spec.loss_fn, params, spec.make_args(),
                               Constraints(pipeline_stages=2, microbatches=4, schedule="gpipe",
                                           pipeline_pivots=("h_*",)))
    assert type(step.program).__name__ == "CutProgram"
    assert [n for n, _ in pm.plan.pipeline.stage_of] == ["h_0", "h_1", "h_2", "h_3"]


@slow
def test_each_device_stores_only_its_stage():
    spec = models.get("t5", "tiny", batch_size=16, n_layers=3)
    params = spec.init(jax.random.PRNGKey(0))["params"]
    pm = auto_parallel(make_mesh((2, 4), ("stage", "data")),
                       Constraints(pipeline_stages=2, microbatches=4))(spec.module)
    step = pm.train_step(spec.loss_fn, optax.sgd(0.1))
    state = step.init({"params": params}, *spec.make_args())
    per_stage = step.program.stage_bytes()
    stacked = state["params"]["stages"]
    held = [sum(x.addressable_shards[i].data.nbytes for x in stacked.values())
            for i in range(8)]
    total = sum(x.nbytes for x in stacked.values())
    assert all(x == held[0] for x in held) and held[0] * 2 == total
    assert max(per_stage) <= held[0] < sum(per_stage)          # ~ the largest stage, not all
    assert held[0] <= max(per_stage) * 1.05 + 64
    for x in stacked.values():                                  # each device: its stage's row
        assert sorted({s.index[0].start for s in x.addressable_shards}) == [0, 1]
        assert x.addressable_shards[0].data.shape[0] == 1


def test_a_pivot_matching_nothing_is_a_plan_error():
    spec = models.get("t5", "tiny", batch_size=16)
    pm = auto_parallel(make_mesh((2, 4), ("stage", "data")),
                       Constraints(pipeline_stages=2, microbatches=4,
                                   pipeline_pivots=("encoder/block_*", "no_such/*")))(spec.module)
    with pytest.raises(PlanError, match="'no_such/\\*' matches no module"):
        pm.make_plan(*spec.make_args())


def test_pivots_must_be_a_tuple_of_globs():
    with pytest.raises(ConstraintError, match=r"pipeline_pivots=\('h_\*',\)"):
        Constraints(pipeline_pivots="h_*")
    assert Constraints(pipeline_pivots=["h_*"]).pipeline_pivots == ("h_*",)


def test_balance_and_chunk_starts():
    costs = [1.0] * 4 + [6.0] * 2
    assert balance(costs, [1, 2, 3, 4, 5], 2) == (0, 5)
    assert balance(costs, [1, 2, 3, 4, 5], 3) == (0, 4, 5)
    with pytest.raises(PlanError, match="need 2 cut points"):
        balance(costs, [3], 3)
    paths = ["emb", "h_0/a", "h_0/b", "h_1/a", "h_2/a", "head"]
    stage_of = (("emb", 0), ("h_0", 0), ("h_1", 1), ("h_2", 0), ("head", 1))
    assert chunk_starts(paths, stage_of, 2, 4) == (0, 3, 4, 5)
    with pytest.raises(PlanError, match="does not cut"):
        chunk_starts(paths, stage_of, 2, 2)


def test_the_plan_records_the_cut_at_the_pivots():
    spec = models.get("t5", "tiny", batch_size=16)
    pm = auto_parallel(make_mesh((2, 4), ("stage", "data")),
                       Constraints(pipeline_stages="auto",
                                   pipeline_pivots=("encoder/block_*", "decoder/block_*")))(
        spec.module)
    plan = pm.make_plan(*spec.make_args())
    assert plan.pipeline.stage_of == (("encoder/block_0", 0), ("encoder/block_1", 0),
                                      ("decoder/block_0", 1), ("decoder/block_1", 1))
    assert "stage 1: decoder/block_0, decoder/block_1" in str(plan)
    assert plan.cost.step_time_s > 0 and type(plan).from_json(plan.to_json()) == plan
