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
