"""Elementwise ops priced by what their fusion reads and writes (``nnscaler_jax.cost.fusion``):
closed forms on small graphs, and the plan's pricing and the search's using them alike."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from nnscaler_jax import trace
from nnscaler_jax.cost import CostModel
from nnscaler_jax.cost.compute import grad_tensors, op_bytes
from nnscaler_jax.cost.fusion import fused_bytes
from nnscaler_jax.search import search

B, D, H = 8, 16, 32
F32 = 4


class Chain(nn.Module):
    """A matmul, four elementwise ops, a matmul."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(H, use_bias=False)(x)
        return nn.Dense(D, use_bias=False)(jnp.exp(jnp.tanh(h * 2.0) + 1.0))


class Softmax(nn.Module):
    """bf16 scores, a float32 softmax, a matmul."""

    @nn.compact
    def __call__(self, x):
        s = nn.Dense(H, use_bias=False, dtype=jnp.bfloat16)(x)
        return nn.Dense(D, use_bias=False)(jax.nn.softmax(s.astype(jnp.float32)))


def _by_primitive(graph):
    io = fused_bytes(graph)
    return [(op.primitive, io[op.id]) for op in graph.ops]


def test_an_elementwise_chain_reads_and_writes_each_buffer_once():
    """h = x @ w is read once (by the fused mul); tanh's and exp's outputs are written once
    (the backward keeps them; exp's is also the next matmul's operand), tanh's read once by the
    add; the intermediates of mul and add stay inside the fusion. Op by op, each of the four
    ops would read and write a B x H buffer: twice the traffic."""
    g = trace(Chain(), jax.ShapeDtypeStruct((B, D), jnp.float32))
    buf = B * H * F32
    assert _by_primitive(g)[1:5] == [("mul", buf), ("tanh", buf), ("add", buf), ("exp", buf)]
    unfused = sum(op_bytes(op) for op in g.ops[1:5])
    assert unfused == 8 * buf + 2 * F32  # (+ the two scalar constants)
    matmuls = [t for p, t in _by_primitive(g) if p == "dot_general"]
    assert matmuls == [op_bytes(op) for op in g.ops if op.primitive == "dot_general"]


def test_a_cheap_op_read_by_two_fusions_is_computed_in_each():
    """The bf16 -> f32 cast of the scores is read by the max reduction and by the subtraction:
    XLA duplicates it into both fusions, each reading the bf16 scores (2 x B x H x 2 bytes)
    and writing nothing; exp's output, read by the sum and the division (and kept for the
    backward), is written once and read by each."""
    g = trace(Softmax(), jax.ShapeDtypeStruct((B, D), jnp.float32))
    got = {p: t for p, t in _by_primitive(g)[3:] if p != "convert_element_type"}
    cast = _by_primitive(g)[3]
    assert cast == ("convert_element_type", 2 * B * H * 2)
    assert got["reduce_max"] == B * F32  # its input fused, its output written
    assert got["sub"] == 0
    assert got["exp"] == B * H * F32
    assert got["reduce_sum"] == B * H * F32 + B * F32
    assert got["div"] == B * H * F32 + B * F32 + B * H * F32  # e, the sums, the probabilities


@pytest.mark.parametrize("module", [Chain(), Softmax()], ids=["chain", "softmax"])
def test_the_plan_and_the_search_price_the_fused_traffic(module):
    """``plan_cost``'s compute is the sum of per-op roofline times over the fused traffic,
    and the search's objective equals the plan's step (the tables price the same bytes)."""
    g = trace(module, jax.ShapeDtypeStruct((B, D), jnp.float32))
    axes = {"data": 2}
    plan, report = search(g, axes)
    cm = CostModel.for_axes(axes)
    splits = {p.op: p.split for p in plan.ops}
    io, grads = fused_bytes(g), grad_tensors(g)

    def priced(traffic):
        return sum(cm.op_time(op, splits.get(op.id, ()), tuple(t.id in grads for t in op.inputs),
                              traffic) for op in g.ops)

    fused, unfused = priced(io), priced(None)
    cost = cm.plan_cost(plan, g)
    assert cost.compute_time_s == pytest.approx(fused, rel=1e-12)
    assert fused < unfused
    assert report.objective_s == pytest.approx(cost.step_time_s, rel=1e-9)
