"""Annotation errors: binding failures name the op, module path, dim and shapes; parse errors
are AnnotationErrors that still underline the bad part."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from nnscaler_jax import PlanError, trace
from nnscaler_jax.errors import AnnotationError, ShardingError
from nnscaler_jax.ir.anno import AnnoSyntaxError, parse_anno

MATMUL = "b m k+, k+ n -> b m n"


class Fc1(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(8, name="fc1")(x)


@pytest.fixture(scope="module")
def dot():
    """The ``dot_general`` of ``fc1``: (6, 16) x (16, 8)."""
    g = trace(Fc1(), jax.ShapeDtypeStruct((6, 16), jnp.float32))
    return next(op for op in g.ops if op.primitive == "dot_general")


def test_bind_mismatch_names_op_module_path_dim_and_shapes():
    anno = parse_anno(MATMUL)
    with pytest.raises(AnnotationError) as info:
        anno.bind([(8, 16, 64), (32, 128)], [(8, 16, 128)], op="dot_general",
                  module_path="blk0/mlp/fc1")
    e, msg = info.value, str(info.value)
    assert isinstance(e, PlanError) and not isinstance(e, ShardingError)
    assert msg.startswith(f"annotation '{MATMUL}' does not bind to op 'dot_general' at "
                          "'blk0/mlp/fc1': dim 'k' is 64 in input 0 and 32 in input 1")
    assert "[(8, 16, 64), (32, 128)]" in msg and "[(8, 16, 128)]" in msg
    assert e.op == "dot_general" and e.module_path == "blk0/mlp/fc1"
    assert e.shapes == ((8, 16, 64), (32, 128), (8, 16, 128))


def test_bind_without_context_says_so_and_leaves_fields_empty():
    with pytest.raises(AnnotationError, match=r"does not bind: dim 'k' is 64") as info:
        parse_anno(MATMUL).bind([(8, 16, 64), (32, 128)], [(8, 16, 128)])
    assert info.value.op is None and info.value.module_path is None
    assert "to op" not in str(info.value)


def test_op_and_module_path_are_keyword_only():
    anno = parse_anno(MATMUL)
    sizes = anno.bind([(2, 3, 4), (4, 5)], [(2, 3, 5)], op="dot_general", module_path="fc1")
    assert sizes == {"b": 2, "m": 3, "k": 4, "n": 5}
    with pytest.raises(TypeError):
        parse_anno(MATMUL).bind([(2, 3, 4), (4, 5)], [(2, 3, 5)], "dot_general")


@pytest.mark.parametrize(("ins", "outs", "what"), [
    ([(2, 3, 4)], [(2, 3, 5)], "it has 2 inputs / 1 outputs but the op has 1 / 1"),
    ([(2, 3), (4, 5)], [(2, 3, 5)], "input 0 'b m k+' has rank 3 but the tensor has shape (2, 3)"),
    ([(2, 3, 4), (4, 5)], [(2, 3, 6)], "dim 'n' is 5 in input 1 and 6 in output 0"),
])
def test_every_bind_failure_is_an_annotation_error_with_context(ins, outs, what):
    with pytest.raises(AnnotationError) as info:
        parse_anno(MATMUL).bind(ins, outs, op="dot_general", module_path="")
    msg = str(info.value)
    assert what in msg, msg
    assert "to op 'dot_general' at '<top>'" in msg  # '' is the top-level module
    assert info.value.module_path == ""


def test_grouped_axis_mismatch_names_the_dims_of_the_group():
    anno = parse_anno("b (h d^), d^ -> b h d^")
    with pytest.raises(AnnotationError, match="needs size") as info:
        anno.bind([(2, 13), (4,)], [(2, 3, 4)], op="reshape", module_path="attn")
    msg = str(info.value)
    assert "input 0 axis '(h d^)' needs size 12 but the tensor has 13" in msg
    assert "'h' is 3 in output 0" in msg and "'d' is 4 in input 1" in msg
    assert "to op 'reshape' at 'attn'" in msg


def test_op_dim_sizes_binds_with_the_ops_context(dot):
    k = dot.annotation.inputs[0].axes[1].dims[0].name
    assert dot.dim_sizes()[k] == 16
    wrong = dataclasses.replace(dot, anno="m k+, n k+ -> m n")  # transposed kernel: 16 vs 8
    with pytest.raises(AnnotationError) as info:
        wrong.dim_sizes()
    e = info.value
    assert (e.op, e.module_path) == ("dot_general", "fc1")
    assert "does not bind to op 'dot_general' at 'fc1'" in str(e)
    assert "dim 'k' is 16 in input 0 and 8 in input 1" in str(e)
    assert "(6, 16), (16, 8)" in str(e)


def test_parse_error_is_an_annotation_error_and_a_plan_error():
    with pytest.raises(AnnotationError) as info:
        parse_anno("a (b c -> a")
    e = info.value
    assert isinstance(e, AnnoSyntaxError) and isinstance(e, PlanError)
    lines = str(e).splitlines()
    assert lines[1] == "  a (b c -> a" and lines[2] == "       ^"  # still underlines 'c'
    with pytest.raises(PlanError, match="exactly one '->'"):
        parse_anno("a b")


def test_a_bad_annotation_on_an_op_names_the_op_and_keeps_the_underline(dot):
    bad = dataclasses.replace(dot, anno="m k+, k n -> m n")
    with pytest.raises(AnnotationError) as info:
        bad.annotation  # noqa: B018 - the property parses
    e = info.value
    assert isinstance(e, AnnoSyntaxError)
    assert (e.op, e.module_path) == ("dot_general", "fc1")
    msg = str(e)
    assert msg.startswith(f"op {dot.id} 'dot_general' at 'fc1': bad annotation: dim 'k'")
    lines = msg.splitlines()
    caret = next(i for i, line in enumerate(lines) if set(line.strip()) == {"^"})
    assert lines[caret - 1] == "  m k+, k n -> m n"
    assert lines[caret] == "  " + " " * len("m k+, ") + "^"
