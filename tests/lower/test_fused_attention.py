"""``Constraints(attention="fused")``: every attention block runs as one fused op (a flash
kernel on GPUs, its arithmetic written once elsewhere), its sequences whole on each device.
Verified against the single-device program (float32, rtol 1e-5): with the heads split by the
search, with the sequence split around attention and moved to the heads by all-to-all (DeepSpeed-
Ulysses, written as a policy), through ``train_step``, from a saved plan; and Pallas' kernel (run
in interpret mode here) against the block's arithmetic."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from one_device import assert_trains_like_one_device

import models
from nnscaler_jax import Constraints, Plan, auto_parallel
from nnscaler_jax.cli.common import capture_model, model_spec, spec_mutable
from nnscaler_jax.cost.compute import op_flops
from nnscaler_jax.errors import ConstraintError
from nnscaler_jax.ir.attention import FUSED, fusable_blocks, with_fused_attention
from nnscaler_jax.lower.attention import _flash, attention_reference
from nnscaler_jax.lower.hlo import hlo_collectives, summarize

RTOL, ATOL = 1e-5, 1e-6


def _value_and_grad(spec, apply, params, args):
    loss = lambda p: spec.loss_fn(apply({"params": p}, *args), *args)
    return jax.jit(jax.value_and_grad(loss))(params)


def _assert_same(got, want):
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=RTOL, atol=ATOL)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_fused_attention_computes_as_one_device(name):
    spec = models.get(name, "tiny", batch_size=4)
    variables, args = spec.init(jax.random.key(0)), spec.make_args()
    mesh = jax.make_mesh((2, 4), ("data", "model"))   # Explicit axes, jax's default
    pm = auto_parallel(mesh, Constraints(attention="fused"))(spec.module)
    laid = pm.init(jax.random.key(0), *args)
    assert len(pm.plan.fused_attention) == 2           # one block per layer
    assert "fused attention (2 blocks" in pm.plan.summary(pm.graph)
    # at the tiny sequence the search keeps it whole: no all-to-all around attention, no ring
    assert not pm.plan.ring_layouts
    loss = lambda p: spec.loss_fn(pm.apply({"params": p}, *args), *args)
    text = jax.jit(jax.value_and_grad(loss)).lower(laid["params"]).compile().as_text()
    assert not [c for c in hlo_collectives(text, mesh) if c.kind == "all_to_all"]
    _assert_same(_value_and_grad(spec, pm.apply, laid["params"], args),
                 _value_and_grad(spec, spec.module.apply, variables["params"], args))


SEQ = 256


def _ulysses(graph, mesh):
    """Sequence split over 'seq' wherever a dim has the sequence's size; each fused attention
    on its heads (``b1``: the kv heads) over 'seq': all-to-all around attention."""
    for op in graph.ops:
        if op.primitive == FUSED:
            graph.decide(op, {"seq": "b1"})
            continue
        sizes = op.dim_sizes()
        seq = [n for n in op.annotation.splittable() if sizes.get(n) == SEQ]
        if seq:
            graph.decide(op, {"seq": seq[0]})
    return graph.finish()


def test_sequence_split_moves_to_the_heads_by_all_to_all():
    spec = models.get("llama", "tiny", batch_size=1, seq_len=SEQ, n_heads=8, n_kv_heads=8,
                      d_model=64, d_ff=128)
    variables, args = spec.init(jax.random.key(0)), spec.make_args()
    mesh = jax.make_mesh((8,), ("seq",))
    pm = auto_parallel(mesh, Constraints(attention="fused"), policy=_ulysses)(spec.module)
    laid = pm.init(jax.random.key(0), *args)
    loss = lambda p: spec.loss_fn(pm.apply({"params": p}, *args), *args)
    text = jax.jit(jax.value_and_grad(loss)).lower(laid["params"]).compile().as_text()
    kinds = summarize(hlo_collectives(text, mesh))
    assert kinds[("all_to_all", ("seq",))] >= 8   # q, k, v in and the output out, per layer
    _assert_same(_value_and_grad(spec, pm.apply, laid["params"], args),
                 _value_and_grad(spec, spec.module.apply, variables["params"], args))


def test_train_step_and_a_saved_plan_run_the_fused_blocks():
    spec = models.get("gpt", "tiny", batch_size=4)
    variables, args = spec.init(jax.random.key(0)), spec.make_args()
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    opt = optax.sgd(0.1)
    pm = auto_parallel(mesh, Constraints(attention="fused"))(spec.module)
    assert_trains_like_one_device(pm.train_step(spec.loss_fn, opt), spec, variables, args, opt,
                                  steps=2)
    saved = Plan.from_json(pm.plan.to_json())
    assert saved.fused_attention == pm.plan.fused_attention and saved == pm.plan
    again = auto_parallel(mesh, plan=saved)(spec.module)
    laid = again.init(jax.random.key(0), *args)
    _assert_same(_value_and_grad(spec, again.apply, laid["params"], args),
                 _value_and_grad(spec, spec.module.apply, variables["params"], args))


def test_flash_kernel_computes_the_block():
    """Pallas' kernel (interpret mode: no GPU here) on the grouped-query layout of Llama's
    block, forward and gradients, against the block's arithmetic."""
    spec = model_spec("llama", "tiny", None, seq_len=SEQ)
    graph = capture_model(spec, mutable=spec_mutable(spec), loss=True).graph
    op = next(o for o in with_fused_attention(graph, fusable_blocks(graph)).ops
              if o.primitive == FUSED)
    q, k, v = (jax.random.normal(key, t.shape, jnp.float32)
               for key, t in zip(jax.random.split(jax.random.key(1), 3), op.inputs, strict=True))
    w = jnp.cos(jnp.arange(np.prod(op.outputs[0].shape)).reshape(op.outputs[0].shape))
    f = lambda fn: lambda *x: (fn(op, *x) * w).sum()
    kernel = lambda *x: _flash(*x, interpret=True)
    np.testing.assert_allclose(kernel(op, q, k, v), attention_reference(op, q, k, v),
                               rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.grad(f(kernel), argnums=(0, 1, 2))(q, k, v),
                    jax.grad(f(attention_reference), argnums=(0, 1, 2))(q, k, v), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_the_fused_op_is_priced_as_a_causal_kernel():
    """Its FLOPs: the two matmuls over the causal half of the (query, key) pairs."""
    spec = model_spec("llama", "tiny", None, seq_len=SEQ)
    graph = capture_model(spec, mutable=spec_mutable(spec), loss=True).graph
    op = next(o for o in with_fused_attention(graph, fusable_blocks(graph)).ops
              if o.primitive == FUSED)
    b, s, kv, g, d = op.inputs[0].shape[0], SEQ, 2, 2, 8   # Llama tiny: 4 heads in 2 groups
    assert op_flops(op) == 2 * b * kv * g * s * s / 2 * (d + d)


def test_bad_attention_settings_are_refused():
    with pytest.raises(ConstraintError, match="attention='spiral'"):
        Constraints(attention="spiral")
    spec = models.get("gpt", "tiny", batch_size=4)
    mesh = jax.make_mesh((2, 4), ("stage", "data"))
    pm = auto_parallel(mesh, Constraints(attention="fused", pipeline_stages=2,
                                         microbatches=2))(spec.module)
    with pytest.raises(ConstraintError, match="attention='fused'"):
        pm.make_plan(*spec.make_args())
