"""Graph values: golden printed IR, deterministic printing, the networkx view."""

from __future__ import annotations

import difflib
import os
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import networkx as nx
import pytest

import models
from nnscaler_jax import trace
from nnscaler_jax.ir.graph import Graph

GOLDEN = pathlib.Path(__file__).parent / "golden"


class TinyMLP(nn.Module):
    """``fc1`` (4 -> 8) -> relu -> ``fc2`` (8 -> 4): the golden-IR model."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return nn.Dense(4, name="fc2")(nn.relu(nn.Dense(8, name="fc1")(x)))


def mlp_ir() -> str:
    """The printed IR of :class:`TinyMLP` on a ``[2, 4]`` batch."""
    return str(trace(TinyMLP(), jax.ShapeDtypeStruct((2, 4), jnp.float32),
                     variables=_mlp_variables()))


def _mlp_variables():
    return jax.eval_shape(lambda x: TinyMLP().init(jax.random.key(0), x),
                          jax.ShapeDtypeStruct((2, 4), jnp.float32))


def check_golden(name: str, got: str) -> None:
    """Compare ``got`` with ``golden/<name>``; ``UPDATE_GOLDEN=1`` rewrites the file."""
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(got + "\n")
        return
    if not path.exists():
        pytest.fail(f"no golden file {path}; create it with UPDATE_GOLDEN=1")
    want = path.read_text().rstrip("\n")
    if got != want:
        diff = "\n".join(difflib.unified_diff(want.splitlines(), got.splitlines(),
                                              f"golden/{name}", "got", lineterm=""))
        pytest.fail(f"printed IR differs from golden/{name} (rewrite with UPDATE_GOLDEN=1):\n"
                    f"{diff}")


def test_golden_mlp_ir() -> None:
    check_golden("mlp.txt", mlp_ir())


def test_printed_ir_is_deterministic_across_processes() -> None:
    """Same text in a fresh interpreter with another hash seed (no set/dict-order leaks)."""
    code = ("import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; "
            "import test_ir_graph as t; sys.stdout.write(t.mlp_ir())")
    here = pathlib.Path(__file__).parent
    env = dict(os.environ, PYTHONHASHSEED="12345", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code, str(here), str(here.parents[1])],
                         capture_output=True, text=True, env=env, timeout=120, check=True)
    assert out.stdout == mlp_ir()
    assert mlp_ir() == mlp_ir()


def _inputs_read(g: Graph) -> int:
    read = {t.id for op in g.ops for t in op.inputs}
    return sum(t.id in read for t in g.inputs + g.consts)


def _check_networkx(g: Graph) -> None:
    view = g.to_networkx()
    assert nx.is_directed_acyclic_graph(view)
    assert view.number_of_nodes() == len(g.ops) + _inputs_read(g)
    # One edge per non-literal operand read, from the tensor's producer.
    producers = {t.id for t in g.inputs + g.consts} | {t.id for op in g.ops for t in op.outputs}
    reads = sum(t.id in producers for op in g.ops for t in op.inputs)
    assert view.number_of_edges() == reads
    for u, v, data in view.edges(data=True):
        t = data["tensor"]
        assert t in view.nodes[v]["op"].inputs
        if isinstance(u, str):
            assert u == f"in:{t.id}"
        else:
            assert t in view.nodes[u]["op"].outputs


def test_networkx_view_of_the_mlp() -> None:
    g = trace(TinyMLP(), jnp.ones((2, 4)))
    _check_networkx(g)
    order = list(nx.topological_sort(g.to_networkx()))
    ops = [n for n in order if not isinstance(n, str)]
    assert ops.index(g.op("fc1").id) < ops.index(g.op("fc2").id)


@pytest.mark.parametrize(("name", "preset"), [
    ("gpt", "tiny"),
    ("gpt", "tiny-scan"),
    ("gpt_nnx", "tiny"),
])
def test_networkx_view_of_the_zoo(name: str, preset: str) -> None:
    spec = models.get(name, preset)
    _check_networkx(trace(spec.module, *spec.make_args()))
