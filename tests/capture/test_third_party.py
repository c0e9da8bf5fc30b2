"""A Flax model nobody here wrote (Hugging Face transformers) traces with every op annotated."""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import pytest
from capture_helpers import check_annotations_bind, unannotated

from nnscaler_jax import trace

transformers = pytest.importorskip("transformers")


def _trace(model, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return trace(model.module, *args, variables={"params": model.params})


def _check(graph) -> None:
    missing = unannotated(graph)
    assert not missing, "ops without a rule:\n  " + "\n  ".join(missing)
    assert all(op.annotated for op in graph.walk())
    assert "!unannotated" not in str(graph)
    check_annotations_bind(graph)


def test_gpt2_lm_head_fully_annotated() -> None:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.FlaxGPT2LMHeadModel(cfg, _do_init=True)
    ids = jnp.ones((2, 8), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(8)[None], (2, 8))
    # __call__(input_ids, attention_mask, position_ids, ...)
    graph = _trace(model, ids, jnp.ones((2, 8), jnp.int32), positions)
    _check(graph)
    assert {"transformer/h/0/attn/c_attn", "transformer/h/1/mlp/c_fc", "lm_head"} <= \
        graph.module_paths
    names = {t.name for t in graph.variables}
    assert "params/transformer/h/0/attn/c_attn/kernel" in names


def test_bert_fully_annotated() -> None:
    cfg = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                  intermediate_size=64, vocab_size=100,
                                  max_position_embeddings=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.FlaxBertModel(cfg, _do_init=True)
    ids = jnp.ones((2, 8), jnp.int32)
    zeros = jnp.zeros((2, 8), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(8)[None], (2, 8))
    # __call__(input_ids, attention_mask, token_type_ids, position_ids, head_mask, ...)
    graph = _trace(model, ids, jnp.ones((2, 8), jnp.int32), zeros, positions, None)
    _check(graph)


def test_wrapping_the_model_object_says_to_wrap_its_module() -> None:
    """A user's first try, ``auto_parallel(mesh)(FlaxGPT2LMHeadModel(...))``: the error is the
    fix (its ``.module``, with ``{'params': model.params}``), which then runs."""
    import jax
    import numpy as np
    from meshes import make_mesh

    from nnscaler_jax import PlanError, auto_parallel

    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=100, n_positions=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.FlaxGPT2LMHeadModel(cfg, _do_init=True)
    mesh = make_mesh((2, 4), ("data", "model"))
    with pytest.raises(PlanError, match=r"FlaxGPT2LMHeadModel is a model object holding one.*"
                       r"\n    pm = auto_parallel\(mesh\)\(model.module\)"):
        auto_parallel(mesh)(model)
    ids = jnp.ones((8, 8), jnp.int32)
    mask, positions = jnp.ones_like(ids), jnp.broadcast_to(jnp.arange(8)[None], (8, 8))
    pm = auto_parallel(mesh)(model.module)
    out = pm.apply({"params": model.params}, ids, mask, positions)
    np.testing.assert_allclose(out.logits, model(ids, mask, positions).logits, rtol=1e-5,
                               atol=1e-5)
    assert jax.tree.leaves(out)[0].sharding.mesh.shape == mesh.shape
