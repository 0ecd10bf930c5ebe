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
