"""The search tables price copies of a layer that differ in recompute apart: the least memory
of any choice (``reduce.least_memory``) with one of four identical GPT layers recomputed is the
same whichever layer it is, between none and all recomputed, and every layer recomputed after
the first saves as much as the others. (The memo by layer key priced
every copy like the first one seen: 144,000 B with ``h_0`` recomputed, 342,656 B with ``h_3``,
for 348,800 B with none.)"""

import pytest

import models
from nnscaler_jax.capture.trace import capture_spec
from nnscaler_jax.cost.model import CostModel
from nnscaler_jax.ir.remat import with_recompute
from nnscaler_jax.search.reduce import least_memory
from nnscaler_jax.search.space import build_space
from nnscaler_jax.search.tables import build_tables

AXES = {"data": 2, "model": 4}


@pytest.mark.parametrize("share_layers", [True, False])  # ours / Alpa-style spaces
def test_one_recomputed_layer_is_priced_the_same_wherever_it_is(share_layers):
    graph = capture_spec(models.get("gpt", "tiny", n_layers=4, batch_size=8)).graph
    cm = CostModel.for_axes(AXES)

    def least(groups):
        g = with_recompute(graph, groups) if groups else graph
        return least_memory(build_tables(build_space(g, AXES, share_layers=share_layers), cm))

    none, first, last = least(()), least(("h_0",)), least(("h_3",))
    two, every = least(("h_0", "h_1")), least(("h_0", "h_1", "h_2", "h_3"))
    assert first == last
    assert every < two < first < none
    # the first recomputed layer also brings its residuals back as the backward's transient;
    # every further one saves one layer's activations: a third of what the last three save
    assert (first - two) == pytest.approx((first - every) / 3, rel=0.1)


@pytest.mark.parametrize("name,groups", [("gpt", ("h_0", "h_1")),
                                         ("swin", ("layers_0/blocks_0", "layers_1/blocks_1")),
                                         ("evoformer", ("blocks_0", "blocks_1"))])
def test_search_memory_is_the_plans_full_pricing_with_recompute(name, groups):
    """With layers recomputed, the search's memory is the plan's full pricing: a recomputed
    block's residuals, live together during its backward, and the inputs it keeps are terms of
    the ILP (they were not: Swin tiny's budgeted plan was priced 85 KB under its full pricing,
    and the budget took re-solves that then found nothing). Evoformer: its residual adds
    (``z + delta``) read gathered inputs, and its blocks' outputs' cotangents are live in their
    backward (``plan_walk.backward_held``)."""
    from nnscaler_jax.search.ilp import search

    graph = with_recompute(capture_spec(models.get(name, "tiny")).graph, groups)
    cm = CostModel.for_axes(AXES)
    plan, report = search(graph, AXES, cost_model=cm)
    assert report.memory_bytes == cm.plan_cost(plan, graph).memory_bytes_per_device
