"""Every equation of real programs (forward and gradient) has a rule whose annotation binds, and
splitting along every splittable identifier reproduces the unsplit result numerically."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jcore
from rule_helpers import CONTROL_FLOW, eqn_anno, walk

from nnscaler_jax.ir.anno import Anno, DimKind


class _CNN(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Conv(8, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=False)(x)
        x = nn.avg_pool(x, (2, 2), (2, 2))
        x = nn.max_pool(x, (2, 2), (1, 1))
        x = nn.Conv(8, (3, 3), feature_group_count=8)(x)  # depthwise
        x = nn.Conv(8, (1, 1), feature_group_count=2)(x)  # grouped, pointwise
        x = nn.Dropout(0.5, deterministic=False)(x)
        return x.sum()


NAMES = ("control", "dense", "attention", "layernorm_gelu", "embedding", "cnn", "xent", "misc",
         "rope", "mlp_reshape")


@functools.cache
def _programs() -> dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]:
    """The programs and their arguments, built when a test first asks (not at collection, which
    every xdist worker runs)."""
    k = jax.random.PRNGKey(0)
    rnd = functools.partial(jax.random.normal, k)
    x = rnd((2, 4, 8))
    dense = nn.Dense(16)
    ln = nn.LayerNorm()
    emb = nn.Embed(10, 8)
    ids = jnp.array([[1, 2, 3], [4, 5, 9]])
    cnn = _CNN()
    img = rnd((2, 8, 8, 4))
    labels = jnp.array([1, 2, 3, 4])

    def attention(q, kk, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, kk)
        a = jax.nn.softmax(s, axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", a, v).sum()

    def layernorm_gelu(p, x):
        y = ln.apply(p, x)
        return jax.nn.gelu(y).sum() + jax.nn.gelu(x, approximate=False).sum()

    def embedding(p):
        table = p["params"]["embedding"]
        return emb.apply(p, ids).sum() + table[ids].sum() + jnp.take(table, ids, axis=0).sum()

    def xent(logits):
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss + (jax.nn.one_hot(labels, 10) * logits).sum()

    def misc(x):
        v, _ = jax.lax.top_k(x, 3)
        c = jnp.cumsum(x, axis=1) + jnp.cumprod(x, axis=0) + jax.lax.cummax(x, axis=1)
        out = v.sum() + c.sum() + jnp.sort(x, axis=1).sum()
        out += jnp.pad(x, ((1, 2), (0, 3))).sum() + jnp.roll(x, 2, axis=1).sum()
        out += jnp.concatenate([x, x], axis=0).sum() + jnp.where(x > 0, x, 0.0).sum()
        return out + (jnp.argsort(x, axis=1) * x).sum() + (x.max(1) * x.argmax(1)).sum()

    def rope(x):
        pos = jnp.arange(x.shape[1])[:, None]
        freq = 1.0 / (10000 ** (jnp.arange(0, x.shape[-1], 2) / x.shape[-1]))
        s, c = jnp.sin(pos * freq), jnp.cos(pos * freq)
        x1, x2 = x[..., ::2], x[..., 1::2]
        return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], -1).sum()

    def mlp_reshape(x, w):
        h = (x.reshape(2, 4, 2, 4) * 2.0).reshape(8, 8) @ w
        return jnp.tanh(h.T).reshape(4, 2, 8).sum()

    def control(x, ws):
        @jax.checkpoint
        def layer(h, w):
            h = jax.nn.relu(h @ w) + jax.nn.silu(h)
            return checkpoint_name(h, "h"), None

        h, _ = jax.lax.scan(layer, x, ws)
        h = jax.lax.fori_loop(0, 2, lambda i, h: h * 0.5, h)
        return jax.lax.cond(h.sum() > 0, jnp.sum, lambda h: -h.sum(), h)

    return {
        "control": (control, (rnd((4, 8)), rnd((2, 8, 8)))),
        "dense": (lambda p, x: dense.apply(p, x).sum(), (dense.init(k, x), x)),
        "attention": (attention, (rnd((2, 6, 2, 4)), rnd((2, 6, 2, 4)), rnd((2, 6, 2, 4)))),
        "layernorm_gelu": (layernorm_gelu, (ln.init(k, x), x)),
        "embedding": (embedding, (emb.init(k, ids),)),
        "cnn": (lambda p, img: cnn.apply(p, img, mutable=["batch_stats"], rngs={"dropout": k})[0],
                (cnn.init({"params": k, "dropout": k}, img), img)),
        "xent": (xent, (rnd((4, 10)),)),
        "misc": (misc, (rnd((4, 6)),)),
        "rope": (rope, (rnd((2, 6, 8)),)),
        "mlp_reshape": (mlp_reshape, (rnd((2, 4, 8)), rnd((8, 8)))),
    }


CASES = [(name, kind) for name in NAMES for kind in ("fwd", "grad")]


def test_the_cases_are_the_programs():
    assert tuple(_programs()) == NAMES


def _fn(name: str, kind: str) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    fn, args = _programs()[name]
    return (fn if kind == "fwd" else jax.grad(fn)), args


@pytest.mark.parametrize(("name", "kind"), CASES)
def test_every_primitive_has_a_rule_that_binds(name: str, kind: str) -> None:
    fn, args = _fn(name, kind)
    missing, failing = set(), []
    for eqn in walk(jax.make_jaxpr(fn)(*args).jaxpr):
        if eqn.primitive.name in CONTROL_FLOW:
            continue
        try:
            anno = eqn_anno(eqn)
        except Exception as e:  # noqa: BLE001 - collected and reported below
            failing.append(f"{eqn.primitive.name}: {e}")
            continue
        if anno is None:
            missing.add(eqn.primitive.name)
    assert not missing, f"primitives without a rule: {sorted(missing)}"
    assert not failing, "\n".join(failing)


# ---------------------------------------------------------------------------- numeric check


# Call primitives whose body runs once on the equation's inputs: evaluated inline.
_INLINE = frozenset({"jit", "pjit", "custom_jvp_call", "custom_vjp_call", "remat2", "checkpoint",
                     "closed_call", "core_call"})


def _record(jaxpr: jcore.Jaxpr, consts: list[Any], args: list[Any],
            log: list[tuple[Any, list[Any]]]) -> list[Any]:
    """Evaluate ``jaxpr`` primitive by primitive, logging every equation with its input values."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if eqn.primitive.name in _INLINE and sub is not None:
            inner = sub.jaxpr if isinstance(sub, jcore.ClosedJaxpr) else sub
            inner_consts = list(sub.consts) if isinstance(sub, jcore.ClosedJaxpr) else []
            outs = _record(inner, inner_consts, ins, log)
        else:
            if eqn.primitive.name not in CONTROL_FLOW:
                log.append((eqn, ins))
            outs = eqn.primitive.bind(*ins, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _local_params(eqn: Any, anno: Anno, name: str, local_out: list[tuple[int, ...]],
                  local_in: list[tuple[int, ...]], full_in: list[tuple[int, ...]]) -> dict[str, Any]:
    """Params of the primitive for one shard (those that encode shapes or group counts)."""
    p = dict(eqn.params)
    prim = eqn.primitive.name
    if prim in ("broadcast_in_dim", "iota"):
        p["shape"] = local_out[0]
    elif prim == "reshape":
        p["new_sizes"] = local_out[0]
    elif prim == "dynamic_slice":
        p["slice_sizes"] = local_out[0]
    elif prim == "slice":
        p["limit_indices"] = tuple(
            lim if anno.outputs[0].axes[i].dims[0].kind is DimKind.FROZEN else local_out[0][i]
            for i, lim in enumerate(p["limit_indices"]))
    elif prim == "gather":
        p["slice_sizes"] = tuple(
            local_in[0][i] if s == full_in[0][i] else s
            for i, s in enumerate(p["slice_sizes"]))
    elif prim == "conv_general_dilated" and name == "g":
        for key in ("feature_group_count", "batch_group_count"):
            if p[key] > 1:
                p[key] //= 2
    return p


def _check_split(eqn: Any, anno: Anno, ins: list[Any], full: list[Any], name: str) -> None:
    parts = 2
    kinds = anno.kinds()
    chunks: list[list[Any]] = [[], []]
    local_in = []
    for op, x in zip(anno.inputs, ins, strict=True):
        ax = op.axis_of(name) if op.axes is not None else None
        if ax is None:
            for c in chunks:
                c.append(x)
            local_in.append(np.shape(x))
        else:
            pieces = jnp.split(x, parts, axis=ax)
            for c, piece in zip(chunks, pieces, strict=True):
                c.append(piece)
            local_in.append(pieces[0].shape)
    local_out = []
    for op, y in zip(anno.outputs, full, strict=True):
        shape = list(np.shape(y))
        ax = op.axis_of(name) if op.axes is not None else None
        if ax is not None:
            shape[ax] //= parts
        local_out.append(tuple(shape))
    params = _local_params(eqn, anno, name, local_out, local_in, [np.shape(x) for x in ins])
    results = []
    for c in chunks:
        out = eqn.primitive.bind(*c, **params)
        results.append(out if eqn.primitive.multiple_results else [out])
    for i, (op, y) in enumerate(zip(anno.outputs, full, strict=True)):
        ax = op.axis_of(name) if op.axes is not None else None
        got = [r[i] for r in results]
        if ax is not None:
            merged = jnp.concatenate(got, axis=ax)
        elif kinds[name] is DimKind.REDUCE:
            merged = functools.reduce(jnp.add, got)
        else:
            for g in got[1:]:
                _assert_close(g, got[0], eqn, name)
            merged = got[0]
        _assert_close(merged, y, eqn, name)


def _assert_close(got: Any, want: Any, eqn: Any, name: str) -> None:
    msg = f"{eqn.primitive.name} split along '{name}' ({eqn_anno(eqn)}): {eqn}"
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, msg
    if np.issubdtype(want.dtype, np.inexact):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=msg)
    else:
        np.testing.assert_array_equal(got, want, err_msg=msg)


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key)


@pytest.mark.parametrize(("name", "kind"), CASES)
def test_annotations_split_numerically(name: str, kind: str) -> None:
    fn, args = _fn(name, kind)
    closed = jax.make_jaxpr(fn)(*args)
    log: list[tuple[Any, list[Any]]] = []
    _record(closed.jaxpr, list(closed.consts), jax.tree.leaves(args), log)
    seen, checked = set(), 0
    for eqn, ins in log:
        anno = eqn_anno(eqn)
        if anno is None or any(_is_key(x) for x in ins):
            continue
        key = (str(eqn), tuple(str(v.aval) for v in eqn.invars))
        if key in seen:
            continue
        seen.add(key)
        full = eqn.primitive.bind(*ins, **eqn.params)
        full = full if eqn.primitive.multiple_results else [full]
        sizes = anno.bind([np.shape(x) for x in ins], [np.shape(y) for y in full])
        for ident in anno.splittable():
            if sizes.get(ident, 0) % 2 == 0 and sizes.get(ident, 0) >= 2:
                _check_split(eqn, anno, ins, full, ident)
                checked += 1
    assert checked > 0
