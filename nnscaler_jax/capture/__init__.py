"""Flax linen / nnx modules + example args -> annotated graphs."""

from nnscaler_jax.capture.trace import trace as trace
