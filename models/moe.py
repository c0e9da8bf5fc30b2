"""GShard-style mixture-of-experts transformer LM with top-2 gating, in Flax linen.

Every ``moe_every``-th block (Alpa: every other one, starting with block 0) replaces the dense MLP
by ``E`` experts. Tokens are cut into groups of ``group_size``; each group dispatches at most
``C = capacity_factor * 2 * group_size / E`` tokens per expert through the GShard einsums::

    gates    gsm,me->gse
    dispatch gsec,gsm->egcm     (one-hot dispatch mask)
    experts  egcm,emf->egcf ; egcf,efm->egcm
    combine  gsec,egcm->gsm     (gate-weighted combine tensor)

The model returns ``(logits, aux_loss)``; the loss is next-token cross-entropy plus
``aux_loss_weight`` times GShard's load-balancing loss. Otherwise the blocks are GPT's (pre-LN,
learned positions, tied embeddings; Alpa's benchmark model is a post-LN BERT encoder with the same
parameter shapes). Module paths: ``wte, wpe, h_i/{ln_1, attn, ln_2, mlp | moe/{gate, wi, wo}}, ln_f``.

>>> import jax, models
>>> spec = models.get("moe", "tiny")
>>> variables = spec.init(jax.random.PRNGKey(0))
>>> logits, aux = spec.module.apply(variables, *spec.make_args())
>>> logits.shape
(2, 16, 64)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import _spec
from models.gpt import MLP, CausalSelfAttention


@dataclasses.dataclass(frozen=True)
class Config:
    """MoE LM hyper-parameters. ``d_ff`` is the width of the dense MLP and of every expert."""

    vocab_size: int = 64
    seq_len: int = 16
    d_model: int = 32
    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 64
    num_experts: int = 4
    group_size: int = 16
    capacity_factor: float = 1.0
    moe_every: int = 2
    aux_loss_weight: float = 0.01
    dropout_rate: float = 0.0
    layer_norm_eps: float = 1e-5
    dtype: Any = jnp.float32

    @property
    def ff(self) -> int:  # the attribute names gpt.MLP / CausalSelfAttention read
        return self.d_ff

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def capacity(self, group: int) -> int:
        return max(1, int(self.capacity_factor * 2 * group / self.num_experts))


def _alpa(h: int, layers: int, experts: int, gpus: int) -> _spec.Preset:
    cfg = Config(vocab_size=32000, seq_len=1024, d_model=h, n_layers=layers, n_heads=16,
                 d_ff=8 * h, num_experts=experts, group_size=2048)
    return _spec.Preset(cfg, 8, note=f"Alpa MoE benchmark (S 1024, V 32000, group 2048, "
                                     f"d_ff 8H), {gpus} GPUs")


PRESETS: dict[str, _spec.Preset] = {
    "tiny": _spec.Preset(Config(), 2, paper=False, note="tests"),
    "moe-380m": _alpa(768, 8, 8, 1),
    "moe-2.4b": _alpa(1024, 16, 16, 8),
    "moe-10b": _alpa(1536, 16, 32, 16),
    "moe-27b": _alpa(2048, 16, 48, 32),
    "moe-70b": _alpa(2048, 32, 64, 64),
}


def top2_gating(gates: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GShard top-2 gating of ``gates [g, s, e]`` (softmax probabilities).

    Returns:
        ``combine [g, s, e, c]`` (gate weights at each token's slot), ``dispatch [g, s, e, c]``
        (its 0/1 mask) and the load-balancing loss ``E^2 mean_e(mean_s gates * mean_s top1)``.
    """
    e = gates.shape[-1]
    idx1 = jnp.argmax(gates, axis=-1)
    mask1 = jax.nn.one_hot(idx1, e, dtype=jnp.int32)
    idx2 = jnp.argmax(jnp.where(mask1 > 0, -jnp.inf, gates), axis=-1)
    mask2 = jax.nn.one_hot(idx2, e, dtype=jnp.int32)
    aux = jnp.mean(jnp.mean(gates, axis=1) * jnp.mean(mask1.astype(gates.dtype), axis=1)) * e * e
    # Slot of each token in its expert's buffer; first choices take precedence over second ones.
    pos1 = jnp.cumsum(mask1, axis=1) - mask1
    mask1 = mask1 * (pos1 < capacity)
    pos2 = jnp.cumsum(mask2, axis=1) - mask2 + jnp.sum(mask1, axis=1, keepdims=True)
    mask2 = mask2 * (pos2 < capacity)
    gate1 = jnp.sum(gates * mask1, axis=-1)
    gate2 = jnp.sum(gates * mask2, axis=-1)
    denom = jnp.maximum(gate1 + gate2, jnp.finfo(gates.dtype).eps)
    combine = 0.0
    for gate, mask, pos in ((gate1 / denom, mask1, pos1), (gate2 / denom, mask2, pos2)):
        slot = jax.nn.one_hot(jnp.sum(pos * mask, axis=-1), capacity, dtype=gates.dtype)
        combine = combine + jnp.einsum("gs,gse,gsc->gsec", gate, mask.astype(gates.dtype), slot)
    dispatch = (combine > 0).astype(gates.dtype)
    return combine, dispatch, aux


class MoELayer(nn.Module):
    """Top-2 routed experts (``wi [e, m, f]``, ``wo [e, f, m]``, gate ``[m, e]``)."""

    cfg: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        b, s, m = x.shape
        e, f = cfg.num_experts, cfg.d_ff
        group = min(cfg.group_size, b * s)
        if (b * s) % group:
            raise ValueError(f"moe: batch * seq = {b * s} tokens is not a multiple of group_size "
                             f"{group}; pick a batch size that makes it one")
        init = nn.initializers.lecun_normal()
        wg = self.param("gate", init, (m, e))
        wi = self.param("wi", init, (e, m, f))
        wo = self.param("wo", init, (e, f, m))
        xs = x.reshape(b * s // group, group, m).astype(cfg.dtype)
        gates = jax.nn.softmax(jnp.einsum("gsm,me->gse", xs, wg.astype(cfg.dtype)), axis=-1)
        combine, dispatch, aux = top2_gating(gates, cfg.capacity(group))
        expert_in = jnp.einsum("gsec,gsm->egcm", dispatch, xs)
        h = nn.relu(jnp.einsum("egcm,emf->egcf", expert_in, wi.astype(cfg.dtype)))
        expert_out = jnp.einsum("egcf,efm->egcm", h, wo.astype(cfg.dtype))
        out = jnp.einsum("gsec,egcm->gsm", combine, expert_out)
        return out.reshape(b, s, m), aux


class Block(nn.Module):
    """Pre-LN block with a dense MLP or an MoE layer. Returns ``(x, aux_loss)``."""

    cfg: Config
    moe: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        ln = lambda name: nn.LayerNorm(cfg.layer_norm_eps, dtype=cfg.dtype, name=name)
        x = x + CausalSelfAttention(cfg, name="attn")(ln("ln_1")(x))
        if self.moe:
            y, aux = MoELayer(cfg, name="moe")(ln("ln_2")(x))
        else:
            y, aux = MLP(cfg, name="mlp")(ln("ln_2")(x)), jnp.zeros((), jnp.float32)
        return x + y, aux


class MoETransformer(nn.Module):
    """``tokens [b, s] -> (logits [b, s, V], aux_loss)``."""

    cfg: Config

    @nn.compact
    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        wte = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, name="wte",
                       embedding_init=nn.initializers.normal(0.02))
        x = wte(tokens) + nn.Embed(cfg.seq_len, cfg.d_model, dtype=cfg.dtype, name="wpe")(
            jnp.arange(tokens.shape[1])[None])
        aux_total = jnp.zeros((), jnp.float32)
        for i in range(cfg.n_layers):
            x, aux = Block(cfg, moe=i % cfg.moe_every == 0, name=f"h_{i}")(x)
            aux_total = aux_total + aux
        x = nn.LayerNorm(cfg.layer_norm_eps, dtype=cfg.dtype, name="ln_f")(x)
        return wte.attend(x), aux_total


def loss_fn(output: tuple[jax.Array, jax.Array], tokens: jax.Array, aux_weight: float = 0.01
            ) -> jax.Array:
    """Next-token cross-entropy + ``aux_weight`` x load-balancing loss."""
    logits, aux = output
    return _spec.next_token_loss(logits, tokens) + aux_weight * aux


def flops_per_token(cfg: Config) -> float:
    """Training FLOPs per token: ``6 N_active + 12 L H S``.

    ``N_active = L 4 H^2 + L_dense 2 H F + L_moe (2 * 2 H F + H E) + H V``: attention projections,
    dense MLPs, two experts per token (top-2, no capacity drops) plus the gate in MoE layers, and
    the tied LM head. Dispatch/combine einsums are not counted.
    """
    h, f, L = cfg.d_model, cfg.d_ff, cfg.n_layers
    n_moe = len(range(0, L, cfg.moe_every))
    active = L * 4 * h * h + (L - n_moe) * 2 * h * f + n_moe * (4 * h * f + h * cfg.num_experts)
    return 6.0 * (active + h * cfg.vocab_size) + 12.0 * L * h * cfg.seq_len


def spec(cfg: Config, batch_size: int, abstract: bool) -> _spec.ModelSpec:
    """Args ``(tokens,)``; output ``(logits, aux_loss)``."""

    def build(b: int, abstract: bool, rng: jax.Array | None) -> tuple:
        return (_spec.tokens((b, cfg.seq_len), cfg.vocab_size, abstract, rng),)

    return _spec.ModelSpec(
        module=MoETransformer(cfg), make_args=_spec.args_factory(build, batch_size, abstract),
        loss_fn=lambda out, tokens: loss_fn(out, tokens, cfg.aux_loss_weight), config=cfg,
        kind="linen", abstract=abstract)
