"""The error hierarchy: PlanError's context fields, its subclasses, pickling, and which
subclass the public API raises (plan JSON, graph/mesh checks, the primitives)."""

from __future__ import annotations

import json
import pickle

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from nnscaler_jax import Draft, Plan, PlanError, errors, op_assign, op_trans, trace
from nnscaler_jax.errors import (
    AnnotationError,
    CheckpointError,
    ConstraintError,
    NoFitError,
    PlanFormatError,
    ShardingError,
)

SUBCLASSES = [AnnotationError, ShardingError, PlanFormatError, ConstraintError, NoFitError,
              CheckpointError]
MESH = {"data": 2, "model": 4}


class TwoDense(nn.Module):
    """``fc1`` (16 -> 8) -> relu -> ``fc2`` (8 -> 4)."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(4, name="fc2")(nn.relu(nn.Dense(8, name="fc1")(x)))


@pytest.fixture(scope="module")
def graph():
    """6 rows: a batch that 4 does not divide."""
    return trace(TwoDense(), jax.ShapeDtypeStruct((6, 16), jnp.float32))


def _fc1(graph):
    return next(op for op in graph.ops if op.primitive == "dot_general"
                and op.module_path == "fc1")


def _batch_dim(op) -> str:
    return op.annotation.inputs[0].axes[0].dims[0].name


# ---- the classes -----------------------------------------------------------------------------

def test_subclasses_are_plan_errors_and_exported():
    for cls in SUBCLASSES:
        assert issubclass(cls, PlanError) and issubclass(cls, ValueError)
        assert cls.__doc__ and "aise" in cls.__doc__  # says when it is raised
        with pytest.raises(PlanError):
            raise cls("boom")
    assert set(errors.__all__) == {"PlanError", *(c.__name__ for c in SUBCLASSES)}
    assert len({*SUBCLASSES}) == 6 and not any(
        issubclass(a, b) for a in SUBCLASSES for b in SUBCLASSES if a is not b)


def test_a_plain_message_is_unchanged_and_fields_default_to_none():
    e = PlanError("no op 'x' in the graph")
    assert str(e) == "no op 'x' in the graph" and e.args == ("no op 'x' in the graph",)
    assert (e.op, e.module_path, e.axis, e.shapes) == (None, None, None, None)


def test_context_fields_are_keyword_only_attributes():
    e = ShardingError("dim 'k' does not divide", op="dot_general", module_path="blk0/mlp/fc1",
                      axis="model", shapes=((8, 16), (16, 64)))
    assert str(e) == "dim 'k' does not divide"
    assert e.op == "dot_general" and e.module_path == "blk0/mlp/fc1" and e.axis == "model"
    assert e.shapes == ((8, 16), (16, 64))
    with pytest.raises(TypeError):
        PlanError("m", "dot_general", op=None, bogus=1)


@pytest.mark.parametrize("cls", [PlanError, *SUBCLASSES])
def test_pickle_round_trip_keeps_type_message_and_fields(cls):
    e = cls("bad thing", op="add", module_path="", axis="data", shapes=((2, 3),))
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is cls and str(back) == "bad thing" and back.args == e.args
    assert (back.op, back.module_path, back.axis, back.shapes) == ("add", "", "data", ((2, 3),))
    plain = pickle.loads(pickle.dumps(cls("just a message")))
    assert str(plain) == "just a message" and plain.op is None


# ---- through the public API ------------------------------------------------------------------

@pytest.mark.parametrize("text", ["{bad", "[]", json.dumps({"format": "other"}), "null"])
def test_from_json_of_a_malformed_plan_is_a_plan_format_error(text):
    with pytest.raises(PlanFormatError, match="plan JSON"):
        Plan.from_json(text)


def test_a_plan_for_another_graph_or_mesh_is_a_plan_format_error(graph):
    plan = Draft(graph, dict(MESH)).finish()
    plan.check_graph(graph, dict(MESH))  # its own graph and mesh: fine
    with pytest.raises(PlanFormatError, match="mesh"):
        plan.check_graph(graph, {"data": 4, "model": 2})
    other = trace(nn.Dense(4), jax.ShapeDtypeStruct((6, 16), jnp.float32))
    with pytest.raises(PlanFormatError, match="another model"):
        plan.check_graph(other, dict(MESH))
    # the same model at another batch size is the same model (sizes are checked on reuse)
    plan.check_graph(trace(TwoDense(), jax.ShapeDtypeStruct((4, 16), jnp.float32)), dict(MESH))


def test_op_trans_of_a_dim_that_does_not_divide_is_a_sharding_error(graph):
    draft = Draft(graph, dict(MESH))
    op = _fc1(graph)
    with pytest.raises(ShardingError, match="size 6 is not divisible by 4") as info:
        op_trans(draft, op, _batch_dim(op), 4)
    e = info.value
    assert isinstance(e, PlanError)
    assert e.op == "dot_general" and e.module_path == "fc1"
    assert e.shapes == ((6, 16), (16, 8))
    assert "dot_general" in str(e) and "fc1" in str(e)  # the message still names them


def test_a_dim_that_a_mesh_axis_does_not_divide_names_the_axis(graph):
    draft = Draft(graph, dict(MESH))
    op = _fc1(graph)
    with pytest.raises(ShardingError, match="not divisible into 4 parts") as info:
        draft.decide(op, {"model": _batch_dim(op)})
    assert (info.value.op, info.value.module_path, info.value.axis) == ("dot_general", "fc1",
                                                                         "model")


def test_unknown_mesh_axis_and_coordinates_outside_the_mesh_name_the_axis(graph):
    draft = Draft(graph, dict(MESH))
    op = _fc1(graph)
    subs = op_trans(draft, op, _batch_dim(op), 2)
    with pytest.raises(ShardingError, match="mesh axis 'pipe' is not in the mesh") as info:
        op_assign(draft, subs, "pipe")
    assert (info.value.op, info.value.module_path, info.value.axis) == ("dot_general", "fc1",
                                                                         "pipe")
    with pytest.raises(ShardingError, match="outside the mesh") as info:
        op_assign(draft, subs[1], {"data": 5})
    assert info.value.axis == "data" and info.value.module_path == "fc1"
    with pytest.raises(ShardingError) as info:
        draft.decide(op, {"pipe": _batch_dim(op)})
    assert info.value.axis == "pipe"


def test_a_placement_spmd_cannot_express_is_a_sharding_error(graph):
    draft = Draft(graph, dict(MESH))
    op = _fc1(graph)
    subs = op_trans(draft, op, _batch_dim(op), 2)
    op_assign(draft, subs[0], {"data": 1})  # sub-op 0 on coordinate 1: not sub-op i on i
    op_assign(draft, subs[1], {"data": 0})
    with pytest.raises(ShardingError, match="not placed along one mesh axis") as info:
        draft.finish()
    assert info.value.op == "dot_general" and info.value.module_path == "fc1"


def test_constraints_that_cannot_be_met_are_constraint_errors_naming_axis_and_op(graph):
    from nnscaler_jax import Constraints, Rule

    with pytest.raises(ConstraintError, match="ZeRO stage"):
        Constraints(zero=5)
    with pytest.raises(ConstraintError, match="mesh axis 'pipe' is not in the mesh") as info:
        Constraints(rules=(Rule(module="fc1", axes=("pipe",)),)).check(graph, dict(MESH))
    assert info.value.axis == "pipe"
    both = (Rule(module="fc*", replicate=True), Rule(module="fc1", axes=("model",)))
    with pytest.raises(ConstraintError, match="contradict") as info:
        Constraints(rules=both).check(graph, dict(MESH))
    assert info.value.module_path == "fc1" and info.value.op is not None
    with pytest.raises(ConstraintError, match="has none of the dims") as info:
        Constraints(rules=(Rule(module="fc1", primitive="dot_general", dims=("zz",)),)).check(
            graph, dict(MESH))
    assert (info.value.op, info.value.module_path) == ("dot_general", "fc1")
    assert info.value.shapes == ((6, 16), (16, 8))
