"""The in-graph pipeline programs' parameter layout: chunks' pieces packed in rows of blocks.

Checked against whole arrays on 8 devices (2 stages x 4 tensor devices): the rows hold each
device's blocks, come back whole, are read by GSPMD-partitioned code as whole pieces with the
gradients of whole pieces (a piece replicated over the tensor axis too), and weigh each element
once in a global norm.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from meshes import make_mesh

from nnscaler_jax.layout import Layout
from nnscaler_jax.pipeline.packed import PackedRows

SDS = jax.ShapeDtypeStruct


def _rows():
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = make_mesh((2, 4), ("stage", "model"), axis_types=auto)
    avals = [[SDS((6, 8), "float32"), SDS((8,), "float32")],   # chunk 0 (stage 0)
             [SDS((4, 4), "float32"), SDS((3,), "int32")]]      # chunk 1 (stage 1)
    lays = [[Layout.of(2, {1: "model"}), None], [Layout.of(2, {0: "model"}), None]]
    return mesh, PackedRows(mesh, "stage", ("model",), 2, 1, avals, lays)


def _pieces(seed=0):
    r = np.random.default_rng(seed)
    return [[r.normal(size=(6, 8)).astype(np.float32), r.normal(size=8).astype(np.float32)],
            [r.normal(size=(4, 4)).astype(np.float32), np.arange(3, dtype=np.int32)]]


def test_rows_hold_each_devices_blocks_and_come_back_whole():
    _, rows = _rows()
    pieces = _pieces()
    got = rows.to_rows(pieces)
    assert rows.width == {"float32": 6 * 2 + 8, "int32": 3}
    assert got["float32"].shape == (2, 1, 4 * 20) and got["int32"].shape == (2, 1, 12)
    part = np.asarray(got["float32"][0, 0]).reshape(4, 20)
    for t in range(4):   # device t of stage 0: its two columns of W, then b whole
        np.testing.assert_array_equal(part[t, :12], pieces[0][0][:, 2 * t:2 * t + 2].ravel())
        np.testing.assert_array_equal(part[t, 12:], pieces[0][1])
    part = np.asarray(got["float32"][1, 0]).reshape(4, 20)
    np.testing.assert_array_equal(part[3, :4], pieces[1][0][3])   # stage 1: V's rows, padded
    assert not part[:, 4:].any()
    back = rows.from_rows(got)
    for want, have in zip(jax.tree.leaves(pieces), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(np.asarray(have), want)


def test_pieces_read_by_partitioned_code_get_whole_pieces_gradients():
    """A stage's code, GSPMD partitioning the tensor axis, reads its chunk's pieces whole; the
    gradient of each stored block is the block of the whole piece's gradient, the copies of a
    replicated piece each the whole (not one device's share of it)."""
    mesh, rows = _rows()
    pieces = _pieces()
    x = np.random.default_rng(1).normal(size=(5, 6)).astype(np.float32)

    def f(w, b):
        return jnp.sum(jnp.tanh(x @ w) * b) + jnp.sum(b ** 2)

    def loss(stored):
        def stage(row):
            row = {dt: r[0, 0] for dt, r in row.items()}
            w, b = rows.pieces(row, 0)[:2]
            return jnp.where(jax.lax.axis_index("stage") == 0, f(w, b), 0.0)[None]

        per = jax.shard_map(stage, mesh=mesh, in_specs=({dt: P("stage") for dt in stored},),
                            out_specs=P("stage"), axis_names={"stage"}, check_vma=False)
        return per(stored).sum()

    stored = jax.device_put(rows.to_rows(pieces), rows.sharding)
    stored = {"float32": stored["float32"]}  # (the int row has no gradient)
    with jax.set_mesh(mesh):
        g = jax.jit(jax.grad(loss))(stored)
    gw, gb = jax.grad(f, argnums=(0, 1))(pieces[0][0], pieces[0][1])
    want = rows.to_rows([[gw, gb], [np.zeros((4, 4), np.float32), pieces[1][1]]])
    np.testing.assert_allclose(np.asarray(g["float32"]), np.asarray(want["float32"]),
                               rtol=1e-5, atol=1e-6)
    assert g["float32"].sharding.is_equivalent_to(
        NamedSharding(mesh, P("stage", None, "model")), 3)


def test_norm_weights_count_each_element_once():
    _, rows = _rows()
    pieces = _pieces(2)
    got = rows.to_rows(pieces)
    weighted = sum(float(np.sum(rows.norm_weights[dt] * np.square(np.asarray(x, np.float64))))
                   for dt, x in got.items())
    whole = sum(float(np.sum(np.square(np.asarray(p, np.float64))))
                for p in jax.tree.leaves(pieces))
    np.testing.assert_allclose(weighted, whole, rtol=1e-6)


def test_a_row_per_group_holds_each_piece_alone():
    """Groups (the identical-layer program's: each layer leaf a group) get a row each, keyed
    '<group>:<dtype>': a piece is its row, not a slice of a wider one."""
    mesh = make_mesh((2,), ("stage",))
    avals = [SDS((2, 3), "float32"), SDS((4,), "int32")]
    rows = PackedRows(mesh, "stage", (), 2, 1, [avals, avals], groups=[["w", "n"]] * 2)
    assert rows.width == {"n:int32": 4, "w:float32": 6}
    assert {k: a.dtype for k, a in rows.shapes().items()} == {"n:int32": np.int32,
                                                              "w:float32": np.float32}
    pieces = [[np.full((2, 3), s, np.float32), np.arange(4, dtype=np.int32) + s]
              for s in range(2)]
    got = rows.to_rows(pieces)
    np.testing.assert_array_equal(np.asarray(got["w:float32"])[:, 0],
                                  [p[0].ravel() for p in pieces])
    np.testing.assert_array_equal(np.asarray(got["n:int32"])[:, 0], [p[1] for p in pieces])
    for want, have in zip(jax.tree.leaves(pieces), jax.tree.leaves(rows.from_rows(got)),
                          strict=True):
        np.testing.assert_array_equal(np.asarray(have), want)
    assert [x.shape for x in rows.blocks({k: x[1, 0] for k, x in got.items()}, 1)] == [
        (2, 3), (4,)]
