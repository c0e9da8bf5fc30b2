"""``conv_general_dilated``: batch free, input features ``+``, output features free, spatial frozen.

Roles come from ``dimension_numbers`` (``lhs_spec = (batch, feature, *spatial)``,
``rhs_spec = (out feature, in feature, *spatial)``, ``out_spec = (batch, feature, *spatial)``).

- ``feature_group_count = G > 1`` (grouped / depthwise conv): the lhs features are ``(g c+)``, the
  rhs output features and the output features ``(g o)``: splitting ``g`` splits whole groups
  (each shard runs a conv with ``G / parts`` groups); ``c`` and ``o`` are not splittable.
- ``batch_group_count = B > 1`` (the kernel gradient of a grouped conv): the lhs batch is
  ``(g n)``, the rhs output features and the output features ``(g o)``.
- a spatial axis is shared by lhs and output only for a size-1 window with stride 1, no padding and
  no dilation of the input; otherwise every spatial axis is frozen (no halo exchange).

>>> import jax
>>> from jax.lax import ConvDimensionNumbers
>>> f32 = lambda *s: jax.core.ShapedArray(s, "float32")
>>> dn = ConvDimensionNumbers((0, 3, 1, 2), (3, 2, 0, 1), (0, 3, 1, 2))   # NHWC, HWIO
>>> p = dict(dimension_numbers=dn, feature_group_count=1, batch_group_count=1,
...          window_strides=(1, 1), padding=((1, 1), (1, 1)), lhs_dilation=(1, 1))
>>> conv_general_dilated(p, [f32(2, 8, 8, 3), f32(3, 3, 3, 16)], [f32(2, 8, 8, 16)])
'n s0^ s1^ c+, w0^ w1^ c+ o -> n t0^ t1^ o'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nnscaler_jax.rules._build import AnnotationRule, anno, group, operand, shape_of

__all__ = ["conv_general_dilated", "rules"]


def _maybe_group(g: str, name: str, inner: int) -> str:
    """``(g name)``, or just ``g`` when the inner size is 1 (one feature per group)."""
    return g if inner == 1 else group([g, name])


def conv_general_dilated(params: Mapping[str, Any], in_avals: Sequence[Any],
                         out_avals: Sequence[Any]) -> str | None:
    """Annotation of ``conv_general_dilated`` from its dimension numbers and group counts."""
    ls, rs, os_ = (shape_of(a) for a in (in_avals[0], in_avals[1], out_avals[0]))
    if ls is None or rs is None or os_ is None:
        return None
    dn = params["dimension_numbers"]
    lspec, rspec, ospec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    fg = int(params.get("feature_group_count", 1))
    bg = int(params.get("batch_group_count", 1))
    lhs: list[str] = [""] * len(ls)
    rhs: list[str] = [""] * len(rs)
    out: list[str] = [""] * len(os_)
    o_total = rs[rspec[0]]
    if fg > 1:
        lhs[lspec[1]] = _maybe_group("g", "c+", ls[lspec[1]] // fg)
        rhs[rspec[1]] = "c+" if rs[rspec[1]] > 1 else "1"
        rhs[rspec[0]] = out[ospec[1]] = _maybe_group("g", "o", o_total // fg)
        lhs[lspec[0]] = out[ospec[0]] = "n"
    elif bg > 1:
        lhs[lspec[0]] = _maybe_group("g", "n", ls[lspec[0]] // bg)
        out[ospec[0]] = "n" if os_[ospec[0]] > 1 else "1"
        rhs[rspec[0]] = out[ospec[1]] = _maybe_group("g", "o", o_total // bg)
        lhs[lspec[1]] = rhs[rspec[1]] = "c+"
    else:
        lhs[lspec[0]] = out[ospec[0]] = "n"
        lhs[lspec[1]] = rhs[rspec[1]] = "c+"
        rhs[rspec[0]] = out[ospec[1]] = "o"
    strides = params.get("window_strides") or (1,) * (len(ls) - 2)
    padding = params.get("padding") or ((0, 0),) * (len(ls) - 2)
    lhs_dil = params.get("lhs_dilation") or (1,) * (len(ls) - 2)
    for i, (la, ra, oa) in enumerate(zip(lspec[2:], rspec[2:], ospec[2:], strict=True)):
        pointwise = (rs[ra] == 1 and strides[i] == 1 and tuple(padding[i]) == (0, 0)
                     and lhs_dil[i] == 1 and ls[la] == os_[oa])
        if pointwise:
            lhs[la] = out[oa] = f"s{i}"
            rhs[ra] = "1"
        else:
            lhs[la], rhs[ra], out[oa] = f"s{i}^", f"w{i}^", f"t{i}^"
    return anno([operand(lhs), operand(rhs)], [operand(out)])


def rules() -> dict[str, AnnotationRule]:
    """The convolution rule table."""
    return {"conv_general_dilated": conv_general_dilated}
