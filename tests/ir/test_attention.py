"""Attention blocks found in the graph (``ir.attention``): however the model writes attention
(the zoo's einsums, ``jax.nn.dot_product_attention``, Flax's attention), in float32 and bf16,
with its scale and whether its mask is causal; and not where the chain does something else."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from nnscaler_jax import trace
from nnscaler_jax.cli.common import capture_model, model_spec, spec_mutable
from nnscaler_jax.ir.attention import attention_blocks

X = jnp.ones((2, 16, 32))


@pytest.mark.parametrize("name,precision", [("llama", None), ("llama", "bfloat16"),
                                            ("gpt", None), ("gpt", "bfloat16")])
def test_the_zoo_decoders_attention_is_found_causal(name, precision):
    spec = model_spec(name, "tiny", precision)
    graph = capture_model(spec, mutable=spec_mutable(spec), precision=precision,
                          loss=True).graph
    blocks = attention_blocks(graph)
    assert len(blocks) == 2  # one per layer of the tiny preset
    for b in blocks:
        assert b.causal
        assert b.scale == pytest.approx(1 / math.sqrt(b.q.shape[b.head_dim]), rel=1e-3)
        assert b.q.shape[b.q_seq] == b.k.shape[b.k_seq] == b.v.shape[b.v_seq] == 16
        assert b.q.shape[b.head_dim] == b.k.shape[b.k_dim]
    if name == "llama":  # grouped-query attention: q carries the group, k / v do not
        b = blocks[0]
        assert b.q.ndim == b.k.ndim + 1 and b.k.shape == b.v.shape


def test_t5_cross_attention_is_found_without_a_mask_and_self_attention_is_not():
    """T5's self-attention adds a relative position bias made from parameters: not a block."""
    spec = model_spec("t5", "tiny")
    graph = capture_model(spec, mutable=spec_mutable(spec), loss=True).graph
    blocks = attention_blocks(graph)
    assert [b.module_path.rsplit("/", 1)[-1] for b in blocks] == ["cross_attn"] * len(blocks)
    assert blocks and not any(b.causal for b in blocks)
    b = blocks[0]
    assert b.q.shape[b.q_seq] != b.k.shape[b.k_seq]  # decoder queries, encoder keys


class DotProduct(nn.Module):
    causal: bool

    @nn.compact
    def __call__(self, x):
        q, k, v = (nn.DenseGeneral((4, 8), name=n)(x) for n in "qkv")
        return jax.nn.dot_product_attention(q, k, v, is_causal=self.causal)


class FlaxAttention(nn.Module):
    causal: bool

    @nn.compact
    def __call__(self, x):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2])) if self.causal else None
        return nn.MultiHeadDotProductAttention(num_heads=4)(x, x, mask=mask)


@pytest.mark.parametrize("module,scale", [(DotProduct, 1 / math.sqrt(8)), (FlaxAttention, 1.0)])
@pytest.mark.parametrize("causal", [True, False])
def test_library_attention_is_found(module, scale, causal):
    """Flax scales the queries before the scores: the block's scale is 1 there."""
    (b,) = attention_blocks(trace(module(causal), X))
    assert b.causal == causal
    assert b.scale == pytest.approx(scale, rel=1e-6)
    assert math.prod(b.out.shape) == 2 * 16 * 4 * 8


class Written(nn.Module):
    """Attention written out, with one change to its chain (``kind``)."""

    kind: str

    @nn.compact
    def __call__(self, x):
        q, k, v = (nn.DenseGeneral((4, 8), name=n)(x) for n in "qkv")
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(8.0)
        i, j = jnp.arange(16)[:, None], jnp.arange(16)[None, :]
        if self.kind == "causal":
            s = jnp.where(i >= j, s, -1e10)
        elif self.kind == "window":  # a sliding window: neither causal nor unmasked
            s = jnp.where((i >= j) & (i - j < 4), s, -1e10)
        elif self.kind == "softcap":
            s = 30.0 * jnp.tanh(s / 30.0)
        elif self.kind == "batch_mask":  # a padding mask read from the input
            s = jnp.where(x[:, None, :, :1] > 0, s, -1e10)
        elif self.kind == "weak_fill":  # masked with -1: not masked out
            s = jnp.where(i >= j, s, -1.0)
        p = jax.nn.softmax(s, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", p, v)
        return (out, p) if self.kind == "weights_out" else out


def test_written_out_causal_attention_is_found():
    (b,) = attention_blocks(trace(Written("causal"), X))
    assert b.causal and b.scale == pytest.approx(1 / math.sqrt(8))


@pytest.mark.parametrize("kind", ["window", "softcap", "batch_mask", "weak_fill", "weights_out"])
def test_other_chains_are_not_blocks(kind):
    """A block must compute exactly softmax(scale q k^T + causal or no mask) v, and nothing
    it computes may be read outside it (here: the attention weights returned)."""
    assert attention_blocks(trace(Written(kind), X)) == []
