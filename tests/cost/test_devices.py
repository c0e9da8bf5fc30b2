"""`cost/devices.py`: what tests/cost/test_cost_model.py leaves out of the hardware table:
peaks per dtype class, presets by name, Alpa's intra/inter placement on meshes of 3 axes."""

from __future__ import annotations

import pytest

from nnscaler_jax.cost.devices import (
    A100_40G,
    CLUSTERS,
    DEVICES,
    IB_HDR,
    NVLINK_A100,
    ClusterSpec,
    DeviceSpec,
    cluster_preset,
    device_preset,
)
from nnscaler_jax.errors import PlanError


def test_peak_per_dtype_class():
    d = DeviceSpec("x", flops=100.0, flops_fp32=10.0, memory_bytes=1, bandwidth=1.0)
    for dt in ("bfloat16", "float16", "float8_e4m3fn", "int8"):
        assert d.peak(dt, matmul=True) == 100.0 and d.peak(dt, matmul=False) == 100.0
    assert d.peak("float64", matmul=True) == 5.0   # half the fp32 rate
    # no TF32 figure: float32 matmuls run at the fp32 rate
    assert d.peak("float32", matmul=True) == 10.0
    tf32 = DeviceSpec("y", 100.0, 10.0, 1, 1.0, flops_tf32=50.0)
    assert tf32.peak("float32", matmul=True) == 50.0 and tf32.peak("float32", matmul=False) == 10.0


def test_presets_are_consistent():
    for key, d in DEVICES.items():
        assert key == d.name.lower() and device_preset(d.name.upper()) is d
        assert d.flops >= d.flops_fp32 > 0 and d.memory_bytes > 0 and d.bandwidth > 0
        assert 0 < d.efficiency <= 1 and 0 < d.bandwidth_efficiency <= 1
    for key, c in CLUSTERS.items():
        assert cluster_preset(key.upper()) is c and c.name == key
        # inside a node is faster than across nodes, on both terms
        assert c.intra.alpha_s <= c.inter.alpha_s
        assert c.intra.beta_s_per_byte < c.inter.beta_s_per_byte
    with pytest.raises(PlanError, match="unknown cluster 'dgx'"):
        cluster_preset("dgx")


C = ClusterSpec("t", A100_40G, 8, NVLINK_A100, IB_HDR)


@pytest.mark.parametrize(("names", "sizes", "want"), [
    (("data", "model"), (4, 8), {"data": "inter", "model": "intra"}),
    (("data", "model"), (2, 4), {"data": "intra", "model": "intra"}),   # 8 devices: one node
    (("data", "fsdp", "model"), (2, 2, 4), {"data": "inter", "fsdp": "intra",
                                              "model": "intra"}),
    (("data", "fsdp", "model"), (2, 4, 4), {"data": "inter", "fsdp": "inter",
                                              "model": "intra"}),
    (("model",), (16,), {"model": "inter"}),                             # larger than a node
    (("a", "b", "c"), (4, 1, 16), {"a": "inter", "b": "inter", "c": "inter"}),
])
def test_placement_minor_axes_inside_a_node_while_they_fit(names, sizes, want):
    got = C.placement(names, sizes)
    assert got == want and list(got) == list(names)  # in mesh order


def test_mesh_spec_uses_the_placement_and_checks_overrides():
    m = C.mesh_spec(("data", "fsdp", "model"), (2, 2, 4))
    assert (m.link("data"), m.link("fsdp"), m.link("model")) == (IB_HDR, NVLINK_A100, NVLINK_A100)
    assert m.axis_sizes == (2, 2, 4)
    m = C.mesh_spec(("data", "model"), (2, 4), placement={"model": "inter"})
    assert m.link("model") == IB_HDR and m.link("data") == NVLINK_A100
    with pytest.raises(PlanError, match="use 'intra'"):
        C.mesh_spec(("data",), (8,), placement={"data": "node"})
