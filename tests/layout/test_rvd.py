"""RVD layouts: validation, PartitionSpec round trip, local shapes against real shardings."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from meshes import make_mesh

from nnscaler_jax.errors import PlanError
from nnscaler_jax.layout import Layout
from nnscaler_jax.mesh.topology import DEFAULT_LINK, MeshSpec

MESH = MeshSpec(("data", "model"), (2, 4), (DEFAULT_LINK, DEFAULT_LINK))


def test_canonical_form_and_equality():
    a = Layout(dims=[["data"], None, "model"], partial=["z", "y"])
    assert a.dims == (("data",), (), ("model",)) and a.partial == ("y", "z")
    assert a == Layout.of(3, {0: "data", -1: "model"}, partial=("z", "y"))
    assert hash(a) == hash(Layout.of(3, {0: "data", 2: "model"}, partial=("y", "z")))


def test_axis_state_and_str():
    lay = Layout.of(3, {0: "data", 2: ("x", "model")}, partial=("v",))
    assert lay.axis_state("data") == ("D", 0)
    assert lay.axis_state("model") == ("D", 2)
    assert lay.axis_state("v") == ("V",)
    assert lay.axis_state("other") == ("R",)
    assert str(lay) == "V(v)D(0:data,2:(x,model))"
    assert str(Layout.replicated(2)) == "R"
    assert Layout.of(2, {0: "data"}).describe(MESH) == "R(model)V()D(0:data)"
    assert Layout.of(2, partial=("data",)).describe(MESH) == "R(model)V(data)D()"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"split": {0: "data", 1: "data"}},
        {"split": {0: ("data", "data")}},
        {"split": {0: "data"}, "partial": ("data",)},
    ],
)
def test_axis_used_twice(kwargs):
    with pytest.raises(PlanError, match=r"mesh axes \['data'\] are used more than once"):
        Layout.of(2, **kwargs)


def test_check_errors_name_layout_axes_and_shape():
    with pytest.raises(PlanError, match=r"D\(0:pipe\).*\(8, 8\).*\['pipe'\].*'data', 'model'"):
        Layout.of(2, {0: "pipe"}).check((8, 8), MESH)
    with pytest.raises(PlanError, match=r"dim 1 has size 6.*not divisible by the 4 shards.*model"):
        Layout.of(2, {1: "model"}).check((8, 6), MESH)
    with pytest.raises(PlanError, match=r"8 shards of mesh axes \('data', 'model'\)"):
        Layout.of(2, {0: ("data", "model")}).check((4, 6), MESH)
    with pytest.raises(PlanError, match="has 2 dims but the tensor has shape"):
        Layout.replicated(2).check((8,), MESH)
    Layout.of(2, {0: ("data", "model")}).check((8, 6), MESH)


def test_pspec_round_trip():
    for pspec, ndim in [
        (P(), 2),
        (P("data"), 2),
        (P(None, ("data", "model")), 3),
        (P("model", None, "data"), 3),
    ]:
        lay = Layout.from_pspec(pspec, ndim)
        assert lay.to_pspec() == pspec
        assert Layout.from_pspec(lay.to_pspec(), ndim) == lay
    assert Layout.from_pspec(P(None, "model"), 2) == Layout.of(2, {1: "model"})
    with pytest.raises(PlanError, match="3 entries for a 2-d tensor"):
        Layout.from_pspec(P("a", None, None), 2)
    with pytest.raises(PlanError, match="UNCONSTRAINED"):
        Layout.from_pspec(P(P.UNCONSTRAINED), 1)


def test_partial_pspec_behaviour():
    lay = Layout.of(2, {0: "data"}, partial=("model",))
    with pytest.raises(PlanError, match=r"partial sums over mesh axes \('model',\)"):
        lay.to_pspec()
    assert lay.to_pspec(allow_partial=True) == P("data")
    assert Layout.from_pspec(P("data"), 2, partial=("model",)) == lay


def test_local_shape_and_bytes():
    lay = Layout.of(3, {0: "data", 2: "model"}, partial=())
    assert lay.local_shape((4, 3, 8), MESH) == (2, 3, 2)
    assert Layout.of(2, {1: ("data", "model")}).local_shape((3, 16), MESH) == (3, 2)
    assert Layout.of(2, partial=("data", "model")).local_shape((3, 16), MESH) == (3, 16)
    assert lay.local_bytes((4, 3, 8), 4, MESH) == 2 * 3 * 2 * 4


def test_replace_axis():
    lay = Layout.of(2, {0: "data"})
    assert lay.replace_axis("model", ("D", 0)) == Layout.of(2, {0: ("data", "model")})
    assert lay.replace_axis("data", ("V",)) == Layout.of(2, partial=("data",))
    assert lay.replace_axis("data", ("R",)) == Layout.replicated(2)


@pytest.mark.parametrize(
    "lay",
    [
        Layout.replicated(2),
        Layout.of(2, {0: "data"}),
        Layout.of(2, {1: "model"}),
        Layout.of(2, {0: "model", 1: "data"}),
        Layout.of(2, {0: ("data", "model")}),
        Layout.of(2, {1: ("model", "data")}),
    ],
    ids=str,
)
def test_real_named_sharding_matches_local_shape(lay):
    mesh = make_mesh((2, 4), ("data", "model"))
    spec = MeshSpec.from_mesh(mesh)
    shape = (16, 8)
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    arr = jax.device_put(x, NamedSharding(mesh, lay.to_pspec()))
    expected = lay.local_shape(shape, spec)
    shards = arr.addressable_shards
    assert len(shards) == 8
    assert {s.data.shape for s in shards} == {expected}
    # Block placement: the minor-most axis of a dim indexes consecutive blocks.
    for s in shards:
        np.testing.assert_array_equal(np.asarray(s.data), x[s.index])
    if lay.dims[0] == ("data", "model"):
        coords = {d.id: c for c, d in np.ndenumerate(mesh.devices)}
        for s in shards:
            i, j = coords[s.device.id]
            assert s.index[0].start == (i * 4 + j) * expected[0]
