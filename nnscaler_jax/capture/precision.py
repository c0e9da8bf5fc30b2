"""Mixed precision: the casts a traced call gets at a compute dtype (one place for linen and nnx).

With a compute precision (``"bfloat16"``, ``"float16"``, ``"float32"``) the traced function
casts, on entry, the floating-point *trainable* variables (linen's ``params`` collection, nnx
``Param`` leaves) and floating-point array arguments to the compute dtype. The graph the planner
and the cost model see then computes in that dtype (matmuls priced at its peak, activations at
its size) while its inputs, the stored variables, keep their own dtype: float32 master weights,
so gradients (the transpose of the cast) and optimizer state are float32 too.

What comes back keeps the types of the plain call:

- results in the compute dtype (16-bit) are cast to float32, so a loss computed from them is
  float32 and a precision switch never changes the caller's types (the cast is the graph's last
  op: activations stay 16-bit);
- state the call writes back (linen mutable collections, an nnx module's state) keeps the stored
  dtype: a variable the call did not change is returned as the stored value itself (never the
  16-bit copy cast back), a changed one is cast back to its stored dtype.

Other collections (``batch_stats``, caches) are not cast: BatchNorm's running averages stay
float32 (a bfloat16 average would stop moving once its updates fall under bfloat16's resolution).
Linen's norm layers return their output in the dtype of their input and scale; nnx's
``BatchNorm`` promotes with its statistics, so it computes (and returns) float32 unless it is
given ``dtype=jnp.bfloat16``.

Layers whose ``dtype`` is pinned to float32 (``nn.Dense(..., dtype=jnp.float32)``) still compute
in float32: the cast only sets what their inputs and params are, as flax's own ``dtype=None``
(the default) infers the compute dtype from them. :func:`float32_matmuls` finds those.

The casts are ops of the variables' modules (module paths, ``str(plan)``) but come first in the
program: a recomputed layer keeps the 16-bit copies of its weights as inputs of its checkpoint
(as Megatron keeps 16-bit weights next to the float32 master copy).

>>> import jax.numpy as jnp
>>> precision_name(jnp.bfloat16), precision_name("fp16"), precision_name(None)
('bfloat16', 'float16', None)
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from nnscaler_jax.errors import ConstraintError
from nnscaler_jax.ir.graph import Role

__all__ = ["PRECISIONS", "UNKNOWN", "Cast", "float32_matmuls", "graph_precision",
           "precision_name", "with_precision"]

PRECISIONS = ("float32", "bfloat16", "float16")
_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16",
            "f16": "float16", "half": "float16"}


def precision_name(value: Any, where: str | None = None) -> str | None:
    """The canonical name (``'float32'``, ``'bfloat16'``, ``'float16'``) of a precision given
    as that name, an alias (``'bf16'``, ``'fp16'``, ``'fp32'``) or a dtype (``jnp.bfloat16``);
    None stays None (the model's own dtypes).

    Raises:
        ConstraintError: anything else.
    """
    if value is None:
        return None
    name = _ALIASES.get(value.lower(), value.lower()) if isinstance(value, str) else None
    if name is None:
        try:
            name = np.dtype(value).name
        except TypeError:
            name = None
    if name not in PRECISIONS:
        where = where or f"precision={value!r}"
        raise ConstraintError(f"{where}: the compute precision is one of "
                              f"{', '.join(repr(p) for p in PRECISIONS)} (or None: the model's "
                              "own dtypes); weights and optimizer state stay float32")
    return name


def _is_float(x: Any) -> bool:
    """A floating-point array (bfloat16 included: not a numpy ``floating`` subtype)."""
    return hasattr(x, "dtype") and bool(jax.numpy.issubdtype(x.dtype, jax.numpy.floating))


@dataclass(frozen=True)
class Cast:
    """The casts of one traced call at a compute dtype (see the module doc).

    Attributes:
        precision: the compute precision's name.
    """

    precision: str

    @classmethod
    def of(cls, precision: Any) -> Cast | None:
        """The casts for ``precision`` (None: no casts at all)."""
        name = precision_name(precision)
        return None if name is None else cls(name)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(jax.numpy.dtype(self.precision))

    def inputs(self, flat: Sequence[Any], mask: Sequence[bool],
               scopes: Sequence[str] | None = None) -> tuple[list[Any], dict]:
        """``flat`` with the floating leaves ``mask`` selects cast to the compute dtype, and
        ``{id(cast value): stored value}`` to hand unchanged state back as it was stored.
        ``scopes``: the module path of each leaf's variable: its cast is that module's op
        (module-path rules, recompute groups and ``str(plan)`` find it there)."""
        out, stored = [], {}
        for i, (x, m) in enumerate(zip(flat, mask, strict=True)):
            if m and _is_float(x) and np.dtype(x.dtype) != self.dtype:
                scope = scopes[i] if scopes else ""
                with jax.named_scope(scope) if scope else contextlib.nullcontext():
                    y = jax.numpy.asarray(x, self.dtype)
                stored[id(y)] = x
                out.append(y)
            else:
                out.append(x)
        return out, stored

    def results(self, tree: Any) -> Any:
        """``tree`` with its 16-bit compute-dtype leaves cast to float32."""
        if self.dtype.itemsize >= 4:
            return tree
        return jax.tree_util.tree_map(
            lambda x: jax.numpy.asarray(x, np.float32)
            if _is_float(x) and np.dtype(x.dtype) == self.dtype else x, tree)

    def state(self, new: Any, stored: Any, originals: dict) -> Any:
        """State written back (``new``) in the dtypes of the ``stored`` tree: an unchanged
        variable is its stored value, a changed one is cast back to the stored dtype (matched
        by tree path), a new one (sown intermediates) as :meth:`results`."""
        dtypes = {p: np.dtype(x.dtype) for p, x in jax.tree_util.tree_flatten_with_path(stored)[0]
                  if _is_float(x)}
        flat, treedef = jax.tree_util.tree_flatten_with_path(new)
        out = []
        for path, x in flat:
            if id(x) in originals:
                out.append(originals[id(x)])
            elif path in dtypes:
                out.append(x if np.dtype(x.dtype) == dtypes[path]
                           else jax.numpy.asarray(x, dtypes[path]))
            else:
                out.append(self.results(x))
        return jax.tree_util.tree_unflatten(treedef, out)

    def restore(self, tree: Any, originals: dict) -> Any:
        """``tree`` with every cast value the call returned unchanged replaced by its stored
        value (a linen ``mutable=True`` call returns its params)."""
        return jax.tree_util.tree_map(lambda x: originals.get(id(x), x), tree)


def float32_matmuls(graph: Any, precision: str | None) -> list[str]:
    """Module paths of the matmuls (``dot_general``, convolutions) that still compute in
    float32 under a 16-bit ``precision`` (layers that pin ``dtype=float32``); [] otherwise."""
    if precision not in ("bfloat16", "float16"):
        return []
    const = {t.id for t in graph.inputs if t.role == Role.CONST}
    made = {t.id for t in graph.inputs} | {t.id for op in graph.walk() for t in op.outputs}
    out = []
    for op in graph.walk():  # a matmul of positions and constants only (rotary angles,
        # ``einsum("s,f->sf", arange(s), inv_freq)``) reads no data: float32 is its choice
        if all(t.id in const or (not t.ndim and t.id not in made) for t in op.inputs) \
                and not op.regions:  # (a literal scalar: an operand nothing makes)
            const.update(t.id for t in op.outputs)
        elif op.primitive in ("dot_general", "conv_general_dilated") and op.inputs and \
                all(str(t.dtype) == "float32" for t in op.inputs):
            out.append(op.module_path or "<top>")
    return out


UNKNOWN = "unknown"
"""What :func:`graph_precision` says of a graph no capture marked (built by hand)."""


def with_precision(graph: Any, precision: str | None) -> Any:
    """``graph`` marked as captured at ``precision`` (None: the model's own dtypes), in its
    ``meta``, so the planner can tell a plan's precision from the graph's."""
    meta = graph.meta if isinstance(graph.meta, dict) else {}
    return dataclasses.replace(graph, meta={**meta, "precision": precision})


def graph_precision(graph: Any) -> str | None:
    """The precision ``graph`` was captured at (None: the model's own dtypes), or
    :data:`UNKNOWN` when no capture marked it."""
    meta = graph.meta if isinstance(graph.meta, dict) else {}
    return meta.get("precision", UNKNOWN)
