"""Tokenizers rebuilt from a GGUF file's metadata (no ``transformers``).

Two kinds, after llama.cpp's ``tokenizer.ggml.model``:

* ``gpt2``: byte-level BPE (SmolLM2): vocabulary + merges;
* ``llama``: SentencePiece BPE (Gemma 3): vocabulary + scores, no merges. Pieces are merged by score,
  as SentencePiece and llama.cpp's SPM tokenizer do; here the merges are derived from the scores (for a
  piece, every split into two vocabulary pieces is a merge ranked by the piece's score, HF's
  ``SentencePieceExtractor`` rule) and run by a ``tokenizers`` BPE model with byte fallback (``<0xNN>``
  tokens), after replacing spaces with ``▁`` (no dummy prefix when ``add_space_prefix`` is false).

The vocabulary, token types and chat template live in the GGUF's ``tokenizer.*`` fields; this module
turns them into a ``tokenizers.Tokenizer`` and renders the chat template with a sandboxed Jinja
environment. A GGUF without a chat template gets ChatML, or Gemma's template for ``gemma3``.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping, Sequence

import gguf
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

from models.gguf_loader import read_gguf_metadata

# llama.cpp's ``tokenizer.ggml.token_type`` values.
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_USER_DEFINED, _TOKEN_BYTE = 1, 3, 4, 6
_SPM_SPACE = "\u2581"  # SentencePiece's "▁"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# Gemma's chat template (Gemma 3 model card): a system message is folded into the first user turn, the
# assistant role is called "model"; the BOS token is part of the rendered text.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def _spm_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]
                ) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-driven merging: ``(left, right)`` for every normal
    piece that splits into two vocabulary pieces, ordered by the piece's score (highest first), then by
    the parts' ids (HF ``SentencePieceExtractor``)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, (piece, ty) in enumerate(zip(tokens, types)):
        if ty != _TOKEN_NORMAL or len(piece) < 2:
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None:
                ranked.append((-scores[i], li, ri, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _spm_tokenizer(tokens: list[str], scores: list[float], types: list[int], *, unk: str | None,
                   add_space_prefix: bool) -> tokenizers.Tokenizer:
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = tokenizers.Tokenizer(models.BPE(vocab, _spm_merges(tokens, scores, types), unk_token=unk,
                                          fuse_unk=True, byte_fallback=True))
    norm = [normalizers.Replace(" ", _SPM_SPACE)]
    if add_space_prefix:
        norm.insert(0, normalizers.Prepend(_SPM_SPACE))
    tok.normalizer = normalizers.Sequence(norm)
    dec = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    return tok


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt2", "default"):
        return byte_level
    raise ValueError(f"tokenizer.ggml.pre={pre!r} is not supported "
                     f"(known: 'smollm', 'gpt2', 'default')")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    import datetime
    return datetime.datetime.now().strftime(fmt)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' ``tojson`` filter: keys in their order, non-ASCII kept, no HTML escaping (Jinja's own sorts
    keys and escapes ``<>&'``, which changes how tool definitions read in a prompt)."""
    import json
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled as ``transformers`` compiles it: a sandboxed Jinja environment with
    ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, the ``raise_exception`` /
    ``strftime_now`` globals (Llama 3's template asks for the date) and transformers' ``tojson`` filter.

    Raises:
        jinja2.TemplateSyntaxError: the template does not parse.
    """
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env.from_string(source)


def check_messages(messages) -> None:
    """Raise ``ValueError`` unless every message is a mapping with a string ``role`` and a string (or, for an
    assistant turn with tool calls, ``None``) ``content``; other keys (``tool_calls``, ``tool_call_id``,
    ``name``, ...) go to the template as they are."""
    for i, message in enumerate(messages):
        ok = isinstance(message, Mapping) and isinstance(message.get("role"), str) and (
            isinstance(message.get("content"), str) or (message.get("content") is None and "content" in message))
        if not ok:
            raise ValueError(f"messages[{i}]={message!r} must be a dict with a str 'role' and a str (or null) "
                             "'content'")


RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def check_template_kwargs(template_kwargs: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` for a template variable the tokenizer sets itself."""
    bad = sorted(RESERVED_TEMPLATE_VARS & template_kwargs.keys())
    if bad:
        raise ValueError(f"template variables {bad} are set by apply_chat_template itself")


class TokenStream:
    """Incremental decoding of one sequence (``step(ids)`` returns the newly completed text, ``""`` while a
    character is incomplete): what :func:`token_stream` builds over ``tokenizers``' ``DecodeStream``."""

    def __init__(self, tokenizer, stream, keep):
        self._tok, self._stream, self._keep = tokenizer, stream, keep

    def step(self, ids: Sequence[int]) -> str:
        out = []
        for i in self._keep(ids):
            chunk = self._stream.step(self._tok, i)
            if chunk:
                out.append(chunk)
        return "".join(out)


def token_stream(tokenizer, keep, *, skip_special_tokens: bool) -> TokenStream | None:
    """A :class:`TokenStream` over a ``tokenizers.Tokenizer`` (Rust, one call per token: 0.6-0.8 us per token
    against 1.65 us for the windowed decode of :class:`models.entrypoints.detokenizer.IncrementalDetokenizer`,
    SmolLM2's tokenizer on the CPU machine), or ``None`` where ``tokenizers`` has no ``DecodeStream`` (before
    0.21). ``keep(ids)``: the ids to decode (the tokenizer's own policy for ids outside its vocabulary)."""
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    return TokenStream(tokenizer, DecodeStream(skip_special_tokens=skip_special_tokens), keep)


class GGUFTokenizer:
    """Byte-level BPE tokenizer and chat template of a GGUF checkpoint.

    Build it with :meth:`from_gguf`.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, tokens: Sequence[str], *,
                 bos_token_id: int | None, eos_token_id: int | None,
                 chat_template: str | None = None, add_bos: bool = False,
                 add_eos: bool = False):
        """Wraps an already built tokenizer.

        Args:
            tokenizer: the ``tokenizers.Tokenizer`` doing the work.
            tokens: vocabulary, id -> token string (GGUF ``tokenizer.ggml.tokens``).
            bos_token_id, eos_token_id: special ids (``None`` when absent).
            chat_template: Jinja chat template; ``None`` means plain ChatML.
            add_bos, add_eos: what ``encode(..., add_special_tokens=True)`` adds.
        """
        self._tok = tokenizer
        self._tokens = list(tokens)
        self._bos, self._eos = bos_token_id, eos_token_id
        self._add_bos, self._add_eos = add_bos, add_eos
        self.chat_template = chat_template or CHATML_TEMPLATE
        self._template = compile_chat_template(self.chat_template)

    @classmethod
    def from_gguf(cls, path_or_reader: str | os.PathLike | gguf.GGUFReader) -> GGUFTokenizer:
        """Rebuilds the tokenizer stored in a GGUF file.

        Args:
            path_or_reader: a ``.gguf`` path or an open ``gguf.GGUFReader``.

        Returns:
            The tokenizer.

        Raises:
            ValueError: an unsupported ``tokenizer.ggml.model`` / ``tokenizer.ggml.pre``,
                or missing / inconsistent vocabulary fields.
        """
        meta = read_gguf_metadata(path_or_reader)
        model = meta.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise ValueError(f"tokenizer.ggml.model={model!r} is not supported ('gpt2' or 'llama')")
        required = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges" if model == "gpt2" else "tokenizer.ggml.scores")
        for key in required:
            if key not in meta:
                raise ValueError(f"GGUF metadata field {key!r} is missing")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types: list[int] = list(
            meta.get("tokenizer.ggml.token_type", [_TOKEN_NORMAL] * len(tokens)))
        if len(types) != len(tokens):
            raise ValueError(f"tokenizer.ggml.token_type has len={len(types)}, "
                             f"tokenizer.ggml.tokens has len={len(tokens)}")
        vocab = {tok: i for i, tok in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ValueError(f"tokenizer.ggml.tokens has {len(tokens) - len(vocab)} duplicates")
        if model == "llama":
            scores = [float(x) for x in meta["tokenizer.ggml.scores"]]
            if len(scores) != len(tokens):
                raise ValueError(f"tokenizer.ggml.scores has len={len(scores)}, tokenizer.ggml.tokens has "
                                 f"len={len(tokens)}")
            unk_id = meta.get("tokenizer.ggml.unknown_token_id")
            tok = _spm_tokenizer(tokens, scores, types, unk=None if unk_id is None else tokens[int(unk_id)],
                                 add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", False)))
        else:
            merges = []
            for merge in meta["tokenizer.ggml.merges"]:
                left, sep, right = merge.partition(" ")
                if not sep or not left or not right:
                    raise ValueError(f"tokenizer.ggml.merges entry {merge!r} is not 'left right'")
                merges.append((left, right))
            tok = tokenizers.Tokenizer(models.BPE(vocab, merges))
            tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
            tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([
            tokenizers.AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types) if ty == _TOKEN_CONTROL])
        tok.add_tokens([
            tokenizers.AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == _TOKEN_USER_DEFINED])

        def opt_int(key: str) -> int | None:
            return None if meta.get(key) is None else int(meta[key])

        return cls(tok, tokens,
                   bos_token_id=opt_int("tokenizer.ggml.bos_token_id"),
                   eos_token_id=opt_int("tokenizer.ggml.eos_token_id"),
                   chat_template=meta.get("tokenizer.chat_template") or (
                       GEMMA_CHAT_TEMPLATE if meta.get("general.architecture") == "gemma3" else None),
                   add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                   add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)))

    @property
    def bos_token_id(self) -> int | None:
        """Beginning-of-sequence id, or ``None``."""
        return self._bos

    @property
    def eos_token_id(self) -> int | None:
        """End-of-sequence id, or ``None``."""
        return self._eos

    def backend_json(self) -> str:
        """The ``tokenizers`` tokenizer as its ``tokenizer.json`` text (what grammar engines read)."""
        return self._tok.to_str()

    @property
    def vocab_size(self) -> int:
        """Number of tokens in the GGUF vocabulary."""
        return len(self._tokens)

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Ids that end generation: EOS, ``<|im_end|>``, ``<|endoftext|>`` and ``<end_of_turn>`` when
        present."""
        ids = {self.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>", "<end_of_turn>")}
        ids.add(self._eos)
        return frozenset(i for i in ids if i is not None)

    def token_to_id(self, token: str) -> int | None:
        """Id of a vocabulary string (e.g. ``"<|im_start|>"``), or ``None``."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """Vocabulary string of an id (byte-level form, e.g. ``"Ġthe"``).

        Raises:
            ValueError: ``token_id`` is out of range.
        """
        if not 0 <= token_id < len(self._tokens):
            raise ValueError(f"token_id={token_id} is outside [0, {len(self._tokens)})")
        return self._tokens[token_id]

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Tokenizes text; special-token strings in it map to their single ids.

        Args:
            text: input string.
            add_special_tokens: add BOS / EOS as the GGUF's ``add_bos_token`` /
                ``add_eos_token`` flags ask.

        Returns:
            Token ids, ``[num_tokens]``.

        Raises:
            ValueError: ``text`` is not a ``str``.
        """
        if not isinstance(text, str):
            raise ValueError(f"text={text!r} must be a str")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self._add_bos and self._bos is not None:
                ids = [self._bos, *ids]
            if self._add_eos and self._eos is not None:
                ids = [*ids, self._eos]
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Turns token ids back into text.

        Args:
            ids: token ids, ``[num_tokens]`` (a list, tuple or 1-D integer array).
            skip_special_tokens: drop control tokens such as ``<|im_end|>``.

        Returns:
            The decoded string.

        Raises:
            ValueError: an id is outside the vocabulary.
        """
        return self._tok.decode(self._checked([int(i) for i in ids]), skip_special_tokens=skip_special_tokens)

    def _checked(self, ids: list[int]) -> list[int]:
        """``ids``, or ``ValueError`` naming those outside the vocabulary."""
        bad = [i for i in ids if not 0 <= i < len(self._tokens)]
        if bad:
            raise ValueError(f"ids={bad[:8]} are outside [0, {len(self._tokens)})")
        return ids

    def decode_stream(self, *, skip_special_tokens: bool = True):
        """An incremental decoder of one sequence (:func:`token_stream`; ``None`` without
        ``tokenizers.decoders.DecodeStream``); ids outside the vocabulary raise ``ValueError`` as in
        :meth:`decode`."""
        return token_stream(self._tok, self._checked, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None, **template_kwargs) -> str:
        """Renders a conversation with the GGUF's chat template (transformers' ``apply_chat_template``).

        Args:
            messages: ``[{"role": "system" | "user" | "assistant" | "tool", "content": str, ...}, ...]``.
            add_generation_prompt: end with the assistant turn header.
            tools: tool definitions (``{"type": "function", "function": {...}}``), the template's ``tools``.
            **template_kwargs: more template variables (``enable_thinking``, ...).

        Returns:
            The prompt text (encode it with :meth:`encode`).

        Raises:
            ValueError: a message is not a mapping with a string ``role`` and ``content``, or a reserved
                template variable.
        """
        check_messages(messages)
        check_template_kwargs(template_kwargs)
        special = lambda i: None if i is None else self._tokens[i]  # noqa: E731
        return self._template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt, tools=tools, **template_kwargs,
            bos_token=special(self._bos) or "", eos_token=special(self._eos) or "")
