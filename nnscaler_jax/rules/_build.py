"""Small helpers shared by the rule modules: shapes of avals and annotation text builders.

Rules build annotation *text*: one operand is a list of axis tokens (``"a"``, ``"k+"``, ``"1"``,
``"(h d)"``), written with :func:`operand`; :func:`anno` joins operands into a full annotation.

>>> anno([operand(["a", "k+"]), operand([])], [operand(["a"])])
'a k+, () -> a'
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from jax.errors import InconclusiveDimensionOperation

AnnotationRule = str | Callable[[Mapping[str, Any], Sequence[Any], Sequence[Any]], "str | None"]
"""An annotation string, or ``rule(params, in_avals, out_avals) -> str | None``."""

Shape = tuple[int, ...]


def shape_of(aval: Any) -> Shape | None:
    """The shape of an abstract value, or None for non-array values (tokens, refs, ...)."""
    shape = getattr(aval, "shape", None)
    if shape is None:
        return None
    try:
        return tuple(int(s) for s in shape)
    except (TypeError, InconclusiveDimensionOperation):  # symbolic dims: not plannable
        return None


def operand(axes: Sequence[str] | None) -> str:
    """One operand: ``None`` -> ``?``, no axes -> ``()``, else space-separated axes."""
    if axes is None:
        return "?"
    return " ".join(axes) if axes else "()"


def anno(inputs: Iterable[str], outputs: Iterable[str]) -> str:
    """Join operand strings into ``'in, in -> out'``."""
    return f"{', '.join(inputs)} -> {', '.join(outputs)}"


def group(names: Sequence[str]) -> str:
    """One axis made of ``names`` (row-major): a single name or ``(a b c)``."""
    return names[0] if len(names) == 1 else f"({' '.join(names)})"


class Fresh:
    """Generator of fresh identifiers ``{prefix}0, {prefix}1, ...``.

    >>> f = Fresh("d")
    >>> f(), f(), f.frozen()
    ('d0', 'd1', 'd2^')
    """

    def __init__(self, prefix: str = "d") -> None:
        self._prefix = prefix
        self._n = 0

    def __call__(self) -> str:
        name = f"{self._prefix}{self._n}"
        self._n += 1
        return name

    def frozen(self) -> str:
        return self() + "^"

    def many(self, n: int) -> list[str]:
        return [self() for _ in range(n)]


def frozen_operand(shape: Shape | None, fresh: Fresh) -> str:
    """An operand whose every axis is a fresh frozen identifier (``?`` for non-arrays)."""
    if shape is None:
        return "?"
    return operand([fresh.frozen() for _ in shape])


def replicated(in_avals: Sequence[Any], out_avals: Sequence[Any]) -> str:
    """The replicate-only annotation: every axis of every operand frozen.

    >>> import numpy as np
    >>> class A:
    ...     def __init__(self, *s): self.shape = s
    >>> replicated([A(2, 3), A()], [A(3)])
    'r0^ r1^, () -> r2^'
    """
    fresh = Fresh("r")
    ins = [frozen_operand(shape_of(a), fresh) for a in in_avals]
    outs = [frozen_operand(shape_of(a), fresh) for a in out_avals]
    return anno(ins, outs)
