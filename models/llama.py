"""Llama-2 / Llama-3 decoder in Flax linen: RMSNorm, rotary embeddings, SwiGLU, grouped-query attention.

Module paths (Hugging Face-like names), unrolled form::

    embed_tokens, layers_0 .. layers_{L-1} / {input_layernorm, self_attn/{q_proj,k_proj,v_proj,o_proj},
    post_attention_layernorm, mlp/{gate_proj,up_proj,down_proj}}, norm, lm_head

``scan_layers=True`` stacks the layers into one ``nn.scan`` named ``layers``. Attention keeps the
kv-head axis ``n`` and the group axis ``g`` explicit: ``bqngd,bknd->bngqk``.

>>> import jax, models
>>> spec = models.get("llama", "tiny")
>>> variables = spec.init(jax.random.PRNGKey(0))
>>> spec.module.apply(variables, *spec.make_args()).shape
(2, 16, 64)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import _spec
from models.gpt import stack_blocks


@dataclasses.dataclass(frozen=True)
class Config:
    """Llama hyper-parameters (H = d_model, F = d_ff, head_dim = H / n_heads)."""

    vocab_size: int = 64
    seq_len: int = 16
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    d_ff: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    scan_layers: bool = False
    remat: bool = False
    dtype: Any = jnp.float32

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


_L2 = {"vocab_size": 32000, "seq_len": 4096, "rope_theta": 10000.0}
_L3 = {"vocab_size": 128256, "seq_len": 8192, "rope_theta": 500000.0, "n_kv_heads": 8}

PRESETS: dict[str, _spec.Preset] = {
    "tiny": _spec.Preset(Config(), 2, paper=False, note="tests"),
    "tiny-scan": _spec.Preset(Config(scan_layers=True, remat=True), 2, paper=False,
                              note="tests, nn.scan + nn.remat"),
    "llama-7b": _spec.Preset(Config(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                                    d_ff=11008, **_L2), 1, note="Llama-2-7B, 6,738,415,616"),
    "llama-70b": _spec.Preset(Config(d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                                     d_ff=28672, **_L2), 1, note="Llama-2-70B, 68,976,648,192"),
    "llama3-8b": _spec.Preset(Config(d_model=4096, n_layers=32, n_heads=32, d_ff=14336, **_L3),
                              1, note="Llama-3-8B, 8,030,261,248"),
    "llama3-8b-128k": _spec.Preset(
        Config(d_model=4096, n_layers=32, n_heads=32, d_ff=14336, **{**_L3, "seq_len": 131072}),
        1, note="nnScaler long-sequence run: Llama-3-8B at 128K tokens, 8 x H100"),
    "llama3-70b": _spec.Preset(Config(d_model=8192, n_layers=80, n_heads=64, d_ff=28672, **_L3),
                               1, note="Llama-3-70B, 70,553,706,496"),
}


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` (no bias, no mean subtraction)."""

    eps: float = 1e-5
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.param("weight", nn.initializers.ones, (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return (y * w).astype(self.dtype)


def rotary(x: jax.Array, theta: float) -> jax.Array:
    """Rotary position embedding of ``x [b, s, ..., d]`` (rotate-half convention)."""
    s, d = x.shape[1], x.shape[-1]
    inv = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    ang = jnp.einsum("s,f->sf", jnp.arange(s, dtype=jnp.float32), inv)
    ang = jnp.concatenate([ang, ang], axis=-1).reshape((1, s) + (1,) * (x.ndim - 3) + (d,))
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x * jnp.cos(ang) + rotated * jnp.sin(ang)).astype(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention with rotary embeddings."""

    cfg: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        n, g, d = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
        dense = lambda shape, name: nn.DenseGeneral(shape, use_bias=False, dtype=cfg.dtype,
                                                    name=name)
        q = rotary(dense((n, g, d), "q_proj")(x), cfg.rope_theta)  # [b, q, n, g, d]
        k = rotary(dense((n, d), "k_proj")(x), cfg.rope_theta)  # [b, k, n, d]
        v = dense((n, d), "v_proj")(x)
        scores = jnp.einsum("bqngd,bknd->bngqk", q, k) / jnp.sqrt(d).astype(cfg.dtype)
        s = x.shape[1]
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, jnp.finfo(scores.dtype).min)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(cfg.dtype)
        out = jnp.einsum("bngqk,bknd->bqngd", probs, v)
        return nn.DenseGeneral(cfg.d_model, axis=(-3, -2, -1), use_bias=False, dtype=cfg.dtype,
                               name="o_proj")(out)


class SwiGLU(nn.Module):
    """``down_proj(silu(gate_proj x) * up_proj x)``."""

    cfg: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        dense = lambda f, name: nn.Dense(f, use_bias=False, dtype=cfg.dtype, name=name)
        h = nn.silu(dense(cfg.d_ff, "gate_proj")(x)) * dense(cfg.d_ff, "up_proj")(x)
        return dense(cfg.d_model, "down_proj")(h)


class DecoderLayer(nn.Module):
    """Pre-RMSNorm attention + SwiGLU block (``scanned`` returns ``(x, None)`` for ``nn.scan``)."""

    cfg: Config
    scanned: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool = True):
        cfg = self.cfg
        x = x + Attention(cfg, name="self_attn")(
            RMSNorm(cfg.norm_eps, cfg.dtype, name="input_layernorm")(x))
        x = x + SwiGLU(cfg, name="mlp")(
            RMSNorm(cfg.norm_eps, cfg.dtype, name="post_attention_layernorm")(x))
        return (x, None) if self.scanned else x


class Llama(nn.Module):
    """Llama LM: ``tokens [b, s] int32 -> logits [b, s, V]`` (untied LM head)."""

    cfg: Config

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        x = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, name="embed_tokens")(tokens)
        x = stack_blocks(DecoderLayer, cfg, x, True, cfg.n_layers, prefix="layers")
        x = RMSNorm(cfg.norm_eps, cfg.dtype, name="norm")(x)
        return nn.Dense(cfg.vocab_size, use_bias=False, dtype=cfg.dtype, name="lm_head")(x)


def flops_per_token(cfg: Config) -> float:
    """Training FLOPs per token: ``6 N_matmul + 12 L H S``.

    ``N_matmul = L (2 H^2 + 2 H n_kv d_head + 3 H F) + H V`` (q/o, k/v, SwiGLU, LM head), times 6
    for forward + backward; ``12 L H S`` is attention over the full S x S square.
    """
    h, L = cfg.d_model, cfg.n_layers
    n = L * (2 * h * h + 2 * h * cfg.n_kv_heads * cfg.head_dim + 3 * h * cfg.d_ff)
    return 6.0 * (n + h * cfg.vocab_size) + 12.0 * L * h * cfg.seq_len


def spec(cfg: Config, batch_size: int, abstract: bool) -> _spec.ModelSpec:
    """Args ``(tokens,)``; loss: next-token cross-entropy."""

    def build(b: int, abstract: bool, rng: jax.Array | None) -> tuple:
        return (_spec.tokens((b, cfg.seq_len), cfg.vocab_size, abstract, rng),)

    return _spec.ModelSpec(
        module=Llama(cfg), make_args=_spec.args_factory(build, batch_size, abstract),
        loss_fn=_spec.next_token_loss, config=cfg, kind="linen", abstract=abstract)
