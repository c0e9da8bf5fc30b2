"""RVD layouts <-> PartitionSpec, and the cheapest collective path between layouts."""

from nnscaler_jax.layout.comm import Collective as Collective
from nnscaler_jax.layout.comm import CommPath as CommPath
from nnscaler_jax.layout.comm import comm_path as comm_path
from nnscaler_jax.layout.comm import comm_time as comm_time
from nnscaler_jax.layout.rvd import Layout as Layout
