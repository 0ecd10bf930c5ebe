"""The front end's half of a request's outputs: detokenization, stop strings, logprobs with their tokens'
text, ``n`` completions. vLLM: ``v1/engine/output_processor.py``.

Shared by the server's :class:`models.entrypoints.async_llm.AsyncLLM` (per step, streamed) and the offline
:class:`models.entrypoints.llm.LLM`, so both count tokens and cut text the same way: a stop token or EOS that
ended a completion is its last token (its text is not in ``text``), a stop string ends it at the token that
completed it (tokens the engine generated after that are not the completion's).
"""

from __future__ import annotations

from jaxkv.engine.protocol import EngineCoreOutput, LogprobsLists
from jaxkv.outputs import FlatLogprobs, Logprob
from jaxkv.sampling_params import SamplingParams
from models.entrypoints.detokenizer import IncrementalDetokenizer, StopChecker


def truncate_prompt(prompt_token_ids: list[int], truncate_prompt_tokens: int | None,
                    max_model_len: int | None = None) -> list[int]:
    """The last ``truncate_prompt_tokens`` prompt tokens (vLLM's left truncation; ``-1``: the last
    ``max_model_len``); the prompt itself when ``None`` or when it is no longer."""
    if truncate_prompt_tokens is None:
        return prompt_token_ids
    keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    return prompt_token_ids if keep is None or len(prompt_token_ids) <= keep else prompt_token_ids[-keep:]


class TokenTexts(dict):
    """``{token_id: text}`` of one tokenizer (``Logprob.decoded_token``), filled on first use: logprobs name
    ``1 + k`` tokens per generated token, mostly the same few thousand, so a hit is one dict lookup."""

    def __init__(self, tokenizer):
        super().__init__()
        self.tokenizer = tokenizer

    def __missing__(self, token_id: int) -> str:
        text = self[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


_TOKEN_TEXTS: dict[int, TokenTexts] = {}  # id(tokenizer) -> its texts (the entry keeps the tokenizer alive)


def token_texts(tokenizer) -> TokenTexts:
    """The shared :class:`TokenTexts` of ``tokenizer``."""
    texts = _TOKEN_TEXTS.get(id(tokenizer))
    if texts is None or texts.tokenizer is not tokenizer:
        texts = _TOKEN_TEXTS[id(tokenizer)] = TokenTexts(tokenizer)
    return texts


def token_text(tokenizer, token_id: int) -> str:
    """One token's text, cached per tokenizer (:func:`token_texts`)."""
    return token_texts(tokenizer)[token_id]


def logprob_dicts(lists: LogprobsLists, texts: TokenTexts) -> list[dict[int, Logprob]]:
    """:class:`LogprobsLists` as vLLM's ``{token_id: Logprob}`` per position, ``decoded_token`` from
    ``texts`` (:func:`token_texts`); the chosen token first, then the top ones by rank."""
    return list(FlatLogprobs(lists.token_ids, lists.logprobs, lists.ranks, texts))


class CompletionState:
    """Detokenizer, stop strings and logprobs of one completion (``index`` of the request's ``n``).

    Attributes:
        detok: its tokens (``detok.token_ids``: what ``usage`` counts) and text.
        logprobs: with ``SamplingParams.logprobs``, one dict per token (``decoded_token`` filled), a
            :class:`jaxkv.outputs.FlatLogprobs` (the dicts are built when read).
        cumulative: the sum of the sampled tokens' logprobs.
        finished: it ended (engine, stop string or abort).
    """

    def __init__(self, index: int, tokenizer, params: SamplingParams):
        self.index = index
        self.tokenizer = tokenizer
        self.texts = token_texts(tokenizer)
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)
        self.detokenize = params.detokenize
        self.stops = StopChecker(params.stop)
        self.include_stop = params.include_stop_str_in_output
        self.want_logprobs = params.logprobs is not None
        self.logprobs = FlatLogprobs(texts=self.texts) if self.want_logprobs else None
        self.cumulative = 0.0 if self.want_logprobs else None
        self.finished = False
        self.stopped_by_string = False
        self.stop_token: int | None = None  # the engine's stop token / EOS: in token_ids, not in the text

    def add(self, out: EngineCoreOutput) -> tuple[str, bool, str | None, int | str | None]:
        """Fold one step's tokens in; returns ``(text, finished, finish_reason, stop_reason)``.

        A completion the engine ended on a stop token or EOS keeps the token in ``token_ids`` but not its text
        (unless ``include_stop_str_in_output``), as vLLM's detokenizer does."""
        finished = out.finish_reason is not None
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        new = list(out.new_token_ids)
        if finish_reason == "stop" and new and not self.include_stop:  # ended by a stop token or EOS
            self.stop_token = new[-1]
        new_lp = (FlatLogprobs(out.new_logprobs.token_ids, out.new_logprobs.logprobs, out.new_logprobs.ranks)
                  if self.want_logprobs and out.new_logprobs is not None else None)
        hit = None
        texted = new[:-1] if self.stop_token is not None else new  # tokens whose text the completion shows
        if self.stops.stop:  # a token at a time: the stop string's token is the completion's last
            for k, token in enumerate(texted):
                self.detok.add_tokens([token], finished=finished and k == len(texted) - 1)
                hit = self.stops.check(self.detok.text)
                if hit is not None:
                    new, new_lp = new[:k + 1], None if new_lp is None else new_lp[:k + 1]
                    break
        else:
            self.detok.add_tokens(texted, finished=finished)
        if self.stop_token is not None and hit is None:
            self.detok.add_tokens([], finished=True)  # flush what a broken character held back
            self.detok.token_ids.append(new[-1])
        if new_lp is not None:
            self.logprobs.extend_rows(new_lp.token_ids, new_lp.logprobs, new_lp.ranks)
            self.cumulative += new_lp.chosen_logprob_sum()
        text = self.detok.text if self.detokenize else ""
        if hit is not None:
            at, stop = hit
            text = text[:at + len(stop)] if self.include_stop else text[:at]
            finished, finish_reason, stop_reason = True, "stop", stop
            self.stopped_by_string = True
        text = text[:self.stops.safe_len(text, finished)]
        self.finished = finished
        return text, finished, finish_reason, stop_reason
