"""nnscaler_jax: automatic parallelization of JAX/Flax training (nnScaler's primitives on JAX).

>>> import nnscaler_jax as nj
>>> sorted(n for n in nj.__all__ if not n.startswith("_"))[:4]
['Constraints', 'Draft', 'Plan', 'PlanError']
"""

from nnscaler_jax.api import auto_parallel as auto_parallel
from nnscaler_jax.capture.trace import trace as trace
from nnscaler_jax.constraints import Constraints as Constraints
from nnscaler_jax.constraints import Rule as Rule
from nnscaler_jax.errors import PlanError as PlanError
from nnscaler_jax.plan.plan import Plan as Plan
from nnscaler_jax.primitives import Draft as Draft
from nnscaler_jax.primitives import op_assign as op_assign
from nnscaler_jax.primitives import op_order as op_order
from nnscaler_jax.primitives import op_trans as op_trans
from nnscaler_jax.rules import register_rule as register_rule

__all__ = ["Constraints", "Draft", "Plan", "PlanError", "Rule", "auto_parallel", "op_assign",
           "op_order", "op_trans", "register_rule", "trace"]
