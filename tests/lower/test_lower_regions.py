"""shard_map regions: a value-split chain and a co-sharded op, through the public API."""

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from meshes import make_mesh

from nnscaler_jax import PlanError, auto_parallel, op_assign, op_order, op_trans
from nnscaler_jax.ir.anno import DimKind
from nnscaler_jax.lower.hlo import hlo_collectives, summarize
from nnscaler_jax.lower.verify import max_rel_diff

pytestmark = pytest.mark.slow  # compiles and runs programs over the mesh


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(64, name="fc1")(x))
        y = nn.Dense(16, use_bias=False, name="fc2")(h)
        z = (y * 0.5).astype(jnp.float32)
        return jnp.tanh(z)


def _reduce_dim(op):
    return next(n for n, k in op.annotation.kinds().items() if k is DimKind.REDUCE)


def chain_policy(graph, mesh):
    """fc2 row-parallel over 'model'; its partial sums flow through mul and convert unreduced."""
    for op in graph.ops:
        if op.module_path == "fc2" and op.primitive == "dot_general":
            op_assign(graph, op_trans(graph, op, _reduce_dim(op), 4), "model")
        if op.primitive in ("mul", "convert_element_type") and op.module_path == "":
            op_assign(graph, op_trans(graph, op, "value", 4), "model")
    return graph.finish()


def coshard_policy(graph, mesh):
    """fc1 split 8 ways along the batch on a data axis of 2: 4 sequential chunks per device."""
    for op in graph.ops:
        if op.module_path == "fc1" and op.primitive == "dot_general":
            batch = op.annotation.operands[0].axes[0].dims[0].name
            subs = op_trans(graph, op, batch, 8)
            op_assign(graph, subs, "data")
            for a, b in itertools.pairwise(subs):
                op_order(graph, a, b)
    return graph.finish()


def _check(policy):
    mesh = make_mesh((2, 4), ("data", "model"))
    m = Net()
    x = jax.random.normal(jax.random.key(0), (8, 32))
    v = m.init(jax.random.key(1), x)
    pm = auto_parallel(mesh, policy=policy)(m)
    assert max_rel_diff(pm.apply(v, x), m.apply(v, x))[0] <= 1e-5
    g = jax.jit(jax.grad(lambda v: jnp.sum(pm.apply(v, x) ** 2)))(v)
    ref = jax.grad(lambda v: jnp.sum(m.apply(v, x) ** 2))(v)
    assert max_rel_diff(g, ref)[0] <= 1e-5
    return pm, pm.compiled(v, x).as_text(), mesh


def test_value_split_chain_reduces_once_at_its_exit():
    pm, hlo, mesh = _check(chain_policy)
    fc2 = next(p for p in pm.plan.ops if p.module_path == "fc2" and p.primitive == "dot_general")
    assert fc2.keep_partial
    # the partial sums cross mul and convert unreduced: one all-reduce over 'model', at the end
    assert summarize(hlo_collectives(hlo, mesh)) == {("all_reduce", ("model",)): 1}
    assert "custom-call" in hlo or "all-reduce" in hlo


def test_value_split_rejects_nonlinear_op():
    def bad(graph, mesh):
        for op in graph.ops:
            if op.primitive == "tanh":
                op_trans(graph, op, "value", 4)
        return graph.finish()

    mesh = make_mesh((2, 4), ("data", "model"))
    x = jnp.ones((8, 32))
    pm = auto_parallel(mesh, policy=bad)(Net())
    with pytest.raises(PlanError, match="not linear"):
        pm.make_plan(x)


def test_cosharded_op_runs_as_sequential_chunks():
    pm, hlo, _ = _check(coshard_policy)
    fc1 = next(p for p in pm.plan.ops if p.module_path == "fc1" and p.primitive == "dot_general")
    assert fc1.chunks is not None and fc1.chunks[1] == 4
    assert fc1.split[0][0] == "data"
    # the chunks are a loop (lax.map) inside the program, not 4 parallel dots
    assert "while" in hlo
