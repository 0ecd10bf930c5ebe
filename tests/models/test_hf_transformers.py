"""Opt-in: the five architectures against Hugging Face ``transformers`` itself (PyTorch, f32, eager attention)
on the tiny random checkpoints of tests/models/hf_checkpoints.py: jaxkv's paged logits of a prefill and 16
greedy decode steps equal ``transformers``' logits of the same token sequence to 1e-4.

Needs the ``hf-test`` extra (``pip install -e '.[hf-test]'``: torch CPU + transformers); skipped without it.
The CI comparison against the project's own dense reference is tests/models/test_hf_checkpoints.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import models  # noqa: E402
from jaxkv import SamplingParams  # noqa: E402
from tests.models import hf_checkpoints as hfc  # noqa: E402

STEPS = 16


@pytest.fixture(scope="module")
def tokenizer():
    return hfc.build_tokenizer()


@pytest.mark.parametrize("arch", list(hfc.ARCHS))
def test_paged_logits_equal_transformers(tmp_path, tokenizer, arch):
    d = tmp_path / arch
    hfc.write_checkpoint(d, arch, seed=7, tokenizer=tokenizer)
    llm = models.LLM(d, dtype="float32", attention_impl="reference", max_model_len=64, num_gpu_blocks=24,
                     block_size=8, max_num_seqs=2, max_num_batched_tokens=32, num_scheduler_steps=STEPS,
                     return_logits=True)
    outs = llm.generate(["The capital of France is", "Once upon a time, there was"],
                        SamplingParams(max_tokens=STEPS + 1, temperature=0, ignore_eos=True), use_tqdm=False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    assert type(hf).__name__ == json.loads((d / "config.json").read_text())["architectures"][0]
    for out in outs:
        seq = out.prompt_token_ids + out.outputs[0].token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([seq])).logits[0].float().numpy()
        start = len(out.prompt_token_ids) - 1
        np.testing.assert_allclose(out.outputs[0].logits, ref[start:start + STEPS + 1], rtol=1e-4, atol=1e-4)


def test_logprobs_and_prompt_logprobs_equal_transformers(tmp_path, tokenizer):
    """Issue 43: ``logprobs`` and ``prompt_logprobs`` of 24 prompts within 1e-3 nats of ``transformers``'
    ``log_softmax`` on the same checkpoint (float32, CPU): prompts computed in 16-token chunks, and a second
    round whose prompts are in the prefix cache (prompt logprobs still compute every position), and a third
    without prompt logprobs, served from the prefix cache."""
    d = tmp_path / "llama"
    hfc.write_checkpoint(d, "LlamaForCausalLM", seed=11, tokenizer=tokenizer)
    llm = models.LLM(d, dtype="float32", attention_impl="reference", max_model_len=96, num_gpu_blocks=256,
                     block_size=8, max_num_seqs=8, max_num_batched_tokens=16, num_scheduler_steps=4,
                     enable_prefix_caching=True, enable_multiprocessing=False)
    words = " ".join(hfc.CORPUS).split()
    rng = np.random.default_rng(0)
    prompts = [" ".join(rng.choice(words, size=rng.integers(3, 24))) for _ in range(24)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    sp = SamplingParams(max_tokens=6, temperature=0.7, seed=1, logprobs=5, prompt_logprobs=5)
    for round_ in range(3):
        outs = llm.generate(prompts, sp if round_ < 2 else sp.replace(prompt_logprobs=None), use_tqdm=False)
        if round_ == 2:
            assert sum(o.num_cached_tokens for o in outs) > 0
        for out in outs:
            c = out.outputs[0]
            seq = out.prompt_token_ids + c.token_ids
            with torch.no_grad():
                ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].double(), -1).numpy()
            n = len(out.prompt_token_ids)
            for i, (t, dct) in enumerate(zip(c.token_ids, c.logprobs)):
                assert abs(dct[t].logprob - ref[n - 1 + i, t]) < 1e-3
                for k in np.argsort(-ref[n - 1 + i])[:5]:
                    assert abs(dct[int(k)].logprob - ref[n - 1 + i, k]) < 1e-3
            if round_ == 2:
                assert out.prompt_logprobs is None
                continue
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n
            for j in range(1, n):
                assert abs(out.prompt_logprobs[j][seq[j]].logprob - ref[j - 1, seq[j]]) < 1e-3
                for k in np.argsort(-ref[j - 1])[:5]:
                    assert abs(out.prompt_logprobs[j][int(k)].logprob - ref[j - 1, k]) < 1e-3
