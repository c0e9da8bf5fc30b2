"""ClosedJaxpr -> Graph (`capture/jaxpr.py`) on plain jax programs: inlined calls, remembered
boundaries, literals and constants, module paths from name stacks, the ``annotate`` hook."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from nnscaler_jax.capture.jaxpr import InputInfo, graph_from_jaxpr
from nnscaler_jax.ir.graph import Role

TABLE = np.arange(3.0, dtype=np.float32)


def program(x, w):
    with jax.named_scope("net"):
        with jax.named_scope("blk"):
            # "attn._split": a linen method scope of the same module
            with jax.named_scope("attn"), jax.named_scope("attn._split"):
                y = x @ w
            with jax.named_scope("wte.attend"):
                z = jnp.sin(y)
        u = jax.jit(lambda a: a * 3.0 + 1.0)(z)
        v = jax.checkpoint(lambda a: jnp.tanh(a) * 2.0)(u)
        s = lax.scan(lambda c, _: (c * 2.0, None), v, None, length=3)[0]
        return jax.nn.relu(s) + TABLE  # relu: a custom_jvp call; TABLE: a closed-over constant


INFOS = [InputInfo(Role.INPUT, "args/0"), InputInfo(Role.VARIABLE, "params/w", "params")]


@pytest.fixture(scope="module")
def graph():
    closed = jax.make_jaxpr(program)(jnp.ones((2, 3)), jnp.ones((3, 3)))
    g, missing = graph_from_jaxpr(closed, INFOS, root="net")
    assert missing == {}
    return g


def test_inputs_carry_their_info(graph):
    x, w = graph.inputs
    assert (x.role, x.name, x.collection, x.shape) == (Role.INPUT, "args/0", None, (2, 3))
    assert (w.role, w.name, w.collection) == (Role.VARIABLE, "params/w", "params")
    assert graph.variables == (w,)


def test_calls_are_inlined_and_wired_to_the_outer_tensors(graph):
    prims = [op.primitive for op in graph.ops]
    assert not {"jit", "pjit", "remat2", "checkpoint", "custom_jvp_call"} & set(prims)
    sin = next(op for op in graph.ops if op.primitive == "sin")
    mul = next(op for op in graph.ops if op.primitive == "mul")  # the first op inside the jit
    assert mul.inputs[0] == sin.outputs[0]
    assert graph.outputs[0] == graph.ops[-1].outputs[0]


def test_remat_and_custom_jvp_boundaries_are_remembered(graph):
    kinds = {b.kind: b for b in graph.boundaries}
    assert set(kinds) == {"remat2", "custom_jvp_call"} or set(kinds) == {"checkpoint",
                                                                        "custom_jvp_call"}
    remat = next(b for b in graph.boundaries if b.kind != "custom_jvp_call")
    inside = [op for op in graph.ops if remat.id in op.boundary]
    assert [op.primitive for op in inside] == ["tanh", "mul"]
    assert remat.inputs == inside[0].inputs[:1] and remat.outputs == inside[-1].outputs
    relu = kinds["custom_jvp_call"]
    (mx,) = [op for op in graph.ops if relu.id in op.boundary]
    assert mx.primitive == "max" and relu.outputs == mx.outputs
    assert relu.eqn.primitive.name == "custom_jvp_call"  # kept to rebind it whole


def test_literals_and_constants_become_const_tensors(graph):
    (const,) = graph.consts
    assert const.role is Role.CONST and np.array_equal(const.value, TABLE)
    bcast = next(op for op in graph.ops if op.primitive == "broadcast_in_dim")
    assert bcast.inputs == (const,)
    mul = next(op for op in graph.ops if op.primitive == "mul")
    lit = mul.inputs[1]
    assert lit.role is Role.CONST and lit.shape == () and float(lit.value) == 3.0


def test_ids_are_unique_across_regions(graph):
    ids = [t.id for t in graph.inputs + graph.consts]
    for op in graph.walk():
        ids.append(op.id)
        ids += [t.id for t in op.outputs]
        for region in op.regions:
            ids += [t.id for t in region.inputs]
    assert len(ids) == len(set(ids))
    assert {b.id for b in graph.boundaries}.isdisjoint(ids)


def test_module_paths_from_name_stacks(graph):
    paths = {op.primitive: op.module_path for op in graph.ops}
    assert paths["dot_general"] == "blk/attn"   # root stripped, "attn/attn._split" merged
    assert paths["sin"] == "blk/wte"            # method scope "wte.attend" -> module "wte"
    assert paths["tanh"] == ""


def test_a_region_op_takes_the_common_path_of_its_body():
    def cell(c, _):
        with jax.named_scope("stack"):
            with jax.named_scope("cell"):
                a = jnp.tanh(c)
            with jax.named_scope("out"):
                return a * 2.0, None

    closed = jax.make_jaxpr(lambda x: lax.scan(cell, x, None, length=2)[0])(jnp.ones((2,)))
    g, _ = graph_from_jaxpr(closed, [InputInfo(Role.INPUT)])
    (scan,) = g.ops
    assert [op.module_path for op in scan.regions[0].ops] == ["stack/cell", "stack/out"]
    assert scan.module_path == "stack"  # the scan itself was called at the top


def test_the_annotate_hook_and_missing_rules():
    seen = []

    def annotate(name, params, in_avals, out_avals):
        seen.append((name, [a.shape for a in in_avals], [a.shape for a in out_avals]))
        return "a b, b c -> a c" if name == "dot_general" else None

    closed = jax.make_jaxpr(lambda x, w: jnp.cos(x @ w))(jnp.ones((2, 3)), jnp.ones((3, 4)))
    g, missing = graph_from_jaxpr(closed, [InputInfo(Role.INPUT)] * 2, annotate=annotate)
    assert seen == [("dot_general", [(2, 3), (3, 4)], [(2, 4)]), ("cos", [(2, 4)], [(2, 4)])]
    dot, cos = g.ops
    assert dot.annotated and dot.anno == "a b, b c -> a c"
    assert not cos.annotated and cos.anno == "? -> ?"
    assert missing == {"cos": {""}}


def test_input_infos_must_match_the_inputs():
    closed = jax.make_jaxpr(lambda x, y: x + y)(1.0, 2.0)
    with pytest.raises(ValueError):
        graph_from_jaxpr(closed, [InputInfo(Role.INPUT)])
