"""``pipeline.configure``: pipeline settings chosen and priced onto a plan, once per plan."""

import pytest
from meshes import make_mesh

import models
from nnscaler_jax import Constraints, auto_parallel
from nnscaler_jax.pipeline.pricing import RuntimeSetup


@pytest.fixture(scope="module")
def gpt():
    spec = models.get("gpt", "tiny", n_layers=4, batch_size=16)
    return spec, spec.make_args(abstract=True), spec.init_abstract()


@pytest.mark.parametrize("stages", ["auto", 2])
def test_make_plan_prices_the_stage_candidates_once(gpt, monkeypatch, stages):
    """The runtime-restricted stage DP runs once per make_plan and runtime (it ran three
    times: the constraints check, the settings and the estimate each priced every candidate):
    the stack in one program, and cut at module boundaries one program per stage."""
    spec, args, variables = gpt
    calls = []
    real = RuntimeSetup.choices

    def counting(self, *a, **kw):
        calls.append(self.executors)
        return real(self, *a, **kw)

    monkeypatch.setattr(RuntimeSetup, "choices", counting)
    mesh = make_mesh((2, 4), ("stage", "data"))
    pm = auto_parallel(mesh, Constraints(pipeline_stages=stages), policy="dp")(spec.module)
    plan = pm.make_plan(*args, variables=variables)
    # (explicit stages: the one program, unless Constraints(pipeline_executor=...) says)
    assert sorted(calls) == ([("in-graph",), ("per-stage",)] if stages == "auto"
                             else [("in-graph",)])
    assert plan.pipeline is not None and plan.pipeline.stages == 2
    assert plan.cost.step_time_s > 0 and plan.cost.memory_bytes_per_device > 0
