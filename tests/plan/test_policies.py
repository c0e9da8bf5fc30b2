"""The built-in policies (`plan/policies.py`) on abstract meshes (axis-size dicts): which dims
dp / zero3 / megatron split over which axes, and how variables end up stored."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from nnscaler_jax import trace
from nnscaler_jax.errors import PlanError
from nnscaler_jax.plan.layouts import op_layouts
from nnscaler_jax.plan.policies import dp, megatron, zero3
from nnscaler_jax.primitives import Draft


class Block(nn.Module):
    """LayerNorm -> fc1 (16 -> 32) -> gelu -> fc2 (32 -> 16), residual."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(32, name="fc1")(nn.LayerNorm(name="ln")(x))
        return x + nn.Dense(16, name="fc2")(nn.gelu(h))


def _graph(batch=8):
    return trace(Block(), jax.ShapeDtypeStruct((batch, 16), jnp.float32))


@pytest.fixture(scope="module")
def graph():
    return _graph()


def _run(policy, graph, mesh):
    return policy(Draft(graph, dict(mesh)), None)


def _dot(graph, path):
    return next(op for op in graph.ops if op.primitive == "dot_general" and op.module_path == path)


def _batch_axes(graph, plan, path="fc1"):
    """Mesh axes splitting the rows of the op's first input."""
    op = _dot(graph, path)
    ins, _ = op_layouts(op, plan.op_plan(op.id))
    return ins[0].dims[0]


def test_dp_splits_the_batch_over_every_data_axis(graph):
    plan = _run(dp, graph, {"data": 2, "fsdp": 2, "model": 2})
    assert plan.policy == "dp" and plan.zero == 0
    for op in graph.ops:
        used = {a for a, _ in plan.op_plan(op.id).split}
        assert "model" not in used
    assert _batch_axes(graph, plan) == ("data", "fsdp")
    assert _batch_axes(graph, plan, "fc2") == ("data", "fsdp")
    # weights stay replicated
    assert all(all(e is None for e in spec) for _, spec in plan.variables)


def test_dp_without_data_named_axes_uses_every_axis(graph):
    plan = _run(dp, graph, {"x": 2, "y": 4})
    assert _batch_axes(graph, plan) == ("x", "y")


def test_dp_skips_an_axis_that_does_not_divide_the_batch():
    g = _graph(batch=6)
    plan = _run(dp, g, {"data": 2, "fsdp": 4})
    assert _batch_axes(g, plan) == ("data",)  # 6 rows: 2 ways yes, then 8 ways no


def test_megatron_splits_the_mlp_hidden_column_then_row(graph):
    plan = _run(megatron, graph, {"data": 2, "model": 4})
    assert plan.policy == "megatron"
    fc1, fc2 = _dot(graph, "fc1"), _dot(graph, "fc2")
    (x1, w1), (h,) = op_layouts(fc1, plan.op_plan(fc1.id))
    (h2, w2), (y,) = op_layouts(fc2, plan.op_plan(fc2.id))
    assert w1.dims == ((), ("model",)) and h.dims == (("data",), ("model",))   # column-parallel
    assert w2.dims == (("model",), ()) and h2 == h                             # row-parallel
    assert y.partial == ("model",)  # fc2's output: partial sums over 'model'
    assert x1.dims == (("data",), ())  # the residual stream is not split over 'model'
    stored = dict(plan.variables)
    assert stored["params/fc1/kernel"] == (None, "model")
    assert stored["params/fc2/kernel"] == ("model", None)
    assert stored["params/fc1/bias"] == ("model",)
    assert all(e is None for e in stored["params/fc2/bias"])
    assert all(e is None for e in stored["params/ln/scale"])  # layer norm: residual features


class _NoNormStack(nn.Module):
    """Two residual MLP layers without layer norms: nothing reduces the residual stream."""

    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = x + nn.Dense(16, name=f"fc2_{i}")(nn.gelu(nn.Dense(32, name=f"fc1_{i}")(x)))
        return x


def test_megatron_without_layer_norms_still_splits_the_hidden():
    """The residual stream is a candidate too when no layer norm rules it out; it runs
    through every layer's weights, each layer's hidden through its own: column then row
    parallel, as with the norms (it was row-parallel twice, over the stream)."""
    graph = trace(_NoNormStack(), jax.ShapeDtypeStruct((8, 16), jnp.float32))
    stored = dict(_run(megatron, graph, {"data": 2, "model": 4}).variables)
    for i in range(2):
        assert stored[f"params/fc1_{i}/kernel"] == (None, "model")
        assert stored[f"params/fc2_{i}/kernel"] == ("model", None)
        assert stored[f"params/fc1_{i}/bias"] == ("model",)
        assert all(e is None for e in stored[f"params/fc2_{i}/bias"])


def test_megatron_without_data_axes_splits_only_the_model_axis(graph):
    plan = _run(megatron, graph, {"model": 4})
    assert _batch_axes(graph, plan) == ()
    assert dict(plan.variables)["params/fc1/kernel"] == (None, "model")


def test_megatron_needs_a_model_axis(graph):
    with pytest.raises(PlanError, match="megatron needs a model axis"):
        _run(megatron, graph, {"data": 8})


def test_zero3_is_dp_plus_storage_sharded_over_the_data_axes(graph):
    mesh = {"data": 2, "model": 2}
    plan = _run(zero3, graph, mesh)
    base = _run(dp, graph, mesh)
    assert plan.zero == 3 and plan.policy == "zero3"
    assert [p.split for p in plan.ops] == [p.split for p in base.ops]
    stored = dict(plan.variables)
    for t in graph.variables:
        # the first dim that 'data' divides is split over it; 'model' is not used by dp
        want = [None] * t.ndim
        first = next(i for i, n in enumerate(t.shape) if n % 2 == 0)
        want[first] = "data"
        assert stored[t.name] == tuple(want), t.name


def test_a_policy_name_set_on_the_draft_is_kept(graph):
    draft = Draft(graph, {"data": 2})
    draft.policy = "mine"
    assert dp(draft, None).policy == "mine"
