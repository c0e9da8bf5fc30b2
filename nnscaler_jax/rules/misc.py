"""Random numbers, sorting and top-k, windowed reductions, FFT and batched linear algebra.

- ``random_bits`` from a counter-based key (threefry2x32 under ``jax_threefry_partitionable``,
  the default; threefry4x32, philox2x32 / philox4x32 always): the drawn axes free, like a
  broadcast from a scalar (bit ``i`` hashes the key with the counter ``i``, so a shard's bits are
  the matching slice of the whole array's, and GSPMD draws them in place); the key's own axes
  frozen. These bits depend on the global shape: run on a local piece (inside ``shard_map``
  regions) the op draws other bits, so :mod:`nnscaler_jax.lower.local` refuses it there;
- ``random_bits`` otherwise (original threefry, rbg keys), the key ops (``random_split``,
  ``random_wrap``, ``random_fold_in`` ...) and ``rng_bit_generator``: every axis frozen (the
  bits of a shard are not a shard of the bits);
- ``sort`` / ``top_k``: the sorted axis frozen, the others shared;
- windowed reductions: axes with a trivial window (size 1, stride 1, no padding, no dilation)
  shared, the others frozen;
- ``fft``: the transformed trailing axes frozen; linear algebra: leading batch axes shared.

>>> import jax
>>> f32 = lambda *s: jax.core.ShapedArray(s, "float32")
>>> i32 = lambda *s: jax.core.ShapedArray(s, "int32")
>>> top_k({"k": 3, "axis": 1}, [f32(4, 6)], [f32(4, 3), i32(4, 3)])
'd0 x^ -> d0 y^, d0 y^'
>>> key, keys = jax.typeof(jax.random.key(0)), jax.typeof(jax.random.split(jax.random.key(0), 3))
>>> random_bits({"bit_width": 32, "shape": (4, 6)}, [key], [i32(4, 6)])
'() -> d0 d1'
>>> random_bits({"bit_width": 32, "shape": (6,)}, [keys], [i32(3, 6)])
'k0^ -> k1^ d0'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax

from nnscaler_jax.rules._build import AnnotationRule, Fresh, anno, operand, replicated, shape_of

__all__ = ["rules"]

Params = Mapping[str, Any]
Avals = Sequence[Any]


def frozen(params: Params, in_avals: Avals, out_avals: Avals) -> str | None:
    """Every axis frozen (replicate-only), scalars ``()``."""
    return replicated(in_avals, out_avals)


# PRNG implementations whose random_bits hash the key with an iota of the output shape
_COUNTER_IMPLS = frozenset({"threefry4x32", "philox2x32", "philox4x32"})


def counter_based(key_aval: Any) -> bool:
    """Whether ``random_bits`` on keys like ``key_aval`` hashes the key with each bit's index.

    threefry2x32 does so only under ``jax_threefry_partitionable`` (read now, at annotation
    time); otherwise its bits of a shape come out of one flattened stream, and rbg keys draw with
    XLA's ``RngBitGenerator``.
    """
    name = getattr(getattr(getattr(key_aval, "dtype", None), "_impl", None), "name", None)
    if name == "threefry2x32":
        return bool(jax.config.jax_threefry_partitionable)
    return name in _COUNTER_IMPLS


def random_bits(params: Params, in_avals: Avals, out_avals: Avals) -> str | None:
    """``keys -> bits`` of shape ``keys.shape + shape``: counter-based keys: the ``shape`` axes
    free (ids in no input), the key axes frozen; other keys: every axis frozen."""
    ks, so = shape_of(in_avals[0]), shape_of(out_avals[0])
    if ks is None or so is None or len(in_avals) != 1 or not counter_based(in_avals[0]):
        return frozen(params, in_avals, out_avals)
    fresh = Fresh("k")
    keys = [fresh.frozen() for _ in ks]
    lead = [fresh.frozen() for _ in ks]
    return anno([operand(keys)], [operand(lead + Fresh("d").many(len(so) - len(ks)))])


def sort(params: Params, in_avals: Avals, out_avals: Avals) -> str | None:
    """All operands share ids; the sorted ``dimension`` frozen."""
    shape = shape_of(in_avals[0])
    if shape is None or any(shape_of(a) != shape for a in [*in_avals, *out_avals]):
        return None
    dim = int(params["dimension"]) % len(shape)
    ids = [f"d{i}^" if i == dim else f"d{i}" for i in range(len(shape))]
    return anno([operand(ids)] * len(in_avals), [operand(ids)] * len(out_avals))


def top_k(params: Params, in_avals: Avals, out_avals: Avals) -> str | None:
    """The selection axis (``axis``, default last) frozen, the others shared."""
    shape = shape_of(in_avals[0])
    if shape is None:
        return None
    axis = params.get("axis", params.get("reduction_dimension", -1))
    axis = int(-1 if axis is None else axis) % len(shape)
    ids = [f"d{i}" for i in range(len(shape))]
    lhs, rhs = list(ids), list(ids)
    lhs[axis], rhs[axis] = "x^", "y^"
    ins = [operand(lhs)] * len(in_avals)
    return anno(ins, [operand(rhs)] * len(out_avals))


def _window_keep(params: Params, rank: int) -> list[bool]:
    one = (1,) * rank
    dims = params["window_dimensions"]
    strides = params.get("window_strides") or one
    padding = params.get("padding") or ((0, 0),) * rank
    base = params.get("base_dilation") or one
    wdil = params.get("window_dilation") or one
    return [dims[i] == 1 and strides[i] == 1 and tuple(padding[i]) == (0, 0) and base[i] == 1
            and wdil[i] == 1 for i in range(rank)]


def _windowed(keep: Sequence[bool]) -> tuple[list[str], list[str]]:
    """Per axis: (input id, window-output id); shared when the window is trivial."""
    fresh = Fresh("d")
    lhs, rhs = [], []
    for k in keep:
        if k:
            lhs.append(fresh())
            rhs.append(lhs[-1])
        else:
            lhs.append(fresh.frozen())
            rhs.append(fresh.frozen())
    return lhs, rhs


def reduce_window(params: Params, in_avals: Avals, out_avals: Avals) -> str | None:
    """``reduce_window_{sum,max,min}`` (one operand) and ``reduce_window`` (operands + inits)."""
    shape = shape_of(in_avals[0])
    if shape is None:
        return None
    lhs, rhs = _windowed(_window_keep(params, len(shape)))
    n = len(out_avals)
    inits = ["()"] * (len(in_avals) - n)
    return anno([operand(lhs)] * n + inits, [operand(rhs)] * n)


def select_and_scatter_add(params: Params, in_avals: Avals, out_avals: Avals) -> str | None:
    """``(source, operand) -> out``: ``source`` has the window-output shape, ``out`` the operand's."""
    shape = shape_of(in_avals[1])
    if shape is None:
        return None
    full, win = _windowed(_window_keep(params, len(shape)))
    return anno([operand(win), operand(full)], [operand(full)])


def select_and_scatter(params: Params, in_avals: Avals, out_avals: Avals) -> str | None:
    """``(operand, source, init) -> out``."""
    shape = shape_of(in_avals[0])
    if shape is None:
        return None
    full, win = _windowed(_window_keep(params, len(shape)))
    return anno([operand(full), operand(win), "()"], [operand(full)])


def select_and_gather_add(params: Params, in_avals: Avals, out_avals: Avals) -> str | None:
    """``(tangents, operand) -> out`` with the window-output shape."""
    shape = shape_of(in_avals[0])
    if shape is None:
        return None
    full, win = _windowed(_window_keep(params, len(shape)))
    return anno([operand(full), operand(full)], [operand(win)])


def fft(params: Params, in_avals: Avals, out_avals: Avals) -> str | None:
    """Leading axes shared, the ``len(fft_lengths)`` trailing axes frozen."""
    si, so = shape_of(in_avals[0]), shape_of(out_avals[0])
    if si is None or so is None or len(si) != len(so):
        return None
    n = len(params["fft_lengths"])
    lead = [f"d{i}" for i in range(len(si) - n)]
    return anno([operand(lead + [f"x{i}^" for i in range(n)])],
                [operand(lead + [f"y{i}^" for i in range(n)])])


def batched_linalg(params: Params, in_avals: Avals, out_avals: Avals) -> str | None:
    """Matrix ops on ``(..., m, n)``: the leading batch axes of every operand shared."""
    shapes = [shape_of(a) for a in [*in_avals, *out_avals]]
    first = shapes[0]
    if first is None or len(first) < 2:
        return None
    batch = first[:-2]
    if any(s is None or tuple(s[:len(batch)]) != batch for s in shapes):
        return None
    ids = [f"b{i}" for i in range(len(batch))]
    fresh = Fresh("m")
    ops = [operand(ids + [fresh.frozen() for _ in s[len(batch):]]) for s in shapes]  # type: ignore[index]
    return anno(ops[:len(in_avals)], ops[len(in_avals):])


_RANDOM = """
random_bits random_seed random_wrap random_unwrap random_fold_in random_split threefry2x32
threefry4x32 philox2x32 philox4x32 rng_bit_generator rng_uniform iota_2x32_shape
"""
_LINALG = """
cholesky eigh eig lu qr svd triangular_solve householder_product geqrf hessenberg schur
"""


def rules() -> dict[str, AnnotationRule]:
    """The misc rule table."""
    table: dict[str, AnnotationRule] = dict.fromkeys(_RANDOM.split(), frozen)
    table.update(dict.fromkeys(_LINALG.split(), batched_linalg))
    table.update({
        "random_bits": random_bits,
        "sort": sort,
        "top_k": top_k,
        "approx_top_k": top_k,
        "reduce_window_sum": reduce_window,
        "reduce_window_max": reduce_window,
        "reduce_window_min": reduce_window,
        "reduce_window": reduce_window,
        "select_and_scatter_add": select_and_scatter_add,
        "select_and_scatter": select_and_scatter,
        "select_and_gather_add": select_and_gather_add,
        "fft": fft,
    })
    return table
