"""Context parallelism of fused attention (``Constraints(attention=...)``): the sequence split over
mesh axes, attention run as ring or zigzag ring attention (K / V rotated around the devices) or
moved to the heads by all-to-all (DeepSpeed-Ulysses). Each plan, chosen by the search or forced by
a hand-written policy, equals the single-device program (float32, rtol 1e-5), forward and
gradients; the HLO shows how it ran."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from one_device import assert_trains_like_one_device

import models
from nnscaler_jax import Constraints, Plan, Rule, auto_parallel
from nnscaler_jax.cli.common import capture_model, spec_mutable
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.ir.attention import FUSED, fusable_blocks, with_fused_attention
from nnscaler_jax.lower.hlo import hlo_collectives, summarize
from nnscaler_jax.plan.view import fused_attention_rows

RTOL, ATOL = 1e-5, 1e-6


def _llama(seq, heads=4, kv_heads=2, batch=1):
    return models.get("llama", "tiny", batch_size=batch, seq_len=seq, n_heads=heads,
                      n_kv_heads=kv_heads, d_model=64, d_ff=128)


def _mesh(shape):
    return jax.make_mesh(shape, ("seq",) if len(shape) == 1 else ("data", "seq"))


def _check(spec, pm, mesh):
    """pm equals one device (loss and gradients); returns its collectives by (kind, axes)."""
    variables, args = spec.init(jax.random.key(0)), spec.make_args()
    laid = pm.init(jax.random.key(0), *args)
    loss = lambda p: spec.loss_fn(pm.apply({"params": p}, *args), *args)
    fn = jax.jit(jax.value_and_grad(loss))
    text = fn.lower(laid["params"]).compile().as_text()
    got = fn(laid["params"])
    want = jax.jit(jax.value_and_grad(lambda p: spec.loss_fn(
        spec.module.apply({"params": p}, *args), *args)))(variables["params"])
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=RTOL, atol=ATOL)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)
    return summarize(hlo_collectives(text, mesh))


# the projections split tokens only (no tensor parallelism): the sequence is split around
# attention, which the search then moves to the heads (all-to-all) or keeps split (ring)
TOKENS_ONLY = (Rule(module="*_proj", dims=("m0", "m1")),)


@pytest.mark.parametrize("shape, seq, heads, kv_heads, rules, how", [
    ((8,), 256, 4, 2, (), "ring over seq"),                  # 2 kv heads cannot split 8 ways
    ((2, 4), 256, 4, 2, (), "ring over seq, b1 over data"),
    ((2, 4), 1024, 4, 2, (), "zigzag over dataxseq"),        # longer: balanced causal work pays
    ((8,), 256, 8, 8, TOKENS_ONLY, "b1 over seq"),           # heads divide: all-to-all wins
    ((2, 4), 256, 8, 8, TOKENS_ONLY, "b1 over data, b1 over seq"),
])
def test_the_search_chooses_how_a_split_sequence_attends(shape, seq, heads, kv_heads, rules,
                                                         how):
    spec, mesh = _llama(seq, heads, kv_heads), _mesh(shape)
    pm = auto_parallel(mesh, Constraints(attention="fused", rules=rules))(spec.module)
    kinds = _check(spec, pm, mesh)
    assert {h for _, h in fused_attention_rows(pm.plan)} == {how}
    all_to_all = sum(n for (kind, _), n in kinds.items() if kind == "all_to_all")
    seq_axes = tuple(a for a in ("data", "seq") if f"over {a}" in how or f"x{a}" in how)
    if how.startswith("b1"):     # Ulysses: q, k, v to the heads and the output back
        assert kinds[("all_to_all", seq_axes)] >= 8 and not pm.plan.ring_layouts
    else:                        # K / V travel between neighbours, nothing is re-laid
        ring_axes = ("data", "seq") if "dataxseq" in how else ("seq",)
        assert not all_to_all and kinds[("ppermute", ring_axes)] >= 2
        assert {x for _, x in pm.plan.ring_layouts} == {how.split()[0]}


def _context_parallel(graph, mesh):
    """The sequence split over 'seq' everywhere (batch over 'data' where there is one), each
    fused attention on its sequence too: ring attention."""
    for op in graph.ops:
        sizes, names = op.dim_sizes(), op.annotation.splittable()
        split = {}
        seq = [n for n in names if sizes.get(n) == 256 or n == "s"]
        if seq:
            split["seq"] = seq[0]
        if "data" in graph.mesh_axes and op.primitive == FUSED:
            split["data"] = "b0"
        if split:
            graph.decide(op, split)
    return graph.finish()


@pytest.mark.parametrize("layout", ["ring", "zigzag"])
@pytest.mark.parametrize("shape", [(8,), (2, 4)])
def test_a_hand_written_plan_forces_ring_or_zigzag(layout, shape):
    spec, mesh = _llama(256, batch=2), _mesh(shape)
    pm = auto_parallel(mesh, Constraints(attention=layout), policy=_context_parallel)(spec.module)
    kinds = _check(spec, pm, mesh)
    assert {h for _, h in fused_attention_rows(pm.plan)} == \
        {f"{layout} over seq" + (", b0 over data" if len(shape) == 2 else "")}
    assert kinds[("ppermute", ("seq",))] >= 2
    assert not [k for k in kinds if k[0] == "all_to_all"]


def test_ring_attention_trains_and_its_plan_is_saved():
    spec, mesh = _llama(256), _mesh((8,))
    variables, args = spec.init(jax.random.key(0)), spec.make_args()
    pm = auto_parallel(mesh, Constraints(attention="zigzag"),
                       policy=_context_parallel)(spec.module)
    opt = optax.sgd(0.1)
    assert_trains_like_one_device(pm.train_step(spec.loss_fn, opt), spec, variables, args, opt,
                                  steps=2)
    saved = Plan.from_json(pm.plan.to_json())
    assert saved == pm.plan and {x for _, x in saved.ring_layouts} == {"zigzag"}
    assert "zigzag over seq" in saved.summary(pm.graph)


def _fused_op(seq):
    spec = _llama(seq)
    graph = capture_model(spec, mutable=spec_mutable(spec), loss=True).graph
    return next(o for o in with_fused_attention(graph, fusable_blocks(graph)).ops
                if o.primitive == FUSED)


def test_ring_pricing_balances_causal_work_against_exchanges():
    """A causal ring's last device computes as if unmasked; zigzag about half, for 8 exchanges
    of half blocks: it pays once the blocks are long enough (here from 1024 tokens)."""
    cm, split = CostModel.for_axes({"seq": 8}), (("seq", "s"),)
    grads = (True, True, True)
    short, long = _fused_op(256), _fused_op(4096)
    assert cm.ring_layout(short, split) == "ring" and cm.ring_layout(long, split) == "zigzag"
    ring, zigzag = (cm._ring_time(long, split, grads, None, lay) for lay in ("ring", "zigzag"))
    assert 1.6 < ring / zigzag < 2.0
    whole = cm.op_time(long, (), grads)
    assert ring == pytest.approx(2 * whole / 8, rel=0.02)  # communication hidden under blocks
