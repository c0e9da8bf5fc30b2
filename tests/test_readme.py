"""Every python block of the README and of each docs/*.md page runs, in order, in one namespace
per file (as a reader pastes them). A block followed by a line starting "prints" and a plain
fenced block shows output: each shown line must appear in what the block printed, in order
(a line that is only `...` stands for lines left out), so quoted output cannot drift."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK = re.compile(r"```python\n(.*?)```(?:\n\nprints[^\n]*\n\n```(?:text)?\n(.*?)```)?", re.DOTALL)


def blocks(path: pathlib.Path) -> list[tuple[str, str | None]]:
    """(code, shown output or None) for every python block of ``path``, in order."""
    return [(m[1], m[2]) for m in BLOCK.finditer(path.read_text())]


PAGES = [README] + [p for p in sorted((ROOT / "docs").glob("*.md")) if blocks(p)]


def missing_lines(shown: str, printed: str) -> list[str]:
    """The shown lines (`...` skipped) that are not in ``printed`` in order; [] when all are.

    >>> missing_lines("a\\n...\\nc", "a\\nb\\nc\\n")
    []
    >>> missing_lines("c\\na", "a\\nc")
    ['a']
    """
    out = [line.rstrip() for line in printed.splitlines()]
    pos, missing = 0, []
    for line in (s.rstrip() for s in shown.splitlines()):
        if line.strip() == "...":
            continue
        try:
            pos = out.index(line, pos) + 1
        except ValueError:
            missing.append(line)
    return missing


@pytest.mark.slow
@pytest.mark.parametrize("path", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_python_blocks_run(path: pathlib.Path):
    found = blocks(path)
    assert found, f"{path.name} has no python block"
    name = path.relative_to(ROOT)
    namespace: dict = {"__name__": "readme"}
    for i, (code, shown) in enumerate(found):
        stdout = io.StringIO()
        try:
            with contextlib.redirect_stdout(stdout):
                exec(compile(code, f"{name} block {i}", "exec"), namespace)  # noqa: S102
        except Exception as e:
            raise AssertionError(f"{name} python block {i} failed: {type(e).__name__}: {e}\n"
                                 f"{code}") from e
        if shown is not None:
            missing = missing_lines(shown, stdout.getvalue())
            assert not missing, (
                f"{name} python block {i}: the output shown after it is not what it prints; "
                f"missing (in order):\n  " + "\n  ".join(missing)
                + f"\nprinted:\n{stdout.getvalue()}")
