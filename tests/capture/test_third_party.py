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
