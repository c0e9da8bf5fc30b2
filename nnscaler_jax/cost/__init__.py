"""Cost models: communication (alpha-beta per mesh axis), compute, memory."""

from nnscaler_jax.cost.comm import DEFAULT_LINK as DEFAULT_LINK
from nnscaler_jax.cost.comm import LinkCost as LinkCost
from nnscaler_jax.cost.comm import MeshSpec as MeshSpec
from nnscaler_jax.cost.comm import all_gather_time as all_gather_time
from nnscaler_jax.cost.comm import all_reduce_time as all_reduce_time
from nnscaler_jax.cost.comm import all_to_all_time as all_to_all_time
from nnscaler_jax.cost.comm import collective_time as collective_time
from nnscaler_jax.cost.comm import ppermute_time as ppermute_time
from nnscaler_jax.cost.comm import reduce_scatter_time as reduce_scatter_time
from nnscaler_jax.cost.comm import wire_bytes as wire_bytes
