"""Per-request sampling and stopping parameters. vLLM: ``vllm/sampling_params.py``.

Names, defaults, ranges and semantics are vLLM's. What runs where:

* on the device, inside the jitted step, batched with per-row arrays (a request without a knob costs
  nothing; a batch without any compiles nothing new): temperature, top-k, top-p, min-p, the three
  penalties, ``logit_bias``, ``allowed_token_ids``, single-token ``bad_words``, ``min_tokens``, the seed,
  ``logprobs`` and ``prompt_logprobs``;
* in the engine's host loop: ``n`` (children that share the prompt's KV blocks), stop token ids, EOS,
  ``max_tokens``, multi-token ``bad_words`` (the banned last token of each sequence, per step);
* in the front end (``LLM``, the server's ``AsyncLLM``): stop strings, ``include_stop_str_in_output``,
  detokenization, ``truncate_prompt_tokens``, ``bad_words`` tokenization.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

# vLLM's clamp of a logit bias (the OpenAI API documents [-100, 100])
LOGIT_BIAS_LIMIT = 100.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM ``StructuredOutputsParams``; its OpenAI fields:
    ``response_format``, ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``). Exactly one
    of the fields is set.

    Attributes:
        json: a JSON schema (a dict or its JSON text): the output is a JSON value that validates.
        regex: the output matches this regular expression.
        choice: the output is one of these strings.
        grammar: an EBNF (GBNF) grammar the output follows.
        json_object: the output is some JSON object (``response_format={"type": "json_object"}``).

    Raises:
        ValueError: no field or more than one set, or an empty one.
    """

    json: Any = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self):
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        set_ = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(f"structured_outputs must set exactly one of json, regex, choice, grammar, "
                             f"json_object; got {set_ or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice={self.choice!r} must be non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name}={value!r} must be a non-empty string")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request samples and when it stops (vLLM ``SamplingParams``: names, defaults, ranges).

    Attributes:
        n: completions of the prompt; they share its KV blocks (the prompt is prefilled once).
        presence_penalty: subtracted once from the logit of every token already generated, in [-2, 2].
        frequency_penalty: subtracted from a token's logit per time it was generated, in [-2, 2].
        repetition_penalty: > 0; the logit of a token in the prompt or the output is divided by it when
            positive, multiplied when negative (1 = off).
        temperature: 0 = greedy; > 0 divides the logits.
        top_p: nucleus mass in ``(0, 1]`` (1 = off).
        top_k: keep the ``top_k`` most likely tokens; ``-1`` or ``0`` = off.
        min_p: drop tokens whose probability is below ``min_p`` times the most likely one's, in [0, 1].
        seed: the request's own PRNG seed; with it, its tokens do not depend on the rest of the batch.
            ``None``: the engine draws one. Completion ``i`` of ``n`` uses ``seed + i``.
        stop: strings that end the completion when it contains one; the text is cut before it unless
            ``include_stop_str_in_output``.
        stop_token_ids: generation ends when one of these is sampled; the token is the last of
            ``CompletionOutput.token_ids`` and its ``stop_reason`` (vLLM).
        bad_words: words that are never generated: each is tokenized (with and without a leading space)
            and the last token of a sequence is banned whenever the tokens before it were just generated.
        include_stop_str_in_output: keep the stop string in the text.
        ignore_eos: keep generating after the EOS token (throughput benchmarks).
        max_tokens: most tokens to generate (``None``: up to ``max_model_len``).
        min_tokens: EOS and ``stop_token_ids`` cannot be sampled before this many tokens.
        logprobs: per generated token, the log-probabilities of this many most likely tokens plus the
            sampled one (``CompletionOutput.logprobs``); ``None``: none; ``-1``: the whole vocabulary. They
            are the model's raw distribution, before temperature, penalties and masks (vLLM's default
            ``logprobs_mode="raw_logprobs"``).
        prompt_logprobs: per prompt token after the first, the same over the prompt
            (``RequestOutput.prompt_logprobs``, ``None`` first).
        detokenize, skip_special_tokens, spaces_between_special_tokens: how the text is decoded.
        truncate_prompt_tokens: keep only the last this many prompt tokens (``-1``: up to ``max_model_len``).
        logit_bias: ``{token_id: bias}`` added to the logits, each clamped to [-100, 100].
        allowed_token_ids: only these tokens may be generated.
        structured_outputs: a constraint on the text (:class:`StructuredOutputsParams`).
        bad_words_token_ids: ``bad_words`` as token-id sequences, filled by the front end's tokenizer
            (:meth:`with_bad_words_tokenized`; vLLM ``update_from_tokenizer``): the engine has no tokenizer.

    Raises:
        ValueError: naming the field and its value, for a value out of range.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    bad_words: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self):
        tup = lambda v: tuple(v) if v is not None else ()  # noqa: E731
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tup(self.stop))
        object.__setattr__(self, "bad_words", tup(self.bad_words))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(int(t) for t in self.allowed_token_ids))
        if self.logit_bias is not None:
            bias = {}
            for k, v in dict(self.logit_bias).items():
                try:
                    token, value = int(k), float(v)
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias={{{k!r}: {v!r}}}: keys must be token ids, values numbers") from None
                if not math.isfinite(value):
                    raise ValueError(f"logit_bias[{token}]={v!r} must be finite")
                bias[token] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, value))
            object.__setattr__(self, "logit_bias", bias or None)
        if self.bad_words_token_ids is not None:
            object.__setattr__(self, "bad_words_token_ids",
                               tuple(tuple(int(t) for t in seq) for seq in self.bad_words_token_ids))
        if isinstance(self.structured_outputs, dict):
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams(**self.structured_outputs))
        self._verify()

    def _verify(self) -> None:
        def check(ok: bool, name: str, rule: str):
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} {rule}")

        check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            check(-2.0 <= getattr(self, name) <= 2.0, name, "must be in [-2, 2]")
        check(self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty), "repetition_penalty",
              "must be > 0")
        check(self.temperature >= 0 and math.isfinite(self.temperature), "temperature", "must be >= 0")
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        check(self.top_k >= -1, "top_k", "must be -1 or 0 (off) or >= 1")
        check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        check(self.seed is None or 0 <= self.seed < 2 ** 63 - 2 ** 20, "seed", "must be in [0, 2**63)")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(all(isinstance(s, str) and s.strip() for s in self.bad_words), "bad_words", "must be non-empty strings")
        check(all(t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be non-negative token ids")
        check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be >= 1")
        check(self.min_tokens >= 0, "min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or (isinstance(value, int) and value >= -1), name, "must be None, -1 or >= 0")
        check(self.truncate_prompt_tokens is None or self.truncate_prompt_tokens == -1
              or self.truncate_prompt_tokens >= 1, "truncate_prompt_tokens", "must be -1 or >= 1")
        if self.logit_bias is not None:
            check(all(t >= 0 for t in self.logit_bias), "logit_bias", "keys must be non-negative token ids")
        if self.allowed_token_ids is not None:
            check(len(self.allowed_token_ids) > 0 and all(t >= 0 for t in self.allowed_token_ids),
                  "allowed_token_ids", "must be a non-empty list of non-negative token ids")
        check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "must be a StructuredOutputsParams")
        if self.bad_words_token_ids is not None:
            check(all(seq and all(t >= 0 for t in seq) for seq in self.bad_words_token_ids),
                  "bad_words_token_ids", "must be non-empty sequences of non-negative token ids")

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

    def with_bad_words_tokenized(self, tokenizer) -> "SamplingParams":
        """A copy whose ``bad_words_token_ids`` hold each bad word tokenized as it would appear at the start
        of the text and after a space (vLLM ``update_from_tokenizer``); ``self`` without bad words.

        Args:
            tokenizer: ``encode(text, add_special_tokens=False) -> list[int]``.
        """
        if not self.bad_words:
            return self
        seqs: list[tuple[int, ...]] = []
        for word in self.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(tokenizer.encode(text, add_special_tokens=False))
                if ids and ids not in seqs:
                    seqs.append(ids)
        return dataclasses.replace(self, bad_words_token_ids=tuple(seqs))


@dataclasses.dataclass(frozen=True, kw_only=True)
class BeamSearchParams:
    """Beam search settings (vLLM ``BeamSearchParams``, for :meth:`models.LLM.beam_search`).

    Attributes:
        beam_width: beams kept after each step.
        max_tokens: most tokens per beam.
        ignore_eos: keep extending beams past EOS.
        temperature: applied to the logprobs that rank the candidates (0: the model's own).
        length_penalty: a finished beam's score is ``cumulative_logprob / len ** length_penalty``.
        include_stop_str_in_output: keep the EOS text in the output.

    Raises:
        ValueError: ``beam_width`` or ``max_tokens`` < 1, ``temperature`` < 0.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        if self.beam_width < 1:
            raise ValueError(f"beam_width={self.beam_width} must be >= 1")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
