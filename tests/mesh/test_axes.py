"""Mesh axis roles (`mesh/axes.py`): reading axis sizes from meshes, the stage and data axes."""

import jax
import pytest
from meshes import make_mesh

from nnscaler_jax.errors import PlanError
from nnscaler_jax.mesh.axes import (
    DATA_AXES,
    MODEL_AXES,
    STAGE_AXES,
    data_axes,
    mesh_axes,
    stage_axis,
)


def test_role_names_are_disjoint():
    # a name with two roles would make dp and megatron split the same axis
    assert not set(DATA_AXES) & set(MODEL_AXES)
    assert not set(DATA_AXES) & set(STAGE_AXES)
    assert not set(MODEL_AXES) & set(STAGE_AXES)


def test_mesh_axes_of_a_real_mesh_an_abstract_mesh_and_a_dict_agree():
    mesh = make_mesh((2, 4), ("data", "model"))
    want = {"data": 2, "model": 4}
    assert mesh_axes(mesh) == want
    assert mesh_axes(mesh.abstract_mesh) == want
    assert mesh_axes(jax.sharding.AbstractMesh((2, 4), ("data", "model"))) == want
    # mesh order is kept (the roles below read it)
    assert list(mesh_axes(make_mesh((4, 2), ("model", "data")))) == ["model", "data"]


def test_mesh_axes_normalises_a_mapping():
    got = mesh_axes({"data": 2.0, "model": True})
    assert got == {"data": 2, "model": 1}
    assert all(type(v) is int for v in got.values())
    src = {"data": 2}
    out = mesh_axes(src)
    out["data"] = 8
    assert src == {"data": 2}  # a copy, not the caller's dict


@pytest.mark.parametrize("bad", ["2x4", (2, 4), 8, None])
def test_mesh_axes_rejects_what_is_not_a_mesh(bad):
    with pytest.raises(PlanError, match="cannot read mesh axes"):
        mesh_axes(bad)


def test_stage_axis_is_the_first_stage_name_present():
    assert stage_axis({"data": 2, "model": 4}) is None
    assert stage_axis({"data": 2, "pipe": 4}) == "pipe"
    # "stage" comes first in STAGE_AXES, whatever the mesh order
    assert stage_axis({"pipe": 2, "stage": 4}) == "stage"
    assert stage_axis(["data", "stage"]) == "stage"  # any container of names


def test_data_axes_in_mesh_order():
    axes = {"model": 2, "fsdp": 2, "stage": 2, "data": 2, "batch": 1}
    assert data_axes(axes) == ["fsdp", "data", "batch"]
    assert data_axes({"model": 8}) == []
    assert data_axes({"tp": 2, "mp": 2}) == []
