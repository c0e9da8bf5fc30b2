"""`cost/devices.py`: what tests/cost/test_cost_model.py leaves out of the hardware table:
peaks per dtype class, presets by name, the V100 preset's figures, Alpa's intra/inter placement
on meshes of 3 axes. (The default memory budget: tests/test_default_budget.py.)"""

from __future__ import annotations

import pytest

from nnscaler_jax.cost.devices import (
    A100_40G,
    CLUSTERS,
    DEVICES,
    IB_EDR,
    IB_HDR,
    NVLINK_A100,
    NVLINK_V100,
    V100_32G,
    ClusterSpec,
    DeviceSpec,
    cluster_preset,
    device_for_kind,
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


def test_v100_preset_figures():
    """V100-SXM2-32GB: 125 T fp16 tensor cores, 15.7 T fp32 and no TF32 (float32 matmuls at the
    fp32 rate), 32 GiB HBM2 at 900 GB/s; NVLink 2 150 GB/s per direction, IB EDR 12.5 GB/s."""
    d = device_preset("v100-32g")
    assert d is V100_32G and d.name == "V100-32G" and d.kind == "Tesla V100-SXM2-32GB"
    assert d.flops == 125e12 and d.flops_fp32 == 15.7e12 and d.flops_tf32 is None
    assert d.peak("float16", matmul=True) == 125e12
    assert d.peak("float32", matmul=True) == d.peak("float32", matmul=False) == 15.7e12
    assert d.memory_bytes == 32 * 2**30 and d.bandwidth == 900e9 and d.efficiency == 0.75
    assert device_for_kind("tesla v100-sxm2-32gb") is d and device_for_kind("cpu") is None
    c = cluster_preset("v100-32g-8x")
    assert c.device is d and c.devices_per_node == 8
    assert (c.intra, c.inter) == (NVLINK_V100, IB_EDR)
    assert c.intra.beta_s_per_byte == pytest.approx(1 / 150e9)
    assert c.inter.beta_s_per_byte == pytest.approx(1 / 12.5e9)
    # nnScaler's artifact: 16 V100 per node, 8 EDR ports per node (6.25 GB/s per GPU)
    big = cluster_preset("v100-32g-16x")
    assert big.device is d and big.devices_per_node == 16 and big.intra == NVLINK_V100
    assert big.inter.beta_s_per_byte == pytest.approx(1 / 6.25e9)
    assert big.placement(("data", "model"), (2, 8)) == {"data": "intra", "model": "intra"}
    assert c.placement(("data", "model"), (2, 8)) == {"data": "inter", "model": "intra"}


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
