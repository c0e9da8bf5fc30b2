"""Mesh axis roles: which axis names mean data, tensor (model) or pipeline-stage parallelism.

The built-in policies, ZeRO, the pipeline and the cost model read roles from axis names, so the
names live here once.

>>> import jax
>>> mesh_axes(jax.sharding.AbstractMesh((8, 8), ("data", "model")))
{'data': 8, 'model': 8}
>>> stage_axis({"stage": 4, "data": 2})
'stage'
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jax.sharding import AxisType, Mesh

from nnscaler_jax.errors import PlanError

__all__ = ["DATA_AXES", "MODEL_AXES", "STAGE_AXES", "auto_view", "data_axes", "is_explicit",
           "mesh_axes", "model_axes", "require_stage_axis", "stage_axis"]

DATA_AXES = ("data", "dp", "batch", "fsdp", "replica")
MODEL_AXES = ("model", "tp", "tensor", "mp")
STAGE_AXES = ("stage", "pipe")


def mesh_axes(mesh: Any) -> dict[str, int]:
    """Axis name -> size of a ``Mesh``, ``AbstractMesh`` or ``{name: size}`` mapping."""
    if isinstance(mesh, Mapping):
        return {str(k): int(v) for k, v in mesh.items()}
    shape = getattr(mesh, "shape", None)
    if isinstance(shape, Mapping):
        return {str(k): int(v) for k, v in shape.items()}
    raise PlanError(f"cannot read mesh axes from {type(mesh).__name__}: pass a jax Mesh, an "
                    "AbstractMesh or a dict like {'data': 8, 'model': 8}")


def stage_axis(axes: Mapping[str, int] | Any) -> str | None:
    """The pipeline-stage axis of a mesh (the first of ``STAGE_AXES`` it has), or None."""
    return next((a for a in STAGE_AXES if a in axes), None)


def require_stage_axis(axes: Mapping[str, int]) -> str:
    """:func:`stage_axis`, or a ``PlanError`` saying how to name one."""
    axis = stage_axis(axes)
    if axis is None:
        raise PlanError(f"pipeline parallelism needs a mesh axis named 'stage' or 'pipe'; the "
                        f"mesh has {dict(axes)}. E.g. jax.make_mesh((4, 2), ('stage', 'data'))")
    return axis


def data_axes(axes: Mapping[str, int] | Any) -> list[str]:
    """The mesh's data-parallel axes (named as in ``DATA_AXES``), in mesh order."""
    return [a for a in axes if a in DATA_AXES]


def model_axes(axes: Mapping[str, int] | Any) -> list[str]:
    """The mesh's tensor-parallel axes (named as in ``MODEL_AXES``), in mesh order."""
    return [a for a in axes if a in MODEL_AXES]


def is_explicit(mesh: Any) -> bool:
    """Whether some mesh axis has Explicit type (sharding is part of array types)."""
    return any(t == AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


def auto_view(mesh: Mesh) -> Mesh:
    """The same devices and axis names with Auto axis types (GSPMD propagates shardings)."""
    if not is_explicit(mesh):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))
