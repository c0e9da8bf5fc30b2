"""nnscaler_jax: automatic parallelization of JAX/Flax training (nnScaler's primitives on JAX)."""

from nnscaler_jax.errors import PlanError as PlanError
from nnscaler_jax.capture.trace import trace as trace
from nnscaler_jax.rules import register_rule as register_rule
