"""`constraints.py`: Rule matching and printing, Constraints validation, and the pipeline fields
checked against the mesh (rule errors against a graph are in tests/test_errors.py)."""

from __future__ import annotations

from types import SimpleNamespace

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from nnscaler_jax import trace
from nnscaler_jax.constraints import Constraints, Rule
from nnscaler_jax.errors import ConstraintError


def _op(primitive, path):
    return SimpleNamespace(primitive=primitive, module_path=path)


@pytest.mark.parametrize(("rule", "op", "hit"), [
    (Rule(), _op("add", ""), True),
    (Rule(module="blk*/mlp/*"), _op("dot_general", "blk0/mlp/fc1"), True),
    (Rule(module="blk*/mlp/*"), _op("dot_general", "blk0/attn/q"), False),
    (Rule(module="fc1"), _op("dot_general", "fc1"), True),
    (Rule(module="fc1"), _op("dot_general", "fc10"), False),   # a glob, not a prefix
    (Rule(module="FC1"), _op("dot_general", "fc1"), False),    # case-sensitive
    (Rule(primitive="dot_general"), _op("dot_general", "x"), True),
    (Rule(primitive="dot_general", module="x"), _op("add", "x"), False),
    (Rule(module="*"), _op("add", ""), True),
])
def test_rule_matches(rule, op, hit):
    assert rule.matches(op) is hit


def test_rule_prints_only_what_it_sets():
    assert str(Rule()) == "Rule()"
    assert str(Rule(module="fc*", dims=("m",), replicate=True)) == \
        "Rule(module='fc*', dims=('m',), replicate=True)"


@pytest.mark.parametrize(("kw", "what"), [
    ({"zero": 4}, "ZeRO stage"),
    ({"schedule": "dualpipe"}, "schedule"),
    ({"max_memory_per_device": 0}, "positive byte count"),
    ({"rules": ("fc1",)}, "takes Rule values"),
    ({"microbatches": 0}, "positive int"),  # refused when given, pipelined or not
    ({"pipeline_stages": 0}, "positive int or 'auto'"),
])
def test_bad_fields(kw, what):
    with pytest.raises(ConstraintError, match=what):
        Constraints(**kw)


def test_fields_are_normalised_to_tuples():
    c = Constraints(rules=[Rule(module="a")], logical_rules=[["embed", "model"], ("batch", None)])
    assert c.rules == (Rule(module="a"),)
    assert c.logical_rules == (("embed", "model"), ("batch", None))
    hash(c.rules), hash(c.logical_rules)  # frozen values
    for zero in (0, 1, 2, 3, None):
        Constraints(zero=zero)


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="fc2")(nn.relu(nn.Dense(8, name="fc1")(x)))


@pytest.fixture(scope="module")
def graph():
    return trace(_Net(), jax.ShapeDtypeStruct((4, 16), jnp.float32))


def test_rules_that_can_be_met_pass(graph):
    Constraints(rules=(Rule(module="fc1", primitive="dot_general", axes=("model",)),
                       Rule(module="fc1", primitive="dot_general", dims=("zz", "m0")),
                       Rule(module="fc2", replicate=True),  # no rule splitting fc2
                       Rule(module="fc1", axes=("data", "model")))).check(  # shares 'model'
        graph, {"data": 2, "model": 2})


def test_a_rule_matching_no_op_lists_module_paths(graph):
    with pytest.raises(ConstraintError, match=r"matches no op; module paths include .*fc1"):
        Constraints(rules=(Rule(module="blk*"),)).check(graph, {"data": 2})


MESH = {"stage": 4, "data": 2}


@pytest.mark.parametrize("kw", [
    {"pipeline_stages": None},
    {"pipeline_stages": 1},
    {"pipeline_stages": 4, "microbatches": 8, "schedule": "1f1b"},
    {"pipeline_stages": "auto"},
])
def test_pipeline_fields_that_fit_the_mesh(graph, kw):
    Constraints(**kw).check(graph, MESH)


def test_pipe_is_a_stage_axis_too(graph):
    Constraints(pipeline_stages=2).check(graph, {"data": 4, "pipe": 2})


@pytest.mark.parametrize(("kw", "mesh", "what"), [
    ({"pipeline_stages": 2}, MESH, r"mesh axis 'stage' \(or 'pipe'\) of size 2"),
    ({"pipeline_stages": 4}, {"data": 8}, "of size 4"),
    ({"pipeline_stages": 4, "microbatches": 0}, MESH, "microbatches=0"),
    ({"pipeline_stages": "auto"}, {"data": 8}, r"'auto'\) chooses micro-batches"),
    ({"pipeline_stages": 0}, MESH, "positive int or 'auto'"),
    ({"pipeline_stages": "four"}, MESH, "positive int or 'auto'"),
])
def test_pipeline_fields_that_do_not(graph, kw, mesh, what):
    with pytest.raises(ConstraintError, match=what):
        Constraints(**kw).check(graph, mesh)


@pytest.mark.parametrize("text, want", [("32GiB", 32 * 2**30), ("80 GB", 80 * 10**9),
                                        ("1.5MiB", int(1.5 * 2**20)), ("4096", 4096),
                                        (4096, 4096), (1e9, 10**9)])
def test_memory_budget_takes_byte_counts_and_size_strings(text, want):
    assert Constraints(max_memory_per_device=text).max_memory_per_device == want


@pytest.mark.parametrize("bad", ["1 GiBs", "lots", "-3GB", "0", 0, -1, True, [1]])
def test_a_bad_memory_budget_is_a_constraint_error_naming_the_units(bad):
    with pytest.raises(ConstraintError, match="GiB"):
        Constraints(max_memory_per_device=bad)
