"""The fuzzer's random models (``scripts/fuzz_plans.py``): a seeded description of a chain of
blocks (dense, matmul, linear tails, batched matmul, attention, conv, norms, reshape / transpose,
MLP, ``nn.scan`` over layers or time, ``cond``, ``fori_loop``) and the linen module it builds.
Sizes come from ``DIMS`` so that mesh axes of 2 / 4 / 8 divide them."""

from __future__ import annotations

import json
import random
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

DIMS = (2, 4, 8, 16)
BLOCKS = ("dense", "matmul_t", "linear", "linear", "bmm", "attention", "conv1d", "conv2d",
          "layernorm", "reshape", "transpose", "merge", "mlp", "scan_layers", "scan_time", "cond",
          "fori")
LINEAR_TAILS = ("scale", "neg", "div", "swap", "flatten")
HEADS = ("none", "mean_t", "sum_d", "pair")
_NO_PARAMS = ("bmm", "reshape", "transpose")

# ---------------------------------------------------------------------------------- models


def pick(rng: random.Random, options: Any) -> Any:
    return options[rng.randrange(len(options))]


def _gen_block(rng: random.Random, shape: list[int]) -> dict | None:
    """One block applicable to an activation of ``shape`` = [B, T, D] (None: not applicable);
    updates ``shape`` to the block's output shape."""
    _, t, d = shape
    kind = pick(rng, BLOCKS)
    act = pick(rng, ("none", "relu", "gelu", "tanh"))
    if kind in ("dense", "matmul_t", "merge"):
        f = pick(rng, DIMS)
        shape[2] = f
        return {"kind": kind, "features": f, "bias": rng.random() < 0.5, "act": act}
    if kind == "linear":
        f = pick(rng, DIMS)
        shape[2] = f
        tails = [pick(rng, LINEAR_TAILS) for _ in range(rng.randint(1, 3))]
        return {"kind": kind, "features": f, "sum_of_two": rng.random() < 0.4, "tails": tails,
                "act": act}
    if kind == "attention":
        heads, hd = pick(rng, (1, 2, 4)), pick(rng, (2, 4))
        return {"kind": kind, "heads": heads, "head_dim": hd, "causal": rng.random() < 0.4}
    if kind == "conv1d":
        f = pick(rng, DIMS)
        groups = pick(rng, [g for g in (1, 2) if d % g == 0 and f % g == 0])
        shape[2] = f
        return {"kind": kind, "features": f, "kernel": pick(rng, (1, 2, 3)), "groups": groups}
    if kind == "conv2d":
        if t < 4:
            return None
        f = pick(rng, DIMS)
        shape[2] = f
        return {"kind": kind, "features": f, "kernel": pick(rng, (1, 2)), "rows": 2}
    if kind == "reshape":
        options = [(t2, (t * d) // t2) for t2 in DIMS if (t * d) % t2 == 0
                   and (t * d) // t2 in DIMS and t2 != t]
        if not options:
            return None
        shape[1], shape[2] = pick(rng, options)
        return {"kind": kind, "to": list(shape[1:])}
    if kind == "transpose":
        shape[1], shape[2] = d, t
        return {"kind": kind}
    if kind == "layernorm":  # centring 2 features is ill-conditioned: RMS norm there
        return {"kind": kind, "rms": rng.random() < 0.3 or d < 4}
    if kind == "mlp":
        return {"kind": kind, "hidden": pick(rng, DIMS), "act": act}
    if kind == "scan_layers":
        return {"kind": kind, "length": pick(rng, (2, 3))}
    if kind == "fori":
        return {"kind": kind, "steps": pick(rng, (1, 2, 3))}
    return {"kind": kind}  # bmm, scan_time, cond


def gen_model(rng: random.Random, max_blocks: int = 4) -> dict:
    """A random model description: input shape and a chain of 1 to ``max_blocks`` blocks."""
    shape = [pick(rng, DIMS), pick(rng, (2, 4, 8)), pick(rng, DIMS)]
    desc: dict[str, Any] = {"input": list(shape), "blocks": []}
    n = rng.randint(1, max_blocks)
    while len(desc["blocks"]) < n:
        trial = list(shape)
        block = _gen_block(rng, trial)
        if block is not None:
            desc["blocks"].append(block)
            shape = trial
    if all(b["kind"] in _NO_PARAMS for b in desc["blocks"]):  # gradients need a param
        desc["blocks"].append({"kind": "dense", "features": pick(rng, DIMS), "bias": True,
                               "act": "none"})
    desc["head"] = pick(rng, HEADS)
    return desc


def _act(name: str, h: Any) -> Any:
    return {"none": lambda x: x, "relu": nn.relu, "gelu": nn.gelu, "tanh": jnp.tanh}[name](h)


class _Attention(nn.Module):
    heads: int
    head_dim: int
    causal: bool

    @nn.compact
    def __call__(self, h: Any) -> Any:
        proj = (self.heads, self.head_dim)
        q = nn.DenseGeneral(proj, name="query")(h)
        k = nn.DenseGeneral(proj, name="key")(h)
        v = nn.DenseGeneral(proj, name="value")(h)
        s = jnp.einsum("bqhe,bkhe->bhqk", q, k) / np.sqrt(self.head_dim).astype(np.float32)
        if self.causal:
            t = h.shape[1]
            mask = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
            s = jnp.where(mask, s, -1e9)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bhqk,bkhe->bqhe", p, v)
        return nn.DenseGeneral(h.shape[-1], axis=(-2, -1), name="out")(o)


class _Layer(nn.Module):
    """One layer of an ``nn.scan`` stack: carry -> tanh(dense(carry)) + carry."""

    @nn.compact
    def __call__(self, c: Any, _: Any) -> tuple[Any, None]:
        return jnp.tanh(nn.Dense(c.shape[-1])(c)) + c, None


class _RnnCell(nn.Module):
    """One step of an RNN over time: (c, x_t) -> tanh(W c + x_t)."""

    @nn.compact
    def __call__(self, c: Any, x: Any) -> tuple[Any, Any]:
        c = jnp.tanh(nn.Dense(c.shape[-1], use_bias=False)(c) + x)
        return c, c


def _run_block(mdl: nn.Module, i: int, blk: dict, h: Any) -> Any:
    kind, name = blk["kind"], f"b{i}_{blk['kind']}"
    b, t, d = h.shape
    if kind == "dense":
        return _act(blk["act"], nn.Dense(blk["features"], use_bias=blk["bias"], name=name)(h))
    if kind == "matmul_t":
        w = mdl.param(name, nn.initializers.normal(d ** -0.5), (blk["features"], d))
        return _act(blk["act"], h @ w.T)
    if kind == "linear":
        return _act(blk["act"], _linear(mdl, name, blk, h))
    if kind == "merge":
        y = nn.Dense(blk["features"], use_bias=blk["bias"], name=name)(h.reshape(b * t, d))
        return _act(blk["act"], y.reshape(b, t, blk["features"]))
    if kind == "bmm":
        return (h @ jnp.swapaxes(h, -1, -2) / d) @ h / t
    if kind == "attention":
        return _Attention(blk["heads"], blk["head_dim"], blk["causal"], name=name)(h)
    if kind == "conv1d":
        return nn.Conv(blk["features"], (blk["kernel"],), feature_group_count=blk["groups"],
                       name=name)(h)
    if kind == "conv2d":
        rows = blk["rows"]
        y = nn.Conv(blk["features"], (blk["kernel"],) * 2, name=name)(
            h.reshape(b, rows, t // rows, d))
        return y.reshape(b, t, blk["features"])
    if kind == "layernorm":
        if blk["rms"]:
            return nn.RMSNorm(name=name)(h)
        # two-pass variance: flax's default E[x^2] - E[x]^2 cancels, and the single-device
        # program alone is then further than the tolerance from the exact result
        return nn.LayerNorm(use_fast_variance=False, name=name)(h)
    if kind == "reshape":
        return h.reshape(b, *blk["to"])
    if kind == "transpose":
        return jnp.swapaxes(h, 1, 2)
    if kind == "mlp":
        y = _act(blk["act"], nn.Dense(blk["hidden"], name=f"{name}_fc1")(h))
        return h + nn.Dense(d, name=f"{name}_fc2")(y)
    if kind == "scan_layers":
        stack = nn.scan(_Layer, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=blk["length"])
        return stack(name=name)(h, None)[0]
    if kind == "scan_time":
        rnn = nn.scan(_RnnCell, variable_broadcast="params", split_rngs={"params": False},
                      in_axes=1, out_axes=1)
        return rnn(name=name)(jnp.zeros((b, d), h.dtype), h)[1]
    w = mdl.param(name, nn.initializers.normal(d ** -0.5), (d, d))
    if kind == "cond":
        # a weighted mean: a plain one is zero up to rounding after a layer norm
        return jax.lax.cond(jnp.mean(h * _ramp(d)) > 0, lambda x: jnp.tanh(x @ w),
                            lambda x: (x @ w) * 0.5 + x, h)
    # fori: a fixed trip count lowers to a scan (differentiable)
    return jax.lax.fori_loop(0, blk["steps"], lambda _, x: jnp.tanh(x @ w) + x, h)


def _ramp(n: int) -> np.ndarray:
    """Weights 0.5 .. 1.5 along a dim: a sum weighted by them does not cancel to rounding noise
    where a plain sum does (over the features a layer norm normalised)."""
    return np.linspace(0.5, 1.5, n, dtype=np.float32)


def _linear(mdl: nn.Module, name: str, blk: dict, h: Any) -> Any:
    """``h @ w`` (or ``h @ w1 + h @ w2``) through ops linear in it (value-split chains)."""
    b, _, d = h.shape
    init = nn.initializers.normal(d ** -0.5)
    y = h @ mdl.param(name, init, (d, blk["features"]))
    if blk["sum_of_two"]:
        y = y + h @ mdl.param(f"{name}_2", init, (d, blk["features"]))
    for tail in blk["tails"]:
        if tail == "scale":
            y = y * 0.5
        elif tail == "neg":
            y = -y
        elif tail == "div":
            y = y / 3.0
        elif tail == "swap":
            y = jnp.swapaxes(jnp.swapaxes(y, 1, 2) * 2.0, 1, 2)
        else:  # flatten
            y = (y.reshape(b, -1) * 1.5).reshape(y.shape)
    return y


class FuzzNet(nn.Module):
    """The model a description (:func:`gen_model`) names, as JSON text (hashable)."""

    spec: str

    @nn.compact
    def __call__(self, x: Any) -> Any:
        desc = json.loads(self.spec)
        h = x
        for i, blk in enumerate(desc["blocks"]):
            h = _run_block(self, i, blk, h)
        head = desc["head"]
        if head == "mean_t":
            return h.mean(axis=1)
        if head == "sum_d":
            return jnp.sum(h * _ramp(h.shape[-1]), axis=-1)  # a plain sum cancels the same
        if head == "pair":
            return h, jnp.mean(h * h)
        return h


def build_model(desc: dict) -> FuzzNet:
    return FuzzNet(json.dumps(desc, sort_keys=True))
