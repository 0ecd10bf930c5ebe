"""Token automata: structured outputs whose masks the device computes with no host work per token.

vLLM: the ``outlines`` structured-output backend (``vllm/v1/structured_output/backend_outlines.py``), which walks
outlines-core's token automaton on the host each step. Here the automaton's tables live on the device.

A regular expression, a choice, or a JSON schema without recursion is a regular language. outlines-core
(``outlines_core.Index``, Rust) compiles it with the tokenizer's vocabulary into a deterministic automaton over
tokens. This module turns the automaton into tables (:class:`TokenDFA`) that the device indexes:

* ``bits`` ``int32[S, W]``: the tokens allowed in each state, packed like the grammar bitmask (bit ``t % 32`` of
  word ``t // 32``; ``W = ceil(vocab / 32)``), EOS excluded;
* ``final`` ``int32[S]``: EOS is allowed there (the text so far is in the language);
* ``prefix`` ``int32[S, W]``: how many allowed tokens precede word ``w`` of the state's row, and ``base``
  ``int32[S]``, where the state's row of ``next`` starts; ``next`` ``int32[T]``, one entry per allowed token in
  token order: the state it leads to. The next state of ``(s, t)`` is ``next[base[s] + prefix[s, t // 32] +
  popcount(bits[s, t // 32] & (2**(t % 32) - 1))]``, two gathers and a popcount.

:class:`DFATables` holds the automata of the running requests in fixed-size device arrays (their size does not
change, so the compiled steps do not), each at an offset; state 0 is "unconstrained" (all tokens, next 0). A
step takes each constrained row's state ``int32[R]``, masks its logits with ``bits[state]`` (plus EOS where
final), samples, and moves to the next state inside the device loop. The host keeps each request's state over
the tokens it has received (:class:`DFAGrammar`), so a dispatch sends the state after the known tokens and the
device advances it over a fed token that is still in flight (async scheduling).

Only grammars that outlines-core expresses exactly take this path (:func:`dfa_regex`): everything else
(``json_object``, Lark / GBNF grammars, schemas with keywords outside :data:`_SCHEMA_KEYWORDS`) uses llguidance
(:mod:`jaxkv.core.structured_output`). Automata compile in a separate process (outlines-core returns its
transitions as Python dicts, holding the GIL for 0.8 s on SmolLM2's vocabulary and 2.6 s on Llama 3's: in the
engine's process that would stall the step loop).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import pickle
import struct
import subprocess
import sys
import threading
import weakref
from typing import Any, Iterable

import numpy as np

from jaxkv._lazy import python_module
from jaxkv.sampling_params import StructuredOutputsParams

# JSON-schema keywords the regular path expresses exactly (with outlines-core's regex builder); a schema using
# any other keyword (minimum without maximum, pattern, format, $ref, oneOf, ...) goes to llguidance
_SCHEMA_KEYWORDS = {
    None: {"type", "enum", "const", "anyOf", "title", "description", "default", "examples", "$schema", "$id",
           "$comment"},
    "object": {"properties", "required", "additionalProperties"},
    "array": {"items", "minItems", "maxItems"},
    "string": {"minLength", "maxLength"},
    "integer": {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "number": set(),
    "boolean": set(),
    "null": set(),
}
MAX_INTEGER_RANGE = 1024  # an integer with both bounds becomes the enum of its values up to this many
_REGEX_META = set("\\.+*?()|[]{}^$#&-~ ")
WHITESPACE_ANY = r"[ \t\n\r]*"


def pack_tokens(tokens, words: int) -> np.ndarray:
    """``int32[words]``: bit ``t % 32`` of word ``t // 32`` set for each token ``t`` of ``tokens`` (the grammar
    bitmask's packing)."""
    allowed = np.zeros(words * 32, bool)
    allowed[np.asarray(tokens, np.int64)] = True
    return np.packbits(allowed, bitorder="little").view("<u4").view(np.int32)


def _regular_schema(schema: Any) -> Any | None:
    """``schema`` rewritten for outlines-core's regex builder (a bounded integer becomes the enum of its values),
    or ``None`` when it uses a keyword the regular path does not express exactly."""
    if not isinstance(schema, dict):
        return None
    if "anyOf" in schema:  # each branch with its siblings' "type" (as tool_choice="required"'s items have it)
        siblings = {k: v for k, v in schema.items() if k not in _SCHEMA_KEYWORDS[None] or k == "type"}
        branches = schema["anyOf"]
        if set(siblings) - {"anyOf", "type"} or not isinstance(branches, list) or not branches:
            return None
        base = {"type": schema["type"]} if "type" in schema else {}
        subs = [_regular_schema({**base, **b}) if isinstance(b, dict) and b.get("type", base.get("type")) ==
                base.get("type", b.get("type")) else None for b in branches]
        return None if any(s is None for s in subs) else {"anyOf": subs}
    kind = schema.get("type")
    if kind is not None and (not isinstance(kind, str) or kind not in _SCHEMA_KEYWORDS):
        return None  # a list of types, or an unknown one
    if any(k not in _SCHEMA_KEYWORDS[None] and k not in _SCHEMA_KEYWORDS.get(kind, ()) for k in schema):
        return None
    for key in ("enum", "const"):
        values = schema.get(key, ()) if key == "enum" else [schema.get("const")] if key in schema else ()
        if not isinstance(values, list | tuple) or any(isinstance(v, dict | list) for v in values):
            return None
    if kind is None:
        return schema if ("enum" in schema or "const" in schema) else None
    out = dict(schema)
    if kind == "object":
        props = schema.get("properties", {})
        if not isinstance(props, dict) or schema.get("additionalProperties", False) is not False:
            return None
        if any(name not in props for name in schema.get("required", ())):
            return None  # a required property the regex could not write
        subs = {name: _regular_schema(s) for name, s in props.items()}
        if any(s is None for s in subs.values()):
            return None
        out["properties"] = subs
    elif kind == "array":
        if not isinstance(schema.get("items"), dict):
            return None
        out["items"] = _regular_schema(schema["items"])
        if out["items"] is None:
            return None
    elif kind == "integer" and any(k in schema for k in _SCHEMA_KEYWORDS["integer"]):
        bounds = [schema.get(k) for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")]
        if any(b is not None and (isinstance(b, bool) or not isinstance(b, int | float) or not math.isfinite(b))
               for b in bounds):
            return None
        lo, hi, xlo, xhi = bounds
        lo = max(v for v in (-math.inf, None if lo is None else math.ceil(lo),
                             None if xlo is None else math.floor(xlo) + 1) if v is not None)
        hi = min(v for v in (math.inf, None if hi is None else math.floor(hi),
                             None if xhi is None else math.ceil(xhi) - 1) if v is not None)
        if not (math.isfinite(lo) and math.isfinite(hi)) or hi - lo + 1 > MAX_INTEGER_RANGE or hi < lo:
            return None
        out = {k: v for k, v in schema.items() if k not in _SCHEMA_KEYWORDS["integer"] and k != "type"}
        out["enum"] = list(range(int(lo), int(hi) + 1))
    return out


def _escape(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def dfa_regex(params: StructuredOutputsParams, *, any_whitespace: bool = True) -> str | None:
    """The regular expression (outlines-core's dialect) whose language is exactly that of ``params``, or ``None``
    when ``params`` is not regular or uses a JSON-schema keyword outside the regular path (llguidance then).
    ``any_whitespace``: JSON may have any whitespace between its tokens (vLLM's default); off: none."""
    if params.regex is not None:
        return params.regex
    if params.choice is not None:
        return "(" + "|".join(_escape(c) for c in params.choice) + ")"
    if params.json is None:
        return None  # json_object (nested to any depth) and grammars are not regular
    try:
        schema = json.loads(params.json) if isinstance(params.json, str) else params.json
    except json.JSONDecodeError:
        return None  # llguidance's validation names the error
    regular = _regular_schema(schema)
    if regular is None:
        return None
    from outlines_core.json_schema import build_regex_from_schema
    try:
        return build_regex_from_schema(json.dumps(regular), WHITESPACE_ANY if any_whitespace else "")
    except Exception:  # noqa: BLE001 - a schema outlines-core does not take: llguidance's path
        return None


@dataclasses.dataclass(eq=False)
class TokenDFA:
    """One grammar's automaton as host tables (module docstring): ``bits`` / ``prefix`` ``int32[S, W]``, ``base``
    / ``final`` ``int32[S]``, ``next`` ``int32[T]`` (local states), the ``initial`` state, its ``regex``."""

    bits: np.ndarray
    prefix: np.ndarray
    base: np.ndarray
    final: np.ndarray
    next: np.ndarray
    initial: int
    regex: str

    @property
    def num_states(self) -> int:
        return int(self.bits.shape[0])

    @property
    def num_transitions(self) -> int:
        return int(self.next.shape[0])

    def step(self, state: int, token: int) -> int:
        """The state after ``token`` (``-1``: not allowed in ``state``; EOS is not a transition)."""
        w, b = token >> 5, token & 31
        if not 0 <= w < self.bits.shape[1]:
            return -1
        word = int(self.bits[state, w]) & 0xFFFFFFFF
        if not (word >> b) & 1:
            return -1
        rank = int(self.prefix[state, w]) + (word & ((1 << b) - 1)).bit_count()
        return int(self.next[self.base[state] + rank])

    def allowed(self, state: int) -> np.ndarray:
        """``int32[W]``: the tokens allowed after ``state`` (EOS not included)."""
        return self.bits[state]

    def is_complete(self, state: int) -> bool:
        """Only EOS may follow: the text is in the language and no token extends it."""
        return bool(self.final[state]) and not self.bits[state].any()


def tables_from_transitions(transitions: dict[int, dict[int, int]], initial: int, finals: Iterable[int],
                            vocab_size: int, eos_ids: Iterable[int], regex: str = "") -> TokenDFA:
    """The :class:`TokenDFA` of an automaton given as ``{state: {token: next state}}`` (outlines-core's
    ``Index.get_transitions``; states any ints, renumbered ``0..S-1`` in sorted order; EOS transitions dropped).

    Raises:
        ValueError: a token outside ``[0, vocab_size)``.
    """
    words = -(-vocab_size // 32)
    eos = np.array(sorted(set(int(e) for e in eos_ids)), np.int64)
    ids = np.array(sorted(set(transitions) | set(finals) | {initial}), np.int64)
    num = len(ids)
    bits = np.zeros((num, words), np.int32)
    rows_dst = []
    for i, s in enumerate(ids.tolist()):
        row = transitions.get(s, {})
        toks = np.fromiter(row.keys(), np.int64, len(row))
        dst = np.fromiter(row.values(), np.int64, len(row))
        keep = ~np.isin(toks, eos)
        toks, dst = toks[keep], dst[keep]
        if toks.size and (toks.min() < 0 or toks.max() >= vocab_size):
            raise ValueError(f"token {int(toks.max() if toks.max() >= vocab_size else toks.min())} outside the "
                             f"vocabulary [0, {vocab_size})")
        bits[i] = pack_tokens(toks, words)
        rows_dst.append(np.searchsorted(ids, dst[np.argsort(toks, kind="stable")]))  # in token order
    counts = np.bitwise_count(bits.view(np.uint32)).astype(np.int64)
    prefix = np.cumsum(counts, axis=1) - counts
    per_state = counts.sum(axis=1)
    base = np.cumsum(per_state) - per_state
    nxt = np.concatenate(rows_dst) if rows_dst else np.zeros(0, np.int64)
    final = np.isin(ids, np.array(sorted(finals), np.int64))
    return TokenDFA(bits=bits, prefix=prefix.astype(np.int32), base=base.astype(np.int32),
                    final=final.astype(np.int32), next=nxt.astype(np.int32),
                    initial=int(np.searchsorted(ids, initial)), regex=regex)


class DFAGrammar:
    """One request's walk through a :class:`TokenDFA` (the counterpart of
    :class:`~jaxkv.core.structured_output.Grammar`): ``state`` after the ``num_consumed`` output tokens the host
    has seen."""

    on_device = True

    def __init__(self, dfa: TokenDFA, eos_ids: Iterable[int]):
        self.dfa = dfa
        self.eos = frozenset(int(e) for e in eos_ids)
        self.state = dfa.initial
        self.num_consumed = 0
        self.rejected: str | None = None
        self.held = False  # it holds its automaton's place in the device tables (DFATables.hold)

    def accept(self, tokens: Iterable[int]) -> bool:
        """Advance over sampled ``tokens``; False when one was not allowed (``rejected`` says which)."""
        for t in tokens:
            self.num_consumed += 1
            if self.rejected is not None:
                return False
            t = int(t)
            if t in self.eos and self.dfa.final[self.state]:
                continue
            nxt = self.dfa.step(self.state, t)
            if nxt < 0:
                self.rejected = f"token {t} not allowed after {self.num_consumed - 1} tokens"
                return False
            self.state = nxt
        return True

    @property
    def error(self) -> str | None:
        return self.rejected

    @property
    def is_terminated(self) -> bool:
        return self.dfa.is_complete(self.state)


# -- compiling, in a worker process ------------------------------------------------------------------------------
def _compile(vocab, regex: str, vocab_size: int, eos_ids: list[int], max_states: int,
             max_transitions: int) -> TokenDFA | str:
    """The worker's half of :meth:`DFACompiler.compile`: a :class:`TokenDFA`, or why not (a string)."""
    from outlines_core import Index
    try:
        index = Index(regex, vocab)
    except Exception as e:  # noqa: BLE001 - outlines-core's own error (an unsupported regex, say)
        return f"outlines-core: {e}"
    transitions = index.get_transitions()
    states = len(set(transitions) | set(index.get_final_states()))
    size = sum(len(t) for t in transitions.values())
    if states > max_states or size > max_transitions:
        return f"{states} states and {size} transitions exceed the tables' {max_states} and {max_transitions}"
    return tables_from_transitions(transitions, index.get_initial_state(), index.get_final_states(), vocab_size,
                                   eos_ids, regex)


def token_bytes(ll_tokenizer, vocab_size: int, eos_ids: Iterable[int]) -> dict[bytes, list[int]]:
    """``{bytes: [token ids]}`` of every token of an ``llguidance.LLTokenizer`` but its special tokens and EOS
    (outlines-core's ``Vocabulary`` map: tokens as the bytes they decode to)."""
    eos = set(int(e) for e in eos_ids)
    out: dict[bytes, list[int]] = {}
    for i in range(min(vocab_size, ll_tokenizer.vocab_size)):
        if i in eos or ll_tokenizer.is_special_token(i):
            continue
        b = ll_tokenizer.decode_bytes([i])
        if b:
            out.setdefault(b, []).append(i)
    return out


def _send(stream, obj) -> None:
    data = pickle.dumps(obj, protocol=5)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream):
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("the automaton compiler process ended")
    (size,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(size))


def _serve() -> None:
    """The worker process (``python -m jaxkv.core.grammar_dfa``): a vocabulary first, then one regex per message,
    each answered with :func:`_compile`'s result; stdout carries only the answers."""
    from outlines_core import Vocabulary

    from jaxkv.core.grammar_dfa import _compile as compile_  # not __main__'s copy: its TokenDFA unpickles
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print goes to stderr
    inp = sys.stdin.buffer
    token_map, eos = _receive(inp)
    vocab = Vocabulary(eos, token_map)
    while True:
        try:
            args = _receive(inp)
        except EOFError:
            return
        _send(out, compile_(vocab, *args))


class DFACompiler:
    """Compiles regexes into :class:`TokenDFA` s in one worker process (``python -m jaxkv.core.grammar_dfa``,
    started on first use, as the engine cores are), one at a time, cached by regex.

    Args:
        ll_tokenizer: the ``llguidance.LLTokenizer`` of the model (its tokens' bytes).
        vocab_size: the model's vocabulary (the bitmask's width may exceed the tokenizer's).
        eos_ids: the tokens that end a completion.
        max_states, max_transitions: an automaton larger than this is refused (the request uses llguidance).
    """

    def __init__(self, ll_tokenizer, vocab_size: int, eos_ids: Iterable[int], max_states: int,
                 max_transitions: int):
        self.vocab_size = int(vocab_size)
        self.eos_ids = sorted(int(e) for e in eos_ids)
        self.max_states, self.max_transitions = int(max_states), int(max_transitions)
        self._ll_tokenizer = ll_tokenizer
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxkv-dfa")
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._cache: dict[str, concurrent.futures.Future] = {}

    def compile(self, regex: str) -> concurrent.futures.Future:
        """A future of the :class:`TokenDFA` of ``regex``, or of a string saying why there is none."""
        with self._lock:
            future = self._cache.get(regex)
            if future is None:
                future = self._cache[regex] = self._thread.submit(self._remote, regex)
            return future

    def _remote(self, regex: str) -> TokenDFA | str:
        if self._proc is None or self._proc.poll() is not None:
            argv, env = python_module("jaxkv.core.grammar_dfa")  # -P: no folder of the cwd shadows jaxkv
            self._proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            weakref.finalize(self, _stop, self._proc)  # an engine dropped without shutdown() ends its worker too
            eos = self.eos_ids[0] if self.eos_ids else self.vocab_size
            _send(self._proc.stdin, (token_bytes(self._ll_tokenizer, self.vocab_size, self.eos_ids), eos))
        _send(self._proc.stdin, (regex, self.vocab_size, self.eos_ids, self.max_states, self.max_transitions))
        return _receive(self._proc.stdout)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        proc, self._proc = self._proc, None
        if proc is not None:
            _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """End a worker: its stdin closed, it returns; killed if it has not within 5 s."""
    if proc.poll() is not None:
        return
    try:
        proc.stdin.close()
        proc.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()


# -- the device side ---------------------------------------------------------------------------------------------
def dfa_bitmask(tables: dict, states):
    """``int32[R, W]``: the allowed tokens of each row's global ``states`` (``int32[R]``; 0: every token)."""
    import jax.numpy as jnp
    bits = tables["bits"][states] | jnp.where((tables["final"][states] > 0)[:, None], tables["eos"][None, :], 0)
    return jnp.where((states > 0)[:, None], bits, -1)


def dfa_advance(tables: dict, states, tokens):
    """``int32[R]``: each row's state after ``tokens`` (``int32[R]``); a row stays where it is in state 0, on
    ``-1`` or EOS, or on a token its state does not allow."""
    import jax.numpy as jnp
    from jax import lax
    tok = jnp.maximum(tokens, 0)
    w, b = tok // 32, (tok % 32).astype(jnp.uint32)
    word = tables["bits"][states, w].astype(jnp.uint32)
    ok = (states > 0) & (tokens >= 0) & (((word >> b) & 1) == 1)
    below = word & ((jnp.uint32(1) << b) - jnp.uint32(1))
    rank = tables["prefix"][states, w] + lax.population_count(below).astype(jnp.int32)
    at = jnp.where(ok, tables["base"][states] + rank, 0)
    return jnp.where(ok, tables["next"][at], states)


def table_sizes(words: int, table_mib: float) -> tuple[int, int]:
    """``(max_states, max_transitions)`` of device tables of ``table_mib`` MiB for a bitmask of ``words`` words:
    half for the states' rows (``bits``, ``prefix``, ``base``, ``final``), half for the transitions."""
    budget = table_mib * 2**20 / 2
    return max(2, int(budget // ((2 * words + 2) * 4))), max(1, int(budget // 4))


@dataclasses.dataclass
class _Placed:
    dfa: TokenDFA
    state_offset: int
    transition_offset: int
    refs: int = 0


class DFATables:
    """The device's automata: fixed-size arrays (module docstring) holding each placed :class:`TokenDFA` at an
    offset. A request holds its automaton (:meth:`hold`, at its grammar's attach) until it ends
    (:meth:`release`); automata no request holds stay as a cache until their room is needed.

    Args:
        words: the bitmask's ``ceil(vocab / 32)``.
        eos_ids: allowed in final states.
        max_states, max_transitions: the arrays' sizes (state 0 is reserved).
        sharding: where the arrays live (``None``: the default device; on a mesh, replicated).
    """

    def __init__(self, words: int, eos_ids: Iterable[int], max_states: int, max_transitions: int,
                 sharding=None):
        self.words = int(words)
        self.max_states, self.max_transitions = int(max_states), int(max_transitions)
        self.sharding = sharding
        self._eos = pack_tokens([e for e in eos_ids if 0 <= e < self.words * 32], self.words)
        self._empty()
        self._arrays: dict | None = None
        self._write = None
        self.num_writes = 0

    def _empty(self) -> None:
        """No automaton placed: the next one goes right after the reserved state 0."""
        self._placed: dict[int, _Placed] = {}
        self._state_top, self._transition_top = 1, 0

    @staticmethod
    def nbytes_for(words: int, max_states: int, max_transitions: int) -> int:
        """Device bytes of tables of these sizes."""
        return max_states * (2 * words + 2) * 4 + max_transitions * 4 + words * 4

    @property
    def arrays(self) -> dict:
        """The device arrays (allocated on first use): ``bits`` / ``prefix`` ``int32[max_states, W]``, ``base`` /
        ``final`` ``int32[max_states]``, ``next`` ``int32[max_transitions]``, ``eos`` ``int32[W]``."""
        if self._arrays is None:
            import jax
            import jax.numpy as jnp

            def make():  # state 0: every token, EOS too (final), next state 0
                s, w = self.max_states, self.words
                return dict(bits=jnp.zeros((s, w), jnp.int32).at[0].set(-1), prefix=jnp.zeros((s, w), jnp.int32),
                            base=jnp.zeros(s, jnp.int32), final=jnp.zeros(s, jnp.int32).at[0].set(1),
                            next=jnp.zeros(self.max_transitions, jnp.int32), eos=jnp.asarray(self._eos))
            self._arrays = jax.jit(make, out_shardings=self.sharding)() if self.sharding is not None else make()
        return self._arrays

    def free(self) -> None:
        """Delete the device arrays and forget every placed automaton (``LLM.sleep``); the next :meth:`hold`
        allocates the arrays again and places its automaton anew.

        Raises:
            ValueError: a request still holds an automaton.
        """
        if self.num_held:
            raise ValueError(f"{self.num_held} automata are still held by requests")
        arrays, self._arrays = self._arrays, None
        for a in (arrays or {}).values():
            a.delete()
        self._empty()

    def is_placed(self, dfa: TokenDFA) -> bool:
        """``dfa`` is in the tables (held, or cached from an earlier holder)."""
        return id(dfa) in self._placed

    def offset(self, dfa: TokenDFA) -> int:
        """The global state of ``dfa``'s state 0 (it must be held)."""
        return self._placed[id(dfa)].state_offset

    def hold(self, dfa: TokenDFA) -> bool:
        """Place ``dfa`` (if it is not) and count one more holder; False when it does not fit beside the held
        automata (then nothing changes)."""
        placed = self._placed.get(id(dfa))
        if placed is None:
            if not self._fits(dfa):
                self._compact()
                if not self._fits(dfa):
                    return False
            placed = self._place(dfa)
        placed.refs += 1
        return True

    def release(self, dfa: TokenDFA) -> None:
        placed = self._placed.get(id(dfa))
        if placed is not None and placed.refs > 0:
            placed.refs -= 1

    @property
    def num_held(self) -> int:
        return sum(p.refs > 0 for p in self._placed.values())

    def _fits(self, dfa: TokenDFA) -> bool:
        return (self._state_top + dfa.num_states <= self.max_states
                and self._transition_top + dfa.num_transitions <= self.max_transitions)

    def _place(self, dfa: TokenDFA) -> _Placed:
        placed = _Placed(dfa, self._state_top, self._transition_top)
        self._state_top += dfa.num_states
        self._transition_top += dfa.num_transitions
        self._placed[id(dfa)] = placed
        self._upload(placed)
        return placed

    def _compact(self) -> None:
        """Drop the automata no request holds and place the held ones again from the tables' start."""
        kept = [p for p in self._placed.values() if p.refs > 0]
        self._empty()
        for p in kept:
            self._place(p.dfa).refs = p.refs

    def _upload(self, placed: _Placed) -> None:
        """Write ``placed``'s tables at its offsets (states renumbered to global ids), padded to powers of two so
        few shapes compile; the old arrays are donated."""
        import jax
        import jax.numpy as jnp
        dfa = placed.dfa
        s_pad = 1 << max(6, (dfa.num_states - 1).bit_length())
        t_pad = 1 << max(12, (max(dfa.num_transitions, 1) - 1).bit_length())

        def pad(a, n):
            return np.pad(a, [(0, n - a.shape[0])] + [(0, 0)] * (a.ndim - 1))
        seg = dict(bits=pad(dfa.bits, s_pad), prefix=pad(dfa.prefix, s_pad),
                   base=pad(dfa.base + placed.transition_offset, s_pad), final=pad(dfa.final, s_pad),
                   next=pad(dfa.next + placed.state_offset, t_pad))
        if self._write is None:
            def write(arrays, seg, s_off, t_off, n_s, n_t):
                i = jnp.arange(seg["bits"].shape[0])
                at_s = jnp.where(i < n_s, s_off + i, arrays["bits"].shape[0])
                j = jnp.arange(seg["next"].shape[0])
                at_t = jnp.where(j < n_t, t_off + j, arrays["next"].shape[0])
                out = dict(arrays)
                for k in ("bits", "prefix", "base", "final"):
                    out[k] = arrays[k].at[at_s].set(seg[k], mode="drop")
                out["next"] = arrays["next"].at[at_t].set(seg["next"], mode="drop")
                return out
            self._write = jax.jit(write, donate_argnums=(0,))
        self._arrays = self._write(self.arrays, seg, np.int32(placed.state_offset),
                                   np.int32(placed.transition_offset), np.int32(dfa.num_states),
                                   np.int32(dfa.num_transitions))
        self.num_writes += 1


if __name__ == "__main__":
    _serve()
