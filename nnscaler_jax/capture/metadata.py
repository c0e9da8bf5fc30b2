"""Flax partitioning metadata as search constraints.

A parameter boxed by ``nn.with_partitioning`` (``nn.Partitioned``), by
``nn.with_logical_partitioning`` (``nn.LogicallyPartitioned``, mapped to mesh axes through
``logical_rules`` or the ``nn.logical_axis_rules`` context) or created by
``nnx.with_partitioning`` (``sharding`` / ``sharding_names`` metadata) names, per dim, the mesh
axes it is split over. The search pins such a variable: its first reader (the layout it is
stored in) must split the variable's dims over exactly those axes (axes of size 1 and axes not
named are free to shard nothing of it); every other choice is left to the search.

>>> import flax.linen as nn
>>> partitioning_specs({"params": {"fc": {"kernel": nn.Partitioned(0, (None, "model"))}}})
{'params/fc/kernel': (None, 'model')}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.graph import Graph

__all__ = ["is_boxed", "partitioning_specs", "pins_of", "unbox"]

Spec = tuple[Any, ...]


def _key(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _names(leaf: Any, logical_rules) -> Spec | None:
    import flax.linen as nn

    if isinstance(leaf, nn.LogicallyPartitioned):
        rules = logical_rules if logical_rules is not None else getattr(leaf, "rules", None)
        return tuple(nn.logical_to_mesh_axes(leaf.names, rules))
    if isinstance(leaf, nn.Partitioned):
        return tuple(leaf.names)
    meta = {}
    if hasattr(leaf, "get_metadata"):  # nnx.Variable
        try:
            meta = dict(leaf.get_metadata())
        except Exception:  # noqa: BLE001 - not a metadata carrier after all
            meta = {}
    # (flax >= 0.12 keeps a Variable's names as 'out_sharding'; 'sharding_names' / 'sharding'
    # are older flax's, read only from metadata: flax's own accessors of them warn)
    names = next((meta[k] for k in ("out_sharding", "sharding_names", "sharding")
                  if meta.get(k) is not None), None)
    return tuple(names) if names is not None else None


def _is_box(x: Any) -> bool:
    import flax.linen as nn

    if isinstance(x, nn.meta.AxisMetadata):
        return True
    try:
        from flax import nnx

        # (flax >= 0.12: a State's leaves are Variables; nnx.VariableState is a deprecated
        # alias whose every read warns)
        return isinstance(x, nnx.Variable)
    except (ImportError, AttributeError):  # pragma: no cover - older flax
        return False


def is_boxed(variables: Any) -> bool:
    """True if any leaf of linen ``variables`` is a Flax metadata box (``nn.Partitioned``...)."""
    import flax.linen as nn

    return any(isinstance(x, nn.meta.AxisMetadata) for x in jax.tree_util.tree_leaves(
        variables, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata)))


def unbox(variables: Any) -> Any:
    """Linen ``variables`` with every metadata box replaced by its value (no sharding
    constraint applied: the plan lays the values out)."""
    import flax.linen as nn

    def one(x):
        if isinstance(x, nn.Partitioned):
            return x.value
        return x.unbox() if isinstance(x, nn.meta.AxisMetadata) else x

    return jax.tree_util.tree_map(one, variables,
                                  is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))


def partitioning_specs(variables: Any, logical_rules=None) -> dict[str, Spec]:
    """Variable path (``'params/fc1/kernel'``) -> mesh axes per dim, from Flax metadata.

    Args:
        variables: linen variables (boxed, e.g. ``jax.eval_shape(module.init, ...)``), or an
            nnx module / state.
        logical_rules: logical -> mesh axis rules for ``nn.with_logical_partitioning``.
    """
    try:
        from flax import nnx

        if isinstance(variables, nnx.Module):
            variables = nnx.state(variables)
    except (ImportError, AttributeError):  # pragma: no cover - older flax
        pass
    leaves = jax.tree_util.tree_flatten_with_path(variables, is_leaf=_is_box)[0]
    out: dict[str, Spec] = {}
    for path, leaf in leaves:
        names = _names(leaf, logical_rules)
        if names is not None and any(n is not None for n in names):
            keys = [_key(k) for k in path]
            if keys and keys[-1] == "value":  # nnx state paths end in the value attribute
                keys = keys[:-1]
            out["/".join(keys)] = names
    return out


def pins_of(graph: Graph, specs: Mapping[str, Spec]) -> dict[int, Spec]:
    """Variable tensor id -> spec, matching ``specs`` paths to the graph's variable names
    (exactly, else as a ``/`` suffix either way: nnx paths have no collection)."""
    by_name = {t.name: t for t in graph.variables}
    out: dict[int, Spec] = {}
    for path, spec in specs.items():
        t = by_name.get(path)
        if t is None:
            hits = [v for n, v in by_name.items()
                    if n.endswith("/" + path) or path.endswith("/" + n)]
            if len(hits) != 1:
                continue  # a variable this graph does not read
            t = hits[0]
        if len(spec) > t.ndim:
            raise PlanError(f"partitioning metadata of '{path}' names {len(spec)} dims "
                            f"{spec}, but the variable has shape {t.shape}")
        out[t.id] = tuple(spec) + (None,) * (t.ndim - len(spec))
    return out
