"""Alpa's inter-operator pass: layer clustering, Alpa's stage DP (closed form on synthetic
costs), and the whole search with intra-op ILP stage profiles on a small GPT."""


import numpy as np
import pytest

import models
from nnscaler_jax.capture.trace import capture_spec
from nnscaler_jax.cost.compute import op_flops
from nnscaler_jax.errors import PlanError
from nnscaler_jax.pipeline.clustering import cluster_layers
from nnscaler_jax.pipeline.inter_op import (
    alpa_pipeline_search,
    inter_op_dp,
    stage_graph,
    submesh_shapes,
)


def _graph(n_layers=4, batch=2):
    spec = models.get("gpt", "tiny", n_layers=n_layers, batch_size=batch)
    return capture_spec(spec).graph, spec


@pytest.fixture(scope="module")
def gpt():
    return _graph()


def test_submesh_set():
    assert submesh_shapes(64, 8) == [(1, 1), (1, 2), (1, 4), (1, 8)] + [(n, 8) for n in
                                                                        range(2, 9)]
    assert submesh_shapes(4, 8) == [(1, 1), (1, 2), (1, 4)]


def test_clustering_balances_flops_and_cuts_cheaply(gpt):
    g, spec = gpt
    n = len(g.ops)
    for L in (2, 4):
        cl = cluster_layers(g, L)
        assert cl[0][0] == 0 and cl[-1][1] == n and len(cl) == L
        assert all(a < b and b == c for (a, b), (c, _) in zip(cl, cl[1:] + ((cl[-1][1], 0),),
                                                              strict=True))
        flops = [sum(op_flops(op) for op in g.ops[a:b]) for a, b in cl]
        assert max(flops) <= (1 + 1.6) * sum(flops) / L
    # a stage graph reads only what earlier ops made (or inputs) and exports what later ops read
    a, b = cluster_layers(g, 2)[1]
    sub = stage_graph(g, a, b)
    made = {t.id for op in sub.ops for t in op.outputs}
    assert all(t.id not in made for t in sub.inputs)
    acts = [t for t in sub.inputs if t.role.value == "value"]
    c = spec.config
    # cutting between transformer layers: the residual stream (batch x seq x d, f32) crosses
    assert sum(t.nbytes for t in acts) == 2 * c.seq_len * c.d_model * 4


def test_inter_op_dp_closed_form():
    # 4 identical layers; one device: 1 s per layer per micro-batch, two devices 0.55 s
    shapes = [(1, 1), (1, 2)]
    cost = {}
    for i in range(4):
        for j in range(i + 1, 5):
            for s in range(1, 5):
                cost[(i, j, (1, 1), s)] = ((j - i) * 1.0, (1, 1), None)
                cost[(i, j, (1, 2), s)] = ((j - i) * 0.55, (1, 2), None)
    step, stages, _ = inter_op_dp(cost, 4, shapes, devices=4, microbatches=8)
    # 4 x (1,1): 4 + 7 * 1 = 11; 2 x (1,2) with 2 layers each: 2.2 + 7 * 1.1 = 9.9 (balanced);
    # (1,2)+(1,1)+(1,1) with 2+1+1 layers: 3.1 + 7 * 1.1 = 10.8
    assert step == pytest.approx(2.2 + 7 * 1.1)
    assert [s[0] for s in stages] == [(0, 2), (2, 4)] and [s[1] for s in stages] == [(1, 2)] * 2
    # a budget that forbids 2 micro-batches in flight on a 2-device stage changes the choice
    tight = {k: v for k, v in cost.items() if not (k[2] == (1, 2) and k[3] >= 2)}
    step2, stages2, _ = inter_op_dp(tight, 4, shapes, devices=4, microbatches=8)
    assert step2 == pytest.approx(3.1 + 7 * 1.1)   # the 2-device stage goes last (1 in flight)
    assert stages2[-1][1] == (1, 2) and stages2[-1][0] == (2, 4)
    # the sync (4th item) is paid once per step, by the slowest
    synced = {k: v + (0.5 if k[2] == (1, 2) else 0.0,) for k, v in cost.items()}
    assert inter_op_dp(synced, 4, shapes, 4, 8)[0] == pytest.approx(9.9 + 0.5)


def test_alpa_pipeline_search_small(gpt):
    g, _ = gpt
    r = alpa_pipeline_search(g, devices=2, global_batch=8, memory_per_device=2**30,
                             per_node=2, layers=2)
    assert sum(sm[0] * sm[1] for _, sm, _, _ in r.stages) == 2
    covered = [kj for kj, *_ in r.stages]
    assert covered[0][0] == 0 and covered[-1][1] == 2
    assert r.microbatches * r.microbatch_size == 8
    ts = [t for *_, t in r.stages]
    assert r.step_time_s >= sum(ts) + (r.microbatches - 1) * max(ts) - 1e-12
    assert r.profiles[0] >= 1 and r.search_s >= r.profile_s > 0
    assert "sub-mesh" in str(r)
    with pytest.raises(PlanError, match="smallest estimate"):
        alpa_pipeline_search(g, devices=2, global_batch=8, memory_per_device=1e4, per_node=2,
                             layers=2)


def test_identical_stages_share_one_ilp():
    g, _ = _graph(n_layers=6)
    r = alpa_pipeline_search(g, devices=1, global_batch=4, memory_per_device=2**30,
                             per_node=1, layers=6, time_limit=60)
    # 21 layer ranges on one device; ranges with the same ops (inner layers) are profiled once
    assert r.profiles[1] == 21 and r.profiles[0] < 21
    assert np.isfinite(r.step_time_s)
