"""Tokenizers of Hugging Face checkpoint directories, and a placeholder for configs that come without one.

:class:`HFTokenizer` reads ``tokenizer.json`` with the ``tokenizers`` library (its normaliser, pre-tokenizer,
model and post-processor: ``encode(text, add_special_tokens=True)`` adds BOS exactly where the checkpoint's
post-processor does), special tokens and the chat template from ``tokenizer_config.json`` (or
``chat_template.jinja``), and EOS ids and default sampling from ``generation_config.json``. It has the
interface of :class:`models.GGUFTokenizer` (what ``LLM``, the server and the detokenizer use).

:class:`PlaceholderTokenizer` serves a built-in config (``load_format="dummy"``, e.g. ``llama-3.1-8b``) that has
no tokenizer here: UTF-8 bytes map to 256 consecutive ids (placed clear of the config's BOS/EOS ids), every
other id decodes to nothing. Its vocabulary size is the model's, so any generated id decodes; prompts are
best given as token ids (``bench_throughput.py --tokenizer``). It is not the model's tokenizer: token counts
of a text are those of bytes, about 4x a BPE vocabulary's.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Iterable, Mapping, Sequence

import tokenizers

from models.hf_config import read_json
from models.tokenizer import CHATML_TEMPLATE, check_messages, check_template_kwargs, compile_chat_template, token_stream

GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _token_str(value) -> str | None:
    """``tokenizer_config.json`` writes a special token as a string or as an ``AddedToken`` dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _ids(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _chat_template(directory: pathlib.Path, tok_config: dict) -> str | None:
    tmpl = tok_config.get("chat_template")
    if isinstance(tmpl, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, Mapping)}
        tmpl = named.get("default") or next(iter(named.values()), None)
    if tmpl is None and (directory / "chat_template.jinja").is_file():
        tmpl = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    if tmpl is None and (directory / "chat_template.json").is_file():
        tmpl = read_json(directory / "chat_template.json").get("chat_template")
    return tmpl if isinstance(tmpl, str) else None


class HFTokenizer:
    """``tokenizer.json`` + ``tokenizer_config.json`` + ``generation_config.json`` of a checkpoint directory.

    Build it with :meth:`from_pretrained`.

    Attributes:
        chat_template: the Jinja source (``None`` in the directory: ChatML).
        generation_config: default sampling of ``generation_config.json`` (``temperature``, ``top_p``,
            ``top_k``, ... where present), what vLLM's ``--generation-config auto`` applies.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, bos_token: str | None, eos_token: str | None,
                 stop_token_ids: Iterable[int] = (), chat_template: str | None = None,
                 generation_config: Mapping[str, Any] | None = None):
        self._tok = tokenizer
        self._bos_token, self._eos_token = bos_token, eos_token
        self._bos = None if bos_token is None else tokenizer.token_to_id(bos_token)
        self._eos = None if eos_token is None else tokenizer.token_to_id(eos_token)
        stop = set(int(t) for t in stop_token_ids)
        if self._eos is not None:
            stop.add(self._eos)
        self._stop = frozenset(stop)
        if self._eos is None and self._stop:
            self._eos = min(self._stop)
        self.chat_template = chat_template or CHATML_TEMPLATE
        self._template = compile_chat_template(self.chat_template)
        self.generation_config = dict(generation_config or {})

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, *, config_eos_token_id=None) -> HFTokenizer:
        """The tokenizer of an HF checkpoint directory.

        Args:
            directory: holds ``tokenizer.json`` (required), ``tokenizer_config.json`` and
                ``generation_config.json`` (optional).
            config_eos_token_id: ``config.json``'s ``eos_token_id`` (an id or a list), also a stop id.

        Raises:
            FileNotFoundError: no ``tokenizer.json`` (names the file).
            ValueError: a file that does not parse (names it).
        """
        d = pathlib.Path(directory)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist (an HF checkpoint directory needs its tokenizer.json)")
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust error says what is wrong, not which file
            raise ValueError(f"{path}: not a tokenizers file ({e})") from None
        tok_config = read_json(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else {}
        gen = read_json(d / "generation_config.json") if (d / "generation_config.json").is_file() else {}
        stop = _ids(gen.get("eos_token_id")) + _ids(config_eos_token_id)
        return cls(tok, bos_token=_token_str(tok_config.get("bos_token")),
                   eos_token=_token_str(tok_config.get("eos_token")), stop_token_ids=stop,
                   chat_template=_chat_template(d, tok_config),
                   generation_config={k: gen[k] for k in GENERATION_DEFAULT_KEYS if gen.get(k) is not None})

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    def backend_json(self) -> str:
        """The ``tokenizers`` tokenizer as its ``tokenizer.json`` text (what grammar engines read)."""
        return self._tok.to_str()

    @property
    def vocab_size(self) -> int:
        """Tokens of the vocabulary, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Ids that end generation: ``tokenizer_config.json``'s EOS, ``generation_config.json``'s
        ``eos_token_id`` (Llama 3 Instruct: ``<|eot_id|>`` too) and ``config.json``'s."""
        return self._stop

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str:
        """Raises ``ValueError`` for an id outside the vocabulary."""
        token = self._tok.id_to_token(int(token_id))
        if token is None:
            raise ValueError(f"token_id={token_id} is outside [0, {self.vocab_size})")
        return token

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens``: what the checkpoint's post-processor adds (BOS).

        Raises:
            ValueError: ``text`` is not a ``str``.
        """
        if not isinstance(text, str):
            raise ValueError(f"text={text!r} must be a str")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; ids outside the tokenizer's vocabulary (a model's padded vocabulary rows) decode
        to nothing."""
        return self._tok.decode(self._in_vocab(ids), skip_special_tokens=skip_special_tokens)

    def _in_vocab(self, ids: Iterable[int]) -> list[int]:
        """``ids`` without those outside the tokenizer's vocabulary (a model's padded vocabulary rows)."""
        n = self.vocab_size
        return [i for i in map(int, ids) if 0 <= i < n]

    def decode_stream(self, *, skip_special_tokens: bool = True):
        """An incremental decoder of one sequence (:func:`models.tokenizer.token_stream`; ``None``
        without ``tokenizers.decoders.DecodeStream``); ids outside the vocabulary decode to nothing, as in
        :meth:`decode`."""
        return token_stream(self._tok, self._in_vocab, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None, **template_kwargs) -> str:
        """Render a conversation with the checkpoint's chat template (``bos_token`` / ``eos_token``, ``tools`` and
        extra variables given to it as ``transformers`` does).

        Raises:
            ValueError: a message that is not a mapping with a string ``role`` and ``content``, or a reserved
                template variable.
        """
        check_messages(messages)
        check_template_kwargs(template_kwargs)
        return self._template.render(messages=[dict(m) for m in messages],
                                     add_generation_prompt=add_generation_prompt, tools=tools,
                                     bos_token=self._bos_token or "", eos_token=self._eos_token or "",
                                     **template_kwargs)


class PlaceholderTokenizer:
    """Byte-level stand-in of a model's tokenizer for dummy weights (see the module docstring).

    Args:
        vocab_size: the model's vocabulary size (>= 256 + its special ids' span).
        bos_token_id, eos_token_id: the config's special ids (``eos_token_id`` may be a list).

    Raises:
        ValueError: no room for 256 byte ids.
    """

    is_placeholder = True

    def __init__(self, vocab_size: int, *, bos_token_id: int | None = None, eos_token_id=None):
        self._vocab = int(vocab_size)
        self._bos = bos_token_id
        eos = _ids(eos_token_id)
        self._eos = eos[0] if eos else None
        self._stop = frozenset(eos)
        special = {i for i in (bos_token_id, *eos) if i is not None}
        self._offset = next((k for k in range(0, self._vocab - 255)
                             if not any(k <= s < k + 256 for s in special)), None)
        if self._offset is None:
            raise ValueError(f"vocab_size={vocab_size} leaves no room for 256 byte ids")
        self.chat_template = CHATML_TEMPLATE
        self._template = compile_chat_template(CHATML_TEMPLATE)
        self.generation_config: dict = {}

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self._stop

    def token_to_id(self, token: str) -> int | None:
        return None

    def id_to_token(self, token_id: int) -> str:
        if not 0 <= token_id < self._vocab:
            raise ValueError(f"token_id={token_id} is outside [0, {self._vocab})")
        b = token_id - self._offset
        return f"<0x{b:02X}>" if 0 <= b < 256 else f"<id {token_id}>"

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text={text!r} must be a str")
        ids = [b + self._offset for b in text.encode("utf-8")]
        return [self._bos, *ids] if add_special_tokens and self._bos is not None else ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        data = bytes(i - self._offset for i in (int(t) for t in ids) if 0 <= i - self._offset < 256)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None, **template_kwargs) -> str:
        check_messages(messages)
        check_template_kwargs(template_kwargs)
        return self._template.render(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                                     tools=tools, bos_token="", eos_token="", **template_kwargs)
