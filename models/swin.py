"""Swin Transformer (Liu et al. 2021) in Flax linen: shifted windows, relative position bias,
patch merging.

Windows stay an explicit axis ``w`` next to the batch (``[b, w, n, c]``, ``n = window^2``) and heads
an explicit axis ``h``: scores are ``bwnhd,bwmhd->bwhnm``. Odd blocks of a stage roll the feature
map by ``window // 2`` and mask attention between pixels that were not neighbours; when a stage's
resolution is not larger than the window, the window shrinks to it and nothing is shifted.

Module paths: ``patch_embed/{proj, norm}``, ``layers_i/{blocks_j/{norm1, attn/{q,k,v,proj,
relative_position_bias_table}, norm2, fc1, fc2}, downsample/{norm, reduction}}``, ``norm``,
``head``. Args are ``(images [b, H, W, 3], labels [b])``; the module ignores ``labels``.

>>> import jax, models
>>> spec = models.get("swin", "tiny")
>>> variables = spec.init(jax.random.PRNGKey(0))
>>> spec.module.apply(variables, *spec.make_args()).shape
(2, 10)
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
    """Swin hyper-parameters (stage i has ``depths[i]`` blocks, width ``embed_dim * 2^i``)."""

    image_size: int = 32
    patch_size: int = 4
    in_chans: int = 3
    num_classes: int = 10
    embed_dim: int = 16
    depths: tuple[int, ...] = (2, 2)
    num_heads: tuple[int, ...] = (2, 4)
    window_size: int = 4
    mlp_ratio: int = 4
    dtype: Any = jnp.float32


def _nnscaler(layers: int, embed: int, h: int, gpus: int) -> _spec.Preset:
    cfg = Config(image_size=1536, num_classes=1000, embed_dim=embed, depths=(2, 2, layers - 6, 2),
                 num_heads=(h, 2 * h, 4 * h, 8 * h), window_size=48)
    return _spec.Preset(cfg, 1, note=f"nnScaler artifact Swin, {gpus} GPUs (micro-batch 1)")


PRESETS: dict[str, _spec.Preset] = {
    "tiny": _spec.Preset(Config(), 2, paper=False, note="tests"),
    "swin-b": _spec.Preset(Config(image_size=224, num_classes=1000, embed_dim=128,
                                  depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32), window_size=7),
                           32, note="Swin-B 224, 88M params, 15.4 GMACs"),
    "swin-l": _spec.Preset(Config(image_size=224, num_classes=1000, embed_dim=192,
                                  depths=(2, 2, 18, 2), num_heads=(6, 12, 24, 48), window_size=7),
                           32, note="Swin-L 224, 197M params, 34.5 GMACs"),
    "swin-nnscaler-4gpu": _nnscaler(32, 512, 16, 4),
    "swin-nnscaler-8gpu": _nnscaler(40, 768, 24, 8),
    "swin-nnscaler-16gpu": _nnscaler(48, 1024, 32, 16),
    "swin-nnscaler-32gpu": _nnscaler(56, 1536, 32, 32),
}


def _stage_geometry(cfg: Config, stage: int) -> tuple[int, int]:
    """``(resolution, window)`` of a stage."""
    res = cfg.image_size // cfg.patch_size // 2**stage
    return res, min(cfg.window_size, res)


def relative_position_index(window: int) -> jax.Array:
    """``[n, n]`` index into the ``(2w-1)^2`` bias table for every pair of window positions.

    Built with jnp inside the trace (a window of 48 would make a 2304 x 2304 numpy constant).
    """
    r, c = jnp.divmod(jnp.arange(window * window), window)
    dr = r[:, None] - r[None, :] + window - 1
    dc = c[:, None] - c[None, :] + window - 1
    return dr * (2 * window - 1) + dc


def shift_regions(res: int, window: int, shift: int) -> jax.Array:
    """``[windows, n]`` id of the pre-roll region (3 x 3 bands) of each pixel of each window.

    Pixels of one window attend to each other only when their ids match (Swin's -100 mask).
    """
    band = lambda i: (i >= res - window).astype(jnp.int32) + (i >= res - shift)
    idx = jnp.arange(res)
    region = 3 * band(idx)[:, None] + band(idx)[None, :]
    return partition(region[None, :, :, None], window)[0, :, :, 0]


def partition(x: jax.Array, window: int) -> jax.Array:
    """``[b, H, W, c] -> [b, windows, window^2, c]``."""
    b, h, w, c = x.shape
    x = x.reshape(b, h // window, window, w // window, window, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (h // window) * (w // window), window * window, c)


def merge(x: jax.Array, window: int, res: int) -> jax.Array:
    """Inverse of :func:`partition`."""
    b, _, _, c = x.shape
    n = res // window
    x = x.reshape(b, n, n, window, window, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, res, res, c)


class WindowAttention(nn.Module):
    """Multi-head self-attention inside windows with a learned relative position bias."""

    dim: int
    heads: int
    window: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, regions: jax.Array | None) -> jax.Array:
        d = self.dim // self.heads
        proj = lambda name: nn.DenseGeneral((self.heads, d), dtype=self.dtype, name=name)
        q, k, v = proj("q")(x), proj("k")(x), proj("v")(x)  # [b, w, n, h, d]
        scores = jnp.einsum("bwnhd,bwmhd->bwhnm", q, k) * (d**-0.5)
        table = self.param("relative_position_bias_table", nn.initializers.truncated_normal(0.02),
                           ((2 * self.window - 1) ** 2, self.heads))
        bias = table[relative_position_index(self.window)]  # [n, n, h]
        scores = scores + jnp.transpose(bias, (2, 0, 1)).astype(self.dtype)
        if regions is not None:  # [w, n] -> additive mask [w, n, m], broadcast over b and h
            apart = regions[:, :, None] != regions[:, None, :]
            scores = jnp.where(apart[None, :, None], scores - 100.0, scores)
        probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(self.dtype)
        out = jnp.einsum("bwhnm,bwmhd->bwnhd", probs, v)
        return nn.DenseGeneral(self.dim, axis=(-2, -1), dtype=self.dtype, name="proj")(out)


class SwinBlock(nn.Module):
    """(Shifted-)window attention block + MLP, both pre-LN with residuals."""

    cfg: Config
    dim: int
    heads: int
    res: int
    window: int
    shift: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg, res, win, shift = self.cfg, self.res, self.window, self.shift
        b, _, c = x.shape
        h = nn.LayerNorm(1e-5, dtype=cfg.dtype, name="norm1")(x).reshape(b, res, res, c)
        if shift:
            h = jnp.roll(h, (-shift, -shift), axis=(1, 2))
        regions = shift_regions(res, win, shift) if shift else None
        h = WindowAttention(self.dim, self.heads, win, cfg.dtype, name="attn")(
            partition(h, win), regions)
        h = merge(h, win, res)
        if shift:
            h = jnp.roll(h, (shift, shift), axis=(1, 2))
        x = x + h.reshape(b, res * res, c)
        y = nn.LayerNorm(1e-5, dtype=cfg.dtype, name="norm2")(x)
        y = nn.Dense(cfg.mlp_ratio * c, dtype=cfg.dtype, name="fc1")(y)
        y = nn.Dense(c, dtype=cfg.dtype, name="fc2")(nn.gelu(y, approximate=False))
        return x + y


class PatchMerging(nn.Module):
    """2x2 neighbourhood concat -> LayerNorm(4C) -> Linear(4C -> 2C, no bias)."""

    res: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, _, c = x.shape
        x = x.reshape(b, self.res, self.res, c)
        x = jnp.concatenate([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2],
                             x[:, 1::2, 1::2]], axis=-1).reshape(b, -1, 4 * c)
        x = nn.LayerNorm(1e-5, dtype=self.dtype, name="norm")(x)
        return nn.Dense(2 * c, use_bias=False, dtype=self.dtype, name="reduction")(x)


class PatchEmbed(nn.Module):
    """Non-overlapping ``p x p`` patches -> ``embed_dim`` (conv ``proj``) + LayerNorm ``norm``."""

    cfg: Config

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        cfg, p = self.cfg, self.cfg.patch_size
        x = nn.Conv(cfg.embed_dim, (p, p), (p, p), dtype=cfg.dtype, name="proj")(
            images.astype(cfg.dtype))
        x = x.reshape(x.shape[0], -1, cfg.embed_dim)
        return nn.LayerNorm(1e-5, dtype=cfg.dtype, name="norm")(x)


class Stage(nn.Module):
    """Blocks ``blocks_j`` of stage ``index`` (odd ones shifted), then ``downsample`` if not last."""

    cfg: Config
    index: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg, i = self.cfg, self.index
        res, win = _stage_geometry(cfg, i)
        dim, heads = cfg.embed_dim * 2**i, cfg.num_heads[i]
        for j in range(cfg.depths[i]):
            shift = win // 2 if (j % 2 and res > cfg.window_size) else 0
            x = SwinBlock(cfg, dim, heads, res, win, shift, name=f"blocks_{j}")(x)
        if i < len(cfg.depths) - 1:
            x = PatchMerging(res, cfg.dtype, name="downsample")(x)
        return x


class Swin(nn.Module):
    """``(images [b, H, W, 3], labels) -> logits [b, classes]``."""

    cfg: Config

    @nn.compact
    def __call__(self, images: jax.Array, labels: jax.Array | None = None) -> jax.Array:
        del labels  # accepted so that (images, labels) can be passed as one args tuple
        cfg = self.cfg
        x = PatchEmbed(cfg, name="patch_embed")(images)
        for i in range(len(cfg.depths)):
            x = Stage(cfg, i, name=f"layers_{i}")(x)
        x = nn.LayerNorm(1e-5, dtype=cfg.dtype, name="norm")(x).mean(axis=1)
        return nn.Dense(cfg.num_classes, dtype=cfg.dtype, name="head")(x)


def forward_macs(cfg: Config) -> float:
    """Forward multiply-adds per image (the "FLOPs" the Swin paper reports)."""
    res0 = cfg.image_size // cfg.patch_size
    macs = res0 * res0 * cfg.patch_size**2 * cfg.in_chans * cfg.embed_dim
    for i, depth in enumerate(cfg.depths):
        res, win = _stage_geometry(cfg, i)
        t, c = res * res, cfg.embed_dim * 2**i
        macs += depth * (4 * t * c * c + 2 * cfg.mlp_ratio * t * c * c + 2 * t * win * win * c)
        if i < len(cfg.depths) - 1:
            macs += (t // 4) * 4 * c * 2 * c
    return macs + cfg.embed_dim * 2 ** (len(cfg.depths) - 1) * cfg.num_classes


def flops_per_token(cfg: Config) -> float:
    """Training FLOPs per image: ``6 x forward_macs`` (2 FLOPs per MAC, backward = 2 x forward).

    Forward MACs per block: ``4 T C^2`` (q, k, v, proj) ``+ 2 r T C^2`` (MLP) ``+ 2 T N C``
    (scores and values in windows of N pixels), T tokens of width C; plus patch embedding, patch
    merging and the head. Norms, softmax and the bias gather are not counted.
    """
    return 6.0 * forward_macs(cfg)


def spec(cfg: Config, batch_size: int, abstract: bool) -> _spec.ModelSpec:
    """Args ``(images, labels)``; loss: softmax cross-entropy."""

    def build(b: int, abstract: bool, rng: jax.Array | None) -> tuple:
        r1, r2 = jax.random.split(jax.random.PRNGKey(0) if rng is None else rng)
        shape = (b, cfg.image_size, cfg.image_size, cfg.in_chans)
        return (_spec.normal(shape, abstract, r1, cfg.dtype),
                _spec.tokens((b,), cfg.num_classes, abstract, r2))

    return _spec.ModelSpec(
        module=Swin(cfg), make_args=_spec.args_factory(build, batch_size, abstract),
        loss_fn=_spec.classification_loss, config=cfg, kind="linen", abstract=abstract)
