"""Test configuration: the 8 virtual CPU devices are requested by the root conftest.py."""
import jax  # noqa: F401 - jax starts after the root conftest set XLA_FLAGS

from meshes import make_mesh  # noqa: F401 - re-exported for old imports
