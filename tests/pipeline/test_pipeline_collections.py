"""The pipelined step carries mutable collections (issue 16): linen ``batch_stats`` and nnx
``nnx.BatchStat``, as :mod:`nnscaler_jax.pipeline.mutable` says.

The reference runs the documented semantics on one device: the batch cut into its ``M x D`` row
blocks (block ``g = m * D + d`` is micro-batch ``m`` of data shard ``d``); on each shard ``d``
the statistics go through micro-batches ``m = 0 .. M - 1`` in order, each block's loss reads
the statistics before its own update (constants for the gradient); the loss is the mean over
blocks, the new statistics the mean over shards of each shard's last ones. A step that did not
carry the statistics from one micro-batch to the next, updated them again in its backwards or
let a backward read other statistics than its forward (``_Center``'s output reads them) gives
other numbers.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from meshes import make_mesh

from nnscaler_jax import Constraints, PlanError, auto_parallel
from nnscaler_jax.pipeline import schedule as sch
from nnscaler_jax.pipeline.mutable import require_forward_order
from nnscaler_jax.pipeline.steps import Schedule, Step

pytestmark = pytest.mark.slow  # compiles and runs programs over the mesh

RTOL, ATOL = 1e-4, 1e-6  # float32; ATOL for entries whose true value is ~0
M, D, LR, WIDTH = 4, 4, 0.1, 16


def _pm(module, schedule="1f1b", overlap=None):
    mesh = make_mesh((2, D), ("stage", "data"))
    return auto_parallel(mesh, Constraints(pipeline_stages=2, microbatches=M,
                                           schedule=schedule, pipeline_overlap=overlap))(module)


def _mse(out, x, y):
    return jnp.mean((out - y) ** 2)


def _batch(rows=4 * M * D):
    x = jax.random.normal(jax.random.key(1), (rows, WIDTH)) * 2.0 + 0.5
    return x, jax.random.normal(jax.random.key(2), (rows, 4))


def _reference_step(block_loss, params, stats, batch):
    """One SGD step of the documented semantics: ``block_loss(params, stats, rows) -> (loss,
    new stats)``; returns ``(loss, new params, new stats)``."""
    blocks = jax.tree.map(lambda x: x.reshape((M, D, -1) + x.shape[1:]), batch)

    def shard(rows_d):  # one data shard: its micro-batches in order, the stats carried
        def body(s, rows):
            _, new = block_loss(params, s, rows)
            return new, s  # (each block reads the stats before its own update)
        return jax.lax.scan(body, stats, rows_d)

    last, read = jax.vmap(shard, in_axes=1)(blocks)  # [D, ...], [D, M, ...]

    by_shard = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), blocks)  # [D, M, b, ...]

    def loss(p):
        return jnp.mean(jax.vmap(jax.vmap(lambda s, rows: block_loss(p, s, rows)[0]))(
            read, by_shard))

    value, grads = jax.value_and_grad(loss)(params)
    new_params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
    return value, new_params, jax.tree.map(lambda x: jnp.mean(x, 0), last)


def _close(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want),
                            strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=RTOL, atol=ATOL,
                                   err_msg=jax.tree_util.keystr(path))


class _Center(nn.Module):
    """Subtracts a running mean of its input that it reads in train mode too (unlike
    BatchNorm): the output depends on the statistics a block reads."""

    @nn.compact
    def __call__(self, x, train):
        mean = self.variable("batch_stats", "mean", jnp.zeros, x.shape[-1:])
        y = x - mean.value
        if train:
            mean.value = 0.5 * mean.value + 0.5 * jnp.mean(x, 0)
        return y


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        x = nn.BatchNorm(use_running_average=not train, momentum=0.5)(nn.Dense(WIDTH)(x))
        return nn.relu(_Center()(x, train))


class _Stack(nn.Module):
    """Identical layers and a head: a layer stack, run by the cut program because of its
    collections."""

    layers: int = 2

    @nn.compact
    def __call__(self, x, train=False):
        for i in range(self.layers):
            x = _Block(name=f"h_{i}")(x, train)
        return nn.Dense(4, name="head")(x)


@pytest.mark.parametrize("schedule,layers,overlap", [
    ("1f1b", 2, None), ("interleaved", 4, None), ("eager-1f1b", 2, None),
    ("1f1b", 2, True)])  # (transfers overlapped: the collections carried as before)
def test_linen_batch_stats_carried_in_microbatch_order_then_averaged(schedule, layers,
                                                                     overlap):
    module, (x, y) = _Stack(layers), _batch()
    variables = module.init(jax.random.key(0), x)
    params, stats = variables["params"], variables["batch_stats"]
    step = _pm(module, schedule, overlap).train_step(_mse, optax.sgd(LR), inputs=1,
                                            module_kwargs={"train": True})
    state = step.init(variables, x, y)
    assert type(step.program).__name__ == "CutProgram"
    assert step.program.tables.overlap == step.plan.pipeline.overlap  # (None: by price)
    assert step.program.tables.overlap or not overlap
    assert step.program.schedule.virtual == layers // 2  # (interleaved: 2 chunks a stage)
    assert set(state) == {"params", "opt_state", "collections", "step"}

    def block_loss(p, s, rows):
        out, new = module.apply({"params": p, "batch_stats": s}, rows[0], train=True,
                                mutable=["batch_stats"])
        return _mse(out, *rows), new["batch_stats"]

    for _ in range(2):  # the second step reads the first one's averaged statistics
        state, metrics = step(state, x, y)
        loss, params, stats = jax.jit(_reference_step, static_argnums=0)(
            block_loss, params, stats, (x, y))
        np.testing.assert_allclose(metrics["loss"], loss, rtol=RTOL)
        got = step.variables(state)
        _close(got["params"], params)
        _close(got["batch_stats"], stats)
    _close(step.params(state), params)
    # each device holds its stage's blocks' statistics (identical blocks: half of them)
    whole = sum(a.nbytes for a in jax.tree.leaves(stats))
    assert step.memory(state)["collections"] == whole // 2


class _NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.bn = nnx.BatchNorm(WIDTH, momentum=0.5, rngs=rngs)

    def __call__(self, x):
        return nnx.relu(self.bn(self.linear(x)))


class _NnxStack(nnx.Module):
    def __init__(self, rngs):
        self.h = nnx.List([_NnxBlock(rngs) for _ in range(2)])
        self.head = nnx.Linear(WIDTH, 4, rngs=rngs)

    def __call__(self, x):
        for block in self.h:
            x = block(x)
        return self.head(x)


def test_nnx_batch_stats_carried_and_written_back():
    model, (x, y) = _NnxStack(nnx.Rngs(0)), _batch()
    graphdef, params, stats, rest = jax.tree.map(
        jnp.copy, nnx.split(model, nnx.Param, nnx.BatchStat, ...))
    step = _pm(model).train_step(_mse, optax.sgd(LR), inputs=1)
    state = step.init(None, x, y)
    state, metrics = step(state, x, y)

    def block_loss(p, s, rows):
        m = nnx.merge(graphdef, p, s, rest, copy=True)
        out = m(rows[0])
        return _mse(out, *rows), nnx.state(m, nnx.BatchStat)

    loss, params, stats = jax.jit(_reference_step, static_argnums=0)(
        block_loss, params, stats, (x, y))
    np.testing.assert_allclose(metrics["loss"], loss, rtol=RTOL)
    step.update(state)  # parameters and statistics back into the wrapped module
    _, got_params, got_stats, _ = nnx.split(model, nnx.Param, nnx.BatchStat, ...)
    _close(nnx.to_pure_dict(got_params), nnx.to_pure_dict(params))
    _close(nnx.to_pure_dict(got_stats), nnx.to_pure_dict(stats))
    assert float(jnp.abs(got_stats["h"][0]["bn"]["mean"][...]).max()) > 0.1  # updated


def test_collections_refused_where_not_carried():
    module, (x, y) = _Stack(), _batch()
    variables = module.init(jax.random.key(0), x)
    for schedule, what in [("nf1b", "recycling passes"), ("interlaced", "all-device blocks")]:
        step = _pm(module, schedule).train_step(_mse, optax.sgd(LR), inputs=1,
                                                module_kwargs={"train": True})
        with pytest.raises(PlanError, match=f"has {what}.*do not carry the model's mutable"):
            step.init(variables, x, y)


class _Scaled(nn.Module):
    @nn.compact
    def __call__(self, x, scale):
        return nn.Dense(WIDTH)(x) * scale


class _Counted(nn.Module):
    """A counter read by both layers (one on each stage)."""

    @nn.compact
    def __call__(self, x, train=False):
        seen = self.variable("batch_stats", "seen", jnp.zeros, ())
        for i in range(2):
            x = _Scaled(name=f"h_{i}")(x, 1 + seen.value)
        if train:
            seen.value = seen.value + 1
        return x


def test_collection_read_on_two_stages_is_refused():
    module, (x, _) = _Counted(), _batch()
    step = _pm(module).train_step(lambda out, x: jnp.mean(out ** 2), optax.sgd(LR), inputs=1,
                                  module_kwargs={"train": True})
    with pytest.raises(PlanError, match="collection leaves batch_stats/seen are read by "
                                        "several pipeline chunks"):
        step.init(module.init(jax.random.key(0), x), x)


def test_forwards_out_of_micro_batch_order_are_refused():
    F, B = (lambda m: Step("F", m)), (lambda m: Step("B", m))
    swapped = Schedule("mine", 1, 2, 1, ((F(1), F(0), B(0), B(1)),))
    with pytest.raises(PlanError, match=r"stage 0 runs the forwards of its chunk 0 in the "
                                        r"micro-batch order \[1, 0\]"):
        require_forward_order(swapped)
    for sched in (sch.one_f_one_b(4, 8), sch.gpipe(2, 4), sch.interleaved(2, 4, 2)):
        require_forward_order(sched)
