"""The command line run in-process, for the tests of the command line."""

from __future__ import annotations

import contextlib
import io


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """The command line's ``main(argv)`` in-process: (exit code, stdout, stderr)."""
    from nnscaler_jax.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()
