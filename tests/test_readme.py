"""Every python block of the README runs, in order, in one namespace (as a reader pastes them)."""

from __future__ import annotations

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.slow
def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks
    namespace: dict = {"__name__": "readme"}
    for i, code in enumerate(blocks):
        try:
            exec(compile(code, f"README.md block {i}", "exec"), namespace)  # noqa: S102
        except Exception as e:  # noqa: BLE001 - name the block
            raise AssertionError(f"README python block {i} failed: {type(e).__name__}: {e}\n"
                                 f"{code}") from e
