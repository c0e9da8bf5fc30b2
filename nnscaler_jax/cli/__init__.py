"""The ``nnscaler-jax`` command line."""

from nnscaler_jax.cli.main import main as main
