"""`lower/replay.py`: the replayed program's structure, traced abstractly (``make_jaxpr``; nothing
compiled): one sharding constraint per operand as the plan lays it out, partial sums resolved to
what their consumer reads (their gradients carried back to the op's layout), remat and
custom-derivative calls kept whole, input and output shardings, and Explicit meshes seen through
an Auto view. (Numerical equivalence of replayed programs: tests/test_auto_parallel.py.)"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from meshes import make_mesh

from nnscaler_jax import trace
from nnscaler_jax.ir.graph import Role
from nnscaler_jax.lower.replay import Lowering, auto_view, explicitly_typed, is_explicit
from nnscaler_jax.primitives import Draft

AXES = {"data": 2, "model": 4}


class Net(nn.Module):
    """remat(fc1) -> fc2 -> relu (a custom_jvp call)."""

    @nn.compact
    def __call__(self, x):
        h = nn.remat(nn.Dense)(8, use_bias=False, name="fc1")(x)
        return jax.nn.relu(nn.Dense(4, use_bias=False, name="fc2")(h))


@pytest.fixture(scope="module")
def graph():
    return trace(Net(), jax.ShapeDtypeStruct((8, 16), jnp.float32))


@pytest.fixture(scope="module")
def mesh():
    return make_mesh((2, 4), ("data", "model"))


def _lowering(graph, mesh, relu_split=None):
    d = Draft(graph, dict(AXES))
    d.decide(graph.op("fc1"), {"data": "m0", "model": "n0"})   # column-parallel
    d.decide(graph.op("fc2"), {"data": "m0", "model": "k0"})   # row-parallel: partial sums
    if relu_split is not None:
        d.decide(next(op for op in graph.ops if op.primitive == "max"), relu_split)
    return Lowering(graph, d.finish(), mesh)


def _jaxpr(low):
    return jax.make_jaxpr(low)(*(jax.ShapeDtypeStruct(t.shape, t.dtype)
                                 for t in low.graph.inputs)).jaxpr


def _eqns(jaxpr, inside=True):
    """Top-level equations, then (``inside``) those of sub-jaxprs, depth first."""
    for e in jaxpr.eqns:
        yield e
        if not inside:
            continue
        for v in e.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                j = getattr(sub, "jaxpr", sub)
                if hasattr(j, "eqns"):
                    yield from _eqns(j)


def _spec_of(eqn):
    return eqn.params["sharding"].spec


def test_the_replay_runs_the_graphs_ops_between_constraints(graph, mesh):
    j = _jaxpr(_lowering(graph, mesh))
    prims = [e.primitive.name for e in _eqns(j) if e.primitive.name != "sharding_constraint"]
    assert prims.count("dot_general") == 2 and prims.count("max") == 1
    top = [e.primitive.name for e in _eqns(j, inside=False)]
    assert ("checkpoint" in top or "remat2" in top) and "custom_jvp_call" in top
    # every matmul operand and result is constrained to its layout
    for e in _eqns(j):
        if e.primitive.name == "dot_general":
            for v in e.invars:
                assert any(c.primitive.name == "sharding_constraint" and v in c.outvars
                           for c in _eqns(j))


def test_operands_are_constrained_as_the_plan_lays_them_out(graph, mesh):
    j = _jaxpr(_lowering(graph, mesh))
    dots = [e for e in _eqns(j) if e.primitive.name == "dot_general"]
    producer = {v: e for e in _eqns(j) for v in e.outvars}
    specs = [[_spec_of(producer[v]) for v in e.invars] for e in dots]
    assert specs == [[P("data"), P(None, "model")],         # fc1: rows, then weight columns
                     [P("data", "model"), P("model")]]      # fc2: h column-split, weight rows


def _relu_call(jaxpr):
    """The top-level custom_jvp call of ``jax.nn.relu`` (others: the lowering's relayouts)."""
    (call,) = [e for e in _eqns(jaxpr, inside=False) if e.primitive.name == "custom_jvp_call"
               and any(x.primitive.name == "max" for x in _eqns(e.params["call_jaxpr"].jaxpr))]
    return call


def test_partial_sums_are_constrained_to_what_the_consumer_reads(graph, mesh):
    # relu follows fc2's rows only: the partial sums over 'model' are all-reduced (R)
    j = _jaxpr(_lowering(graph, mesh))
    call = _relu_call(j)
    producer = {v: e for e in _eqns(j, inside=False) for v in e.outvars}
    assert _spec_of(producer[call.invars[0]]) == P("data")
    # relu splitting its columns over 'model': reduce-scattered into that split
    j = _jaxpr(_lowering(graph, mesh, relu_split={"data": "d0", "model": "d1"}))
    call = _relu_call(j)
    producer = {v: e for e in _eqns(j, inside=False) for v in e.outvars}
    assert _spec_of(producer[call.invars[0]]) == P("data", "model")


@pytest.mark.parametrize("relu_split", [None, {"data": "d0", "model": "d1"}])
def test_the_gradient_of_partial_sums_reaches_the_transpose_as_the_op_made_them(mesh,
                                                                                relu_split):
    """fc2's transpose reads its output's gradient in fc2's layout without the partial sums
    (rows over 'data', replicated over 'model'), not where the sums were reduced to."""
    graph = trace(Net(), jax.ShapeDtypeStruct((16, 16), jnp.float32))  # output (16, 4), not
    low = _lowering(graph, mesh, relu_split)                             # fc2's kernel's shape
    args = [jnp.ones(t.shape, t.dtype) for t in low.graph.inputs]
    out = graph.op("fc2").outputs[0]
    j = jax.make_jaxpr(lambda *a: jax.vjp(lambda *b: low(*b)[0], *a)[1](
        jnp.ones(out.shape, out.dtype)))(*args).jaxpr
    producer = {v: e for e in _eqns(j) for v in e.outvars}
    reads = [producer.get(v) for e in _eqns(j) if e.primitive.name == "dot_general"
             for v in e.invars if tuple(v.aval.shape) == out.shape]
    assert len(reads) == 2  # fc2's transposes: the gradients of h and of fc2's kernel
    assert all(e is not None and e.primitive.name == "sharding_constraint" and
               _spec_of(e) == P("data") for e in reads)


def test_input_and_output_shardings(graph, mesh):
    low = _lowering(graph, mesh)
    assert not is_explicit(low.mesh)  # jax.make_mesh's default Explicit axes: an Auto view
    by_name = {t.name: s.spec for t, s in zip(graph.inputs, low.input_shardings())}
    assert by_name == {"params/fc1/kernel": P(None, "model"),   # stored as its reader reads it
                       "params/fc2/kernel": P("model"),
                       "args/0": P("data")}                     # the first consumer's layout
    assert all(isinstance(s, NamedSharding) and s.mesh.axis_names == ("data", "model")
               for s in low.input_shardings())
    assert low.output_specs() == [P("data")]
    x = next(t for t in graph.inputs if t.role is Role.INPUT)
    assert low.input_layout(x).partial == ()
    assert low.consumers(x.id) == [graph.op("fc1").id]
    assert low.is_output(graph.outputs[0].id) and not low.is_output(x.id)


def test_explicit_meshes_are_replayed_on_an_auto_view():
    auto = make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    explicit = make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    assert not is_explicit(auto) and is_explicit(explicit)
    assert auto_view(auto) is auto
    view = auto_view(explicit)
    assert not is_explicit(view) and view.axis_names == explicit.axis_names
    assert (view.devices == explicit.devices).all()
    assert not is_explicit({"data": 2})  # anything without axis types


def test_explicitly_typed_arrays():
    explicit = make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    auto = make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    assert not explicitly_typed(np.ones(4)) and not explicitly_typed("x")
    assert not explicitly_typed(jax.device_put(jnp.ones(8), NamedSharding(auto, P("data"))))
    assert explicitly_typed(jax.device_put(jnp.ones(8), NamedSharding(explicit, P("data"))))
