"""Token automata for structured outputs (jaxkv.core.grammar_dfa): the regexes against Python's ``re``, the packed
tables against outlines-core's own ``Index`` walk, the device lookups against a loop over the host tables, and the
device tables' placement (full, released, compacted)."""

from __future__ import annotations

import gc
import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.core import grammar_dfa as gd
from jaxkv.sampling_params import StructuredOutputsParams as SOP

outlines_core = pytest.importorskip("outlines_core")

# a small vocabulary: single characters, some longer pieces, EOS = 0
PIECES = [c.encode() for c in '0123456789abcdefghijklmnopqrstuvwxyz-{}[]":, '] + [
    b"ab", b"12", b'":', b'{"', b"yes", b"no", b"may", b"be", b" so", b"true", b"false", b"null", b'", "']
VOCAB = 1 + len(PIECES)
EOS = 0


def index(regex: str):
    vocab = outlines_core.Vocabulary(EOS, {p: [i + 1] for i, p in enumerate(PIECES)})
    return outlines_core.Index(regex, vocab)


def dfa_of(regex: str) -> gd.TokenDFA:
    idx = index(regex)
    return gd.tables_from_transitions(idx.get_transitions(), idx.get_initial_state(), idx.get_final_states(),
                                      VOCAB, [EOS], regex)


def test_regexes_of_choices_and_schemas():
    choices = ["yes", "no", "maybe so", "a.b (c)", "x|y"]
    rx = gd.dfa_regex(SOP(choice=choices))
    assert all(re.fullmatch(rx, c) for c in choices) and not re.fullmatch(rx, "a b (c)") and not re.fullmatch(rx, "x")
    assert gd.dfa_regex(SOP(regex=r"[0-9]+")) == r"[0-9]+"
    assert gd.dfa_regex(SOP(json_object=True)) is None and gd.dfa_regex(SOP(grammar='start: "a"')) is None
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "exclusiveMaximum": 7}},
              "required": ["n"]}
    rx = gd.dfa_regex(SOP(json=schema), any_whitespace=False)
    assert [n for n in range(-2, 12) if re.fullmatch(rx, json.dumps({"n": n}, separators=(",", ":")))] == [3, 4, 5, 6]
    halves = {"type": "integer", "exclusiveMinimum": 2.5, "maximum": 6.5}  # 3..6, as jsonschema counts them
    rx = gd.dfa_regex(SOP(json=halves), any_whitespace=False)
    assert [n for n in range(-2, 12) if re.fullmatch(rx, str(n))] == [3, 4, 5, 6]
    for unsupported in ({"type": "integer", "minimum": 0}, {"type": "string", "pattern": "a+"},
                        {"type": "object", "properties": {"a": {"$ref": "#"}}}, {"oneOf": [{"type": "null"}]},
                        {"type": ["string", "null"]}, {"type": "integer", "minimum": 0, "maximum": 10**6},
                        {"type": "integer", "minimum": "0", "maximum": 3},
                        {"type": "object", "properties": {}, "required": ["a"]}):
        assert gd.dfa_regex(SOP(json=unsupported)) is None, unsupported


@pytest.mark.parametrize("regex", [r"[0-9]{2,3}-[a-z]{1,4}", r"(yes|no|maybe so)", r'\{"a":(true|false|null)\}'])
def test_tables_follow_outlines_index(regex):
    """Every state on 40 random walks: the packed row allows exactly ``Index.get_allowed_tokens`` (EOS aside,
    final states marked) and ``step`` is ``Index.get_next_state``."""
    idx, dfa = index(regex), dfa_of(regex)
    ids = sorted(set(idx.get_transitions()) | set(idx.get_final_states()) | {idx.get_initial_state()})
    rng = np.random.default_rng(0)
    for _ in range(40):
        s = idx.get_initial_state()
        while True:
            local = ids.index(s)
            allowed = sorted(set(idx.get_allowed_tokens(s)) - {EOS})
            bits = np.unpackbits(dfa.allowed(local).view(np.uint8), bitorder="little")[:VOCAB]
            assert np.nonzero(bits)[0].tolist() == allowed
            assert bool(dfa.final[local]) == idx.is_final_state(s)
            if not allowed:
                break
            t = int(rng.choice(allowed))
            assert ids[dfa.step(local, t)] == idx.get_next_state(s, t)
            s = idx.get_next_state(s, t)
        assert dfa.is_complete(local)


def test_device_lookups_against_the_host_tables():
    """Two automata placed in one table: for random global states and tokens, ``dfa_bitmask`` is the host row (plus
    EOS where final; all ones in state 0) and ``dfa_advance`` the host ``step`` (staying on EOS, -1 and a token the
    state does not allow)."""
    a, b = dfa_of(r"[0-9]{2,3}-[a-z]{1,4}"), dfa_of(r"(yes|no|maybe so)")
    tables = gd.DFATables(-(-VOCAB // 32), [EOS], max_states=64, max_transitions=4096)
    assert tables.hold(a) and tables.hold(b)
    rng = np.random.default_rng(1)
    glob, toks, want_mask, want_next = [0], [5], [np.full(tables.words, -1, np.int32)], [0]
    for dfa in (a, b):
        off = tables.offset(dfa)
        for s in range(dfa.num_states):
            for t in rng.choice(VOCAB, 6).tolist() + [EOS, -1]:
                row = dfa.allowed(s).copy()
                if dfa.final[s]:
                    row[EOS // 32] |= 1 << (EOS % 32)
                nxt = dfa.step(s, t) if t > 0 else -1
                glob.append(off + s)
                toks.append(t)
                want_mask.append(row)
                want_next.append(off + s if nxt < 0 else off + nxt)
    arrays = tables.arrays
    mask = np.asarray(gd.dfa_bitmask(arrays, jnp.asarray(glob, jnp.int32)))
    nxt = np.asarray(gd.dfa_advance(arrays, jnp.asarray(glob, jnp.int32), jnp.asarray(toks, jnp.int32)))
    np.testing.assert_array_equal(mask, np.stack(want_mask))
    np.testing.assert_array_equal(nxt, want_next)


def test_tables_full_release_and_compaction():
    a, b, c = dfa_of(r"[0-9]{2,3}-[a-z]{1,4}"), dfa_of(r"(yes|no|maybe so)"), dfa_of(r"[a-f]{1,3}")
    room = a.num_states + b.num_states + 1  # state 0 is reserved: a and b fit, c does not beside them
    tables = gd.DFATables(-(-VOCAB // 32), [EOS], max_states=room, max_transitions=4096)
    assert tables.hold(a) and tables.hold(b) and not tables.hold(c)
    assert tables.num_held == 2
    tables.release(a)  # a stays cached until its room is needed
    assert tables.num_held == 1 and tables.hold(c)  # compaction: a dropped, b moved to the front
    assert tables.offset(b) == 1
    arrays = {k: np.asarray(v) for k, v in tables.arrays.items()}
    for dfa in (b, c):
        o = tables.offset(dfa)
        np.testing.assert_array_equal(arrays["bits"][o:o + dfa.num_states], dfa.bits)
        np.testing.assert_array_equal(arrays["final"][o:o + dfa.num_states], dfa.final)


def test_tables_free_their_device_memory_and_place_again():
    a = dfa_of(r"[0-9]{2,3}-[a-z]{1,4}")
    tables = gd.DFATables(-(-VOCAB // 32), [EOS], max_states=64, max_transitions=4096)
    assert tables.hold(a)
    with pytest.raises(ValueError, match="1 automata are still held"):
        tables.free()
    tables.release(a)
    old = list(tables.arrays.values())
    tables.free()  # LLM.sleep: no request runs
    assert all(x.is_deleted() for x in old) and not tables.is_placed(a)
    assert tables.hold(a) and tables.offset(a) == 1
    o = tables.offset(a)
    np.testing.assert_array_equal(np.asarray(tables.arrays["bits"])[o:o + a.num_states], a.bits)


def test_grammar_accept_names_the_token_it_refuses():
    g = gd.DFAGrammar(dfa_of(r"[0-9]{2}"), [EOS])
    assert g.accept([PIECES.index(b"1") + 1, PIECES.index(b"2") + 1]) and g.is_terminated
    assert g.accept([EOS])  # EOS ends a complete text
    g = gd.DFAGrammar(dfa_of(r"[0-9]{2}"), [EOS])
    assert not g.accept([PIECES.index(b"a") + 1]) and "token" in g.error and g.num_consumed == 1


def test_compiler_process_gives_the_same_tables():
    """The worker process (``python -m jaxkv.core.grammar_dfa``) compiles what the in-process path builds; a
    regex over the size limits comes back as the reason; the worker ends with its compiler."""

    class Tok:  # the two llguidance tokenizer calls token_bytes makes
        vocab_size = VOCAB

        @staticmethod
        def is_special_token(i):
            return i == EOS

        @staticmethod
        def decode_bytes(ids):
            return PIECES[ids[0] - 1]
    compiler = gd.DFACompiler(Tok(), VOCAB, [EOS], max_states=50, max_transitions=10**5)
    try:
        got = compiler.compile(r"[0-9]{2,3}-[a-z]{1,4}").result(timeout=60)
        want = dfa_of(r"[0-9]{2,3}-[a-z]{1,4}")
        for k in ("bits", "prefix", "base", "final", "next"):
            np.testing.assert_array_equal(getattr(got, k), getattr(want, k))
        assert "exceed" in compiler.compile(r"[a-z]{0,60}").result(timeout=60)
    finally:
        proc = compiler._proc
        del compiler  # dropped without shutdown(): its worker ends too (weakref.finalize)
        gc.collect()
    assert proc.wait(timeout=10) == 0


def test_every_complete_walk_validates():
    """Random walks through automata of JSON schemas (nested objects, enums, bounded integers, arrays, anyOf, a
    tool_choice="required" schema), over a vocabulary of single ASCII characters: every text the automaton
    completes parses and validates (``jsonschema``), with and without free whitespace."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("pydantic")
    from models.benchmarks.serving import BENCH_SCHEMA
    from models.entrypoints.openai.protocol import ChatCompletionRequest
    from models.entrypoints.openai.tool_parsers import tool_choice_json_schema
    from tests.models.test_structured_outputs import SCHEMA

    chars = [bytes([c]) for c in range(32, 127)] + [b"\n"]
    vocab = outlines_core.Vocabulary(0, {c: [i + 1] for i, c in enumerate(chars)})
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {
            "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 8}},
            "required": ["timezone"]}}}]
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                                    "tool_choice": "required"})
    required = tool_choice_json_schema(request.tools, "required")
    rng = np.random.default_rng(2)
    for schema in (SCHEMA, BENCH_SCHEMA, required, {"anyOf": [{"type": "null"}, {"type": "number"}]}):
        for any_ws in (False, True):
            rx = gd.dfa_regex(SOP(json=schema), any_whitespace=any_ws)
            assert rx is not None, schema
            idx = outlines_core.Index(rx, vocab)
            dfa = gd.tables_from_transitions(idx.get_transitions(), idx.get_initial_state(), idx.get_final_states(),
                                             len(chars) + 1, [0], rx)
            done = 0
            for _ in range(30):
                s, text = dfa.initial, b""
                for _ in range(600):
                    allowed = np.nonzero(np.unpackbits(dfa.allowed(s).view(np.uint8), bitorder="little"))[0]
                    if dfa.final[s] and (not allowed.size or rng.random() < 0.3):
                        jsonschema.validate(json.loads(text), schema)
                        done += 1
                        break
                    t = int(rng.choice(allowed))
                    text += chars[t - 1]
                    s = dfa.step(s, t)
            assert done >= 10, (schema, done)
