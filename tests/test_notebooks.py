"""docs/quickstart.ipynb and docs/compare.ipynb: stored without outputs, and run headless in a
fresh kernel (nbclient) without a cell error.

The kernel inherits this process's environment, so it starts with the 8 virtual CPU devices the
root conftest.py requests. Strip outputs after editing a notebook with
``python scripts/strip_notebooks.py``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = [ROOT / "docs" / "quickstart.ipynb", ROOT / "docs" / "compare.ipynb"]
CELL_TIMEOUT_S = 240


def _strip_script():
    spec = importlib.util.spec_from_file_location("strip_notebooks",
                                                  ROOT / "scripts" / "strip_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _read(path: Path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    return nb


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
    nb = _read(path)
    assert nb.nbformat == 4
    assert nb.metadata["kernelspec"]["name"] == "python3"
    with_outputs = [i for i, c in enumerate(nb.cells)
                    if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not with_outputs, (f"{path.name}: cells {with_outputs} have outputs; run "
                              "python scripts/strip_notebooks.py")
    assert not _strip_script().strip(nb), f"{path.name}: not stripped; run python scripts/strip_notebooks.py"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_without_errors(path, tmp_path):
    nbclient = pytest.importorskip("nbclient")
    nb = _read(path)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError naming the failing cell
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    kinds = {k for o in outputs for k in o.get("data", {})}
    assert "image/png" in kinds  # the figures are drawn
    if path.stem == "quickstart":
        assert "text/html" in kinds  # the plan's notebook view
    assert not list(tmp_path.iterdir()), "the notebook wrote files into its working directory"
