"""Structured outputs: a grammar per request, its allowed next tokens as a packed bitmask each step.

vLLM: ``vllm/v1/structured_output/`` (``StructuredOutputManager``, the ``guidance`` backend). The grammar
engine is llguidance (``llguidance``, the Rust library behind Guidance, a backend of vLLM's): no dependencies,
so a CPU machine and CI install it in seconds (xgrammar requires torch, transformers and triton), and on
SmolLM2's 49,152-token vocabulary a JSON-schema grammar compiled in ~5 ms and a mask took well under a
millisecond per token (docs/perf-notes.md). Each :class:`StructuredOutputsParams` kind maps to one llguidance
grammar: a JSON schema (``json``; ``json_object`` is ``{"type": "object"}``), a regular expression, a choice
(an alternation of the literal strings), or a Lark / GBNF grammar.

Backends (vLLM's names, ``backend``): ``"guidance"`` is llguidance alone; ``"outlines"`` is outlines-core's token
automata, held on the device so a constrained row needs no host work per token
(:mod:`jaxkv.core.grammar_dfa`), refusing what they cannot express; ``"auto"`` (the default) takes an automaton
where one expresses the request exactly and fits the device's tables, llguidance otherwise (vLLM's ``auto``
also picks per request). With json_schema on half of 1000 requests, llguidance's masks made the H100 server
0.45x as fast as unconstrained (two host callbacks per step, session 29).

Grammars compile on a thread pool, off the engine loop, and are cached by their text; a request waits for
its grammar outside the scheduler's queue (vLLM's ``WAITING_FOR_FSM``), so it holds no other request back.
Each request gets its own matcher (a copy of the compiled one). Per step the host fills each constrained row
of an ``int32[rows, ceil(vocab / 32)]`` bitmask (bit ``t % 32`` of word ``t // 32``: token ``t`` allowed) and
the jitted step masks the logits with it; the sampled token then advances the request's matcher. Once the
grammar is complete only EOS is allowed, so the request ends on its own. The rows of one step are filled in
parallel by llguidance's own threads (:func:`fill_bitmasks`; vLLM fills xgrammar's in a thread pool): on an
H100 server with json_schema on half of 1000 requests, filling them one after another took ~11 s of a 17.9 s
run's host time (session 26).
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import threading
import time
from typing import Any, Iterable, Sequence

import numpy as np

from jaxkv.config import STRUCTURED_OUTPUTS_BACKENDS as BACKENDS
from jaxkv.core.grammar_dfa import DFACompiler, DFAGrammar, DFATables, TokenDFA, dfa_regex, table_sizes
from jaxkv.sampling_params import StructuredOutputsParams

log = logging.getLogger(__name__)


def _import_llguidance():
    try:
        import llguidance
        import llguidance.numpy
    except ImportError:  # pragma: no cover - a dependency of jaxkv
        raise ValueError("structured outputs need the llguidance package (pip install llguidance)") from None
    return llguidance


def grammar_text(params: StructuredOutputsParams, *, any_whitespace: bool = True) -> str:
    """The llguidance grammar (its JSON serialisation) of ``params``. ``any_whitespace``: JSON may have any
    whitespace between its tokens (vLLM's default; off: llguidance's compact form, vLLM's
    ``disable_any_whitespace``).

    Raises:
        ValueError: a JSON schema that is not JSON.
    """
    llg = _import_llguidance()
    defaults = {"whitespace_flexible": bool(any_whitespace)}
    if params.json_object:
        return llg.LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=defaults)
    if params.json is not None:
        spec = params.json if isinstance(params.json, str) else json.dumps(params.json)
        try:
            json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        return llg.LLMatcher.grammar_from_json_schema(spec, defaults=defaults)
    if params.regex is not None:
        return llg.grammar_from("regex", params.regex)
    if params.choice is not None:
        return llg.grammar_from("choice", json.dumps(list(params.choice)))
    return llg.grammar_from("grammar", params.grammar)  # Lark or GBNF (llguidance tells them apart)


class Grammar:
    """One request's matcher: which tokens may come next, and the tokens that came. ``num_consumed``: how many
    of the request's output tokens it has advanced over (one per token, also after the grammar ended)."""

    on_device = False  # its masks come from the host (DFAGrammar's from the device)

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.num_consumed = 0
        # masks inside the step: why a token fed to it was rejected, set by StepMasks' worker (other threads read
        # this, never the matcher, which the worker may be advancing)
        self.rejected: str | None = None

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Row ``row`` of ``bitmask`` (``int32[rows, words]``) gets the allowed next tokens."""
        import llguidance.numpy as lnp
        lnp.fill_next_token_bitmask(self.matcher, bitmask, row)

    def accept(self, tokens: Iterable[int]) -> bool:
        """Advance over sampled ``tokens``; False when one was not allowed (the matcher's error says why)."""
        for t in tokens:
            self.num_consumed += 1
            if self.matcher.is_stopped():  # the grammar ended: its EOS is the request's last token
                continue
            if not self.matcher.consume_token(int(t)):
                return False
        return True

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() or None

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_stopped())


_EXECUTOR = None
_EXECUTOR_LOCK = threading.Lock()


def _executor():
    """The process's llguidance thread pool (one thread per core), made on first use."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = _import_llguidance().LLExecutor()
        return _EXECUTOR


def fill_bitmasks(rows: Iterable[tuple[Grammar, int]], bitmask: np.ndarray) -> None:
    """Row ``r`` of ``bitmask`` (``int32[rows, words]``, C-contiguous) gets ``grammar``'s allowed next tokens, for
    each ``(grammar, r)``; llguidance computes the rows on its threads at once (the GIL released). Same bits as
    :meth:`Grammar.fill_bitmask` row by row.

    Raises:
        ValueError: ``bitmask`` not an ``int32`` C-contiguous 2-D array, or a row outside it.
    """
    rows = list(rows)
    if bitmask.dtype != np.int32 or bitmask.ndim != 2 or not bitmask.flags["C_CONTIGUOUS"]:
        raise ValueError(f"bitmask must be a C-contiguous int32[rows, words] array, got {bitmask.dtype}"
                         f"{list(bitmask.shape)}")
    bad = [r for _, r in rows if not 0 <= r < bitmask.shape[0]]
    if bad:
        raise ValueError(f"bitmask rows {bad} outside [0, {bitmask.shape[0]})")
    if len(rows) == 1:
        grammar, r = rows[0]
        grammar.fill_bitmask(bitmask, r)
    elif rows:
        import llguidance.numpy as lnp
        lnp.fill_next_token_bitmask_par(_executor(), [(g.matcher, r) for g, r in rows], bitmask)


def accept_tokens(rows: Iterable[tuple[Grammar, Sequence[int]]]) -> list[bool]:
    """:meth:`Grammar.accept` of each ``(grammar, tokens)``, the one-token rows of unstopped grammars advanced on
    llguidance's threads at once (a constrained request gets one token per step). Returns each row's result, in
    order: False where a token was not allowed (the matcher's ``error`` says why)."""
    rows = list(rows)
    ok: list[bool | None] = [None] * len(rows)             # None: not advanced in parallel
    single = [i for i, (g, toks) in enumerate(rows) if len(toks) == 1 and not g.matcher.is_stopped()]
    if len(single) > 1:
        import llguidance.numpy as lnp
        got = lnp.consume_token_par(_executor(), [(rows[i][0].matcher, int(rows[i][1][0])) for i in single])
        for i, good in zip(single, got):
            ok[i] = bool(good)
            rows[i][0].num_consumed += 1
    return [g.accept(toks) if done is None else done for (g, toks), done in zip(rows, ok)]


class StepMasks:
    """The host side of masks computed inside the device step (``LLMEngine(structured_outputs_in_step=True)``).

    Each step of a decode loop (and each mixed step) that has constrained rows makes two ordered
    ``jax.experimental.io_callback`` calls. :meth:`begin`, before the step's forward pass, takes the tokens the
    step was fed and their positions and hands them to this object's worker thread, returning at once; there each
    constrained row's matcher advances over its fed token when it is the next output token it has not consumed
    (``position - num_prompt_tokens == grammar.num_consumed``) and its mask row is filled (:func:`fill_bitmasks`).
    :meth:`finish`, after the forward pass, waits for that work and returns the masks the step samples through.
    The host fills while the device computes the step; XLA:GPU runs a program's thunks on the dispatching thread
    and each callback waits for the stream to reach it, so one callback doing all the work would add it to every
    step (0.43x of the unconstrained server with json_schema on half the requests, H100, session 27).

    A constrained request then takes a token per step of a device loop instead of one per host round trip, and its
    matcher advances only on the worker, in device order, so steps can be dispatched before the previous one's
    tokens are back. vLLM fills each step's masks on the host between single steps.

    Dispatches are told apart by an id (:meth:`register`); ids the host does not know (the warm-up's dummy
    batches) get all-ones masks.

    Args:
        words: the bitmask's ``ceil(vocab / 32)``.
        keep: how many dispatches' rows are kept (older ones are forgotten: at most two steps are in flight).
    """

    def __init__(self, words: int, keep: int = 8):
        self.words = int(words)
        self._keep = int(keep)
        self._rows: dict[int, list[tuple[int, Grammar, int]]] = {}
        self._next_id = 0
        self._lock = threading.Lock()
        # one worker: the matchers advance in the order the device fed their tokens
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxkv-step-masks")
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._next_ticket = 0
        self.num_calls = 0
        self.seconds = 0.0   # worker seconds advancing and filling
        self.wait_s = 0.0    # seconds finish() waited for the worker (the fill the forward pass did not hide)

    def register(self, rows: Iterable[tuple[int, Grammar, int]]) -> int:
        """A dispatch's constrained rows, ``(row, grammar, num_prompt_tokens)`` each; returns its id (an
        ``int32``)."""
        with self._lock:
            self._next_id = (self._next_id + 1) % (1 << 30)
            self._rows[self._next_id] = list(rows)
            while len(self._rows) > self._keep:
                del self._rows[next(iter(self._rows))]
            return self._next_id

    def begin(self, dispatch_id, tokens, positions) -> np.ndarray:
        """Start the masks of a step whose rows were fed ``tokens`` at ``positions`` (``int32[R]``, position
        ``-1``: the row does not run this step); returns the ticket :meth:`finish` takes (``int32[]``)."""
        tokens = np.array(tokens, copy=True)
        positions = np.array(positions, copy=True)
        with self._lock:
            rows = self._rows.get(int(np.asarray(dispatch_id).reshape(-1)[0]), ())
            self._next_ticket = (self._next_ticket + 1) % (1 << 30)
            ticket = self._next_ticket
            try:
                self._pending[ticket] = self._worker.submit(self._masks, rows, tokens, positions)
                return np.int32(ticket)
            except RuntimeError:  # the worker is shut down: a step still in flight at interpreter exit
                done = self._pending[ticket] = concurrent.futures.Future()
        done.set_result(self._masks(rows, tokens, positions))  # on this thread, in the same order
        return np.int32(ticket)

    def finish(self, ticket, *after) -> np.ndarray:
        """``int32[R, words]``: the masks :meth:`begin` started (``after``: values of the step's forward pass,
        unused, which keep XLA from calling this before it)."""
        t0 = time.perf_counter()
        with self._lock:
            future = self._pending.pop(int(np.asarray(ticket)))
        mask = future.result()
        self.wait_s += time.perf_counter() - t0
        return mask

    def _masks(self, rows, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        mask = np.full((tokens.shape[0], self.words), -1, np.int32)
        live = []
        for r, g, prompt_len in rows:
            if positions[r] < 0:
                continue
            if self._advance(g, int(positions[r]) - prompt_len, int(tokens[r])):
                live.append((g, r))
            elif g.rejected is None:
                g.rejected = g.error or f"token {int(tokens[r])} not allowed"
        fill_bitmasks(live, mask)
        self.num_calls += 1
        self.seconds += time.perf_counter() - t0
        return mask

    @staticmethod
    def _advance(grammar: Grammar, index: int, token: int) -> bool:
        """Advance ``grammar`` over output token ``index`` if it is its next one; False once the grammar has
        rejected a token (its row stays all ones; the engine aborts the request)."""
        if grammar.rejected is not None:
            return False
        if index == grammar.num_consumed:
            return grammar.accept([token])
        return True


_PARAMS_CACHE = 4096  # grammars remembered by their request's content


def _params_key(params: StructuredOutputsParams) -> tuple:
    """``params``' content as a hashable key (a JSON schema as its sorted JSON text)."""
    spec = params.json
    if spec is not None and not isinstance(spec, str):
        spec = json.dumps(spec, sort_keys=True)
    return (spec, params.regex, params.choice, params.grammar, bool(params.json_object))


class StructuredOutputManager:
    """Compiles grammars for one tokenizer and hands each request its matcher (vLLM
    ``StructuredOutputManager``).

    Args:
        tokenizer_json: the tokenizer's ``tokenizer.json`` text (``tokenizers.Tokenizer.to_str()``).
        vocab_size: the model's vocabulary (the bitmask's width in bits; may exceed the tokenizer's).
        eos_token_ids: the tokens that end a completion (allowed once a grammar is complete).
        any_whitespace: JSON grammars allow any whitespace between tokens (vLLM's default); ``False``: the
            compact form only (vLLM ``disable_any_whitespace``; a weak model cannot loop on whitespace).
        max_workers: compile threads.
        backend: ``"auto"``, ``"guidance"`` or ``"outlines"`` (module docstring; vLLM
            ``--structured-outputs-config.backend``).
        table_mib: the device tables' size for automata (:meth:`new_tables`), MiB; an automaton larger than
            the tables goes to llguidance (``"auto"``) or is refused (``"outlines"``).

    Raises:
        ValueError: an unknown ``backend`` or a ``table_mib`` below 1.
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Iterable[int], *,
                 any_whitespace: bool = True, max_workers: int = 2, backend: str = "auto",
                 table_mib: float = 256.0):
        if backend not in BACKENDS:
            raise ValueError(f"structured outputs backend={backend!r} must be one of {BACKENDS}")
        if not table_mib >= 1:
            raise ValueError(f"structured outputs table_mib={table_mib!r} must be at least 1")
        self.backend = backend
        self.table_mib = float(table_mib)
        self.any_whitespace = bool(any_whitespace)
        self.vocab_size = int(vocab_size)
        self.bitmask_words = -(-self.vocab_size // 32)
        self._tokenizer_json = tokenizer_json
        self._eos = sorted(int(t) for t in eos_token_ids)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="jaxkv-grammar")
        self._lock = threading.Lock()
        self._ll_tokenizer = None
        self._compiled: dict[tuple, concurrent.futures.Future] = {}
        # (params' content, backend) -> its future: a request repeating a grammar (the common case: one schema per
        # application) costs a dict lookup on the engine's thread, not llguidance's validation and the regex
        # building again (2.3 ms a request for a nested schema on this CPU; session 30)
        self._by_params: collections.OrderedDict[tuple, concurrent.futures.Future] = collections.OrderedDict()
        self._dfa: DFACompiler | None = None
        self.num_compiled = 0
        self.num_fallbacks = 0  # automata that did not compile or fit: llguidance took the request

    def _tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                llg = _import_llguidance()
                self._ll_tokenizer = llg.LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size,
                                                     eos_token=self._eos or None)
            return self._ll_tokenizer

    def validate(self, params: StructuredOutputsParams) -> str:
        """The grammar text of ``params``, checked without compiling it for the vocabulary.

        Raises:
            ValueError: naming what is wrong with the grammar.
        """
        text = grammar_text(params, any_whitespace=self.any_whitespace)
        error = _import_llguidance().LLMatcher.validate_grammar(text)
        if error:
            raise ValueError(f"structured_outputs: {error.strip()}")
        return text

    @property
    def table_sizes(self) -> tuple[int, int]:
        """``(max_states, max_transitions)`` of the device tables (:func:`~jaxkv.core.grammar_dfa.table_sizes`)."""
        return table_sizes(self.bitmask_words, self.table_mib)

    def new_tables(self) -> DFATables:
        """Empty device tables for this vocabulary (:class:`~jaxkv.core.grammar_dfa.DFATables`)."""
        return DFATables(self.bitmask_words, self._eos, *self.table_sizes)

    def compile(self, params: StructuredOutputsParams, backend: str | None = None) -> concurrent.futures.Future:
        """A future of the compiled grammar of ``params``: a :class:`~jaxkv.core.grammar_dfa.TokenDFA` or an
        llguidance matcher, by ``backend`` (default: the manager's). Cached by grammar; compiled on threads (an
        automaton in a worker process).

        Raises:
            ValueError: the grammar is invalid (from :meth:`validate`), or with ``"outlines"`` not regular.
        """
        backend = backend or self.backend
        try:
            seen = (_params_key(params), backend)
        except (TypeError, ValueError):
            seen = None  # a schema json.dumps cannot write: validate() names the problem
        with self._lock:
            future = self._by_params.get(seen) if seen is not None else None
            if future is not None:
                self._by_params.move_to_end(seen)
                return future
        text = self.validate(params)
        regex = None if backend == "guidance" else dfa_regex(params, any_whitespace=self.any_whitespace)
        if regex is None and backend == "outlines":
            raise ValueError("structured_outputs: backend 'outlines' takes a regex, a choice or a JSON schema of "
                             "regular form (no recursion, $ref, pattern or format; integer bounds both given), "
                             "not this one: use backend 'auto' or 'guidance'")
        key = ("regex", regex, backend) if regex is not None else ("guidance", text)
        with self._lock:
            future = self._compiled.get(key)
            if future is None:
                future = self._compiled[key] = self._pool.submit(
                    self._compile if regex is None else self._compile_regular, *(
                        (text,) if regex is None else (regex, text, backend)))
            if seen is not None:
                self._by_params[seen] = future
                while len(self._by_params) > _PARAMS_CACHE:
                    self._by_params.popitem(last=False)
        return future

    def _compile_regular(self, regex: str, text: str, backend: str):
        tokenizer = self._tokenizer()
        with self._lock:
            if self._dfa is None:
                self._dfa = DFACompiler(tokenizer, self.vocab_size, self._eos, *self.table_sizes)
        got = self._dfa.compile(regex).result()
        if isinstance(got, TokenDFA):
            self.num_compiled += 1
            return got
        if backend == "outlines":
            raise ValueError(f"structured_outputs: {got}")
        log.info("structured outputs: no automaton (%s): llguidance's masks", got)
        self.num_fallbacks += 1
        return self._compile(text)

    def _compile(self, text: str):
        llg = _import_llguidance()
        matcher = llg.LLMatcher(self._tokenizer(), text)
        error = matcher.get_error()
        if error:
            raise ValueError(f"structured_outputs: {error}")
        self.num_compiled += 1
        return matcher

    def grammar(self, compiled) -> Grammar | DFAGrammar:
        """A request's own matcher, copied from a compiled one (a walk from the start, for an automaton)."""
        if isinstance(compiled, TokenDFA):
            return DFAGrammar(compiled, self._eos)
        return Grammar(compiled.deep_copy(), self.vocab_size)

    def new_bitmask(self, rows: int) -> np.ndarray:
        """``int32[rows, words]`` with every token allowed."""
        return np.full((rows, self.bitmask_words), -1, np.int32)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._dfa is not None:
            self._dfa.shutdown()

    def __reduce__(self) -> tuple[Any, ...]:  # rebuilt empty in another process
        return (_rebuild, (self._tokenizer_json, self.vocab_size, self._eos, self.any_whitespace, self.backend,
                           self.table_mib))


def _rebuild(tokenizer_json: str, vocab_size: int, eos: list[int], any_whitespace: bool, backend: str = "auto",
             table_mib: float = 256.0) -> StructuredOutputManager:
    return StructuredOutputManager(tokenizer_json, vocab_size, eos, any_whitespace=any_whitespace, backend=backend,
                                   table_mib=table_mib)
