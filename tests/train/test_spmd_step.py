"""``pm.train_step`` for plans without pipeline stages (nnscaler_jax/train/step.py): ZeRO 0-3,
gradient accumulation, precision, mutable collections and dropout, against plain optax loops."""
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from one_device import updated

import models
from nnscaler_jax import Constraints, PlanError, Rule, auto_parallel
from nnscaler_jax.lower.verify import max_rel_diff

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gpt():
    module, make_args, loss_fn = models.get("gpt", "tiny", batch_size=8)
    args = make_args(rng=jax.random.key(1))
    return module, args, loss_fn, module.init(jax.random.key(0), *args)


def reference_losses(module, loss_fn, variables, args, opt, steps):
    """The unsharded optax loop."""
    p, o, out = variables["params"], opt.init(variables["params"]), []

    @jax.jit
    def step(p, o):
        loss, g = jax.value_and_grad(lambda p: loss_fn(module.apply({"params": p}, *args),
                                                       *args))(p)
        u, o = opt.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    for _ in range(steps):
        p, o, loss = step(p, o)
        out.append(float(loss))
    return np.array(out), p


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_stages_measured_bytes_match_plan_and_losses_match(gpt, mesh, zero):
    module, args, loss_fn, variables = gpt
    opt = optax.adamw(1e-2)
    ref, _ = reference_losses(module, loss_fn, variables, args, opt, 5)
    pm = auto_parallel(mesh, Constraints(zero=zero), policy="megatron")(module)
    step = pm.train_step(loss_fn, opt, return_grads=True)
    state = step.init(variables, *args)
    losses = []
    for _ in range(5):
        state, metrics = step(state, *args)
        losses.append(float(metrics["loss"]))
    # (parameters are compared under SGD below: Adam turns float noise in gradients near 0
    # into full-size updates of the biases)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    measured, predicted = step.memory(state), step.predicted_memory()
    # the gradients as the step stores them (returned), not only their planned shardings
    measured_grads = sum(g.addressable_shards[0].data.nbytes
                         for g in jax.tree.leaves(metrics["grads"]))
    assert measured_grads == measured["grads"]
    for kind in ("params", "grads", "optimizer"):
        assert abs(measured[kind] - predicted[kind]) <= 0.05 * predicted[kind], (kind, measured,
                                                                                 predicted)
    full = sum(x.nbytes for x in jax.tree.leaves(variables["params"]))
    sharded_model = measured["params"] < full  # megatron splits over 'model' (4 ways) anyway
    assert sharded_model
    # each stage shards what it says over 'data' (2 ways), on top of the megatron split
    base = {"params": measured["params"] * (2 if zero >= 3 else 1)}
    assert measured["grads"] == pytest.approx(base["params"] / (2 if zero >= 2 else 1), rel=0.02)
    assert measured["optimizer"] == pytest.approx(2 * base["params"] / (2 if zero >= 1 else 1),
                                                  rel=0.02)


@pytest.mark.parametrize("name,zero", [("mlp", 1), ("mlp", 2), ("mlp", 3), ("mlp_nnx", 3)])
def test_zero_shards_state_over_every_axis_the_gradient_is_reduced_over(mesh, name, zero):
    """Its layers kept data-parallel by a rule, the search runs the wide MLP with its batch split
    over both mesh axes, each weight read whole: each weight's gradient is reduced over 'data'
    and 'model', the cost model prices its ZeRO-sharded state split over both, and the step
    stores it so (it split it over 'data' alone: 4x the bytes priced, what XLA:GPU found on
    Llama-3-8B's co-sharded layers)."""
    spec = models.get(name, "medium", abstract=False)
    args = spec.make_args(rng=jax.random.key(1))
    variables = spec.init(jax.random.key(0), *args) if spec.kind == "linen" else None
    rows = Rule(module="fc*", primitive="dot_general", dims=("m0",))  # the batch rows only
    pm = auto_parallel(mesh, Constraints(zero=zero, rules=(rows,)))(spec.module)
    step = pm.train_step(spec.loss_fn, optax.adam(1e-3))
    state = step.init(variables, *args)
    kinds = ("optimizer", "grads", "params")[:zero]  # what each stage shards
    measured, predicted = step.memory(state), step.predicted_memory()
    full = 4 * sum(x.size for x in jax.tree.leaves(step.params(state)))  # float32
    for kind in kinds:  # the ZeRO-sharded kinds: an eighth (Adam: two moments)
        n = 2 if kind == "optimizer" else 1
        assert abs(measured[kind] - predicted[kind]) <= 16, (kind, measured, predicted)
        assert measured[kind] == pytest.approx(n * full / 8, abs=16), (kind, measured)
    if spec.kind == "linen":
        ref, _ = reference_losses(spec.module, spec.loss_fn, variables, args,
                                  optax.adam(1e-3), 3)
        losses = []
        for _ in range(3):
            state, metrics = step(state, *args)
            losses.append(float(metrics["loss"]))
        np.testing.assert_allclose(losses, ref, rtol=1e-5)


def test_microbatches_accumulate_gradients(gpt, mesh):
    module, args, loss_fn, variables = gpt
    opt = optax.sgd(0.1)
    ref, ref_params = reference_losses(module, loss_fn, variables, args, opt, 3)
    pm = auto_parallel(mesh, Constraints(microbatches=4), policy="megatron")(module)
    step = pm.train_step(loss_fn, opt)
    state = step.init(variables, *args)
    assert step.microbatches == 4
    losses = []
    for _ in range(3):
        state, metrics = step(state, *args)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 step.params(state), ref_params)
    # planned for the whole batch, priced with one micro-batch's activations
    assert step.plan.microbatches == 4 and "microbatches=4" in str(step.plan)
    assert pm.graph.inputs[-1].shape[0] == 8


def test_microbatches_must_divide_the_batch(gpt, mesh):
    module, args, loss_fn, variables = gpt
    pm = auto_parallel(mesh, Constraints(microbatches=3), policy="dp")(module)
    with pytest.raises(PlanError, match="3 micro-batches do not divide the batch size 8"):
        pm.train_step(loss_fn, optax.sgd(0.1)).init(variables, *args)


def test_step_before_init_is_a_plan_error(gpt, mesh):
    module, args, loss_fn, _ = gpt
    step = auto_parallel(mesh, policy="dp")(module).train_step(loss_fn, optax.sgd(0.1))
    with pytest.raises(PlanError, match="step.init"):
        step(None, *args)


class Net(nn.Module):
    """BatchNorm + dropout + a `train` flag, trained on (images, labels)."""

    @nn.compact
    def __call__(self, x, *, train: bool):
        x = nn.Dense(32)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.Dropout(0.2, deterministic=not train)(nn.relu(x))
        return nn.Dense(4)(x)


def ce(logits, x, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def test_train_flag_batch_stats_and_dropout_match_the_plain_loop(mesh):
    module = Net()
    x = jax.random.normal(jax.random.key(1), (16, 8))
    labels = jax.random.randint(jax.random.key(2), (16,), 0, 4)
    variables = module.init(jax.random.key(0), x, train=False)
    opt, rng = optax.sgd(0.1), jax.random.key(7)  # Adam would blow up float noise in the
    # gradient of the bias before BatchNorm (0 in exact arithmetic)

    # the plain loop, with the step's documented key derivation
    p, stats, o, r, ref = variables["params"], variables["batch_stats"], None, rng, []
    o = opt.init(p)
    for _ in range(3):
        r, key = jax.random.split(r)
        rngs = {"dropout": jax.random.fold_in(jax.random.fold_in(key, 0), 0)}

        def loss(p, stats, rngs):
            out, new = module.apply({"params": p, "batch_stats": stats}, x, train=True,
                                    rngs=rngs, mutable=["batch_stats"])
            return ce(out, x, labels), new

        (lv, new), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(p, stats, rngs)
        (p, o), stats = updated(opt, p, g, o), new["batch_stats"]
        ref.append(float(lv))

    pm = auto_parallel(mesh, policy="dp")(module)
    step = pm.train_step(ce, opt, inputs=1, module_kwargs={"train": True})
    state = step.init(variables, x, labels, rng=rng)
    losses = []
    for _ in range(3):
        state, metrics = step(state, x, labels)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 step.variables(state)["batch_stats"], stats)
    assert not np.allclose(ref[0], ref[1])  # the model trains (and dropout keys change)
    # the statistics are replicated: every device holds them whole
    assert step.memory(state)["collections"] == sum(a.nbytes for a in jax.tree.leaves(stats))


class DropNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dropout(0.3, deterministic=False)(nn.relu(nn.Dense(32)(x)))
        return nn.Dense(4)(x)


@pytest.mark.parametrize("policy", ["dp", "auto"])
def test_an_rbg_key_trains_like_the_plain_loop_in_micro_batches(mesh, policy):
    """A step key of another impl (``rbg``, MaxText's choice for speed): the step is planned
    with keys of that impl (it was planned with threefry keys and refused its own program: "this
    plan was made for another model"), and the dropout mask an ``rbg`` key draws, whose bits
    change when split, is drawn whole while the rest of the batch still splits (its batch
    class counted as frozen, so ``dp`` split nothing and 2 micro-batches did not bound the
    splits). Micro-batch ``i`` holds rows ``i::2``, keyed ``fold_in(fold_in(key, i), 0)``."""
    module, opt, rng = DropNet(), optax.sgd(0.1), jax.random.key(7, impl="rbg")
    x = jax.random.normal(jax.random.key(1), (16, 8))
    labels = jax.random.randint(jax.random.key(2), (16,), 0, 4)
    variables = module.init(jax.random.key(0), x)
    p, o, r, ref = variables["params"], opt.init(variables["params"]), rng, []
    for _ in range(2):
        r, key = jax.random.split(r)

        def loss(p, key):
            return sum(ce(module.apply({"params": p}, x[i::2], rngs={
                "dropout": jax.random.fold_in(jax.random.fold_in(key, i), 0)}), x[i::2],
                labels[i::2]) for i in range(2)) / 2

        lv, g = jax.jit(jax.value_and_grad(loss))(p, key)
        p, o = updated(opt, p, g, o)
        ref.append(float(lv))
    pm = auto_parallel(mesh, Constraints(microbatches=2), policy=policy)(module)
    step = pm.train_step(ce, opt, inputs=1)
    state = step.init(variables, x, labels, rng=rng)
    assert state["rng"].dtype == rng.dtype
    losses = []
    for _ in range(2):
        state, metrics = step(state, x, labels)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 step.params(state), p)
    if policy == "dp":  # the batch splits (the search may keep so tiny a model whole)
        dense = [o for o in step.plan.ops if o.module_path == "Dense_0" and o.split]
        assert any(a == "data" for o in dense for a, _ in o.split), step.plan


def test_raw_key_data_of_another_impl_is_refused(mesh):
    pm = auto_parallel(mesh, policy="dp")(DropNet())
    x, labels = jnp.ones((16, 8)), jnp.zeros((16,), jnp.int32)
    step = pm.train_step(ce, optax.sgd(0.1), inputs=1)
    with pytest.raises(PlanError, match=r"raw key data uint32\[4\].*impl='rbg'"):
        step.init(DropNet().init(jax.random.key(0), x), x, labels,
                  rng=jax.random.PRNGKey(0, impl="rbg"))


def test_bfloat16_trains_like_float32_with_float32_master_weights(gpt, mesh):
    module, args, loss_fn, variables = gpt
    opt = optax.adam(3e-3)
    ref, _ = reference_losses(module, loss_fn, variables, args, opt, 20)
    # the same GPT with its layers computing in bfloat16 (flax's dtype; params float32)
    bf16 = models.get("gpt", "tiny", batch_size=8, dtype=jnp.bfloat16).module
    pm = auto_parallel(mesh, Constraints(precision="bfloat16"), policy="megatron")(bf16)
    step = pm.train_step(loss_fn, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no matmul left in float32
        state = step.init(variables, *args)
        for _ in range(20):
            state, metrics = step(state, *args)
    assert abs(float(metrics["loss"]) - ref[-1]) <= 0.02 * ref[-1]
    assert float(metrics["loss"]) != pytest.approx(ref[-1], rel=1e-6)  # it did run in bf16
    assert {x.dtype for x in jax.tree.leaves(step.params(state))} == {jnp.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(state["opt_state"])
            if x.ndim} == {jnp.dtype("float32")}


def test_float16_scales_the_loss_and_skips_overflowing_steps(gpt, mesh):
    module, args, loss_fn, variables = gpt
    pm = auto_parallel(mesh, Constraints(precision="float16"), policy="dp")(module)
    step = pm.train_step(loss_fn, optax.adam(1e-3))
    state = step.init(variables, *args)
    state, metrics = step(state, *args)
    assert bool(metrics["finite"]) and float(metrics["loss_scale"]) == 2.0 ** 15
    # an absurd scale overflows float16: the step is skipped and the scale halves
    before = jax.tree.map(np.asarray, step.params(state))
    state["loss_scale"] = jnp.float32(2.0 ** 40)
    state, metrics = step(state, *args)
    assert not bool(metrics["finite"]) and float(state["loss_scale"]) == 2.0 ** 39
    jax.tree.map(np.testing.assert_array_equal, step.params(state), before)


class NnxNet(nnx.Module):
    """nnx: BatchNorm statistics and a Dropout rng stream live in the module's state."""

    def __init__(self, rngs):
        self.l1, self.bn = nnx.Linear(8, 32, rngs=rngs), nnx.BatchNorm(32, rngs=rngs)
        self.drop, self.l2 = nnx.Dropout(0.2, rngs=rngs), nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


def test_nnx_module_trains_like_the_plain_nnx_loop(mesh):
    x = jax.random.normal(jax.random.key(1), (16, 8))
    labels = jax.random.randint(jax.random.key(2), (16,), 0, 4)
    opt = optax.sgd(0.1)
    graphdef, params, rest = nnx.split(NnxNet(nnx.Rngs(0)), nnx.Param, ...)
    o, ref = opt.init(params), []
    for _ in range(3):
        def loss(p, rest):
            m = nnx.merge(graphdef, p, rest, copy=True)
            return ce(m(x), x, labels), nnx.split(m, nnx.Param, ...)[2]

        (lv, rest), g = jax.value_and_grad(loss, has_aux=True)(params, rest)
        u, o = opt.update(g, o, params)
        params = optax.apply_updates(params, u)
        ref.append(float(lv))

    pm = auto_parallel(mesh, policy="dp")(NnxNet(nnx.Rngs(0)))
    step = pm.train_step(ce, opt, inputs=1)
    state = step.init(None, x, labels)
    losses = []
    for _ in range(3):
        state, metrics = step(state, x, labels)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    step.update(state)  # back into the wrapped module
    np.testing.assert_allclose(pm.module.bn.mean[...], rest["bn"]["mean"][...], rtol=1e-4,
                               atol=1e-6)
    np.testing.assert_allclose(pm.module.l2.kernel[...], params["l2"]["kernel"][...],
                               rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("micro", [1, 2])
def test_nnx_dropout_keyed_by_the_step_key_as_the_pipelined_step_keys_it(mesh, micro):
    """``step.init(None, *batch, rng=key)`` on an nnx module: each micro-batch ``i`` keys the
    module's streams from ``microbatch_rngs(split(key)[1], i, ('dropout', 'default'))`` (the
    ``j``-th stream named ``s``: ``fold_in(rngs[s], j)``, what ``nnx.reseed`` sets), as the
    pipelined step does; micro-batch ``i`` holds rows ``i::micro``."""
    from nnscaler_jax.pipeline import microbatch_rngs

    x = jax.random.normal(jax.random.key(1), (16, 8))
    labels = jax.random.randint(jax.random.key(2), (16,), 0, 4)
    opt, rng = optax.sgd(0.1), jax.random.key(7)
    graphdef, params, rest = jax.tree.map(jnp.copy,
                                          nnx.split(NnxNet(nnx.Rngs(0)), nnx.Param, ...))
    o, ref, r = opt.init(params), [], rng
    for _ in range(2):
        r, key = jax.random.split(r)

        def loss(p, rest, key=key):
            total = 0.0
            for i in range(micro):
                m = nnx.merge(graphdef, p, rest, copy=True)
                nnx.reseed(m, default=microbatch_rngs(key, i, ("dropout", "default"))["default"])
                total += ce(m(x[i::micro]), x[i::micro], labels[i::micro])
                rest = nnx.split(m, nnx.Param, ...)[2]
            return total / micro, rest

        (lv, rest), g = jax.value_and_grad(loss, has_aux=True)(params, rest)
        u, o = opt.update(g, o, params)
        params = optax.apply_updates(params, u)
        ref.append(float(lv))

    pm = auto_parallel(mesh, Constraints(microbatches=micro), policy="dp")(NnxNet(nnx.Rngs(0)))
    step = pm.train_step(ce, opt, inputs=1)
    state = step.init(None, x, labels, rng=rng)
    losses = []
    for _ in range(2):
        state, metrics = step(state, x, labels)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    step.update(state)
    np.testing.assert_allclose(pm.module.l2.kernel[...], params["l2"]["kernel"][...],
                               rtol=1e-4, atol=1e-6)
    # the key decides the dropout masks: another key, another loss
    other = pm.train_step(ce, opt, inputs=1)
    _, m2 = other(other.init(None, x, labels, rng=jax.random.key(8)), x, labels)
    assert abs(float(m2["loss"]) - ref[1]) > 1e-4 and abs(float(m2["loss"]) - ref[0]) > 1e-4


def test_budget_chosen_microbatches_train_like_the_whole_batch(mesh):
    module, make_args, loss_fn = models.get("gpt", "tiny", batch_size=16)
    args = make_args(rng=jax.random.key(1))
    variables = module.init(jax.random.key(0), *args)
    opt = optax.sgd(0.1)
    ref, _ = reference_losses(module, loss_fn, variables, args, opt, 2)
    full = auto_parallel(mesh, policy="dp")(module).make_plan(*args).cost
    pm = auto_parallel(mesh, Constraints(max_memory_per_device=int(
        full.memory_bytes_per_device * 0.7)), policy="dp")(module)
    step = pm.train_step(loss_fn, opt)
    state = step.init(variables, *args)
    assert step.microbatches == step.plan.microbatches > 1
    losses = []
    for _ in range(2):
        state, metrics = step(state, *args)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref, rtol=1e-5)


class _LogicalMlp(nn.Module):
    """Kernels boxed with logical partitioning metadata (``module.init`` returns the boxes)."""

    @nn.compact
    def __call__(self, x):
        k1 = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        k2 = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed"))
        return nn.Dense(8, kernel_init=k2, name="fc2")(
            nn.gelu(nn.Dense(32, kernel_init=k1, name="fc1")(x)))


def test_boxed_variables_train_like_one_device(mesh):
    """Variables as ``module.init`` returns them with ``nn.with_logical_partitioning``: the
    step trains on their values (the plan reads the metadata) and matches the unsharded loop,
    the kernels stored as the logical rules place them."""
    module = _LogicalMlp()
    x = jax.random.normal(jax.random.key(1), (16, 16))
    y = jax.random.normal(jax.random.key(2), (16, 8))
    variables = module.init(jax.random.key(0), x)
    assert isinstance(variables["params"]["fc1"]["kernel"], nn.LogicallyPartitioned)
    mse = lambda out, x, y: jnp.mean((out - y) ** 2)
    pm = auto_parallel(mesh, Constraints(logical_rules=(("embed", None), ("mlp", "model"))))(
        module)
    step = pm.train_step(mse, optax.sgd(0.1), inputs=1, return_grads=True)
    state = step.init(variables, x, y)
    plain = nn.unbox(variables)["params"]
    loss_of = lambda p: mse(module.apply({"params": p}, x), x, y)
    for _ in range(2):
        want, grads = jax.value_and_grad(loss_of)(plain)
        state, metrics = step(state, x, y)
        np.testing.assert_allclose(metrics["loss"], want, rtol=1e-5)
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                     metrics["grads"], grads)
        plain = jax.tree.map(lambda p, g: p - 0.1 * g, plain, grads)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 step.params(state), plain)
    assert state["params"]["fc1"]["kernel"].sharding.spec == jax.sharding.PartitionSpec(
        None, "model")


def test_microbatches_the_data_axis_does_not_divide_say_so(mesh):
    """Batch 12 in 4 micro-batches of 3 rows under a plan splitting the batch over 'data' (2):
    the error names the micro-batches and the fix, not a saved plan the user never gave."""
    module = _LogicalMlp()
    x, y = jnp.ones((12, 16)), jnp.zeros((12, 8))
    pm = auto_parallel(mesh, Constraints(microbatches=4), policy="zero3")(module)
    step = pm.train_step(lambda out, x, y: jnp.mean((out - y) ** 2), optax.sgd(0.1), inputs=1)
    with pytest.raises(PlanError, match=r"(?s)the plan of the whole batch \(12 rows\) does not "
                       r"run on its 4 micro-batches of 3 rows: .*'data'.*Use Constraints\("
                       r"microbatches=k\) with a micro-batch") as info:
        step.init(nn.unbox(module.init(jax.random.key(0), x)), x, y)
    assert "saved plan" not in str(info.value)


class _Head(nn.Module):
    """A classifier head: the logits (and the loss's softmax over them) outweigh the rest."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(512)(nn.relu(nn.Dense(64)(x)))


def _ce(logits, x, labels):
    del x
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _head_reference(module, variables, x, labels, opt, steps=3):
    p, o, out = variables["params"], opt.init(variables["params"]), []
    grad = jax.jit(jax.value_and_grad(lambda p: _ce(module.apply({"params": p}, x), x, labels)))
    for _ in range(steps):
        loss, g = grad(p)
        p, o = updated(opt, p, g, o)
        out.append(float(loss))
    return np.array(out)


def _head_losses(step, state, x, labels, steps=3):
    """The step's losses over ``steps`` steps on the head's batch."""
    out = []
    for _ in range(steps):
        state, metrics = step(state, x, labels)
        out.append(float(metrics["loss"]))
    return out


def _head_batch():
    x = jax.random.normal(jax.random.key(2), (16, 32))
    return x, jax.random.randint(jax.random.key(3), (16,), 0, 512)


def test_the_step_plans_the_loss_with_the_module(mesh):
    """The step's plan covers ``loss_fn(module(x), *batch)`` as one graph: the loss's softmax
    is laid out (split over the mesh, not computed whole on every device) and priced, the
    labels are read where the plan puts them, and it trains as the plain loop does."""
    module = _Head()
    x, labels = _head_batch()
    variables = module.init(jax.random.key(0), x)
    opt = optax.sgd(0.1)
    ref = _head_reference(module, variables, x, labels, opt)
    pm = auto_parallel(mesh, policy="dp")(module)
    step = pm.train_step(_ce, opt, inputs=1)
    state = step.init(variables, x, labels)
    exps = [p for p in step.plan.ops if p.primitive == "exp"]
    assert exps and all(p.split for p in exps), exps  # the loss's softmax, laid out
    specs = [s.spec for s in pm.argument_shardings()]  # the images, then the labels
    assert len(specs) == 2 and specs[0] == specs[1] != P(), specs
    module_only = auto_parallel(mesh, policy="dp")(module).make_plan(x, variables=variables)
    assert not any(p.primitive == "exp" for p in module_only.ops)
    np.testing.assert_allclose(_head_losses(step, state, x, labels), ref, rtol=1e-5)


def test_a_saved_plan_of_the_module_alone_still_trains(mesh):
    """``pm.make_plan(x)``'s plan covers the module only: the step runs the module under it
    and the loss after it, outside the plan, and trains as the plain loop does."""
    module = _Head()
    x, labels = _head_batch()
    variables = module.init(jax.random.key(0), x)
    opt = optax.sgd(0.1)
    ref = _head_reference(module, variables, x, labels, opt)
    saved = auto_parallel(mesh, policy="megatron")(module).make_plan(x, variables=variables)
    pm = auto_parallel(mesh, plan=saved)(module)
    step = pm.train_step(_ce, opt, inputs=1)
    state = step.init(variables, x, labels)
    assert step.plan.fingerprint == saved.fingerprint
    np.testing.assert_allclose(_head_losses(step, state, x, labels), ref, rtol=1e-5)


def test_a_saved_step_plan_runs_the_modules_own_calls_and_the_step(mesh):
    """A training step's plan (the module and its loss), saved as JSON, serves ``init`` and
    ``apply`` of the module (its ops restricted to the module's) and the step itself."""
    module = _Head()
    x, labels = _head_batch()
    variables = module.init(jax.random.key(0), x)
    opt = optax.sgd(0.1)
    ref = _head_reference(module, variables, x, labels, opt)
    first = auto_parallel(mesh, policy="megatron")(module).train_step(_ce, opt, inputs=1)
    first.init(variables, x, labels)
    saved = first.plan.to_json()
    pm = auto_parallel(mesh, plan=saved)(module)
    laid = pm.init(jax.random.key(0), x)  # the module's call under the step's plan
    # (relative to the logits' scale: a split contraction rounds its partial sums)
    assert max_rel_diff(pm.apply(laid, x), module.apply(variables, x))[0] < 1e-5
    assert pm.plan.fingerprint != first.plan.fingerprint  # the module's part of it
    step = pm.train_step(_ce, opt, inputs=1)
    state = step.init(laid, x, labels)
    assert step.plan.fingerprint == first.plan.fingerprint  # the step's own, loss and all
    np.testing.assert_allclose(_head_losses(step, state, x, labels), ref, rtol=1e-5)
