"""Value checks of the ops' index inputs: on the host when concrete, with ``checkify`` inside ``jit`` on demand.

Shape and dtype checks work on tracers and always run. Checks of *values* (a block id inside the cache,
a length inside its block table) need the values, so each check runs in one of two modes:

* **host**: every checked array is concrete (not traced; e.g. an op called eagerly with NumPy or device
  arrays). The values are read on the host (a device → host sync) and the first bad entry raises
  ``ValueError`` naming the field, the index, the value and the bound, before any work is launched.
* **traced**: some array is traced (the op runs inside ``jax.jit``, ``vmap``, ``checkify``, ...). Nothing
  is checked and nothing is added to the program, unless the check mode is on (:func:`checks_enabled`):
  then the same conditions are staged with ``jax.experimental.checkify.check``, and the program must be
  functionalised with ``checkify.checkify`` (``jaxkv.checks.checked`` does both), which returns an
  ``Error`` whose message is the host message with the traced values filled in.

The check mode is a trace-time flag: it is read while a function is traced and changes the traced program.
It is kept in a JAX *user context* (``jax.make_user_context``), which is part of every ``jax.jit`` cache
key, so a function traced with the mode off is re-traced (not served from the jit cache) when called with it
on, and the other way round: a cache hit can neither drop the checks nor leak un-functionalised checks into a
program traced with the mode off.

This module imports only jax and numpy (``pallas_kernels`` never imports ``jaxkv``); ``jaxkv.checks`` builds
the public API on it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify


def _make_flag():
    make = getattr(jax, "make_user_context", None)
    if make is not None:
        return make(default_value=False)
    from jax._src import config as _config  # JAX without user contexts: a jit-keyed config state
    return _config.bool_state("jaxkv_debug_checks", False, "jaxkv in-jit checks (checkify)",
                              include_in_jit_key=True, include_in_trace_context=True)


_FLAG = _make_flag()


@contextlib.contextmanager
def checks_enabled(enabled: bool = True) -> Iterator[None]:
    """Context in which traced ops stage their value checks with ``checkify.check``.

    Read at trace time: functions traced inside the context contain the checks and must be wrapped with
    ``jax.experimental.checkify.checkify`` (else lowering fails with "not functionalized"). The flag is part
    of the ``jax.jit`` cache key, so jitted functions are re-traced when it changes.
    """
    with _FLAG(bool(enabled)):
        yield


def checks_are_enabled() -> bool:
    """Whether traced ops stage their value checks now (see :func:`checks_enabled`)."""
    return bool(_FLAG.value)


def is_concrete(*xs) -> bool:
    """No leaf of ``xs`` is a tracer (``None`` leaves are ignored)."""
    return not any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(xs))


def check_mode(*arrays) -> str | None:
    """``"host"`` when every array is concrete, ``"traced"`` when some is traced and the check mode is
    on, else ``None`` (nothing to check, nothing staged)."""
    if is_concrete(*arrays):
        return "host"
    return "traced" if checks_are_enabled() else None


def as_checked(mode: str, x):
    """``x`` as the array type of ``mode``: ``int64`` NumPy on the host (no overflow), ``jnp`` when traced."""
    if x is None:
        return None
    return np.asarray(x).astype(np.int64) if mode == "host" else jnp.asarray(x)


def xp(mode: str):
    """The array module of ``mode``."""
    return np if mode == "host" else jnp


def require(mode: str, ok, message: str, *, index_names: tuple[str, ...] = (), **values) -> None:
    """Fail when any entry of ``ok`` is false, reporting the first false entry.

    Args:
        mode: ``"host"`` (raise ``ValueError`` now) or ``"traced"`` (stage ``checkify.check``).
        ok: ``bool[...]`` (NumPy on the host, jnp when traced).
        message: a ``str.format`` template; its fields are ``index_names`` (the first failing entry's
            indices) and ``values`` (arrays broadcast against ``ok``; the entry at the failing index).
            Static numbers belong in the template itself.
        index_names: one name per axis of ``ok``.
        values: named arrays (or scalars) to report.

    Raises:
        ValueError: in host mode, ``message`` formatted at the first failing entry.
    """
    if mode == "host":
        ok = np.asarray(ok, bool)
        if ok.all():
            return
        idx = np.unravel_index(int(np.argmin(ok.reshape(-1))), ok.shape)
        fields: dict[str, Any] = {n: int(i) for n, i in zip(index_names, idx)}
        fields.update({k: np.broadcast_to(np.asarray(v), ok.shape)[idx].item() for k, v in values.items()})
        raise ValueError(message.format(**fields))
    ok = jnp.asarray(ok, bool)
    if ok.size == 0:
        return
    first = jnp.argmin(ok.reshape(-1))
    idx = jnp.unravel_index(first, ok.shape)
    fields = {n: jnp.asarray(i, jnp.int32) for n, i in zip(index_names, idx)}
    fields.update({k: jnp.broadcast_to(jnp.asarray(v), ok.shape).reshape(-1)[first]
                   for k, v in values.items()})
    checkify.check(jnp.all(ok), message, **fields)


def below(x, bound: int):
    """``x < bound`` without overflow when ``bound`` exceeds ``x``'s integer range."""
    if isinstance(x, np.ndarray) or bound <= np.iinfo(x.dtype).max:
        return x < bound
    return jnp.ones(x.shape, bool)


def check_block_ids(mode: str, ids, used, where: str, num_blocks: int | None, *,
                    index_names: tuple[str, ...], suffix: str = "", **values) -> None:
    """Every used entry of ``ids`` is a block id in ``[0, num_blocks)`` (``>= 0`` when ``num_blocks`` is
    ``None``).

    The message is ``{where}={value} is not a block id in [0, num_blocks=N){suffix}``: ``where`` and
    ``suffix`` are :func:`require` templates over ``index_names`` (one per axis of ``ids``) and the
    further named arrays ``values``, e.g. ``where="block_tables[{s}, {i}]"``.
    """
    ok = ids >= 0
    bound = "(block ids are >= 0)" if num_blocks is None else f"in [0, num_blocks={num_blocks})"
    if num_blocks is not None:
        ok = ok & below(ids, num_blocks)
    require(mode, ok | ~used, f"{where}={{value}} is not a block id {bound}{suffix}",
            index_names=index_names, value=ids, **values)


# ------------------------------------------------------------------------------------------------
# The paged-attention metadata, shared by the decode and prefill ops
# ------------------------------------------------------------------------------------------------

def check_paged_metadata(kv_cache, block_tables, seq_lens, query_start_loc=None, *,
                         num_tokens: int | None = None, max_query_len: int | None = None,
                         query_offset: bool = False) -> None:
    """Value checks of a paged-attention batch: everything the kernels rely on to stay in bounds.

    ``seq_lens[s]`` in ``[0, max_num_blocks_per_seq * block_size]``; every block a sequence reads
    (logical blocks ``i < cdiv(seq_lens[s], block_size)``) a block id in ``[0, num_blocks)`` (entries
    past them are never read and are not checked); with ``query_start_loc`` (prefill): it starts at 0 (at
    ``>= 0`` with ``query_offset``: tokens before it belong to no sequence), never decreases, ends at most at
    ``num_tokens``, and each ``query_len`` is at most ``max_query_len`` and its ``seq_len``. Host mode when the
    metadata is concrete, checkify when traced and the check mode is on, nothing otherwise (see the module
    docstring). Inputs whose shapes are wrong are skipped: the ops' shape checks report them.

    Args:
        kv_cache: ``[2, num_blocks, num_kv_heads, block_size, head_size]`` (only its shape is read).
        block_tables: ``int32[num_seqs, max_num_blocks_per_seq]``.
        seq_lens: ``int32[num_seqs]``.
        query_start_loc: ``int32[num_seqs + 1]`` or ``None`` (decode: one query per sequence).
        num_tokens: rows of ``q`` (with ``query_start_loc``).
        max_query_len: static bound on each ``query_len`` (with ``query_start_loc``).
        query_offset: the kernel accepts a ``query_start_loc`` that starts past 0 (the Triton prefill kernel).

    Raises:
        ValueError: in host mode, naming the field, the index, the value and the bound.
    """
    if not all(hasattr(a, "shape") for a in (kv_cache, block_tables, seq_lens)):
        return
    if (len(kv_cache.shape) != 5 or block_tables.ndim != 2 or seq_lens.shape != block_tables.shape[:1]
            or (query_start_loc is not None and getattr(query_start_loc, "shape", None) != (block_tables.shape[0] + 1,))):
        return
    mode = check_mode(block_tables, seq_lens, query_start_loc)
    if mode is None:
        return
    np_ = xp(mode)
    tables, lens, qsl = (as_checked(mode, a) for a in (block_tables, seq_lens, query_start_loc))
    _, num_blocks, _, block_size, _ = kv_cache.shape
    num_seqs, width = tables.shape
    seq = np_.arange(num_seqs)
    if qsl is not None:
        if query_offset:
            require(mode, qsl[0] >= 0, "query_start_loc[0]={value} must be >= 0", value=qsl[0])
        else:
            require(mode, qsl[0] == 0, "query_start_loc[0]={value} must be 0", value=qsl[0])
        steps = qsl[1:] - qsl[:-1]
        require(mode, steps >= 0, "query_start_loc[{next}]={hi} < query_start_loc[{s}]={lo}: "
                "query_start_loc must be non-decreasing", index_names=("s",), next=seq + 1, hi=qsl[1:],
                lo=qsl[:-1])
        if num_tokens is not None:
            require(mode, qsl[-1] <= num_tokens,
                    f"query_start_loc[-1]={{value}} exceeds num_tokens={num_tokens}", value=qsl[-1])
    require(mode, lens >= 0, "seq_lens[{s}]={value} must be >= 0", index_names=("s",), value=lens)
    if qsl is not None:
        if max_query_len is not None:
            require(mode, steps <= max_query_len, "query_len={value} of sequence {s} exceeds "
                    f"max_query_len={max_query_len}", index_names=("s",), value=steps)
        require(mode, steps <= lens, "query_len={value} of sequence {s} exceeds its seq_len={n}",
                index_names=("s",), value=steps, n=lens)
    capacity = width * block_size
    require(mode, lens <= capacity, "seq_lens[{s}]={value} needs {pages} blocks but block_tables has "
            f"max_num_blocks_per_seq={width}: seq_lens must be in [0, max_num_blocks_per_seq * "
            f"block_size={capacity}]", index_names=("s",), value=lens,
            pages=(lens + block_size - 1) // block_size)
    # logical block i of sequence s is read iff i * block_size < seq_lens[s]
    used = np_.arange(width)[None, :] * block_size < lens[:, None]
    check_block_ids(mode, tables, used, "block_tables[{s}, {i}]", num_blocks, index_names=("s", "i"))


def host_checked(check: Callable[..., None]):
    """Decorator for a ``jax.jit``-ed public op: run ``check`` on the call's arguments first.

    The jitted body only ever sees tracers, so value checks of a jitted op run here, at call time: on the
    host when the arguments are concrete, staged into the caller's trace (check mode) when traced.
    ``check`` is called with the op's arguments bound to its signature, as keyword arguments (extra ones
    must be absorbed by ``**_``). ``lower``, ``trace``, ``eval_shape`` and ``clear_cache`` of the jitted
    op stay available (they do not run the checks).
    """
    def decorate(jitted):
        signature = inspect.signature(jitted)

        @functools.wraps(jitted)
        def op(*args, **kwargs):
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                return jitted(*args, **kwargs)  # let the jitted op report the bad call
            check(**bound.arguments)
            return jitted(*args, **kwargs)

        for name in ("lower", "trace", "eval_shape", "clear_cache"):
            if hasattr(jitted, name):
                setattr(op, name, getattr(jitted, name))
        return op

    return decorate


def check_decode_args(*, kv_cache, block_tables, seq_lens, **_) -> None:
    """:func:`check_paged_metadata` of a decode call (``paged_attention``'s arguments)."""
    check_paged_metadata(kv_cache, block_tables, seq_lens)
