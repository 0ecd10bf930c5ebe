"""The messages between front ends and engine-core processes, and their msgpack codec.

vLLM: ``vllm/v1/engine/__init__.py`` (``EngineCoreRequest``, ``EngineCoreOutput(s)``,
``EngineCoreRequestType``) and ``v1/serial_utils.py``. Messages carry token ids and small structs, never
text, and arrays only as raw bytes (:class:`LogprobsLists`): one message per step per direction. They are
``msgspec`` structs of a tagged union, so one decoder reads every kind and a malformed message fails loudly
(``msgspec.ValidationError``).

Front end → engine core (over the core's DEALER socket, from the front end's ROUTER):

* :class:`AddRequests` — requests (token ids + :class:`SamplingParams`), optionally acknowledged;
* :class:`AbortRequests` — ids to finish as aborted before the next step;
* :class:`UtilityCall` — a named engine method (``stats``, ``reset_prefix_cache``, ...), answered by a
  :class:`UtilityResult`;
* :class:`Shutdown`.

Engine core → front end (PUSH → PULL):

* :class:`Ready` — the engine is built and warm (its facts: blocks, lengths, dtypes);
* :class:`EngineCoreOutputs` — one per step: every request that got tokens, finished or was rejected;
* :class:`UtilityResult`, :class:`AddResult`;
* :class:`Heartbeat` — from a side thread every ``HEARTBEAT_INTERVAL_S``, busy or not;
* :class:`EngineDead` — the core is about to exit after an error (type and message).
"""

from __future__ import annotations

from typing import Any, Union

import msgspec
import numpy as np

from jaxkv.sampling_params import SamplingParams

HEARTBEAT_INTERVAL_S = 0.5


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One request as the engine core sees it. vLLM: ``EngineCoreRequest``.

    Attributes:
        request_id: unique among the core's live requests.
        prompt_token_ids: ``[num_prompt_tokens]`` ids.
        sampling_params: how to sample and stop.
        final_only: send the request's tokens once, when it finishes (vLLM
            ``RequestOutputKind.FINAL_ONLY``, what the offline ``LLM`` uses); otherwise every step's new
            tokens are sent (``DELTA``, what streaming needs).
        priority: with ``scheduling_policy="priority"``, smaller is admitted first (vLLM's ``priority``).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    final_only: bool = False
    priority: int = 0


class AddRequests(msgspec.Struct, tag="add", array_like=True, omit_defaults=True, gc=False):
    """Queue requests. With ``ack`` the core answers one :class:`AddResult`: all added, or none of them
    (a ``ValueError`` of one rolls the others back); without it a rejected request gets an
    :class:`EngineCoreOutput` whose ``error`` says why. ``client_index``: the front end (API-server
    process) that sent them; their outputs go to its output socket (vLLM: ``EngineCoreRequest.client_index``)."""

    requests: list[EngineCoreRequest]
    ack: int | None = None
    client_index: int = 0


class AbortRequests(msgspec.Struct, tag="abort", array_like=True, gc=False):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag="utility", array_like=True, gc=False):
    """Call ``EngineCoreProc.utility_<method>(*args)`` in the core; answered by :class:`UtilityResult` to
    front end ``client_index``."""

    call_id: int
    method: str
    args: list[Any] = []
    client_index: int = 0


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class LogprobsLists(msgspec.Struct, array_like=True, gc=False):
    """Log-probabilities of consecutive positions (vLLM ``LogprobsLists``), sent as the raw bytes of three
    little-endian arrays: msgpack then copies three buffers per message instead of walking ``n * (k + 1)``
    numbers, and the front end views them with NumPy without building a Python object per number.

    Position ``p``'s ``token_ids[p]`` are the chosen token (sampled, or the prompt's next token) then the top-k
    tokens in rank order, ``logprobs[p]`` theirs, ``ranks[p]`` the chosen token's rank (1 = most likely).
    Build one with :meth:`from_arrays`; read it through the properties.

    Attributes:
        token_ids_raw: ``int32[n, width]`` C order, little-endian.
        logprobs_raw: ``float32[n, width]``.
        ranks_raw: ``int32[n]``.
        width: ``1 + k``.
    """

    token_ids_raw: bytes
    logprobs_raw: bytes
    ranks_raw: bytes
    width: int

    @classmethod
    def from_arrays(cls, token_ids, logprobs, ranks) -> "LogprobsLists":
        """From ``int[n, width]`` ids, ``float[n, width]`` logprobs and ``int[n]`` ranks (arrays or nested lists).

        Raises:
            ValueError: shapes that disagree (naming them).
        """
        ids = np.ascontiguousarray(token_ids, dtype="<i4")
        lps = np.ascontiguousarray(logprobs, dtype="<f4")
        rks = np.ascontiguousarray(ranks, dtype="<i4")
        if ids.ndim != 2 or lps.shape != ids.shape or rks.shape != ids.shape[:1]:
            raise ValueError(f"LogprobsLists: token_ids {ids.shape}, logprobs {lps.shape} and ranks {rks.shape} "
                             "must be [n, width], [n, width] and [n]")
        return cls(ids.tobytes(), lps.tobytes(), rks.tobytes(), ids.shape[1])

    @property
    def ranks(self) -> np.ndarray:
        """``int32[n]`` (a read-only view of the bytes)."""
        return np.frombuffer(self.ranks_raw, "<i4")

    @property
    def token_ids(self) -> np.ndarray:
        """``int32[n, width]`` (a read-only view)."""
        return np.frombuffer(self.token_ids_raw, "<i4").reshape(len(self), self.width)

    @property
    def logprobs(self) -> np.ndarray:
        """``float32[n, width]`` (a read-only view)."""
        return np.frombuffer(self.logprobs_raw, "<f4").reshape(len(self), self.width)

    def __len__(self) -> int:
        return len(self.ranks_raw) // 4


def child_request_id(request_id: str, index: int) -> str:
    """The engine's id of completion ``index`` of a request with ``n > 1`` (vLLM's ``f"{index}_{parent}"``):
    aborting it ends that completion only; aborting ``request_id`` ends them all."""
    return f"{index}_{request_id}"


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One completion's progress in one step. vLLM: ``EngineCoreOutput``.

    Attributes:
        request_id: the request (the parent's id for a completion of ``n > 1``).
        new_token_ids: tokens generated in this step (every generated token for a ``final_only``
            request, sent once at its end); a stop token or EOS that ended it is the last one.
        finish_reason: ``None`` while running; ``"stop"``, ``"length"`` or ``"abort"`` at the end.
        stop_reason: the stop token id that ended it, if any.
        num_cached_tokens: prompt tokens served from the prefix cache at admission.
        error: the request was rejected (``ValueError`` text); nothing else is set.
        index: which completion of the request's ``n``.
        new_logprobs: with ``logprobs``: one position per token of ``new_token_ids``.
        new_prompt_logprobs: with ``prompt_logprobs``: positions ``1..`` of the prompt computed in this
            step (none for position 0); all of them arrive before the first generated token.
        queue_time_s: with the completion's first output: seconds from its arrival in the engine to its
            first step (vLLM's ``request_queue_time_seconds``).
    """

    request_id: str
    new_token_ids: list[int] = []
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    index: int = 0
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    queue_time_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class EngineCoreOutputs(msgspec.Struct, tag="outputs", array_like=True, omit_defaults=True, gc=False):
    """Everything one step produced on one engine core (``engine_index`` = its data-parallel rank), and
    at most every ``stats_interval_s`` the engine's counters (:class:`jaxkv.engine.llm_engine.EngineStats` as a
    dict)."""

    engine_index: int
    outputs: list[EngineCoreOutput] = []
    stats: dict[str, Any] | None = None


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """The core built its engine (and compiled ahead if asked): ``info`` holds its facts (``num_gpu_blocks``,
    ``max_model_len``, ``block_size``, ``dtype``, ``attention_impl``, device, start-up seconds...)."""

    engine_index: int
    info: dict[str, Any]


class AddResult(msgspec.Struct, tag="add_result", array_like=True):
    engine_index: int
    ack: int
    error: str | None = None


class UtilityResult(msgspec.Struct, tag="utility_result", array_like=True):
    engine_index: int
    call_id: int
    result: Any = None
    error: str | None = None


class Heartbeat(msgspec.Struct, tag="heartbeat", array_like=True):
    engine_index: int


class EngineDead(msgspec.Struct, tag="dead", array_like=True):
    """The core failed (during start-up or a step) and exits: the exception's type name and text, and
    the traceback for the log."""

    engine_index: int
    error_type: str
    message: str
    traceback: str = ""


InputMessage = Union[AddRequests, AbortRequests, UtilityCall, Shutdown]
OutputMessage = Union[EngineCoreOutputs, Ready, AddResult, UtilityResult, Heartbeat, EngineDead]

_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(InputMessage)
_output_decoder = msgspec.msgpack.Decoder(OutputMessage)


def encode(message) -> bytes:
    """msgpack bytes of any message above."""
    return _encoder.encode(message)


def decode_input(data: bytes) -> InputMessage:
    """A front end's message. Raises ``msgspec.ValidationError`` / ``DecodeError`` for anything else."""
    return _input_decoder.decode(data)


def decode_output(data: bytes) -> OutputMessage:
    """An engine core's message. Raises ``msgspec.ValidationError`` / ``DecodeError`` for anything else."""
    return _output_decoder.decode(data)
