"""The annotation language: print/parse round trip (hypothesis) and errors that underline."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.anno import Anno, AnnoSyntaxError, Axis, Dim, DimKind, Operand, parse_anno

_NAMES = ["a", "b", "k", "h", "d", "m0", "n_1", "_x", "seq", "D"]


@st.composite
def annos(draw) -> Anno:
    """Random valid annotations: one kind per identifier, fixed sizes unmarked, groups of >= 2."""
    kinds = {n: draw(st.sampled_from(list(DimKind))) for n in _NAMES}

    def dim() -> Dim:
        if draw(st.integers(0, 5)) == 0:
            return Dim(str(draw(st.integers(1, 64))))
        name = draw(st.sampled_from(_NAMES))
        return Dim(name, kinds[name])

    def operand() -> Operand:
        form = draw(st.sampled_from(["?", "()", "axes", "axes", "axes"]))
        if form == "?":
            return Operand(None)
        if form == "()":
            return Operand(())
        axes = []
        for _ in range(draw(st.integers(1, 4))):
            n = draw(st.sampled_from([1, 1, 1, 2, 3]))
            axes.append(Axis(tuple(dim() for _ in range(n))))
        return Operand(tuple(axes))

    ins = tuple(operand() for _ in range(draw(st.integers(0, 3))))
    outs = tuple(operand() for _ in range(draw(st.integers(0, 2))))
    return Anno(ins, outs)


@settings(max_examples=300, deadline=None)
@given(annos())
def test_print_parse_round_trip(anno: Anno) -> None:
    text = str(anno)
    assert parse_anno(text) == anno
    assert str(parse_anno(text)) == text


@settings(max_examples=100, deadline=None)
@given(annos(), st.sampled_from(["  ", " ", "\t"]))
def test_parse_ignores_extra_whitespace(anno: Anno, ws: str) -> None:
    text = str(anno).replace(" ", ws).replace(",", " ,")
    assert parse_anno(ws + text + ws) == anno


def _underline(err: Exception) -> tuple[str, int, int]:
    """(echoed text, caret start, caret width) from an AnnoSyntaxError message."""
    lines = str(err).splitlines()
    i = next(k for k, line in enumerate(lines) if set(line.strip()) == {"^"})
    carets = lines[i][2:]
    start = len(carets) - len(carets.lstrip(" "))
    return lines[i - 1][2:], start, len(carets.strip())


# (bad text, the token that must be underlined, which occurrence of it (0-based), message part)
BAD = [
    ("a b c", None, 0, "exactly one '->'"),
    ("a -> b -> c", "->", 1, "exactly one '->'"),
    ("a (b) -> a", "(b)", 0, "at least two dims"),
    ("a (b c -> a", "c", 0, "expected ')'"),  # the group ends without ')'
    ("a $ -> a", "$", 0, "unexpected character"),
    ("a b ? -> a", "?", 0, "'?'"),
    ("a 4+ -> a", "4+", 0, "fixed-size"),
    ("a 4^, a -> a", "4^", 0, "fixed-size"),
    ("a b+, b -> a", "b", 1, "'b' is marked '+'"),
    ("ab b+, b -> ab", "b", 2, "'b' is marked '+'"),
    ("b k, k+ n -> b n", "k+", 0, "'k' is unmarked"),
    ("(h d), h^ -> d", "h^", 0, "'h' is unmarked"),
]


def _nth(text: str, token: str, n: int) -> int:
    pos = -1
    for _ in range(n + 1):
        pos = text.index(token, pos + 1)
    return pos


@pytest.mark.parametrize(("text", "token", "nth", "what"), BAD)
def test_error_underlines_the_bad_token(text: str, token: str | None, nth: int,
                                        what: str) -> None:
    with pytest.raises(AnnoSyntaxError) as info:
        parse_anno(text)
    echoed, start, width = _underline(info.value)
    assert echoed == text
    assert what in str(info.value)
    if token is None:  # missing '->': the caret points past the end
        assert start == len(text)
    else:
        assert (start, width) == (_nth(text, token, nth), len(token)), str(info.value)


def test_syntax_error_is_a_plan_error_with_a_fix() -> None:
    with pytest.raises(PlanError, match=r"e\.g\. 'b m k\+, k\+ n -> b m n'"):
        parse_anno("a b")


@pytest.mark.parametrize(("text", "ins", "outs"), [
    ("-> a", 0, 1),
    ("a ->", 1, 0),
    ("?, () -> ?", 2, 1),
    ("b (h d) 4 -> b h d 4", 1, 1),
])
def test_edge_forms_parse(text: str, ins: int, outs: int) -> None:
    anno = parse_anno(text)
    assert (len(anno.inputs), len(anno.outputs)) == (ins, outs)
    assert parse_anno(str(anno)) == anno


def test_bind_and_splittable() -> None:
    anno = parse_anno("b (h d^), d^ -> b h d^")
    assert anno.bind([(2, 12), (4,)], [(2, 3, 4)]) == {"b": 2, "h": 3, "d": 4}
    assert anno.splittable() == ["b", "h"]
    with pytest.raises(PlanError, match="needs size"):
        anno.bind([(2, 12), (5,)], [(2, 3, 4)])
