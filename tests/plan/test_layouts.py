"""`plan/layouts.py`: the RVD layout of every operand under an op's partition, its inverse
(`split_for_layout`), and how a scan reads the stacked weights of its body."""

from __future__ import annotations

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from nnscaler_jax import trace
from nnscaler_jax.ir.graph import Op, Role, Tensor
from nnscaler_jax.layout import Layout
from nnscaler_jax.plan.layouts import (
    lift,
    op_layouts,
    plan_layouts,
    scan_read_layouts,
    scan_stored_inputs,
    sole_read_variables,
    split_for_layout,
    unstack,
)
from nnscaler_jax.plan.plan import VALUE, OpPlan

X, W, Y = Tensor(0, (8, 4), "float32"), Tensor(1, (4, 6), "float32"), Tensor(2, (8, 6), "float32")
DOT = Op(3, "dot_general", (X, W), (Y,), "m k+, k+ n -> m n")


def _plan(*split):
    return OpPlan(DOT.id, DOT.primitive, "", tuple(split))


def test_no_plan_is_replicated():
    ins, outs = op_layouts(DOT, None)
    assert ins == (Layout.replicated(2), Layout.replicated(2)) and outs == (Layout.replicated(2),)


def test_a_spatial_split_shards_every_operand_holding_the_dim():
    ins, outs = op_layouts(DOT, _plan(("data", "m")))
    assert ins == (Layout.of(2, {0: "data"}), Layout.replicated(2))
    assert outs == (Layout.of(2, {0: "data"}),)


def test_a_reduction_split_leaves_partial_sums():
    ins, outs = op_layouts(DOT, _plan(("model", "k")))
    assert ins == (Layout.of(2, {1: "model"}), Layout.of(2, {0: "model"}))
    assert outs == (Layout.of(2, partial=("model",)),)


def test_two_axes_on_one_dim_and_two_dims():
    ins, outs = op_layouts(DOT, _plan(("data", "m"), ("fsdp", "m"), ("model", "n")))
    assert ins[0] == Layout.of(2, {0: ("data", "fsdp")})
    assert ins[1] == Layout.of(2, {1: "model"})
    assert outs[0] == Layout.of(2, {0: ("data", "fsdp"), 1: "model"})


def test_a_value_split_makes_outputs_partial_only():
    ins, outs = op_layouts(DOT, _plan(("model", VALUE)))
    assert ins == (Layout.replicated(2),) * 2 and outs == (Layout.of(2, partial=("model",)),)


def test_a_replicate_only_operand_stays_replicated():
    op = Op(4, "custom", (X,), (Y,), "? -> ?")
    assert op_layouts(op, OpPlan(4, "custom", "", (("data", "m"),))) == (
        (Layout.replicated(2),), (Layout.replicated(2),))


SPLITS = [(), (("data", "m"),), (("model", "n"),), (("data", "m"), ("model", "n")),
          (("data", "n"), ("model", "m")), (("data", "m"), ("model", "m"))]


@pytest.mark.parametrize("split", SPLITS)
def test_split_for_layout_inverts_op_layouts(split):
    """The partition found for one operand's layout gives that operand that layout."""
    ins, outs = op_layouts(DOT, _plan(*split))
    for k, lay in enumerate(ins + outs):
        found = split_for_layout(DOT, k, lay)
        assert found is not None
        assert (op_layouts(DOT, _plan(*found))[0] + op_layouts(DOT, _plan(*found))[1])[k] == lay


def test_split_for_layout_refuses_frozen_and_grouped_dims():
    frozen = Op(5, "cumsum", (Y,), (Y,), "a b^ -> a b^")
    assert split_for_layout(frozen, 0, Layout.of(2, {1: "data"})) is None
    assert split_for_layout(frozen, 0, Layout.of(2, {0: "data"})) == (("data", "a"),)
    grouped = Op(6, "reshape", (Tensor(7, (12,), "float32"),), (Tensor(8, (3, 4), "float32"),),
                 "(h d) -> h d")
    assert split_for_layout(grouped, 1, Layout.of(2, {0: "model"})) == (("model", "h"),)
    assert split_for_layout(grouped, 0, Layout.of(1, {0: "model"})) == (("model", "h"),)
    unknown = Op(9, "custom", (X,), (Y,), "? -> ?")
    assert split_for_layout(unknown, 0, Layout.replicated(2)) == ()
    assert split_for_layout(unknown, 0, Layout.of(2, {0: "data"})) is None


@pytest.mark.parametrize(("stacked", "lay"), itertools.product(
    [False, True], [Layout.replicated(2), Layout.of(2, {1: "model"}),
                    Layout.of(2, {0: ("data", "model")})]))
def test_lift_and_unstack_are_inverse(stacked, lay):
    up = lift(lay, stacked)
    assert up.ndim == lay.ndim + stacked
    if stacked:
        assert up.dims[0] == ()  # the layer axis is never split
    assert unstack(up, stacked) == lay
    # a read is never partial: lifting drops partial sums
    assert lift(Layout(lay.dims, ("fsdp",)), stacked) == up


class _Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
        class Cell(nn.Module):
            @nn.compact
            def __call__(self, c, _):
                return nn.Dense(c.shape[-1], use_bias=False, name="fc")(c), None

        scan = nn.scan(Cell, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        return nn.Dense(8, name="head")(scan(name="layers")(x, None)[0])


@pytest.fixture(scope="module")
def stack():
    g = trace(_Stack(), jax.ShapeDtypeStruct((4, 8), jnp.float32))
    (scan,) = [op for op in g.ops if op.primitive == "scan"]
    return g, scan


def test_sole_read_variables(stack):
    g, scan = stack
    sole = sole_read_variables(g)
    assert sole == frozenset(t.id for t in g.variables)  # each weight has one reader
    kernel = next(t for t in g.variables if "layers" in t.name)
    assert g.consumers[kernel.id] == (scan,)


def test_scan_stores_its_stacked_weight_as_the_body_reads_a_block(stack):
    g, scan = stack
    sole = sole_read_variables(g)
    (body,) = scan.regions
    dot = next(op for op in body.ops if op.primitive == "dot_general")
    stored = scan_stored_inputs(scan, sole)
    (k,) = stored
    assert scan.inputs[k].shape == (3, 8, 8) and stored[k] == (dot, 1, True)
    assert scan_stored_inputs(scan, frozenset()) == {}  # not solely read: not stored so
    assert scan_stored_inputs(dot, sole) == {}          # not a scan

    n = dot.annotation.outputs[0].axes[1].dims[0].name
    plans = {dot.id: OpPlan(dot.id, dot.primitive, "", (("model", n),))}
    reads = scan_read_layouts(scan, plans, sole)
    assert reads == {k: Layout.of(3, {2: "model"})}
    ins, _ = plan_layouts(scan, plans, sole)
    assert ins[k] == reads[k]
    # without the sole-reader set, the scan reads its operands as its own (empty) plan says
    assert plan_layouts(scan, plans)[0][k] == Layout.replicated(3)
    # other ops: plan_layouts is op_layouts
    head = next(op for op in g.ops if op.module_path == "head" and op.primitive == "dot_general")
    assert plan_layouts(head, plans, sole) == op_layouts(head, None)
    assert scan.inputs[k].role is Role.VARIABLE
