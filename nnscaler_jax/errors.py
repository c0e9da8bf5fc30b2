"""Errors a user can cause and act on.

Every one is a :class:`PlanError` (a ``ValueError``), so ``except PlanError`` catches them all;
the subclasses say which kind of mistake it was, and the optional fields say where::

    try:
        op_trans(graph, op, "k", 3)
    except ShardingError as e:
        print(e.op, e.module_path, e.axis)   # 'dot_general' 'blk0/mlp/fc1' None

This module is the bottom layer of the package: it imports nothing from it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["AnnotationError", "CheckpointError", "ConstraintError", "NoFitError", "PlanError",
           "PlanFormatError", "ShardingError"]


_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def fmt_bytes(n: float) -> str:
    """Bytes in the unit that fits (the largest whose figure is at least 1): every size a plan's
    text and the command line print.

    >>> fmt_bytes(512), fmt_bytes(3 * 2**20), fmt_bytes(31_856_000_000)
    ('512 B', '3.00 MiB', '29.67 GiB')
    """
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for i, unit in enumerate(_UNITS):
        if abs(n) < 1024 ** (i + 2) or unit == _UNITS[-1]:
            return f"{n / 1024 ** (i + 1):.2f} {unit}"
    raise AssertionError("unreachable")


def shapes_summary(arrays: Any, limit: int = 6) -> str:
    """A short account of many arrays' shapes for a message: equal (shape, dtype) pairs
    counted, at most ``limit`` kinds listed (``'10 arrays: 4 x (64,) float32, ...'``).

    >>> import numpy as np
    >>> shapes_summary([np.zeros((2, 3))] * 3 + [np.zeros(4, np.int32)])
    '4 arrays: 3 x (2, 3) float64, (4,) int32'
    """
    kinds: dict[tuple, int] = {}
    for a in arrays:
        key = (tuple(a.shape), str(a.dtype))
        kinds[key] = kinds.get(key, 0) + 1
    listed = [f"{n} x {shape} {dtype}" if n > 1 else f"{shape} {dtype}"
              for (shape, dtype), n in list(kinds.items())[:limit]]
    more = len(kinds) - limit
    tail = f", ... ({more} more kinds)" if more > 0 else ""
    total = sum(kinds.values())
    return f"{total} array{'s' if total != 1 else ''}: {', '.join(listed)}{tail}"


class PlanError(ValueError):
    """Every planning failure a user can cause.

    Messages name what was passed (op, module path, shapes, mesh axes), which rule it broke and
    how to fix it. ``str(e)`` is the message; the same context is also available as fields
    (each ``None`` where the raise site does not know it):

    Attributes:
        op: the primitive name (``'dot_general'``) or a description of the op.
        module_path: the Flax module path of the op (``'blk0/mlp/fc1'``; ``''`` at the top).
        axis: the mesh axis involved (``'model'``; several comma-separated).
        shapes: the tensor shapes involved (e.g. the op's operand shapes).
    """

    def __init__(self, *args: Any, op: str | None = None, module_path: str | None = None,
                 axis: str | None = None, shapes: Any = None) -> None:
        super().__init__(*args)
        self.op = op
        self.module_path = module_path
        self.axis = axis
        self.shapes = shapes

    def __reduce__(self) -> tuple[Any, ...]:
        # BaseException pickles as cls(*args) and then restores __dict__: the keyword-only
        # fields travel in the state, so subclasses with the same signature round-trip too.
        return (type(self), self.args, dict(self.__dict__))


class AnnotationError(PlanError):
    """An annotation that does not parse, or does not bind to the op's shapes.

    Raised by :func:`nnscaler_jax.ir.anno.parse_anno` (the message underlines the bad part)
    and by ``Anno.bind`` (operand count, rank or a dim's sizes disagree with the shapes; the
    message names the op and module path when the caller knows them).
    """


class ShardingError(PlanError):
    """A requested split or placement that cannot be made.

    Raised by the primitives (``op_trans``, ``op_assign``, ``Draft.decide``) for a dim that is
    not splittable or whose size a split does not divide, a placement an SPMD program cannot
    express, and a mesh axis (or coordinates) that is not in the mesh.
    """


class PlanFormatError(PlanError):
    """A saved plan that cannot be used.

    Raised by ``Plan.from_json`` for malformed plan JSON (not JSON, not a plan, missing or
    mistyped fields), by ``Plan.check_graph`` for a plan made for another model or another mesh
    shape, and by ``make_plan(plan=...)`` when a split of the plan does not divide this graph's
    sizes (another batch size or sequence length).
    """


class ConstraintError(PlanError):
    """A ``Constraints`` field or ``Rule`` that cannot be met.

    Raised for a bad field value (a ZeRO stage other than 0-3, an unknown schedule, a
    non-positive memory budget, micro-batches or pipeline stages that are not a positive int,
    ``rules`` / ``logical_rules`` / ``Rule(dims=, axes=)`` that are not tuples of the right
    values) and when ``Constraints.check`` finds a rule that matches no op, names a mesh axis
    the mesh lacks, has none of an op's dims or sizes no mesh axis it allows divides, or
    contradicts itself or another rule.
    """


class NoFitError(PlanError):
    """No plan within the memory budget.

    Raised by the searches (and the planner's budget check) when every plan they can make needs
    more memory per device than ``Constraints(max_memory_per_device=...)`` (or the device's
    memory, the default budget on real devices and cluster presets).

    Attributes:
        smallest_bytes: the smallest per-device estimate found (None when unknown).
        budget_bytes: the budget it was over.
    """

    def __init__(self, *args: Any, smallest_bytes: float | None = None,
                 budget_bytes: float | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.smallest_bytes = smallest_bytes
        self.budget_bytes = budget_bytes


class CheckpointError(PlanError):
    """A checkpoint that cannot be written or restored.

    Raised by :class:`nnscaler_jax.train.checkpoint.Checkpointer` for a missing directory or one
    with no checkpoint, a missing step, unreadable or corrupted checkpoint metadata, and a
    checkpoint written by another model (the message names the first leaf path whose saved
    shape / dtype differs from the expected one).

    Attributes:
        directory: the checkpoint directory (None when unknown).
        step: the step involved (None when unknown).
    """

    def __init__(self, *args: Any, directory: str | None = None, step: int | None = None,
                 **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.directory = directory
        self.step = step


# the packages whose frames a warning never points at: a plan is made inside them (jax traces
# the training step, flax runs a module's method) on behalf of a call of the user's
_LIBRARIES = ("nnscaler_jax", "jax", "jaxlib", "flax", "optax", "orbax")


def user_stacklevel() -> int:
    """The ``stacklevel`` (for a ``warnings.warn`` in the caller) of the innermost frame that is
    the user's: not in this package or the libraries it runs under (:data:`_LIBRARIES`), not
    Python's frozen import machinery (``<frozen runpy>``); the outermost frame if none is."""
    roots = []
    for name in _LIBRARIES:
        module = sys.modules.get(name)
        # (a namespace package, orbax, has no __file__: its __path__ lists its folders)
        for path in getattr(module, "__path__", None) or ():
            roots.append(os.path.abspath(path) + os.sep)
    roots = tuple(roots)
    frame, level, last = sys._getframe(2), 2, 2
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith("<"):
            if not os.path.abspath(name).startswith(roots):
                return level
            last = level
        frame, level = frame.f_back, level + 1
    return last
