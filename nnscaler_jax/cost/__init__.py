"""Cost models: devices and clusters, compute, communication (alpha-beta per mesh axis), memory,
profiling; :class:`CostModel` prices ops, relayouts and whole plans.

Public (docs/api.md, ``__all__``): :class:`CostModel`, the device and cluster presets
(:data:`DEVICES`, :data:`CLUSTERS`, :func:`device_preset`, :func:`cluster_preset`,
:func:`local_cpu`, :class:`DeviceSpec`, :class:`ClusterSpec`, :class:`MixedCluster` (several
device kinds), :class:`LinkCost`,
:class:`MeshSpec`), the default memory budget (:func:`default_budget`,
:func:`default_budget_of`, :class:`DefaultBudget`, :data:`DEFAULT_RESERVE_FRACTION`),
:func:`compile_only_mesh` (a preset's GPUs for XLA:GPU without a GPU) and profiles
(:class:`ProfileDB`, :func:`profile_ops`). The collective-time helpers imported here are
internal.

>>> from nnscaler_jax.cost import CostModel
>>> CostModel.for_axes({"data": 2, "model": 4}).mesh.size("model")
4
"""

from nnscaler_jax.cost.devices import CLUSTERS as CLUSTERS
from nnscaler_jax.cost.devices import DEFAULT_RESERVE_FRACTION as DEFAULT_RESERVE_FRACTION
from nnscaler_jax.cost.devices import DEVICES as DEVICES
from nnscaler_jax.cost.devices import ClusterSpec as ClusterSpec
from nnscaler_jax.cost.devices import DefaultBudget as DefaultBudget
from nnscaler_jax.cost.devices import DeviceSpec as DeviceSpec
from nnscaler_jax.cost.devices import MixedCluster as MixedCluster
from nnscaler_jax.cost.devices import cluster_preset as cluster_preset
from nnscaler_jax.cost.devices import compile_only_mesh as compile_only_mesh
from nnscaler_jax.cost.devices import default_budget as default_budget
from nnscaler_jax.cost.devices import default_budget_of as default_budget_of
from nnscaler_jax.cost.devices import device_preset as device_preset
from nnscaler_jax.cost.devices import local_cpu as local_cpu
from nnscaler_jax.cost.model import CostModel as CostModel
from nnscaler_jax.cost.profile import ProfileDB as ProfileDB
from nnscaler_jax.cost.profile import profile_ops as profile_ops
from nnscaler_jax.mesh.topology import DEFAULT_LINK as DEFAULT_LINK
from nnscaler_jax.mesh.topology import LinkCost as LinkCost
from nnscaler_jax.mesh.topology import MeshSpec as MeshSpec
from nnscaler_jax.mesh.topology import all_gather_time as all_gather_time
from nnscaler_jax.mesh.topology import all_reduce_time as all_reduce_time
from nnscaler_jax.mesh.topology import all_to_all_time as all_to_all_time
from nnscaler_jax.mesh.topology import collective_time as collective_time
from nnscaler_jax.mesh.topology import ppermute_time as ppermute_time
from nnscaler_jax.mesh.topology import reduce_scatter_time as reduce_scatter_time
from nnscaler_jax.mesh.topology import wire_bytes as wire_bytes

__all__ = [
    "CLUSTERS", "DEFAULT_RESERVE_FRACTION", "DEVICES", "ClusterSpec", "CostModel", "DefaultBudget",
    "DeviceSpec", "LinkCost", "MeshSpec", "MixedCluster", "ProfileDB", "cluster_preset",
    "compile_only_mesh",
    "default_budget", "default_budget_of", "device_preset", "local_cpu", "profile_ops",
]
