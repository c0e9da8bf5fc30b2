"""Tensor parallelism inside heterogeneous stages: one program per stage (pipeline/mpmd.py), or
asked (``pipeline_executor='in-graph'``) one program, each stage on its devices' blocks.

T5 (encoder on one stage, decoder on the other, tied embeddings on both) and Swin (stages of
different widths) on 2 stages x 2 'data' x 2 'model' with ``policy='megatron'``: one optax
step equals the single-device step (float32, rtol 1e-4); parameters are stored split over
'model' on their stage's devices only; the chunk programs all-reduce over 'model'. The cut
program's single SPMD program cannot run this on XLA:CPU (its branches' collectives wait for
every device), which is why the stages are separate programs by default; in one program the
stages run the plan on each device's blocks with explicit collectives (lower/manual.py). An
optimizer that couples leaves across stages runs on the module's whole tree, spread over the
mesh, under either executor; the planner prices the stages as tensor-parallel.
"""

import contextlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from meshes import make_mesh
from one_device import assert_same_params, global_norm, updated

import models
from nnscaler_jax import Constraints, PlanError, Rule, auto_parallel, trace
from nnscaler_jax.lower.hlo import hlo_collectives
from nnscaler_jax.pipeline import schedule as sch
from nnscaler_jax.pipeline.cut import plan_cut
from nnscaler_jax.pipeline.in_stage import tensor_axes
from nnscaler_jax.pipeline.leafwise import leafwise
from nnscaler_jax.pipeline.recycle import reference_loss

RTOL, ATOL = 1e-4, 1e-6   # float32; ATOL for entries whose true value is ~0
MESH = ((2, 2, 2), ("stage", "data", "model"))
RUNTIME = {"per-stage": "MpmdProgram", "in-graph": "CutProgram"}


def _one_device(spec, params, args, opt, steps):
    """``steps`` optax steps of ``opt`` on one device: the parameters after them and each
    step's ``(loss, gradients' global norm)``."""
    grad_of = jax.jit(jax.value_and_grad(
        lambda p: spec.loss_fn(spec.module.apply({"params": p}, *args), *args)))
    want, opt_state, refs = params, opt.init(params), []
    for _ in range(steps):
        loss, grads = grad_of(want)
        want, opt_state = updated(opt, want, grads, opt_state)
        refs.append((loss, global_norm(grads)))
    return want, refs


def _steps_compile_once(step, state, args, refs):
    """One step per reference ``(loss, norm)``, its loss and gradient norm as the reference's;
    the steps after the first compile nothing. Returns the state and the last metrics."""
    seen: list[str] = []

    def compiled(event, _duration, **_kw):
        seen.extend([event] * (event == "/jax/core/compile/backend_compile_duration"))

    metrics = None
    try:
        for k, (loss, norm) in enumerate(refs):
            if k == 1:  # (the steps after the first: cache hits)
                jax.monitoring.register_event_duration_secs_listener(compiled)
            state, metrics = step(state, *args)
            np.testing.assert_allclose(metrics["loss"], loss, rtol=RTOL)
            np.testing.assert_allclose(metrics["grad_norm"], norm, rtol=RTOL)
    finally:
        jax.monitoring.unregister_event_duration_listener(compiled)
    assert seen == []
    return state, metrics


def _wrapped(name, **kw):
    spec = models.get(name, "tiny", batch_size=16, **kw)
    pm = auto_parallel(make_mesh(*MESH), Constraints(pipeline_stages=2, microbatches=2,
                                                     schedule="1f1b"),
                       policy="megatron")(spec.module)
    return spec, pm


@pytest.mark.slow
@pytest.mark.parametrize("name", ["t5", "swin"])
def test_tensor_parallel_stages_train_like_one_device(name):
    spec, pm = _wrapped(name)
    params = spec.init(jax.random.PRNGKey(0))["params"]
    args = spec.make_args()
    opt = optax.adam(1e-2, eps=1e-3)  # (eps: gradients ~0 in theory stay ~0 in the update)
    step = pm.train_step(spec.loss_fn, opt, return_grads=True)
    state = step.init({"params": params}, *args)
    prog = step.program
    assert type(prog).__name__ == "MpmdProgram" and prog.tp_axes == ("model",)
    grad_of = jax.jit(jax.value_and_grad(
        lambda p: spec.loss_fn(spec.module.apply({"params": p}, *args), *args)))
    want, opt_state = params, opt.init(params)
    # (T5: the steps inside the caller's Explicit mesh context, as jax's docs write them, on a
    # batch already split over its data axis)
    ctx, batch = contextlib.nullcontext(), args
    if name == "t5":
        mesh = make_mesh(*MESH)
        ctx = jax.set_mesh(mesh)
        batch = tuple(jax.device_put(x, NamedSharding(mesh, P("data"))) for x in args)
    for _ in range(2):  # (the second step: the optimizer state carried per stage)
        with ctx:
            state, metrics = step(state, *batch)
        loss, grads = grad_of(want)
        want, opt_state = updated(opt, want, grads, opt_state)
        np.testing.assert_allclose(metrics["loss"], loss, rtol=RTOL)
    np.testing.assert_allclose(metrics["grad_norm"], global_norm(grads), rtol=RTOL)
    for got, ref in [(metrics["grads"], grads), (step.params(state), want)]:
        assert jax.tree.structure(got) == jax.tree.structure(ref)
        for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                                jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=RTOL, atol=ATOL,
                                       err_msg=jax.tree_util.keystr(path))

    # each stage's leaves on its own 4 devices, some split over 'model' (half per device)
    devices = np.asarray(make_mesh(*MESH).devices)
    split = 0
    for s, tree in enumerate(state["params"]):
        for x in jax.tree.leaves(tree):
            assert x.sharding.device_set == set(devices[s].flat)
            if "model" in jax.tree.leaves(tuple(x.sharding.spec)):
                split += 1
                assert x.addressable_shards[0].data.size * 2 == x.size
    assert split >= 4
    # Adam's moments split as their parameters (replicated, each device held whole ones)
    for t, o in zip(state["params"], state["opt_state"], strict=True):
        for mom in (o[0].mu, o[0].nu):
            for x, m in zip(jax.tree.leaves(t), jax.tree.leaves(mom), strict=True):
                assert m.sharding == x.sharding
    held = [sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(t))
            for t in state["params"]]
    assert step.memory(state)["params"] == max(held)  # (stages on their own devices)
    # the plan's estimate of each kind on the stage holding the most of it, as measured
    measured, predicted = step.memory(state), step.predicted_memory()
    for kind in ("params", "grads", "optimizer"):
        assert measured[kind] == pytest.approx(predicted[kind], rel=0.01), (kind, predicted)
    # a chunk's forward all-reduces over 'model' (the row-parallel matmuls' partial sums)
    text = prog.chunk_text(0)
    kinds = {(k.kind, tuple(k.axes)) for k in hlo_collectives(text, prog.sub[0])}
    assert ("all_reduce", ("model",)) in kinds, kinds
    if name == "t5":  # the tied embedding: a copy on each stage, updated alike
        emb = [jax.tree.leaves(t["shared"]) for t in state["params"]]
        np.testing.assert_array_equal(np.asarray(emb[0][0]), np.asarray(emb[1][0]))


@pytest.mark.slow
def test_an_optimizer_coupling_leaves_runs_on_the_whole_tree():
    """Probed on the model's tree at gradient scales 1e-3 .. 1e6: a clipping threshold above
    one scale's norm (10 here) still shows; masks given as a pytree of the model's parameters
    apply (the stages keep the module's tree, other stages' leaves as empty placeholders).
    Per stage, global-norm clipping would see one stage's norm: its update runs once on the
    module's tree over the whole mesh (T5 tiny's, tied embedding on both stages). Three steps
    equal one device's, the ones after the first compile nothing, and the checkpointed state
    restores and takes the fourth step as one device does."""
    assert leafwise(optax.sgd(0.1)) and leafwise(optax.adamw(1e-3))
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.1))
    assert not leafwise(clipped)
    assert not leafwise(optax.chain(optax.clip_by_global_norm(10.0), optax.sgd(0.1)))
    tree = {"dense": {"kernel": np.zeros((4, 8)), "bias": np.zeros(8)}, "head": np.zeros((8, 2))}
    mask = jax.tree.map(lambda x: x.ndim > 1, tree)
    labels = jax.tree.map(lambda x: "a" if x.ndim > 1 else "b", tree)
    groups = [[0, 1], [2]]  # (the leaf order: dense/bias, dense/kernel, head)
    assert leafwise(optax.adamw(1e-3, weight_decay=0.1, mask=mask), tree, groups)
    assert leafwise(optax.multi_transform({"a": optax.adam(1e-3), "b": optax.sgd(0.1)}, labels),
                    tree, groups)
    spec, pm = _wrapped("t5")
    opt = optax.chain(optax.clip_by_global_norm(0.05),
                      optax.adamw(1e-2, eps=1e-3, weight_decay=0.1))
    step = pm.train_step(spec.loss_fn, opt)
    params, args = spec.init(jax.random.PRNGKey(0))["params"], spec.make_args()
    state = step.init({"params": params}, *args)
    assert type(step.program).__name__ == "MpmdProgram"
    everywhere = set(np.asarray(make_mesh(*MESH).devices).flat)
    moments = jax.tree.leaves(state["opt_state"])  # (one state of the module's tree)
    assert moments and all(x.sharding.device_set == everywhere for x in moments)
    want, refs = _one_device(spec, params, args, opt, 3)
    assert min(n for _, n in refs) > 0.05  # (the clipping acts at every step)
    state, _ = _steps_compile_once(step, state, args, refs)
    assert_same_params(step.params(state), want, rtol=RTOL, atol=ATOL)
    again, _ = step(step.restore_state(step.checkpoint_state(state)), *args)
    assert_same_params(step.params(again), _one_device(spec, params, args, opt, 4)[0],
                       rtol=RTOL, atol=ATOL)
    with pytest.raises(PlanError, match="couples leaves across stages"):
        step.program.block_programs(opt)


def test_the_stages_are_priced_tensor_parallel():
    """The cut's setup splits the non-stage axes as the runtime does (data 2 x model 2), each
    chunk is priced under the in-stage plan and carries Megatron's 4 all-reduces per layer;
    the plan prices them."""
    spec, pm = _wrapped("t5")
    graph = trace(spec.module, *spec.make_args(),
                  variables=spec.init(jax.random.PRNGKey(0)))
    cut = plan_cut(graph, {"stage": 2, "data": 2, "model": 2}, Constraints(pipeline_stages=2),
                   "megatron", 1)
    setup = cut.setup
    assert (setup.dp, setup.tp, setup.data, setup.tensor) == (2, 2, ("data",), ("model",))
    chunks = setup.units[1:-1]
    assert all(u.tp_collectives % 4 == 0 and u.tp_collectives >= 4 for u in chunks)
    dp_only = plan_cut(graph, {"stage": 2, "data": 4}, Constraints(pipeline_stages=2), None, 1)
    assert dp_only.setup.tp == 1 and dp_only.starts == cut.starts
    # compute and activations under the in-stage plan's splits (times tp: the runtime's pricing
    # divides by tp): what Megatron leaves whole (layer norms, softmax over unsplit heads'
    # inputs, ...) costs every device in full, so a device's part is more than 1/tp
    for u, w in zip(chunks, dp_only.setup.units[1:-1], strict=True):
        assert w.time_s < u.time_s < 2 * w.time_s
        assert w.act_bytes < u.act_bytes < 2 * w.act_bytes
    # parameters as the in-stage plan stores them (Megatron leaves norm scales, biases of
    # unsplit outputs and the tied embedding whole): the priced bytes a device of each stage
    # holds equal what the runtime lays out there (the shared table on both stages)
    step = pm.train_step(spec.loss_fn, optax.sgd(0.1))
    step.build(spec.init(jax.random.PRNGKey(0)), *spec.make_args())
    prog = step.program
    stored = lambda s: sum(
        int(np.prod(prog.leaf_sharding(s, j).shard_shape(prog.param_avals[j].shape)))
        * prog.param_avals[j].dtype.itemsize for j in prog.stage_leaves[s])
    units = setup.units
    priced = [(units[0].param_bytes + u.param_bytes + units[-1].param_bytes) / setup.tp
              for u in chunks]
    assert priced == [stored(0), stored(1)]
    assert units[0].whole_param_bytes < units[0].param_bytes  # (whole: tp times its bytes)
    pm.make_plan(*spec.make_args())
    assert pm.plan.pipeline is not None and pm.plan.stages == 2


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["per-stage", "in-graph"])
def test_dropout_keys_per_microbatch_and_data_shard(executor):
    """GPT with dropout cut at its layers (pivots), tensor-parallel stages: each micro-batch
    and data shard draws the keys the other runtimes give it (``microbatch_rngs(key, g)``,
    ``g = m x D + d``), so one SGD step equals the single-device step over those blocks. A
    recompute rule checkpoints layer h_0 inside its chunk (under the in-stage constraints; it
    was a TypeError). One program per stage, or one program (the masks drawn whole on each
    device's blocks)."""
    from nnscaler_jax.pipeline import microbatch_rngs

    M, D = 2, 2
    spec = models.get("gpt", "tiny-dropout", batch_size=2 * M * D)
    (tokens,) = spec.make_args(rng=jax.random.key(1))
    params = spec.module.init(jax.random.key(0), tokens)["params"]
    pm = auto_parallel(make_mesh(*MESH), Constraints(pipeline_stages=2, microbatches=M,
                                                     schedule="1f1b", pipeline_pivots=("h_*",),
                                                     rules=(Rule("h_0", recompute=True),),
                                                     pipeline_executor=executor),
                       policy="megatron")(spec.module)
    step = pm.train_step(spec.loss_fn, optax.sgd(0.1), inputs=1,
                         module_kwargs={"deterministic": False})
    rng = jax.random.key(7)
    state = step.init({"params": params}, tokens, rng=rng)
    assert type(step.program).__name__ == RUNTIME[executor]
    state, metrics = step(state, tokens)
    _, key = jax.random.split(rng)
    blocks = tokens.reshape((M * D, -1) + tokens.shape[1:])

    def loss(p):
        def block(g, x):
            out = spec.module.apply({"params": p}, x, deterministic=False,
                                    rngs=microbatch_rngs(key, g, ("dropout",)))
            return spec.loss_fn(out, x)
        return jax.numpy.mean(jax.vmap(block)(jax.numpy.arange(M * D), blocks))

    ref_loss, grads = jax.jit(jax.value_and_grad(loss))(params)
    np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=RTOL)
    want = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(step.params(state))[0],
                            jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=RTOL, atol=ATOL,
                                   err_msg=jax.tree_util.keystr(path))
    plain = spec.loss_fn(spec.module.apply({"params": params}, tokens, deterministic=True),
                         tokens)
    assert abs(float(metrics["loss"]) - float(plain)) > 1e-4  # dropout was on (noise ~1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["per-stage", "in-graph"])
def test_an_nnx_module_trains_and_takes_its_parameters_back(executor):
    """nnx GPT cut at its layers: one SGD step like one device; ``step.update(state)`` writes
    the parameters back as whole arrays the module runs on eagerly (not left on the stages'
    separate devices, where the module's own call failed on incompatible devices)."""
    from flax import nnx

    spec = models.get("gpt_nnx", "tiny", batch_size=8)
    module, (tokens,) = spec.module, spec.make_args()
    ref = nnx.clone(module)
    pm = auto_parallel(make_mesh(*MESH), Constraints(pipeline_stages=2, microbatches=2,
                                                     schedule="1f1b", pipeline_pivots=("h/*",),
                                                     pipeline_executor=executor),
                       policy="megatron")(module)
    step = pm.train_step(spec.loss_fn, optax.sgd(0.1))
    state = step.init(None, tokens)
    state, metrics = step(state, tokens)
    assert type(step.program).__name__ == RUNTIME[executor]
    loss, grads = nnx.jit(nnx.value_and_grad(lambda m: spec.loss_fn(m(tokens), tokens)))(ref)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=RTOL)
    params = nnx.state(ref, nnx.Param)
    want = jax.tree.map(lambda p, g: p - 0.1 * g, params, nnx.state(grads, nnx.Param))
    step.update(state)
    got = nnx.state(module, nnx.Param)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=RTOL, atol=ATOL)
    nnx.update(ref, want)
    np.testing.assert_allclose(spec.loss_fn(module(tokens), tokens),
                               spec.loss_fn(ref(tokens), tokens), rtol=RTOL)


def test_a_model_axis_of_size_one_is_data_parallel():
    """A 'model' axis of size 1 splits nothing: not tensor-parallel (the in-stage plan was
    refused for "splitting no op over 'model'")."""
    assert tensor_axes({"stage": 2, "data": 4, "model": 1}, "stage", "megatron") == ()
    assert tensor_axes({"stage": 2, "data": 2, "model": 2}, "stage", "megatron") == ("model",)


class _Block(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(x.shape[-1], name="down")(nn.relu(nn.Dense(self.width)(x)))


class _Net(nn.Module):
    """Blocks of different widths (a cut model) and a parameter the loss never reads."""

    @nn.compact
    def __call__(self, x):
        self.param("unused", nn.initializers.normal(1.0), (4, 4))
        x = nn.Dense(32, name="embed")(x)
        for i, w in enumerate([32, 64, 32, 64]):
            x = _Block(w, name=f"block_{i}")(x)
        return nn.Dense(4, name="head")(x)


@pytest.mark.slow
def test_an_unread_parameter_and_a_pytree_mask():
    """adamw with weight decay masked by a pytree of the module's parameters (the stages keep
    its tree); a parameter no chunk reads is kept on stage 0 and decays as on one device (it
    had no stage: StopIteration in from_pipeline, never updated)."""
    rs = np.random.RandomState(0)
    x = jnp.asarray(rs.randn(16, 8), jnp.float32)
    y = jnp.asarray(rs.randn(16, 4), jnp.float32)
    params = _Net().init(jax.random.key(0), x)["params"]
    loss_fn = lambda out, x, y: jnp.mean((out - y) ** 2)
    # (eps well above float32 noise, as the other pipeline tests: adam's first step is
    # lr * g / (|g| + eps), which float noise flips for gradients near 0 at the default 1e-8)
    opt = optax.adamw(1e-2, eps=1e-3, weight_decay=0.5,
                      mask=jax.tree.map(lambda p: p.ndim > 1, params))
    pm = auto_parallel(make_mesh(*MESH), Constraints(pipeline_stages=2, microbatches=2,
                                                     schedule="1f1b"), policy="megatron")(_Net())
    step = pm.train_step(loss_fn, opt, inputs=1)
    state = step.init({"params": params}, x, y)
    assert type(step.program).__name__ == "MpmdProgram"
    state, metrics = step(state, x, y)
    loss, g = jax.value_and_grad(lambda p: loss_fn(_Net().apply({"params": p}, x), x, y))(params)
    want = updated(opt, params, g)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=RTOL)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(step.params(state))[0],
                            jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL,
                                   err_msg=jax.tree_util.keystr(path))
    assert not np.allclose(np.asarray(step.params(state)["unused"]), params["unused"])


def _sgd_step_like_one_device(name, schedule, loss=None, executor="per-stage"):
    """One SGD step of the zoo's tiny ``name`` with ``schedule`` on Megatron stages (2 stages x
    2 data x 2 model, 4 micro-batches) against one device (``loss``: its loss of the params
    and batch, default the module's); returns the program and the state after it."""
    spec = models.get(name, "tiny", batch_size=16)
    params = spec.init(jax.random.PRNGKey(0))["params"]
    args = spec.make_args()
    pm = auto_parallel(make_mesh(*MESH), Constraints(pipeline_stages=2, microbatches=4,
                                                     schedule=schedule,
                                                     pipeline_executor=executor),
                       policy="megatron")(spec.module)
    step = pm.train_step(spec.loss_fn, optax.sgd(0.1))
    state = step.init({"params": params}, *args)
    prog = step.program
    assert type(prog).__name__ == RUNTIME[executor] and prog.tp_axes == ("model",)
    state, metrics = step(state, *args)
    loss = loss or (lambda p, *b: spec.loss_fn(spec.module.apply({"params": p}, *b), *b))
    ref, grads = jax.jit(jax.value_and_grad(loss))(params, *args)
    np.testing.assert_allclose(metrics["loss"], ref, rtol=RTOL)
    assert_same_params(step.params(state), jax.tree.map(lambda p, g: p - 0.1 * g, params, grads),
                       RTOL, ATOL)
    return prog, state


@pytest.mark.slow
@pytest.mark.parametrize("executor", ["per-stage", "in-graph"])
def test_nf1b_evoformer_on_tensor_parallel_stages_recycles_like_one_device(executor):
    # AlphaFold2's recycling (2 no-grad passes per micro-batch, then 1F1B) on stages that run
    # Megatron inside, one program per stage or one program: the last chunk's outputs go back
    # to chunk 0 (in one program gathered from the blocks they were made in)
    spec = models.get("evoformer", "tiny", batch_size=16)
    prog, _ = _sgd_step_like_one_device("evoformer", sch.nf1b(2, 4, recycles=2),
                                        reference_loss(spec.module, spec.loss_fn, 2), executor)
    if executor == "in-graph":
        return
    for s in range(2):  # (stage 1's program numbers its devices 0..3 in its sub-mesh)
        kinds = {(k.kind, tuple(k.axes))
                 for k in hlo_collectives(prog.chunk_text(s), prog.sub[s])}
        assert ("all_reduce", ("model",)) in kinds, (s, kinds)


@pytest.mark.slow
def test_interlaced_t5_vocabulary_split_over_all_devices_trains_like_one_device():
    # nnScaler's T5 plan: the encoder and decoder pipelined on tensor-parallel stages, the
    # embedding (E / W) and the LM head + loss (H) run on all 8 devices at once, the tied
    # table split on its vocabulary over them (stage x model: 4 ways, data-parallel over 2)
    prog, state = _sgd_step_like_one_device("t5", "interlaced")
    assert prog.seg0 == 1 and prog.seg_stage == (2, 0, 1, 2)  # embedding, encoder, decoder, head
    # the all-device group's table: on all 8 devices, a quarter of the vocabulary on each;
    # no stage keeps a copy (E embeds the decoder's tokens too, as nnScaler's T5 plan)
    table = state["params"][2]["shared"]["embedding"]
    assert [t["shared"]["embedding"].size for t in state["params"][:2]] == [0, 0]
    assert table.sharding.device_set == set(np.asarray(make_mesh(*MESH).devices).flat)
    assert table.addressable_shards[0].data.shape == (table.shape[0] // 4, table.shape[1])
    # E: each device looks up its rows, the partial embeddings all-reduced over the folded
    # axis; H: the logits of a quarter of the vocabulary per device, the softmax's max and
    # sum and the input's cotangent all-reduced, the table never gathered
    kinds = lambda text: {(k.kind, tuple(k.axes)) for k in hlo_collectives(text, prog.sub[2])}
    assert ("all_reduce", ("model",)) in kinds(prog.chunk_text(0))
    head = prog.chunk_text(3, "H")
    assert ("all_reduce", ("model",)) in kinds(head)
    assert not any(k == "all_gather" for k, _ in kinds(head)), kinds(head)
    vocab = table.shape[0]
    logits = [ln for ln in head.splitlines() if " dot(" in ln and f",{vocab // 4}]" in ln]
    assert logits and not any(f",{vocab}]" in ln for ln in head.splitlines() if " dot(" in ln)


def _in_graph(name, schedule="1f1b", policy="megatron", **kw):
    spec = models.get(name, "tiny", batch_size=16)
    pm = auto_parallel(make_mesh(*MESH), Constraints(
        pipeline_stages=2, microbatches=2, schedule=schedule, pipeline_executor="in-graph",
        **kw), policy=policy)(spec.module)
    return spec, pm


@pytest.mark.slow
@pytest.mark.parametrize("name,clip,schedule", [("t5", False, "1f1b"),
                                                ("swin", True, "zb-h1")])
def test_tensor_parallel_stages_in_one_program_train_like_one_device(name, clip, schedule):
    """``pipeline_executor='in-graph'``: the cut stages tensor-parallel inside one program
    (each stage's chunks on its devices' blocks, the plan's collectives explicit: no stage
    waits on another's). Three Adam steps (Swin's with global-norm clipping, which the step
    runs on the module's tree, and zero-bubble split backwards) equal one device's; the
    stored rows are split over 'model'; steps after the first compile nothing."""
    spec, pm = _in_graph(name, schedule)
    params = spec.init(jax.random.PRNGKey(0))["params"]
    args = spec.make_args()
    opt = optax.adam(1e-2, eps=1e-3)
    if clip:
        opt = optax.chain(optax.clip_by_global_norm(0.5), opt)
    step = pm.train_step(spec.loss_fn, opt)
    state = step.init({"params": params}, *args)
    prog = step.program
    assert pm.plan.pipeline.executor == "in-graph"
    assert type(prog).__name__ == "CutProgram" and prog.tp_axes == ("model",)
    for x in jax.tree.leaves(state["params"]["stages"]):  # [stage, virtual, model x width]
        assert x.addressable_shards[0].data.size * 4 == x.size
    want, refs = _one_device(spec, params, args, opt, 3)
    state, _ = _steps_compile_once(step, state, args, refs)
    assert_same_params(step.params(state), want, rtol=RTOL, atol=ATOL)


def test_tensor_parallel_stages_in_one_program_refuse_what_they_do_not_run():
    """A schedule with all-device blocks is refused in one program, with the fix: one
    program per stage (an op co-sharded alone likewise, when its lowering is made:
    tests/lower/test_manual.py)."""
    spec, pm = _in_graph("t5", schedule="interlaced")
    step = pm.train_step(spec.loss_fn, optax.sgd(1e-2))
    with pytest.raises(PlanError, match="pipeline_executor='per-stage'"):
        step.init(spec.init(jax.random.PRNGKey(0)), *spec.make_args())


@pytest.mark.slow
def test_transformers_gpt2_on_tensor_parallel_stages_in_one_program():
    """transformers' Flax GPT-2 as users call it (its module and params, the mask and
    positions among the inputs, the steps inside an Explicit mesh context) on Megatron
    stages in one program: two Adam steps equal one device's."""
    from tiny_gpt2 import tiny_gpt2

    model, args, loss_fn = tiny_gpt2(16, 8)
    mesh = make_mesh(*MESH)
    pm = auto_parallel(mesh, Constraints(pipeline_stages=2, microbatches=2, schedule="1f1b",
                                         pipeline_executor="in-graph"),
                       policy="megatron")(model.module)
    opt = optax.adam(1e-2, eps=1e-3)
    step = pm.train_step(loss_fn, opt)
    state = step.init({"params": model.params}, *args)
    assert type(step.program).__name__ == "CutProgram" and step.program.tp_axes == ("model",)
    grad_of = jax.jit(jax.value_and_grad(
        lambda p: loss_fn(model.module.apply({"params": p}, *args), *args)))
    want, opt_state = model.params, opt.init(model.params)
    for _ in range(2):
        with jax.set_mesh(mesh):
            state, metrics = step(state, *args)
        loss, grads = grad_of(want)
        want, opt_state = updated(opt, want, grads, opt_state)
        np.testing.assert_allclose(metrics["loss"], loss, rtol=RTOL)
    assert_same_params(step.params(state), want, rtol=RTOL, atol=ATOL)


@jax.custom_vjp
def _softsign(x):
    return x / (1.0 + jnp.abs(x))


def _softsign_fwd(x):
    return _softsign(x), x


def _softsign_bwd(x, g):
    return (g / jnp.square(1.0 + jnp.abs(x)),)


_softsign.defvjp(_softsign_fwd, _softsign_bwd)


class _Widths(nn.Module):
    """Six Dense layers of different widths, relu (a ``custom_jvp`` call the stages on
    blocks run on the blocks) and a ``custom_vjp`` softsign (a call they run whole) in
    turn."""

    @nn.compact
    def __call__(self, x):
        for i, w in enumerate((32, 48, 64, 40, 56, 24)):
            x = (jax.nn.relu if i % 2 else _softsign)(nn.Dense(w, name=f"layers_{i}")(x))
        return nn.Dense(4, name="head")(x)


@pytest.mark.slow
def test_searched_stages_in_one_program_pass_values_as_planned():
    """Stages planned by the search, in one program: a value a call runs whole (softsign,
    a ``custom_vjp``) is sliced back to the blocks its plan makes it in, so the next stage
    reads what it was told (it crashed: the boundary was packed as the plan's blocks and
    sent whole)."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 32)), jnp.float32)
    params = _Widths().init(jax.random.key(0), x)["params"]
    loss_fn = lambda out, x: jnp.mean(jnp.square(out))
    pm = auto_parallel(make_mesh(*MESH), Constraints(
        pipeline_stages=2, microbatches=2, schedule="1f1b", pipeline_executor="in-graph",
        pipeline_pivots=("layers_1",)), policy="auto")(_Widths())
    step = pm.train_step(loss_fn, optax.sgd(1e-2))
    state, metrics = step(step.init({"params": params}, x), x)
    assert type(step.program).__name__ == "CutProgram"
    loss, grads = jax.value_and_grad(lambda p: loss_fn(_Widths().apply({"params": p}, x), x))(
        params)
    np.testing.assert_allclose(metrics["loss"], loss, rtol=RTOL)
    assert_same_params(step.params(state), updated(optax.sgd(1e-2), params, grads), RTOL,
                       ATOL)
