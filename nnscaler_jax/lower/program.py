"""A planned call as ``jax.jit`` runs it: the lowering, the inputs' storage shardings, and one
jitted program per pattern of eagerly traced inputs.

Concrete inputs are placed as the plan stores them (:func:`place`), so the program's
``in_shardings`` are strict for them, and for the tracers of a caller's ``jax.jit`` (they constrain
its program). Tracers of a transformation running eagerly (``jax.grad`` / ``jax.vjp`` outside any
jit) carry values that may be committed to another layout (replicated by ``device_put``, laid out
by another plan), which a strict ``in_shardings`` rejects, and they cannot be placed from outside:
they enter unconstrained and the replay relays them (it constrains every input to its storage
layout first, :meth:`~nnscaler_jax.lower.replay.Lowering._program`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.extend.core import concrete_or_error

from nnscaler_jax.capture.trace import Captured
from nnscaler_jax.lower.replay import Lowering
from nnscaler_jax.plan.plan import Plan

__all__ = ["Program", "place", "signature"]


def signature(flat: Sequence[Any], extra: Any) -> tuple:
    """What selects a call's program: its inputs' shapes and dtypes, and ``extra`` (static
    arguments, layout metadata)."""
    return tuple((tuple(np.shape(x)), str(getattr(x, "dtype", type(x)))) for x in flat) + (
        extra,)


def place(x: Any, sharding: Any) -> Any:
    """``x`` stored as ``sharding`` (None: as it is); tracers are left as they are."""
    if sharding is None or isinstance(x, jax.core.Tracer) or not hasattr(x, "shape"):
        return x
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    return jax.device_put(x, sharding)


def _eagerly_traced(x: Any) -> bool:
    """Whether ``x`` is a tracer whose value is known: ``jax.grad`` / ``jax.vjp`` / ``jax.jvp``
    running eagerly (not inside a ``jax.jit`` or ``jax.vmap``)."""
    if not isinstance(x, jax.core.Tracer):
        return False
    try:
        concrete_or_error(None, x)
    except jax.errors.ConcretizationTypeError:
        return False
    return True


@dataclass
class Program:
    """The program of a call: its capture, plan, lowering and the inputs' storage shardings
    (``lowering.input_shardings()``; None: unconstrained)."""

    captured: Captured
    plan: Plan
    lowering: Lowering
    in_shardings: tuple[Any, ...]
    _jitted: dict[tuple[bool, ...], Callable[..., Any]] = field(default_factory=dict)

    @classmethod
    def of(cls, captured: Captured, plan: Plan, lowering: Lowering) -> Program:
        return cls(captured, plan, lowering, lowering.input_shardings())

    def fn(self, flat: Sequence[Any]) -> Callable[..., Any]:
        """The jitted program for the inputs ``flat``: strict ``in_shardings``, but none for
        the tracers of an eager transformation (relaid inside the program)."""
        eager = tuple(_eagerly_traced(x) for x in flat)
        fn = self._jitted.get(eager)
        if fn is None:
            shardings = tuple(None if e else s
                              for e, s in zip(eager, self.in_shardings, strict=True))
            fn = self._jitted[eager] = jax.jit(self.lowering, in_shardings=shardings)
        return fn

    def placed(self, flat: Sequence[Any]) -> list[Any]:
        """The inputs ``flat`` stored as the plan stores them (tracers as they are)."""
        return [place(x, s) for x, s in zip(flat, self.in_shardings, strict=True)]

    def __call__(self, flat: Sequence[Any]) -> list[Any]:
        """The program's flat outputs on the inputs ``flat``."""
        placed = self.placed(flat)
        return self.fn(placed)(*placed)
