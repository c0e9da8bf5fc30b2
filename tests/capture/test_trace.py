"""`capture/trace.py`: capture's errors, the missing-rule warning, linen ``method=`` and keyword
args, the out tree, and the model-zoo helpers (abstract inputs, rng streams, capture_spec)."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import models
from nnscaler_jax.capture.trace import (
    abstract_init,
    capture,
    capture_spec,
    spec_inputs,
    spec_rngs,
    trace,
    warn_unannotated,
)
from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.graph import Role

X = jax.ShapeDtypeStruct((2, 8), jnp.float32)


class _Coder(nn.Module):
    """Two methods and an optional keyword array."""

    def setup(self):
        self.enc = nn.Dense(4)
        self.dec = nn.Dense(8)

    def __call__(self, x, *, scale=None):
        y = self.dec(self.enc(x))
        return {"y": y} if scale is None else {"y": y * scale, "s": scale.sum()}

    def encode(self, x):
        return self.enc(x)


def _dots(graph):
    return [op for op in graph.walk() if op.primitive == "dot_general"]


def test_keyword_args_reach_the_module_and_the_out_tree_follows():
    one = capture(_Coder(), X)
    two = capture(_Coder(), X, scale=jax.ShapeDtypeStruct((8,), jnp.float32))
    assert len(two.graph.inputs) == len(one.graph.inputs) + 1
    scale = two.graph.inputs[-1]
    assert (scale.role, scale.name, scale.shape) == (Role.INPUT, "kwargs/scale", (8,))
    assert {op.primitive for op in two.graph.ops if scale in op.inputs} >= {"reduce_sum"}
    out = jax.tree_util.tree_unflatten(two.out_tree, two.graph.outputs)
    assert set(out) == {"y", "s"} and out["y"].shape == (2, 8) and out["s"].shape == ()
    assert set(jax.tree_util.tree_unflatten(one.out_tree, one.graph.outputs)) == {"y"}


def test_method_traces_another_method():
    g = trace(_Coder(), X, method="encode")
    (dot,) = _dots(g)
    assert dot.module_path == "enc" and g.outputs[0].shape == (2, 4)
    # abstract init of the default method created both layers' variables anyway
    assert {t.name for t in g.variables} >= {"params/enc/kernel", "params/dec/kernel"}


def test_abstract_init_allocates_nothing():
    v = abstract_init(nn.Dense(3), (X,), {})
    leaves = jax.tree_util.tree_leaves(v)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert v["params"]["kernel"].shape == (8, 3)


def test_errors_name_the_module_and_the_shapes():
    with pytest.raises(PlanError, match="cannot trace a function"):
        capture(lambda x: x, X)
    with pytest.raises(PlanError, match=r"Dense.init failed on the example args .*\(2, 8\)"):
        abstract_init(nn.Dense(3), (jnp.ones((2, 8)), jnp.ones(3)), {})  # too many args
    wrong = jax.eval_shape(lambda: nn.Dense(3).init(jax.random.key(0), jnp.ones((2, 5))))
    with pytest.raises(PlanError, match=r"tracing Dense on args .*\(2, 8\).* failed"):
        capture(nn.Dense(3), X, variables=wrong)  # kernel (5, 3) against 8 features


def test_no_warning_without_missing_rules():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_unannotated({}, "m")
        trace(nn.Dense(3), X)


def test_missing_rule_warning_lists_primitives_paths_and_a_fix():
    missing = {"zeta": {f"blk{i}" for i in range(7)}, "alpha": {""}}
    with pytest.warns(UserWarning) as rec:
        warn_unannotated(missing, "trace(Net)")
    (w,) = rec
    text = str(w.message)
    assert text.startswith("trace(Net): no annotation rule")
    assert "'alpha' at <top>" in text
    # at most 5 paths per primitive, sorted, then how many more
    assert "'zeta' at blk0, blk1, blk2, blk3, blk4 and 2 more" in text
    assert "register_rule('alpha'" in text  # the example names the first primitive
    assert text.index("'alpha'") < text.index("'zeta'")


def test_spec_inputs_are_abstract():
    spec = models.get("mlp", "tiny")
    args, variables = spec_inputs(spec)
    assert [a.shape for a in args] == [a.shape for a in spec.make_args()]
    assert all(isinstance(x, jax.ShapeDtypeStruct)
               for x in jax.tree_util.tree_leaves((args, variables)))
    _, none = spec_inputs(models.get("mlp_nnx", "tiny"))
    assert none is None  # nnx modules hold their own variables


def test_spec_rngs_one_key_per_stream():
    assert spec_rngs(models.get("mlp", "tiny")) is None
    spec = models.get("gpt", "tiny-dropout")
    rngs = spec_rngs(spec)
    assert list(rngs) == list(spec.rng_streams) == ["dropout"]
    assert rngs["dropout"].shape == (2,)  # a raw PRNGKey
    assert (spec_rngs(spec)["dropout"] == rngs["dropout"]).all()  # fixed, not fresh


def test_capture_spec_matches_capture_on_concrete_args():
    spec = models.get("mlp", "tiny")
    abstract = capture_spec(spec)
    concrete = capture(spec.module, *spec.make_args())
    assert str(abstract.graph) == str(concrete.graph)
    nnx_graph = capture_spec(models.get("mlp_nnx", "tiny")).graph
    assert [op.module_path for op in _dots(nnx_graph)] == ["fc1", "fc2"]


def test_capture_spec_passes_rng_keys_as_rng_inputs():
    g = capture_spec(models.get("gpt", "tiny-dropout")).graph
    assert [t.name for t in g.inputs if t.role is Role.RNG] == ["rngs/dropout"]
