"""One single-source Dijkstra per (source layout, shape, itemsize, mesh) answers every
destination with the path a search for that destination alone finds (the per-pair search the
cache replaced): same steps, same time, for every pair of valid layouts."""

import itertools

import networkx as nx
import pytest

from nnscaler_jax.layout import comm_path
from nnscaler_jax.layout.comm import _cached_path, _layout_graph, _paths_from
from nnscaler_jax.mesh.topology import LinkCost, MeshSpec

FAST, SLOW = LinkCost(1e-6, 1e-11), LinkCost(2e-5, 1e-10)
CASES = [
    ((64, 48), 4, MeshSpec(("data", "model"), (2, 4), (SLOW, FAST))),
    ((8, 6, 16), 2, MeshSpec(("data", "model"), (2, 2), (FAST, FAST))),
    ((32,), 4, MeshSpec(("a", "b", "c"), (2, 2, 2), (SLOW, FAST, SLOW))),
]


@pytest.mark.parametrize("shape,itemsize,mesh", CASES)
def test_every_pair_matches_the_per_pair_search(shape, itemsize, mesh):
    graph = _layout_graph(shape, itemsize, mesh)
    nodes = list(graph.nodes)
    assert len(nodes) > 4
    for src, dst in itertools.product(nodes, nodes):
        got = comm_path(src, dst, shape, itemsize, mesh)
        if src == dst:
            assert got.steps == ()
            continue
        want = nx.dijkstra_path(graph, src, dst, weight="weight")
        assert [src] + [s.dst for s in got.steps] == want, (src, dst)
        assert got.time_s == sum(graph.edges[u, v]["step"].time_s
                                 for u, v in itertools.pairwise(want))


def test_one_search_per_source():
    shape, itemsize, mesh = CASES[0]
    nodes = list(_layout_graph(shape, itemsize, mesh).nodes)
    _paths_from.cache_clear()
    _cached_path.cache_clear()
    for dst in nodes:
        comm_path(nodes[0], dst, shape, itemsize, mesh)
    assert _paths_from.cache_info().misses == 1
