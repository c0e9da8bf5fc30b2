"""Search: the strategy space, cost tables, the SPMD ILP (ours), the Alpa-style planner, and the
SPMD planning entry (:mod:`nnscaler_jax.search.entry`)."""

from nnscaler_jax.search.alpa import alpa_search as alpa_search
from nnscaler_jax.search.ilp import SearchReport as SearchReport
from nnscaler_jax.search.ilp import search as search
from nnscaler_jax.search.ilp import search_policy as search_policy
from nnscaler_jax.search.space import SearchSpace as SearchSpace
from nnscaler_jax.search.space import build_space as build_space

__all__ = ["SearchReport", "SearchSpace", "alpa_search", "build_space", "search",
           "search_policy"]
