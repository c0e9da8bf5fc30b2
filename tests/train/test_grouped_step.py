"""``Constraints(batch_shares=...)``: data-parallel groups taking uneven shares of the batch,
each group its own program (nnscaler_jax/train/grouped_step.py), against one device."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from one_device import assert_same_params, assert_steps_like_one_device, updated

import models
from nnscaler_jax import Constraints, PlanError, auto_parallel
from nnscaler_jax.errors import ConstraintError
from nnscaler_jax.train import Checkpointer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gpt():
    spec = models.get("gpt", "tiny", batch_size=16)
    return spec, spec.init(jax.random.PRNGKey(0))["params"], spec.make_args()


@pytest.mark.parametrize("shape,names,types,micro", [
    ((2, 4), ("data", "model"), AxisType.Explicit, None),
    ((2, 2, 2), ("data", "replica", "model"), AxisType.Auto, 2),
])
def test_uneven_shares_train_like_one_device(gpt, shape, names, types, micro):
    """Shares (10, 6) of a 16-row batch: each group plans its rows on its devices (in-group
    data parallel and micro-batches too), and 3 momentum SGD steps equal one device's, every group
    holding the same parameters."""
    spec, params, args = gpt
    mesh = jax.make_mesh(shape, names, axis_types=(types,) * len(names))
    pm = auto_parallel(mesh, Constraints(batch_shares=(10, 6), microbatches=micro))(
        spec.module)
    opt = optax.sgd(0.1, momentum=0.9)  # (Adam would blow up the float noise of the key
    # bias's gradient, 0 in exact arithmetic: softmax does not see it)
    step = pm.train_step(spec.loss_fn, opt)
    # (on the Explicit mesh, the batch as a user lays it out: split over the data axis)
    batch = args if types is AxisType.Auto else tuple(
        jax.device_put(x, NamedSharding(mesh, P("data"))) for x in args)
    state = step.init({"params": params}, *batch)
    assert type(step).__name__ == "GroupStep"
    for g, (st, m) in enumerate(zip(step.steps, step.meshes, strict=True)):
        assert set(m.devices.flat) == set(np.take(mesh.devices, g, axis=0).flat)
        assert dict(st.plan.mesh)["data"] == 1 and st.microbatches == (micro or 1)
    state, ref = assert_steps_like_one_device(step, state, spec, params, args, opt,
                                              batch=batch)
    for x, y in zip(jax.tree.leaves(step.params(state)),
                    jax.tree.leaves(step.steps[1].params(state["groups"][1])), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # one update, alike
    # the wrapper's own calls run over the whole mesh, the groups an even data axis
    np.testing.assert_allclose(pm.apply({"params": ref}, *args),
                               spec.module.apply({"params": ref}, *args), rtol=1e-5, atol=1e-5)
    loss, grads = step.loss_and_grads({"params": ref}, *args)
    want_loss, want = jax.jit(jax.value_and_grad(
        lambda p: spec.loss_fn(spec.module.apply({"params": p}, *args), *args)))(ref)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert_same_params(grads, want, rtol=1e-4, atol=1e-6)


class DropNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dropout(0.3, deterministic=False)(nn.relu(nn.Dense(32)(x)))
        return nn.Dense(4)(x)


def ce(logits, x, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def test_dropout_keys_fold_in_the_group_and_a_checkpoint_resumes(mesh, tmp_path):
    """Each step's key split from the state's, group ``g``'s keys folded with ``g`` (then per
    micro-batch as the SPMD step draws them): the plain loop with those keys gives the same
    losses and parameters; an orbax checkpoint of ``checkpoint_state`` restored into a new
    step continues alike, and restores under an SPMD step (even data parallelism) too."""
    module = DropNet()
    x = jax.random.normal(jax.random.key(1), (12, 8))
    labels = jax.random.randint(jax.random.key(2), (12,), 0, 4)
    variables = module.init(jax.random.key(0), x)
    opt, rng, shares = optax.sgd(0.1), jax.random.key(7), (8, 4)

    def loss(p, key):  # the rows-weighted mean of the groups' losses
        out, a = 0.0, 0
        for g, r in enumerate(shares):
            k = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, g), 0), 0)
            logits = module.apply({"params": p}, x[a:a + r], rngs={"dropout": k})
            out, a = out + r / sum(shares) * ce(logits, None, labels[a:a + r]), a + r
        return out

    grad = jax.jit(jax.value_and_grad(loss))
    p, r, ref, history = variables["params"], rng, [], []
    for _ in range(4):
        r, key = jax.random.split(r)
        lv, g = grad(p, key)
        p = updated(opt, p, g)
        ref.append(float(lv))
        history.append(p)
    pm = auto_parallel(mesh, Constraints(batch_shares=shares))(module)
    step = pm.train_step(ce, opt, inputs=1)
    state = step.init(variables, x, labels, rng=rng)
    losses = []
    for _ in range(2):
        state, metrics = step(state, x, labels)
        losses.append(float(metrics["loss"]))
    directory = tmp_path / "ckpt"
    with Checkpointer(directory) as ckpt:
        ckpt.save(2, step.checkpoint_state(state))
    again = auto_parallel(mesh, Constraints(batch_shares=shares))(module).train_step(
        ce, opt, inputs=1)
    fresh = again.init(variables, x, labels, rng=rng)
    with Checkpointer(directory) as ckpt:
        saved, info = ckpt.restore(target=again.checkpoint_state(fresh))
    state = again.restore_state(saved)
    for _ in range(2):
        state, metrics = again(state, x, labels)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    assert_same_params(again.params(state), p, rtol=1e-4, atol=1e-6)
    assert len(set(ref)) == 4  # the model trains and the keys change
    # the checkpoint is the SPMD step's: it restores under even data parallelism too
    even = auto_parallel(mesh)(module).train_step(ce, opt, inputs=1)
    fresh = even.init(variables, x, labels, rng=rng)
    with Checkpointer(directory) as ckpt:
        saved, info = ckpt.restore(target=even.checkpoint_state(fresh))
    assert info.step == 2
    restored = even.restore_state(saved)
    assert_same_params(even.params(restored), history[1], rtol=1e-4, atol=1e-6)


def test_batch_shares_say_what_is_wrong(gpt, mesh):
    spec, params, args = gpt
    for bad in ((10,), (10, 0), (10.0, 6), "10,6"):
        with pytest.raises(ConstraintError, match="batch_shares"):
            Constraints(batch_shares=bad)
    with pytest.raises(ConstraintError, match="pipeline stages are the other answer"):
        Constraints(batch_shares=(10, 6), pipeline_stages=2)
    with pytest.raises(ConstraintError, match="first data axis of size 3"):
        auto_parallel(mesh, Constraints(batch_shares=(6, 6, 4)))(spec.module).train_step(
            spec.loss_fn, optax.sgd(0.1))
    step = auto_parallel(mesh, Constraints(batch_shares=(10, 4)))(spec.module).train_step(
        spec.loss_fn, optax.sgd(0.1))
    with pytest.raises(PlanError, match="shares 14 rows a step"):
        step.init({"params": params}, *args)
    with pytest.raises(PlanError, match="before the first step"):
        step({}, *args)


class Normed(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.BatchNorm(use_running_average=False)(nn.Dense(8)(x)))


def test_what_groups_do_not_carry_is_refused(mesh):
    x, labels = jnp.ones((16, 8)), jnp.zeros((16,), jnp.int32)
    module = Normed()
    variables = module.init(jax.random.key(0), x)
    step = auto_parallel(mesh, Constraints(batch_shares=(10, 6)))(module).train_step(
        ce, optax.sgd(0.1), inputs=1)
    with pytest.raises(PlanError, match="would differ between groups"):
        step.init(variables, x, labels)

    class NnxNormed(nnx.Module):
        def __init__(self, rngs):
            self.l1, self.bn = nnx.Linear(8, 8, rngs=rngs), nnx.BatchNorm(8, rngs=rngs)

        def __call__(self, x):
            return self.bn(self.l1(x))

    pm = auto_parallel(mesh, Constraints(batch_shares=(10, 6)))(NnxNormed(nnx.Rngs(0)))
    with pytest.raises(PlanError, match="would differ between groups"):
        pm.train_step(ce, optax.sgd(0.1), inputs=1).init(None, x, labels)


class NnxMlp(nnx.Module):
    def __init__(self, rngs):
        self.l1, self.l2 = nnx.Linear(8, 32, rngs=rngs), nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(nnx.relu(self.l1(x)))


def test_an_nnx_module_trains_in_groups_like_the_plain_loop(mesh):
    """An nnx module on shares (10, 6): 3 SGD steps equal the plain nnx loop's, and
    ``step.update`` writes the trained parameters back into the wrapped module."""
    x = jax.random.normal(jax.random.key(1), (16, 8))
    labels = jax.random.randint(jax.random.key(2), (16,), 0, 4)
    opt = optax.sgd(0.1)
    graphdef, params = nnx.split(NnxMlp(nnx.Rngs(0)))
    o, ref = opt.init(params), []
    for _ in range(3):
        lv, g = jax.value_and_grad(lambda p: ce(nnx.merge(graphdef, p)(x), x, labels))(params)
        u, o = opt.update(g, o, params)
        params = optax.apply_updates(params, u)
        ref.append(float(lv))
    pm = auto_parallel(mesh, Constraints(batch_shares=(10, 6)))(NnxMlp(nnx.Rngs(0)))
    step = pm.train_step(ce, opt, inputs=1)
    state = step.init(None, x, labels)
    losses = []
    for _ in range(3):
        state, metrics = step(state, x, labels)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    step.update(state)
    np.testing.assert_allclose(pm.module.l2.kernel[...], params["l2"]["kernel"][...],
                               rtol=1e-4, atol=1e-6)
