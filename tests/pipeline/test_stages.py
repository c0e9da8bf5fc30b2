"""Layer / stage detection: one finder for variables, graphs and the runtime's program split."""

import math

import pytest

import models
from nnscaler_jax.capture.trace import trace
from nnscaler_jax.errors import PlanError
from nnscaler_jax.ir.layers import graph_layers, numbered_layers, variable_stack
from nnscaler_jax.pipeline.stages import stage_layers, stage_of
from nnscaler_jax.pipeline.units import layer_units


def test_stage_layers():
    vs = [(f"params/h_{i}/mlp/kernel", (4, 4)) for i in range(4)] + [("params/wte/embedding",
                                                                       (8, 4))]
    assert stage_layers(vs, 2) == (("h_0", 0), ("h_1", 0), ("h_2", 1), ("h_3", 1))
    assert [s for _, s in stage_layers(vs, 2, 2)] == [0, 1, 0, 1]
    with pytest.raises(PlanError, match="do not split evenly"):
        stage_layers(vs, 3)
    with pytest.raises(PlanError, match="no stack of repeated layers"):
        stage_layers([("params/fc1/kernel", (4, 4))], 2)


def test_numbered_stack_is_the_most_repeated_prefix_whatever_its_name():
    tops = ["Dense_0", "block_0", "block_0", "block_1", "block_2", None, "Dense_1", "head"]
    stack = numbered_layers(tops)
    assert (stack.module, stack.numbers, stack.scanned) == ("block", (0, 1, 2), False)
    assert stack.names == ("block_0", "block_1", "block_2")
    assert stack.number_of("block_2") == 2 and stack.number_of("Dense_1") is None
    assert numbered_layers(["Dense_0", "emb", "head"]) is None   # one is not a stack


def test_scanned_stack_from_variables_has_no_special_names():
    layer = [(f"params/encoder/{n}", (3, 8, 8)) for n in ("q", "k", "v", "o")]
    vs = ([("params/tokens/embedding", (3, 8)), ("params/norm/scale", (8,)),
           ("params/norm/bias", (8,))] + layer
          + [("params/proj/kernel", (3, 8)), ("params/proj/bias", (3,)),
             ("params/proj/extra", (3, 2)), ("params/proj/more", (3, 1))])
    stack = variable_stack(vs)  # 'encoder' has more stacked variables than 'proj'
    assert stack.scanned and stack.names == ("encoder[0]", "encoder[1]", "encoder[2]")
    assert stage_of(stack, 3) == (("encoder[0]", 0), ("encoder[1]", 1), ("encoder[2]", 2))


@pytest.mark.parametrize("name,preset,module,scanned,count", [
    ("gpt", "tiny", "h", False, 2), ("llama", "tiny", "layers", False, 2),
    ("gpt", "tiny-scan", "h", True, 2), ("llama", "tiny-scan", "layers", True, 2),
])
def test_graph_layers_and_units_agree(name, preset, module, scanned, count):
    spec = models.get(name, preset)
    graph = trace(spec.module, *spec.make_args())
    where = graph_layers(graph)
    assert (where.stack.module, where.stack.scanned, where.stack.count) == (module, scanned, count)
    units = layer_units(graph, batch=2)
    assert [u.name for u in units] == ["<prefix>", *where.stack.names, "<suffix>"]
    # the same stack as the variables give (what the CLI prints)
    assert variable_stack([(v.name, v.shape) for v in graph.variables]) == where.stack
    if not scanned:
        assert where.start > 0 and where.end < len(graph.ops)
        assert all(b == c for (_, b), (c, _) in zip(where.bounds, where.bounds[1:]))


def test_graph_without_stack():
    spec = models.get("mlp", "tiny")
    with pytest.raises(PlanError, match="no stack of repeated layers"):
        graph_layers(trace(spec.module, *spec.make_args()))


@pytest.mark.parametrize("precision", [None, "bfloat16"])
def test_units_of_a_model_captured_at_a_precision_are_its_layers(precision):
    """A precision casts every weight at the program's start, in the parameters' (string)
    order, each cast under its layer's path: the layers must not start at their casts (h_0,
    h_1, h_10, h_11, ..., with all of the compute in the last one)."""
    from nnscaler_jax.capture.trace import capture_spec

    spec = models.get("gpt", "tiny", n_layers=12)
    graph = capture_spec(spec, precision=precision, loss=True).graph
    where = graph_layers(graph)
    assert where.stack.names == tuple(f"h_{i}" for i in range(12))
    units = layer_units(graph, batch=2)
    assert [u.name for u in units] == ["<prefix>", *where.stack.names, "<suffix>"]
    layers = units[1:-1]
    for u in layers:  # identical layers: equal compute, weights and kept activations
        assert u.time_s == pytest.approx(layers[0].time_s, rel=1e-9) and u.time_s > 0
        assert u.param_bytes == layers[0].param_bytes > 0
        assert u.act_bytes == pytest.approx(layers[0].act_bytes, rel=1e-9)
    # every weight counted once, in float32 (the variables; their casts read them)
    assert sum(u.param_bytes for u in units) - units[-1].tied_bytes == pytest.approx(sum(
        4 * math.prod(t.shape) for t in graph.variables))
