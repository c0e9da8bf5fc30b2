"""The annotation language (nnScaler's dimops): one einsum-like string per operator.

Grammar::

    anno     := operands '->' operands
    operands := [operand (',' operand)*]     (empty: an op without inputs)
    operand  := '?' | '()' | axis+
    axis     := dim | '(' dim dim+ ')'
    dim      := (IDENT | NUMBER) ['+' | '^']

- a plain identifier is a dimension that may be split (spatially: every operand holding it splits);
- ``k+`` is a reduction dimension: splitting it leaves the outputs as partial sums (value split);
- ``k^`` is frozen: never split;
- ``(h d)`` groups identifiers into one tensor axis (reshapes); only the first may be split;
- a number is a dimension of fixed size (never split);
- ``?`` marks a non-tensor or replicate-only operand; ``()`` a rank-0 tensor.

>>> a = parse_anno("b m k+, k+ n -> b m n")
>>> str(a)
'b m k+, k+ n -> b m n'
>>> a.bind([(2, 3, 4), (4, 5)], [(2, 3, 5)])
{'b': 2, 'm': 3, 'k': 4, 'n': 5}
>>> sorted(a.splittable())
['b', 'k', 'm', 'n']
"""

from __future__ import annotations

import enum
import functools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from nnscaler_jax.errors import AnnotationError

__all__ = ["Anno", "AnnoSyntaxError", "AnnotationError", "Axis", "Dim", "DimKind", "Operand",
           "parse_anno"]


class DimKind(enum.Enum):
    """How a dimension may be split."""

    SPATIAL = ""
    REDUCE = "+"
    FROZEN = "^"


@dataclass(frozen=True, slots=True)
class Dim:
    """One named (or fixed-size) dimension."""

    name: str
    kind: DimKind = DimKind.SPATIAL

    @property
    def fixed(self) -> int | None:
        return int(self.name) if self.name.isdigit() else None

    def __str__(self) -> str:
        return self.name + self.kind.value


@dataclass(frozen=True, slots=True)
class Axis:
    """One tensor axis: a single dim or a group ``(h d)`` of dims (row-major)."""

    dims: tuple[Dim, ...]

    def __str__(self) -> str:
        inner = " ".join(str(d) for d in self.dims)
        return inner if len(self.dims) == 1 else f"({inner})"


@dataclass(frozen=True, slots=True)
class Operand:
    """One operand: ``axes is None`` means ``?`` (replicate-only / non-tensor)."""

    axes: tuple[Axis, ...] | None

    def __str__(self) -> str:
        if self.axes is None:
            return "?"
        if not self.axes:
            return "()"
        return " ".join(str(a) for a in self.axes)

    def axis_of(self, name: str) -> int | None:
        """Index of the tensor axis whose *first* dim is ``name`` (the splittable position)."""
        for i, ax in enumerate(self.axes or ()):
            if ax.dims[0].name == name:
                return i
        return None

    def names(self) -> list[str]:
        return [d.name for ax in self.axes or () for d in ax.dims]


class AnnoSyntaxError(AnnotationError):
    """An annotation string that does not parse; the message underlines the bad part."""


def _syntax_error(text: str, pos: int, width: int, what: str) -> AnnoSyntaxError:
    width = max(1, width)
    return AnnoSyntaxError(
        f"bad annotation: {what}\n  {text}\n  {' ' * pos}{'^' * width}\n"
        "Write operands as space-separated dims, e.g. 'b m k+, k+ n -> b m n' "
        "('+' reduction, '^' frozen, '(h d)' grouped, '?' replicate-only, '()' scalar)."
    )


_TOKEN = re.compile(r"\s*(?:(?P<name>[A-Za-z_][A-Za-z0-9_]*|\d+)(?P<suf>[+^]?)|(?P<p>->|[(),?]))")


@dataclass(frozen=True, slots=True)
class Anno:
    """A parsed annotation: input and output operands."""

    inputs: tuple[Operand, ...]
    outputs: tuple[Operand, ...]
    # kinds() / splittable() of this (immutable) annotation, computed once: planning asks for
    # them per op many times, and parse_anno shares one Anno among ops of equal annotations
    _memo: dict = field(default_factory=dict, init=False, compare=False, hash=False, repr=False)

    def __str__(self) -> str:
        text = f"{', '.join(map(str, self.inputs))} -> {', '.join(map(str, self.outputs))}"
        return text.strip()

    @property
    def operands(self) -> tuple[Operand, ...]:
        return self.inputs + self.outputs

    def kinds(self) -> dict[str, DimKind]:
        """Every identifier (not fixed sizes) and its kind, in order of first appearance."""
        memo = self._memo.get("kinds")
        if memo is None:
            memo = self._memo["kinds"] = self._kinds()
        return dict(memo)

    def _kinds(self) -> dict[str, DimKind]:
        out: dict[str, DimKind] = {}
        for op in self.operands:
            for ax in op.axes or ():
                for d in ax.dims:
                    if d.fixed is None:
                        out.setdefault(d.name, d.kind)
        return out

    def splittable(self) -> list[str]:
        """Identifiers that may be split: not frozen, and first in every group holding them."""
        memo = self._memo.get("splittable")
        if memo is None:
            memo = self._memo["splittable"] = tuple(self._splittable())
        return list(memo)

    def _splittable(self) -> list[str]:
        names = []
        for name, kind in self.kinds().items():
            if kind is DimKind.FROZEN:
                continue
            ok = all(
                ax.dims[0].name == name
                for op in self.operands
                for ax in op.axes or ()
                if name in [d.name for d in ax.dims]
            )
            if ok:
                names.append(name)
        return names

    def bind(
        self,
        in_shapes: Sequence[Sequence[int] | None],
        out_shapes: Sequence[Sequence[int] | None],
        *,
        op: str | None = None,
        module_path: str | None = None,
    ) -> dict[str, int]:
        """Check shapes against the annotation and return the size of every identifier.

        Args:
            in_shapes / out_shapes: the operands' shapes (``None`` for a non-tensor operand).
            op / module_path: the op being bound (primitive name, Flax module path), named in
                the error message and set on the error when given.

        Raises:
            AnnotationError: operand count, rank or sizes inconsistent with the annotation.
        """
        def error(detail: str) -> AnnotationError:
            to = f" to op '{op}'" if op is not None else ""
            at = f" at '{module_path or '<top>'}'" if module_path is not None else ""
            ins = [None if s is None else tuple(s) for s in in_shapes]
            outs = [None if s is None else tuple(s) for s in out_shapes]
            return AnnotationError(
                f"annotation '{self}' does not bind{to}{at}: {detail} "
                f"(input shapes {ins}, output shapes {outs})",
                op=op, module_path=module_path, shapes=tuple(ins + outs),
            )

        if len(in_shapes) != len(self.inputs) or len(out_shapes) != len(self.outputs):
            raise error(
                f"it has {len(self.inputs)} inputs / {len(self.outputs)} outputs "
                f"but the op has {len(in_shapes)} / {len(out_shapes)}"
            )
        sizes: dict[str, int] = {}
        origin: dict[str, str] = {}  # identifier -> the operand its size was read from
        pending: list[tuple[Axis, int, str]] = []
        pairs = [(o, s, f"input {i}") for i, (o, s) in enumerate(zip(self.inputs, in_shapes))]
        pairs += [(o, s, f"output {i}") for i, (o, s) in enumerate(zip(self.outputs, out_shapes))]
        for operand, shape, where in pairs:
            if operand.axes is None or shape is None:
                continue
            if len(operand.axes) != len(shape):
                raise error(
                    f"{where} '{operand}' has rank {len(operand.axes)} "
                    f"but the tensor has shape {tuple(shape)}"
                )
            for ax, size in zip(operand.axes, shape):
                pending.append((ax, int(size), where))
        # Solve groups: repeat until no progress (single-unknown groups are determined).
        progress = True
        while progress:
            progress = False
            rest = []
            for ax, size, where in pending:
                unknown = [d for d in ax.dims if d.fixed is None and d.name not in sizes]
                known = math.prod(d.fixed if d.fixed is not None else sizes[d.name]
                                  for d in ax.dims if d not in unknown)
                if len(unknown) == 0:
                    if known != size:
                        raise error(_mismatch(ax, known, size, where, sizes, origin))
                elif len(unknown) == 1 and len({d.name for d in unknown}) == 1:
                    if known == 0 or size % known:
                        raise error(
                            f"{where} axis '{ax}' of size {size} is not a multiple of {known}"
                            + _from(ax, sizes, origin)
                        )
                    sizes[unknown[0].name] = size // known
                    origin[unknown[0].name] = where
                    progress = True
                else:
                    rest.append((ax, size, where))
            pending = rest
        if pending:
            ax, size, where = pending[0]
            raise error(f"cannot infer the dims of {where} axis '{ax}' of size {size}")
        return {name: sizes[name] for name in self.kinds() if name in sizes}


def _from(ax: Axis, sizes: dict[str, int], origin: dict[str, str]) -> str:
    """Where the known dims of a group got their sizes: `` (h is 3 in input 0)``."""
    known = [f"'{d.name}' is {sizes[d.name]} in {origin[d.name]}"
             for d in ax.dims if d.name in origin]
    return f" (dim {', '.join(known)})" if known else ""


def _mismatch(ax: Axis, known: int, size: int, where: str, sizes: dict[str, int],
              origin: dict[str, str]) -> str:
    """A fully known axis whose size disagrees with the tensor's, naming the dim(s)."""
    needs = f"{where} axis '{ax}' needs size {known} but the tensor has {size}"
    if len(ax.dims) == 1:
        d = ax.dims[0]
        if d.fixed is None:
            return (f"dim '{d.name}' is {sizes[d.name]} in {origin[d.name]} and {size} in "
                    f"{where} ({needs})")
        return f"fixed-size dim {d.name}: {needs}"
    return needs + _from(ax, sizes, origin)


@functools.lru_cache(maxsize=65536)
def parse_anno(text: str) -> Anno:
    """Parse an annotation string (cached: an ``Anno`` is immutable).

    Raises:
        AnnoSyntaxError: with the bad part of ``text`` underlined.
    """
    tokens: list[tuple[str, str, int, int]] = []  # (kind, value, pos, width)
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if not m:
            bad = len(text[pos:]) - len(text[pos:].lstrip())
            raise _syntax_error(text, pos + bad, 1, f"unexpected character {text[pos + bad]!r}")
        start = m.start("name") if m.group("name") else m.start("p")
        if m.group("name"):
            tokens.append(("dim", m.group("name") + m.group("suf"), start, m.end() - start))
        else:
            tokens.append((m.group("p"), m.group("p"), start, len(m.group("p"))))
        pos = m.end()
    arrows = [t for t in tokens if t[0] == "->"]
    if len(arrows) != 1:
        where = arrows[1] if arrows else ("", "", len(text), 1)
        raise _syntax_error(text, where[2], where[3], "expected exactly one '->'")
    split = tokens.index(arrows[0])
    inputs = _parse_operands(text, tokens[:split], arrows[0][2])
    outputs = _parse_operands(text, tokens[split + 1:], len(text))
    anno = Anno(tuple(inputs), tuple(outputs))
    _check_kinds(text, anno)
    return anno


def _parse_operands(text: str, toks: list[tuple[str, str, int, int]], end: int) -> list[Operand]:
    operands: list[Operand] = []
    if not toks:
        return operands  # an op without inputs (iota, rng seeds)
    groups: list[list[tuple[str, str, int, int]]] = [[]]
    for t in toks:
        if t[0] == ",":
            groups.append([])
        else:
            groups[-1].append(t)
    for g in groups:
        if not g:
            raise _syntax_error(text, min(end, len(text) - 1) if text else 0, 1,
                                "empty operand (write '()' for a scalar)")
        operands.append(_parse_operand(text, g))
    return operands


def _parse_operand(text: str, toks: list[tuple[str, str, int, int]]) -> Operand:
    if toks[0][0] == "?":
        if len(toks) != 1:
            raise _syntax_error(text, toks[1][2], toks[1][3], "'?' stands alone in its operand")
        return Operand(None)
    if [t[0] for t in toks] == ["(", ")"]:
        return Operand(())
    axes: list[Axis] = []
    i = 0
    while i < len(toks):
        kind, val, p, w = toks[i]
        if kind == "dim":
            axes.append(Axis((_dim(val),)))
            i += 1
        elif kind == "(":
            j = i + 1
            dims = []
            while j < len(toks) and toks[j][0] == "dim":
                dims.append(_dim(toks[j][1]))
                j += 1
            if j >= len(toks) or toks[j][0] != ")":
                bad = toks[j] if j < len(toks) else toks[-1]
                raise _syntax_error(text, bad[2], bad[3], "expected ')' closing the group")
            if len(dims) < 2:
                raise _syntax_error(text, p, toks[j][2] - p + 1,
                                    "a group needs at least two dims, e.g. '(h d)'")
            axes.append(Axis(tuple(dims)))
            i = j + 1
        else:
            raise _syntax_error(text, p, w, f"unexpected {val!r}")
    return Operand(tuple(axes))


def _dim(token: str) -> Dim:
    if token[-1] in "+^":
        return Dim(token[:-1], DimKind(token[-1]))
    return Dim(token)


def _check_kinds(text: str, anno: Anno) -> None:
    """Every identifier keeps one kind; fixed sizes take none. Underlines the offending token."""
    # The dim tokens of ``text`` in order are exactly the dims of the operands in order.
    spots = [(m.start("name"), m.end() - m.start("name"))
             for m in _TOKEN.finditer(text) if m.group("name")]
    dims = [d for op in anno.operands for ax in op.axes or () for d in ax.dims]
    seen: dict[str, DimKind] = {}
    for d, (pos, width) in zip(dims, spots, strict=True):
        if d.fixed is not None:
            if d.kind is not DimKind.SPATIAL:
                raise _syntax_error(text, pos, width, "a fixed-size dim takes no '+' or '^'")
            continue
        first = seen.setdefault(d.name, d.kind)
        if first is not d.kind:
            was = f"marked '{first.value}'" if first.value else "unmarked"
            raise _syntax_error(
                text, pos, width,
                f"dim '{d.name}' is {was} where it first appears: mark it the same in every "
                "operand",
            )
