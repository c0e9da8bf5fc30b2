"""Fixtures for the rule tests: equations of a traced function and their annotations."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import pytest
from rule_helpers import eqn_anno, walk


@pytest.fixture
def eqns_of() -> Callable[..., list[Any]]:
    """``eqns_of(fn, *args, prim=None)``: the equations of ``jax.make_jaxpr(fn)(*args)``."""

    def get(fn: Callable[..., Any], *args: Any, prim: str | None = None) -> list[Any]:
        out = list(walk(jax.make_jaxpr(fn)(*args).jaxpr))
        return [e for e in out if prim is None or e.primitive.name == prim]

    return get


@pytest.fixture
def anno_of() -> Callable[[Any], Any]:
    """``anno_of(eqn)``: the annotation of an equation."""
    return eqn_anno


@pytest.fixture
def user_rules():
    """Restore the user rule table after a test that registers rules."""
    from nnscaler_jax.rules.registry import _REGISTRY

    saved = dict(_REGISTRY._user)
    yield
    _REGISTRY._user.clear()
    _REGISTRY._user.update(saved)
