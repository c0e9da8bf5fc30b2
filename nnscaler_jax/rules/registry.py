"""The rule registry: primitive name -> annotation rule.

A rule is either an annotation string (for ops of fixed arity and rank) or a function
``rule(params, in_avals, out_avals) -> str | None`` deriving the annotation from the equation's
params and abstract values; ``None`` means "no partitioning possible for these params" and the op is
planned replicated (every axis frozen).

Built-in rules are loaded on the first lookup; user registrations override them.

>>> from nnscaler_jax.rules import annotate
>>> import jax
>>> a = jax.core.ShapedArray((4, 8), "float32")
>>> b = jax.core.ShapedArray((8, 3), "float32")
>>> c = jax.core.ShapedArray((4, 3), "float32")
>>> dn = (((1,), (0,)), ((), ()))
>>> str(annotate("dot_general", {"dimension_numbers": dn}, [a, b], [c]))
'm0 k0+, k0+ n0 -> m0 n0'
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, overload

from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.anno import Anno, parse_anno
from nnscaler_jax.rules import conv, dot, elementwise, gather, misc, reduce, reshape, shape
from nnscaler_jax.rules._build import AnnotationRule, replicated, shape_of

__all__ = ["AnnotationRule", "annotate", "has_rule", "register_rule", "registered"]

log = logging.getLogger(__name__)



class _Registry:
    """Built-in rules (loaded once, lazily) and user rules (which take precedence)."""

    def __init__(self) -> None:
        self._builtin: dict[str, AnnotationRule] | None = None
        self._user: dict[str, AnnotationRule] = {}

    @property
    def builtin(self) -> dict[str, AnnotationRule]:
        if self._builtin is None:
            self._builtin = _builtin_rules()
        return self._builtin

    def lookup(self, name: str) -> tuple[AnnotationRule, bool] | None:
        """The rule for ``name`` and whether a user registered it."""
        if name in self._user:
            return self._user[name], True
        if name in self.builtin:
            return self.builtin[name], False
        return None


_REGISTRY = _Registry()


def _builtin_rules() -> dict[str, AnnotationRule]:
    """Collect every built-in rule table (imports the rule modules on first use)."""
    table: dict[str, AnnotationRule] = {}
    for module in (elementwise, dot, reduce, reshape, shape, conv, gather, misc):
        for name, rule in module.rules().items():
            if name in table:
                raise RuntimeError(f"built-in rule for '{name}' defined twice ({module.__name__})")
            table[name] = rule
    return table


def _prim_name(prim: Any) -> str:
    if isinstance(prim, str):
        return prim
    name = getattr(prim, "name", None)
    if not isinstance(name, str):
        raise TypeError(f"register_rule expects a primitive name or a jax Primitive, got {prim!r}")
    return name


def _parse(name: str, text: str) -> Anno:
    stripped = text.strip()
    if stripped.startswith("->"):
        # Zero-input ops (iota, ...): the grammar needs at least one input operand.
        return Anno((), parse_anno("() " + stripped).outputs)
    return parse_anno(text)


@overload
def register_rule(prim: Any, rule: AnnotationRule, *, override: bool = True) -> AnnotationRule: ...
@overload
def register_rule(prim: Any, rule: None = None, *, override: bool = True) -> Callable[[AnnotationRule], AnnotationRule]: ...


def register_rule(prim: Any, rule: AnnotationRule | None = None, *, override: bool = True) -> Any:
    """Register the annotation rule of a primitive (overrides the built-in one).

    Works as a call and as a decorator::

        register_rule("my_matmul", "m k+, k+ n -> m n")

        @register_rule(my_prim)
        def _my_rule(params, in_avals, out_avals):
            return "b d, b d -> b d"

    Args:
        prim: primitive name or ``jax.extend.core.Primitive``.
        rule: annotation string or function ``(params, in_avals, out_avals) -> str | None``;
            omitted: return a decorator.
        override: when False, refuse to replace an existing (built-in or user) rule.

    Returns:
        The rule (so the function form can decorate).

    Raises:
        PlanError: the string does not parse, or a rule exists and ``override`` is False.
    """
    name = _prim_name(prim)
    if rule is None:
        return lambda r: register_rule(name, r, override=override)
    if not override and _REGISTRY.lookup(name) is not None:
        raise PlanError(
            f"a rule for primitive '{name}' is already registered; pass override=True to replace it"
        )
    if isinstance(rule, str):
        try:
            _parse(name, rule)
        except PlanError as e:
            raise PlanError(f"rule for primitive '{name}': {e}") from None
    elif not callable(rule):
        raise TypeError(f"a rule is an annotation string or a function, got {type(rule).__name__}")
    _REGISTRY._user[name] = rule
    return rule


def has_rule(name: str) -> bool:
    """Whether ``name`` has a (built-in or user) rule."""
    return _REGISTRY.lookup(name) is not None


def registered() -> frozenset[str]:
    """Every primitive name with a rule."""
    return frozenset(_REGISTRY.builtin) | frozenset(_REGISTRY._user)


def _shapes(avals: Sequence[Any]) -> list[tuple[int, ...] | None]:
    return [shape_of(a) for a in avals]


def _rule_error(name: str, text: str, in_avals: Sequence[Any], out_avals: Sequence[Any],
                why: str, user: bool) -> PlanError:
    ins = ", ".join(str(s) for s in _shapes(in_avals))
    outs = ", ".join(str(s) for s in _shapes(out_avals))
    fix = (
        "Fix the rule so it has one operand per input/output, one axis per tensor dim, and "
        "identifiers whose sizes agree, e.g. for a matmul of (4, 8) x (8, 3):\n"
        "    wrong: register_rule('my_matmul', 'm k+, n k+ -> m n')\n"
        "    right: register_rule('my_matmul', 'm k+, k+ n -> m n')"
        if user else
        "This is a bug in a built-in rule; work around it with "
        f"register_rule('{name}', <rule>) and please report it."
    )
    who = "user" if user else "built-in"
    return PlanError(
        f"{who} rule for primitive '{name}' gave annotation '{text}' which does not fit the "
        f"equation: inputs {ins} -> outputs {outs}: {why}\n{fix}"
    )


def annotate(prim_name: str, params: Mapping[str, Any], in_avals: Sequence[Any],
             out_avals: Sequence[Any]) -> Anno | None:
    """The annotation of one equation, checked against its shapes.

    Args:
        prim_name: the primitive's name (``eqn.primitive.name``).
        params: ``eqn.params``.
        in_avals: abstract values of the inputs (``v.aval`` of ``eqn.invars``).
        out_avals: abstract values of the outputs.

    Returns:
        The annotation; every axis frozen when the rule says no partitioning is possible;
        ``None`` when the primitive has no rule (the caller plans it replicated and warns).

    Raises:
        PlanError: the rule's annotation does not parse or does not bind to the shapes.
    """
    found = _REGISTRY.lookup(prim_name)
    if found is None:
        return None
    rule, user = found
    text = rule if isinstance(rule, str) else rule(params, in_avals, out_avals)
    if text is None:
        text = replicated(in_avals, out_avals)
    try:
        anno = _parse(prim_name, text)
        anno.bind(_shapes(in_avals), _shapes(out_avals))
    except PlanError as e:
        raise _rule_error(prim_name, text, in_avals, out_avals, str(e), user) from None
    return anno
