"""T5 tiny's tied LM head co-sharded on the vocabulary (2 chunks per device) while its table is
stored split on the features: the block reads its chunked input (the table) in another layout
than it is stored in (T5-8's searched plan; shared by the co-sharding numerics test and the
XLA:GPU check that the table is relaid out once, outside the chunk loop)."""

import dataclasses

import models
from nnscaler_jax.capture.trace import capture_spec
from nnscaler_jax.ir.coshard import coshard_candidates
from nnscaler_jax.planner import make_plan

TABLE = "params/shared/embedding"


def tied_head_plan(loss: bool = True):
    """``(spec, graph, plan)``: the searched plan of T5 tiny (no budget) with its head's
    transpose split on the vocabulary over ``model``, the LM head matmul on the tokens over
    ``data`` and the vocabulary over ``model``, the table stored ``(None, 'model')``, the
    head's block in 2 chunks."""
    spec = models.get("t5", "tiny")
    graph = capture_spec(spec, loss=loss).graph
    (head,) = [c for c in coshard_candidates(graph, ways=8) if c.layer == ""]
    plan = make_plan(graph, {"data": 2, "model": 4}, policy="auto")
    by_id = {op.id: op for op in graph.ops}
    ops = []
    for p in plan.ops:
        if p.op == head.seed:
            p = dataclasses.replace(p, split=(("model", head.dim),))
        elif p.module_path == "shared" and by_id[p.op].primitive == "dot_general":
            p = dataclasses.replace(p, split=(("data", "m0"), ("model", "n0")))
        ops.append(p)
    variables = tuple((n, (None, "model") if n == TABLE else s) for n, s in plan.variables)
    return spec, graph, dataclasses.replace(plan, ops=tuple(ops), variables=variables,
                                            coshard=((head.seed, head.dim, 2),), cost=None)
