"""Every primitive of every tiny model in the zoo (forward and gradient) has a rule."""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import pytest
from flax import nnx
from jax.extend import core as jcore

import models
from nnscaler_jax import trace
from nnscaler_jax.rules import has_rule

# Calls and control flow: the capture layer inlines them or builds regions itself.
HANDLED_BY_CAPTURE = frozenset({
    "jit", "pjit", "closed_call", "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr",
    "remat2", "checkpoint", "scan", "while", "cond",
})


def _tiny_presets() -> list[Any]:
    out = []
    for name in models.names():
        module = models._MODELS[name][0]
        if importlib.util.find_spec(module) is None:
            out.append(pytest.param(name, "tiny", marks=pytest.mark.skip(
                reason=f"{module} does not exist yet")))
            continue
        out += [(name, p) for p in models.presets(name) if p.startswith("tiny")]
    return out


def _walk(jaxpr: jcore.Jaxpr) -> Iterator[Any]:
    for eqn in jaxpr.eqns:
        yield eqn
        for v in eqn.params.values():
            for s in v if isinstance(v, (tuple, list)) else (v,):
                if isinstance(s, jcore.ClosedJaxpr):
                    yield from _walk(s.jaxpr)
                elif isinstance(s, jcore.Jaxpr):
                    yield from _walk(s)


def _grad_jaxpr(spec: models.ModelSpec, args: tuple) -> jcore.ClosedJaxpr:
    """The jaxpr of the gradient of the training loss w.r.t. the trainable parameters."""
    if spec.kind == "nnx":
        graphdef, state = nnx.split(spec.module)

        def nnx_grad(s, a):
            m = nnx.merge(graphdef, s)  # rng counts are mutated: keep them inside this trace
            return nnx.grad(lambda mod: spec.loss_fn(mod(*a), *a))(m)

        return jax.make_jaxpr(nnx_grad)(state, args)
    variables = spec.init_abstract()

    def loss(p, v, a, rng):
        return spec.loss({**v, "params": p}, *a, rng=rng)

    rng = jax.ShapeDtypeStruct((2,), jax.numpy.uint32)
    return jax.make_jaxpr(jax.grad(loss))(variables["params"], variables, args, rng)


def _forward(spec: models.ModelSpec, args: tuple):
    if spec.kind == "nnx":
        return trace(spec.module, *args)
    rngs = {s: jax.random.key(i) for i, s in enumerate(spec.rng_streams)} or None
    return trace(spec.module, *args, variables=spec.init_abstract(), rngs=rngs)


@pytest.mark.parametrize(("name", "preset"), _tiny_presets())
def test_zoo_primitives_have_rules(name: str, preset: str) -> None:
    spec = models.get(name, preset, abstract=True)  # shapes only: nothing is computed
    args = spec.make_args()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = _forward(spec, args)
    seen: dict[str, str] = {}
    for op in graph.walk():
        seen.setdefault(op.primitive, f"forward @{op.module_path or '<top>'}")
    for eqn in _walk(_grad_jaxpr(spec, args).jaxpr):
        seen.setdefault(eqn.primitive.name, f"grad at {eqn.source_info.name_stack}")
    missing = {p: where for p, where in sorted(seen.items())
               if p not in HANDLED_BY_CAPTURE and not has_rule(p)}
    assert not missing, f"{name}:{preset}: primitives without a rule: {missing}"
    rule_warnings = [str(w.message) for w in caught
                     if issubclass(w.category, UserWarning) and "register_rule" in str(w.message)]
    assert not rule_warnings, rule_warnings
    assert all(op.annotated for op in graph.walk())
