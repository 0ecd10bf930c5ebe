"""The device side of a step: flat inputs padded to buckets, one jitted function per bucket kind.

vLLM: ``vllm/v1/worker/gpu_model_runner.py`` (``_prepare_inputs``, CUDA-graph padding, ``execute_model``).
Two jitted functions, each compiled once per bucket (their argument shapes are the bucket sizes):

* **mixed step** — prefill chunks and decodes together: ``num_tokens`` padded to a token bucket (powers
  of two from 16 to ``max_num_batched_tokens``), requests padded to the largest request bucket (dummy
  rows own no token, ``seq_len`` 0); the attention metadata's static ``max_query_len`` is the token
  bucket, so the prefill kernel serves it;
* **decode loop** — only decodes: one token per request, requests padded to a request bucket (powers of
  two up to ``max_num_seqs``, dummy rows write to ``PAD_SLOT_ID``), ``num_scheduler_steps`` steps in one
  ``lax.scan``; a row runs its own number of steps and writes to ``PAD_SLOT_ID`` after them, so the step
  count is not part of the shape; slot mapping, sequence lengths and sampling stay on the device and only
  the sampled tokens come back. The decode kernel serves it (``max_query_len == 1``).

Neither program holds control flow with a device-side predicate: on GPU, XLA runs a ``lax.cond`` by
copying its predicate to the host and waiting for it, which made each jitted call block until the device
had nearly finished the step (11.8 of 15.7 ms of host work per round trip on an H100, docs/perf-notes.md,
session 8). So the scan runs all its iterations (those past every row's steps compute and discard), and
whether the sampler filters by top-k/top-p is a static argument decided on the host: a bucket has two
programs, the filtering one compiled when a batch first needs it.

Structured outputs with ``use_step_masks`` add two host callbacks to each step that has constrained rows (their
token masks computed on the host while the device runs the forward pass). A program with host callbacks does not
dispatch asynchronously: XLA:GPU runs its thunks on the calling thread and each callback waits for the stream, so
such a call returns when its loop is nearly done (session 27). Those calls are made on one dispatch thread, in
order, and return :class:`Deferred` tokens, so the engine prepares the next step meanwhile.

The caches are donated to each call (updated in place).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import checkify, io_callback
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkv.attention.metadata import AttentionMetadata
from jaxkv.checks import checked, checks_are_enabled, raise_if_error
from jaxkv.core.grammar_dfa import dfa_advance, dfa_bitmask
from jaxkv.core.request import Request
from jaxkv.core.structured_output import fill_bitmasks
from jaxkv.kv_cache.slot_mapping import slot_mapping_from_positions
from jaxkv.worker.executable_cache import program_devices
from jaxkv.worker.sampler import (
    SamplerFeatures,
    SamplingArrays,
    needs_top_k_top_p,
    raw_logprobs,
    sample_with_features,
    token_counts,
)

ModelFn = Callable[..., tuple[jax.Array, list[jax.Array]]]


def pow2_buckets(low: int, high: int) -> tuple[int, ...]:
    """``low, 2*low, 4*low, ...`` up to the first size ``>= high``."""
    sizes = [low]
    while sizes[-1] < high:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)


def _bucket(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def _per_group(block_tables, make):
    """``make(table)`` for a single ``[R, W]`` table; a tuple of one per group for ``[G, R, W]`` tables."""
    if block_tables.ndim == 2:
        return make(block_tables)
    return tuple(make(block_tables[g]) for g in range(block_tables.shape[0]))


def _scatter_rows(table: np.ndarray, rows: list[list[int]]) -> None:
    """``table[r, :len(rows[r])] = rows[r]`` for every row, as one NumPy scatter (no per-row call)."""
    if not rows:
        return
    lens = np.fromiter((len(ids) for ids in rows), np.int64, count=len(rows))
    flat = np.fromiter(itertools.chain.from_iterable(rows), np.int32, count=int(lens.sum()))
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    table[np.repeat(np.arange(len(rows)), lens), np.arange(flat.size) - starts] = flat


_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingArrays))


# Each array of a packed buffer starts at a multiple of this many 4-byte elements (256 bytes): a static slice of a
# parameter reaches a kernel as a pointer into it, and Mosaic GPU kernels refuse inputs that are not 256-byte
# aligned ("Input buffer 2 is not 256-byte aligned": a mixed step's block table, session 23).
PACK_ALIGN = 64


def _aligned(n: int) -> int:
    return -(-n // PACK_ALIGN) * PACK_ALIGN


def _pack(arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, tuple]:
    """One ``int32`` and one ``float32`` buffer holding every host input of a step, and their static
    layout ``((name, shape, dtype), ...)``: two host-to-device copies per step instead of one per array
    (about fifteen). ``uint32`` arrays travel as their ``int32`` bit patterns. Each array starts at a multiple
    of :data:`PACK_ALIGN` elements (zeros between them)."""
    ints, floats, layout = [], [], []
    for name, a in arrays.items():
        a = np.asarray(a)
        if a.dtype == np.float32:
            flat, out = a.ravel(), floats
        else:
            flat, out = (a.view(np.int32).ravel() if a.dtype == np.uint32
                         else a.astype(np.int32, copy=False).ravel()), ints
        out.append(flat)
        if flat.size % PACK_ALIGN:
            out.append(np.zeros(_aligned(flat.size) - flat.size, flat.dtype))
        layout.append((name, a.shape, a.dtype.name))
    empty = np.zeros(0, np.int32)
    return (np.concatenate(ints) if ints else empty,
            np.concatenate(floats) if floats else empty.astype(np.float32), tuple(layout))


def _unpack(ints: jax.Array, floats: jax.Array, layout: tuple) -> dict[str, jax.Array]:
    """Inverse of :func:`_pack` on the device (static slices, no copies after fusion)."""
    out, offsets = {}, {"float32": 0, "int32": 0}
    for name, shape, dtype in layout:
        kind = "float32" if dtype == "float32" else "int32"
        size = int(np.prod(shape, dtype=np.int64))
        buf = floats if kind == "float32" else ints
        a = buf[..., offsets[kind]:offsets[kind] + size].reshape(buf.shape[:-1] + tuple(shape))
        offsets[kind] += _aligned(size)
        out[name] = lax.bitcast_convert_type(a, jnp.uint32) if dtype == "uint32" else a
    return out


def _sampling_dict(sampling: SamplingArrays, extras: dict | None = None) -> dict[str, np.ndarray]:
    out = {f"sampling.{name}": getattr(sampling, name) for name in _SAMPLING_FIELDS}
    out.update({f"extra.{name}": a for name, a in (extras or {}).items()})
    return out


def _split_sampling(arrays: dict) -> tuple[dict, SamplingArrays, dict]:
    sampling = SamplingArrays(**{name: arrays.pop(f"sampling.{name}") for name in _SAMPLING_FIELDS})
    extras = {k[len("extra."):]: arrays.pop(k) for k in [k for k in arrays if k.startswith("extra.")]}
    return arrays, sampling, extras


def _pow2_at_least(n: int, low: int = 16) -> int:
    return max(low, 1 << max(0, int(n) - 1).bit_length())


def _logprobs_width(k: int, max_logprobs: int) -> int:
    """The static top-k width of a step whose rows ask for at most ``k`` (0: the sampled token only):
    a power of two capped at ``max_logprobs``, so few widths compile."""
    return 0 if k <= 0 else min(max_logprobs, _pow2_at_least(k, 1))


def _check_fed_tokens(input_ids, positions) -> None:
    """In check mode: every token fed at a real position (``>= 0``) has an id ``>= 0`` (a pending token
    taken from the previous step's output must have been sampled there)."""
    if checks_are_enabled():
        bad = (positions >= 0) & (input_ids < 0)
        checkify.check(~jnp.any(bad), "input_ids[{i}]={value} is fed at position {pos}: token ids must be >= 0",
                       i=jnp.argmax(bad), value=jnp.min(jnp.where(bad, input_ids, 0)),
                       pos=jnp.max(jnp.where(bad, positions, -1)))


def _raising(step):
    """A ``checked`` jitted step that raises its first failed check and returns the step's output."""
    def run(*args, **kwargs):
        err, out = step(*args, **kwargs)
        raise_if_error(err)
        return out
    run.jitted = step
    return run


def _executable_key(kind: str, ints, floats, static: dict) -> tuple:
    """The in-memory key of a step's executable: its kind, packed input shapes and static arguments (the
    weights, caches and previous tokens keep one shape and sharding for the runner's life)."""
    return (kind, ints.shape, floats.shape, tuple(sorted(static.items())))


@dataclasses.dataclass
class _WarmupProgram:
    """One program of the warm-up: ``lowered`` to compile, or ``payload`` (an executable-cache file's
    contents) to load; ``args``/``kwargs`` of its call, to lower it after all if the payload does not load."""

    step: "_LowerOnly"
    mem_key: tuple
    disk_key: str | None
    lowered: object = None
    payload: tuple | None = None
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)


def _temp_bytes(exe) -> int | None:
    """An executable's temporary buffers in bytes per device (``memory_analysis().temp_size_in_bytes``), or
    ``None`` where XLA gives no analysis."""
    try:
        stats = exe.memory_analysis()
    except Exception:  # noqa: BLE001 - a backend without the analysis
        return None
    temp = getattr(stats, "temp_size_in_bytes", None)
    return None if temp is None else int(temp)


class _LowerOnly:
    """Stands in for a jitted step during :meth:`ModelRunner.warmup`'s first pass: lowers the call
    (tracing it; nothing runs) into a :class:`_WarmupProgram` and returns the outputs' shapes
    (``jax.ShapeDtypeStruct``), so the warm-up code runs unchanged. With an
    :class:`~jaxkv.worker.executable_cache.ExecutableCache` holding the program, it reads the file instead
    (no tracing, no lowering; the warm-up loads the executables on threads afterwards) and returns
    placeholders (the outputs' tree from the file). The step's last output, the caches, is returned as the
    caches it was given (argument 1): lowering the next bucket with the real arrays keeps its input
    shardings those of the real calls, whose executables it must match."""

    def __init__(self, kind: str, step, sink: list, cache=None):
        self.kind = kind
        self.jitted = getattr(step, "jitted", step)  # a _raising wrapper's jitted (err, out) step
        self.checked = hasattr(step, "jitted")
        self.sink = sink
        self.cache = None if self.checked else cache

    def __call__(self, *args, **kwargs):
        program = _WarmupProgram(self, _executable_key(self.kind, args[2], args[3], kwargs),
                                 self.cache.key(self.kind, args, kwargs) if self.cache is not None else None)
        program.payload = self.cache.read(program.disk_key) if program.disk_key is not None else None
        if program.payload is not None:
            program.args, program.kwargs = args, kwargs
            self.sink.append(program)
            num_outputs = len(program.payload[2].children())  # out_tree: (outputs..., caches)
            return (None,) * (num_outputs - 1) + (args[1],)
        program.lowered = self.jitted.lower(*args, **kwargs)
        self.sink.append(program)
        out = program.lowered.out_info[1] if self.checked else program.lowered.out_info
        return (*out[:-1], args[1])


@dataclasses.dataclass
class StepResult:
    """Device results of one call (not yet fetched): ``tokens`` ``int32[R]`` (mixed) or
    ``int32[max_steps, R]`` (decode loop), optional logits of the same leading shape, ``last``
    ``int32[largest request bucket]``: each row's last sampled token (what the next step may read); with
    logprobs, :func:`jaxkv.worker.sampler.raw_logprobs`' dict of the sampled tokens (same leading shape as
    ``tokens``); with prompt logprobs, the same dict over the step's ``plp_indices``."""

    tokens: jax.Array
    logits: jax.Array | None
    last: jax.Array
    logprobs: dict | None = None
    prompt_logprobs: dict | None = None


class Deferred:
    """An output of a step dispatched on the runner's dispatch thread (masks inside the step: such a call
    returns only when its loop is nearly done): ``np.asarray`` waits for it; the next dispatch takes it as is."""

    def __init__(self, future, index: int):
        self._future = future
        self._index = index

    def result(self) -> jax.Array:
        return self._future.result()[self._index]

    def is_ready(self) -> bool:
        return self._future.done() and self.result().is_ready()

    def __array__(self, dtype=None, copy=None):
        a = np.asarray(self.result())
        return a if dtype is None else a.astype(dtype)


def _resolved(x):
    return x.result() if isinstance(x, Deferred) else x


def _with_grammar_bitmask(reqs: list, rows: list[int], num_rows: int, extras: dict, features, step_masks=None):
    """Structured outputs: ``extras["bitmask"]`` ``int32[num_rows, words]`` (each of ``rows`` filled by its
    grammar for its next token, every other row all ones) and ``features.bitmask``; ``features`` unchanged when
    ``rows`` is empty. With ``step_masks`` (a :class:`~jaxkv.core.structured_output.StepMasks`) the rows are
    registered with it instead and the step computes its masks by callback (``extras["grammar_id"]``
    ``int32[1]``, ``features.bitmask_in_step``)."""
    rows = [r for r in rows if not getattr(reqs[r].grammar, "on_device", False)]  # automata: _state_rows
    if not rows:
        return features
    if step_masks is not None:
        extras["grammar_id"] = np.array([step_masks.register(
            (r, reqs[r].grammar, reqs[r].num_prompt_tokens) for r in rows)], np.int32)
        return dataclasses.replace(features, bitmask=True, bitmask_in_step=True)
    bitmask = np.full((num_rows, reqs[rows[0]].grammar_words), -1, np.int32)
    fill_bitmasks([(reqs[r].grammar, r) for r in rows], bitmask)
    extras["bitmask"] = bitmask
    return dataclasses.replace(features, bitmask=True)


class ModelRunner:
    """Builds padded inputs from a :class:`jaxkv.core.scheduler.SchedulerOutput` and runs the jitted step.

    Args:
        model_fn: ``(params, input_ids, positions, kv_caches, metadata, logits_indices) -> (f32[n, vocab]
            logits, kv_caches)``, traceable.
        params: the model's parameters (not donated).
        kv_caches: one ``[2, num_blocks, num_kv_heads, block_size, head_size]`` array per layer (owned
            and donated from now on).
        block_size, max_model_len, max_num_seqs, max_num_batched_tokens, num_scheduler_steps: the
            engine's limits.
        max_num_stop_token_ids: width of the per-row stop-id table used to mask stop tokens before
            ``min_tokens``.
        max_logprobs: most ``logprobs`` / ``prompt_logprobs`` a request may ask for (vLLM's
            ``max_logprobs``).
        vocab_size: the logits' width (the penalties' per-slot counts; ``None``: requests with penalties are
            refused by the engine).
        return_logits: also return the logits of every sampled token (tests, accuracy scripts).
        num_kv_cache_groups: KV-cache groups of the model; with more than one, block tables are
            ``int32[num_kv_cache_groups, R, max_num_blocks_per_seq]`` (from ``Request.group_block_ids``) and
            ``model_fn`` gets a tuple of metadata, one per group (vLLM: one metadata per group).
        check_kernel_inputs: debug mode: both step functions run under ``checkify`` with jaxkv's value
            checks on (:mod:`jaxkv.checks`): every attention call's block table, sequence lengths and
            ``query_start_loc`` and every written slot are checked on the device, and a violation raises
            ``ValueError`` after the step (each step then waits for its result: no overlap).

    Raises:
        ValueError: caches of different shapes or a block size that disagrees with them.
    """

    def __init__(self, model_fn: ModelFn, params, kv_caches, *, block_size: int, max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, num_scheduler_steps: int,
                 max_num_stop_token_ids: int = 8, return_logits: bool = False,
                 check_kernel_inputs: bool = False, num_kv_cache_groups: int = 1, max_logprobs: int = 20,
                 vocab_size: int | None = None):
        shapes = {c.shape for c in kv_caches}
        if len(shapes) != 1:
            raise ValueError(f"kv_caches have different shapes: {sorted(shapes)}")
        (shape,) = shapes
        if shape[3] != block_size:
            raise ValueError(f"block_size={block_size} != cache block size {shape[3]}")
        # The jitted steps take the weights as a flat list of arrays: JAX flattens every argument on
        # every call, and an nnx.State of SmolLM2's 272 arrays cost ~300 us per call to flatten on the
        # CPU dev box against ~35 us as a list. The model still sees its own pytree (unflattened at trace).
        leaves, treedef = jax.tree.flatten(params)
        self.model_fn = lambda flat, *args, **kwargs: model_fn(jax.tree.unflatten(treedef, flat), *args, **kwargs)
        self.params = leaves
        self._treedef = treedef
        self._asleep = None  # sleep(): what wake_up() restores
        self._inflight = None  # the dispatch thread's last call (use_step_masks), whose caches are the current ones
        self._dispatcher = None
        self._defer = False
        self.num_deferred = 0  # calls made on the dispatch thread
        self.kv_caches = list(kv_caches)
        self.num_blocks = shape[1]
        self.block_size = block_size
        self.max_num_blocks_per_seq = -(-max_model_len // block_size)
        self.num_kv_cache_groups = num_kv_cache_groups
        self.num_scheduler_steps = num_scheduler_steps
        self.max_num_stop_token_ids = max_num_stop_token_ids
        self.max_logprobs = max_logprobs
        self.vocab_size = vocab_size
        self.return_logits = return_logits
        # decode loops run at least 2 rows: with one row XLA:GPU rewrites the small projections (an 8B's k and v:
        # 1 x 4096 x 1024) as a multiply that writes the whole weight-sized product and a column reduction; a
        # Llama-3.1-8B decode step took 7.7 ms of device time at 1 row and 4.6 ms at 2 (H200, session 20);
        # $JAXKV_MIN_DECODE_ROWS overrides it for A/B measurements
        min_rows = int(os.environ.get("JAXKV_MIN_DECODE_ROWS", 2))
        self.request_buckets = pow2_buckets(min(min_rows, max_num_seqs), max_num_seqs)
        self.token_buckets = pow2_buckets(min(16, max_num_batched_tokens), max_num_batched_tokens)
        self.prev_len = self.request_buckets[-1]  # length of a step's per-row last tokens
        self.num_compiles = 0
        self.transfer_s = self.call_s = 0.0  # host seconds in input transfers / jitted calls (dispatch)
        self._no_prev = None
        # on a mesh (caches with a NamedSharding): the previous step's tokens are replicated over it
        mesh = getattr(self.kv_caches[0].sharding, "mesh", None)
        self._replicated = None if mesh is None else NamedSharding(mesh, P())
        wrap = checked if check_kernel_inputs else (lambda fn: fn)
        self._mixed = jax.jit(wrap(self._packed_mixed_step), donate_argnums=(1, 5),
                              static_argnames=("layout", "max_query_len", "features", "prompt_logprobs"))
        self._decode = jax.jit(wrap(self._packed_decode_loop), donate_argnums=(1, 5),
                               static_argnames=("layout", "features"))
        # penalties' device state (allocated with the first request that has a penalty): per slot (a running
        # request's, held from its first step to its end) the counts of its generated tokens and its prompt's
        # tokens, updated by every step on the device, so a request with penalties needs no known history
        self.aux: dict = {}
        self._free_slots = list(range(self.request_buckets[-1] - 1, -1, -1))
        self._init_rows = jax.jit(self._packed_init_rows, donate_argnums=(0,))
        # structured outputs whose automaton is on the device (jaxkv.core.grammar_dfa.DFATables; use_dfa_tables):
        # a row's state lives in aux["dfa_state"] at its slot, as penalties' counts do
        self.dfa_tables = None
        self._init_dfa_rows = jax.jit(lambda states, at, values: states.at[at].set(values, mode="drop"),
                                      donate_argnums=(0,))
        if check_kernel_inputs:
            self._mixed, self._decode = _raising(self._mixed), _raising(self._decode)
        self._checked = check_kernel_inputs
        # (kind, packed shapes, static arguments) -> the executable warmup() compiled or loaded for it
        self.executables: dict[tuple, jax.stages.Compiled] = {}
        # the largest temporary buffer (bytes, per device) of the programs warmup() built (XLA's memory analysis);
        # None before warmup() or where XLA gives no analysis
        self.warmup_temp_bytes: int | None = None
        # structured outputs' masks computed inside the steps (use_step_masks); None: filled on the host per step
        self.step_masks = None

    @property
    def kv_caches(self) -> list[jax.Array]:
        """The KV caches (each step donates and replaces them); waits for a step still being dispatched."""
        self._wait_dispatch()
        return self._kv_caches

    @kv_caches.setter
    def kv_caches(self, caches) -> None:
        self._wait_dispatch()
        self._kv_caches = caches

    def _wait_dispatch(self) -> None:
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight.result()

    def use_step_masks(self, words: int) -> None:
        """Constrained rows get their masks inside each step (two ordered host callbacks per step of a decode loop
        and per mixed step: :class:`~jaxkv.core.structured_output.StepMasks`) instead of one host-filled mask
        per dispatch; ``words`` is the bitmask's ``ceil(vocab / 32)``. Call before :meth:`warmup`.

        Raises:
            ValueError: on a mesh of several devices (host callbacks in a partitioned program are not supported:
                such engines keep host-filled masks).
        """
        from jaxkv.core.structured_output import StepMasks
        if self._replicated is not None and len(self._replicated.mesh.devices.flat) > 1:
            raise ValueError(f"structured-output masks inside the step need one device, not a mesh "
                             f"{dict(self._replicated.mesh.shape)}")
        self.step_masks = StepMasks(words)
        # such a program's call returns only when its loop is nearly done (module docstring): it is made on one
        # dispatch thread, in order, so the engine prepares the next step meanwhile
        self._dispatcher = ThreadPoolExecutor(1, thread_name_prefix="jaxkv-dispatch")
        self._defer = True

    def use_dfa_tables(self, tables) -> None:
        """Structured outputs whose automaton is on the device (:class:`jaxkv.core.grammar_dfa.DFATables`, placed
        on this runner's device or replicated over its mesh): their rows' masks and states are computed inside
        the steps, with no host work per token. Call before :meth:`warmup`."""
        tables.sharding = self._replicated
        self.dfa_tables = tables

    def hold_dfa(self, dfa) -> bool:
        """:meth:`DFATables.hold <jaxkv.core.grammar_dfa.DFATables.hold>` ``dfa`` for a request. Placing it writes
        the tables, donating the old arrays: a step still being dispatched on the dispatch thread goes first (an
        automaton already placed only gains a holder, and waits for nothing)."""
        if not self.dfa_tables.is_placed(dfa):
            self._wait_dispatch()
        return self.dfa_tables.hold(dfa)

    def _begin_step_mask(self, grammar_id, tokens, positions, *inputs):
        """Start the host's masks of a step fed ``tokens`` at ``positions`` (``int32[R]``, ``-1``: the row does not
        run; :meth:`~jaxkv.core.structured_output.StepMasks.begin`); returns the ticket and ``inputs``, which now
        depend on the callback (the step's forward pass takes them, so XLA calls it first)."""
        ticket = io_callback(self.step_masks.begin, jax.ShapeDtypeStruct((), jnp.int32), grammar_id, tokens,
                             positions, ordered=True)
        ticket, *inputs = lax.optimization_barrier((ticket, *inputs))
        return ticket, inputs

    def _finish_step_mask(self, ticket, logits):
        """``int32[R, words]``: the masks begun for ``ticket``, asked for after ``logits`` (the forward pass) exist,
        so the host fills while the device computes."""
        return io_callback(self.step_masks.finish,
                           jax.ShapeDtypeStruct((logits.shape[0], self.step_masks.words), jnp.int32),
                           ticket, logits[0, 0], ordered=True)

    # -- weights and memory (RL: a trainer between generations) ----------------------------------------------
    def get_params(self):
        """The model's parameters, as the pytree ``model_fn`` takes (the engine's own arrays)."""
        self._wait_dispatch()
        return jax.tree.unflatten(self._treedef, self.params)

    def set_params(self, params) -> None:
        """Use ``params`` from now on: a pytree of ``model_fn``'s structure whose arrays have the current
        shapes and dtypes. Arrays on other devices or shardings are moved device to device onto the
        current ones, so the compiled steps are reused (no trace, no compile).

        Raises:
            ValueError: another structure, shape or dtype (naming the first leaf that differs).
        """
        self._wait_dispatch()  # a step still being dispatched runs with the weights it was scheduled with
        leaves, treedef = jax.tree.flatten(params)
        if treedef != self._treedef:
            raise ValueError(f"params have another structure than the model's: {treedef} != {self._treedef}")
        current = self.params if self._asleep is None or self._asleep[1] is None else self._asleep[1]
        new = []
        for i, (a, b) in enumerate(zip(leaves, current)):
            shape, dtype = tuple(getattr(a, "shape", ())), jnp.dtype(getattr(a, "dtype", type(a)))
            if shape != tuple(b.shape) or dtype != jnp.dtype(b.dtype):
                path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(self.get_params())[0][i][0]) \
                    if self._asleep is None else f"leaf {i}"
                raise ValueError(f"params{path}: shape={shape} dtype={dtype}, the model's is "
                                 f"shape={tuple(b.shape)} dtype={b.dtype}")
            sharding = getattr(b, "sharding", None)
            if not isinstance(a, jax.Array) or (sharding is not None and a.sharding != sharding):
                a = jax.device_put(a, sharding)
            new.append(a)
        if self._asleep is not None:
            self._asleep = (self._asleep[0], None)  # the new weights replace the offloaded ones
        self.params = new

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache's device memory (level 1 and 2), the structured outputs' automata tables, and the
        weights' (level 1: copied to host memory first; level 2: discarded, :meth:`set_params` must give new
        ones). vLLM ``LLM.sleep``.

        Raises:
            ValueError: ``level`` not 1 or 2, or already asleep.
        """
        if level not in (1, 2):
            raise ValueError(f"level={level} must be 1 (weights offloaded) or 2 (weights discarded)")
        if self._asleep is not None:
            raise ValueError("the engine is already asleep")
        specs = [(c.shape, c.dtype, c.sharding) for c in self.kv_caches]
        host = [np.asarray(jax.device_get(a)) for a in self.params] if level == 1 else None
        meta = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in self.params]
        for a in [*self.kv_caches, *self.params]:
            a.delete()
        if self.dfa_tables is not None:  # the structured outputs' automata (allocated again on the next hold)
            self.dfa_tables.free()
        self.kv_caches = []
        self.params = meta
        self._asleep = (specs, host)

    def wake_up(self) -> None:
        """Allocate the KV cache again (zeros) and bring the weights back (from host memory after level 1,
        or the ones :meth:`set_params` gave while asleep). vLLM ``LLM.wake_up``.

        Raises:
            ValueError: not asleep, or level 2 without new weights.
        """
        if self._asleep is None:
            raise ValueError("the engine is not asleep")
        specs, host = self._asleep
        if host is not None:
            self.params = [jax.device_put(h, m.sharding) for h, m in zip(host, self.params)]
        elif any(isinstance(a, jax.ShapeDtypeStruct) for a in self.params):
            raise ValueError("sleep(level=2) discarded the weights: give new ones with update_weights first")
        self.kv_caches = [jnp.zeros(shape, dtype, device=sharding) for shape, dtype, sharding in specs]
        self._asleep = None

    @property
    def is_sleeping(self) -> bool:
        return self._asleep is not None

    @property
    def num_buckets(self) -> int:
        """Distinct compiled shapes the engine can need: request buckets (decode loop) + token buckets
        (mixed step). Each has a second program for batches with a top-k/top-p row, compiled on first use
        (or by ``warmup(top_k_top_p=True)``), so ``num_compiles <= 2 * num_buckets``, and
        ``<= num_buckets`` while no request filters."""
        return len(self.request_buckets) + len(self.token_buckets)

    # -- device functions (traced once per bucket) --------------------------------------------------
    def _slot_mapping(self, block_tables, seq_ids, positions):
        return slot_mapping_from_positions(block_tables, seq_ids, positions, self.block_size)

    def _packed_mixed_step(self, params, kv_caches, ints, floats, prev_tokens, aux, tables, *, layout,
                           max_query_len, features, prompt_logprobs):
        inputs, sampling, extras = _split_sampling(_unpack(ints, floats, layout))
        return self._mixed_step(params, kv_caches, inputs, sampling, extras, prev_tokens, aux, tables,
                                max_query_len=max_query_len, features=features, prompt_logprobs=prompt_logprobs)

    def _packed_decode_loop(self, params, kv_caches, ints, floats, prev_tokens, aux, tables, *, layout, features):
        a, sampling, extras = _split_sampling(_unpack(ints, floats, layout))
        return self._decode_loop(params, kv_caches, a["tokens"], a["src_rows"], prev_tokens, a["positions"],
                                 a["steps"], a["block_tables"], sampling, extras, aux, tables, features=features)

    @staticmethod
    def _packed_init_rows(aux, slots, history, prompt_lens):
        """Slots ``slots`` (``int32[I]``, ``-1`` padding) start over from ``history`` (``int32[I, H]``: a
        request's known tokens, ``-1`` padded) split at ``prompt_lens``: output-token counts and prompt mask."""
        counts, mask = aux["counts"], aux["prompt_mask"]
        vocab = counts.shape[1]
        col = jnp.arange(history.shape[1])[None, :]
        row_counts = token_counts(jnp.where(col >= prompt_lens[:, None], history, -1), vocab)
        row_mask = token_counts(jnp.where(col < prompt_lens[:, None], history, -1), vocab) > 0
        at = jnp.where(slots >= 0, slots, counts.shape[0])
        return dict(counts=counts.at[at].set(row_counts, mode="drop"), prompt_mask=mask.at[at].set(row_mask, mode="drop"))

    @staticmethod
    def _slot_state(aux, extras):
        """The rows' penalty counts and prompt masks gathered from their slots (zeros for rows without one)."""
        slots = extras["slots"]
        has = (slots >= 0)[:, None]
        at = jnp.maximum(slots, 0)
        return jnp.where(has, aux["counts"][at], 0), has & aux["prompt_mask"][at]

    @staticmethod
    def _count_sampled(aux, extras, tokens, counted):
        """``counts[slot, token] += 1`` for the rows whose sampled ``tokens`` count (``bool[R]``)."""
        slots = extras["slots"]
        counts = aux["counts"]
        at = jnp.where((slots >= 0) & counted & (tokens >= 0), slots, counts.shape[0])
        return dict(aux, counts=counts.at[at, jnp.maximum(tokens, 0)].add(1, mode="drop"))

    @staticmethod
    def _dfa_states(aux, extras):
        """``int32[R]``: each automaton row's local state, read from its slot (0 for other rows)."""
        slots = extras["slots"]
        return jnp.where(extras["dfa_offset"] > 0, aux["dfa_state"][jnp.maximum(slots, 0)], 0)

    @staticmethod
    def _dfa_bitmask(tables, extras, states):
        """The step's grammar bitmask: each automaton row's allowed tokens (:func:`dfa_bitmask` of its global
        state ``dfa_offset + state``), and with llguidance rows too (``extras["bitmask"]``, from the host or the
        step's callback), their masks (every other row is all ones)."""
        offset = extras["dfa_offset"]
        mask = dfa_bitmask(tables, jnp.where(offset > 0, offset + states, 0))
        return mask & extras["bitmask"] if "bitmask" in extras else mask

    @staticmethod
    def _dfa_advance(tables, extras, states, tokens, moved):
        """Local states after the rows sampled ``tokens`` (rows where ``moved`` is False keep theirs)."""
        offset = extras["dfa_offset"]
        glob = jnp.where(offset > 0, offset + states, 0)
        return jnp.where(moved & (offset > 0), dfa_advance(tables, glob, tokens) - offset, states)

    @staticmethod
    def _store_dfa_states(aux, extras, states):
        """The automaton rows' local ``states`` back into their slots."""
        at = jnp.where((extras["slots"] >= 0) & (extras["dfa_offset"] > 0), extras["slots"],
                       aux["dfa_state"].shape[0])
        return dict(aux, dfa_state=aux["dfa_state"].at[at].set(states, mode="drop"))

    @staticmethod
    def _bad_tokens(extras: dict, tail: jax.Array) -> jax.Array:
        """``int32[R, NB]``: each bad word's last token where the row's last tokens (``tail``
        ``int32[R, M - 1]``, right-aligned, ``-1`` unknown) end with the word's other tokens, else ``-1``.
        ``extras["bad_seqs"]``: ``int32[R, NB, M]`` words left-padded with ``-1`` (a one-token word always
        matches)."""
        seqs = extras["bad_seqs"]
        prefix = seqs[:, :, :-1]
        match = jnp.all((prefix < 0) | (prefix == tail[:, None, :]), axis=-1) & (seqs[:, :, -1] >= 0)
        return jnp.where(match, seqs[:, :, -1], -1)

    def _sample(self, logits, sampling: SamplingArrays, extras: dict, features: SamplerFeatures, *,
                counts=None, prompt_mask=None, tail=None):
        if features.bad_words:
            extras = dict(extras, bad_ids=self._bad_tokens(extras, tail))
        return sample_with_features(logits, sampling, extras, features, output_counts=counts,
                                    prompt_mask=prompt_mask)

    def _mixed_step(self, params, kv_caches, inputs: dict, sampling: SamplingArrays, extras: dict, prev_tokens,
                    aux, tables, *, max_query_len, features: SamplerFeatures, prompt_logprobs: int):
        """``inputs``: ``input_ids``/``positions``/``seq_ids``/``src_rows`` ``int32[T]`` (position -1 =
        padding token; ``src_rows >= 0``: the id is ``prev_tokens[src_rows]``, a token the previous step
        sampled), ``seq_lens`` ``int32[R]``, ``query_start_loc`` ``int32[R + 1]``, ``block_tables``
        ``int32[R, max_num_blocks_per_seq]``, ``logits_indices`` ``int32[R]``; with ``prompt_logprobs >= 0``
        also ``plp_indices`` / ``plp_targets`` ``int32[Q]``: token slots whose next prompt token's logprob
        is wanted (``-1`` padding) and that token; ``prev_tokens`` ``int32[R]``. Returns the sampled
        ``int32[R]`` (also the next step's ``prev_tokens``), the sampled tokens' logprobs, the prompt
        logprobs, the logits (``return_logits``) and the caches."""
        self.num_compiles += 1
        src = inputs["src_rows"]
        input_ids = jnp.where(src >= 0, prev_tokens[jnp.maximum(src, 0)], inputs["input_ids"])
        positions = inputs["positions"]
        _check_fed_tokens(input_ids, positions)
        metadata = _per_group(inputs["block_tables"], lambda block_tables: AttentionMetadata(
            slot_mapping=self._slot_mapping(block_tables, inputs["seq_ids"], positions),
            seq_lens=inputs["seq_lens"], block_tables=block_tables,
            query_start_loc=inputs["query_start_loc"], max_query_len=max_query_len,
            max_seq_len=block_tables.shape[1] * self.block_size))
        indices = inputs["logits_indices"]
        num_rows = indices.shape[0]
        if features.bitmask_in_step:  # the sampled rows' masks start on the host before the forward pass
            ticket, (input_ids,) = self._begin_step_mask(extras["grammar_id"], input_ids[indices], positions[indices],
                                                         input_ids)
        if prompt_logprobs >= 0:
            indices = jnp.concatenate([indices, jnp.maximum(inputs["plp_indices"], 0)])
        logits, kv_caches = self.model_fn(params, input_ids, jnp.maximum(positions, 0), kv_caches, metadata, indices)
        plp = None
        if prompt_logprobs >= 0:
            logits, plp_logits = logits[:num_rows], logits[num_rows:]
            plp = raw_logprobs(plp_logits, inputs["plp_targets"], prompt_logprobs)
        counts = prompt_mask = tail = None
        if features.penalties:
            counts, prompt_mask = self._slot_state(aux, extras)
        if features.bad_words:
            tail = extras["bad_tail"]
        if features.bitmask_in_step:
            extras = dict(extras, bitmask=self._finish_step_mask(ticket, logits))
        states = None
        if features.grammar_dfa:
            states = self._dfa_states(aux, extras)
            extras = dict(extras, bitmask=self._dfa_bitmask(tables, extras, states))
        tokens, logprobs = self._sample(logits, sampling, extras, features, counts=counts, prompt_mask=prompt_mask,
                                        tail=tail)
        if features.penalties:
            aux = self._count_sampled(aux, extras, tokens, extras["counted"] > 0)
        if features.grammar_dfa:
            aux = self._store_dfa_states(aux, extras, self._dfa_advance(tables, extras, states, tokens,
                                                                        extras["counted"] > 0))
        return tokens, logprobs, plp, (logits if self.return_logits else None), aux, kv_caches

    def _decode_loop(self, params, kv_caches, tokens, src_rows, prev_tokens, positions, steps, block_tables,
                     sampling: SamplingArrays, extras: dict, aux, tables, *, features: SamplerFeatures):
        """Runs ``num_scheduler_steps`` steps; row ``r`` decodes in the first ``steps[r]`` and writes
        nothing after them (every iteration computes: no ``lax.cond``, see the module docstring).
        Returns ``int32[num_scheduler_steps, R]`` tokens (-1 where a row did not run), each row's last
        token padded to ``prev_len`` (the next step's ``prev_tokens``), the sampled tokens' logprobs
        (stacked by step), the logits (``return_logits``), the caches. Penalty counts and bad-word tails
        follow the tokens sampled inside the loop."""
        self.num_compiles += 1
        tokens = jnp.where(src_rows >= 0, prev_tokens[jnp.maximum(src_rows, 0)], tokens)
        num_reqs = tokens.shape[0]
        rows = jnp.arange(num_reqs, dtype=jnp.int32)

        def metadata_for(fed):
            return _per_group(block_tables, lambda table: AttentionMetadata(
                slot_mapping=self._slot_mapping(table, rows, fed),
                seq_lens=jnp.where(fed >= 0, fed + 1, 1).astype(jnp.int32), block_tables=table,
                query_start_loc=jnp.arange(num_reqs + 1, dtype=jnp.int32), max_query_len=1,
                max_seq_len=table.shape[1] * self.block_size))

        counts = prompt_mask = tail = states = jnp.zeros((), jnp.int32)  # placeholders in the carry when unused
        if features.penalties:
            counts, prompt_mask = self._slot_state(aux, extras)
        if features.bad_words:
            tail = extras["bad_tail"]
        if features.grammar_dfa:
            states = self._dfa_states(aux, extras)

        def run(i, carry):
            toks, pos, gen, counts, tail, states, caches = carry
            active = i < steps
            fed = jnp.where(active, pos, -1)  # -1 → PAD slot: finished and dummy rows write nothing
            _check_fed_tokens(toks, fed)
            fed_toks = toks
            if features.bitmask_in_step:  # this step's masks start on the host, its fed tokens advancing the matchers
                ticket, (fed_toks,) = self._begin_step_mask(extras["grammar_id"], toks, fed, toks)
            logits, caches = self.model_fn(params, fed_toks, jnp.maximum(fed, 0), caches, metadata_for(fed), rows)
            step_extras = extras
            if features.bitmask_in_step:  # ... and are taken once the forward pass is done
                step_extras = dict(extras, bitmask=self._finish_step_mask(ticket, logits))
            if features.grammar_dfa:
                step_extras = dict(step_extras, bitmask=self._dfa_bitmask(tables, step_extras, states))
            new, logprobs = self._sample(logits, dataclasses.replace(sampling, gen_idx=gen), step_extras, features,
                                         counts=counts if features.penalties else None,
                                         prompt_mask=prompt_mask if features.penalties else None, tail=tail)
            new = jnp.where(active, new, -1)
            step = active.astype(jnp.int32)
            if features.penalties:
                counts = counts.at[rows, jnp.where(active, new, counts.shape[-1])].add(1, mode="drop")
            if features.bad_words:
                tail = jnp.where(active[:, None], jnp.concatenate([tail[:, 1:], new[:, None]], axis=1), tail)
            if features.grammar_dfa:
                states = self._dfa_advance(tables, extras, states, new, active)
            return ((jnp.where(active, new, toks), pos + step, gen + step, counts, tail, states, caches),
                    (new, logprobs, logits if self.return_logits else None))

        carry0 = (tokens, positions, sampling.gen_idx, counts, tail, states, kv_caches)
        (_, _, _, counts, _, states, kv_caches), (out_tokens, out_logprobs, out_logits) = lax.scan(
            lambda carry, i: run(i, carry), carry0, jnp.arange(self.num_scheduler_steps, dtype=jnp.int32))
        if features.penalties:  # the rows' counts back into their slots
            slots = extras["slots"]
            at = jnp.where(slots >= 0, slots, aux["counts"].shape[0])
            aux = dict(aux, counts=aux["counts"].at[at].set(counts, mode="drop"))
        if features.grammar_dfa:
            aux = self._store_dfa_states(aux, extras, states)
        last = jnp.where(steps > 0, out_tokens[jnp.maximum(steps - 1, 0), rows], -1)
        last = jnp.pad(last, (0, self.prev_len - num_reqs), constant_values=-1)
        return out_tokens, last, out_logprobs, out_logits, aux, kv_caches

    # -- host side ------------------------------------------------------------------------------------
    def _block_table(self, reqs: list[Request], num_rows: int) -> np.ndarray:
        if self.num_kv_cache_groups > 1:
            return self._group_block_tables(reqs, num_rows)
        table = np.zeros((num_rows, self.max_num_blocks_per_seq), np.int32)
        _scatter_rows(table, [r.block_ids for r in reqs])
        return table

    def _group_block_tables(self, reqs: list[Request], num_rows: int) -> np.ndarray:
        """``int32[num_kv_cache_groups, num_rows, max_num_blocks_per_seq]`` from ``group_block_ids``."""
        table = np.zeros((self.num_kv_cache_groups, num_rows, self.max_num_blocks_per_seq), np.int32)
        for g in range(self.num_kv_cache_groups):
            _scatter_rows(table[g], [r.group_block_ids[g] for r in reqs])
        return table

    def _empty_tables(self, num_rows: int) -> np.ndarray:
        lead = (self.num_kv_cache_groups,) if self.num_kv_cache_groups > 1 else ()
        return np.zeros((*lead, num_rows, self.max_num_blocks_per_seq), np.int32)

    def _sampling_arrays(self, reqs: list[Request], num_rows: int, gen_idx_rows=(), *,
                         top_k_top_p: bool = False) -> tuple[SamplingArrays, dict, SamplerFeatures]:
        """Host (NumPy) per-row sampling parameters, the extras the rows' options need and the step's static
        :class:`SamplerFeatures`; sent with the step's other inputs in one transfer. ``top_k_top_p``
        (warm-up): padding rows that select the filtering program."""
        temperature = np.zeros(num_rows, np.float32)
        top_p = np.ones(num_rows, np.float32)
        if top_k_top_p:
            temperature[:] = 1.0
            top_p[:] = 0.5
        top_k = np.full(num_rows, -1, np.int32)
        seeds = np.zeros(num_rows, np.uint32)
        gen_idx = np.zeros(num_rows, np.int32)
        min_tokens = np.zeros(num_rows, np.int32)
        stop_ids = np.full((num_rows, self.max_num_stop_token_ids), -1, np.int32)
        n = len(reqs)
        sps = [r.sampling_params for r in reqs]
        if n:
            temperature[:n] = [sp.temperature for sp in sps]
            top_p[:n] = [sp.top_p for sp in sps]
            top_k[:n] = [sp.top_k for sp in sps]
            seeds[:n] = [r.seed & 0xFFFFFFFF for r in reqs]
            gen_idx[:n] = gen_idx_rows
            for r, req in enumerate(reqs):
                if req.sampling_params.min_tokens > gen_idx[r]:
                    min_tokens[r] = req.sampling_params.min_tokens
                    ids = sorted(req.stop_ids_for_min_tokens)
                    stop_ids[r, :len(ids)] = ids
        sampling = SamplingArrays(temperature, top_p, top_k, seeds, gen_idx, min_tokens, stop_ids)
        extras: dict[str, np.ndarray] = {}
        under_min_tokens = bool(np.any(min_tokens > 0))  # the stop-id mask: only when a row needs it
        if not any(r.sampling_special for r in reqs):  # the common batch: no per-feature pass
            return sampling, extras, SamplerFeatures(min_tokens=under_min_tokens,
                                                     top_k_top_p=needs_top_k_top_p(temperature, top_p, top_k))
        widths = [sp.logprobs for sp in sps if sp.logprobs is not None]
        features = SamplerFeatures(
            min_tokens=under_min_tokens,
            top_k_top_p=needs_top_k_top_p(temperature, top_p, top_k),
            min_p=any(sp.min_p > 0 for sp in sps),
            penalties=any(sp.has_penalties for sp in sps),
            logit_bias=any(sp.logit_bias for sp in sps),
            allowed=any(sp.allowed_token_ids for sp in sps),
            bad_words=any(sp.bad_words_token_ids for sp in sps),
            grammar_dfa=any(getattr(r.grammar, "on_device", False) for r in reqs),
            num_logprobs=_logprobs_width(max(widths), self.max_logprobs) if widths else -1)
        if features.grammar_dfa:  # the automata's masks (and llguidance's rows', if any) are applied as one bitmask
            features = dataclasses.replace(features, bitmask=True)
        if features.min_p:
            extras["min_p"] = np.zeros(num_rows, np.float32)
            extras["min_p"][:n] = [sp.min_p for sp in sps]
        if features.penalties or features.grammar_dfa:
            extras.update(self._state_rows(reqs, sps, num_rows, features))
        if features.logit_bias:
            width = _pow2_at_least(max(len(sp.logit_bias or ()) for sp in sps), 8)
            ids = np.full((num_rows, width), -1, np.int32)
            values = np.zeros((num_rows, width), np.float32)
            for r, sp in enumerate(sps):
                if sp.logit_bias:
                    ids[r, :len(sp.logit_bias)] = list(sp.logit_bias)
                    values[r, :len(sp.logit_bias)] = list(sp.logit_bias.values())
            extras.update(bias_ids=ids, bias_values=values)
        if features.allowed:
            width = _pow2_at_least(max(len(sp.allowed_token_ids or ()) for sp in sps), 8)
            ids = np.full((num_rows, width), -1, np.int32)
            has = np.zeros(num_rows, np.int32)
            for r, sp in enumerate(sps):
                if sp.allowed_token_ids:
                    ids[r, :len(sp.allowed_token_ids)] = sp.allowed_token_ids
                    has[r] = 1
            extras.update(allowed_ids=ids, has_allowed=has)
        if features.bad_words:
            words = [sp.bad_words_token_ids or () for sp in sps]
            num = _pow2_at_least(max(len(w) for w in words), 4)
            length = max(2, max(len(s) for w in words for s in w))
            seqs = np.full((num_rows, num, length), -1, np.int32)
            tail = np.full((num_rows, length - 1), -1, np.int32)
            for r, w in enumerate(words):
                for j, s in enumerate(w):
                    seqs[r, j, length - len(s):] = s
                if w:
                    known = reqs[r].all_token_ids[-(length - 1):]
                    tail[r, length - 1 - len(known):] = known
            extras.update(bad_seqs=seqs, bad_tail=tail)
        return sampling, extras, features

    def _state_rows(self, reqs: list[Request], sps, num_rows: int, features: SamplerFeatures) -> dict[str, np.ndarray]:
        """Each penalty or automaton row's slot (a request's first step takes a free one and its state starts from
        its known tokens, set before the step: :meth:`_init_rows` counts them, an automaton starts from the host's
        state after them); penalties; each automaton row's ``dfa_offset`` (its automaton's place in the tables,
        0 for other rows)."""
        if features.penalties and "counts" not in self.aux:
            self._allocate_aux()
        if features.grammar_dfa and "dfa_state" not in self.aux:
            self.aux["dfa_state"] = self._zeros((self.request_buckets[-1],), jnp.int32)
        slots = np.full(num_rows, -1, np.int32)
        presence = np.zeros(num_rows, np.float32)
        frequency = np.zeros(num_rows, np.float32)
        repetition = np.ones(num_rows, np.float32)
        offsets = np.zeros(num_rows, np.int32)
        fresh, fresh_dfa = [], []
        for r, (req, sp) in enumerate(zip(reqs, sps)):
            on_device = getattr(req.grammar, "on_device", False)
            if not (sp.has_penalties or on_device):
                continue
            if req.penalty_slot is None:
                req.penalty_slot = self._free_slots.pop()
                if sp.has_penalties:
                    fresh.append(req)
                if on_device:
                    fresh_dfa.append(req)
            slots[r] = req.penalty_slot
            presence[r], frequency[r], repetition[r] = sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty
            if on_device:
                offsets[r] = self.dfa_tables.offset(req.grammar.dfa)
        if fresh_dfa:  # its tokens are all known (as below): the host's state is the row's
            at = np.full(_pow2_at_least(len(fresh_dfa), 4), self.request_buckets[-1], np.int32)
            values = np.zeros(at.shape, np.int32)
            for i, req in enumerate(fresh_dfa):
                req.grammar.accept(req.output_token_ids[req.grammar.num_consumed:])
                at[i], values[i] = req.penalty_slot, req.grammar.state
            self.aux["dfa_state"] = self._init_dfa_rows(self.aux["dfa_state"], at, values)
        out = dict(slots=slots)
        if features.grammar_dfa:
            out["dfa_offset"] = offsets
        if not features.penalties:
            return out
        if fresh:
            width = _pow2_at_least(max(req.num_tokens for req in fresh), 64)
            num = _pow2_at_least(len(fresh), 4)
            hist = np.full((num, width), -1, np.int32)
            plen = np.zeros(num, np.int32)
            init = np.full(num, -1, np.int32)
            for i, req in enumerate(fresh):  # its tokens are all known: placeholders wait (see Scheduler)
                hist[i, :req.num_tokens] = req.token_array()
                plen[i] = req.num_prompt_tokens
                init[i] = req.penalty_slot
            counts = self._init_rows({k: self.aux[k] for k in ("counts", "prompt_mask")}, jnp.asarray(init),
                                     jnp.asarray(hist), jnp.asarray(plen))
            self.aux = {**self.aux, **counts}
        return dict(out, presence=presence, frequency=frequency, repetition=repetition)

    def _zeros(self, shape, dtype):
        """Zeros on the runner's device (replicated over its mesh)."""
        z = jnp.zeros(shape, dtype)
        return z if self._replicated is None else jax.device_put(z, self._replicated)

    def _allocate_aux(self) -> None:
        slots, vocab = self.request_buckets[-1], self.vocab_size
        self.aux = dict(self.aux, counts=self._zeros((slots, vocab), jnp.int32),
                        prompt_mask=self._zeros((slots, vocab), jnp.bool_))

    def release_slot(self, req: Request) -> None:
        """A request that finished or was preempted gives its slot (penalties' counts, an automaton's state) back
        (a later step that takes it starts the row over before using it; steps already dispatched run before that
        on the device)."""
        if req.penalty_slot is not None:
            self._free_slots.append(req.penalty_slot)
            req.penalty_slot = None

    def _prev(self, prev_tokens):
        """The previous step's last tokens (``int32[prev_len]``; all -1 when there is none). On a mesh
        (caches with a ``NamedSharding``) they are replicated over it, so the placeholder of the warm-up
        and a step's output are one input type and share one executable (a single-device placeholder
        made each bucket's first real step after the warm-up compile again)."""
        if isinstance(prev_tokens, Deferred):
            return prev_tokens  # a deferred step's (one device): the dispatch resolves it in order
        if prev_tokens is None:
            if self._no_prev is None:
                self._no_prev = jnp.full(self.prev_len, -1, jnp.int32)
                if self._replicated is not None:
                    self._no_prev = jax.device_put(self._no_prev, self._replicated)
            return self._no_prev
        return prev_tokens if self._replicated is None else jax.device_put(prev_tokens, self._replicated)

    def execute_mixed(self, sched, src_rows=None, prev_tokens=None) -> StepResult:
        """One step of prefill chunks and decodes (``sched``: a committed
        :class:`jaxkv.core.scheduler.SchedulerOutput`): ``tokens[r]`` is request ``r``'s next token (meaningful
        where ``sched.samples[r]``). ``src_rows[r] >= 0``: request ``r``'s input token is
        ``prev_tokens[src_rows[r]]`` (sampled by the previous, still running step)."""
        t = _bucket(sched.total_num_scheduled_tokens, self.token_buckets)
        inputs, sampling, extras, features, plp_k = self.prepare_mixed(sched, src_rows, self.request_buckets[-1], t)
        tokens, logprobs, plp, logits = self._run_mixed(inputs, sampling, extras, features, prev_tokens,
                                                         max_query_len=t, prompt_logprobs=plp_k)
        return StepResult(tokens, logits, tokens, logprobs, plp)

    def prepare_mixed(self, sched, src_rows, num_rows: int, t: int):
        """Host (NumPy) inputs of a mixed step: ``num_rows`` rows, ``t`` token slots; returns ``(inputs,
        sampling arrays, extras, features, prompt-logprobs width)`` (width ``-1``: no row wants prompt
        logprobs). A row with ``prompt_logprobs`` gets, for every prompt position of its chunk whose next
        token is a prompt token, that token's logprob (``plp_indices`` / ``plp_targets``), recorded in
        ``sched``'s ``plp_rows`` as ``(request, first position, count)``."""
        scheduled = sched.scheduled
        reqs = [r for r, _ in scheduled]
        n = len(reqs)
        q_lens = np.array([k for _, k in scheduled], np.int32)
        context = np.array(sched.context_lens, np.int32)
        num_tokens = int(q_lens.sum())
        ids = np.zeros(t, np.int32)
        pos = np.full(t, -1, np.int32)
        seq_ids = np.zeros(t, np.int32)
        src = np.full(t, -1, np.int32)
        c = 0
        for r, (req, start, k) in enumerate(zip(reqs, context, q_lens)):
            known = min(k, max(0, req.num_tokens - start))
            ids[c:c + known] = req.all_token_ids[start:start + known]
            if known < k:  # a decode whose input is the token the previous step is sampling
                src[c + k - 1] = src_rows[r]
            c += k
        pos[:num_tokens] = np.arange(num_tokens) - np.repeat(np.cumsum(q_lens) - q_lens - context, q_lens)
        seq_ids[:num_tokens] = np.repeat(np.arange(n, dtype=np.int32), q_lens)
        seq_lens = np.zeros(num_rows, np.int32)
        seq_lens[:n] = context + q_lens
        qsl = np.full(num_rows + 1, num_tokens, np.int32)
        qsl[0] = 0
        qsl[1:n + 1] = np.cumsum(q_lens)
        last = np.zeros(num_rows, np.int32)
        last[:n] = qsl[1:n + 1] - 1
        inputs = dict(input_ids=ids, positions=pos, seq_ids=seq_ids, src_rows=src, seq_lens=seq_lens,
                      query_start_loc=qsl, block_tables=self._block_table(reqs, num_rows), logits_indices=last)
        plp_k = -1
        sched.plp_rows = []
        slots, targets = [], []
        starts = qsl[:n] if n else []
        special = [r for r, req in enumerate(reqs) if req.sampling_special]
        for r in special:
            req = reqs[r]
            if req.prompt_logprobs is None:
                continue
            first = max(context[r], len(req.prompt_logprobs))  # positions already recorded are skipped
            end = min(context[r] + q_lens[r], req.num_prompt_tokens - 1)  # position p predicts prompt token p+1
            if end <= first:
                continue
            base = starts[r] - context[r]
            slots.extend(range(base + first, base + end))
            targets.extend(req.prompt_token_ids[first + 1:end + 1])
            sched.plp_rows.append((req, first, end - first))
            plp_k = max(plp_k, req.sampling_params.prompt_logprobs)
        if plp_k >= 0:
            q = _pow2_at_least(len(slots), 16)
            inputs["plp_indices"] = np.full(q, -1, np.int32)
            inputs["plp_indices"][:len(slots)] = slots
            inputs["plp_targets"] = np.zeros(q, np.int32)
            inputs["plp_targets"][:len(targets)] = targets
            plp_k = _logprobs_width(plp_k, self.max_logprobs)
        sampling, extras, features = self._sampling_arrays(reqs, num_rows, sched.gen_idx)
        if features.penalties or features.grammar_dfa:  # which rows' sampled tokens are real (not a prompt chunk's)
            extras["counted"] = np.zeros(num_rows, np.int32)
            extras["counted"][:n] = sched.samples
        features = _with_grammar_bitmask(
            reqs, [r for r in special if reqs[r].grammar is not None and sched.samples[r]], num_rows, extras, features,
            self.step_masks)
        return inputs, sampling, extras, features, plp_k

    def _run_mixed(self, inputs: dict, sampling: SamplingArrays, extras: dict, features: SamplerFeatures,
                   prev_tokens, *, max_query_len: int, prompt_logprobs: int = -1):
        ints, floats, layout = _pack(inputs | _sampling_dict(sampling, extras))
        tokens, logprobs, plp, logits, aux = self._dispatch(
            "mixed", self._mixed, ints, floats, self._prev(prev_tokens), self._step_aux(features),
            self._step_tables(features), layout=layout, max_query_len=max_query_len, features=features,
            prompt_logprobs=prompt_logprobs)
        if aux:
            self.aux = {**self.aux, **aux}
        return tokens, logprobs, plp, logits

    def _run_decode(self, arrays: dict, sampling: SamplingArrays, extras: dict, features: SamplerFeatures,
                    prev_tokens):
        ints, floats, layout = _pack(arrays | _sampling_dict(sampling, extras))
        out, last, logprobs, logits, aux = self._dispatch(
            "decode", self._decode, ints, floats, self._prev(prev_tokens), self._step_aux(features),
            self._step_tables(features), layout=layout, features=features)
        if aux:
            self.aux = {**self.aux, **aux}
        return out, last, logprobs, logits

    def _step_aux(self, features: SamplerFeatures) -> dict:
        """The device state a step with ``features`` reads and returns (donated): penalties' counts and prompt
        masks, automata's states."""
        keys = (("counts", "prompt_mask") if features.penalties else ()) + (
            ("dfa_state",) if features.grammar_dfa else ())
        return {k: self.aux[k] for k in keys}

    def _step_tables(self, features: SamplerFeatures) -> dict:
        """The automata's tables (read only) for a step with ``features.grammar_dfa``, else nothing."""
        return self.dfa_tables.arrays if features.grammar_dfa else {}

    def _put_packed(self, ints: np.ndarray, floats: np.ndarray):
        """The packed host buffers on the device (one batched transfer)."""
        return jax.device_put((ints, floats))

    def _dispatch(self, kind: str, step, ints, floats, *args, **static):
        """Transfer the packed buffers and call the ``kind`` step: the executable the warm-up compiled or
        loaded for these shapes (``executables``), else the jitted ``step`` (caches donated and replaced);
        returns its outputs but the caches. Adds the host seconds of the transfer to ``transfer_s`` and
        of the call to ``call_s``. A program with masks inside the step whose outputs are plain arrays (no
        penalties, logprobs or logits) is called on the dispatch thread instead (``use_step_masks``): its outputs
        come back as :class:`Deferred`."""
        features = static.get("features")
        if (self._defer and features is not None and features.bitmask_in_step and not features.penalties
                and not features.grammar_dfa
                and features.num_logprobs < 0 and not self.return_logits and static.get("prompt_logprobs", -1) < 0):
            # one thread, in order: the previous deferred call's caches are this one's input there
            future = self._dispatcher.submit(self._dispatch_now, kind, step, ints, floats, *args, **static)
            self._inflight = future
            self.num_deferred += 1
            # decode: (tokens, last, ...); mixed: (tokens, ...); the rest is None (no logprobs, logits, penalties)
            return [Deferred(future, 0), Deferred(future, 1) if kind == "decode" else None, None, None, None]
        self._wait_dispatch()
        return self._dispatch_now(kind, step, ints, floats, *args, **static)

    def _dispatch_now(self, kind: str, step, ints, floats, *args, **static):
        args = [_resolved(a) for a in args]
        t0 = time.perf_counter()
        ints, floats = self._put_packed(ints, floats)
        t1 = time.perf_counter()
        exe = (self.executables.get(_executable_key(kind, ints, floats, static))
               if self.executables and not isinstance(step, _LowerOnly) else None)
        if exe is not None:
            *out, self._kv_caches = exe(self.params, self._kv_caches, ints, floats, *args)
        else:
            *out, self._kv_caches = step(self.params, self._kv_caches, ints, floats, *args, **static)
        self.transfer_s += t1 - t0
        self.call_s += time.perf_counter() - t1
        return out

    def warmup(self, max_workers: int | None = None, top_k_top_p: bool = False, run: bool | None = None,
               executable_cache=None, bitmask_words: int | None = None) -> None:
        """Compile every bucket now (vLLM captures its CUDA graphs at start-up), then (``run``) run each
        once with a dummy batch whose tokens all go to ``PAD_SLOT_ID`` (the cache is not written; the
        outputs are discarded).

        The buckets are traced and lowered one after another, then compiled by ``max_workers`` threads
        at once (default: one per CPU core; XLA's compiler releases the GIL), so start-up takes about
        the longest compile instead of their sum on a many-core host. Each executable is kept in
        ``executables`` and later steps of its shapes call it directly. With ``executable_cache`` (an
        :class:`~jaxkv.worker.executable_cache.ExecutableCache`), programs it holds are loaded instead
        of traced, lowered and compiled, and new ones are stored in it. ``run`` defaults to True except
        on CPU: there a run of every bucket's all-padding batch computes every padded token (minutes for
        4096-token buckets) and buys nothing. Afterwards ``num_compiles == num_buckets`` (loaded
        programs count); with ``top_k_top_p`` the programs for batches with a top-k/top-p row are
        compiled too (``2 * num_buckets``), and with ``bitmask_words`` (structured outputs: the bitmask's
        ``ceil(vocab / 32)``) each of those again with a grammar bitmask (``x 2``): without them a server's first
        constrained batches compiled mid-run (3 programs in a json_schema run on an H100, session 26). With
        :meth:`use_dfa_tables` those are the programs of automaton rows (the masks of llguidance's grammars,
        which automata cannot express, then compile on first use)."""
        variants = [(tkp, words) for tkp in ((False, True) if top_k_top_p else (False,))
                    for words in ((None, bitmask_words) if bitmask_words else (None,))]
        defer, self._defer = self._defer, False  # the warm-up's calls wait for their outputs themselves
        try:
            self._warmup(variants, max_workers, run, executable_cache)
        finally:
            self._defer = defer

    def _warmup(self, variants, max_workers, run, executable_cache) -> None:
        programs: list[_WarmupProgram] = []
        saved = self._mixed, self._decode, self.kv_caches
        self._mixed = _LowerOnly("mixed", self._mixed, programs, executable_cache)
        self._decode = _LowerOnly("decode", self._decode, programs, executable_cache)
        try:
            for flag, words in variants:
                self._warmup_batches(flag, words)
        finally:
            self._mixed, self._decode, self.kv_caches = saved
            # the lowered steps returned shapes for the device state they update: keep the arrays
            self.aux = {k: v for k, v in self.aux.items() if isinstance(v, jax.Array)}

        def build(program: _WarmupProgram):
            if program.lowered is None:  # loading releases the GIL: a GPU executable takes ~0.5 s (session 21)
                return executable_cache.load_payload(program.disk_key, program.payload,
                                                  program_devices(program.args[1][0]))
            return program.lowered.compile()
        workers = max_workers or min(len(programs), os.cpu_count() or 1)
        fresh = executable_cache.fresh_compiles() if executable_cache is not None else contextlib.nullcontext()
        with fresh, ThreadPoolExecutor(max(1, workers)) as pool:
            built = list(pool.map(build, programs))
        for program, exe in zip(programs, built):
            if exe is None:  # its file did not load (deleted by load_payload): trace, lower and compile it now
                program.lowered = program.step.jitted.lower(*program.args, **program.kwargs)
                with executable_cache.fresh_compiles():
                    exe = program.lowered.compile()
            elif program.lowered is None:
                self.num_compiles += 1  # loaded: counts as the bucket's compile (nothing was traced)
            if not self._checked:  # a checkify step returns (error, outputs): it keeps its _raising wrapper
                self.executables[program.mem_key] = exe
            if program.lowered is not None and program.disk_key is not None:
                executable_cache.store(program.disk_key, exe)
            temp = _temp_bytes(exe)
            if temp is not None:
                self.warmup_temp_bytes = max(self.warmup_temp_bytes or 0, temp)
        if run is None:
            run = jax.default_backend() != "cpu"
        for flag, words in variants if run else ():
            self._warmup_batches(flag, words)

    def _warmup_batches(self, top_k_top_p: bool = False, bitmask_words: int | None = None) -> None:
        """One all-padding call per bucket: every token bucket's mixed step, then every request
        bucket's decode loop (their top-k/top-p programs if ``top_k_top_p``; with an all-ones grammar bitmask of
        ``bitmask_words`` words per row if given)."""

        def sampling(rows, mixed=False):
            sampling, extras, features = self._sampling_arrays([], rows, top_k_top_p=top_k_top_p)
            if bitmask_words and self.dfa_tables is not None:  # automata: no row has one (state 0: all ones)
                if "dfa_state" not in self.aux:
                    self.aux["dfa_state"] = self._zeros((self.request_buckets[-1],), jnp.int32)
                extras.update(slots=np.full(rows, -1, np.int32), dfa_offset=np.zeros(rows, np.int32))
                if mixed:
                    extras["counted"] = np.zeros(rows, np.int32)
                features = dataclasses.replace(features, bitmask=True, grammar_dfa=True)
            elif bitmask_words and self.step_masks is not None:  # an id no dispatch has: all-ones masks
                extras["grammar_id"] = np.full(1, -1, np.int32)
                features = dataclasses.replace(features, bitmask=True, bitmask_in_step=True)
            elif bitmask_words:
                extras["bitmask"] = np.full((rows, bitmask_words), -1, np.int32)
                features = dataclasses.replace(features, bitmask=True)
            return sampling, extras, features
        num_rows = self.request_buckets[-1]
        width = self.max_num_blocks_per_seq
        for t in self.token_buckets:
            qsl = np.full(num_rows + 1, t, np.int32)
            qsl[0] = 0
            seq_lens = np.zeros(num_rows, np.int32)
            seq_lens[0] = min(t, width * self.block_size)
            inputs = dict(input_ids=np.zeros(t, np.int32), positions=np.full(t, -1, np.int32),
                          seq_ids=np.zeros(t, np.int32), src_rows=np.full(t, -1, np.int32),
                          seq_lens=seq_lens, query_start_loc=qsl,
                          block_tables=self._empty_tables(num_rows),
                          logits_indices=np.zeros(num_rows, np.int32))
            tokens, *_ = self._run_mixed(inputs, *sampling(num_rows, mixed=True), None, max_query_len=t)
            jax.block_until_ready(tokens)
        for rows in self.request_buckets:
            zeros = np.zeros(rows, np.int32)
            arrays = dict(tokens=zeros, src_rows=np.full(rows, -1, np.int32), positions=zeros, steps=zeros,
                          block_tables=self._empty_tables(rows))
            out, *_ = self._run_decode(arrays, *sampling(rows), None)
            jax.block_until_ready(out)

    def execute_decode(self, sched, src_rows=None, prev_tokens=None) -> StepResult:
        """``sched.num_decode_steps`` decode steps; request ``r`` runs ``sched.scheduled[r][1]`` of them
        (its blocks for them allocated). ``tokens[i, r]`` is its token of step ``i`` (-1 once it stopped
        running). ``src_rows`` / ``prev_tokens``: as in :meth:`execute_mixed`."""
        num_rows = _bucket(len(sched.scheduled), self.request_buckets)
        arrays, sampling, extras, features = self.prepare_decode(sched, src_rows, num_rows)
        out, last, logprobs, logits = self._run_decode(arrays, sampling, extras, features, prev_tokens)
        return StepResult(out, logits, last, logprobs)

    def prepare_decode(self, sched, src_rows, num_rows: int):
        """Host (NumPy) inputs of a decode loop over ``num_rows`` rows: ``tokens``, ``src_rows``,
        ``positions``, ``steps``, ``block_tables``; the sampling arrays, extras and features."""
        scheduled = sched.scheduled
        reqs = [r for r, _ in scheduled]
        tokens = np.zeros(num_rows, np.int32)
        src = np.full(num_rows, -1, np.int32)
        positions = np.zeros(num_rows, np.int32)
        steps = np.zeros(num_rows, np.int32)
        n = len(reqs)
        for r, req in enumerate(reqs):
            if sched.pending_input[r]:
                src[r] = src_rows[r]
            else:
                tokens[r] = req.all_token_ids[-1]
        positions[:n] = sched.context_lens
        steps[:n] = [s for _, s in scheduled]
        arrays = dict(tokens=tokens, src_rows=src, positions=positions, steps=steps,
                      block_tables=self._block_table(reqs, num_rows))
        sampling, extras, features = self._sampling_arrays(reqs, num_rows, sched.gen_idx)
        # a structured output runs one step of the loop (the scheduler's rule) with its mask from the host, all
        # ones elsewhere; with step masks it runs its steps like any row, each step's mask from a callback
        features = _with_grammar_bitmask(reqs, [r for r, req in enumerate(reqs) if req.grammar is not None],
                                         num_rows, extras, features, self.step_masks)
        return arrays, sampling, extras, features
