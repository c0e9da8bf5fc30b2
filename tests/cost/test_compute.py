"""`cost/compute.py`: FLOPs and bytes of ops from shapes (closed forms derived by hand), free
layout ops, region multiplicities, and which tensors need gradients."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from nnscaler_jax import trace
from nnscaler_jax.cost.compute import (
    compute_dtype,
    grad_sources,
    grad_tensors,
    is_float,
    itemsize,
    needs_grad_locally,
    op_bytes,
    op_flops,
    region_length,
    walk_weighted,
)
from nnscaler_jax.ir.graph import Op, Role, Tensor


def T(i, shape, dtype="float32", role=Role.VALUE):
    return Tensor(i, shape, dtype, role)


def test_batched_matmul_flops_count_every_identifier_once():
    # b q h d+, b k h d+ -> b h q k: 2 x b x q x k x h x d multiply-adds
    q, k = T(0, (2, 5, 3, 4)), T(1, (2, 7, 3, 4))
    out = T(2, (2, 3, 5, 7))
    op = Op(3, "dot_general", (q, k), (out,), "b q h d+, b k h d+ -> b h q k")
    assert op_flops(op) == 2 * 2 * 5 * 7 * 3 * 4


def test_elementwise_flops_and_bytes():
    x, y = T(0, (4, 6)), T(1, (4, 6), "bfloat16")
    op = Op(2, "add", (x, x), (y,), "a b, a b -> a b")
    assert op_flops(op) == 24                      # one per output element
    assert op_bytes(op) == 24 * 4 * 2 + 24 * 2     # two float32 reads, one bfloat16 write


@pytest.mark.parametrize("prim", ["reshape", "squeeze", "expand_dims", "broadcast_in_dim"])
def test_layout_ops_are_free(prim):
    op = Op(2, prim, (T(0, (4, 6)),), (T(1, (24,)),), "(a b) -> (a b)")
    assert op_flops(op) == 0.0 and op_bytes(op) == 0.0


def test_an_unannotated_matmul_is_priced_like_an_elementwise_op():
    op = Op(2, "dot_general", (T(0, (8, 16)), T(1, (16, 4))), (T(3, (8, 4)),), "?, ? -> ?",
            annotated=False)
    assert op_flops(op) == 32


def test_itemsize_and_float_detection():
    assert itemsize(T(0, (), "bfloat16")) == 2 and itemsize(T(0, (), "key<fry>")) == 8
    assert is_float(T(0, (), "float16")) and is_float(T(0, (), "complex64"))
    assert not is_float(T(0, (), "int32")) and not is_float(T(0, (), "key<fry>"))


def test_compute_dtype_is_a_matmul_operand_or_the_first_output():
    mm = Op(2, "dot_general", (T(0, (2, 2), "bfloat16"), T(1, (2, 2), "bfloat16")),
            (T(3, (2, 2)),), "m k+, k+ n -> m n")
    assert compute_dtype(mm) == "bfloat16"
    cast = Op(4, "convert_element_type", (T(0, (2,), "float32"),), (T(1, (2,), "bfloat16"),),
              "a -> a")
    assert compute_dtype(cast) == "bfloat16"


def test_needs_grad_locally():
    assert needs_grad_locally(T(0, (2,), role=Role.VARIABLE), False)
    assert needs_grad_locally(T(0, (2,)), False)
    assert not needs_grad_locally(T(0, (2,), role=Role.INPUT), False)
    assert needs_grad_locally(T(0, (2,), role=Role.INPUT), True)
    assert not needs_grad_locally(T(0, (2,), role=Role.CONST), True)
    assert not needs_grad_locally(T(0, (2,), "int32", role=Role.VARIABLE), True)


class _Scan(nn.Module):
    """Dense(8 -> 8) scanned 3 times, then Dense(8 -> 2)."""

    @nn.compact
    def __call__(self, x):
        class Cell(nn.Module):
            @nn.compact
            def __call__(self, c, _):
                return nn.Dense(8, use_bias=False)(c), None

        scan = nn.scan(Cell, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)
        return nn.Dense(2, use_bias=False, name="head")(scan(name="s")(x, None)[0])


@pytest.fixture(scope="module")
def scan_graph():
    return trace(_Scan(), jax.ShapeDtypeStruct((4, 8), jnp.float32))


def test_a_scan_runs_its_body_length_times(scan_graph):
    (scan,) = [op for op in scan_graph.ops if op.primitive == "scan"]
    assert region_length(scan) == 3
    body_dot = 2 * 4 * 8 * 8  # [4, 8] @ [8, 8]
    assert op_flops(scan) == pytest.approx(3 * sum(op_flops(o) for o in scan.regions[0].ops))
    assert op_flops(scan) >= 3 * body_dot
    assert op_bytes(scan) == pytest.approx(3 * sum(op_bytes(o) for o in scan.regions[0].ops))
    weights = dict(walk_weighted(scan_graph))
    assert weights[scan] == 1
    assert all(weights[o] == 3 for o in scan.regions[0].walk())
    assert sum(1 for _ in walk_weighted(scan_graph)) == sum(1 for _ in scan_graph.walk())


def test_gradients_flow_from_trainable_variables_and_optionally_inputs():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, ids):
            e = nn.Embed(10, 8, name="emb")(ids)  # integer ids carry no gradient
            return nn.Dense(8, name="fc")(x) + e.sum(0)

    g = trace(Net(), jax.ShapeDtypeStruct((3, 8), jnp.float32),
              jax.ShapeDtypeStruct((3,), jnp.int32))
    src = grad_sources(g)
    x, ids = [t for t in g.inputs if t.role is Role.INPUT]
    assert src[x.id] == 2 and ids.id not in src
    for v in g.variables:
        assert src[v.id] == 1
    out = g.outputs[0]
    assert src[out.id] == 3  # computed from both
    only_weights = grad_tensors(g)
    with_inputs = grad_tensors(g, input_grads=True)
    assert x.id not in only_weights and x.id in with_inputs and out.id in only_weights
    assert only_weights < with_inputs
    assert grad_tensors(g, sources=src) == only_weights
    dot = next(op for op in g.ops if op.primitive == "dot_general")
    assert dot.outputs[0].id in only_weights  # x @ W depends on W
    assert all(is_float(t) for op in g.walk() for t in op.outputs if t.id in with_inputs)
