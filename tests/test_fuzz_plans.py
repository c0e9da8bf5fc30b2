"""``scripts/fuzz_plans.py``: its generator is deterministic per seed, and a fixed-seed run of 50
cases (random small models x meshes x plans, each against the single-device program) finds no
mismatch and no error."""

import importlib.util
import json
import pathlib
import sys

import jax
import numpy as np
import pytest

from nnscaler_jax.primitives import Draft

_PATH = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "fuzz_plans.py"


@pytest.fixture(scope="module")
def fuzz():
    """The script as a module (scripts/ is not a package)."""
    name = "fuzz_plans_script"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _PATH)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # flax's dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_cases_are_deterministic_per_seed(fuzz):
    a = json.dumps(fuzz.gen_cases(40, 7), sort_keys=True)
    assert a == json.dumps(fuzz.gen_cases(40, 7), sort_keys=True)
    assert a != json.dumps(fuzz.gen_cases(40, 8), sort_keys=True)
    cases = fuzz.gen_cases(40, 7)
    assert {c["plan"]["kind"] for c in cases} == {"builtin", "random"}
    assert len({len(c["mesh"]["shape"]) for c in cases}) == 3  # 1-D, 2-D and 3-D meshes
    assert {c["mesh"]["types"] for c in cases} == {"auto", "explicit"}
    kinds = {b["kind"] for c in fuzz.gen_cases(200, 7) for b in c["model"]["blocks"]}
    assert kinds == set(sys.modules["fuzz_models"].BLOCKS)  # the script's sibling module


def test_random_plans_are_deterministic_per_seed(fuzz):
    """The random policy's actions depend on its seed and the graph only, and replaying them
    gives the same plan."""
    from nnscaler_jax import trace

    case = next(c for c in fuzz.gen_cases(60, 3) if c["plan"]["kind"] == "random"
                and any(b["kind"] == "linear" for b in c["model"]["blocks"]))
    module, x = fuzz._inputs(case)
    graph = trace(module, x, variables=jax.eval_shape(module.init, jax.random.key(0), x))
    axes = dict(zip(case["mesh"]["names"], case["mesh"]["shape"], strict=True))
    acts = [fuzz.random_actions(Draft(graph, dict(axes)), case["plan"]) for _ in range(2)]
    assert acts[0] == acts[1] and acts[0]
    other = fuzz.random_actions(Draft(graph, dict(axes)), {**case["plan"], "seed": 1})
    assert other != acts[0]
    plans = []
    for desc in (case["plan"], {"kind": "actions", "actions": acts[0]}):
        plans.append(fuzz.make_policy(desc)(Draft(graph, dict(axes)), None).to_json())
    assert plans[0] == plans[1]


def test_close_is_elementwise_within_fixed_tolerances(fuzz):
    """``|a - b| <= ATOL * scale + RTOL * |b|``, scale: the tree's largest ``|b|`` (here 3)."""
    assert (fuzz.RTOL, fuzz.ATOL) == (1e-5, 1e-6)
    ref = {"a": np.array([1.0, -2.0, 0.0]), "b": np.array([3.0])}

    def close(a0, a2):
        return fuzz._close({"a": np.array([a0, -2.0, a2]), "b": np.array([3.0])}, ref)

    assert close(1.0, 0.0)[0]
    assert close(1.0 + 1.2e-5, 2.9e-6)[0]  # within 3e-6 + 1e-5 and 3e-6
    ok, where = close(1.0, 3.1e-6)
    assert not ok and where.startswith("['a']")
    assert not close(1.0 + 1.4e-5, 0.0)[0]
    assert not fuzz._close({"a": ref["a"]}, ref)[0]  # a missing leaf


@pytest.mark.slow
def test_fixed_seed_run_finds_no_mismatch_and_no_error(fuzz):
    """50 cases (models of up to 2 blocks, 5 plans per model) in this process."""
    summary = fuzz.fuzz(50, 2024, max_blocks=2, per_model=5)
    assert summary["cases"] == 50
    detail = [(f["index"], f["detail"][:500], f.get("reproducer", {}).get("case"))
              for f in summary["findings"]]
    assert summary["mismatches"] == 0 and summary["errors"] == 0, detail
    assert summary["rejected"] <= 10, summary["rejections"]
