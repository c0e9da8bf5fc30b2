"""GPT-2/GPT-3 decoder-only language model in Flax linen.

Learned positions, pre-LN blocks, GELU MLP, embeddings tied with the LM head. Attention heads are
an explicit einsum axis (``bqhd,bkhd->bhqk``) so head splitting is visible in the graph.

Module paths (as they appear in parallelization plans), unrolled form::

    wte, wpe, h_0 .. h_{L-1} / {ln_1, attn/{query,key,value,out}, ln_2, mlp/{c_fc,c_proj}}, ln_f

With ``scan_layers=True`` the blocks are one ``nn.scan`` named ``h`` whose params carry a leading
layer axis; ``remat=True`` wraps each block in ``nn.remat``.

>>> import jax, models
>>> spec = models.get("gpt", "tiny")
>>> (tokens,) = spec.make_args()
>>> variables = spec.init(jax.random.PRNGKey(0))
>>> spec.module.apply(variables, tokens).shape
(2, 16, 64)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import _spec


@dataclasses.dataclass(frozen=True)
class Config:
    """GPT hyper-parameters.

    Attributes:
        vocab_size: V.
        n_positions: length of the learned position table (max context).
        seq_len: sequence length S of the example args (<= n_positions).
        d_model: hidden size H.
        n_layers: L.
        n_heads: attention heads; head_dim = H / n_heads.
        d_ff: MLP width (0 means 4 H).
        dropout_rate: dropout on attention probabilities and residual branches.
        scan_layers: stack the blocks with ``nn.scan`` (one module ``h``) instead of ``h_i``.
        remat: rematerialize each block (``nn.remat``) in the backward pass.
        layer_norm_eps: LayerNorm epsilon.
        dtype: compute dtype (params stay float32).
    """

    vocab_size: int = 64
    n_positions: int = 16
    seq_len: int = 16
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 0
    dropout_rate: float = 0.0
    scan_layers: bool = False
    remat: bool = False
    layer_norm_eps: float = 1e-5
    dtype: Any = jnp.float32

    @property
    def ff(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def _alpa(h: int, layers: int, heads: int, batch: int, note: str) -> _spec.Preset:
    cfg = Config(vocab_size=51200, n_positions=1024, seq_len=1024, d_model=h, n_layers=layers,
                 n_heads=heads)
    return _spec.Preset(cfg, batch, note=f"Alpa GPT benchmark (S 1024, V 51200): {note}")


PRESETS: dict[str, _spec.Preset] = {
    "tiny": _spec.Preset(Config(), 2, paper=False, note="tests"),
    "tiny-dropout": _spec.Preset(Config(dropout_rate=0.1), 2, paper=False, note="tests, dropout"),
    "tiny-scan": _spec.Preset(Config(scan_layers=True, remat=True), 2, paper=False,
                              note="tests, nn.scan + nn.remat"),
    "gpt2-small": _spec.Preset(
        Config(vocab_size=50257, n_positions=1024, seq_len=1024, d_model=768, n_layers=12,
               n_heads=12), 8, note="GPT-2 small, 124,439,808 params"),
    "gpt3-350m": _alpa(1024, 24, 16, 2, "1 GPU, 512 micro-batches"),
    "gpt3-1.3b": _alpa(2048, 24, 32, 8, "4 GPUs, 128 micro-batches"),
    "gpt3-2.6b": _alpa(2560, 32, 32, 8, "8 GPUs, 128 micro-batches"),
    "gpt3-6.7b": _alpa(4096, 32, 32, 16, "16 GPUs, 64 micro-batches"),
    "gpt3-15b": _alpa(5120, 48, 40, 8, "32 GPUs, 128 micro-batches"),
    "gpt3-39b": _alpa(8192, 48, 64, 1, "64 GPUs, 1024 micro-batches"),
    "gpt3-175b": _spec.Preset(
        Config(vocab_size=50257, n_positions=2048, seq_len=2048, d_model=12288, n_layers=96,
               n_heads=96), 1, note="GPT-3 175B (Brown et al. 2020)"),
}


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with heads as an explicit axis."""

    cfg: Config

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
        cfg = self.cfg
        proj = lambda name: nn.DenseGeneral((cfg.n_heads, cfg.head_dim), dtype=cfg.dtype,
                                            name=name)
        q, k, v = proj("query")(x), proj("key")(x), proj("value")(x)  # [b, s, h, d]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(cfg.head_dim).astype(cfg.dtype)
        s = x.shape[1]
        causal = jnp.tril(jnp.ones((s, s), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(cfg.dtype)
        probs = nn.Dropout(cfg.dropout_rate)(probs, deterministic=deterministic)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return nn.DenseGeneral(cfg.d_model, axis=(-2, -1), dtype=cfg.dtype, name="out")(out)


class MLP(nn.Module):
    """GELU feed-forward: ``c_fc`` (H -> F) then ``c_proj`` (F -> H)."""

    cfg: Config

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool = True) -> jax.Array:
        h = nn.gelu(nn.Dense(self.cfg.ff, dtype=self.cfg.dtype, name="c_fc")(x))
        return nn.Dense(self.cfg.d_model, dtype=self.cfg.dtype, name="c_proj")(h)


class Block(nn.Module):
    """Pre-LN transformer block. ``scanned`` makes it return ``(x, None)`` for ``nn.scan``."""

    cfg: Config
    scanned: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, deterministic: bool = True):
        cfg = self.cfg
        drop = nn.Dropout(cfg.dropout_rate)
        ln = lambda name: nn.LayerNorm(cfg.layer_norm_eps, dtype=cfg.dtype, name=name)
        x = x + drop(CausalSelfAttention(cfg, name="attn")(ln("ln_1")(x), deterministic),
                     deterministic=deterministic)
        x = x + drop(MLP(cfg, name="mlp")(ln("ln_2")(x)), deterministic=deterministic)
        return (x, None) if self.scanned else x


def stack_blocks(block_cls: type[nn.Module], cfg: Any, x: jax.Array, deterministic: bool,
                 n_layers: int, prefix: str = "h", **kw) -> jax.Array:
    """Applies ``n_layers`` blocks: unrolled as ``{prefix}_i`` or one ``nn.scan`` ``{prefix}``.

    Must be called inside a compact ``__call__``. ``block_cls(cfg, scanned=..., **kw)`` takes
    ``(x, deterministic)``.
    """
    cls = block_cls
    if cfg.remat:
        cls = nn.remat(cls, static_argnums=(2,), prevent_cse=not cfg.scan_layers)
    if not cfg.scan_layers:
        for i in range(n_layers):
            x = cls(cfg, name=f"{prefix}_{i}", **kw)(x, deterministic)
        return x
    scanned = nn.scan(cls, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True},
                      in_axes=(nn.broadcast,), length=n_layers)
    x, _ = scanned(cfg, scanned=True, name=prefix, **kw)(x, deterministic)
    return x


class GPT(nn.Module):
    """GPT LM: ``tokens [b, s] int32 -> logits [b, s, V]``."""

    cfg: Config

    @nn.compact
    def __call__(self, tokens: jax.Array, deterministic: bool | None = None) -> jax.Array:
        cfg = self.cfg
        if deterministic is None:
            deterministic = cfg.dropout_rate == 0.0
        wte = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, name="wte",
                       embedding_init=nn.initializers.normal(0.02))
        wpe = nn.Embed(cfg.n_positions, cfg.d_model, dtype=cfg.dtype, name="wpe",
                       embedding_init=nn.initializers.normal(0.01))
        x = wte(tokens) + wpe(jnp.arange(tokens.shape[1])[None])
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        x = stack_blocks(Block, cfg, x, deterministic, cfg.n_layers)
        x = nn.LayerNorm(cfg.layer_norm_eps, dtype=cfg.dtype, name="ln_f")(x)
        return wte.attend(x)


def flops_per_token(cfg: Config) -> float:
    """Training FLOPs per token: ``6 (L (4 H^2 + 2 H F) + H V) + 12 L H S``.

    3x the forward matmul FLOPs (2 per multiply-add) of the QKV/out projections, the MLP and the
    tied LM head, plus ``12 L H S`` for attention scores and weighted values over the full S x S
    square (no causal halving). Embedding lookups, biases, norms and softmax are not counted.
    """
    h, f, L = cfg.d_model, cfg.ff, cfg.n_layers
    return 6.0 * (L * (4 * h * h + 2 * h * f) + h * cfg.vocab_size) + 12.0 * L * h * cfg.seq_len


def spec(cfg: Config, batch_size: int, abstract: bool) -> _spec.ModelSpec:
    """The ModelSpec of a GPT config (args: ``(tokens,)``, loss: next-token cross-entropy)."""

    def build(b: int, abstract: bool, rng: jax.Array | None) -> tuple:
        return (_spec.tokens((b, cfg.seq_len), cfg.vocab_size, abstract, rng),)

    return _spec.ModelSpec(
        module=GPT(cfg), make_args=_spec.args_factory(build, batch_size, abstract),
        loss_fn=_spec.next_token_loss, config=cfg, kind="linen", abstract=abstract,
        rng_streams=("dropout",) if cfg.dropout_rate > 0 else ())
