#!/usr/bin/env python
"""Strip outputs from notebooks (default: docs/*.ipynb) in place, as they are kept in git.

    python scripts/strip_notebooks.py                 # strip docs/*.ipynb
    python scripts/strip_notebooks.py a.ipynb --check # list notebooks with outputs, exit 1

Removes every code cell's outputs and execution count, the per-cell metadata a run adds
(``execution`` timings, ``scrolled``...; ``tags`` stay) and the kernel's version details from
the notebook metadata, so that a notebook diffs only where its cells changed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
KEEP_CELL_METADATA = ("tags",)


def strip(nb: nbformat.NotebookNode) -> bool:
    """Strip ``nb`` in place; True if anything changed."""
    before = nbformat.writes(nb)
    for cell in nb.cells:
        cell.metadata = {k: v for k, v in cell.metadata.items() if k in KEEP_CELL_METADATA}
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    nb.metadata.pop("widgets", None)
    if "language_info" in nb.metadata:
        nb.metadata["language_info"] = {"name": nb.metadata["language_info"].get("name",
                                                                                 "python")}
    return nbformat.writes(nb) != before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=Path,
                        help="notebooks (default: docs/*.ipynb)")
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a notebook has outputs")
    args = parser.parse_args(argv)
    paths = args.paths or sorted((ROOT / "docs").glob("*.ipynb"))
    dirty = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        if strip(nb):
            dirty.append(path)
            if not args.check:
                nbformat.write(nb, path)
    for path in dirty:
        print(f"{'has outputs' if args.check else 'stripped'}: {path}")
    return 1 if args.check and dirty else 0


if __name__ == "__main__":
    sys.exit(main())
