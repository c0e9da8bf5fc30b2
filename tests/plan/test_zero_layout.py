"""ZeRO-3 storage: the one rule (`plan.zero.zero3_layout`) and its two readings.

`joint=True` is the plan's storage (`zero3_storage`: all data axes as one block, major-most);
`joint=False` prices a plan whose storage was not sharded (each data-parallel axis on its own,
minor-most: `cost.relayout.storage_layout`, the search tables). Both keep today's results.
"""

import itertools
from types import SimpleNamespace

import pytest

from nnscaler_jax.cost.relayout import storage_layout
from nnscaler_jax.layout import Layout
from nnscaler_jax.mesh.topology import DEFAULT_LINK, MeshSpec
from nnscaler_jax.plan.plan import Plan
from nnscaler_jax.plan.zero import state_layout, zero3_layout, zero3_storage

SIZES = {"data": 2, "fsdp": 2, "model": 2}


def _var(name, shape):
    return SimpleNamespace(name=name, shape=shape, ndim=len(shape), id=0)


class _Graph(SimpleNamespace):
    """A graph of one variable and no ops."""


def _storage(spec, shape, axes, sizes=SIZES):
    plan = Plan(mesh=tuple(sizes.items()), fingerprint="f", ops=(),
                variables=(("w", tuple(spec)),) if spec is not None else ())
    graph = _Graph(variables=[_var("w", shape)], consumers={}, walk=lambda: iter(()))
    graph.dataflow = graph  # (analyses memoised per dataflow hold it weakly)
    out = zero3_storage(plan, graph, list(axes))
    assert out.zero == 3
    return dict(out.variables).get("w")


def test_joint_places_the_block_major_on_the_first_dim_it_divides():
    lay = Layout.of(2, {1: "model"})
    got = zero3_layout((2, 8), lay, ("data", "fsdp"), SIZES)
    assert got == Layout(((), ("data", "fsdp", "model")))
    # the plan's spec: only that entry rewritten, the others as written
    assert _storage((None, "model"), (2, 8), ("data", "fsdp")) == (None, ("data", "fsdp", "model"))
    assert _storage(None, (4, 8), ("data", "fsdp")) == (("data", "fsdp"), None)
    assert _storage(None, (2, 8), ("data",)) == ("data", None)


def test_state_layout_adds_the_variables_own_axes_after_the_data_block():
    """A weight whose gradient is also reduced over 'model' (its readers split tokens there):
    the data axes as one block, then 'model' on the first dim it divides, minor-most."""
    lay = Layout.replicated(2)
    got = state_layout((4, 6), lay, ("data", "fsdp"), ("data", "model"), SIZES)
    assert got == Layout((("data", "fsdp"), ("model",)))
    got = state_layout((8, 6), Layout.of(2, {0: "data"}), ("data",), ("model",), SIZES)
    assert got == Layout((("data", "model"), ()))
    assert state_layout((3, 5), lay, ("data",), ("model",), SIZES) == lay  # no dim divides


def test_joint_leaves_a_variable_alone():
    lay = Layout.of(2, {0: "data"})
    assert zero3_layout((4, 8), lay, ("data", "fsdp"), SIZES) is lay  # uses one of the axes
    lay = Layout.replicated(2)
    assert zero3_layout((3, 5), lay, ("data",), SIZES) is lay  # no dim divides
    assert zero3_layout((2, 6), lay, ("data", "fsdp"), SIZES) is lay  # not jointly
    assert zero3_layout((4, 4), lay, ("data",), {"data": 1}) is lay  # one way
    assert _storage(("data", None), (4, 8), ("data", "fsdp")) == ("data", None)


def test_one_by_one_places_each_axis_minor_most():
    lay = Layout.of(2, {1: "model"})
    got = zero3_layout((2, 8), lay, ("data", "fsdp"), SIZES, joint=False)
    assert got == Layout((("data",), ("model", "fsdp")))
    # an axis already used is skipped, the others still placed
    lay = Layout.of(2, {0: "data"})
    assert zero3_layout((4, 8), lay, ("data", "fsdp"), SIZES, joint=False) == \
        Layout((("data", "fsdp"), ()))
    # partial axes count as used
    lay = Layout(((), ()), ("data",))
    assert zero3_layout((4, 8), lay, ("data",), SIZES, joint=False) is lay


@pytest.mark.parametrize("shape", [(2, 8), (6, 4), (3, 4), (8,), (5, 5)])
@pytest.mark.parametrize("split", [None, 0, 1])
def test_readings_agree_on_one_axis_on_an_unsplit_dim(shape, split):
    """The usual data x model mesh: one data axis, the model axis on another dim or nowhere."""
    if split is not None and split >= len(shape):
        pytest.skip("no such dim")
    lay = Layout.of(len(shape), {} if split is None else {split: "model"})
    joint = zero3_layout(shape, lay, ("data",), SIZES)
    single = zero3_layout(shape, lay, ("data",), SIZES, joint=False)
    assert joint.axis_state("data") == single.axis_state("data")  # the same dim, or none
    where = joint.axis_state("data")
    if where == ("R",) or not lay.dims[where[1]]:
        assert joint == single  # only the order within a dim split twice differs


def test_pricing_helpers_are_the_one_by_one_reading():
    mesh = MeshSpec(tuple(SIZES), tuple(SIZES.values()), (DEFAULT_LINK,) * len(SIZES))
    v = _var("w", (4, 8))
    for d0, d1 in itertools.product([(), ("model",)], repeat=2):
        if d0 and d1:
            continue
        lay = Layout((d0, d1))
        for axes in [("data",), ("data", "fsdp"), ("fsdp", "data")]:
            assert storage_layout(mesh, v, lay, axes) == \
                zero3_layout(v.shape, lay, axes, SIZES, joint=False)
