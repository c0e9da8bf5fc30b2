"""`plan/propagate.py`: undecided ops follow the layout of their first split input, when the
split divides their dims; partial sums count as reduced; decided ops are kept as they are."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from nnscaler_jax import trace
from nnscaler_jax.ir.graph import Graph, Op, Tensor
from nnscaler_jax.plan.layouts import op_layouts
from nnscaler_jax.plan.plan import OpPlan
from nnscaler_jax.plan.propagate import propagate

MESH = {"data": 4, "model": 2}


def T(i, *shape):
    return Tensor(i, shape, "float32")


X, W, H = T(0, 8, 4), T(1, 4, 6), T(2, 8, 6)
DOT = Op(10, "dot_general", (X, W), (H,), "m k+, k+ n -> m n")


def _graph(*ops):
    return Graph(tuple(ops), (X, W), tuple(ops[-1].outputs))


def _decide(op, *split):
    return {op.id: OpPlan(op.id, op.primitive, op.module_path, tuple(split))}


def test_a_chain_of_elementwise_ops_follows_the_split():
    a, b = T(3, 8, 6), T(4, 8, 6)
    tanh = Op(11, "tanh", (H,), (a,), "p q -> p q")
    exp = Op(12, "exp", (a,), (b,), "r s -> r s")
    plans = propagate(_graph(DOT, tanh, exp), _decide(DOT, ("data", "m"), ("model", "n")), MESH)
    assert plans[tanh.id].split == (("data", "p"), ("model", "q"))
    assert plans[exp.id].split == (("data", "r"), ("model", "s"))
    # each follower's output has the producer's layout: no relayout between them
    assert op_layouts(exp, plans[exp.id])[1] == op_layouts(DOT, plans[DOT.id])[1]


def test_decided_ops_are_kept_and_a_fully_decided_graph_is_returned_as_is():
    tanh = Op(11, "tanh", (H,), (T(3, 8, 6),), "p q -> p q")
    decided = {**_decide(DOT, ("data", "m")), **_decide(tanh)}
    out = propagate(_graph(DOT, tanh), decided, MESH)
    assert out == decided and out is not decided
    assert out[tanh.id].split == ()  # replicated by decision, not followed


def test_partial_sums_count_as_reduced():
    tanh = Op(11, "tanh", (H,), (T(3, 8, 6),), "p q -> p q")
    plans = propagate(_graph(DOT, tanh), _decide(DOT, ("model", "k")), MESH)
    assert plans[tanh.id].split == ()
    plans = propagate(_graph(DOT, tanh), _decide(DOT, ("model", "k"), ("data", "m")), MESH)
    assert plans[tanh.id].split == (("data", "p"),)


def test_the_first_split_input_wins():
    other = T(5, 8, 6)
    add = Op(11, "add", (other, H), (T(3, 8, 6),), "p q, p q -> p q")
    g = Graph((DOT, add), (X, W, other), add.outputs)
    plans = propagate(g, _decide(DOT, ("model", "n")), MESH)
    assert plans[add.id].split == (("model", "q"),)  # input 0 unknown: input 1 is followed


def test_an_indivisible_follower_stays_replicated():
    # [8, 6] split 4 ways on rows -> reshape to [2, 4, 6]: the leading 2 cannot split 4 ways
    out = T(3, 2, 4, 6)
    reshape = Op(11, "reshape", (H,), (out,), "(a b) c -> a b c")
    plans = propagate(_graph(DOT, reshape), _decide(DOT, ("data", "m")), MESH)
    assert plans[reshape.id].split == ()
    # 2 ways divide it: followed
    plans = propagate(_graph(DOT, reshape), _decide(DOT, ("data", "m")), {"data": 2, "model": 2})
    assert plans[reshape.id].split == (("data", "a"),)


def test_unannotated_ops_and_graph_inputs_replicate():
    custom = Op(11, "custom", (H,), (T(3, 8, 6),), "? -> ?", annotated=False)
    plans = propagate(_graph(DOT, custom), {}, MESH)
    assert all(p.split == () for p in plans.values())
    assert set(plans) == {DOT.id, custom.id}
    assert plans[custom.id].primitive == "custom"


def test_every_op_of_a_traced_scan_gets_a_plan_region_bodies_included():
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(8, name="fc")(x)
            return jax.lax.scan(lambda c, _: (jnp.tanh(c), None), h, None, length=2)[0]

    g = trace(Net(), jax.ShapeDtypeStruct((8, 4), jnp.float32))
    fc = next(op for op in g.ops if op.primitive == "dot_general")
    m = fc.annotation.inputs[0].axes[0].dims[0].name
    plans = propagate(g, _decide(fc, ("data", m)), MESH)
    assert set(plans) == {op.id for op in g.walk()}
    scan = next(op for op in g.ops if op.primitive == "scan")
    assert [a for a, _ in plans[scan.id].split] == ["data"]  # the carry follows the batch split
