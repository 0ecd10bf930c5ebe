"""scripts/dev/roofline.py's sequential bound against hand-computed schedules (no JAX)."""

from __future__ import annotations

import types

import pytest

from tests.conftest import load_script

CONFIG = types.SimpleNamespace(hidden_size=64, num_layers=2, vocab_size=100, head_size=16, num_heads=4,
                               num_kv_heads=2, intermediate_size=128, tie_word_embeddings=False)


def _bound(requests, **kw):
    load_script("sim_token_budget")  # roofline imports its replay
    roofline = load_script("roofline")
    args = dict(max_num_seqs=1, max_num_batched_tokens=64, bandwidth=1e9, flops=1e12) | kw
    return roofline.sequential_bound(CONFIG, requests, **args), roofline.model_numbers(CONFIG)


def test_one_request_by_hand():
    prompt, n = 12, 5
    b, m = _bound([(list(range(prompt)), n)])
    bw, fl = 1e9, 1e12
    weights = m["weight_bytes"] / bw
    # step 1: the whole prompt (its first token sampled there); then n - 1 decode steps at contexts 13..16
    want = max(weights, 2 * m["params"] * prompt / fl) + m["attn_flops_per_pair"] * prompt * (prompt / 2) / fl
    for ctx in range(prompt + 1, prompt + n):
        want += max(weights, 2 * m["params"] / fl) + m["kv_bytes_per_token"] * ctx / bw
    assert b["steps"] == n
    assert b["seconds"] == pytest.approx(want, rel=1e-12)
    assert b["output_tok_s"] == pytest.approx(n / want)
    assert sum(sec for _, sec in b["phases"].values()) == pytest.approx(want)
    assert b["phases"]["1-32"][0] == n


def test_longest_first_shortens_the_schedule():
    reqs = [([1] * 4, 1), ([1] * 4, 1), ([1] * 4, 10)]
    fcfs, _ = _bound(reqs, max_num_seqs=2)
    lpt, _ = _bound(reqs, max_num_seqs=2, order="longest_first")
    # fcfs: the two short requests fill both seats in step 1, the long one starts in step 2 and decodes 9 more;
    # longest first: the long one starts in step 1 and the last short one rides in its second step
    assert (fcfs["steps"], lpt["steps"]) == (11, 10)
    with pytest.raises(ValueError, match="order='random'"):
        _bound(reqs, order="random")
