"""Figures quoted in the README and docs/*.md come from the code: each carries a marker right
after it, ``29.7<!-- figure: SOURCE FORMAT -->``, and the quoted text must be what FORMAT makes of
SOURCE's value today, so a rerun benchmark or a changed cost model that moves a figure fails here
until the page says the new one.

- SOURCE is ``results/<file>.json:<key>/<key>/...`` (a list index is a number), or
  ``compute:<name>`` for a value computed here (``COMPUTED``: e.g. what a CLI command prints).
- FORMAT is the body of a Python f-string over ``v``: ``{v:.2f}``, ``{v/2**30:.1f}``,
  ``{v*100:.1f}``.

The markers are HTML comments, so rendered pages show the figure only. The README's prose
quotes no decimal figure with a unit without a marker.
"""

from __future__ import annotations

import functools
import json
import pathlib
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!-- figure: (\S+) (\{.+?\}\S*) -->")
ANY_MARKER = re.compile(r"<!--\s*figure")
FENCE = re.compile(r"```.*?```", re.DOTALL)


@functools.cache
def _compare_json(*args: str) -> dict[str, Any]:
    """The JSON object ``nnscaler-jax compare ... --json`` prints (last line of stdout)."""
    out = subprocess.run([sys.executable, "-m", "nnscaler_jax", "compare", *args, "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _dp_gpt3_1_3b_v100_gib() -> float:
    """README / cli.md: data parallelism's smallest estimate for GPT-3 1.3B on 8 V100s, GiB."""
    res = _compare_json("--model", "gpt", "--preset", "gpt3-1.3b", "--mesh", "2x4",
                        "--cluster", "v100-32g-8x", "--planners", "dp")
    dp = res["planners"]["dp"]
    assert dp["fits"] is False, "the pages say data parallelism does not fit"
    return dp["memory_bytes_per_device"] / 2**30


def _decisions_swin_budgeted_packing() -> float:
    """limitations.md: XLA's packed temporaries over its live peak, Swin tiny's budgeted plan."""
    row = json.loads((ROOT / "results/bench_decisions_memory.json").read_text())["rows"][0]
    assert row["model"] == "swin"
    return row["budgeted"]["xla"]["total"] / row["budgeted"]["xla"]["live_peak"]


COMPUTED: dict[str, tuple[Callable[[], float], bool]] = {  # name -> (function, slow)
    "dp_gpt3_1.3b_v100_gib": (_dp_gpt3_1_3b_v100_gib, True),
    "decisions_swin_budgeted_packing": (_decisions_swin_budgeted_packing, False),
}


def markers() -> list[tuple[str, int, str, str, str]]:
    """(page, line, text before the marker, source, format) for every marker of every page."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in MARKER.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append((str(page.relative_to(ROOT)), line, text[:m.start()], m[1], m[2]))
    return found


def lookup(source: str) -> Any:
    """The value a marker's source names."""
    if source.startswith("compute:"):
        return COMPUTED[source.removeprefix("compute:")][0]()
    file, _, path = source.partition(":")
    value: Any = json.loads((ROOT / file).read_text())
    for key in path.split("/"):
        value = value[int(key)] if isinstance(value, list) else value[key]
    return value


def render(fmt: str, v: Any) -> str:
    """FORMAT applied to ``v``.

    >>> render("{v/2**30:.1f}", 31859490816), render("{v*100:.1f}", 0.3378)
    ('29.7', '33.8')
    """
    return eval("f" + repr(fmt), {"__builtins__": {}}, {"v": v})


def _params():
    for page, line, before, source, fmt in markers():
        slow = source.startswith("compute:") and COMPUTED.get(
            source.removeprefix("compute:"), (None, False))[1]
        yield pytest.param(page, before, source, fmt, id=f"{page}:{line}",
                           marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize(("page", "before", "source", "fmt"), list(_params()))
def test_quoted_figure_is_the_computed_one(page, before, source, fmt):
    want = render(fmt, lookup(source))
    quoted = before.rstrip().rsplit(None, 1)[-1] if before.strip() else ""
    assert before.rstrip().endswith(want), (
        f"{page}: the figure before <!-- figure: {source} {fmt} --> reads {quoted!r}; "
        f"{source} gives {want!r} today: update the page (and the prose around it)")


def test_every_marker_parses_and_names_a_source():
    """A marker with a typo would check nothing: every ``<!-- figure`` must parse, and each
    computed name exist."""
    bad = []
    for page in PAGES:
        text = page.read_text()
        good = {m.start() for m in MARKER.finditer(text)}
        bad += [f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
                for m in ANY_MARKER.finditer(text) if m.start() not in good]
    for page, line, _, source, _ in markers():
        if source.startswith("compute:") and source.removeprefix("compute:") not in COMPUTED:
            bad.append(f"{page}:{line}: no COMPUTED entry {source!r}")
        elif not source.startswith("compute:") and not (ROOT / source.partition(":")[0]).is_file():
            bad.append(f"{page}:{line}: no file {source.partition(':')[0]}")
    assert not bad, "markers that do not parse or name nothing:\n  " + "\n  ".join(bad)


def test_readme_figures_are_marked():
    """Every decimal figure with a unit in the README's prose carries a marker (the marker sits
    right after the number, before its unit: ``29.7<!-- figure: ... --> GiB``)."""
    text = FENCE.sub("", (ROOT / "README.md").read_text())
    unmarked = [m[0] for m in re.finditer(r"\b\d+\.\d+(?!\d)", text)
                if not text.startswith("<!-- figure", m.end())
                and re.match(r"\s?(GiB|GB|MiB|ms|s|x|%)(?!\w)", text[m.end():])]
    assert not unmarked, f"README figures without a marker: {unmarked}"
