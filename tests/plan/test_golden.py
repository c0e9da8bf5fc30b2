"""Golden plans: today's ``str(plan)`` and ``plan.to_json()`` for the tiny zoo models, pinned.

For (mlp, gpt) tiny presets x ("dp", "megatron", "auto") on a 2x4 ``("data", "model")`` mesh the
plan is made through the public API only and compared with ``golden/<model>_<policy>.txt`` and
``golden/<model>_<policy>.json``. Op splits, variables, fingerprint and policy must match exactly;
the cost model's float estimates are compared with a relative tolerance of 1e-6 (floats in the JSON
with ``math.isclose``; numbers on the table's ``estimate:`` line rounded to 6 significant digits).

Rewrite the files with ``UPDATE_GOLDEN=1`` (the variable ``tests/ir`` uses;
``NNSCALER_UPDATE_GOLDEN=1`` works too), e.g.
``UPDATE_GOLDEN=1 python -m pytest tests/plan/test_golden.py -q``.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import os
import pathlib
import re

import pytest
from meshes import make_mesh

import models
from nnscaler_jax import auto_parallel

GOLDEN = pathlib.Path(__file__).parent / "golden"
ENV_VARS = ("UPDATE_GOLDEN", "NNSCALER_UPDATE_GOLDEN")
HOW = "create or rewrite it with UPDATE_GOLDEN=1 python -m pytest tests/plan/test_golden.py"
REL_TOL = 1e-6
DIFF_LINES = 60

MODELS = ("mlp", "gpt")
POLICIES = ("dp", "megatron", "auto")
CASES = [(m, p) for m in MODELS for p in POLICIES]
IDS = [f"{m}-{p}" for m, p in CASES]

_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def _updating() -> bool:
    return any(os.environ.get(name) == "1" for name in ENV_VARS)


@functools.cache
def _plan(model: str, policy: str):
    """The plan of ``model``'s tiny preset under ``policy`` on the 2x4 mesh (made once per run)."""
    mesh = make_mesh((2, 4), ("data", "model"))
    module, make_args, _ = models.get(model, "tiny")
    return auto_parallel(mesh, policy=policy)(module).make_plan(*make_args())


def _diff(want: str, got: str, name: str) -> str:
    lines = list(difflib.unified_diff(want.splitlines(), got.splitlines(),
                                      f"golden/{name}", "got", lineterm=""))
    more = len(lines) - DIFF_LINES
    return "\n".join(lines[:DIFF_LINES] + ([f"... ({more} more diff lines)"] if more > 0 else []))


def _read_golden(name: str, got: str) -> str | None:
    """The golden text of ``name``; in update mode writes ``got`` there and returns None."""
    path = GOLDEN / name
    if _updating():
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(got.rstrip("\n") + "\n")
        return None
    if not path.exists():
        pytest.fail(f"no golden file {path}; {HOW}", pytrace=False)
    return path.read_text().rstrip("\n")


# -- text --------------------------------------------------------------------------------------

def _normalize_text(text: str) -> str:
    """``text`` with every number on ``estimate:`` lines rounded to 6 significant digits."""
    out = []
    for line in text.rstrip("\n").splitlines():
        if line.lstrip().startswith("estimate:"):
            line = _NUMBER.sub(lambda m: format(float(m.group()), ".6g"), line)
        out.append(line)
    return "\n".join(out)


# -- JSON --------------------------------------------------------------------------------------

def _is_float_like(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _first_mismatch(want, got, where: str = "$") -> str | None:
    """Where ``got`` differs from ``want``: containers and non-floats exactly, floats to REL_TOL."""
    if isinstance(want, float) or isinstance(got, float):
        if (_is_float_like(want) and _is_float_like(got)
                and math.isclose(want, got, rel_tol=REL_TOL)):
            return None
        return f"{where}: {want!r} != {got!r}"
    if type(want) is not type(got):
        return f"{where}: {type(want).__name__} {want!r} != {type(got).__name__} {got!r}"
    if isinstance(want, dict):
        if set(want) != set(got):
            return f"{where}: keys {sorted(want)} != {sorted(got)}"
        for key in sorted(want):
            found = _first_mismatch(want[key], got[key], f"{where}.{key}")
            if found:
                return found
        return None
    if isinstance(want, list):
        if len(want) != len(got):
            return f"{where}: length {len(want)} != {len(got)}"
        for i, (a, b) in enumerate(zip(want, got)):
            found = _first_mismatch(a, b, f"{where}[{i}]")
            if found:
                return found
        return None
    return None if want == got else f"{where}: {want!r} != {got!r}"


def _pretty(obj) -> str:
    return json.dumps(obj, indent=1, sort_keys=True)


def _align(want, got):
    """``got`` with floats within REL_TOL of ``want``'s replaced by them (a diff without noise)."""
    if isinstance(want, dict) and isinstance(got, dict):
        return {k: _align(want[k], v) if k in want else v for k, v in got.items()}
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [_align(a, b) for a, b in zip(want, got)]
    if (isinstance(got, float) and _is_float_like(want)
            and math.isclose(want, got, rel_tol=REL_TOL)):
        return want
    return got


# -- tests -------------------------------------------------------------------------------------

@pytest.mark.parametrize(("model", "policy"), CASES, ids=IDS)
def test_plan_text_matches_golden(model: str, policy: str) -> None:
    name = f"{model}_{policy}.txt"
    got = str(_plan(model, policy))
    want = _read_golden(name, got)
    if want is None:
        return
    want, got = _normalize_text(want), _normalize_text(got)
    if got != want:
        pytest.fail(f"str(plan) for {model}/{policy} differs from golden/{name} "
                    f"(if intended, {HOW}):\n{_diff(want, got, name)}", pytrace=False)


@pytest.mark.parametrize(("model", "policy"), CASES, ids=IDS)
def test_plan_json_matches_golden(model: str, policy: str) -> None:
    name = f"{model}_{policy}.json"
    got_text = _plan(model, policy).to_json()
    want_text = _read_golden(name, got_text)
    if want_text is None:
        return
    try:
        want = json.loads(want_text)
    except json.JSONDecodeError as e:
        pytest.fail(f"golden/{name} is not valid JSON ({e}); {HOW}", pytrace=False)
    got = json.loads(got_text)
    where = _first_mismatch(want, got)
    if where:
        diff = _diff(_pretty(want), _pretty(_align(want, got)), name)
        pytest.fail(f"plan.to_json() for {model}/{policy} differs from golden/{name} at {where} "
                    f"(if intended, {HOW}):\n{diff}", pytrace=False)
