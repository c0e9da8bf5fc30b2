"""The mesh an abstract plan is made for: axis roles and topology (links, alpha-beta
collectives)."""

from nnscaler_jax.mesh.axes import DATA_AXES as DATA_AXES
from nnscaler_jax.mesh.axes import MODEL_AXES as MODEL_AXES
from nnscaler_jax.mesh.axes import STAGE_AXES as STAGE_AXES
from nnscaler_jax.mesh.axes import data_axes as data_axes
from nnscaler_jax.mesh.axes import mesh_axes as mesh_axes
from nnscaler_jax.mesh.axes import stage_axis as stage_axis
from nnscaler_jax.mesh.topology import DEFAULT_LINK as DEFAULT_LINK
from nnscaler_jax.mesh.topology import LinkCost as LinkCost
from nnscaler_jax.mesh.topology import MeshSpec as MeshSpec
