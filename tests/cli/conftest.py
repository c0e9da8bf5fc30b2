"""The command line run in-process for the tests of this folder."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable

import pytest

from nnscaler_jax.cli.main import main


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``main(argv)`` in-process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="session")
def cli() -> Callable[[list[str]], tuple[int, str, str]]:
    """:func:`run_cli`."""
    return run_cli
