"""``scripts/fuzz_plans.py``: its generator is deterministic per seed; its oracle (the planned
float32 error against a float64 single-device run, next to the plain float32 program's) passes
rounding and catches deliberately broken lowerings; a fixed-seed run of 50 cases (random small
models x meshes x plans) finds no mismatch and no error."""

import importlib.util
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
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


def test_oracle_tells_rounding_from_errors(fuzz):
    """Mismatch iff ``err_planned > RATIO * err_plain + FLOOR_ULPS * eps32 * max|ref64|``
    per leaf, the max over the leaf's whole tree."""
    assert (fuzz.RATIO, fuzz.FLOOR_ULPS) == (16.0, 64)
    ref = {"a": np.array([100.0, -3.0]), "b": np.array([1e-3])}
    plain = {"a": np.array([100.0 + 1e-4, -3.0]), "b": np.array([1e-3])}  # rounding: 1e-6 rel
    floor = 64 * fuzz.EPS32 * 100.0  # 7.6e-4, for both leaves

    def score(a0, b0=1e-3):
        return fuzz._oracle({"a": np.float32([a0, -3.0]), "b": np.float32([b0])},
                            jax.tree.map(np.float32, plain), ref)

    # 15 times the plain program's error plus the floor passes; twice that does not
    assert score(100.0 + 15 * 1e-4 + floor * 0.9)["score"] < 1
    o = score(100.0 + 32 * 1e-4 + 2 * floor)
    assert o["score"] > 1 and o["leaf"] == "['a']" and 2 < o["ratio"] < 100
    # the plain program exact on leaf b (err_plain 0): only the floor, the tree's
    assert score(100.0, 1e-3 + 0.9 * floor)["score"] < 1
    assert score(100.0, 1e-3 + 1.1 * floor)["score"] > 1
    assert score(100.0, np.nan)["score"] == np.inf
    assert "dtype" in fuzz._oracle({"a": np.zeros(2)}, {"a": np.zeros(2, np.float32)},
                                   {"a": np.zeros(2)})["why"]  # float64 where float32 ran
    assert "shape" in fuzz._oracle({"a": np.zeros(3)}, {"a": np.zeros(2)},
                                   {"a": np.zeros(2)})["why"]


def test_oracle_floor_is_the_trees_not_the_leafs(fuzz):
    """Seed 7, case 223: an MLP's output-bias gradient (a sum over batch and time of cancelling
    terms, 0.089) that the plain program computed exactly and the planned one 1.28e-6 off:
    121 float32 eps of the leaf, 8.4 of the gradients' largest (1.28). Rounding: it passes."""
    ref = {"bias": np.array([0.08867, -0.05]), "kernel": np.array([1.278, 0.3])}
    plain = jax.tree.map(np.float32, ref)
    ref = jax.tree.map(lambda a: a.astype(np.float32).astype(np.float64), ref)  # plain exact
    got = {"bias": np.float32(ref["bias"] + [1.28e-6, 0.0]), "kernel": plain["kernel"]}
    o = fuzz._oracle(got, plain, ref)
    assert o["leaf"] == "['bias']" and o["err_plain"] == 0 and o["score"] < 0.2
    assert o["err_planned"] > 64 * fuzz.EPS32 * 0.08867  # a floor of the leaf's would fail


def test_reference_runs_in_float64_and_leaves_float32(fuzz):
    """The float64 reference holds float64 numbers close to the float32 program's, and 64-bit
    types are off again after it (the planned program runs in float32)."""
    case = fuzz.gen_cases(15, 7)[13]  # linear + bmm + transpose + cond
    expected = fuzz._reference(case)
    for leaf64, leaf32 in zip(jax.tree.leaves((expected.out64, expected.grads64)),
                              jax.tree.leaves((expected.out32, expected.grads32)), strict=True):
        assert leaf64.dtype == np.float64 and leaf32.dtype == np.float32
        np.testing.assert_allclose(leaf32, leaf64, rtol=1e-4, atol=1e-4)
    assert not jax.config.jax_enable_x64
    assert jnp.asarray(np.zeros(2)).dtype == jnp.float32


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["psum", "chunks", None])
def test_oracle_catches_a_broken_lowering(fuzz, kind):
    """Seed-7 cases whose plans have value-split chains and co-sharded ops (13 and 14: the
    two a fixed float32 tolerance used to flag, rounding): under a broken lowering
    (``--break``: partial sums not reduced, chunk results one chunk off) every case whose
    results the broken code changed is a mismatch (none missed), and with the real lowering
    all pass."""
    summary = fuzz.fuzz(95, 7, only=[13, 14, 16, 19, 94], breaks=kind)
    assert summary["cases"] == 5 and summary["errors"] == 0, summary["findings"]
    if kind is None:
        assert summary["mismatches"] == 0, [f["detail"] for f in summary["findings"]]
        assert summary["margin"]["score_max"] < 0.5
        return
    got = summary["break"]
    assert got["missed"] == [] and got["caught"] == summary["mismatches"] >= 3, got
    assert got["ran_broken_code"] == got["caught"] + len(got["unchanged"])
    # case 94 chunks an op along the time dim the model then averages over: rolled chunks
    # change nothing beyond rounding, and the script says so instead of calling it missed
    assert got["unchanged"] == ([94] if kind == "chunks" else [])
    for f in summary["findings"]:  # far beyond rounding
        assert f["oracle"]["ratio"] is None or f["oracle"]["ratio"] > 1e3, f["detail"]
