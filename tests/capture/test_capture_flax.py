"""Capture of Flax modules: annotations of real layers, module and variable paths, scan/remat,
mutable collections, rng inputs and control-flow regions."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from capture_helpers import canon, check_annotations_bind, ops_of

import models
from nnscaler_jax import trace
from nnscaler_jax.capture.trace import capture
from nnscaler_jax.ir.graph import Role

# --- annotations of real layers, against hand-written expectations ------------------------------

def _only(graph, primitive):
    (op,) = ops_of(graph, primitive)
    return op


def test_dense_dot_general() -> None:
    g = trace(nn.Dense(5), jnp.ones((2, 3, 4)))
    assert canon(_only(g, "dot_general").anno) == canon("b s k+, k+ n -> b s n")
    check_annotations_bind(g)


def test_conv_spatial_dims_frozen() -> None:
    g = trace(nn.Conv(6, (3, 3)), jnp.ones((2, 8, 8, 3)))
    op = _only(g, "conv_general_dilated")
    assert canon(op.anno) == canon("n h^ w^ c+, kh^ kw^ c+ o -> n oh^ ow^ o")
    assert [t.shape for t in op.inputs] == [(2, 8, 8, 3), (3, 3, 3, 6)]
    check_annotations_bind(g)


def test_embed_gather_splits_batch_and_features() -> None:
    g = trace(nn.Embed(10, 4), jnp.ones((2, 3), jnp.int32))
    op = _only(g, "gather")
    # The table's vocab axis is frozen (indices address it); the feature axis splits.
    assert canon(op.anno) == canon("v^ e, b s 1 -> b s e")
    check_annotations_bind(g)


class _Heads(nn.Module):
    """The reshapes of multi-head attention: ``[b, s, h*d] <-> [b, s, h, d]``."""

    @nn.compact
    def __call__(self, x):
        b, s, _ = x.shape
        q = nn.Dense(8, name="query")(x).reshape(b, s, 2, 4)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, q)
        return jnp.einsum("bhqk,bkhd->bqhd", scores, q).reshape(b, s, 8)


def test_attention_reshapes_group_heads() -> None:
    g = trace(_Heads(), jnp.ones((2, 3, 6)))
    split, merge = [op for op in ops_of(g, "reshape") if op.inputs[0].ndim != 1]
    assert canon(split.anno) == canon("b s (h d) -> b s h d")
    assert canon(merge.anno) == canon("b s h d -> b s (h d)")
    scores = [op for op in ops_of(g, "dot_general") if op.outputs[0].shape == (2, 2, 3, 3)]
    # bqhd,bkhd->bhqk on the operands as they are: batch b h, contraction d, free q k.
    assert canon(scores[0].anno) == canon("b q h d+, b k h d+ -> b h q k")
    check_annotations_bind(g)


# --- linen GPT: module and variable paths -------------------------------------------------------

@pytest.fixture(scope="module")
def gpt_graph():
    spec = models.get("gpt", "tiny")
    return trace(spec.module, *spec.make_args())


def test_linen_gpt_module_paths(gpt_graph) -> None:
    paths = gpt_graph.module_paths
    for p in ["wte", "wpe", "h_0/attn/query", "h_0/attn/key", "h_0/attn/value", "h_0/attn/out",
              "h_0/ln_1", "h_1/mlp/c_fc", "h_1/mlp/c_proj", "ln_f"]:
        assert p in paths, sorted(paths)
    query = [op for op in ops_of(gpt_graph, "dot_general") if op.module_path == "h_0/attn/query"]
    assert len(query) == 1


def test_linen_gpt_variable_paths(gpt_graph) -> None:
    by_name = {t.name: t for t in gpt_graph.variables}
    kernel = by_name["params/h_0/attn/query/kernel"]
    assert kernel.collection == "params" and kernel.role is Role.VARIABLE
    assert kernel.shape == (32, 4, 8)
    assert {t.collection for t in gpt_graph.variables} == {"params"}
    (reader,) = gpt_graph.consumers[kernel.id]
    assert reader.primitive == "dot_general" and reader.module_path == "h_0/attn/query"
    (tokens,) = [t for t in gpt_graph.inputs if t.role is Role.INPUT]
    assert tokens.name == "args/0" and tokens.dtype == "int32"
    assert all(op.annotated for op in gpt_graph.walk())
    check_annotations_bind(gpt_graph)


# --- nnx: module paths from state paths ---------------------------------------------------------

def test_nnx_mlp_paths() -> None:
    spec = models.get("mlp_nnx", "tiny")
    g = trace(spec.module, *spec.make_args())
    dots = ops_of(g, "dot_general")
    assert [op.module_path for op in dots] == ["fc1", "fc2"]
    by_name = {t.name: t for t in g.variables}
    assert {"fc1/kernel", "fc1/bias", "fc2/kernel", "fc2/bias"} <= set(by_name)
    assert dots[0].inputs[1] == by_name["fc1/kernel"]
    assert dots[1].inputs[1] == by_name["fc2/kernel"]
    assert by_name["fc1/kernel"].collection == "param"
    check_annotations_bind(g)


def test_nnx_gpt_nested_paths() -> None:
    spec = models.get("gpt_nnx", "tiny")
    g = trace(spec.module, *spec.make_args())
    assert {"h/0/attn/query", "h/1/mlp/c_fc", "ln_f"} <= g.module_paths
    names = {t.name for t in g.variables}
    assert "h/0/attn/query/kernel" in names
    assert all(op.annotated for op in g.walk())


# --- nn.scan + nn.remat -------------------------------------------------------------------------

def test_scan_remat_stack() -> None:
    spec = models.get("gpt", "tiny-scan")
    g = trace(spec.module, *spec.make_args())
    scans = [op for op in g.ops if op.primitive == "scan"]
    assert len(scans) == 1
    (body,) = scans[0].regions
    layer_paths = {op.module_path for op in body.walk()}
    assert {"h/attn/query", "h/attn/out", "h/mlp/c_fc", "h/ln_1"} <= layer_paths, layer_paths
    assert not any(p.startswith("h") for p in {op.module_path for op in g.ops if op is not scans[0]})
    # The layer params enter the scan stacked on a leading layer axis.
    kernel = next(t for t in g.variables if t.name == "params/h/attn/query/kernel")
    assert kernel.shape == (2, 32, 4, 8) and kernel in scans[0].inputs
    # remat: one boundary in the body; every layer op carries its id.
    kinds = {b.kind for b in body.boundaries}
    assert kinds and kinds <= {"remat2", "checkpoint"}
    (remat,) = body.boundaries
    inside = [op for op in body.ops if remat.id in op.boundary]
    assert {"h/attn/query", "h/mlp/c_proj"} <= {op.module_path for op in inside}
    assert set(remat.outputs) <= {t for op in inside for t in op.outputs} | set(remat.inputs)
    check_annotations_bind(g)


class _RematDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.remat(nn.Dense)(4, name="fc")(x).sum()


def test_remat_boundary_at_top_level() -> None:
    g = trace(_RematDense(), jnp.ones((2, 3)))
    (b,) = [b for b in g.boundaries if b.kind in ("remat2", "checkpoint")]
    dot = _only(g, "dot_general")
    assert b.id in dot.boundary and dot.module_path == "fc"
    assert dot.outputs[0] in b.outputs or any(b.id in op.boundary for op in g.consumers[dot.outputs[0].id])


# --- BatchNorm: batch_stats variables and mutable outputs ---------------------------------------

class _ConvBN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(4, (3, 3), name="conv")(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, name="bn")(x)
        return nn.Dense(3, name="head")(nn.relu(x).mean(axis=(1, 2)))


def test_batchnorm_stats_in_and_out() -> None:
    x = jnp.ones((2, 8, 8, 3))
    variables = _ConvBN().init(jax.random.key(0), x)
    c = capture(_ConvBN(), x, variables=variables, mutable=["batch_stats"])
    g = c.graph
    stats = {t.name: t for t in g.variables if t.collection == "batch_stats"}
    assert set(stats) == {"batch_stats/bn/mean", "batch_stats/bn/var"}
    assert {t.collection for t in g.variables} == {"params", "batch_stats"}
    # Outputs: logits, then the updated mean and var (new tensors computed from the batch).
    logits, stats_tree = jax.tree_util.tree_unflatten(c.out_tree, g.outputs)
    assert logits.shape == (2, 3)
    new_mean = stats_tree["batch_stats"]["bn"]["mean"]
    assert new_mean.shape == (4,) and new_mean.id in g.producer
    assert new_mean != stats["batch_stats/bn/mean"]
    # Default mutable: every collection but params.
    assert len(capture(_ConvBN(), x, variables=variables).graph.outputs) == 3
    assert all(op.annotated for op in g.walk())
    check_annotations_bind(g)


# --- dropout: rng input, random_* primitives ----------------------------------------------------

def test_dropout_rng_input() -> None:
    spec = models.get("gpt", "tiny-dropout")
    assert spec.rng_streams == ("dropout",)
    g = trace(spec.module, *spec.make_args(), rngs={"dropout": jax.random.key(0)})
    (rng,) = [t for t in g.inputs if t.role is Role.RNG]
    assert rng.name == "rngs/dropout" and rng.shape == ()
    prims = {op.primitive for op in g.walk()}
    assert {"random_bits", "random_fold_in"} <= prims, sorted(prims)
    randoms = [op for op in g.walk() if op.primitive.startswith("random_")]
    assert all(op.annotated for op in randoms)
    assert any(rng in op.inputs for op in randoms)
    check_annotations_bind(g)


# --- stop_gradient, integer index arithmetic, while / cond regions -----------------------------

class _Loop(nn.Module):
    @nn.compact
    def __call__(self, x, n):
        w = self.param("w", nn.initializers.lecun_normal(), (x.shape[-1], x.shape[-1]))
        y = jax.lax.fori_loop(0, n, lambda i, c: jnp.tanh(c @ w), x)  # dynamic trip count
        y = jax.lax.cond(n > 2, lambda a: a * 2.0, lambda a: a - 1.0, y)
        idx = (n * 3 + 1) % x.shape[0]  # integer index arithmetic
        return jax.lax.stop_gradient(y[idx]) + y.sum(axis=0)


@pytest.fixture(scope="module")
def loop_graph():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return trace(_Loop(), jnp.ones((4, 3)), jnp.int32(3))


def test_while_region(loop_graph) -> None:
    (loop,) = [op for op in loop_graph.ops if op.primitive == "while"]
    cond, body = loop.regions
    assert [op.primitive for op in cond.ops] == ["lt"]
    assert {"dot_general", "tanh"} <= {op.primitive for op in body.ops}
    assert loop.annotated
    w = next(t for t in loop_graph.variables if t.name == "params/w")
    assert w in loop.inputs
    # The carried activation keeps its batch axis splittable through the loop.
    anno = loop.annotation
    carry = anno.outputs[-1]
    assert carry.axes[0].dims[0].kind.value == "" and loop.outputs[-1].shape == (4, 3)


def test_cond_region(loop_graph) -> None:
    (cond,) = [op for op in loop_graph.ops if op.primitive == "cond"]
    assert len(cond.regions) == 2
    assert {op.primitive for op in cond.regions[0].ops} | {
        op.primitive for op in cond.regions[1].ops} >= {"mul", "sub"}
    # The branch index is replicate-only; the operand's axes pass through.
    assert canon(cond.anno) == canon("?, a b -> a b")


def test_stop_gradient_and_integer_ops(loop_graph) -> None:
    prims = {op.primitive for op in loop_graph.ops}
    assert {"stop_gradient", "rem", "dynamic_slice"} <= prims, sorted(prims)
    ints = [op for op in loop_graph.ops if op.outputs and op.outputs[0].dtype == "int32"]
    assert ints and all(op.annotated for op in ints)
    assert all(op.annotated for op in loop_graph.walk())
    check_annotations_bind(loop_graph)
