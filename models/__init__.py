"""Model zoo: the seed papers' workloads in Flax, at test size and at paper size.

>>> import models
>>> models.names()[:3]
('gpt', 'gpt_nnx', 'llama')
>>> module, make_args, loss_fn = models.get("mlp", "tiny")
>>> [a.shape for a in make_args()]
[(8, 16)]
>>> models.param_count("gpt", "gpt2-small")
124439808

Paper-size presets default to abstract args (``jax.ShapeDtypeStruct``); nothing of that size is
ever allocated by this package. Model files are imported lazily, on first use.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

from models._spec import ModelSpec, Preset, count

__all__ = [
    "ModelSpec",
    "Preset",
    "flops_per_token",
    "flops_unit",
    "get",
    "names",
    "param_count",
    "preset_info",
    "presets",
]

# name -> (python module, its spec builder, unit of flops_per_token)
_MODELS: dict[str, tuple[str, str, str]] = {
    "gpt": ("models.gpt", "spec", "token"),
    "gpt_nnx": ("models.gpt_nnx", "spec", "token"),
    "llama": ("models.llama", "spec", "token"),
    "swin": ("models.swin", "spec", "image"),
    "evoformer": ("models.evoformer", "spec", "sample"),
    "t5": ("models.t5", "spec", "token"),
    "moe": ("models.moe", "spec", "token"),
    "wide_resnet": ("models.wide_resnet", "spec", "image"),
    "mlp": ("models.mlp", "spec", "example"),
    "mlp_nnx": ("models.mlp", "spec_nnx", "example"),
}


def names() -> tuple[str, ...]:
    """All model names, in registry order."""
    return tuple(_MODELS)


def _module(name: str):
    if name not in _MODELS:
        raise KeyError(f"unknown model {name!r}; known models: {', '.join(_MODELS)}")
    return importlib.import_module(_MODELS[name][0])


def presets(name: str) -> tuple[str, ...]:
    """Preset names of model ``name`` (``tiny`` first)."""
    return tuple(_module(name).PRESETS)


def preset_info(name: str, preset_name: str) -> Preset:
    """The :class:`Preset` (config, default batch size, paper flag, note)."""
    table = _module(name).PRESETS
    if preset_name not in table:
        raise KeyError(f"model {name!r} has no preset {preset_name!r}; presets: {', '.join(table)}")
    return table[preset_name]


def get(name: str, preset: str, *, abstract: bool | None = None, batch_size: int | None = None,
        **overrides) -> ModelSpec:
    """Builds the :class:`ModelSpec` ``(module, make_args, loss_fn)`` of ``name`` at ``preset``.

    Args:
        name: one of :func:`names`.
        preset: one of :func:`presets` ``(name)``.
        abstract: default of ``make_args(abstract=...)``; ``None`` means True for paper presets
            and False for ``tiny*``.
        batch_size: default batch size of ``make_args``; ``None`` takes the preset's.
        **overrides: config fields to replace, e.g. ``scan_layers=True`` or ``dropout_rate=0.1``.

    Returns:
        A frozen ModelSpec; it unpacks as ``module, make_args, loss_fn``.
    """
    mod = _module(name)
    p = preset_info(name, preset)
    cfg = dataclasses.replace(p.config, **overrides) if overrides else p.config
    abstract = p.paper if abstract is None else abstract
    spec = getattr(mod, _MODELS[name][1])(cfg, p.batch_size if batch_size is None else batch_size, abstract)
    return dataclasses.replace(spec, name=name, preset=preset)


@functools.cache
def param_count(name: str, preset: str) -> int:
    """Number of trainable parameters (the ``params`` collection) via ``jax.eval_shape`` of init.

    Stacks layers with ``nn.scan`` when the config supports it (same count, faster tracing).
    """
    cfg = preset_info(name, preset).config
    fields = {f.name for f in dataclasses.fields(cfg)}
    over = {"scan_layers": True} if "scan_layers" in fields else {}
    spec = get(name, preset, abstract=True, batch_size=1, **over)
    variables = spec.init_abstract()
    if spec.kind == "nnx":
        from flax import nnx

        return count(nnx.state(spec.module, nnx.Param))
    return count(variables.get("params", {}))


def flops_per_token(name: str, preset: str) -> float:
    """Analytic training FLOPs (forward + backward) per unit (see :func:`flops_unit`).

    Each model documents its formula in its ``flops_per_token`` docstring; transformers use
    ``6 N_matmul + 12 L H S`` style counts (3x the forward matmul FLOPs).
    """
    return float(_module(name).flops_per_token(preset_info(name, preset).config))


def flops_unit(name: str) -> str:
    """What :func:`flops_per_token` counts per: ``token``, ``image``, ``sample`` or ``example``."""
    _module(name)
    return _MODELS[name][2]

