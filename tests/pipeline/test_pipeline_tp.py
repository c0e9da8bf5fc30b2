"""Tensor parallelism inside pipeline stages == single-device step; TP really happens.

GPT tiny (4 layers), ``policy='megatron'``: 4 stages x 2-way 'model' (GPipe and 1F1B, 8
micro-batches) and 2 stages x 2 'data' x 2 'model' (an ``nn.scan`` layer stack). Gradients and
params after one optax step equal the single-device program's; layer parameters are stored split
over 'model' (heads of the attention kernels halved per device) and the compiled step has
all-reduces over 'model' and no all-gather of weights over it. Each step program is compiled
once (``step.lower(...).compile()``), run, and its HLO inspected.
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from meshes import make_mesh

import models
from nnscaler_jax import Constraints, PlanError, auto_parallel
from nnscaler_jax.lower.hlo import hlo_collectives

pytestmark = pytest.mark.slow  # compiles and runs programs over the mesh

RTOL, ATOL = 1e-4, 1e-6  # float32, as tests/pipeline/test_pipeline_train.py


def _opt():
    # eps well above float32 noise: the key bias's true gradient is 0 (softmax is shift
    # invariant), ~1e-10 in float32, which adam's default eps=1e-8 would blow up to +-lr.
    return optax.adam(1e-2, eps=1e-3)


@functools.cache
def _reference(preset):
    """The single-device step (jitted: the same program on one device, compiled once)."""
    spec, tokens, params = _model(preset)
    opt = _opt()

    def step(params, tokens):
        loss_fn = lambda p: spec.loss_fn(spec.module.apply({"params": p}, tokens),
                                         tokens)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, _ = opt.update(grads, opt.init(params), params)
        return loss, grads, optax.apply_updates(params, updates)

    device = jax.devices()[0]
    return jax.jit(step)(jax.device_put(params, device), jax.device_put(tokens, device))


def _close(a, b):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b),
                            strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=RTOL, atol=ATOL,
                                   err_msg=jax.tree_util.keystr(path))


@functools.cache
def _model(preset, abstract=False):
    """(spec, tokens, params) of GPT ``preset``, 4 layers, batch 16 (built once per preset)."""
    spec = models.get("gpt", preset, n_layers=4, batch_size=16)
    (tokens,) = spec.make_args()
    init = jax.eval_shape if abstract else lambda f, k: f(k)
    return spec, tokens, init(spec.init, jax.random.PRNGKey(0))["params"]


def _step(preset, shape, names, schedule, policy="megatron", abstract=False, overlap=None):
    spec, tokens, params = _model(preset, abstract)
    mesh = make_mesh(shape, names)
    pm = auto_parallel(mesh, Constraints(pipeline_stages=shape[0], microbatches=8,
                                         schedule=schedule, pipeline_overlap=overlap),
                       policy=policy)(spec.module)
    return spec, tokens, params, pm


@pytest.mark.parametrize("preset,shape,names,schedule", [
    ("tiny", (4, 2), ("stage", "model"), "gpipe"),
    ("tiny", (4, 2), ("stage", "model"), "1f1b"),
    ("tiny-scan", (2, 2, 2), ("stage", "data", "model"), "1f1b"),
    # transfers overlapped with the next step (outside the branches, model axis auto)
    ("tiny", (2, 2, 2), ("stage", "data", "model"), "1f1b+overlap"),
])
def test_tensor_parallel_stages_match_single_device(preset, shape, names, schedule):
    overlap = schedule.endswith("+overlap") or None
    spec, tokens, params, pm = _step(preset, shape, names, schedule.split("+")[0],
                                     overlap=overlap)
    step = pm.train_step(spec.loss_fn, _opt(), return_grads=True)
    state = step.init({"params": params}, tokens)
    compiled = step.lower(state, tokens).compile()   # the step's program, compiled once
    state, metrics = compiled(state, (tokens,))
    ref_loss, ref_grads, ref_params = _reference(preset)
    np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=RTOL)
    _close(step.program.from_pipeline(metrics["grads"]), ref_grads)
    _close(step.params(state), ref_params)

    # Stored split over 'model': each layer leaf, stacked over a chunk's layers, in a row of
    # its own [stages, virtual, model x width], each device's blocks; the query kernel
    # (d_model, heads, head_dim) keeps half the heads per device.
    prog = step.program
    assert prog.tables.overlap == pm.plan.pipeline.overlap  # (None: the planner's choice)
    assert prog.tables.overlap or not overlap
    assert prog.tp_axes == ("model",)
    assert prog.data_axes == tuple(a for a in names if a not in ("stage", "model"))
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    q = next(k for k, j in enumerate(prog.split.layer_leaves[0])
             if "query" in jax.tree_util.keystr(paths[j]) and
             "kernel" in jax.tree_util.keystr(paths[j]))
    _, _, block = prog.layer_rows.packs[0].slots[q]
    assert block == tuple(ref_params_shape(params, paths, q, prog))
    adam = state["opt_state"][0]
    for x in (state["params"]["stages"], metrics["grads"]["stages"], adam.mu["stages"],
              adam.nu["stages"]):
        assert len(x) == len(prog.split.layer_leaves[0])  # (a row per layer leaf)
        for row in x.values():
            assert tuple(row.sharding.spec) == ("stage", None, "model")
            assert row.shape[-1] == 2 * row.addressable_shards[0].data.shape[-1]
        assert x[f"{q}:float32"].shape[-1] == 2 * prog.per_chunk * math.prod(block)

    # Megatron: the attention and MLP row-parallel outputs (forward) and their input gradients
    # (backward) are summed over 'model'; layer gradients averaged over 'data' once; no weight
    # is gathered over 'model' (stored split as used).
    kinds = [(c.kind, c.axes) for c in hlo_collectives(compiled.as_text(), prog.mesh)]
    assert kinds.count(("all_reduce", ("model",))) >= 4
    assert (("all_reduce", ("data",)) in kinds) == ("data" in names)
    assert ("all_gather", ("model",)) not in kinds


def ref_params_shape(params, paths, k, prog):
    """The block shape of template leaf ``k`` of one layer: half the heads of the query
    kernel (its scanned layer dim dropped)."""
    j = prog.split.layer_leaves[0][k]
    shape = list(jax.tree.leaves(params)[j].shape[int(prog.split.stacked):])
    shape[1] //= 2
    return shape


def test_tensor_parallel_stage_errors():
    # 3-way 'model' divides neither the 4 heads nor the MLP hidden size 128
    spec, tokens, params, pm = _step("tiny", (2, 3), ("stage", "model"), "1f1b", abstract=True)
    step = pm.train_step(spec.loss_fn, optax.sgd(0.1))
    with pytest.raises(PlanError, match="splits no op over mesh axis 'model' \\(size 3\\)"):
        step.init({"params": params}, tokens)

    def on_stage_axis(graph, mesh):  # a custom policy that splits along the stage axis
        from nnscaler_jax.primitives import op_assign, op_trans

        op = next(op for op in graph.graph.ops if op.primitive == "dot_general")
        op_assign(graph, op_trans(graph, op, "n1", 4), "stage")  # head_dim 8 over 4 stages
        return graph.finish()

    spec, tokens, params, pm = _step("tiny", (4, 2), ("stage", "model"), "1f1b",
                                     policy=on_stage_axis, abstract=True)
    step = pm.train_step(spec.loss_fn, optax.sgd(0.1))
    with pytest.raises(PlanError, match="in-stage plan .* failed: .*'stage' is not in the mesh"):
        step.init({"params": params}, tokens)


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(16, name="fc2")(nn.gelu(nn.Dense(32, name="fc1")(
            nn.LayerNorm(name="ln")(x))))


class _Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16, name="embed")(x)
        for i in range(4):
            x = _Block(name=f"h_{i}")(x)
        return nn.Dense(8, name="head")(x)


def test_search_that_splits_nothing_in_stage_says_so():
    """A model too small for tensor parallelism to pay: the search's in-stage plan splits
    nothing over 'model' (which divides every size), and the error says that, not that the
    sizes do not divide."""
    mesh = make_mesh((2, 2, 2), ("stage", "data", "model"))
    x, y = jnp.ones((16, 16)), jnp.zeros((16, 8))
    pm = auto_parallel(mesh, Constraints(pipeline_stages=2, microbatches=2),
                       policy="auto")(_Stack())
    step = pm.train_step(lambda out, x, y: jnp.mean((out - y) ** 2), optax.sgd(0.1), inputs=1)
    with pytest.raises(PlanError, match="(?s)policy 'auto'.*splits no op over mesh axis 'model' "
                       r"\(size 2\): at these sizes every split .* Name the axis 'data'"):
        step.init(_Stack().init(jax.random.key(0), x), x, y)
