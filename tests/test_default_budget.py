"""Memory is a constraint by default (issue 15): planning for a cluster preset, a cost model whose
device has a known memory, or a mesh of accelerators, without ``max_memory_per_device``, the
budget is the device's memory less ``DEFAULT_RESERVE_FRACTION``; the searches and the final check
both use it; an explicit budget wins; CPU meshes get none. Paper-scale models only on abstract
shapes (``capture_spec`` traces ``jax.ShapeDtypeStruct`` inputs)."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
from meshes import make_mesh

import models
from nnscaler_jax import Constraints
from nnscaler_jax.capture.trace import capture_spec
from nnscaler_jax.cost.devices import (
    A100_80G,
    CPU,
    DEFAULT_RESERVE_FRACTION,
    H100_80G,
    IB_EDR,
    NVLINK_V100,
    ClusterSpec,
    cluster_preset,
    default_budget,
    default_budget_of,
    memory_reserve,
)
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.errors import NoFitError
from nnscaler_jax.planner import make_plan, plan_and_report, with_default_budget

AXES = {"data": 2, "model": 4}
V100_BUDGET = 32 * 2**30 - int(32 * 2**30 * DEFAULT_RESERVE_FRACTION)  # 28.8 GiB


@pytest.fixture(scope="module")
def gpt13():
    """GPT-3 1.3B (Alpa's 4-GPU size) traced on abstract shapes: its data-parallel plan needs
    ~72 GiB per device, Megatron's and the search's ~22-25 GiB."""
    return capture_spec(models.get("gpt", "gpt3-1.3b")).graph


@pytest.fixture(scope="module")
def tiny():
    return capture_spec(models.get("gpt", "tiny")).graph


def _v100():
    return CostModel.for_cluster(cluster_preset("v100-32g-8x"), AXES)


def test_the_reserve_rule_and_the_budget_of_each_source():
    assert DEFAULT_RESERVE_FRACTION == 0.1
    assert memory_reserve(80 * 10**9) == 8 * 10**9
    assert default_budget(AXES, _v100()) == V100_BUDGET
    assert default_budget(AXES, cluster_preset("v100-32g-8x")) == V100_BUDGET  # a ClusterSpec
    assert default_budget(AXES, H100_80G) == 72 * 10**9                       # a DeviceSpec
    assert default_budget(AXES, CostModel.for_axes(AXES, device=A100_80G)) == 72 * 10**9
    # no memory to speak of: the CPU model, a timed local backend, a dict mesh, CPU devices
    assert default_budget(AXES, CostModel.for_axes(AXES)) is None
    local = dataclasses.replace(CPU, name="local-cpu")
    assert default_budget(AXES, local) is None and default_budget(AXES) is None
    assert default_budget(make_mesh((2, 4), ("data", "model"))) is None


class _Gpu:
    platform, device_kind = "gpu", "Tesla V100-SXM2-32GB"

    def __init__(self, stats=None):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def _gpu_mesh(stats=None, kind=None):
    dev = _Gpu(stats)
    if kind is not None:
        dev.device_kind = kind
    return types.SimpleNamespace(devices=np.array([[dev] * 4] * 2, dtype=object))


def test_a_mesh_of_accelerators_gives_its_memory():
    """Real devices: the allocator's bytes_limit when reported, else the preset of the
    device_kind; an unknown kind without statistics: no default."""
    assert default_budget(_gpu_mesh()) == V100_BUDGET
    assert default_budget(_gpu_mesh({"bytes_limit": 10 * 2**30})) == 9 * 2**30
    assert default_budget(_gpu_mesh(kind="TPU v9")) is None
    b = default_budget_of(_gpu_mesh())
    assert b.device == "V100-32G" and "Tesla V100-SXM2-32GB" in b.source
    # a cluster cost model says what is planned for: it wins over the mesh's devices
    assert default_budget(_gpu_mesh(), CostModel.for_axes(AXES, device=H100_80G)) == 72 * 10**9
    # the planner's one place: fills the budget in unless the user gave one
    cons, default = with_default_budget(None, _gpu_mesh(), None)
    assert cons.max_memory_per_device == V100_BUDGET and default is not None
    cons, default = with_default_budget(Constraints(max_memory_per_device="1GiB"), _gpu_mesh(),
                                        None)
    assert cons.max_memory_per_device == 2**30 and default is None


def test_a_cluster_preset_budget_binds_and_an_explicit_one_overrides(gpt13):
    """GPT-3 1.3B on 8 x V100-32GB: data parallelism does not fit 28.8 GiB, the error says
    where the budget came from and how to change it; the search's plan fits; an explicit budget
    lets dp through; the same dp plan on a CPU mesh meets no default budget."""
    with pytest.raises(NoFitError) as e:
        make_plan(gpt13, AXES, policy="dp", cost_model=_v100())
    msg = str(e.value)
    assert "V100-32G" in msg and "3.20 GiB reserve (10%)" in msg and "28.80 GiB" in msg
    assert "Constraints(max_memory_per_device=...)" in msg and "--budget" in msg
    assert e.value.budget_bytes == V100_BUDGET and e.value.smallest_bytes > V100_BUDGET
    assert "micro-batches, the most this batch allows" in msg  # accumulation was tried too
    auto = make_plan(gpt13, AXES, policy="auto", cost_model=_v100())
    assert auto.cost.memory_bytes_per_device <= V100_BUDGET
    big = Constraints(max_memory_per_device="100GiB")
    dp = make_plan(gpt13, AXES, policy="dp", cost_model=_v100(), constraints=big)
    assert dp.microbatches == 1 and dp.cost.memory_bytes_per_device > 1.5 * V100_BUDGET
    assert e.value.smallest_bytes < dp.cost.memory_bytes_per_device
    cpu = make_plan(gpt13, make_mesh((2, 4), ("data", "model")), policy="dp")
    assert cpu.cost.memory_bytes_per_device > CPU.memory_bytes  # CPU: no default budget
    # an explicit budget that fails (under the smallest dp estimate) says nothing of a default
    explicit = e.value.smallest_bytes - 1
    with pytest.raises(NoFitError) as e:
        make_plan(gpt13, AXES, policy="dp", cost_model=_v100(),
                  constraints=Constraints(max_memory_per_device=explicit))
    assert "default" not in str(e.value) and f"max_memory_per_device={explicit}" in str(e.value)


def test_the_search_plans_within_the_default_budget(tiny):
    """A tiny fake device whose default budget is under the memory of the search's free choice:
    the search (not only the final check) sees the default and picks a plan within it."""
    def cluster(memory):
        device = dataclasses.replace(A100_80G, name="tiny-gpu", memory_bytes=memory)
        return CostModel.for_cluster(ClusterSpec("tiny", device, 8, NVLINK_V100, IB_EDR), AXES)

    free = plan_and_report(tiny, AXES, cost_model=cluster(10**12)).plan
    need = free.cost.memory_bytes_per_device
    tight = cluster(need)   # budget: 90% of what the free choice needs
    budget = default_budget(AXES, tight)
    assert budget < need
    planned = plan_and_report(tiny, AXES, cost_model=tight)
    assert planned.plan.cost.memory_bytes_per_device <= budget
    assert planned.plan.cost.step_time_s >= free.cost.step_time_s
    # the explicit budget wins over the device's
    again = plan_and_report(tiny, AXES, cost_model=tight,
                            constraints=Constraints(max_memory_per_device=10**12)).plan
    assert again.ops == free.ops
    with pytest.raises(NoFitError, match="default for tiny-gpu"):
        plan_and_report(tiny, AXES, cost_model=cluster(1000))


def test_a_mesh_of_known_accelerators_is_priced_with_their_peaks(tiny):
    """A mesh over H100s (faked: this machine has none) prices the plan with the H100 preset,
    not the nominal CPU (the CLI's measured-vs-predicted step time on a GPU depends on it)."""

    class FakeMesh:
        shape = AXES
        devices = np.array([types.SimpleNamespace(device_kind=H100_80G.kind)] * 8,
                           dtype=object).reshape(2, 4)

    plan = make_plan(tiny, FakeMesh(), policy="dp")
    h100 = CostModel.for_axes(AXES, device=H100_80G).plan_cost(plan, tiny).step_time_s
    cpu = CostModel.for_axes(AXES).plan_cost(plan, tiny).step_time_s
    assert plan.cost.step_time_s == pytest.approx(h100) and h100 < cpu


def test_only_gradients_built_up_over_the_backward_count_at_the_peak(gpt13):
    """GPT-3 1.3B under Megatron's plan on V100s: XLA:GPU runs each weight's Adam update as soon
    as its gradient is reduced (the compiled step's peak is the estimate without the other
    gradients: tests/train/test_xla_gpu.py, results/bench_xla_gpu.md), so the peak holds only
    the tied embedding's, which gets contributions at both ends of the model; an optimizer that
    reads every gradient at once (grads_held) holds them all."""
    plan = make_plan(gpt13, AXES, policy="megatron", cost_model=_v100())
    cm = _v100()
    mem = cm.memory_breakdown(plan, gpt13)
    held = dataclasses.replace(cm, grads_held=True).memory_breakdown(plan, gpt13)
    assert 0 < mem["grads_held"] < mem["grads"] / 2
    assert held["grads_held"] == mem["grads"] and held["peak"] > mem["peak"] + mem["grads"] / 2
