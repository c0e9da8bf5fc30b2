"""``compare``'s features of a pipelined plan list no co-sharding: the pipeline runtime does not
run its SPMD part's co-sharding (chunks run data-parallel, or tensor-parallel with an in-stage
plan, which refuses co-sharded ops), as it does not run that part's recompute groups."""

import dataclasses

import models
from nnscaler_jax import Constraints, op_assign, op_trans
from nnscaler_jax.capture.trace import capture_spec
from nnscaler_jax.cli.compare import plan_features
from nnscaler_jax.ir.coshard import coshard_candidates
from nnscaler_jax.planner import make_plan


def _coshard_first_matmul(graph, mesh):
    """A policy running the first matmul in 2 chunks per device along its batch dim."""
    op = next(o for o in graph.ops if o.primitive == "dot_general")
    dim = op.annotation.outputs[0].names()[0]
    op_assign(graph, op_trans(graph, op, dim, 2 * graph.mesh_axes["data"]), "data")
    return graph.finish()


def test_pipelined_plan_lists_no_cosharding():
    graph = capture_spec(models.get("gpt", "tiny", batch_size=16)).graph
    flat = make_plan(graph, {"data": 4}, policy=_coshard_first_matmul)
    piped = make_plan(graph, {"stage": 2, "data": 4}, policy=_coshard_first_matmul,
                      constraints=Constraints(pipeline_stages=2, microbatches=2))
    assert piped.pipeline is not None
    assert [p.chunks for p in piped.ops if p.chunks] == [("m0", 2)]  # the SPMD part co-shards
    assert plan_features(flat)["cosharded"] == [["h_0/attn/query", "dot_general", "m0", 2]]
    f = plan_features(piped)
    assert f["cosharded"] == [] and f["stages"] == 2 and f["microbatches"] == 2
    assert f["schedule"] == piped.pipeline.schedule and "schedule" not in plan_features(flat)
    assert f["executor"] == piped.pipeline.executor == "in-graph"  # (tiny blocks: one program)
    # co-sharded blocks (Plan.coshard) of the SPMD part do not run in the pipeline either
    cand = coshard_candidates(graph)[0]
    blocks = ((cand.seed, cand.dim, 2),)
    assert plan_features(dataclasses.replace(flat, coshard=blocks))["cosharded"][1:]
    assert plan_features(dataclasses.replace(piped, coshard=blocks))["cosharded"] == []
