"""Checked ops: the value checks of every op, on the host or, opt-in, inside ``jax.jit`` with checkify.

Every public op that takes indices (block ids, slots, lengths) checks their values. How depends on
whether they are concrete:

* **Concrete** (an op called outside ``jit``, with NumPy or device arrays): checked on the host before
  any work (reading a device array syncs on it). A bad value raises ``ValueError`` naming the field, the
  index, the value and the bound, e.g. ``block_tables[1, 0]=9 is not a block id in [0, num_blocks=8)``,
  and nothing is written (a donated cache is not consumed).
* **Traced** (the op runs inside ``jax.jit``): the values do not exist at trace time, so by default
  nothing is checked and **nothing is added to the program** (zero cost: the compiled step is the same
  as without this module). Inside :func:`checks_enabled` the same conditions are staged with
  ``jax.experimental.checkify.check``; the traced function must then be functionalised with
  ``checkify.checkify``. :func:`checked` does both::

      step = jax.jit(jaxkv.checks.checked(step_fn), donate_argnums=1)   # build once, reuse
      err, (logits, cache) = step(params, cache, batch)
      jaxkv.checks.raise_if_error(err)     # ValueError with the same message as the host check

The mode is a trace-time flag held in a JAX user context, which is part of the ``jax.jit`` cache key:
functions are re-traced when it changes, so a cache hit can neither skip the checks of a checked call
nor put un-functionalised checks into an unchecked one. Cost when on: a few comparisons and reductions
over the metadata per op (``O(num_seqs * max_num_blocks_per_seq + num_tokens)``, nothing over the cache),
one error flag and the reported values carried out of the step, and one device → host read of them when
``err`` is inspected.
"""

from __future__ import annotations

import functools
from typing import Callable

from jax.experimental import checkify

# The public API is __all__; the helpers below are what jaxkv's ops build their checks from.
from pallas_kernels._checks import (  # noqa: F401
    as_checked,
    below,
    check_block_ids,
    check_mode,
    check_paged_metadata,
    checks_are_enabled,
    checks_enabled,
    require,
    xp,
)

__all__ = ["checked", "checks_are_enabled", "checks_enabled", "raise_if_error"]


def checked(fn: Callable, *, errors=checkify.user_checks) -> Callable:
    """``fn`` with the check mode on while it is traced, functionalised by ``checkify.checkify``.

    Args:
        fn: a function calling jaxkv ops (e.g. a model step); may itself be jitted.
        errors: the checkify error set; the ops' checks are ``checkify.user_checks`` (the default).
            Add e.g. ``checkify.index_checks`` to also catch out-of-bounds gathers of the model.

    Returns:
        A function with ``fn``'s arguments returning ``(err, out)``: ``err`` is a ``checkify.Error``
        (``err.get()`` is ``None`` or the first failed check's message), ``out`` is ``fn``'s output. It
        can be jitted (``jax.jit(checked(fn))``; build it once, since a new function object is a new jit
        cache entry) and its arguments donated.
    """
    functionalised = checkify.checkify(fn, errors=errors)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with checks_enabled(True):
            return functionalised(*args, **kwargs)

    return run


def raise_if_error(err: checkify.Error) -> None:
    """Raise ``ValueError`` with the failed check's message when ``err`` holds one (host side, syncs).

    Raises:
        ValueError: the message of the first failed check, worded as the host check's (checkify's
            " (`check` failed)" suffix removed).
    """
    message = err.get()
    if message is not None:
        raise ValueError(message.removesuffix(_CHECKIFY_SUFFIX))


_CHECKIFY_SUFFIX = " (`check` failed)"
