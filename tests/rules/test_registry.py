"""The registry: user rules (string, function, decorator), overrides and actionable errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.extend.core import Primitive

from nnscaler_jax.errors import PlanError
from nnscaler_jax.rules import annotate, has_rule, register_rule, registered


def f32(*shape: int) -> jax.core.ShapedArray:
    return jax.core.ShapedArray(shape, jnp.float32)


def test_builtins_are_registered() -> None:
    names = registered()
    for name in ("dot_general", "reduce_sum", "conv_general_dilated", "gather", "scatter-add",
                 "reshape", "broadcast_in_dim", "add", "select_n", "iota", "random_bits"):
        assert name in names and has_rule(name)
    assert not has_rule("no_such_primitive")
    assert annotate("no_such_primitive", {}, [f32(2)], [f32(2)]) is None


def test_user_rule_as_string(user_rules) -> None:
    register_rule("my_matmul", "m k+, k+ n -> m n")
    anno = annotate("my_matmul", {}, [f32(4, 8), f32(8, 3)], [f32(4, 3)])
    assert str(anno) == "m k+, k+ n -> m n"
    assert has_rule("my_matmul") and "my_matmul" in registered()


def test_user_rule_as_function_and_primitive(user_rules) -> None:
    prim = Primitive("my_rowsum")

    @register_rule(prim)
    def _rule(params, in_avals, out_avals):
        return "b d+ -> b" if params["axis"] == 1 else None

    assert str(annotate("my_rowsum", {"axis": 1}, [f32(4, 8)], [f32(4)])) == "b d+ -> b"
    # None: no partitioning possible for these params -> every axis frozen.
    assert str(annotate("my_rowsum", {"axis": 0}, [f32(4, 8)], [f32(8)])) == "r0^ r1^ -> r2^"


def test_user_rule_overrides_builtin(user_rules) -> None:
    register_rule("exp", "a^ -> a^")
    assert str(annotate("exp", {}, [f32(3)], [f32(3)])) == "a^ -> a^"
    with pytest.raises(PlanError, match="already registered"):
        register_rule("exp", "a -> a", override=False)


def test_bad_user_rule_names_primitive_shapes_and_fix(user_rules) -> None:
    register_rule("my_matmul", "m k+, n k+ -> m n")
    with pytest.raises(PlanError) as info:
        annotate("my_matmul", {}, [f32(4, 8), f32(8, 3)], [f32(4, 3)])
    msg = str(info.value)
    assert "'my_matmul'" in msg and "m k+, n k+ -> m n" in msg
    assert "(4, 8), (8, 3)" in msg and "(4, 3)" in msg
    assert "right: register_rule('my_matmul', 'm k+, k+ n -> m n')" in msg


def test_bad_rank_and_syntax(user_rules) -> None:
    register_rule("my_op", lambda p, i, o: "a b -> a b")
    with pytest.raises(PlanError, match="rank"):
        annotate("my_op", {}, [f32(4)], [f32(4)])
    with pytest.raises(PlanError, match="my_bad"):
        register_rule("my_bad", "a b -> a (b")


def test_zero_input_annotation() -> None:
    anno = annotate("iota", {"dimension": 0, "shape": (4, 2), "dtype": jnp.int32, "sharding": None},
                    [], [jax.core.ShapedArray((4, 2), jnp.int32)])
    assert anno.inputs == () and anno.splittable() == ["d1"]
