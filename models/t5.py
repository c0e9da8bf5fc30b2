"""T5 (v1.0) encoder-decoder in Flax linen.

Relative position buckets (one bias table per stack, shared by its layers), ReLU feed-forward,
RMS layer norm without bias, embeddings shared by encoder, decoder and the tied LM head (logits
scaled by ``d_model ** -0.5``). No attention scaling (T5 folds it into the init).

Module paths::

    shared, encoder/{relative_attention_bias, block_i/{ln_self, self_attn/{q,k,v,o}, ln_ff,
    ff/{wi,wo}}, final_layer_norm}, decoder/{... block_i/{ln_self, self_attn, ln_cross,
    cross_attn/{q,k,v,o}, ln_ff, ff}, final_layer_norm}

Args are ``(encoder_tokens [b, S_enc], decoder_tokens [b, S_dec])``; the decoder reads
``decoder_tokens`` causally and the loss is next-token cross-entropy on them.

>>> import jax, models
>>> spec = models.get("t5", "tiny")
>>> variables = spec.init(jax.random.PRNGKey(0))
>>> spec.module.apply(variables, *spec.make_args()).shape
(2, 8, 64)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import _spec
from models.llama import RMSNorm


@dataclasses.dataclass(frozen=True)
class Config:
    """T5 hyper-parameters (``n_layers`` per stack; inner attention width ``n_heads * d_kv``)."""

    vocab_size: int = 64
    d_model: int = 32
    d_kv: int = 8
    n_heads: int = 4
    d_ff: int = 64
    n_layers: int = 2
    seq_len: int = 16
    dec_len: int = 8
    num_buckets: int = 32
    max_distance: int = 128
    norm_eps: float = 1e-6
    dtype: Any = jnp.float32


def _nnscaler(h: int, layers: int, heads: int, vocab: int, gpus: int) -> _spec.Preset:
    cfg = Config(vocab_size=vocab, d_model=h, d_kv=h // heads, n_heads=heads, d_ff=4 * h,
                 n_layers=layers, seq_len=1024, dec_len=1024)
    return _spec.Preset(cfg, 1, note=f"nnScaler artifact T5, {gpus} GPUs (micro-batch 1)")


PRESETS: dict[str, _spec.Preset] = {
    "tiny": _spec.Preset(Config(), 2, paper=False, note="tests"),
    "t5-base": _spec.Preset(Config(vocab_size=32128, d_model=768, d_kv=64, n_heads=12, d_ff=3072,
                                   n_layers=12, seq_len=512, dec_len=512), 8,
                            note="T5-base v1.0, 222,903,552 params"),
    "t5-11b": _spec.Preset(Config(vocab_size=32128, d_model=1024, d_kv=128, n_heads=128,
                                  d_ff=65536, n_layers=24, seq_len=512, dec_len=512), 1,
                           note="T5-11B v1.0"),
    "t5-nnscaler-4gpu": _nnscaler(2048, 24, 32, 512_000, 4),
    "t5-nnscaler-8gpu": _nnscaler(3072, 32, 48, 1_024_000, 8),
    "t5-nnscaler-16gpu": _nnscaler(4096, 32, 64, 1_536_000, 16),
    "t5-nnscaler-32gpu": _nnscaler(6144, 32, 96, 2_048_000, 32),
}


def relative_position_bucket(rel: jax.Array, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> jax.Array:
    """T5 bucket of ``rel = key_pos - query_pos``: exact for small, log-spaced for large offsets."""
    ret = jnp.zeros_like(rel)
    n = -rel
    if bidirectional:
        num_buckets //= 2
        ret += (n < 0).astype(rel.dtype) * num_buckets
        n = jnp.abs(n)
    else:
        n = jnp.maximum(n, 0)
    max_exact = num_buckets // 2
    scaled = jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / max_exact) / math.log(
        max_distance / max_exact)
    large = max_exact + (scaled * (num_buckets - max_exact)).astype(rel.dtype)
    large = jnp.minimum(large, num_buckets - 1)
    return ret + jnp.where(n < max_exact, n, large)


class Attention(nn.Module):
    """Multi-head attention with heads explicit: ``bqhd,bkhd->bhqk`` plus an additive bias."""

    cfg: Config

    @nn.compact
    def __call__(self, x: jax.Array, kv: jax.Array, bias: jax.Array | None) -> jax.Array:
        cfg = self.cfg
        proj = lambda name: nn.DenseGeneral((cfg.n_heads, cfg.d_kv), use_bias=False,
                                            dtype=cfg.dtype, name=name)
        q, k, v = proj("q")(x), proj("k")(kv), proj("v")(kv)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        if bias is not None:
            scores = scores + bias
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(cfg.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return nn.DenseGeneral(cfg.d_model, axis=(-2, -1), use_bias=False, dtype=cfg.dtype,
                               name="o")(out)


class FeedForward(nn.Module):
    """``wo(relu(wi x))`` without biases."""

    cfg: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        dense = lambda f, name: nn.Dense(f, use_bias=False, dtype=self.cfg.dtype, name=name)
        return dense(self.cfg.d_model, "wo")(nn.relu(dense(self.cfg.d_ff, "wi")(x)))


class Block(nn.Module):
    """Encoder block, or decoder block (with cross-attention) when ``decoder``."""

    cfg: Config
    decoder: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, bias: jax.Array, enc: jax.Array | None = None) -> jax.Array:
        cfg = self.cfg
        norm = lambda name: RMSNorm(cfg.norm_eps, cfg.dtype, name=name)
        h = norm("ln_self")(x)
        x = x + Attention(cfg, name="self_attn")(h, h, bias)
        if self.decoder:
            x = x + Attention(cfg, name="cross_attn")(norm("ln_cross")(x), enc, None)
        return x + FeedForward(cfg, name="ff")(norm("ln_ff")(x))


class Stack(nn.Module):
    """Encoder or decoder stack with its relative-position bias table ``[num_buckets, heads]``."""

    cfg: Config
    decoder: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, enc: jax.Array | None = None) -> jax.Array:
        cfg = self.cfg
        s = x.shape[1]
        pos = jnp.arange(s)
        buckets = relative_position_bucket(pos[None, :] - pos[:, None], not self.decoder,
                                           cfg.num_buckets, cfg.max_distance)
        table = nn.Embed(cfg.num_buckets, cfg.n_heads, dtype=cfg.dtype,
                         name="relative_attention_bias")
        # read as a one-hot contraction, not a gather (as T5X does): the gather's gradient is a
        # scatter-add of q x k x heads updates into num_buckets x heads entries, which a GPU
        # serialises (T5-base's step on one H100: 1.65 s, 66x the plan's prediction)
        onehot = jax.nn.one_hot(buckets, cfg.num_buckets, dtype=cfg.dtype)  # [q, k, buckets]
        bias = jnp.einsum("qkb,bh->hqk", onehot, table.embedding.astype(cfg.dtype))[None]
        if self.decoder:
            bias = jnp.where(jnp.tril(jnp.ones((s, s), bool)), bias, jnp.finfo(bias.dtype).min)
        for i in range(cfg.n_layers):
            x = Block(cfg, self.decoder, name=f"block_{i}")(x, bias, enc)
        return RMSNorm(cfg.norm_eps, cfg.dtype, name="final_layer_norm")(x)


class T5(nn.Module):
    """``(encoder_tokens, decoder_tokens) -> logits [b, S_dec, V]``."""

    cfg: Config

    @nn.compact
    def __call__(self, enc_tokens: jax.Array, dec_tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        shared = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, name="shared",
                          embedding_init=nn.initializers.normal(1.0))
        enc = Stack(cfg, name="encoder")(shared(enc_tokens))
        dec = Stack(cfg, decoder=True, name="decoder")(shared(dec_tokens), enc)
        return shared.attend(dec * cfg.d_model**-0.5)


def loss_fn(logits: jax.Array, enc_tokens: jax.Array, dec_tokens: jax.Array) -> jax.Array:
    """Next-token cross-entropy on the decoder tokens."""
    del enc_tokens
    return _spec.next_token_loss(logits, dec_tokens)


def flops_per_token(cfg: Config) -> float:
    """Training FLOPs per (encoder token + decoder token) pair, with ``S_enc = seq_len``.

    ``6 [L (4 H I + 2 H F) + L (8 H I + 2 H F) + H V] + 12 L I (S_enc + S_dec + S_enc)``: encoder
    and decoder matmuls (``I = heads * d_kv``; cross-attention k/v counted per decoder token),
    the tied LM head, and attention scores/values for encoder self, decoder self and cross attention.
    """
    h, i, f, L = cfg.d_model, cfg.n_heads * cfg.d_kv, cfg.d_ff, cfg.n_layers
    matmul = L * (4 * h * i + 2 * h * f) + L * (8 * h * i + 2 * h * f) + h * cfg.vocab_size
    return 6.0 * matmul + 12.0 * L * i * (2 * cfg.seq_len + cfg.dec_len)


def spec(cfg: Config, batch_size: int, abstract: bool) -> _spec.ModelSpec:
    """Args ``(encoder_tokens, decoder_tokens)``."""

    def build(b: int, abstract: bool, rng: jax.Array | None) -> tuple:
        r1, r2 = jax.random.split(jax.random.PRNGKey(0) if rng is None else rng)
        return (_spec.tokens((b, cfg.seq_len), cfg.vocab_size, abstract, r1),
                _spec.tokens((b, cfg.dec_len), cfg.vocab_size, abstract, r2))

    return _spec.ModelSpec(
        module=T5(cfg), make_args=_spec.args_factory(build, batch_size, abstract),
        loss_fn=loss_fn, config=cfg, kind="linen", abstract=abstract)
