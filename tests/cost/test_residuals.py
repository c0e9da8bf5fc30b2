"""`cost/residuals.py`: what each primitive's transpose reads, and which forward outputs a
training step materialises for the backward pass (expected sets derived from the module's two
rules by hand in each test)."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from nnscaler_jax import trace
from nnscaler_jax.cost.residuals import residual_forms, residual_outputs, saved_operands
from nnscaler_jax.ir.graph import Op, Tensor

F = lambda i: Tensor(i, (4, 4), "float32")
I = lambda i: Tensor(i, (4,), "int32")


def _op(prim, n_in, ints=()):
    ins = tuple(I(k) if k in ints else F(k) for k in range(n_in))
    return Op(9, prim, ins, (F(8),), "")


@pytest.mark.parametrize(("prim", "n_in", "ints", "grads", "want"), [
    ("add", 2, (), (True, True), ([], [])),                    # linear: nothing
    ("reduce_sum", 1, (), (True,), ([], [])),
    ("gather", 2, (1,), (True, False), ([1], [])),             # its indices
    ("select_n", 3, (0,), (False, True, True), ([0], [])),     # its predicate
    ("exp", 1, (), (True,), ([], [0])),                        # its output
    ("rsqrt", 1, (), (True,), ([0], [0])),                     # both
    ("mul", 2, (), (True, False), ([1], [])),                  # the other operand
    ("mul", 2, (), (True, True), ([0, 1], [])),
    ("dot_general", 2, (), (False, True), ([0], [])),
    ("div", 2, (), (True, False), ([1], [])),                  # d/dx = 1/y
    ("div", 2, (), (False, True), ([0, 1], [])),               # d/dy = -x/y^2
    ("log", 1, (), (True,), ([0], [])),                        # anything else: its inputs
    ("mul", 2, (), (False, False), ([], [])),                  # no gradient: nothing
])
def test_saved_operands(prim, n_in, ints, grads, want):
    assert saved_operands(_op(prim, n_in, ints), grads) == want


def _saved_prims(module, *shapes):
    g = trace(module, *(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes))
    by_id = {op.id: op for op in g.walk()}
    return sorted((by_id[i].primitive, by_id[i].module_path, ks)
                  for i, ks in residual_outputs(g).items())


class Chain(nn.Module):
    """fc1 -> act -> fc2, no biases."""

    act: str = "tanh"

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8, use_bias=False, name="fc1")(x)
        if self.act == "tanh":
            h = jnp.tanh(h)
        elif self.act == "relu":
            h = jnp.maximum(h, 0.0)
        elif self.act == "scale":
            h = h * 2.0
        elif self.act == "exp_reshape":
            h = jnp.exp(h).reshape(h.shape[0], 2, 4).reshape(h.shape)
        elif self.act == "scale_sin":
            h = jnp.sin(h * 2.0)
        return nn.Dense(4, use_bias=False, name="fc2")(h)


def test_tanh_saves_its_output_once():
    # tanh's transpose reads its output; fc2's weight gradient reads the same value
    assert _saved_prims(Chain("tanh"), (2, 16)) == [("tanh", "", (0,))]


def test_relu_mask_keeps_the_matmul_output_and_its_own():
    # max saves its input (fc1's output, materialised: max is a masked transpose) and fc2's
    # weight gradient reads max's output (a matmul operand is materialised)
    assert _saved_prims(Chain("relu"), (2, 16)) == [("dot_general", "fc1", (0,)),
                                                    ("max", "", (0,))]


def test_a_cheap_op_feeding_a_matmul_is_materialised():
    # fc2 reads h * 2 as a matmul operand: XLA materialises it; mul by a constant saves nothing
    assert _saved_prims(Chain("scale"), (2, 16)) == [("mul", "", (0,))]


def test_bitcast_reshapes_fold_into_the_matmul_operand():
    # exp saves its output; fc2 reads reshape(reshape(exp)): bitcasts, so exp's output is kept
    assert _saved_prims(Chain("exp_reshape"), (2, 16)) == [("exp", "", (0,))]


class TiedHead(nn.Module):
    """fc -> logits against a table's transposed view (a tied LM head) -> tanh."""

    @nn.compact
    def __call__(self, x):
        table = self.param("embedding", nn.initializers.normal(), (32, 8))
        h = nn.Dense(8, use_bias=False, name="fc")(x)
        return jnp.tanh(h @ table.T)


def test_a_weights_transposed_view_is_held_as_the_weight_is():
    # the head's matmul saves its operands: fc's output and table.T, a view of a weight that
    # XLA reads through the dot's dimension numbers (no copy lives to the backward)
    assert _saved_prims(TiedHead(), (2, 16)) == [("dot_general", "fc", (0,)),
                                                 ("tanh", "", (0,))]


def test_cheap_producers_fuse_into_an_elementwise_transpose():
    # sin saves its input h * 2; mul is cheap, so XLA recomputes it from fc1's output; fc2
    # reads sin's output (not cheap: kept)
    assert _saved_prims(Chain("scale_sin"), (2, 16)) == [("dot_general", "fc1", (0,)),
                                                         ("sin", "", (0,))]


def test_nothing_is_saved_without_gradients_and_results_are_cached():
    g = trace(Chain("tanh"), jax.ShapeDtypeStruct((2, 16), jnp.float32))
    assert residual_outputs(g, grads=set()) == {}
    first = residual_outputs(g)
    assert residual_outputs(g) is first  # memoised per graph object


class Softmax(nn.Module):
    """fc1 -> jax.nn.softmax -> fc2: softmax subtracts ``stop_gradient(max(h))``."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8, use_bias=False, name="fc1")(x)
        return nn.Dense(4, use_bias=False, name="fc2")(jax.nn.softmax(h))


def test_ops_reaching_the_loss_only_through_stop_gradient_save_nothing():
    # exp saves its output; the division by the row sum reads the sum (and exp's output);
    # fc2 reads the division's output. The row max reaches the output only through
    # stop_gradient: no cotangent reaches it, so its saved input (fc1's output) and output are
    # not kept. JAX's own jax.ad_checkpoint.print_saved_residuals lists the same three (exp,
    # the broadcast row sum, div) and neither fc1's output nor the max.
    assert _saved_prims(Softmax(), (2, 16)) == [("div", "", (0,)), ("exp", "", (0,)),
                                                ("reduce_sum", "", (0,))]


def test_residual_reads_are_the_cheap_ops_a_residual_is_traced_through():
    """``sin(x + x @ w)``: sin's transpose reads its input, computed by a cheap add, so the
    residual is traced through the add into both its inputs (x, a graph input; the matmul's
    output, the root kept); a relayout growing either on its way into the add is kept as the
    add reads it (``plan_walk``). The matmul reads x itself, not through a cheap op."""
    from nnscaler_jax.cost.residuals import residual_reads

    class M(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.sin(x + nn.Dense(4, use_bias=False)(x))

    g = trace(M(), jax.ShapeDtypeStruct((2, 4), jnp.float32))
    add = next(op for op in g.walk() if op.primitive == "add")
    dot = next(op for op in g.walk() if op.primitive == "dot_general")
    reads = residual_reads(g)
    assert {(add.id, 0), (add.id, 1)} <= reads
    assert not any(op_id == dot.id for op_id, _ in reads)
    assert residual_outputs(g)[dot.id] == (0,)


class ExpSoftmax(nn.Module):
    """Scores in ``dtype``, their softmax written out in float32 (as mixed-precision attention
    computes it), the probabilities back in ``dtype`` for the weighted sum."""

    dtype: object = jnp.bfloat16

    @nn.compact
    def __call__(self, x):
        q = nn.Dense(8, use_bias=False, dtype=self.dtype, name="q")(x)
        s = jnp.einsum("bqd,bkd->bqk", q, q)
        e = jnp.exp(s.astype(jnp.float32) - jax.lax.stop_gradient(s.max(-1, keepdims=True))
                    .astype(jnp.float32))
        p = (e / e.sum(-1, keepdims=True)).astype(self.dtype)
        return jnp.einsum("bqk,bkd->bqd", p, q)


def _kept(dtype):
    g = trace(ExpSoftmax(dtype), jax.ShapeDtypeStruct((2, 16, 8), jnp.float32))
    by_id = {op.id: op for op in g.walk()}
    scores = next(op for op in g.walk() if op.primitive == "dot_general"
                  and op.outputs[0].shape == (2, 16, 16))
    return {by_id[i].primitive for i in residual_outputs(g)}, scores.id in residual_outputs(g)


def test_float32_exponentials_of_bf16_scores_are_recomputed_from_them():
    """XLA:GPU rebuilds ``exp(float32(s) - max)`` inside the backward fusion from the bf16
    scores ``s`` instead of keeping the float32 exponentials, twice their size (measured:
    GPT-3 1.3B bf16 on H100s: 0.85 -> 0.97 of XLA's peak under Megatron). The scores' matmul
    output is kept, no ``exp``; in float32 throughout, the exponentials are kept (their
    inputs are as wide) and the scores are not."""
    kept, scores = _kept(jnp.bfloat16)
    assert "exp" not in kept and scores
    kept, scores = _kept(jnp.float32)
    assert "exp" in kept and not scores


class Gelu(nn.Module):
    """fc1 -> GELU (tanh approximation) -> fc2, computed in ``dtype``."""

    dtype: str = "float32"
    upcast: bool = False  # the GELU in float32 on bf16 values

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8, use_bias=False, dtype=self.dtype, name="fc1")(x)
        h = h.astype(jnp.float32) if self.upcast else h
        return nn.Dense(4, use_bias=False, dtype=self.dtype, name="fc2")(
            jax.nn.gelu(h, approximate=True))


def test_a_float32_tanh_of_bf16_values_is_kept_unless_a_reduction_reads_it():
    # wider than its bf16 source, but read by elementwise ops only: XLA writes it in the
    # forward and keeps it (a softmax's exp, read by its sum, is rebuilt:
    # test_float32_exponentials_of_bf16_scores_are_recomputed_from_them)
    assert ("tanh", "", (0,)) in _saved_prims(Gelu("bfloat16", upcast=True), (2, 16))



class PreLN(nn.Module):
    """A bf16 pre-LN block: x + proj(LN(x)), then + fc2(gelu(fc1(LN(.))))."""

    dtype: jnp.dtype = jnp.bfloat16

    @nn.compact
    def __call__(self, x):
        bf16 = self.dtype
        x = x + nn.Dense(16, use_bias=False, dtype=bf16, name="proj")(
            nn.LayerNorm(dtype=bf16, name="ln1")(x))
        h = nn.Dense(32, use_bias=False, dtype=bf16, name="fc1")(
            nn.LayerNorm(dtype=bf16, name="ln2")(x))
        return x + nn.Dense(16, use_bias=False, dtype=bf16, name="fc2")(
            jax.nn.gelu(h, approximate=True))


def _pre_ln_graph():
    return trace(PreLN(), jax.ShapeDtypeStruct((8, 8, 16), jnp.bfloat16))


def test_a_16bit_residual_sum_a_layernorm_reads_is_kept_as_the_sum():
    # ln2's statistics read x + proj(...): XLA writes the sum from the add's multi-output
    # fusion with the statistics and keeps it; the estimate keeps the sum, not proj's output
    # it would otherwise trace the sum through to
    g = _pre_ln_graph()
    by_id = {op.id: op for op in g.walk()}
    kept = {(by_id[i].primitive, by_id[i].module_path) for i in residual_outputs(g)}
    assert ("add", "") in kept and ("dot_general", "proj") not in kept


def _float32(g):
    return [key for key, form in residual_forms(g).items() if form == "float32"]


def test_float32_held_are_the_bf16_sums_and_activations_only_elementwise_ops_read():
    # the residual sum (read by ln2's backward) and the GELU's tanh are held in float32 on a
    # GPU without 16-bit arithmetic; the GELU's output, fc2's matmul operand, stays bf16
    g = _pre_ln_graph()
    by_id = {op.id: op for op in g.walk()}
    held = sorted((by_id[i].primitive, by_id[i].module_path) for i, _ in _float32(g))
    assert held == [("add", ""), ("tanh", "")]
    assert ("mul", "") in {(by_id[i].primitive, by_id[i].module_path)
                           for i in residual_outputs(g)}


def test_a_gpu_without_bf16_arithmetic_holds_those_residuals_twice_as_large():
    # the same replicated plan priced for A100s (XLA computes bf16 arithmetic in float32 and
    # keeps those values so) and H100s: the activations differ by exactly the held roots'
    # bf16 bytes
    from meshes import make_mesh

    from nnscaler_jax.cost.devices import cluster_preset
    from nnscaler_jax.cost.model import CostModel
    from nnscaler_jax.planner import make_plan

    g = _pre_ln_graph()
    plan = make_plan(g, make_mesh((8,), ("data",)), policy="dp")
    acts = {name: CostModel.for_cluster(cluster_preset(name), dict(plan.mesh))
            .memory_breakdown(plan, g)["activations"] for name in ("a100-80g-8x", "h100-80g-8x")}
    ops = {op.id: op for op in g.walk()}
    held = sum(ops[i].outputs[k].nbytes for i, k in _float32(g)) / 8  # batch over 8
    assert held > 0
    assert acts["a100-80g-8x"] - acts["h100-80g-8x"] == pytest.approx(held)


def test_a_float32_gelus_tanh_is_rebuilt_on_gpus_and_kept_on_cpus():
    # in float32 the GELU's tanh is the one form: XLA:GPU rebuilds it in the backward fusion
    # from the GELU's input, which is kept anyway (measured: GPT-3 1.3B on V100s); XLA:CPU
    # keeps it. The same plan priced for V100s and for the CPU differs by exactly its bytes
    from meshes import make_mesh

    from nnscaler_jax.cost.devices import CPU, cluster_preset
    from nnscaler_jax.cost.model import CostModel
    from nnscaler_jax.planner import make_plan

    g = trace(PreLN(dtype=jnp.float32), jax.ShapeDtypeStruct((8, 8, 16), jnp.float32))
    ops = {op.id: op for op in g.walk()}
    forms = residual_forms(g)
    assert sorted((ops[i].primitive, form) for (i, _), form in forms.items()) == [
        ("tanh", "rebuilt")]
    (i, k), = forms
    plan = make_plan(g, make_mesh((8,), ("data",)), policy="dp")
    v100 = CostModel.for_cluster(cluster_preset("v100-32g-8x"), dict(plan.mesh))
    cpu = dataclasses.replace(v100, device=CPU)
    acts = {m.device.name: m.memory_breakdown(plan, g)["activations"] for m in (v100, cpu)}
    assert acts["cpu"] - acts["V100-32G"] == pytest.approx(ops[i].outputs[k].nbytes / 8)


def test_grouped_query_scores_transposed_copy_their_cotangent():
    """Grouped-query attention computes its scores with the queries' two free dims (tokens,
    head groups) and transposes them apart: the backward copies the scores' cotangent back
    into the matmul's order (XLA:GPU, Llama-3-8B); so does its output (the values' head
    groups and features, transposed apart). A transpose keeping one free dim per operand
    (GPT's attention output) needs no copy."""
    import models
    from nnscaler_jax.capture.trace import capture_spec
    from nnscaler_jax.cost.residuals import copies_cotangent

    def copies(name):
        graph = capture_spec(models.get(name, "tiny"), loss=True).graph
        return [(op.inputs[0].shape, copies_cotangent(op, graph)) for op in graph.walk()
                if op.primitive == "transpose" and
                getattr(graph.producer.get(op.inputs[0].id), "primitive", "") == "dot_general"]

    llama = copies("llama")
    assert [c for _, c in llama] == [True, True] * 2  # per layer: scores, then the output
    assert llama[0][0] == (2, 2, 16, 16, 2)  # [batch, kv heads, keys, queries, groups]
    gpt = copies("gpt")
    assert gpt and not any(c for _, c in gpt)
