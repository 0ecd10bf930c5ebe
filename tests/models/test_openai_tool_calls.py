"""Tool calling: the hermes / llama3_json / mistral parsers on recorded model outputs (whole and streamed in
pieces), the JSON schema of tool_choice "required" / a named function, and the chat route with tools over
test_openai_features.py's fake engine (which writes a recorded output when the prompt names it).

The recorded outputs are the formats as the models write them (Qwen 2.5 / Hermes: ``<tool_call>`` blocks;
Llama 3.1+: ``<|python_tag|>`` JSON separated by ``;``; Mistral: ``[TOOL_CALLS]`` with a JSON array, and the
``name[ARGS]{...}`` form of its v11 tokenizers).
"""

from __future__ import annotations

import json
import random
import re

import httpx
import pytest

jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

from test_openai_features import MODEL, SCRIPTS, make_app, serve, sse_events  # noqa: E402

from models.entrypoints.openai.protocol import ChatCompletionRequest  # noqa: E402
from models.entrypoints.openai.tool_parsers import (  # noqa: E402
    TOOL_PARSERS,
    RequiredToolChoiceParser,
    ToolCallStreamer,
    tool_choice_json_schema,
)

WEATHER = {"city": "Paris", "unit": "celsius"}
RECORDED = {
    # (parser, model output): (content, [(name, arguments)])
    ("hermes", 'I will check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": '
               '"Europe/Paris"}}\n</tool_call>'):
        ("I will check both.\n", [("get_weather", WEATHER), ("get_time", {"timezone": "Europe/Paris"})]),
    ("hermes", '<tool_call>\n{"name": "search", "arguments": {"query": "caf\\u00e9 \\"best\\" {brace} ]", '
               '"filters": {"tags": ["a", "b"], "limit": 3, "exact": true, "near": null}}}\n</tool_call>'):
        (None, [("search", {"query": 'café "best" {brace} ]', "filters": {"tags": ["a", "b"], "limit": 3,
                                                                           "exact": True, "near": None}})]),
    ("hermes", "The capital of France is Paris."): ("The capital of France is Paris.", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'):  # cut by max_tokens
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "get_time", "parameters": {"timezone": "CET"}}'):
        (None, [("get_weather", WEATHER), ("get_time", {"timezone": "CET"})]),
    ("llama3_json", '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris", "unit": '
                    '"celsius"}}'): (None, [("get_weather", WEATHER)]),
    ("llama3_json", "Paris is the capital of France."): ("Paris is the capital of France.", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": {"timezone": "CET"}}]'):
        (None, [("get_weather", WEATHER), ("get_time", {"timezone": "CET"})]),
    ("mistral", 'Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
                '[TOOL_CALLS]get_time[ARGS]{"timezone": "CET"}'):
        ("Let me look.", [("get_weather", WEATHER), ("get_time", {"timezone": "CET"})]),
    ("mistral", "No tools needed [TOOL_CALL] here."): ("No tools needed [TOOL_CALL] here.", []),
}


def assemble(deltas):
    """What a client builds from streamed deltas: ``(content, [(id, name, arguments)])``."""
    content, calls = "", {}
    for text, tool_deltas in deltas:
        content += text or ""
        for d in tool_deltas:
            call = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in d:
                assert call["id"] is None and d["type"] == "function" and d["function"]["name"]
                call["id"], call["name"] = d["id"], d["function"]["name"]
            else:
                assert call["id"] is not None, "arguments before the call's first delta"
            call["arguments"] += d["function"].get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))
    return content, [(calls[i]["id"], calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]


def stream_in_pieces(parser_cls, text, sizes):
    """Feed ``text`` in pieces of the given sizes (the last piece marks the end)."""
    streamer = ToolCallStreamer(parser_cls())
    deltas, pos = [], 0
    for size in sizes:
        pos = min(len(text), pos + size)
        deltas.append(streamer.update(text[:pos], pos == len(text)))
        if pos == len(text):
            break
    return deltas


@pytest.mark.parametrize("key", list(RECORDED), ids=lambda k: f"{k[0]}:{k[1][:24]}")
def test_recorded_outputs_whole_and_streamed(key):
    name, text = key
    content, calls = RECORDED[key]
    parser = TOOL_PARSERS[name]
    got_content, got = parser().extract(text)
    assert got_content == content
    assert [(n, json.loads(a)) for _, n, a in got] == calls
    rng = random.Random(len(text))
    for sizes in ([1] * len(text), [rng.randint(1, 9) for _ in range(len(text))], [len(text)]):
        s_content, s_calls = assemble(stream_in_pieces(parser, text, sizes))
        if calls:  # streamed arguments join to exactly the non-streamed ones
            assert [(n, a) for _, n, a in s_calls] == [(n, a) for _, n, a in got]
            assert (s_content or None) == content
        else:  # an output without calls streams as content (one cut by max_tokens keeps what was sent)
            assert s_content == text if "<tool_call>" not in text else s_content == ""
    ids = [i for i, _, _ in got]
    assert len(set(ids)) == len(ids)
    if name == "mistral":
        assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
    else:
        assert all(i.startswith("chatcmpl-tool-") for i in ids)


def test_streaming_holds_back_what_may_become_a_marker():
    streamer = ToolCallStreamer(TOOL_PARSERS["hermes"]())
    assert streamer.update("Sure <tool", False) == ("Sure ", [])
    assert streamer.update("Sure <tools are fun", False) == ("<tools are fun", [])
    streamer = ToolCallStreamer(TOOL_PARSERS["hermes"]())
    streamer.update("a <tool_", False)
    assert streamer.update("a <tool_", True) == ("<tool_", [])  # the end releases it
    streamer = ToolCallStreamer(TOOL_PARSERS["llama3_json"]())
    assert streamer.update("<|pyth", False) == (None, [])  # undecided: tag or text
    content, deltas = streamer.update('<|python_tag|>{"name": "f", "parameters": {"a"', False)
    assert content is None and deltas == [{"index": 0, "id": deltas[0]["id"], "type": "function",
                                           "function": {"name": "f", "arguments": '{"a"'}}]
    assert streamer.update('<|python_tag|>{"name": "f", "parameters": {"a": 1}}', True)[1] == \
        [{"index": 0, "function": {"arguments": ": 1}"}}]
    # parallel_tool_calls false: one call streamed
    text = next(t for (p, t) in RECORDED if p == "mistral" and t.startswith("[TOOL_CALLS] ["))
    streamer = ToolCallStreamer(TOOL_PARSERS["mistral"](), max_calls=1)
    assert len(assemble([streamer.update(text, True)])[1]) == 1


def test_malformed_tool_json_falls_back_to_content():
    text = '<tool_call>\n{"name": "f", arguments: {}}\n</tool_call>'
    assert TOOL_PARSERS["hermes"]().extract(text) == (text, [])
    streamer = ToolCallStreamer(TOOL_PARSERS["hermes"]())
    assert streamer.update(text, True) == (None, [])  # nothing before the marker, nothing parseable after it
    streamer = ToolCallStreamer(TOOL_PARSERS["hermes"]())
    assert streamer.update("Hi " + text, True) == ("Hi ", [])  # the content before it still comes
    assert streamer.update("Hi " + text + " more", True) == (None, [])
    assert TOOL_PARSERS["llama3_json"]().extract('{"name": 3, "parameters": {}}')[1] == []


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
                                               "required": ["city"], "$defs": {"unit": {"enum": ["celsius",
                                                                                                 "fahrenheit"]}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}]


def _request(**kwargs) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                                                 **kwargs})


def test_tool_choice_schemas_accept_and_reject_what_they_should():
    req = _request(tool_choice="required")
    schema = tool_choice_json_schema(req.tools, "required")
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}},
          {"name": "get_time", "parameters": {"timezone": "CET"}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "kelvin"}}],
                [{"name": "launch", "parameters": {}}], [{"name": "get_time", "parameters": {}}], {"name": "x"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):  # parallel_tool_calls false: one call
        jsonschema.validate(ok, tool_choice_json_schema(req.tools, "required", parallel=False))
    named = _request(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert tool_choice_json_schema(named.tools, named.tool_choice) == TOOLS[1]["function"]["parameters"]
    # the required answer parses into the calls the schema allows
    _, calls = RequiredToolChoiceParser().extract(json.dumps(ok))
    assert [(n, json.loads(a)) for _, n, a in calls] == [(c["name"], c["parameters"]) for c in ok]


# ------------------------------------------------------------------------------------ the chat route

SCRIPTS.update({
    "hermes": next(t for (p, t) in RECORDED if p == "hermes").encode(),
    "llama": next(t for (p, t) in RECORDED if p == "llama3_json").encode(),
    "mistral": next(t for (p, t) in RECORDED if p == "mistral").encode(),
    "required": json.dumps([{"name": "get_weather", "parameters": WEATHER}]).encode(),
    "named": json.dumps({"timezone": "CET"}).encode(),
    "plain": b"Just text.",
})


@pytest.fixture(scope="module")
def servers():
    """``{parser or None: (base_url, engine)}``: a server per tool-call parser, and one without."""
    out, stack = {}, []
    for parser in (None, "hermes", "llama3_json", "mistral"):
        kwargs = {} if parser is None else dict(enable_auto_tool_choice=True, tool_call_parser=parser)
        app, engine = make_app(**kwargs)
        cm = serve(app)
        out[parser] = (cm.__enter__(), engine)
        stack.append(cm)
    yield out
    for cm in stack:
        cm.__exit__(None, None, None)


def _client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=20)


def _chat(base, script, **kwargs):
    return _client(base).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"@{script}@ what now?"}], tools=TOOLS,
        max_tokens=400, **kwargs)


@pytest.mark.parametrize("parser,script", [("hermes", "hermes"), ("llama3_json", "llama"), ("mistral", "mistral")])
def test_auto_tool_calls_plain_and_streamed(servers, parser, script):
    base, engine = servers[parser]
    key = next(k for k in RECORDED if k[0] == parser and k[1].encode() == SCRIPTS[script])
    content, calls = RECORDED[key]
    r = _chat(base, script)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == calls
    assert all(c.type == "function" and c.id for c in choice.message.tool_calls)
    assert engine.params[r.id].skip_special_tokens is (parser != "mistral")  # [TOOL_CALLS] is a special token
    # the tools reached the template
    assert f"<tools>{json.dumps(TOOLS)}</tools>".encode() in bytes(engine.prompts[r.id])
    chunks = list(_chat(base, script, stream=True))
    deltas = [(ch.choices[0].delta.content, [tc.model_dump(exclude_none=True) for tc in
                                             ch.choices[0].delta.tool_calls or ()]) for ch in chunks[1:]]
    s_content, s_calls = assemble(deltas)
    assert (s_content or None) == content
    assert [(n, a) for _, n, a in s_calls] == [(c.function.name, c.function.arguments)
                                               for c in choice.message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # no call in the output: content, finish_reason from the engine (the EOS text dropped for mistral)
    r = _chat(base, "plain")
    assert (r.choices[0].message.content, r.choices[0].message.tool_calls, r.choices[0].finish_reason) == \
        ("Just text.", [], "stop")
    chunks = list(_chat(base, "plain", stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "Just text."


def test_auto_needs_the_flags_and_tool_choice_none_is_content(servers):
    base, _ = servers[None]
    for kwargs in ({}, {"tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError) as e:
            _chat(base, "hermes", **kwargs)
        assert e.value.body["param"] == "tool_choice" and "--enable-auto-tool-choice" in e.value.message
    r = _chat(servers["hermes"][0], "hermes", tool_choice="none")
    assert r.choices[0].message.content == SCRIPTS["hermes"].decode() and r.choices[0].message.tool_calls == []
    assert r.choices[0].finish_reason == "stop"


def test_required_and_named_tool_choice(servers):
    base, engine = servers[None]
    r = _chat(base, "required", tool_choice="required")
    schema = engine.params[r.id].structured_outputs.json
    assert schema == tool_choice_json_schema(_request().tools, "required")
    jsonschema.validate(json.loads(SCRIPTS["required"]), schema)
    assert r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls] == \
        [("get_weather", WEATHER)]
    chunks = list(_chat(base, "required", tool_choice="required", stream=True))
    _, calls = assemble([(ch.choices[0].delta.content, [tc.model_dump(exclude_none=True)
                                                        for tc in ch.choices[0].delta.tool_calls or ()])
                         for ch in chunks[1:]])
    assert [(n, a) for _, n, a in calls] == [(c.function.name, c.function.arguments)
                                             for c in r.choices[0].message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    named = {"type": "function", "function": {"name": "get_time"}}
    r = _chat(base, "named", tool_choice=named)
    assert engine.params[r.id].structured_outputs.json == TOOLS[1]["function"]["parameters"]
    call = r.choices[0].message.tool_calls[0]
    assert (call.function.name, call.function.arguments, r.choices[0].finish_reason) == \
        ("get_time", SCRIPTS["named"].decode(), "stop")
    chunks = list(_chat(base, "named", tool_choice=named, stream=True))
    _, calls = assemble([(None, [tc.model_dump(exclude_none=True) for tc in ch.choices[0].delta.tool_calls or ()])
                         for ch in chunks[1:]])
    assert [(n, a) for _, n, a in calls] == [("get_time", SCRIPTS["named"].decode())]


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_requests_are_400(servers, body, param):
    r = httpx.post(servers["hermes"][0] + "/v1/chat/completions", timeout=10, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": TOOLS, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_tool_messages_and_parallel_tool_calls(servers):
    base, engine = servers["hermes"]
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "reasoning_content": "think", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
                {"role": "user", "content": "@hermes@ and now?"}]
    r = _client(base).chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=400,
                                              parallel_tool_calls=False)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    prompt = bytes(engine.prompts[r.id]).decode()
    assert '<assistant>(think)<call>get_weather{"city": "Paris"}</call></assistant><tool>18C<id>call_1</id></tool>' \
        in prompt
    events = sse_events(base, "/v1/chat/completions", {
        "model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 400, "parallel_tool_calls": False,
        "stream": True})
    indices = {tc["index"] for e in events for tc in e["choices"][0]["delta"].get("tool_calls", [])}
    assert indices == {0}
    # /tokenize renders tools the same way
    t = httpx.post(base + "/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    assert bytes(t["tokens"]).decode() == prompt


def test_tool_flags():
    from models.entrypoints.openai.cli_args import checked_server_flags, make_arg_parser

    p = make_arg_parser()
    args = p.parse_args(["--model", "m", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"])
    assert (args.enable_auto_tool_choice, args.tool_call_parser) == (True, "llama3_json")
    checked_server_flags(args)
    with pytest.raises(ValueError, match="--tool-call-parser"):
        checked_server_flags(p.parse_args(["--model", "m", "--enable-auto-tool-choice"]))
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "m", "--tool-call-parser", "nonsense"])
    with pytest.raises(ValueError, match="--tool-call-parser"):
        make_app(enable_auto_tool_choice=True)
