"""Structured outputs through the engine (llguidance masks applied inside the jitted step): a tiny random
model whose unconstrained text is noise must produce JSON that validates against nested schemas, one of the
choices, or a regex match; constrained and unconstrained requests share batches without the mask leaking."""

from __future__ import annotations

import json
import re

import pytest

import models
from jaxkv.sampling_params import SamplingParams, StructuredOutputsParams
from tests.models import hf_checkpoints as hfc

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"type": "string", "enum": ["cat", "dog", "owl"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 3},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                                                   "ok": {"type": "boolean"}},
                  "required": ["id", "ok"], "additionalProperties": False},
    },
    "required": ["name", "kind", "age", "owner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    hfc.write_checkpoint(d, "LlamaForCausalLM", seed=5)
    return models.LLM(d, dtype="float32", attention_impl="reference", max_model_len=128, num_gpu_blocks=512,
                      block_size=8, max_num_seqs=24, max_num_batched_tokens=128, num_scheduler_steps=4,
                      async_scheduling=True, enable_multiprocessing=False,
                      structured_outputs_disable_any_whitespace=True)  # noise would otherwise loop on spaces


def test_json_schema_outputs_validate(llm):
    """20 prompts, sampled at temperature 1 (noise unless masked): every output parses and validates."""
    sp = SamplingParams(max_tokens=120, temperature=1.0, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    outs = llm.generate([f"Animal {i}:" for i in range(20)], [sp.replace(seed=i) for i in range(20)], use_tqdm=False)
    values = []
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text
        value = json.loads(c.text)
        jsonschema.validate(value, SCHEMA)
        values.append(json.dumps(value, sort_keys=True))
    assert len(set(values)) > 10  # sampled, not one forced string


def test_choice_regex_json_object_and_a_plain_row_in_one_batch(llm):
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate("Hello world", plain, use_tqdm=False)[0].outputs[0].token_ids
    sps = [SamplingParams(max_tokens=20, temperature=1.0, seed=1,
                          structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe so"])),
           SamplingParams(max_tokens=30, temperature=1.0, seed=2,
                          structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}")),
           SamplingParams(max_tokens=120, temperature=0.8, seed=3, structured_outputs=StructuredOutputsParams(
               grammar='start: "(" num ("," num)* ")"\nnum: /[0-9]/')),
           plain]
    outs = llm.generate(["Answer:", "Code:", "Tuple:", "Hello world"], sps, use_tqdm=False)
    assert outs[0].outputs[0].text in ("yes", "no", "maybe so")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", outs[1].outputs[0].text)
    assert re.fullmatch(r"\([0-9](,[0-9])*\)", outs[2].outputs[0].text)
    assert outs[3].outputs[0].token_ids == alone  # the masks of the other rows do not reach it
    obj = llm.generate("x", SamplingParams(max_tokens=120, temperature=0.7, seed=4, n=2,
                                           structured_outputs=StructuredOutputsParams(json_object=True)),
                       use_tqdm=False)[0]
    for c in obj.outputs:
        assert c.finish_reason != "stop" or isinstance(json.loads(c.text), dict)


def test_invalid_grammars_name_the_field(llm):
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(grammar="start: foo")),
                     use_tqdm=False)
    with pytest.raises(ValueError, match="structured_outputs.json is not valid JSON"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(json="{nope")), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_compile_structured_outputs_warms_the_bitmask_programs(tmp_path):
    """``compile_structured_outputs`` (the server's default): start-up compiles each bucket's program again with
    a grammar bitmask, so constrained requests (a mixed step, then decode loops) compile nothing while serving;
    and they give the tokens the lazily compiled engine gives."""
    from tests.conftest import step_compiles
    hfc.write_checkpoint(tmp_path, "LlamaForCausalLM", seed=5)
    kw = dict(dtype="float32", attention_impl="reference", max_model_len=64, num_gpu_blocks=64, block_size=8,
              max_num_seqs=2, max_num_batched_tokens=16, num_scheduler_steps=2, enable_multiprocessing=False,
              structured_outputs_disable_any_whitespace=True)
    sp = SamplingParams(max_tokens=24, temperature=1.0, seed=3, structured_outputs=StructuredOutputsParams(
        regex=r"[0-9]{3}-[a-z]{2,12}"))
    lazy = models.LLM(tmp_path, **kw).generate(["A:", "B:"], sp, use_tqdm=False)
    warm = models.LLM(tmp_path, compile_ahead="on", compile_structured_outputs=True, **kw)
    assert warm.engine.num_compiles == 2 * warm.engine.num_buckets
    outs = []
    assert step_compiles(lambda: outs.extend(warm.generate(["A:", "B:"], sp, use_tqdm=False))) == []
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in lazy]
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2,12}", o.outputs[0].text) for o in outs)


def test_parallel_bitmask_fill_equals_row_by_row(llm):
    """``fill_bitmasks`` (llguidance's threads) gives every row the bits ``Grammar.fill_bitmask`` gives it alone:
    64 matchers of three grammars advanced by different random allowed tokens, rows in a shuffled order, one row
    left all ones; bad arrays are refused by name."""
    import numpy as np

    from jaxkv.core.structured_output import fill_bitmasks
    manager = llm.engine.structured_outputs
    kinds = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,12}"),
             StructuredOutputsParams(choice=["yes", "no", "maybe so"])]
    compiled = [manager.compile(k, backend="guidance").result() for k in kinds]
    rng = np.random.default_rng(0)
    grammars = [manager.grammar(compiled[i % 3]) for i in range(64)]
    one = manager.new_bitmask(1)
    for i, g in enumerate(grammars):
        for _ in range(i % 7):  # a different point of its grammar each
            g.fill_bitmask(one, 0)
            allowed = np.flatnonzero(np.unpackbits(one[0].view(np.uint8), bitorder="little"))
            if g.is_terminated or not len(allowed):
                break
            assert g.accept([int(rng.choice(allowed))])
    rows = rng.permutation(65)[:64]
    want = manager.new_bitmask(65)
    for g, r in zip(grammars, rows):
        g.fill_bitmask(want, int(r))
    got = manager.new_bitmask(65)
    fill_bitmasks(zip(grammars, (int(r) for r in rows)), got)
    np.testing.assert_array_equal(got, want)
    assert (got[int(np.setdiff1d(np.arange(65), rows)[0])] == -1).all() and (got != -1).any()
    with pytest.raises(ValueError, match="C-contiguous int32"):
        fill_bitmasks([(grammars[0], 0)], np.zeros((2, manager.bitmask_words), np.int64))
    with pytest.raises(ValueError, match=r"rows \[70\] outside \[0, 65\)"):
        fill_bitmasks([(grammars[0], 70), (grammars[1], 0)], got)


def test_accept_tokens_equals_accept_row_by_row(llm):
    """``accept_tokens`` (one-token rows on llguidance's threads) leaves every matcher where ``Grammar.accept``
    leaves a copy of it, with the same results: allowed tokens, a disallowed one (False, the error kept), a
    several-token row, a stopped grammar (True: its EOS ends the request)."""
    import numpy as np

    from jaxkv.core.structured_output import accept_tokens
    manager = llm.engine.structured_outputs
    choice = manager.compile(StructuredOutputsParams(choice=["yes", "no"]), backend="guidance").result()
    regex = manager.compile(StructuredOutputsParams(regex=r"[0-9]{3}"), backend="guidance").result()
    tok = llm.get_tokenizer()
    digit = tok.encode("7")[-1]
    letter = tok.encode("x")[-1]
    first = manager.new_bitmask(1)
    manager.grammar(choice).fill_bitmask(first, 0)
    yes = int(np.flatnonzero(np.unpackbits(first[0].view(np.uint8), bitorder="little"))[0])  # a token choice allows
    pairs = [(manager.grammar(regex), [digit]), (manager.grammar(regex), [letter]), (manager.grammar(regex), [digit]),
             (manager.grammar(choice), [yes]), (manager.grammar(regex), [digit, digit])]
    stopped = manager.grammar(regex)
    assert stopped.accept([digit, digit, digit]) and stopped.is_terminated
    pairs.append((stopped, [tok.eos_token_id if tok.eos_token_id is not None else 0]))
    copies = [(manager.grammar(regex) if i != 3 else manager.grammar(choice), t) for i, (_, t) in enumerate(pairs[:5])]
    twin = manager.grammar(regex)
    twin.accept([digit, digit, digit])
    copies.append((twin, pairs[5][1]))
    want = [g.accept(t) for g, t in copies]
    got = accept_tokens(pairs)
    assert got == want and want[1] is False and all(want[i] for i in (0, 2, 3, 4, 5))
    words = manager.new_bitmask(2)
    for (g, _), (c, _) in zip(pairs, copies):
        if g.is_terminated or g.error:
            assert (g.is_terminated, bool(g.error)) == (c.is_terminated, bool(c.error))
            continue
        g.fill_bitmask(words, 0)
        c.fill_bitmask(words, 1)
        np.testing.assert_array_equal(words[0], words[1])


def test_a_token_outside_the_grammar_aborts_only_its_request(llm, monkeypatch, caplog):
    """With the masks taken away (every row left all ones: by the host fill, or inside the step, ``llm``'s default),
    a noise model soon samples what the regex forbids: the engine aborts that request, logs why, and the
    unconstrained request beside it finishes as usual."""
    import logging

    from jaxkv.core import structured_output
    from jaxkv.worker import model_runner
    monkeypatch.setattr(model_runner, "fill_bitmasks", lambda rows, bitmask: None)
    monkeypatch.setattr(structured_output, "fill_bitmasks", lambda rows, bitmask: None)
    monkeypatch.setattr(llm.engine.structured_outputs, "backend", "guidance")  # llguidance's masks, not automata
    digits = SamplingParams(max_tokens=12, temperature=1.0, seed=11,
                            structured_outputs=StructuredOutputsParams(regex=r"[0-9]{12}"))
    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with caplog.at_level(logging.ERROR):
        outs = llm.generate(["Digits:", "Hello"], [digits, plain], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "abort", outs[0].outputs[0]
    assert "outside its grammar" in caplog.text and outs[0].request_id in caplog.text
    assert len(outs[1].outputs[0].token_ids) == 6 and outs[1].outputs[0].finish_reason == "length"


def test_masks_inside_the_step_and_automata_against_host_masks(llm, tmp_path, monkeypatch):
    """llguidance's masks filled on the host (``structured_outputs_in_step=False``: one per pass, one token per pass
    for a constrained request) against (1) llguidance's masks from host callbacks inside each step
    (``structured_outputs_in_step``, the default with one device), the matchers advancing over the tokens the step
    was fed: the same tokens; and (2) token automata on the device (the ``auto`` backend's choice for these
    grammars: a JSON schema of regular form, a regex, a choice), with no host work per token: outputs of the same
    languages. Both decode the constrained requests in device loops (fewer passes than tokens)."""
    from jaxkv.core.grammar_dfa import TokenDFA
    hfc.write_checkpoint(tmp_path, "LlamaForCausalLM", seed=5)
    host = models.LLM(tmp_path, dtype="float32", attention_impl="reference", max_model_len=128,
                      num_gpu_blocks=512, block_size=8, max_num_seqs=24, max_num_batched_tokens=128,
                      num_scheduler_steps=4, async_scheduling=True, enable_multiprocessing=False,
                      structured_outputs_disable_any_whitespace=True, structured_outputs_in_step=False,
                      structured_outputs_backend="guidance")
    in_step = llm
    assert host.engine.runner.step_masks is None and in_step.engine.runner.step_masks is not None
    sps = [SamplingParams(max_tokens=120, temperature=1.0, seed=i,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA)) for i in range(6)]
    sps += [SamplingParams(max_tokens=30, temperature=1.0, seed=7,
                           structured_outputs=StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}")),
            SamplingParams(max_tokens=20, temperature=1.0, seed=8,
                           structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe so"])),
            SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)]
    prompts = [f"Animal {i}:" for i in range(6)] + ["Code:", "Answer:", "Hello world"]
    want = host.generate(prompts, sps, use_tqdm=False)
    engine = in_step.engine
    manager = engine.structured_outputs
    assert all(isinstance(manager.compile(sp.structured_outputs).result(), TokenDFA) for sp in sps[:-1])
    for backend in ("guidance", "auto"):
        monkeypatch.setattr(manager, "backend", backend)
        before, calls = engine.stats.steps, engine.runner.step_masks.num_calls
        got = in_step.generate(prompts, sps, use_tqdm=False)
        if backend == "guidance":
            assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        else:  # the same languages, not always the same tokens: llguidance refuses some tokenizations automata take
            assert got[-1].outputs[0].token_ids == want[-1].outputs[0].token_ids  # the plain row
            assert got[7].outputs[0].text in ("yes", "no", "maybe so")
            assert all(o.outputs[0].finish_reason == "stop" for o in got[:8])
        for o in got[:6]:
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", got[6].outputs[0].text)
        passes = engine.stats.steps - before
        assert passes < max(len(o.outputs[0].token_ids) for o in got[:6])  # constrained rows took tokens in loops
        if backend == "guidance":
            assert engine.runner.step_masks.num_calls > calls and engine.runner.num_deferred > 0  # dispatch thread
        else:
            assert engine.runner.step_masks.num_calls == calls  # no callback: the masks came from the automata
    stats = engine.stats
    assert stats.step_mask_calls == engine.runner.step_masks.num_calls and stats.step_mask_wait_s >= 0
    assert host.engine.stats.step_mask_calls == 0


def test_step_masks_advance_each_matcher_once_in_device_order(llm):
    """``StepMasks`` (the host side of masks inside the step): a registered row's matcher advances over a fed token
    only when it is its next output token (a re-fed token, e.g. a resumed request's, is not consumed twice), rows
    that do not run or are not registered stay all ones, an unknown dispatch (the warm-up's) gets all-ones masks;
    the masks equal ``Grammar.fill_bitmask`` of a copy advanced by hand, also once the worker is shut down."""
    import numpy as np

    from jaxkv.core.structured_output import StepMasks
    manager = llm.engine.structured_outputs
    regex = manager.compile(StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"), backend="guidance").result()
    digit = llm.get_tokenizer().encode("7")[-1]
    masks = StepMasks(manager.bitmask_words)
    g, twin = manager.grammar(regex), manager.grammar(regex)
    prompt_len = 5
    dispatch = masks.register([(1, g, prompt_len)])
    tokens, positions = np.zeros(3, np.int32), np.full(3, -1, np.int32)

    def step(token, position):
        tokens[1], positions[1] = token, position
        return masks.finish(masks.begin(np.int32([dispatch]), tokens, positions), np.float32(0))

    want = manager.new_bitmask(1)
    twin.fill_bitmask(want, 0)
    got = step(0, prompt_len - 1)                      # the last prompt token: nothing consumed
    np.testing.assert_array_equal(got[1], want[0])
    assert (got[[0, 2]] == -1).all() and g.num_consumed == 0
    for k in range(2):                                  # output tokens 0 and 1, each fed once
        got = step(digit, prompt_len + k)
        twin.accept([digit])
        twin.fill_bitmask(want, 0)
        np.testing.assert_array_equal(got[1], want[0])
    got = step(digit, prompt_len + 1)                   # token 1 fed again: not consumed again
    np.testing.assert_array_equal(got[1], want[0])
    assert g.num_consumed == 2 and masks.num_calls == 4 and g.rejected is None
    letter = llm.get_tokenizer().encode("x")[-1]
    masks._worker.shutdown()  # as at interpreter exit with a step in flight: begin fills on its own thread
    got = step(digit, prompt_len + 2)
    twin.accept([digit])
    twin.fill_bitmask(want, 0)
    np.testing.assert_array_equal(got[1], want[0])
    got = step(letter, prompt_len + 3)                  # "777x": the regex wants "-"
    assert g.rejected and (got[1] == -1).all()          # said on the grammar; the row is left all ones
    assert (masks.finish(masks.begin(np.int32([-1]), tokens, positions)) == -1).all()   # a dispatch nobody registered


def test_automata_survive_preemption_and_fall_back_when_the_tables_are_full(llm, tmp_path, monkeypatch):
    """A cache of 24 blocks for 8 constrained requests preempts them (recompute): a resumed request's slot starts
    from the host's state after its tokens, so every output still validates. With no room in the device tables
    (``hold_dfa`` refusing), a request takes llguidance's masks instead and still validates. The ``outlines``
    backend refuses what automata cannot express, naming the backend."""
    hfc.write_checkpoint(tmp_path, "LlamaForCausalLM", seed=5)
    small = models.LLM(tmp_path, dtype="float32", attention_impl="reference", max_model_len=128, num_gpu_blocks=24,
                       block_size=8, max_num_seqs=8, max_num_batched_tokens=64, num_scheduler_steps=4,
                       async_scheduling=True, enable_multiprocessing=False,
                       structured_outputs_disable_any_whitespace=True)
    sps = [SamplingParams(max_tokens=100, temperature=1.0, seed=i,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA)) for i in range(8)]
    outs = small.generate([f"Animal number {i} is:" for i in range(8)], sps, use_tqdm=False)
    assert small.engine.stats.num_preemptions > 0
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)

    manager, runner = llm.engine.structured_outputs, llm.engine.runner
    fallbacks, calls = manager.num_fallbacks, runner.step_masks.num_calls
    monkeypatch.setattr(runner, "hold_dfa", lambda dfa: False)
    out = llm.generate("Pet:", sps[0], use_tqdm=False)[0].outputs[0]
    jsonschema.validate(json.loads(out.text), SCHEMA)
    assert manager.num_fallbacks == fallbacks + 1 and runner.step_masks.num_calls > calls

    monkeypatch.setattr(manager, "backend", "outlines")
    with pytest.raises(ValueError, match="backend 'outlines'"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True)), use_tqdm=False)
    assert llm.engine.get_num_unfinished_requests() == 0


def test_a_repeated_grammar_is_looked_up_not_validated_again(llm, monkeypatch):
    """A request repeating a grammar (equal content, a new dict) gets the cached future without llguidance's
    validation or the regex building on the engine's thread; another backend or schema is compiled anew."""
    manager = llm.engine.structured_outputs
    schema = dict(SCHEMA, title="seen once before this test")  # no other test compiled it
    first = manager.compile(StructuredOutputsParams(json=json.loads(json.dumps(schema))))
    monkeypatch.setattr(manager, "validate", lambda params: pytest.fail("validated again"))
    assert manager.compile(StructuredOutputsParams(json=json.loads(json.dumps(schema)))) is first
    assert manager.compile(StructuredOutputsParams(json=json.dumps(schema, sort_keys=True))) is first
    with pytest.raises(pytest.fail.Exception):
        manager.compile(StructuredOutputsParams(json=schema), backend="guidance")
