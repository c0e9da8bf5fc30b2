"""The package's architecture rules, checked on the source (parsed with `ast`, never imported).

docs/design.md, "Layers: imports only go down": every module of `nnscaler_jax` belongs to a layer
with a rank (`LAYERS`, by longest dotted prefix); a module imports only modules of its own or a lower
rank, function-level and `if TYPE_CHECKING` imports included, and the imports have no cycle. Nothing
inside the package imports the root package (only `__main__` may). `from x import _name` across
modules is forbidden (private *names*; private module files such as `rules/_build.py` are fine).
No module is over 800 lines (one concept whatever its length; past ~800 lines, ask whether it still
is: STYLE retired the 500-line cap), no function over 80 (the `def` line to its last line); exceptions go
in `EXCEPTIONS` and must be listed in docs/design.md's "Exceptions to the size limits".
"""
import ast
import re
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PKG = "nnscaler_jax"
DESIGN = ROOT / "docs" / "design.md"
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 800, 80

# Size-limit exceptions: "nnscaler_jax/x.py" or "nnscaler_jax/x.py::Class.func" -> reason.
EXCEPTIONS: dict[str, str] = {
    "nnscaler_jax/pipeline/hetero.py": "one concept, plans over a cluster of several device "
    "kinds: its three planners share one data model, one pricing and one realization",
}

# Module prefix -> layer rank (docs/design.md's table; the root package and `__main__` on top).
LAYERS = {
    "errors": 0, "mesh": 1, "ir": 2, "rules": 3, "capture": 4, "layout": 5,
    "plan": 6, "primitives": 6, "constraints": 6, "cost": 7, "search": 8, "lower": 9,
    "pipeline": 10, "train": 11, "planner": 12, "api": 13, "cli": 14,
}
RANKS = {f"{PKG}.{name}": rank for name, rank in LAYERS.items()} | {PKG: 15, f"{PKG}.__main__": 15}


def discover_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every `.py` under the package (`__init__` names the package)."""
    modules = {}
    for path in sorted((ROOT / PKG).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def rank_of(module: str) -> int | None:
    """The rank of the longest `RANKS` prefix of `module` (whole dotted parts); None if unlisted."""
    keys = [k for k in RANKS if module == k or (k != PKG and module.startswith(k + "."))]
    return RANKS[max(keys, key=len)] if keys else None


def _longest_module(name: str, modules) -> str | None:
    parts = name.split(".")
    return next((".".join(parts[:i]) for i in range(len(parts), 0, -1)
                 if ".".join(parts[:i]) in modules), None)


def _where(module: str, modules, lineno: int) -> str:
    return f"{modules[module].relative_to(ROOT)}:{lineno}"


def collect_imports(module: str, modules) -> list[tuple[str, str, int, str]]:
    """(target module, imported name or '', line, source text) for every package import in `module`."""
    path = modules[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):  # every node: function-level and TYPE_CHECKING imports too
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _longest_module(alias.name, modules)
                if target:
                    out.append((target, "", node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up from the importing module's package
                pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([node.module] if node.module else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                target = full if full in modules else _longest_module(base, modules)
                if target:
                    name = "" if full in modules else alias.name
                    out.append((target, name, node.lineno, ast.unparse(node)))
    return out


def import_graph() -> tuple[dict[str, Path], nx.DiGraph]:
    """The module import graph; each edge keeps its `sites` (file:line, source text)."""
    modules = discover_modules()
    g = nx.DiGraph()
    g.add_nodes_from(modules)
    for src in modules:
        for dst, _, lineno, text in collect_imports(src, modules):
            if dst != src:
                g.add_edge(src, dst)
                sites = g.edges[src, dst].setdefault("sites", [])
                if (site := (_where(src, modules, lineno), text)) not in sites:
                    sites.append(site)
    return modules, g


def _report(title: str, offenders: list[str]) -> str:
    return f"{title} ({len(offenders)}):\n  " + "\n  ".join(offenders)


def test_every_module_has_a_layer():
    unlisted = [f"{m} ({p.relative_to(ROOT)})" for m, p in discover_modules().items()
                if rank_of(m) is None]
    assert not unlisted, _report(
        "modules with no layer: add the layer to docs/design.md's table and to LAYERS in "
        "tests/test_architecture.py", unlisted)


def test_no_import_cycles():
    """Each strongly connected component of the import graph, with every import inside it."""
    _, g = import_graph()
    offenders = []
    for scc in sorted(map(sorted, nx.strongly_connected_components(g)), key=lambda c: c[0]):
        if len(scc) > 1:
            inside = g.subgraph(scc)
            hops = [f"{a} -> {b}: {', '.join(s for s, _ in sites)}"
                    for a, b, sites in sorted(inside.edges(data="sites"))]
            loop = [a for a, _ in nx.find_cycle(inside)]
            example = " -> ".join(loop + loop[:1])
            offenders.append(f"cycle among {', '.join(scc)}\n      e.g. {example}\n      "
                             + "\n      ".join(hops))
    assert not offenders, _report("import cycles (strongly connected modules)", offenders)


def test_imports_only_go_down():
    _, g = import_graph()
    offenders = []
    for src, dst, sites in g.edges(data="sites"):
        rs, rd = rank_of(src), rank_of(dst)
        if rs is None or rd is None:
            why = f"no layer for {src if rs is None else dst}: add it to docs/design.md and LAYERS"
        elif rd > rs:
            why = f"rank {rs} imports rank {rd}" + (" (the root package)" if dst == PKG else "")
        else:
            continue
        offenders += [f"{site}: {src} -> {dst}: {why}: {text}" for site, text in sites]
    assert not offenders, _report("imports that go up the layers", sorted(offenders))


def test_no_private_imports_across_modules():
    modules = discover_modules()
    offenders = sorted(
        f"{_where(src, modules, lineno)}: {src} imports {name} from {dst}: {text}"
        for src in modules for dst, name, lineno, text in collect_imports(src, modules)
        if name.startswith("_") and not name.startswith("__") and dst != src)
    assert not offenders, _report("private names imported from another module", offenders)


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, def node) for every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        name = prefix
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node
            name += "."
        yield from _functions(node, name)


def test_module_size():
    offenders = []
    for path in discover_modules().values():
        rel, n = str(path.relative_to(ROOT)), len(path.read_text().splitlines())
        if n > MAX_MODULE_LINES and rel not in EXCEPTIONS:
            offenders.append(f"{rel}: {n} lines")
    assert not offenders, _report(f"modules over {MAX_MODULE_LINES} lines", offenders)


def test_function_size():
    offenders = []
    for path in discover_modules().values():
        rel = str(path.relative_to(ROOT))
        for name, node in _functions(ast.parse(path.read_text())):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES and f"{rel}::{name}" not in EXCEPTIONS:
                offenders.append(f"{rel}:{node.lineno}: {name}: {n} lines")
    assert not offenders, _report(f"functions over {MAX_FUNCTION_LINES} lines", offenders)


def test_size_exceptions_are_documented():
    text = DESIGN.read_text()
    start = text.find("\nExceptions to the size limits")
    assert start >= 0, "docs/design.md has no line starting 'Exceptions to the size limits'"
    end = text.find("\n#", start + 1)
    section = text[start: end if end >= 0 else len(text)]
    files = {str(p.relative_to(ROOT)) for p in discover_modules().values()}
    missing = [k for k in EXCEPTIONS if k not in section]
    stale = [k for k in EXCEPTIONS if k.split("::")[0] not in files]
    assert not missing, _report("EXCEPTIONS not listed in docs/design.md's exceptions", missing)
    assert not stale, _report("EXCEPTIONS naming no module", stale)


def design_layers() -> dict[str, int]:
    """Layer name -> rank from the table under docs/design.md's "Layers: imports only go down"."""
    text = DESIGN.read_text().split("## Layers: imports only go down", 1)[1].split("\n#", 1)[0]
    layers = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2 and cells[0].isdigit():
            for name in re.findall(r"`([^`]+)`", cells[1]):
                layers[name.strip("/")] = int(cells[0])
    return layers


def test_rank_table_matches_design_doc():
    doc = design_layers()
    diff = [f"{name}: design.md {doc.get(name)}, LAYERS {LAYERS.get(name)}"
            for name in sorted(doc.keys() | LAYERS.keys()) if doc.get(name) != LAYERS.get(name)]
    assert not diff, _report("layers that differ between docs/design.md and LAYERS", diff)
