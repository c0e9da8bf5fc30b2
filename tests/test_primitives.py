"""`primitives.py`: op_trans / op_assign / op_order compiled by ``Draft.finish`` into op
decisions: 2-D splits, co-sharding, inherited placements, value splits, storage and order.
(The error messages naming ops are tested in tests/test_errors.py and tests/plan/.)"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from nnscaler_jax import trace
from nnscaler_jax.errors import PlanError, ShardingError
from nnscaler_jax.plan.plan import VALUE
from nnscaler_jax.primitives import Draft, SubOp, op_assign, op_order, op_trans

MESH = {"data": 2, "model": 2}


class TwoDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8, use_bias=False, name="fc1")(x)
        return nn.Dense(4, use_bias=False, name="fc2")(h) * 2.0


@pytest.fixture(scope="module")
def graph():
    return trace(TwoDense(), jax.ShapeDtypeStruct((8, 16), jnp.float32))


@pytest.fixture
def draft(graph):
    return Draft(graph, dict(MESH))


def _ids(op):
    """(rows, contracted, columns) identifiers of a matmul ``m k+, k+ n -> m n``."""
    a = op.annotation
    return (a.inputs[0].axes[0].dims[0].name, a.inputs[0].axes[1].dims[0].name,
            a.outputs[0].axes[1].dims[0].name)


def test_draft_reads_through_to_the_graph(draft, graph):
    assert draft.ops == graph.ops and draft.op("fc1") is graph.op("fc1")


def test_a_split_assigned_along_an_axis(draft, graph):
    fc1 = graph.op("fc1")
    m, _, _ = _ids(fc1)
    subs = op_trans(draft, fc1, m, 2)
    assert [s.splits for s in subs] == [((m, 2, 0),), ((m, 2, 1),)]
    assert str(subs[1]) == f"dot_general@fc1({m}[1/2])"
    op_assign(draft, subs, "data")
    plan = draft.finish()
    assert plan.op_plan(fc1.id).split == (("data", m),) and plan.op_plan(fc1.id).chunks is None


def test_two_dimensional_split_with_inherited_placement(draft, graph):
    fc1 = graph.op("fc1")
    m, _, n = _ids(fc1)
    rows = op_trans(draft, fc1, m, 2)
    op_assign(draft, rows, "data")  # assigned before being split again: children inherit it
    for r in rows:
        op_assign(draft, op_trans(draft, r, n, 2), "model")
    plan = draft.finish()
    assert plan.op_plan(fc1.id).split == (("data", m), ("model", n))
    # the weight is stored the way fc1 reads it
    assert plan.variable_spec("params/fc1/kernel") == (None, "model")


def test_more_sub_ops_than_devices_co_shard(draft, graph):
    fc2 = graph.op("fc2")
    m, _, _ = _ids(fc2)
    op_assign(draft, op_trans(draft, fc2, m, 4), "data")  # 4 pieces, 2 devices: 2 each
    p = draft.finish().op_plan(fc2.id)
    assert p.split == (("data", m),) and p.chunks == (m, 2)


def test_every_sub_op_must_be_assigned(draft, graph):
    fc1 = graph.op("fc1")
    subs = op_trans(draft, fc1, _ids(fc1)[0], 2)
    op_assign(draft, subs[0], {"data": 0})
    with pytest.raises(ShardingError, match="1 of its 2 sub-ops are assigned"):
        draft.finish()


def test_sub_ops_of_one_op_split_the_same_way(draft, graph):
    fc1 = graph.op("fc1")
    m, _, n = _ids(fc1)
    rows = op_trans(draft, fc1, m, 2)
    op_trans(draft, rows[0], n, 2)
    with pytest.raises(ShardingError, match="split the same way"):
        op_trans(draft, rows[1], n, 4)


def test_replicas_assigned_along_an_axis_leave_the_op_replicated(draft, graph):
    fc1 = graph.op("fc1")
    subs = op_trans(draft, fc1, "replicate", 2)
    assert [s.splits for s in subs] == [(("replicate", 2, 0),), (("replicate", 2, 1),)]
    op_assign(draft, subs, "data")
    assert draft.finish().op_plan(fc1.id).split == ()


def test_a_value_split_chain_keeps_its_producer_partial(draft, graph):
    fc2 = graph.op("fc2")
    mul = next(op for op in graph.ops if op.primitive == "mul")
    _, k, _ = _ids(fc2)
    op_assign(draft, op_trans(draft, fc2, k, 2), "model")    # partial sums over 'model'
    op_assign(draft, op_trans(draft, mul, "value", 2), "model")
    plan = draft.finish()
    assert plan.op_plan(mul.id).split == (("model", VALUE),)
    assert plan.op_plan(fc2.id).keep_partial  # the partial sums flow into the chain
    assert not plan.op_plan(graph.op("fc1").id).keep_partial


def test_without_a_value_split_consumer_partial_sums_are_reduced(draft, graph):
    fc2 = graph.op("fc2")
    op_assign(draft, op_trans(draft, fc2, _ids(fc2)[1], 2), "model")
    assert not draft.finish().op_plan(fc2.id).keep_partial


def test_decide_records_a_split_directly(draft, graph):
    fc1 = graph.op("fc1")
    m, k, _ = _ids(fc1)
    draft.decide(fc1, [("data", m), ("model", m)])  # one dim over two axes: 4 ways of 8 rows
    draft.decide(graph.op("fc2"), {"model": VALUE})
    plan = draft.finish()
    assert plan.op_plan(fc1.id).split == (("data", m), ("model", m))
    with pytest.raises(ShardingError, match="cannot co-shard along"):
        draft.decide(fc1, {"data": m}, chunks=(k + "zz", 2))
    draft.decide(fc1, {"data": m}, chunks=(m, 4))  # 8 rows: 2 devices x 4 chunks of 1
    with pytest.raises(ShardingError, match="not divisible into 16 parts"):
        draft.decide(fc1, {"data": m}, chunks=(m, 8))


def test_store_variable_overrides_consumer_storage(draft, graph):
    fc1 = graph.op("fc1")
    draft.decide(fc1, {"model": _ids(fc1)[2]})
    draft.store_variable("params/fc1/kernel", ("data", None))
    plan = draft.finish()
    assert plan.variable_spec("params/fc1/kernel") == ("data", None)
    # fc2, undecided, follows fc1's split columns (its contracted dim): stored as it reads them
    assert plan.variable_spec("params/fc2/kernel") == ("model", None)
    with pytest.raises(PlanError, match="no model variable 'params/nope'"):
        draft.store_variable("params/nope", (None,))


def test_op_order_is_recorded_once_per_call(draft, graph):
    fc1, fc2 = graph.op("fc1"), graph.op("fc2")
    op_order(draft, fc1, fc2)
    op_order(draft, fc1, fc1)  # an op before itself: nothing
    sub = op_trans(draft, fc1, _ids(fc1)[0], 2)[0]
    op_order(draft, sub, fc2)  # sub-ops order their op
    assert draft.finish().order == ((fc1.id, fc2.id), (fc1.id, fc2.id))


def test_primitives_need_a_draft(graph):
    with pytest.raises(PlanError, match="primitives take the draft"):
        op_trans(graph, graph.op("fc1"), "replicate", 2)
    with pytest.raises(PlanError, match="op_assign takes sub-ops"):
        op_assign(Draft(graph, dict(MESH)), [graph.op("fc1")], "data")
    assert isinstance(op_trans(Draft(graph, dict(MESH)), graph.op("fc1"), "replicate", 1)[0],
                      SubOp)
