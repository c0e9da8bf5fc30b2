"""nnscaler_jax: automatic parallelization of JAX/Flax training (nnScaler's primitives on JAX).

The public API is what this package and four subpackages list in ``__all__``:

- ``nnscaler_jax``: ``auto_parallel``, ``Constraints`` / ``Rule``, ``Plan``, the primitives
  (``Draft``, ``op_trans``, ``op_assign``, ``op_order``), ``register_rule``, ``trace``,
  ``make_plan`` / ``plan_and_report`` and every error class;
- ``nnscaler_jax.capture``: graphs of modules and of the model zoo's specs;
- ``nnscaler_jax.cost``: cost models, device and cluster presets, memory budgets,
  compile-only GPU meshes;
- ``nnscaler_jax.pipeline``: pipeline schedules (built-in and written with ``op_order``) and
  the stage search;
- ``nnscaler_jax.train``: checkpoints, multi-process start, XLA:GPU checks of a step.

Every other module is internal: it may change without notice (docs/api.md, "What is public").

>>> import nnscaler_jax as nj
>>> sorted(n for n in nj.__all__ if not n.startswith("_"))[:4]
['AnnotationError', 'CheckpointError', 'ConstraintError', 'Constraints']
"""

from nnscaler_jax.api import auto_parallel as auto_parallel
from nnscaler_jax.capture.trace import trace as trace
from nnscaler_jax.constraints import Constraints as Constraints
from nnscaler_jax.constraints import Rule as Rule
from nnscaler_jax.errors import AnnotationError as AnnotationError
from nnscaler_jax.errors import CheckpointError as CheckpointError
from nnscaler_jax.errors import ConstraintError as ConstraintError
from nnscaler_jax.errors import NoFitError as NoFitError
from nnscaler_jax.errors import PlanError as PlanError
from nnscaler_jax.errors import PlanFormatError as PlanFormatError
from nnscaler_jax.errors import ShardingError as ShardingError
from nnscaler_jax.plan.plan import Plan as Plan
from nnscaler_jax.planner import make_plan as make_plan
from nnscaler_jax.planner import plan_and_report as plan_and_report
from nnscaler_jax.primitives import Draft as Draft
from nnscaler_jax.primitives import op_assign as op_assign
from nnscaler_jax.primitives import op_order as op_order
from nnscaler_jax.primitives import op_trans as op_trans
from nnscaler_jax.rules import register_rule as register_rule

__all__ = [
    "AnnotationError", "CheckpointError", "ConstraintError", "Constraints", "Draft", "NoFitError",
    "Plan", "PlanError", "PlanFormatError", "Rule", "ShardingError", "auto_parallel",
    "make_plan", "op_assign", "op_order", "op_trans", "plan_and_report", "register_rule",
    "trace",
]
