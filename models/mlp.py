"""A 2-layer MLP (``fc1`` -> GELU -> ``fc2``, hidden 4x) for the parallelization tests.

Linen :class:`MLP` (model ``"mlp"``) and nnx :class:`MLPNnx` (model ``"mlp_nnx"``) share configs
and parameter names. Args are ``(x,)`` with ``x [b, d]``; the loss is the mean square of the
output (a regression onto zero), so gradients reach every parameter.

>>> import jax, models
>>> spec = models.get("mlp", "tiny")
>>> variables = spec.init(jax.random.PRNGKey(0))
>>> jax.tree.map(lambda p: p.shape, variables["params"]["fc1"])
{'bias': (64,), 'kernel': (16, 64)}
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from models import _spec


@dataclasses.dataclass(frozen=True)
class Config:
    """MLP sizes: ``d_model -> 4 d_model -> d_model``."""

    d_model: int = 16
    dtype: Any = jnp.float32

    @property
    def hidden(self) -> int:
        return 4 * self.d_model


PRESETS: dict[str, _spec.Preset] = {
    "tiny": _spec.Preset(Config(), 8, paper=False, note="tests"),
    "medium": _spec.Preset(Config(d_model=1024), 64, paper=False, note="benchmarks on CPU"),
    "large": _spec.Preset(Config(d_model=12288), 2048, note="one GPT-3 175B-width MLP"),
}


class MLP(nn.Module):
    """Linen ``fc1`` (d -> 4d) -> GELU -> ``fc2`` (4d -> d)."""

    cfg: Config

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.gelu(nn.Dense(self.cfg.hidden, dtype=self.cfg.dtype, name="fc1")(x))
        return nn.Dense(self.cfg.d_model, dtype=self.cfg.dtype, name="fc2")(h)


class MLPNnx(nnx.Module):
    """nnx twin of :class:`MLP`."""

    def __init__(self, cfg: Config, *, rngs: nnx.Rngs):
        self.fc1 = nnx.Linear(cfg.d_model, cfg.hidden, dtype=cfg.dtype, rngs=rngs)
        self.fc2 = nnx.Linear(cfg.hidden, cfg.d_model, dtype=cfg.dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(nnx.gelu(self.fc1(x)))


def loss_fn(out: jax.Array, x: jax.Array) -> jax.Array:
    """Mean square of the output."""
    del x
    return jnp.mean(jnp.square(out.astype(jnp.float32)))


def flops_per_token(cfg: Config) -> float:
    """Training FLOPs per example: ``6 * 2 * d * 4d`` (3x forward matmuls; biases ignored)."""
    return 6.0 * 2 * cfg.d_model * cfg.hidden


def _build(cfg: Config):
    def build(b: int, abstract: bool, rng: jax.Array | None) -> tuple:
        return (_spec.normal((b, cfg.d_model), abstract, rng, cfg.dtype),)

    return build


def spec(cfg: Config, batch_size: int, abstract: bool) -> _spec.ModelSpec:
    """Linen ModelSpec."""
    return _spec.ModelSpec(
        module=MLP(cfg), make_args=_spec.args_factory(_build(cfg), batch_size, abstract),
        loss_fn=loss_fn, config=cfg, kind="linen", abstract=abstract)


def spec_nnx(cfg: Config, batch_size: int, abstract: bool) -> _spec.ModelSpec:
    """nnx ModelSpec (``module`` is an :class:`MLPNnx` instance)."""
    make = lambda: MLPNnx(cfg, rngs=nnx.Rngs(0))
    return _spec.ModelSpec(
        module=nnx.eval_shape(make) if abstract else make(),
        make_args=_spec.args_factory(_build(cfg), batch_size, abstract),
        loss_fn=loss_fn, config=cfg, kind="nnx", abstract=abstract)
