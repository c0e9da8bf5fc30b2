"""The pipelined step takes the SPMD step's options (issue 16): ``module_kwargs``, rng streams
(dropout: every micro-batch and data shard its own key) and ``inputs``, and trains nnx modules.

The reference runs the same program on one device: the batch cut into its ``M x D`` row blocks
(block ``g`` is micro-batch ``g // D`` of data shard ``g % D``), block ``g`` with
``microbatch_rngs(key, g, streams)`` where ``key`` is split off the step's rng, loss = mean.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from meshes import make_mesh

import models
from nnscaler_jax import Constraints, PlanError, auto_parallel
from nnscaler_jax.pipeline import microbatch_rngs

pytestmark = pytest.mark.slow  # compiles and runs programs over the mesh

RTOL, ATOL = 1e-4, 1e-6  # float32; ATOL for gradients that are exactly 0 in theory (key bias)
M, D, LR = 4, 4, 0.1


def _pm(module, schedule="1f1b"):
    mesh = make_mesh((2, D), ("stage", "data"))
    return auto_parallel(mesh, Constraints(pipeline_stages=2, microbatches=M,
                                           schedule=schedule))(module)


def _sgd_reference(loss_of_block, params, batch, *, grads=False, blocks_of=M * D):
    """Params after one SGD step on the mean of ``loss_of_block(params, g, rows)`` over the
    row blocks ``g`` of ``batch`` (an array or a tuple of them); ``grads``: and the
    gradients. The blocks run one after the other (``lax.map``), not under ``vmap``: jax
    batches an ``rbg`` key's draw from the first key only."""
    blocks = jax.tree.map(lambda x: x.reshape((blocks_of, -1) + x.shape[1:]), batch)

    def loss(p):
        return jnp.mean(jax.lax.map(lambda gb: loss_of_block(p, *gb),
                                    (jnp.arange(blocks_of), blocks)))

    value, g = jax.jit(jax.value_and_grad(loss))(params)
    out = value, jax.tree.map(lambda p, d: p - LR * d, params, g)
    return (*out, g) if grads else out


def _close(a, b):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b),
                            strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=RTOL, atol=ATOL,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_linen_dropout_and_module_kwargs_match_per_microbatch_keys(schedule):
    # zb-h1: the split backward's B recomputes the forward with the micro-batch's key, its G
    # reads the masks B kept
    spec = models.get("gpt", "tiny-dropout", batch_size=2 * M * D)
    (tokens,) = spec.make_args(rng=jax.random.key(1))
    params = spec.module.init(jax.random.key(0), tokens)["params"]
    rng = jax.random.key(7)
    step = _pm(spec.module, schedule).train_step(spec.loss_fn, optax.sgd(LR), inputs=1,
                                       module_kwargs={"deterministic": False})
    state = step.init({"params": params}, tokens, rng=rng)
    state, metrics = step(state, tokens)
    _, key = jax.random.split(rng)  # the step's key; the state keeps the other half

    def block(p, g, x):
        out = spec.module.apply({"params": p}, x, deterministic=False,
                                rngs=microbatch_rngs(key, g, ("dropout",)))
        return spec.loss_fn(out, x)

    ref_loss, ref_params = _sgd_reference(block, params, tokens)
    np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=RTOL)
    _close(step.params(state), ref_params)
    plain = spec.loss_fn(spec.module.apply({"params": params}, tokens, deterministic=True),
                         tokens)
    assert abs(float(metrics["loss"]) - float(plain)) > 1e-3  # dropout was on
    assert set(state) == {"params", "opt_state", "rng", "step"}
    state, again = step(state, tokens)  # a new key per step
    assert float(again["loss"]) != pytest.approx(float(metrics["loss"]), rel=1e-6)


def test_an_rbg_key_on_tensor_parallel_stages_matches_per_microbatch_keys():
    """GPT with dropout, a step key of the ``rbg`` impl, Megatron stages (2 stages x 2 data x 2
    model), the planner's own overlap choice: the keyed call runs cut (its layers read a key
    besides their activation), and the planner prices that runtime; it priced the stacked one
    with transfers overlapped, which the per-stage runtime refused ("overlap=True ... is the
    in-graph runtime's"). Block ``g`` is micro-batch ``g // 2`` of data shard ``g % 2``."""
    spec = models.get("gpt", "tiny-dropout", batch_size=2 * M * 2)
    (tokens,) = spec.make_args(rng=jax.random.key(1))
    params = spec.module.init(jax.random.key(0), tokens)["params"]
    rng = jax.random.key(7, impl="rbg")
    pm = auto_parallel(make_mesh((2, 2, 2), ("stage", "data", "model")),
                       Constraints(pipeline_stages=2, microbatches=M, schedule="1f1b"),
                       policy="megatron")(spec.module)
    step = pm.train_step(spec.loss_fn, optax.sgd(LR), inputs=1,
                         module_kwargs={"deterministic": False})
    state = step.init({"params": params}, tokens, rng=rng)
    state, metrics = step(state, tokens)
    assert type(step.program).__name__ == "MpmdProgram" and step.program.tp_axes == ("model",)
    assert pm.plan.pipeline.executor == "per-stage" and not pm.plan.pipeline.overlap
    _, key = jax.random.split(rng)

    def block(p, g, x):
        out = spec.module.apply({"params": p}, x, deterministic=False,
                                rngs=microbatch_rngs(key, g, ("dropout",)))
        return spec.loss_fn(out, x)

    ref_loss, ref_params = _sgd_reference(block, params, tokens, blocks_of=M * 2)
    np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=RTOL)
    _close(step.params(state), ref_params)


def test_nnx_module_trains_and_writes_back():
    spec = models.get("gpt_nnx", "tiny-dropout", batch_size=2 * M * D)
    module, loss_fn = spec.module, spec.loss_fn
    (tokens,) = spec.make_args(rng=jax.random.key(1))
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    params, rest = jax.tree.map(jnp.copy, (params, rest))
    seed = jnp.copy(module.dropout.rngs.key[...])  # the step key: the module's first stream
    pm = _pm(module)
    step = pm.train_step(loss_fn, optax.sgd(LR))
    state = step.init(None, tokens)
    state, metrics = step(state, tokens)
    _, key = jax.random.split(seed)

    def block(p, g, x):
        m = nnx.merge(graphdef, p, rest, copy=True)
        nnx.reseed(m, dropout=microbatch_rngs(key, g, ("dropout",))["dropout"])
        return loss_fn(m(x), x)

    ref_loss, ref_params = _sgd_reference(block, params, tokens)
    np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=RTOL)
    _close(step.params(state), ref_params)
    step.update(state)  # back into the wrapped module
    np.testing.assert_allclose(pm.module.h[1].mlp.c_fc.kernel[...],
                               ref_params["h"][1]["mlp"]["c_fc"]["kernel"][...],
                               rtol=RTOL, atol=ATOL)


class _Net(nnx.Module):
    """An ``nnx.Rngs(0)`` model: its Dropout draws from the 'default' stream."""

    def __init__(self, rngs):
        self.l1, self.drop = nnx.Linear(8, 32, rngs=rngs), nnx.Dropout(0.2, rngs=rngs)
        self.l2, self.l3 = nnx.Linear(32, 32, rngs=rngs), nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.l3(nnx.relu(self.l2(self.drop(nnx.relu(self.l1(x))))))


def _ce(logits, x, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def test_nnx_default_stream_given_key_and_inputs():
    x = jax.random.normal(jax.random.key(1), (2 * M * D, 8))
    labels = jax.random.randint(jax.random.key(2), (2 * M * D,), 0, 4)
    model = _Net(nnx.Rngs(0))
    graphdef, params, rest = jax.tree.map(jnp.copy, nnx.split(model, nnx.Param, ...))
    step = _pm(model).train_step(_ce, optax.sgd(LR), inputs=1,  # model(x), loss(out, x, labels)
                                 return_grads=True)
    rng = jax.random.key(5)
    state = step.init(None, x, labels, rng=rng)
    state, metrics = step(state, x, labels)
    _, key = jax.random.split(rng)

    def block(p, g, rows):
        m = nnx.merge(graphdef, p, rest, copy=True)
        nnx.reseed(m, default=microbatch_rngs(key, g, ("dropout", "default"))["default"])
        return _ce(m(rows[0]), *rows)

    ref_loss, ref_params, ref_grads = _sgd_reference(block, params, (x, labels), grads=True)
    np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=RTOL)
    _close(step.params(state), ref_params)
    # the gradients as the parameters: the module's nnx.State, not the pipeline's layout
    assert type(metrics["grads"]) is type(step.params(state))
    _close(metrics["grads"], ref_grads)


class _Cached(nnx.Module):
    """A decoding cache (``nnx.Cache``), which the pipelined step does not carry."""

    def __init__(self, rngs):
        self.l1, self.l2 = nnx.Linear(8, 8, rngs=rngs), nnx.Linear(8, 8, rngs=rngs)
        self.seen = nnx.Cache(jnp.zeros(8))

    def __call__(self, x):
        self.seen[...] = self.seen[...] + x.sum(0)
        return self.l2(self.l1(x))


def test_bad_options_are_plan_errors():
    spec = models.get("gpt", "tiny-dropout", batch_size=2 * M * D)
    (tokens,) = spec.make_args(rng=jax.random.key(1))
    params = spec.module.init(jax.random.key(0), tokens)["params"]
    pm = _pm(spec.module)
    with pytest.raises(PlanError, match="growth_interval=1.5 must be a positive int"):
        pm.train_step(spec.loss_fn, optax.sgd(LR), growth_interval=1.5)
    with pytest.raises(PlanError, match="static flags"):
        pm.train_step(spec.loss_fn, optax.sgd(LR), module_kwargs={"mask": jnp.ones(3)})
    with pytest.raises(PlanError, match="rng_streams"):
        pm.train_step(spec.loss_fn, optax.sgd(LR), rng_streams="dropout")
    with pytest.raises(PlanError, match="inputs=3"):
        pm.train_step(spec.loss_fn, optax.sgd(LR), inputs=3).init({"params": params}, tokens)
    step = pm.train_step(spec.loss_fn, optax.sgd(LR), module_kwargs={"deterministic": False})
    with pytest.raises(PlanError, match="rng="):  # dropout on, no key
        step.init({"params": params}, tokens)
    with pytest.raises(PlanError, match=r"\['batch_stats'\] hold no arrays"):
        step.init({"params": params, "batch_stats": {}}, tokens)
    nnx_step = _pm(_Cached(nnx.Rngs(0))).train_step(lambda y, x: jnp.mean((y - x) ** 2),
                                                     optax.sgd(LR))
    with pytest.raises(PlanError, match=r"holds \['Cache'\], which it does not carry"):
        nnx_step.init(None, jnp.ones((2 * M * D, 8)))
