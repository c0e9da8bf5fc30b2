"""Flax linen / nnx modules + example args -> annotated graphs.

Public (docs/api.md): :func:`trace` (also ``nnscaler_jax.trace``), and for the model zoo's
``ModelSpec`` (``models.get(...)``) :func:`spec_inputs` (abstract args and variables, nothing
allocated) and :func:`capture_spec`.
"""

from nnscaler_jax.capture.trace import capture_spec as capture_spec
from nnscaler_jax.capture.trace import spec_inputs as spec_inputs
from nnscaler_jax.capture.trace import trace as trace

__all__ = ["capture_spec", "spec_inputs", "trace"]
