"""Mesh topology (`mesh/topology.py`): what tests/cost/test_comm_cost.py leaves out: groups over
several axes, pickling, per-axis link sequences, validation, and monotonicity of the formulas."""

import pickle

import pytest
from meshes import make_mesh

from nnscaler_jax.errors import PlanError
from nnscaler_jax.mesh.topology import (
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

FAST = LinkCost(1e-6, 1e-12)   # NVLink-like
SLOW = LinkCost(5e-6, 1e-10)   # across nodes
MESH = MeshSpec(("data", "fsdp", "model"), (2, 3, 4), (SLOW, FAST, FAST))


def test_size_of_a_tuple_of_axes_is_the_product():
    assert MESH.size(("data", "model")) == 8
    assert MESH.size(("data", "fsdp", "model")) == MESH.num_devices == 24
    assert MESH.size(()) == 1  # no axis: one device
    with pytest.raises(PlanError, match="unknown mesh axis"):
        MESH.size(("data", "pipe"))


def test_link_of_a_tuple_of_axes_is_bound_by_the_slowest():
    # one ring through data x model: the latency and the bandwidth of the slow link
    assert MESH.link(("data", "model")) == LinkCost(5e-6, 1e-10)
    assert MESH.link(("fsdp", "model")) == FAST
    # max is taken per field: a low-latency narrow link and a wide high-latency one
    a, b = LinkCost(1e-6, 1e-9), LinkCost(1e-5, 1e-11)
    m = MeshSpec(("x", "y"), (2, 2), (a, b))
    assert m.link(("x", "y")) == LinkCost(1e-5, 1e-9)


def test_index_follows_axis_order():
    assert [MESH.index(a) for a in MESH.axis_names] == [0, 1, 2]


def test_pickle_round_trip_keeps_equality_and_hash():
    again = pickle.loads(pickle.dumps(MESH))
    assert again == MESH and hash(again) == hash(MESH)
    assert {again: 1}[MESH] == 1  # usable as the same dict key


def test_from_mesh_with_one_link_per_axis():
    mesh = make_mesh((2, 4), ("data", "model"))
    spec = MeshSpec.from_mesh(mesh, [SLOW, FAST])
    assert spec.link("data") == SLOW and spec.link("model") == FAST
    with pytest.raises(PlanError, match="one size and one link per axis"):
        MeshSpec.from_mesh(mesh, [SLOW])


def test_validation():
    with pytest.raises(PlanError, match="sizes must be >= 1"):
        MeshSpec(("a",), (0,), (FAST,))
    with pytest.raises(PlanError, match="links must be LinkCost"):
        MeshSpec(("a",), (2,), ((1e-6, 1e-9),))
    with pytest.raises(PlanError):
        LinkCost(0.0, -1e-9)
    for bad in ((float("inf"), 1e-9), (1e-6, float("inf")), (float("nan"), 1e-9)):
        with pytest.raises(PlanError, match="finite and >= 0"):
            LinkCost(*bad)
    with pytest.raises(PlanError, match="need p >= 1 and n >= 0"):
        reduce_scatter_time(FAST, 2, -1)
    with pytest.raises(PlanError, match="need p >= 1"):
        collective_time("slice", FAST, 0, 10)  # local kinds check their group too


def test_local_kinds_send_nothing_and_unknown_kinds_are_errors():
    assert wire_bytes("slice", 8, 1024) == 0.0
    assert wire_bytes("value_chunk", 8, 1024) == 0.0
    assert wire_bytes("ppermute", 8, 1024) == 1024.0
    with pytest.raises(PlanError, match="unknown collective kind"):
        wire_bytes("broadcast", 8, 1024)


@pytest.mark.parametrize("fn", [all_gather_time, all_reduce_time, reduce_scatter_time,
                                all_to_all_time, ppermute_time])
def test_times_grow_with_bytes_and_start_at_the_latency(fn):
    times = [fn(SLOW, 4, n) for n in (0, 1 << 10, 1 << 20)]
    assert times[0] == SLOW.alpha_s  # n = 0 still pays one latency (p > 1)
    assert times[0] < times[1] < times[2]


def test_ring_collectives_approach_their_bandwidth_bound_as_groups_grow():
    """(p-1)/p grows to 1: an all-reduce of n bytes never sends more than 2n per device."""
    n = 1 << 20
    ar = [all_reduce_time(SLOW, p, n) for p in (2, 4, 8, 64)]
    assert ar == sorted(ar)
    assert ar[-1] < SLOW.alpha_s + 2 * SLOW.beta_s_per_byte * n
    # an all-reduce is a reduce-scatter followed by an all-gather of the same buffer
    for p in (2, 4, 8):
        assert all_reduce_time(SLOW, p, n) == pytest.approx(
            reduce_scatter_time(SLOW, p, n) + all_gather_time(SLOW, p, n) - SLOW.alpha_s)
