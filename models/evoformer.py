"""AlphaFold2 Evoformer stack (Jumper et al. 2021, supplement Alg. 6-14) in Flax linen.

Each block updates the MSA representation ``m [b, s, r, c_m]`` and the pair representation
``z [b, r, r, c_z]``::

    m += msa_row_attn(m, z)      row attention with pair bias   bsihc,bsjhc->bshij
    m += msa_col_attn(m)         column attention               bsihc,btihc->bihst
    m += msa_transition(m)
    z += outer_product_mean(m)                                  bsic,bsjd->bijcd
    z += tri_mul_out(z)          triangle update, outgoing      bikc,bjkc->bijc
    z += tri_mul_in(z)           triangle update, incoming      bkic,bkjc->bijc
    z += tri_att_start(z)        triangle attention, starting   bijhc,bikhc->bhijk
    z += tri_att_end(z)          triangle attention, ending     bijhc,bkjhc->bhijk
    z += pair_transition(z)

Dropout and masks are left out (full crops). Args are ``(msa, pair)`` activations; the module returns
the updated pair and the loss is the mean square of both outputs (a synthetic regression).
Blocks are ``blocks_i``; ``scan_layers`` stacks them into one ``nn.scan`` named ``blocks``.

>>> import jax, models
>>> spec = models.get("evoformer", "tiny")
>>> variables = spec.init(jax.random.PRNGKey(0))
>>> m, z = spec.module.apply(variables, *spec.make_args())
>>> m.shape, z.shape
((1, 4, 8, 16), (1, 8, 8, 8))
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
    """Evoformer sizes: ``n_seq`` (s) MSA rows, ``n_res`` (r) residues."""

    n_seq: int = 4
    n_res: int = 8
    c_m: int = 16
    c_z: int = 8
    n_blocks: int = 2
    msa_heads: int = 2
    msa_head_dim: int = 4
    tri_heads: int = 2
    tri_head_dim: int = 4
    c_opm: int = 4
    c_tri_mul: int = 8
    transition_n: int = 4
    scan_layers: bool = False
    remat: bool = False
    dtype: Any = jnp.float32


_AF2 = {"c_m": 256, "c_z": 128, "n_blocks": 48, "msa_heads": 8, "msa_head_dim": 32, "tri_heads": 4,
            "tri_head_dim": 32, "c_opm": 32, "c_tri_mul": 128}

PRESETS: dict[str, _spec.Preset] = {
    "tiny": _spec.Preset(Config(), 1, paper=False, note="tests"),
    "af2-initial": _spec.Preset(Config(n_seq=128, n_res=256, **_AF2), 1,
                                note="AlphaFold2 initial training: s 128, r 256"),
    "af2-finetune": _spec.Preset(Config(n_seq=512, n_res=256, **_AF2), 1,
                                 note="nnScaler fine-tune shape: s 512, r 256"),
    "af2-finetune-384": _spec.Preset(Config(n_seq=512, n_res=384, **_AF2), 1,
                                     note="AlphaFold2 fine-tuning: s 512, r 384"),
}


def _dense(features, name: str, cfg: Config, bias: bool = True, axis: Any = -1) -> nn.Module:
    return nn.DenseGeneral(features, axis=axis, use_bias=bias, dtype=cfg.dtype, name=name)


class GatedAttention(nn.Module):
    """Gated multi-head attention over one axis of a 2-D grid, with an optional bias.

    ``x [b, a, i, c]`` attends along ``i`` for every ``a`` (``transpose`` swaps the two axes first,
    so ``a`` is attended instead). ``bias [b, h, i, j]`` is added to every ``a``.
    """

    cfg: Config
    heads: int
    head_dim: int
    transpose: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, bias: jax.Array | None = None) -> jax.Array:
        cfg, h, d = self.cfg, self.heads, self.head_dim
        x = nn.LayerNorm(dtype=cfg.dtype, name="norm")(x)
        q = _dense((h, d), "q", cfg, bias=False)(x) * d**-0.5
        k = _dense((h, d), "k", cfg, bias=False)(x)
        v = _dense((h, d), "v", cfg, bias=False)(x)
        g = jax.nn.sigmoid(_dense((h, d), "gate", cfg)(x))
        if self.transpose:  # attend along axis 1 (e.g. MSA columns / ending node)
            scores = jnp.einsum("bsihc,btihc->bihst", q, k)
        else:
            scores = jnp.einsum("bsihc,bsjhc->bshij", q, k)
        if bias is not None:
            scores = scores + bias[:, None]
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(cfg.dtype)
        if self.transpose:
            o = jnp.einsum("bihst,btihc->bsihc", probs, v)
        else:
            o = jnp.einsum("bshij,bsjhc->bsihc", probs, v)
        return _dense(x.shape[-1], "out", cfg, axis=(-2, -1))(g * o)


class Transition(nn.Module):
    """LayerNorm -> Linear(n c) -> ReLU -> Linear(c)."""

    cfg: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = x.shape[-1]
        x = nn.LayerNorm(dtype=self.cfg.dtype, name="norm")(x)
        x = nn.relu(_dense(self.cfg.transition_n * c, "fc1", self.cfg)(x))
        return _dense(c, "fc2", self.cfg)(x)


class OuterProductMean(nn.Module):
    """``z_ij = Linear(mean_s a_si (x) b_sj)`` with ``a, b`` of width ``c_opm``."""

    cfg: Config

    @nn.compact
    def __call__(self, m: jax.Array) -> jax.Array:
        cfg = self.cfg
        m = nn.LayerNorm(dtype=cfg.dtype, name="norm")(m)
        a, b = _dense(cfg.c_opm, "a", cfg)(m), _dense(cfg.c_opm, "b", cfg)(m)
        outer = jnp.einsum("bsic,bsjd->bijcd", a, b) / m.shape[1]
        return _dense(cfg.c_z, "out", cfg, axis=(-2, -1))(outer)


class TriangleMultiplication(nn.Module):
    """Triangle multiplicative update, ``outgoing`` (``bikc,bjkc->bijc``) or incoming."""

    cfg: Config
    outgoing: bool = True

    @nn.compact
    def __call__(self, z: jax.Array) -> jax.Array:
        cfg, c = self.cfg, self.cfg.c_tri_mul
        z = nn.LayerNorm(dtype=cfg.dtype, name="norm_in")(z)
        a = jax.nn.sigmoid(_dense(c, "a_gate", cfg)(z)) * _dense(c, "a_proj", cfg)(z)
        b = jax.nn.sigmoid(_dense(c, "b_gate", cfg)(z)) * _dense(c, "b_proj", cfg)(z)
        eq = "bikc,bjkc->bijc" if self.outgoing else "bkic,bkjc->bijc"
        x = nn.LayerNorm(dtype=cfg.dtype, name="norm_out")(jnp.einsum(eq, a, b))
        return jax.nn.sigmoid(_dense(cfg.c_z, "gate", cfg)(z)) * _dense(cfg.c_z, "out", cfg)(x)


class TriangleAttention(nn.Module):
    """Triangle attention around the starting node (rows) or the ending node (columns)."""

    cfg: Config
    starting: bool = True

    @nn.compact
    def __call__(self, z: jax.Array) -> jax.Array:
        cfg = self.cfg
        bias = _dense(cfg.tri_heads, "bias", cfg, bias=False)(
            nn.LayerNorm(dtype=cfg.dtype, name="norm_bias")(z))  # [b, j, k, h]
        # starting: scores[b, i, h, j, k] + bias_jk ; ending: scores[b, j, h, i, k] + bias_ki
        bias = jnp.transpose(bias, (0, 3, 1, 2) if self.starting else (0, 3, 2, 1))
        att = GatedAttention(cfg, cfg.tri_heads, cfg.tri_head_dim, transpose=not self.starting,
                             name="attn")
        return att(z, bias)


class EvoformerBlock(nn.Module):
    """One Evoformer block on the carry ``(m, z)``."""

    cfg: Config
    scanned: bool = False

    @nn.compact
    def __call__(self, carry: tuple[jax.Array, jax.Array], deterministic: bool = True):
        cfg = self.cfg
        m, z = carry
        pair_bias = _dense(cfg.msa_heads, "msa_row_pair_bias", cfg, bias=False)(
            nn.LayerNorm(dtype=cfg.dtype, name="msa_row_pair_norm")(z))  # [b, i, j, h]
        m = m + GatedAttention(cfg, cfg.msa_heads, cfg.msa_head_dim, name="msa_row_attn")(
            m, jnp.transpose(pair_bias, (0, 3, 1, 2)))
        m = m + GatedAttention(cfg, cfg.msa_heads, cfg.msa_head_dim, transpose=True,
                               name="msa_col_attn")(m)
        m = m + Transition(cfg, name="msa_transition")(m)
        z = z + OuterProductMean(cfg, name="outer_product_mean")(m)
        z = z + TriangleMultiplication(cfg, True, name="tri_mul_out")(z)
        z = z + TriangleMultiplication(cfg, False, name="tri_mul_in")(z)
        z = z + TriangleAttention(cfg, True, name="tri_att_start")(z)
        z = z + TriangleAttention(cfg, False, name="tri_att_end")(z)
        z = z + Transition(cfg, name="pair_transition")(z)
        return ((m, z), None) if self.scanned else (m, z)


class Evoformer(nn.Module):
    """``(msa [b, s, r, c_m], pair [b, r, r, c_z]) -> (msa, pair)``."""

    cfg: Config

    @nn.compact
    def __call__(self, msa: jax.Array, pair: jax.Array) -> tuple[jax.Array, jax.Array]:
        cfg = self.cfg
        carry = (msa.astype(cfg.dtype), pair.astype(cfg.dtype))
        return stack_blocks(EvoformerBlock, cfg, carry, True, cfg.n_blocks, prefix="blocks")


def loss_fn(out: tuple[jax.Array, jax.Array], msa: jax.Array, pair: jax.Array) -> jax.Array:
    """Synthetic loss: mean square of the updated MSA and pair representations."""
    del msa, pair
    m, z = out
    return jnp.mean(jnp.square(m.astype(jnp.float32))) + jnp.mean(jnp.square(z.astype(jnp.float32)))


def forward_macs(cfg: Config) -> float:
    """Forward multiply-adds of the matmuls and einsums of one sample (norms, softmax excluded)."""
    s, r, cm, cz = cfg.n_seq, cfg.n_res, cfg.c_m, cfg.c_z
    hm = cfg.msa_heads * cfg.msa_head_dim
    ht, n = cfg.tri_heads * cfg.tri_head_dim, cfg.transition_n
    row = 5 * s * r * cm * hm + r * r * cz * cfg.msa_heads + 2 * s * r * r * hm
    col = 5 * s * r * cm * hm + 2 * r * s * s * hm
    opm = 2 * s * r * cm * cfg.c_opm + r * r * s * cfg.c_opm**2 + r * r * cfg.c_opm**2 * cz
    tri_mul = 4 * r * r * cz * cfg.c_tri_mul + r * r * cz * cz + r**3 * cfg.c_tri_mul \
        + r * r * cfg.c_tri_mul * cz
    tri_att = 5 * r * r * cz * ht + r * r * cz * cfg.tri_heads + 2 * r**3 * ht
    transitions = 2 * s * r * cm * n * cm + 2 * r * r * cz * n * cz
    return cfg.n_blocks * (row + col + opm + 2 * tri_mul + 2 * tri_att + transitions)


def flops_per_token(cfg: Config) -> float:
    """Training FLOPs per sample (one crop): ``6 x forward_macs``.

    Per block (s seqs, r residues, attention widths ``H c``): MSA row/column attention
    ``5 s r c_m H c`` projections + ``2 s r^2 H c`` / ``2 r s^2 H c`` scores and values, outer product
    mean ``r^2 s c_opm^2``, triangle updates ``r^3 c_tri_mul`` each, triangle attention
    ``2 r^3 H c`` each, plus all projections and transitions (see :func:`forward_macs`).
    """
    return 6.0 * forward_macs(cfg)


def spec(cfg: Config, batch_size: int, abstract: bool) -> _spec.ModelSpec:
    """Args ``(msa, pair)`` as standard-normal activations."""

    def build(b: int, abstract: bool, rng: jax.Array | None) -> tuple:
        r1, r2 = jax.random.split(jax.random.PRNGKey(0) if rng is None else rng)
        return (_spec.normal((b, cfg.n_seq, cfg.n_res, cfg.c_m), abstract, r1, cfg.dtype),
                _spec.normal((b, cfg.n_res, cfg.n_res, cfg.c_z), abstract, r2, cfg.dtype))

    return _spec.ModelSpec(
        module=Evoformer(cfg), make_args=_spec.args_factory(build, batch_size, abstract),
        loss_fn=loss_fn, config=cfg, kind="linen", abstract=abstract)
