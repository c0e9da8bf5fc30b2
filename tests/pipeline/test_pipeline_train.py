"""Pipelined train step == single-device step: gradients and params after one optax update.

GPT tiny (4 layers) on a (stage, data) mesh of 8 devices; loss = mean over the full batch, which
the pipeline computes as the mean over micro-batches and data shards.
"""

import jax
import numpy as np
import optax
import pytest
from meshes import make_mesh

import models
from nnscaler_jax import Constraints, PlanError, auto_parallel

pytestmark = pytest.mark.slow  # compiles and runs programs over the mesh

RTOL, ATOL = 1e-4, 1e-6  # float32; ATOL for gradients that are exactly 0 in theory (key bias)


def _reference(spec, params, args, opt):
    """One SGD step on one device, jitted (eagerly every op compiled alone: 30 s of Swin's)."""
    @jax.jit
    def step(params, args):
        loss_fn = lambda p: spec.loss_fn(spec.module.apply({"params": p}, *args), *args)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, _ = opt.update(grads, opt.init(params), params)
        return loss, grads, optax.apply_updates(params, updates)

    return step(*jax.tree.map(np.asarray, (params, args)))


def _close(a, b):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b),
                            strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=RTOL, atol=ATOL,
                                   err_msg=jax.tree_util.keystr(path))


# (4 stages x 1f1b x 4 micro-batches is left out: 2 x 1f1b x 4 and 4 x 1f1b x 8 run the same
# runtime with and without a steady state, 4 x gpipe x 4 the four stages at M = S; eager-1f1b
# runs a forward and a backward in one time step: the loop's second, backward-only branch)
@pytest.mark.parametrize("preset,stages,schedule,microbatches", [
    ("tiny", 2, "1f1b", 4), ("tiny", 4, "gpipe", 4),
    ("tiny-scan", 2, "interleaved", 4), ("tiny", 4, "1f1b", 8), ("tiny", 4, "eager-1f1b", 8),
])
def test_pipeline_matches_single_device(preset, stages, schedule, microbatches):
    spec = models.get("gpt", preset, n_layers=4, batch_size=16)
    (tokens,) = spec.make_args()
    params = spec.init(jax.random.PRNGKey(0))["params"]
    mesh = make_mesh((stages, 8 // stages), ("stage", "data"))
    # eps well above float32 noise: the key bias's true gradient is 0 (softmax is shift
    # invariant), ~1e-10 in float32, which adam's default eps=1e-8 would blow up to +-lr.
    opt = optax.adam(1e-2, eps=1e-3)
    pm = auto_parallel(mesh, Constraints(pipeline_stages=stages, microbatches=microbatches,
                                         schedule=schedule))(spec.module)
    step = pm.train_step(spec.loss_fn, opt, return_grads=True)
    state = step.init({"params": params}, tokens)
    state, metrics = step(state, tokens)
    ref_loss, ref_grads, ref_params = _reference(spec, params, (tokens,), opt)
    np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=RTOL)
    _close(metrics["grads"], ref_grads)  # (the module's tree, as SpmdStep gives them)
    _close(step.params(state), ref_params)
    assert pm.plan.stages == stages and pm.plan.pipeline.schedule == schedule
    assert "pipeline: " in str(pm.plan)
    assert type(pm.plan).from_json(pm.plan.to_json()) == pm.plan



def test_init_leaves_the_wrappers_policy():
    """``step.init`` plans stages data-parallel inside without setting ``pm.policy``."""
    spec = models.get("gpt", "tiny", n_layers=2, batch_size=8)
    (tokens,) = spec.make_args()
    params = spec.init(jax.random.PRNGKey(0))["params"]
    pm = auto_parallel(make_mesh((2, 4), ("stage", "data")),
                       Constraints(pipeline_stages=2, microbatches=2))(spec.module)
    step = pm.train_step(spec.loss_fn, optax.sgd(0.1))
    step.init({"params": params}, tokens)
    assert pm.policy is None                       # the user's wrapper is not mutated
    assert pm.plan.policy == "dp" and step.program.tp_axes == ()

def test_unsupported_model_and_mesh_errors():
    spec = models.get("mlp", "tiny")
    (x,) = spec.make_args()
    # two modules (fc1 | fc2) cannot make 4 stages (any model pipelines now: pipeline/cut.py)
    mesh = make_mesh((4, 2), ("stage", "data"))
    pm = auto_parallel(mesh, Constraints(pipeline_stages=4), policy="dp")(spec.module)
    with pytest.raises(PlanError, match="need 3 cut points"):
        pm.make_plan(x)
    gpt = models.get("gpt", "tiny")
    (tokens,) = gpt.make_args()
    bad = auto_parallel(make_mesh((2, 4), ("data", "model")), Constraints(pipeline_stages=2),
                        policy="dp")(gpt.module)
    with pytest.raises(PlanError, match="needs a mesh axis 'stage'"):
        bad.make_plan(tokens)


# transfers overlapped with compute (Constraints(pipeline_overlap=True)): each step sends the
# previous step's results beside its own blocks, on a table one step longer a hop
# (test_pipeline_overlap.py prices and places it; tests/train/test_xla_gpu.py: XLA:GPU's schedule)
@pytest.mark.parametrize("model,preset,S,schedule,M,program", [
    ("gpt", "tiny", 4, "1f1b", 8, "PipelineProgram"),
    ("gpt", "tiny", 4, "eager-1f1b", 8, "PipelineProgram"),  # pairs: two lanes a step
    ("gpt", "tiny-scan", 2, "interleaved", 4, "PipelineProgram"),
    ("gpt", "tiny", 2, "zb-h1", 4, "CutProgram"),             # split backwards
    ("t5", "tiny", 2, "interlaced", 2, "CutProgram"),         # all-device E / H / W
    ("swin", "tiny", 2, "1f1b", 2, "CutProgram"),             # cut at module boundaries
])
def test_overlapped_steps_train_like_one_device(model, preset, S, schedule, M, program):
    kw = {"n_layers": 4, "batch_size": 16} if model == "gpt" else {"batch_size": 8}
    spec = models.get(model, preset, **kw)
    args = spec.make_args()
    params = spec.init(jax.random.PRNGKey(0))["params"]
    opt = optax.adam(1e-2, eps=1e-3)
    pm = auto_parallel(make_mesh((S, 8 // S), ("stage", "data")),
                       Constraints(pipeline_stages=S, microbatches=M, schedule=schedule,
                                   pipeline_overlap=True))(spec.module)
    step = pm.train_step(spec.loss_fn, opt, return_grads=True)
    state = step.init({"params": params}, *args)
    state, metrics = step(state, *args)
    assert type(step.program).__name__ == program and step.program.tables.overlap
    assert pm.plan.pipeline.overlap and "transfers overlapped" in str(pm.plan)
    ref_loss, ref_grads, ref_params = _reference(spec, params, args, opt)
    np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=RTOL)
    _close(metrics["grads"], ref_grads)
    _close(step.params(state), ref_params)
    assert type(pm.plan).from_json(pm.plan.to_json()) == pm.plan
