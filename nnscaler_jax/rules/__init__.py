"""Per-primitive annotation rules (nnScaler dimops) in a registry keyed by primitive name.

``annotate(name, params, in_avals, out_avals)`` gives the checked annotation of one jaxpr equation;
``register_rule`` adds or overrides the rule of a (custom) primitive.
"""

from nnscaler_jax.rules.registry import annotate as annotate
from nnscaler_jax.rules.registry import has_rule as has_rule
from nnscaler_jax.rules.registry import register_rule as register_rule
from nnscaler_jax.rules.registry import registered as registered

__all__ = ["annotate", "has_rule", "register_rule", "registered"]
