"""scripts/bench_multiturn.py's pieces on the host: ShareGPT records to conversations, the turn driver (each
prompt is the conversation so far), the copy/kernel overlap of a trace (against brute force)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv.outputs import CompletionOutput, RequestOutput
from tests.conftest import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_multiturn")


class _Tok:
    def encode(self, text):
        return [ord(c) for c in text]


def test_records_become_conversations(bench):
    records = [
        {"conversations": [{"from": "gpt", "value": "hi"}, {"from": "human", "value": "abcdef"},
                           {"from": "gpt", "value": "xyz"}, {"from": "human", "value": "gh"},
                           {"from": "gpt", "value": "1234567"}, {"from": "gpt", "value": "breaks"}]},
        {"conversations": [{"from": "human", "value": "one turn"}, {"from": "gpt", "value": "only"}]},
        {"conversations": [{"from": "human", "value": "aa"}, {"from": "gpt", "value": "b"},
                           {"from": "human", "value": "cc"}, {"from": "gpt", "value": "d" * 50}]},
    ]
    convs = bench.sample_conversations(records, _Tok(), 5, seed=0, min_turns=2, max_user_tokens=4,
                                       max_answer_tokens=5, max_context=20)
    got = sorted((c.user_turns, c.answer_lens) for c in convs)
    # record 0: from the first human turn, user messages cut to 4 tokens, answers capped at 5; the trailing
    # gpt-after-gpt is a break. Record 1 has one turn (dropped); record 2's turns fit 20 tokens
    assert got == sorted([([[97, 98, 99, 100], [103, 104]], [3, 5]), ([[97, 97], [99, 99]], [1, 5])])
    small = bench.sample_conversations(records, _Tok(), 5, seed=0, max_user_tokens=4, max_answer_tokens=5,
                                       max_context=12)
    assert [c.user_turns for c in small] == [[[97, 97], [99, 99]]]  # record 0's second turn passes 12


class _EchoEngine:
    """Answers every request with the first ``max_tokens`` of ``[len(prompt), len(prompt) + 1, ...]``, one
    token per step, so each turn's output depends on the prompt the driver built."""

    def __init__(self):
        self.live, self.prompts = {}, {}

    def add_request(self, rid, prompt, params):
        self.prompts[rid] = list(prompt)
        self.live[rid] = (list(prompt), params.max_tokens, [])

    def has_unfinished_requests(self):
        return bool(self.live)

    def step(self):
        outs = []
        for rid, (prompt, n, out) in list(self.live.items()):
            out.append(len(prompt) + len(out))
            done = len(out) == n
            outs.append(RequestOutput(request_id=rid, prompt_token_ids=prompt, finished=done, outputs=[
                CompletionOutput(index=0, token_ids=list(out), new_token_ids=out[-1:],
                                 finish_reason="length" if done else None)]))
            if done:
                del self.live[rid]
        return outs


def test_each_turn_prompt_is_the_conversation_so_far(bench):
    convs = bench.synthetic_conversations(5, seed=1, vocab_size=50, turns=3)
    engine = _EchoEngine()
    turns = bench.run_workload(engine, convs, max_active=2)
    assert len(turns) == 15
    for i, c in enumerate(convs):
        context = []
        for t in range(3):
            prompt = context + c.user_turns[t]
            assert engine.prompts[f"c{i}-t{t}"] == prompt
            answer = list(range(len(prompt), len(prompt) + c.answer_lens[t]))
            assert bench.transcripts(turns)[(i, t)] == answer
            context = prompt + answer
    assert all(t.first_token is not None and t.first_token <= t.done for t in turns)


def test_overlap_of_interval_unions_matches_brute_force(bench):
    rng = np.random.default_rng(3)
    for _ in range(20):
        xs = [tuple(sorted(rng.integers(0, 100, 2))) for _ in range(int(rng.integers(0, 6)))]
        ys = [tuple(sorted(rng.integers(0, 100, 2))) for _ in range(int(rng.integers(0, 6)))]
        covered = lambda spans: {t for a, b in spans for t in range(a, b)}  # noqa: E731
        assert bench.overlap_ns(xs, ys) == len(covered(xs) & covered(ys))
