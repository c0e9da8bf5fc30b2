"""transformers' Flax GPT-2 at a tiny size (2 layers, width 32, vocabulary 100), as the tests
that run a third-party model call it."""

import warnings

import jax.numpy as jnp
import pytest


def tiny_gpt2(batch: int, seq: int):
    """``(model, args, loss_fn)``: the ``FlaxGPT2LMHeadModel`` (``.module``, ``.params``), its
    call's ``(input_ids, attention_mask, position_ids)`` and a loss on its logits; skips the
    test where transformers is missing."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.FlaxGPT2LMHeadModel(cfg, _do_init=True)
    ids = (jnp.arange(batch * seq).reshape(batch, seq) % 100).astype(jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(seq)[None], (batch, seq))
    args = (ids, jnp.ones((batch, seq), jnp.int32), pos)
    return model, args, lambda out, *a: jnp.mean(out[0] ** 2)
