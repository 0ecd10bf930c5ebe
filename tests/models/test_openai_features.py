"""The OpenAI surface over a fake engine that honours n, logprobs and prompt logprobs (no model).

``LogprobEngine`` keeps ``LLMEngine``'s contract (``add_request`` / ``step`` -> ``RequestOutput`` s with one
``CompletionOutput`` per completion ``index``) and emits values a test can compute independently:

* completion ``c`` of a request emits the bytes of ``TEXT`` starting at offset ``4 * c`` (one byte-token per
  step), or a prompt's script (``@name`` in the prompt: ``SCRIPTS[name]`` then EOS);
* the sampled token at position ``j`` of completion ``c`` has logprob ``-(j + 1) / 8 - c / 64`` and rank
  ``k + 1`` (``k`` = the request's ``logprobs``); the top-``k`` tokens are the digits ``"0"``, ``"1"``, ...
  with logprob ``-(r + 1) / 128`` and rank ``r + 1`` (binary fractions: float32, the engine's wire type,
  holds them exactly);
* prompt token ``p >= 1`` has logprob ``-p / 4`` (rank ``k + 1``), with the same digits as the top ones.

Each test builds its expected JSON from these rules, and the official ``openai`` client parses the answers.
The server runs in-process (uvicorn in a thread), so each request costs milliseconds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections import deque

import httpx
import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from jaxkv.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from jaxkv.sampling_params import StructuredOutputsParams  # noqa: E402
from models.entrypoints.async_llm import AsyncLLM  # noqa: E402
from models.entrypoints.openai.api_server import build_app  # noqa: E402
from tests.conftest import serve  # noqa: E402

EOS = 0
MODEL = "fake-model"
MAX_MODEL_LEN = 2048
TEXT = b"The quick brown fox jumps over the lazy dog. "
SCRIPTS: dict[str, bytes] = {}  # filled by test_openai_tool_calls.py (recorded model outputs)
CHAT_TEMPLATE = ("{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
                 "{% for m in messages %}<{{ m.role }}>{% if m.reasoning_content %}({{ m.reasoning_content }}){% endif %}"
                 "{{ m.content }}"
                 "{% if m.tool_calls %}{% for c in m.tool_calls %}<call>{{ c.function.name }}"
                 "{{ c.function.arguments | tojson }}</call>{% endfor %}{% endif %}"
                 "{% if m.tool_call_id %}<id>{{ m.tool_call_id }}</id>{% endif %}</{{ m.role }}>{% endfor %}"
                 "{% if enable_thinking %}<think>{% endif %}{% if add_generation_prompt %}<assistant>{% endif %}")


class ByteTokenizer:
    """One token per UTF-8 byte; id 0 is EOS (special: skipped in text unless asked); ChatML-free template."""

    vocab_size = 256
    eos_token_id = EOS
    bos_token_id = None
    chat_template = CHAT_TEMPLATE
    generation_config: dict = {}

    def __init__(self):
        from models.tokenizer import compile_chat_template
        self._template = compile_chat_template(CHAT_TEMPLATE)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i != EOS or not skip_special_tokens).decode("utf-8", errors="replace")

    def id_to_token(self, token_id: int) -> str:
        return f"<0x{token_id:02X}>"

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True, tools=None, **kwargs) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                     **kwargs)


def sample_logprob(j: int, c: int) -> float:
    return -(j + 1) / 8 - c / 64


def alt_logprob(r: int) -> float:
    return -(r + 1) / 128


def _alts(k: int) -> dict[int, Logprob]:
    return {ord("0") + r: Logprob(alt_logprob(r), r + 1) for r in range(k)}


@dataclasses.dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: object
    tokens: list
    lps: list
    done: list
    script: bytes | None
    started: bool = False


class LogprobEngine:
    """``LLMEngine``'s contract with n, logprobs and prompt logprobs (module docstring)."""

    def __init__(self, step_s: float = 0.001, max_num_seqs: int = 8):
        self.step_s, self.max_num_seqs = step_s, max_num_seqs
        self.waiting: deque = deque()
        self.running: dict[str, _Req] = {}
        self.params: dict[str, object] = {}
        self.prompts: dict[str, list[int]] = {}
        self.aborted: list[str] = []
        self.lock = threading.Lock()

    def add_request(self, request_id, prompt_token_ids, sampling_params):
        if sampling_params.min_p == 0.75:  # what a real engine refuses (the request's field named first)
            raise ValueError(f"min_p={sampling_params.min_p} is not supported by this engine yet")
        prompt = list(prompt_token_ids)
        text = bytes(prompt)
        script = next((s for name, s in SCRIPTS.items() if f"@{name}@".encode() in text), None)
        n = sampling_params.n
        with self.lock:
            self.params[request_id] = sampling_params
            self.prompts[request_id] = prompt
            self.waiting.append(_Req(request_id, prompt, sampling_params, [[] for _ in range(n)],
                                     [[] for _ in range(n)], [False] * n, script))

    def abort_request(self, request_id):
        with self.lock:
            for rid in [request_id] if isinstance(request_id, str) else list(request_id):
                self.aborted.append(rid)
                if rid in self.running or any(r.rid == rid for r in self.waiting):
                    self.running.pop(rid, None)
                    self.waiting = deque(r for r in self.waiting if r.rid != rid)
                    continue
                index, _, parent = rid.partition("_")  # one completion of n: f"{index}_{parent}"
                if index.isdigit() and parent in self.running:
                    self.running[parent].done[int(index)] = True

    def has_unfinished_requests(self):
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self):
        return len(self.waiting) + len(self.running)

    @property
    def stats(self):
        return {"num_running": len(self.running), "num_waiting": len(self.waiting),
                "kv_cache_usage": len(self.running) / self.max_num_seqs, "num_preemptions": 3}

    def _token(self, req: _Req, c: int, j: int) -> int:
        if req.script is not None:
            return req.script[j] if j < len(req.script) else EOS
        return TEXT[(j + 4 * c) % len(TEXT)]

    def step(self):
        time.sleep(self.step_s)
        outputs = []
        with self.lock:
            while self.waiting and len(self.running) < self.max_num_seqs:
                r = self.waiting.popleft()
                self.running[r.rid] = r
            for rid, req in list(self.running.items()):
                p = req.params
                k = p.logprobs
                outs = []
                for c in range(p.n):
                    if req.done[c]:
                        continue
                    j = len(req.tokens[c])
                    tok = self._token(req, c, j)
                    req.tokens[c].append(tok)
                    if k is not None:
                        req.lps[c].append({tok: Logprob(sample_logprob(j, c), k + 1), **_alts(k)})
                    reason = stop_reason = None
                    if tok in p.stop_token_ids and len(req.tokens[c]) > p.min_tokens:
                        reason, stop_reason = "stop", None if tok == EOS else tok
                    elif len(req.tokens[c]) >= p.max_tokens or len(req.prompt) + len(req.tokens[c]) >= MAX_MODEL_LEN:
                        reason = "length"
                    req.done[c] = reason is not None
                    outs.append(CompletionOutput(index=c, token_ids=list(req.tokens[c]), new_token_ids=[tok],
                                                 finish_reason=reason, stop_reason=stop_reason,
                                                 logprobs=list(req.lps[c]) if k is not None else None))
                prompt_lp = None
                if not req.started and p.prompt_logprobs is not None:
                    kp = p.prompt_logprobs
                    prompt_lp = [None] + [{t: Logprob(-i / 4, kp + 1), **_alts(kp)}
                                          for i, t in enumerate(req.prompt) if i > 0]
                req.started = True
                if all(req.done):
                    del self.running[rid]
                if outs:
                    # the prompt logprobs ride with completion 0's first tokens only
                    outputs.append(RequestOutput(rid, req.prompt, outs[:1], all(req.done), prompt_logprobs=prompt_lp))
                    if outs[1:]:
                        outputs.append(RequestOutput(rid, req.prompt, outs[1:], all(req.done)))
        return outputs


def make_app(engine=None, **kwargs):
    engine = engine or LogprobEngine()
    tok = ByteTokenizer()
    app = build_app(AsyncLLM(engine, tok, log_stats_interval_s=None), tok, served_model_names=[MODEL],
                    max_model_len=MAX_MODEL_LEN, default_stop_token_ids=[EOS], **kwargs)
    return app, engine


@pytest.fixture(scope="module")
def server():
    app, engine = make_app()
    with serve(app) as base:
        yield base, engine


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=20)


def text_of(c: int, n: int) -> str:
    return bytes(TEXT[(j + 4 * c) % len(TEXT)] for j in range(n)).decode()


def expected_completion_logprobs(token_texts, token_lps, k, offset=0):
    """OpenAI's completions logprobs for tokens with the given logprobs (None: no Logprob)."""
    tops, offsets = [], []
    for t, lp in zip(token_texts, token_lps):
        tops.append(None if lp is None else {t: lp, **{str(r): alt_logprob(r) for r in range(k)}})
        offsets.append(offset)
        offset += len(t)
    return {"tokens": list(token_texts), "token_logprobs": list(token_lps), "top_logprobs": tops,
            "text_offset": offsets}


def as_dict(logprobs) -> dict:
    d = logprobs.model_dump() if hasattr(logprobs, "model_dump") else dict(logprobs)
    return {k: d[k] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}


def sse_events(base, path, body):
    """The JSON events of a streamed response (``[DONE]`` checked and dropped)."""
    with httpx.stream("POST", base + path, json=body, timeout=20) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ------------------------------------------------------------------------------------- completions

def test_completion_n_and_several_prompts_index_and_usage(client):
    r = client.completions.create(model=MODEL, prompt=["hi", "hey"], n=3, max_tokens=6)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [text_of(c, 6) for _ in range(2) for c in range(3)]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 36, 41)
    # best_of equal to n is accepted (vLLM V1); otherwise 400
    assert len(client.completions.create(model=MODEL, prompt="hi", n=2, max_tokens=2,
                                         extra_body={"best_of": 2}).choices) == 2
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", n=1, max_tokens=2, best_of=2)
    assert e.value.body["param"] == "best_of"


def test_completion_logprobs_match_the_engine(client):
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=5, logprobs=2)
    toks = list(text_of(0, 5))
    assert r.choices[0].text == "".join(toks)
    assert as_dict(r.choices[0].logprobs) == expected_completion_logprobs(
        toks, [sample_logprob(j, 0) for j in range(5)], 2)
    # n = 2: each choice has its completion's logprobs
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, logprobs=0, n=2)
    for c in (0, 1):
        toks = list(text_of(c, 3))
        assert as_dict(r.choices[c].logprobs) == expected_completion_logprobs(
            toks, [sample_logprob(j, c) for j in range(3)], 0)


def test_completion_echo_with_logprobs_and_the_loglikelihood_request(server, client):
    prompt = "hi you"
    p_toks = list(prompt)
    p_lps = [None] + [-i / 4 for i in range(1, len(prompt))]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logprobs=1, echo=True)
    g_toks = list(text_of(0, 3))
    assert r.choices[0].text == prompt + "".join(g_toks)
    assert as_dict(r.choices[0].logprobs) == expected_completion_logprobs(
        p_toks + g_toks, p_lps + [sample_logprob(j, 0) for j in range(3)], 1)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (6, 3)
    # lm-eval's loglikelihood request: echo, max_tokens 0 -> the prompt and its logprobs, nothing generated
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, logprobs=1, echo=True, temperature=0)
    assert r.choices[0].text == prompt
    assert as_dict(r.choices[0].logprobs) == expected_completion_logprobs(p_toks, p_lps, 1)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (6, 0)
    assert server[1].params[r.id + "-0"].max_tokens == 1  # vLLM: one token generated, then dropped
    # token-id prompts are echoed as their text; echo without logprobs has none
    r = client.completions.create(model=MODEL, prompt=[104, 105], max_tokens=2, echo=True)
    assert r.choices[0].text == "hi" + text_of(0, 2) and r.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError):  # max_tokens 0 only with echo
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)


def test_completion_prompt_logprobs_field(server):
    r = httpx.post(server[0] + "/v1/completions", timeout=10, json={
        "model": MODEL, "prompt": "abc", "max_tokens": 1, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    assert got == [None, {"98": {"logprob": -0.25, "rank": 2, "decoded_token": "b"},
                          "48": {"logprob": alt_logprob(0), "rank": 1, "decoded_token": "0"}},
                   {"99": {"logprob": -0.5, "rank": 2, "decoded_token": "c"},
                    "48": {"logprob": alt_logprob(0), "rank": 1, "decoded_token": "0"}}]
    r = httpx.post(server[0] + "/v1/completions", timeout=10, json={
        "model": MODEL, "prompt": "abc", "max_tokens": 1, "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_completion_stream_with_n_logprobs_and_echo_equals_the_full_answer(server, client):
    body = {"model": MODEL, "prompt": "hi you", "max_tokens": 7, "n": 2, "logprobs": 2, "echo": True,
            "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(server[0], "/v1/completions", body)
    full = client.completions.create(**{k: v for k, v in body.items() if k not in ("stream", "stream_options")})
    for c in (0, 1):
        chunks = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == c]
        assert "".join(ch["text"] for ch in chunks) == full.choices[c].text
        merged = {k: sum((ch["logprobs"][k] for ch in chunks), []) for k in
                  ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        assert merged == as_dict(full.choices[c].logprobs)
        assert chunks[-1]["finish_reason"] == "length" and chunks[0]["text"].startswith("hi you")
    assert events[-1]["usage"] == {"prompt_tokens": 6, "completion_tokens": 14, "total_tokens": 20}
    # the official client parses the same stream
    chunks = list(client.completions.create(**body))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == 1) == \
        full.choices[1].text


def test_completion_sampling_fields_reach_the_engine(server, client):
    r = client.completions.create(
        model=MODEL, prompt="abcdef", max_tokens=2, presence_penalty=0.5, frequency_penalty=-0.25, seed=7,
        temperature=0.5, top_p=0.9, logit_bias={"65": 5, "66": -200}, user="someone",
        extra_body={"repetition_penalty": 1.2, "min_p": 0.1, "top_k": 5, "allowed_token_ids": [65, 66, 84],
                    "bad_words": ["fox"], "include_stop_str_in_output": True, "truncate_prompt_tokens": 3,
                    "min_tokens": 1, "stop_token_ids": [7]})
    p = server[1].params[r.id + "-0"]
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p, p.top_k, p.seed) == \
        (0.5, -0.25, 1.2, 0.1, 5, 7)
    assert (p.temperature, p.top_p, p.include_stop_str_in_output, p.min_tokens) == (0.5, 0.9, True, 1)
    assert p.logit_bias == {65: 5.0, 66: -100.0} and p.allowed_token_ids == (65, 66, 84)
    assert p.bad_words == ("fox",) and (tuple(b"fox") in p.bad_words_token_ids)
    assert p.stop_token_ids == (7, EOS) and p.truncate_prompt_tokens == 3
    assert server[1].prompts[r.id + "-0"] == list(b"def") and r.usage.prompt_tokens == 3
    # defaults: nothing set
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=1)
    p = server[1].params[r.id + "-0"]
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p, p.n, p.logprobs) == \
        (0.0, 0.0, 1.0, 0.0, 1, None)
    assert p.logit_bias is None and p.structured_outputs is None and p.prompt_logprobs is None


@pytest.mark.parametrize("extra,param", [
    ({"logit_bias": {"999": 1}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"allowed_token_ids": [300]}, "allowed_token_ids"), ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"bad_words": [" "]}, "bad_words"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"), ({"n": 2, "best_of": 3}, "best_of"),
    ({"use_beam_search": True}, "use_beam_search"), ({"priority": 1}, "priority"),
    ({"logprob_token_ids": [1]}, "logprob_token_ids"), ({"guided_decoding_backend": "xgrammar"},
                                                         "guided_decoding_backend"),
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}, "stream": True},
     "stream_options.continuous_usage_stats"),
    ({"n": 300}, "n"),
])
def test_bad_sampling_fields_are_400_naming_the_field(server, extra, param):
    r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra},
                   timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param.split(".")[-1] in err["message"], err


def test_engine_refusals_are_400_naming_the_field(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "min_p": 0.75}
    r = httpx.post(server[0] + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_p", r.text
    assert r.json()["error"]["code"] == "unsupported_parameter" and "not supported" in r.json()["error"]["message"]
    events = sse_events(server[0], "/v1/completions", dict(body, stream=True))  # the stream has started
    assert events[-1]["error"]["param"] == "min_p"


def test_no_op_values_of_unimplemented_fields_and_unknown_fields(server, caplog):
    with caplog.at_level(logging.WARNING, logger="jaxkv.serve"):
        r = httpx.post(server[0] + "/v1/completions", timeout=10, json={
            "model": MODEL, "prompt": "hi", "max_tokens": 2, "use_beam_search": False, "priority": 0,
            "length_penalty": 1.0, "my_custom_knob": 3, "another": "x"})
    assert r.status_code == 200, r.text
    warned = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert len(warned) == 1 and "my_custom_knob" in warned[0] and "another" in warned[0]
    assert "priority" not in warned[0]


# --------------------------------------------------------------------------------- structured outputs

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize("extra,expected", [
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputsParams(json=SCHEMA)),
    ({"guided_regex": "[a-z]+"}, StructuredOutputsParams(regex="[a-z]+")),
    ({"guided_choice": ["yes", "no"]}, StructuredOutputsParams(choice=("yes", "no"))),
    ({"guided_grammar": "root ::= \"a\""}, StructuredOutputsParams(grammar="root ::= \"a\"")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutputsParams(choice=("a", "b"))),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA)),
])
def test_structured_outputs_reach_the_engine(server, extra, expected):
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = httpx.post(server[0] + path, json={"model": MODEL, "max_tokens": 2, **body, **extra}, timeout=10)
        assert r.status_code == 200, r.text
        rid = r.json()["id"] + ("-0" if path == "/v1/completions" else "")
        assert server[1].params[rid].structured_outputs == expected


@pytest.mark.parametrize("extra,param", [
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_json": "{not json"}, "guided_json"), ({"guided_json": [1]}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structural_tag"),
])
def test_bad_or_conflicting_structured_outputs_are_400(server, extra, param):
    r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra},
                   timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---------------------------------------------------------------------------------------------- chat

def test_chat_n_logprobs_and_usage(server, client):
    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, n=2, logprobs=True,
                                       top_logprobs=2)
    prompt = "<user>hi</user><assistant>"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), 8)
    for c in (0, 1):
        choice = r.choices[c]
        assert choice.index == c and choice.message.content == text_of(c, 4) and choice.finish_reason == "length"
        want = [{"token": t, "logprob": sample_logprob(j, c), "bytes": list(t.encode()),
                 "top_logprobs": [{"token": str(q), "logprob": alt_logprob(q), "bytes": list(str(q).encode())}
                                  for q in range(2)]} for j, t in enumerate(text_of(c, 4))]
        assert [x.model_dump() for x in choice.logprobs.content] == want
    p = server[1].params[r.id]
    assert p.n == 2 and p.logprobs == 2
    # logprobs without top_logprobs: the sampled tokens only
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, logprobs=True)
    assert [x.top_logprobs for x in r.choices[0].logprobs.content] == [[], []]
    assert server[1].params[r.id].logprobs == 0
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, top_logprobs=2)
    assert e.value.body["param"] == "top_logprobs"


def test_chat_stream_with_n_and_logprobs_equals_the_full_answer(server, client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "n": 2,
            "logprobs": True, "top_logprobs": 1, "stream": True, "stream_options": {"include_usage": True}}
    events = sse_events(server[0], "/v1/chat/completions", body)
    full = client.chat.completions.create(**{k: v for k, v in body.items() if k not in ("stream", "stream_options")})
    for c in (0, 1):
        chunks = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["index"] == c]
        assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(ch["delta"].get("content") or "" for ch in chunks) == full.choices[c].message.content
        lps = sum((ch["logprobs"]["content"] for ch in chunks if ch["logprobs"]), [])
        assert lps == [x.model_dump() for x in full.choices[c].logprobs.content]
        assert chunks[-1]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 10
    chunks = list(client.chat.completions.create(**body))  # the official client parses it
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_chat_echo_continue_final_message_and_template_kwargs(server, client):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3,
                                       extra_body={"echo": True, "add_generation_prompt": False,
                                                   "continue_final_message": True})
    assert r.choices[0].message.content == "Sure, " + text_of(0, 3)
    assert server[1].prompts[r.id] == list(b"<user>hi</user><assistant>Sure, ")
    events = sse_events(server[0], "/v1/chat/completions", {
        "model": MODEL, "messages": msgs, "max_tokens": 3, "echo": True, "add_generation_prompt": False,
        "stream": True})
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0]["role"] == "assistant" and deltas[1] == {"content": "Sure, "}
    assert "".join(d.get("content") or "" for d in deltas) == "Sure, " + text_of(0, 3)
    # echo with a generation prompt: the last message is the user's, not the response role's: nothing echoed
    r = client.chat.completions.create(model=MODEL, messages=msgs[:1], max_tokens=2, extra_body={"echo": True})
    assert r.choices[0].message.content == text_of(0, 2)
    r = client.chat.completions.create(model=MODEL, messages=msgs[:1], max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert server[1].prompts[r.id] == list(b"<user>hi</user><think><assistant>")
    for extra, param in (({"continue_final_message": True}, "continue_final_message"), ({"n": 257}, "n"),
                         ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                         ({"chat_template": "{{ 1 }}"}, "chat_template")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, extra_body=extra)
        assert e.value.body["param"] == param


def test_chat_prompt_logprobs_field(server):
    r = httpx.post(server[0] + "/v1/chat/completions", timeout=10, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "prompt_logprobs": 0})
    got = r.json()["prompt_logprobs"]
    prompt = "<user>x</user><assistant>"
    assert len(got) == len(prompt) and got[0] is None
    assert got[3] == {str(ord(prompt[3])): {"logprob": -0.75, "rank": 1, "decoded_token": prompt[3]}}


# -------------------------------------------------------------------------------- the other routes

def test_tokenize_detokenize_version_ping(server):
    base = server[0]
    r = httpx.post(base + "/tokenize", json={"model": MODEL, "prompt": "hé", "return_token_strs": True})
    assert r.json() == {"count": 3, "max_model_len": MAX_MODEL_LEN, "tokens": list("hé".encode()),
                        "token_strs": ["<0x68>", "<0xC3>", "<0xA9>"]}
    r = httpx.post(base + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.json()["tokens"] == list(b"<user>hi</user><assistant>") and r.json()["token_strs"] is None
    r = httpx.post(base + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}],
                                             "add_generation_prompt": False,
                                             "chat_template_kwargs": {"enable_thinking": True}})
    assert bytes(r.json()["tokens"]) == b"<user>hi</user><think>"
    assert httpx.post(base + "/detokenize", json={"tokens": list("hé".encode())}).json() == {"prompt": "hé"}
    r = httpx.post(base + "/detokenize", json={"tokens": [1, 256]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert httpx.post(base + "/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404
    assert httpx.post(base + "/tokenize", json={"prompt": 5}).json()["error"]["param"] == "prompt"
    assert isinstance(httpx.get(base + "/version").json()["version"], str)
    assert httpx.get(base + "/ping").status_code == 200 and httpx.post(base + "/ping").status_code == 200


def test_404_and_405_are_openai_errors(server):
    base = server[0]
    r = httpx.get(base + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(base + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert "POST" in r.headers["allow"]
    r = httpx.delete(base + "/tokenize")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_request_id_field_names_the_response(client):
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={"request_id": "abc-1"})
    assert r.id == "cmpl-abc-1"
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                       extra_body={"request_id": "abc-2"})
    assert r.id == "chatcmpl-abc-2"
