"""Alpha-beta collective costs: closed forms, p == 1, MeshSpec."""

import pytest
from meshes import make_mesh

from nnscaler_jax.errors import PlanError
from nnscaler_jax.mesh.topology import (
    DEFAULT_LINK,
    LinkCost,
    MeshSpec,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    collective_time,
    ppermute_time,
    reduce_scatter_time,
    wire_bytes,
)

A, B = 2e-6, 1e-9
LINK = LinkCost(A, B)
N = 4 * 1024 * 1024


@pytest.mark.parametrize(
    ("fn", "expected"),
    [
        (all_gather_time, A + B * 3 / 4 * N),
        (all_reduce_time, A + 2 * B * 3 / 4 * N),
        (reduce_scatter_time, A + B * 3 / 4 * N),
        (all_to_all_time, A + B * 3 / 16 * N),
        (ppermute_time, A + B * N),
    ],
)
def test_closed_forms_p4(fn, expected):
    assert fn(LINK, 4, N) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    "fn", [all_gather_time, all_reduce_time, reduce_scatter_time, all_to_all_time, ppermute_time]
)
def test_single_device_group_is_free(fn):
    assert fn(LINK, 1, N) == 0.0


def test_dispatch_and_wire_bytes_match():
    for kind in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "ppermute"):
        t = collective_time(kind, LINK, 8, N)
        assert t == pytest.approx(A + B * wire_bytes(kind, 8, N), rel=1e-12)
    assert collective_time("slice", LINK, 8, N) == 0.0
    assert collective_time("value_chunk", LINK, 8, N) == 0.0
    with pytest.raises(PlanError, match="unknown collective kind"):
        collective_time("broadcast", LINK, 8, N)


def test_bad_arguments():
    with pytest.raises(PlanError):
        all_gather_time(LINK, 0, N)
    with pytest.raises(PlanError):
        LinkCost(-1.0, 0.0)
    with pytest.raises(PlanError):
        LinkCost.from_bandwidth(1e-6, 0)
    assert LinkCost.from_bandwidth(1e-6, 50e9) == LinkCost(1e-6, 1 / 50e9)


def test_meshspec_validation_and_hash():
    m = MeshSpec(("data", "model"), (2, 4), (LINK, DEFAULT_LINK))
    assert m.size("model") == 4 and m.link("data") == LINK and m.num_devices == 8
    assert hash(m) == hash(MeshSpec(("data", "model"), [2, 4], [LINK, DEFAULT_LINK]))
    with pytest.raises(PlanError, match="unknown mesh axis 'pipe'"):
        m.size("pipe")
    with pytest.raises(PlanError, match="unique"):
        MeshSpec(("a", "a"), (2, 2), (LINK, LINK))
    with pytest.raises(PlanError, match="one size and one link"):
        MeshSpec(("a",), (2, 2), (LINK,))


def test_meshspec_from_real_mesh():
    mesh = make_mesh((2, 4), ("data", "model"))
    spec = MeshSpec.from_mesh(mesh)
    assert spec.axis_names == ("data", "model") and spec.axis_sizes == (2, 4)
    assert spec.links == (DEFAULT_LINK, DEFAULT_LINK)
    fast = LinkCost(1e-6, 1e-12)
    assert MeshSpec.from_mesh(mesh, {"model": fast}).links == (DEFAULT_LINK, fast)
    assert MeshSpec.from_mesh(mesh, fast).links == (fast, fast)
    assert MeshSpec.from_mesh(mesh.abstract_mesh) == spec
    with pytest.raises(PlanError, match="unknown mesh axes"):
        MeshSpec.from_mesh(mesh, {"pipe": fast})
