"""A training state checkpointed under one plan restores under another: ``step.checkpoint_state``
holds the module's trees (parameters, the optimizer's state of them, collections, the step
counter) whatever the runtime's layout, and ``step.restore_state`` lays them out again, so a
pipelined run continues under the SPMD plan (or another pipeline runtime) and the other way,
training on as the uninterrupted run does."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from meshes import make_mesh

import models
from nnscaler_jax import Constraints, PlanError, auto_parallel
from nnscaler_jax.train.checkpoint import Checkpointer

pytestmark = pytest.mark.slow  # compiles and runs programs over the mesh

M = 2  # micro-batches


@pytest.fixture(scope="module")
def gpt():
    module, make_args, loss_fn = models.get("gpt", "tiny", batch_size=16)
    args = make_args(rng=jax.random.key(1))
    return module, args, loss_fn, module.init(jax.random.key(0), *args)


def _spmd(module):
    return auto_parallel(make_mesh((2, 4), ("data", "model")), Constraints(microbatches=M),
                         policy="dp")(module)


def _pipelined(module, executor=None, **kw):
    return auto_parallel(make_mesh((2, 4), ("stage", "data")),
                         Constraints(pipeline_stages=2, microbatches=M,
                                     pipeline_executor=executor, **kw))(module)


def _run(step, state, args, n):
    losses = []
    for _ in range(n):
        state, metrics = step(state, *args)
        losses.append(float(metrics["loss"]))
    return state, losses


def _through_a_checkpoint(tmp_path, saving, state, loading, fresh):
    """``saving``'s state written by a Checkpointer and read back into ``loading`` (``fresh``:
    a state of its ``init``): the state ``loading`` continues from."""
    with Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(2, saving.checkpoint_state(state))
        ckpt.wait()
        like = loading.checkpoint_state(fresh)
        restored, _ = ckpt.restore(target=jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like))
    return loading.restore_state(restored)


def _spread(saved):
    """The most bytes of ``saved``'s arrays one device holds, as a share of them all."""
    arrays = [x for x in jax.tree.leaves(saved) if hasattr(x, "addressable_shards")
              and not jnp.issubdtype(x.dtype, jax.dtypes.prng_key)]
    per = {}
    for x in arrays:
        for shard in x.addressable_shards:
            per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
    return max(per.values()) / sum(x.nbytes for x in arrays)


def _same(got, want, **tol):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    data = lambda x: np.asarray(jax.random.key_data(x) if jnp.issubdtype(
        x.dtype, jax.dtypes.prng_key) else x)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want),
                            strict=True):
        np.testing.assert_allclose(data(x), data(y), err_msg=jax.tree_util.keystr(path), **tol)


@pytest.mark.parametrize("executor,masked", [("in-graph", False), ("in-graph", True),
                                             ("per-stage", True)])
def test_a_pipelined_checkpoint_continues_under_the_spmd_plan_and_back(tmp_path, gpt, executor,
                                                                       masked):
    """``masked``: Adam on the matrices only (``optax.masked``: ``MaskedNode`` s in the
    moments beside the matrices' arrays), an optimizer the in-graph runtime updates on the
    module's tree (its state kept as that tree, not in the layout) and the per-stage one per
    stage (each stage's mask sees its own placeholders)."""
    module, args, loss_fn, variables = gpt
    opt = optax.adamw(1e-3)
    if masked:
        opt = optax.masked(optax.adam(1e-3), lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
    spmd = _spmd(module).train_step(loss_fn, opt)
    _, ref = _run(spmd, spmd.init(variables, *args), args, 4)

    piped = _pipelined(module, executor).train_step(loss_fn, opt)
    state, first = _run(piped, piped.init(variables, *args), args, 2)
    if executor == "in-graph":  # (the optimizer's view of the module's tree)
        assert (piped.program._view(opt) is not None) == masked
    np.testing.assert_allclose(first, ref[:2], rtol=1e-5)
    assert int(state["step"]) == 2
    # the module's trees, as the SPMD step keeps them: one checkpoint for both
    saved = piped.checkpoint_state(state)
    assert jax.tree.structure(saved["params"]) == jax.tree.structure(variables["params"])
    # spread over the 8 devices (the module-tree view's moments, as kept: over the 2 stages):
    # no device holds the model whole (before: every device, or device 0, held it all)
    assert _spread(saved) <= (0.4 if masked else 0.25), _spread(saved)
    # out of the runtime's layout and back is exact
    _same(piped.checkpoint_state(piped.restore_state(saved)), saved, rtol=0, atol=0)

    spmd2 = _spmd(module).train_step(loss_fn, opt)
    resumed = _through_a_checkpoint(tmp_path / "a", piped, state, spmd2,
                                    spmd2.init(variables, *args))
    assert int(resumed["step"]) == 2
    _, then = _run(spmd2, resumed, args, 2)
    np.testing.assert_allclose(then, ref[2:], rtol=1e-5)

    # and the SPMD plan's checkpoint continues pipelined
    spmd3 = _spmd(module).train_step(loss_fn, opt)
    state, _ = _run(spmd3, spmd3.init(variables, *args), args, 2)
    piped2 = _pipelined(module, executor).train_step(loss_fn, opt)
    resumed = _through_a_checkpoint(tmp_path / "b", spmd3, state, piped2,
                                    piped2.init(variables, *args))
    _, then = _run(piped2, resumed, args, 2)
    np.testing.assert_allclose(then, ref[2:], rtol=1e-5)


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        return nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.5)(
            nn.Dense(16)(x)))


class _Stack(nn.Module):
    """BatchNorm layers: run by the cut program, which carries their statistics packed."""

    @nn.compact
    def __call__(self, x, train=False):
        for i in range(2):
            x = _Block(name=f"h_{i}")(x, train)
        return nn.Dense(4, name="head")(x)


def test_collections_and_a_step_key_survive_a_restore_in_the_cut_program(tmp_path):
    x = jax.random.normal(jax.random.key(1), (16, 16))
    y = jax.random.normal(jax.random.key(2), (16, 4))
    module = _Stack()
    variables = module.init(jax.random.key(0), x)
    mse = lambda out, x, y: jnp.mean((out - y) ** 2)
    kw = {"inputs": 1, "module_kwargs": {"train": True}}
    make = lambda: _pipelined(module).train_step(mse, optax.adam(1e-2), **kw)
    step = make()
    state = step.init(variables, x, y, rng=jax.random.key(3))
    assert type(step.program).__name__ == "CutProgram"
    state, _ = _run(step, state, (x, y), 1)
    saved = step.checkpoint_state(state)
    assert _spread(saved) <= 0.25, _spread(saved)
    _run(step, step.restore_state(saved), (x, y), 1)  # (donates its own buffers only)
    assert set(saved) == {"params", "opt_state", "collections", "rng", "step"}
    assert jax.tree.structure(saved["collections"]) == jax.tree.structure(
        {"batch_stats": variables["batch_stats"]})
    other = make()
    resumed = _through_a_checkpoint(tmp_path, step, state, other,
                                    other.init(variables, x, y, rng=jax.random.key(9)))
    _same(other.checkpoint_state(resumed), saved, rtol=0, atol=0)
    _, want = _run(step, state, (x, y), 2)  # (the step donates the state it is given)
    _, got = _run(other, resumed, (x, y), 2)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_restoring_what_is_not_a_checkpoint_state_says_what_to_pass(gpt):
    module, args, loss_fn, variables = gpt
    step = _pipelined(module).train_step(loss_fn, optax.sgd(0.1))
    state = step.init(variables, *args)
    with pytest.raises(PlanError, match=r"no \['opt_state', 'step'\].*checkpoint_state"):
        step.restore_state({"params": variables["params"]})
    spmd = _spmd(module).train_step(loss_fn, optax.sgd(0.1))
    # a raw PRNGKey is kept typed, as the pipelined step keeps it (one checkpoint form)
    got = spmd.init(variables, *args, rng=jax.random.PRNGKey(0))["rng"]
    assert jnp.issubdtype(got.dtype, jax.dtypes.prng_key)
    with pytest.raises(PlanError, match=r"checkpoint_state"):
        spmd.restore_state({"params": step.checkpoint_state(state)["params"]})


@pytest.fixture(scope="module")
def gpt_nnx():
    spec = models.get("gpt_nnx", "tiny", batch_size=16)
    return spec.module, spec.make_args(rng=jax.random.key(1)), spec.loss_fn


def test_an_nnx_checkpoint_continues_across_spmd_and_pipelined_plans(tmp_path, gpt_nnx):
    """An nnx module's SPMD state (the wrapper's ``nnx.State`` s) checkpoints as the module's
    pure dicts, the pipelined step's form, so either step restores the other's; with a step
    key both key the module's streams per micro-batch (no counters to carry)."""
    module, args, loss_fn = gpt_nnx
    opt, key = optax.adam(1e-3), jax.random.key(5)
    spmd = _spmd(nnx.clone(module)).train_step(loss_fn, opt)
    _, ref = _run(spmd, spmd.init(None, *args, rng=key), args, 4)

    piped = _pipelined(nnx.clone(module)).train_step(loss_fn, opt)
    state, first = _run(piped, piped.init(None, *args, rng=key), args, 2)
    np.testing.assert_allclose(first, ref[:2], rtol=1e-5)
    spmd2 = _spmd(nnx.clone(module)).train_step(loss_fn, opt)
    resumed = _through_a_checkpoint(tmp_path / "a", piped, state, spmd2,
                                    spmd2.init(None, *args, rng=key))
    assert isinstance(resumed["params"], nnx.State) and int(resumed["step"]) == 2
    _, then = _run(spmd2, resumed, args, 2)
    np.testing.assert_allclose(then, ref[2:], rtol=1e-5)

    spmd3 = _spmd(nnx.clone(module)).train_step(loss_fn, opt)
    state, _ = _run(spmd3, spmd3.init(None, *args, rng=key), args, 2)
    saved = spmd3.checkpoint_state(state)
    assert set(saved) == {"params", "opt_state", "collections", "step", "rng", "other_state"}
    assert jax.tree.leaves(saved["other_state"]) == []  # (the streams: keyed by the step)
    assert jax.tree.structure(saved["params"]) == jax.tree.structure(
        nnx.to_pure_dict(nnx.state(module, nnx.Param)))
    _same(spmd3.checkpoint_state(spmd3.restore_state(saved)), saved, rtol=0, atol=0)
    piped2 = _pipelined(nnx.clone(module)).train_step(loss_fn, opt)
    resumed = _through_a_checkpoint(tmp_path / "b", spmd3, state, piped2,
                                    piped2.init(None, *args, rng=key))
    _, then = _run(piped2, resumed, args, 2)
    np.testing.assert_allclose(then, ref[2:], rtol=1e-5)


class _NnxNet(nnx.Module):
    def __init__(self, rngs):
        self.l1, self.bn = nnx.Linear(8, 32, rngs=rngs), nnx.BatchNorm(32, rngs=rngs)
        self.drop, self.l2 = nnx.Dropout(0.5, rngs=rngs), nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


def test_an_unkeyed_nnx_checkpoint_keeps_the_streams_counters(tmp_path):
    """Without a step key the module's dropout draws from its own stream: the checkpoint keeps
    its key and counter (``other_state``) beside the statistics, so a run restored into a
    fresh module draws the masks the uninterrupted run draws."""
    x = jax.random.normal(jax.random.key(1), (16, 8))
    y = jax.random.normal(jax.random.key(2), (16, 4))
    mse = lambda out, x, y: jnp.mean((out - y) ** 2)
    make = lambda: _spmd(_NnxNet(nnx.Rngs(0))).train_step(mse, optax.sgd(0.1), inputs=1)
    step = make()
    state, _ = _run(step, step.init(None, x, y), (x, y), 1)
    saved = step.checkpoint_state(state)
    assert set(saved) == {"params", "opt_state", "collections", "step", "other_state"}
    assert set(saved["collections"]) == {"bn"} and "drop" in saved["other_state"]
    other = make()
    resumed = _through_a_checkpoint(tmp_path, step, state, other, other.init(None, x, y))
    _, want = _run(step, state, (x, y), 2)
    _, got = _run(other, resumed, (x, y), 2)
    np.testing.assert_allclose(got, want, rtol=1e-6)


class _NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.l, self.bn = nnx.Linear(16, 16, rngs=rngs), nnx.BatchNorm(16, rngs=rngs)

    def __call__(self, x):
        return nnx.relu(self.bn(self.l(x)))


class _NnxStack(nnx.Module):
    """BatchNorm blocks, a constant buffer and (``count``) a counter its calls update and a
    stream of its own (``noise``, which no step key keys)."""

    def __init__(self, rngs, count=False):
        self.h = nnx.List([_NnxBlock(rngs) for _ in range(2)])
        self.head = nnx.Linear(16, 4, rngs=rngs)
        self.scale = nnx.Variable(jnp.full((16,), 0.5))
        self.calls = nnx.Variable(jnp.zeros(())) if count else None
        self.noise = nnx.Rngs(noise=1) if count else None
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        for block in self.h:
            x = block(x)
        if self.calls is not None:
            self.calls[...] = self.calls[...] + 1.0
            x = x + 1e-3 * jax.random.normal(self.noise.noise(), x.shape)
        return self.head(self.drop(x * self.scale[...]))


def test_an_nnx_modules_other_variables_survive_a_checkpoint(tmp_path):
    """A keyed nnx module's variables besides its parameters and statistics (a buffer, a
    counter its calls update) are in its checkpoint (``other_state``), in the SPMD and the
    pipelined form alike (a buffer restores across them); the streams' keys a checkpoint
    leaves out come from the step's own copy, not from the module, whose arrays a step that
    ``update`` d it donates."""
    x = jax.random.normal(jax.random.key(1), (16, 16))
    y = jax.random.normal(jax.random.key(2), (16, 4))
    mse = lambda out, x, y: jnp.mean((out - y) ** 2)
    key, kw = jax.random.key(5), {"inputs": 1}
    step = _spmd(_NnxStack(nnx.Rngs(0), count=True)).train_step(mse, optax.adam(1e-2), **kw)
    state, _ = _run(step, step.init(None, x, y, rng=key), (x, y), 1)
    step.update(state)  # the module holds the state's arrays, the next step donates them
    state, _ = _run(step, state, (x, y), 1)
    saved = step.checkpoint_state(state)
    assert float(saved["other_state"]["calls"]) == 2 * M  # (a call per micro-batch)
    # the noise stream draws on from its own state: kept; the dropout stream's: the step key's
    assert set(saved["other_state"]) == {"scale", "calls", "noise"}
    assert int(saved["other_state"]["noise"]["noise"]["count"]) == 2 * M
    back = nnx.to_pure_dict(step.restore_state(saved)["collections"])["module"]
    assert float(back["calls"]) == 2 * M and set(back["drop"]["rngs"]) == {"key", "count"}
    assert int(back["noise"]["noise"]["count"]) == 2 * M

    spmd = _spmd(_NnxStack(nnx.Rngs(0))).train_step(mse, optax.adam(1e-2), **kw)
    s_state, _ = _run(spmd, spmd.init(None, x, y, rng=key), (x, y), 1)
    piped = _pipelined(_NnxStack(nnx.Rngs(0))).train_step(mse, optax.adam(1e-2), **kw)
    p_state = piped.init(None, x, y, rng=key)
    assert type(piped.program).__name__ == "CutProgram"
    resumed = _through_a_checkpoint(tmp_path / "a", spmd, s_state, piped, p_state)
    _same(piped.checkpoint_state(resumed)["params"], spmd.checkpoint_state(s_state)["params"],
          rtol=0, atol=0)
    resumed = _through_a_checkpoint(tmp_path / "b", piped, resumed, spmd,
                                    spmd.init(None, x, y, rng=key))
    _run(spmd, resumed, (x, y), 1)
    # the pipelined step keys no 'noise' stream and carries no counter: said, not dropped
    piped = _pipelined(_NnxStack(nnx.Rngs(0), count=True)).train_step(mse, optax.sgd(0.1), **kw)
    with pytest.raises(PlanError, match=r"\['noise'\].*rng_streams=\('dropout', 'default', "
                                        r"'noise'\)"):
        piped.init(None, x, y, rng=key)
    piped = _pipelined(_NnxStack(nnx.Rngs(0), count=True)).train_step(
        mse, optax.sgd(0.1), rng_streams=("dropout", "noise"), **kw)
    with pytest.raises(PlanError, match=r"calls \(updated by the call\)"):
        piped.init(None, x, y, rng=key)
