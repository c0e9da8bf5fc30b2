"""Test configuration: the 8 virtual CPU devices are requested by the root conftest.py."""
import importlib

import jax  # noqa: F401 - jax starts after the root conftest set XLA_FLAGS
import pytest
from cli_run import run_cli
from meshes import make_mesh


@pytest.fixture
def mesh():
    """The 2 x 4 ('data', 'model') mesh most wrapper tests use."""
    return make_mesh((2, 4), ("data", "model"))


@pytest.fixture
def plans(monkeypatch):
    """Counts the plans ``auto_parallel`` makes (one per new program)."""
    api = importlib.import_module("nnscaler_jax.api")
    calls = []
    real = api.make_plan

    def counting(graph, *args, **kwargs):
        calls.append(graph)
        return real(graph, *args, **kwargs)

    monkeypatch.setattr(api, "make_plan", counting)
    return calls


@pytest.fixture(scope="session")
def cli():
    """:func:`run_cli` (tests of the command line)."""
    return run_cli
