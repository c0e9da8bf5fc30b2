"""The public API is docs/api.md's table "What is public": the package's and four subpackages'
``__all__``, plus named functions of the command line's modules. Everything else is internal.

- the table equals each owned package's ``__all__`` (a name exported without being documented,
  or documented without being exported, fails);
- every public name imports and has its own docstring (constants: a line of docs/api.md);
- the README, every code block of docs/*.md and every code cell of docs/*.ipynb import and
  reference ``nnscaler_jax`` only through public names (``from nnscaler_jax.x import y``,
  ``import nnscaler_jax.x as m`` then ``m.y``, ``nnscaler_jax.x.y`` written out); so does the
  README's prose.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
API_DOC = ROOT / "docs" / "api.md"
PKG = "nnscaler_jax"
# Packages whose __all__ is the public list (the table must equal it); the table's other
# modules (the command line's) list a few of their names only.
OWNED = ("nnscaler_jax", "nnscaler_jax.capture", "nnscaler_jax.cost", "nnscaler_jax.pipeline",
         "nnscaler_jax.train")
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.DOTALL)
DOTTED = re.compile(r"\bnnscaler_jax(?:\.\w+)+")
FROM_IMPORT = re.compile(r"\bfrom (nnscaler_jax[\w.]*) import ([\w, ]+)")


def public_table() -> dict[str, tuple[str, ...]]:
    """Module -> public names, from docs/api.md's "What is public" table."""
    section = API_DOC.read_text().split("## What is public", 1)[1].split("\n## ", 1)[0]
    table = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) == 2:
            table[cells[0].strip("`")] = tuple(re.findall(r"`([^`]+)`", cells[1]))
    return table


PUBLIC = public_table()


def test_table_equals_each_package_all():
    assert set(OWNED) <= set(PUBLIC), f"docs/api.md's table lacks {set(OWNED) - set(PUBLIC)}"
    diffs = []
    for mod in OWNED:
        exported = set(importlib.import_module(mod).__all__)
        listed = set(PUBLIC[mod])
        if exported != listed:
            diffs.append(f"{mod}: in __all__ only {sorted(exported - listed)}, "
                         f"in docs/api.md only {sorted(listed - exported)}")
    assert not diffs, "docs/api.md's table and __all__ differ:\n  " + "\n  ".join(diffs)


def _own_doc(obj) -> str | None:
    """The object's own docstring (not a dataclass' generated signature, not its type's)."""
    doc = obj.__doc__ if (inspect.isclass(obj) or callable(obj) or inspect.ismodule(obj)) \
        else None
    if doc and inspect.isclass(obj) and doc.startswith(f"{obj.__name__}("):
        return None  # dataclasses write "Name(field: type, ...)" when a class has no docstring
    return doc.strip() if doc else None


@pytest.mark.parametrize(("mod", "name"),
                         [(m, n) for m, names in PUBLIC.items() for n in names],
                         ids=[f"{m}.{n}" for m, names in PUBLIC.items() for n in names])
def test_public_name_imports_and_is_documented(mod, name):
    obj = getattr(importlib.import_module(mod), name)  # AttributeError: not importable
    if inspect.isclass(obj) or callable(obj) or inspect.ismodule(obj):
        assert _own_doc(obj), f"{mod}.{name} has no docstring of its own"
    else:  # a constant: described in docs/api.md outside the table
        section = API_DOC.read_text().split("| module | public names |", 1)[1]
        prose = "\n".join(line for line in section.splitlines() if not line.startswith("|"))
        assert f"`{name}`" in prose, f"constant {mod}.{name} is not described in docs/api.md"


# ---- what the pages and notebooks use ----------------------------------------------------------


def resolve(dotted: str) -> str | None:
    """None when ``nnscaler_jax.a.b.c`` reaches a public name through public modules (or is a
    public module); else what is wrong."""
    parts = dotted.split(".")
    module = parts[0]
    for i, part in enumerate(parts[1:], 1):
        step = f"{module}.{part}"
        if step in PUBLIC or any(m.startswith(step + ".") for m in PUBLIC):
            module = step  # a public module, or a package on the way to one (nnscaler_jax.cli)
            continue
        if part in PUBLIC.get(module, ()):
            return None  # a public name; what follows is its own attribute
        return f"{'.'.join(parts[:i + 1])} is not public"
    return None if module in PUBLIC else f"{module} is not a public module"


class _Uses(ast.NodeVisitor):
    """Problems with the ``nnscaler_jax`` names one piece of Python code imports and reads."""

    def __init__(self) -> None:
        self.modules: dict[str, str] = {}  # local name -> nnscaler_jax module it is bound to
        self.problems: list[str] = []

    def _check(self, dotted: str, line: int) -> None:
        if (why := resolve(dotted)) is not None:
            self.problems.append(f"line {line}: {why}")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] != PKG:
                continue
            self._check(alias.name, node.lineno)
            if alias.asname:
                self.modules[alias.asname] = alias.name
            else:
                self.modules[PKG] = PKG

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if not node.module or node.module.split(".")[0] != PKG:
            return
        for alias in node.names:
            full = f"{node.module}.{alias.name}"
            self._check(full, node.lineno)
            if full in PUBLIC:
                self.modules[alias.asname or alias.name] = full

    def visit_Attribute(self, node: ast.Attribute) -> None:
        chain, base = [], node
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in self.modules:
            self._check(".".join([self.modules[base.id], *reversed(chain)]), node.lineno)
            return  # the chain is checked whole
        self.generic_visit(node)


def _python_problems(code: str) -> list[str]:
    code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line
                     for line in code.splitlines())  # notebook magics
    uses = _Uses()
    uses.visit(ast.parse(code))
    return uses.problems


def _text_problems(text: str) -> list[str]:
    problems = [why for m in DOTTED.finditer(text) if (why := resolve(m[0]))]
    for m in FROM_IMPORT.finditer(text):
        problems += [why for name in m[2].replace(" ", "").split(",") if name
                     if (why := resolve(f"{m[1]}.{name}"))]
    return problems


def pieces() -> list[tuple[str, str, str]]:
    """(where, kind, text): every code block of the README and docs/*.md ('python' or 'text'),
    the README's prose ('text') and every notebook code cell ('python')."""
    out = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text, name = page.read_text(), str(page.relative_to(ROOT))
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            out.append((f"{name}:{line}", "python" if m[1] == "python" else "text", m[2]))
        if page.name == "README.md":
            out.append((f"{name} (prose)", "text", FENCE.sub("", text)))
    for nb in sorted((ROOT / "docs").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        out += [(f"{nb.relative_to(ROOT)} cell {i}", "python", "".join(c["source"]))
                for i, c in enumerate(cells) if c["cell_type"] == "code"]
    return out


def test_pages_and_notebooks_use_only_public_names():
    problems = []
    for where, kind, text in pieces():
        found = _python_problems(text) if kind == "python" else _text_problems(text)
        problems += [f"{where}: {p}" for p in found]
    assert not problems, ("internal nnscaler_jax names in user-facing pages (use the public ones "
                          "of docs/api.md, or make the name public there and in __all__):\n  "
                          + "\n  ".join(problems))


def test_the_checker_catches_internal_names():
    """The checks above can fail: internal paths, private names and aliases of public modules."""
    assert _python_problems("from nnscaler_jax.planner import make_plan")
    assert _python_problems("from nnscaler_jax.pipeline import schedule as sch")
    assert _python_problems("import nnscaler_jax.cost as c\nc.devices.CPU")
    assert _python_problems("import nnscaler_jax\nnnscaler_jax.search.entry.POLICIES")
    assert _python_problems("from nnscaler_jax import cli")      # a package, not public itself
    assert not _python_problems("from nnscaler_jax import pipeline as p\np.one_f_one_b(2, 4)")
    assert not _python_problems("from nnscaler_jax.cli.plots import layout_map")
    assert not _python_problems("from nnscaler_jax.cost import CostModel\nCostModel.for_axes")
    assert _text_problems("use `nnscaler_jax.lower.verify.PRECISION_RTOL`")
    assert not _text_problems("python -c 'from nnscaler_jax.train import initialize'")
