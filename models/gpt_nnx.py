"""GPT in Flax nnx: the same architecture, presets and parameter names as :mod:`models.gpt`.

State paths: ``wte``, ``wpe``, ``h/{i}/{ln_1, attn/{query,key,value,out}, ln_2, mlp/{c_fc,c_proj}}``,
``ln_f``. The LM head is tied to ``wte``.

>>> import models
>>> spec = models.get("gpt_nnx", "tiny")
>>> (tokens,) = spec.make_args()
>>> spec.module(tokens).shape
(2, 16, 64)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models import _spec
from models.gpt import PRESETS, Config, flops_per_token

__all__ = ["GPT", "PRESETS", "Config", "flops_per_token", "spec"]


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention; heads are an explicit einsum axis."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.cfg = cfg
        shape = (cfg.n_heads, cfg.head_dim)
        self.query = nnx.LinearGeneral(cfg.d_model, shape, dtype=cfg.dtype, rngs=rngs)
        self.key = nnx.LinearGeneral(cfg.d_model, shape, dtype=cfg.dtype, rngs=rngs)
        self.value = nnx.LinearGeneral(cfg.d_model, shape, dtype=cfg.dtype, rngs=rngs)
        self.out = nnx.LinearGeneral(shape, cfg.d_model, axis=(-2, -1), dtype=cfg.dtype, rngs=rngs)
        self.dropout = nnx.Dropout(cfg.dropout_rate, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        q, k, v = self.query(x), self.key(x), self.value(x)  # [b, s, h, d]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(cfg.head_dim).astype(cfg.dtype)
        s = x.shape[1]
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, jnp.finfo(scores.dtype).min)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(cfg.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", self.dropout(probs), v)
        return self.out(out)


class MLP(nnx.Module):
    """GELU feed-forward ``c_fc`` -> ``c_proj``."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.c_fc = nnx.Linear(cfg.d_model, cfg.ff, dtype=cfg.dtype, rngs=rngs)
        self.c_proj = nnx.Linear(cfg.ff, cfg.d_model, dtype=cfg.dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.c_proj(nnx.gelu(self.c_fc(x)))


class Block(nnx.Module):
    """Pre-LN transformer block."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        eps = cfg.layer_norm_eps
        self.ln_1 = nnx.LayerNorm(cfg.d_model, epsilon=eps, dtype=cfg.dtype, rngs=rngs)
        self.attn = CausalSelfAttention(cfg, rngs=rngs)
        self.ln_2 = nnx.LayerNorm(cfg.d_model, epsilon=eps, dtype=cfg.dtype, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)
        self.dropout = nnx.Dropout(cfg.dropout_rate, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.dropout(self.attn(self.ln_1(x)))
        return x + self.dropout(self.mlp(self.ln_2(x)))


class GPT(nnx.Module):
    """GPT LM: ``tokens [b, s] int32 -> logits [b, s, V]``."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.wte = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, rngs=rngs,
                             embedding_init=nnx.initializers.normal(0.02))
        self.wpe = nnx.Embed(cfg.n_positions, cfg.d_model, dtype=cfg.dtype, rngs=rngs,
                             embedding_init=nnx.initializers.normal(0.01))
        self.dropout = nnx.Dropout(cfg.dropout_rate, rngs=rngs)
        self.h = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.ln_f = nnx.LayerNorm(cfg.d_model, epsilon=cfg.layer_norm_eps, dtype=cfg.dtype,
                                  rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1])[None])
        x = self.dropout(x)
        for block in self.h:
            x = block(x)
        return self.wte.attend(self.ln_f(x))


def abstract_gpt(cfg: Config) -> GPT:
    """A GPT whose variables are ``jax.ShapeDtypeStruct`` (nothing allocated).

    Built block by block: one ``nnx.eval_shape`` over the whole model gets quadratic in depth
    (nnx inspects tracer shardings on every rng update), so 96 layers would take minutes.
    """
    import dataclasses

    module = nnx.eval_shape(lambda: GPT(dataclasses.replace(cfg, n_layers=0), rngs=nnx.Rngs(0)))
    module.cfg = cfg
    module.h = nnx.List([nnx.eval_shape(lambda i=i: Block(cfg, rngs=nnx.Rngs(params=i, dropout=i)))
                         for i in range(cfg.n_layers)])
    return module


def spec(cfg: Config, batch_size: int, abstract: bool) -> _spec.ModelSpec:
    """nnx ModelSpec: ``module`` is a GPT instance (abstract state when ``abstract``)."""
    module = abstract_gpt(cfg) if abstract else GPT(cfg, rngs=nnx.Rngs(params=0, dropout=1))

    def build(b: int, abstract: bool, rng: jax.Array | None) -> tuple:
        return (_spec.tokens((b, cfg.seq_len), cfg.vocab_size, abstract, rng),)

    return _spec.ModelSpec(
        module=module, make_args=_spec.args_factory(build, batch_size, abstract),
        loss_fn=_spec.next_token_loss, config=cfg, kind="nnx", abstract=abstract)
