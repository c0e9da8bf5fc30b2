"""Wide-ResNet (bottleneck ResNet-v1 with a widened 3x3 conv) in Flax linen, as benchmarked by Alpa.

A bottleneck block maps ``C_in -> f`` (1x1) ``-> f * width`` (3x3, strided) ``-> 4 f`` (1x1) with
BatchNorm after every conv and a projected shortcut when shapes change; stage ``i`` uses
``f = num_filters * 2^i``. BatchNorm runs in training mode, so ``apply`` needs
``mutable=["batch_stats"]`` (``ModelSpec.mutable``; ``ModelSpec.apply`` passes it).

Module paths: ``conv_init, bn_init, stage{i}_block{j}/{conv_0, bn_0, conv_1, bn_1, conv_2, bn_2,
conv_proj, norm_proj}, head``. Args are ``(images [b, H, W, 3], labels [b])``.

>>> import jax, models
>>> spec = models.get("wide_resnet", "tiny")
>>> variables = spec.init(jax.random.PRNGKey(0))
>>> logits, state = spec.apply(variables, *spec.make_args())
>>> logits.shape, list(state)
((2, 10), ['batch_stats'])
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import _spec

STAGES: dict[int, tuple[int, ...]] = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}


@dataclasses.dataclass(frozen=True)
class Config:
    """Wide-ResNet sizes (``stage_sizes`` bottleneck blocks per stage)."""

    image_size: int = 32
    num_classes: int = 10
    stage_sizes: tuple[int, ...] = (1, 1)
    num_filters: int = 8
    width_factor: int = 2
    train: bool = True
    dtype: Any = jnp.float32


def _alpa(depth: int, channels: int, width: int, gpus: int) -> _spec.Preset:
    cfg = Config(image_size=224, num_classes=1000, stage_sizes=STAGES[depth],
                 num_filters=channels, width_factor=width)
    return _spec.Preset(cfg, 32, note=f"Alpa WResNet benchmark (depth {depth}, C {channels},"
                                              f" W {width}), {gpus} GPUs, global batch 1536")


PRESETS: dict[str, _spec.Preset] = {
    "tiny": _spec.Preset(Config(), 2, paper=False, note="tests"),
    "wrn-250m": _alpa(50, 160, 2, 1),
    "wrn-2b": _alpa(50, 448, 2, 8),
    "wrn-4b": _alpa(50, 640, 2, 16),
    "wrn-6.8b": _alpa(50, 320, 16, 32),
    "wrn-13b": _alpa(101, 320, 16, 64),
}


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (strided, ``width`` x wider) -> 1x1 (4 f) with BatchNorm; ReLU after the sum."""

    filters: int
    width: int
    strides: tuple[int, int]
    cfg: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.cfg.dtype)
        norm = functools.partial(nn.BatchNorm, use_running_average=not self.cfg.train,
                                 momentum=0.9, epsilon=1e-5, dtype=self.cfg.dtype)
        f = self.filters
        y = nn.relu(norm(name="bn_0")(conv(f, (1, 1), name="conv_0")(x)))
        y = conv(f * self.width, (3, 3), self.strides, name="conv_1")(y)
        y = nn.relu(norm(name="bn_1")(y))
        y = norm(scale_init=nn.initializers.zeros, name="bn_2")(conv(4 * f, (1, 1), name="conv_2")(y))
        if x.shape != y.shape:
            x = norm(name="norm_proj")(conv(4 * f, (1, 1), self.strides, name="conv_proj")(x))
        return nn.relu(x + y)


class WideResNet(nn.Module):
    """``(images [b, H, W, 3], labels) -> logits [b, classes]``."""

    cfg: Config

    @nn.compact
    def __call__(self, images: jax.Array, labels: jax.Array | None = None) -> jax.Array:
        del labels  # accepted so that (images, labels) can be passed as one args tuple
        cfg = self.cfg
        x = nn.Conv(cfg.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], use_bias=False,
                    dtype=cfg.dtype, name="conv_init")(images.astype(cfg.dtype))
        x = nn.BatchNorm(use_running_average=not cfg.train, momentum=0.9, epsilon=1e-5,
                         dtype=cfg.dtype, name="bn_init")(x)
        x = nn.max_pool(nn.relu(x), (3, 3), strides=(2, 2), padding="SAME")
        for i, n in enumerate(cfg.stage_sizes):
            for j in range(n):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = Bottleneck(cfg.num_filters * 2**i, cfg.width_factor, strides, cfg,
                               name=f"stage{i}_block{j}")(x)
        return nn.Dense(cfg.num_classes, dtype=cfg.dtype, name="head")(jnp.mean(x, axis=(1, 2)))


def forward_macs(cfg: Config) -> float:
    """Forward multiply-adds of the convolutions and the head for one image."""
    res = cfg.image_size // 2
    macs = res * res * 49 * 3 * cfg.num_filters
    res, c_in = -(-res // 2), cfg.num_filters
    for i, n in enumerate(cfg.stage_sizes):
        f = cfg.num_filters * 2**i
        for j in range(n):
            out = -(-res // 2) if i > 0 and j == 0 else res
            macs += res * res * c_in * f + out * out * (9 * f * f * cfg.width_factor
                                                        + 4 * f * f * cfg.width_factor)
            if c_in != 4 * f or out != res:
                macs += out * out * c_in * 4 * f
            res, c_in = out, 4 * f
    return macs + c_in * cfg.num_classes


def flops_per_token(cfg: Config) -> float:
    """Training FLOPs per image: ``6 x forward_macs`` (conv MACs ``H_out W_out k^2 C_in C_out``).

    The strided 3x3 conv sits in the first block of stages 1..; BatchNorm, ReLU and pooling are
    not counted.
    """
    return 6.0 * forward_macs(cfg)


def spec(cfg: Config, batch_size: int, abstract: bool) -> _spec.ModelSpec:
    """Args ``(images, labels)``; training mode mutates ``batch_stats``."""

    def build(b: int, abstract: bool, rng: jax.Array | None) -> tuple:
        r1, r2 = jax.random.split(jax.random.PRNGKey(0) if rng is None else rng)
        shape = (b, cfg.image_size, cfg.image_size, 3)
        return (_spec.normal(shape, abstract, r1, cfg.dtype),
                _spec.tokens((b,), cfg.num_classes, abstract, r2))

    return _spec.ModelSpec(
        module=WideResNet(cfg), make_args=_spec.args_factory(build, batch_size, abstract),
        loss_fn=_spec.classification_loss, config=cfg, kind="linen", abstract=abstract,
        mutable=("batch_stats",) if cfg.train else ())
