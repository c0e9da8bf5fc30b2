"""Property: any reshape gets an annotation that binds to its shapes."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from nnscaler_jax.ir.anno import DimKind
from nnscaler_jax.rules import annotate

_SIZES = st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=0, max_size=4)


def _factorise(total: int, draw) -> tuple[int, ...]:
    out = []
    while total > 1:
        divisors = [d for d in range(2, total + 1) if total % d == 0]
        d = draw(st.sampled_from(divisors))
        out.append(d)
        total //= d
        if draw(st.booleans()):
            out.append(1)
    return tuple(out)


@st.composite
def _reshapes(draw):
    src = tuple(draw(_SIZES))
    dst = _factorise(math.prod(src), draw)
    perm = draw(st.permutations(list(dst)))
    return src, tuple(perm)


@settings(max_examples=60, deadline=None)
@given(_reshapes())
def test_random_reshape_binds(shapes) -> None:
    src, dst = shapes
    anno = annotate("reshape", {"new_sizes": dst, "dimensions": None, "sharding": None},
                    [jax.core.ShapedArray(src, jnp.float32)], [jax.core.ShapedArray(dst, jnp.float32)])
    sizes = anno.bind([src], [dst])
    # No reduction dims in a reshape; every splittable id is the first of its groups.
    assert all(k is not DimKind.REDUCE for k in anno.kinds().values())
    assert set(anno.splittable()) <= set(sizes)


@settings(max_examples=60, deadline=None)
@given(_reshapes())
def test_random_reshape_splits_numerically(shapes) -> None:
    """Splitting a splittable id in halves and reshaping each half reproduces the full reshape."""
    src, dst = shapes
    anno = annotate("reshape", {"new_sizes": dst, "dimensions": None, "sharding": None},
                    [jax.core.ShapedArray(src, jnp.float32)], [jax.core.ShapedArray(dst, jnp.float32)])
    sizes = anno.bind([src], [dst])
    x = np.arange(math.prod(src)).reshape(src)
    for name in anno.splittable():
        if sizes[name] % 2:
            continue
        ai, ao = anno.inputs[0].axis_of(name), anno.outputs[0].axis_of(name)
        local = list(dst)
        local[ao] //= 2
        parts = [p.reshape(local) for p in np.split(x, 2, axis=ai)]
        np.testing.assert_array_equal(np.concatenate(parts, axis=ao), x.reshape(dst))
