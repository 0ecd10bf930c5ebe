"""The Mosaic GPU decode kernel (``pallas_kernels.paged_attention_mgpu``) against the float64 fuzz reference.

Where each test runs: on CPU the kernel runs in the Mosaic GPU interpreter (``InterpretGPUParams``:
simulated shared memory, TMA copies, barriers and the two warpgroups), which checks the kernel's logic
(paging, masking, NaN slots, online softmax, split merge) but not what only the hardware shows (layouts,
shared-memory budget, ptxas); ``test_lowers_for_sm90`` (its own file, test_paged_attention_mgpu_lowering.py)
lowers every class through Mosaic GPU for CUDA on CPU, which catches unsupported ops and layouts. On a GPU the same tests run the compiled kernel
(``scripts/dev/gpu_mgpu.sh``, on an H100); only that run is evidence that the compiled kernel is right.
``JAXKV_MGPU_FUZZ=N`` adds N random interpreted classes (slow: ~2 s a case) and every class of ``CASES``
through the persistent kernel.

The persistent kernel (``persistent=True``) runs here with 2 or 3 programs, so each program walks several
work items (of different sequences, zero-length ones, several partitions) through one K/V ring and the
two query/output tiles (or one, ``PERSISTENT_CASES``' last default case).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.attention import dispatch as attention_dispatch
from pallas_kernels import paged_attention as triton_mod
from pallas_kernels import paged_attention_mgpu as mgpu_mod
from pallas_kernels.paged_attention_mgpu import paged_attention_mgpu, unsupported_reason
from tests.pallas_kernels import fuzz

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU


def _cls(*, num_seqs=2, kv_heads=1, group=4, head=128, block=16, dtype="bfloat16", fp8=False, width=8,
         window=None, cap=None) -> fuzz.ShapeClass:
    return fuzz.ShapeClass(kernel="decode", num_seqs=num_seqs, num_kv_heads=kv_heads, group=group,
                           head_size=head, block_size=block, dtype=dtype, fp8=fp8, table_width=width,
                           num_blocks=num_seqs * width + 2, num_tokens=num_seqs, max_query_len=1,
                           sliding_window=window, logits_soft_cap=cap, alibi=False)


# (class, sequence lengths, num_splits): every head size, fp8, window, soft cap, one page a step and
# several, a page sliced over steps (block 128 > 64 keys a step at head size 256), MQA with head size
# 256, GQA up to the 64-row tile, lengths on page and step boundaries, and split-K.
CASES = [
    (_cls(head=128, block=16, width=20), [300, 17], 2),
    (_cls(head=128, block=16, width=20, window=40, cap=5.0), [300, 1], 1),
    (_cls(head=64, block=8, kv_heads=2, group=3, dtype="float16", fp8=True, width=40), [130, 64], 1),
    (_cls(head=256, block=32, group=1, width=6, window=100), [190, 64], 2),   # MQA, head size 256
    (_cls(head=256, block=128, group=1, num_seqs=1, width=2), [129], 1),      # page sliced over steps
    (_cls(head=128, block=128, group=1, fp8=True, width=3, cap=30.0), [300, 129], None),
    (_cls(head=64, block=16, group=64, num_seqs=1, width=4), [1], None),      # the full 64-row tile
    (_cls(head=128, block=64, kv_heads=3, group=5, width=4), [64, 255], 4),   # empty partitions
]


def _resolved(cls, num_splits, **kw) -> tuple:
    """The knobs a call of ``paged_attention_mgpu`` resolves to, with the kernel's own defaults (read from
    ``tuning`` now, so this follows any change of them). Two variants that resolve alike (same class, same
    data) run the very same program: the tests below run the first and skip the repeats, which come back
    with ``JAXKV_MGPU_FUZZ=N``."""
    from pallas_kernels import tuning
    kw = dict(kw, num_splits=num_splits)
    persistent = kw.setdefault("persistent", True)
    if kw.get("block_kv") is None:
        kw["block_kv"] = tuning.mgpu_decode_block_kv(cls.head_size)
    pc = kw.get("producer_converts")
    kw["producer_converts"] = bool(tuning.MGPU_DECODE_PRODUCER_CONVERTS and persistent if pc is None else pc) and cls.fp8
    if kw.get("convert_ahead") is None:
        kw["convert_ahead"] = tuning.MGPU_DECODE_CONVERT_AHEAD
    if kw.get("page_ids_first") is None:
        kw["page_ids_first"] = tuning.mgpu_decode_page_ids_first(cls.fp8)
    if kw.get("prefetch_item") is None:
        kw["prefetch_item"] = tuning.mgpu_decode_prefetch_item(cls.fp8)
    kw["fp8_route"] = mgpu_mod._fp8_route(kw.get("fp8_route"), fp8=cls.fp8, persistent=persistent,
                                          producer_converts=kw["producer_converts"], head_size=cls.head_size,
                                          group=cls.group)
    return (cls, *sorted(kw.items()))


def _tolerance(cls, resolved) -> float:
    """The class's tolerance, or :data:`fuzz.FP8_Q_TOLERANCE` for a call that runs ``fp8_route="qk8"``
    (``resolved``: :func:`_resolved`'s key)."""
    return fuzz.FP8_Q_TOLERANCE if ("fp8_route", "qk8") in resolved else fuzz.TOLERANCE[cls.dtype]


def _skip_repeat(key, earlier: dict, what: str) -> None:
    """Skip (unless ``JAXKV_MGPU_FUZZ`` is set) a call that resolves like one of ``earlier`` (key -> test id)."""
    if key in earlier and not os.environ.get("JAXKV_MGPU_FUZZ"):
        pytest.skip(f"{what}: the same call as {earlier[key]} under the current tuning defaults "
                    "(set JAXKV_MGPU_FUZZ=N to run it anyway)")


def _run(cls, lens, num_splits, seed=0, **extra):
    """Length 0 gives an empty sequence (``(context, query) = (-1, 1)``: ``seq_len`` 0, zero output)."""
    case = fuzz.make_case(np.random.default_rng(seed), cls, [(n - 1, 1) for n in lens])
    arrays, kwargs = case.kernel_args()
    out = paged_attention_mgpu(*arrays, **kwargs, num_splits=num_splits, interpret=INTERPRET, **extra)
    assert out.shape == case.q.shape and out.dtype == jnp.dtype(cls.dtype)
    return fuzz.error(out, case)


CASE_IDS = [f"{c.describe()} {lens} s{sp}" for c, lens, sp in CASES]


@pytest.mark.parametrize("cls,lens,num_splits", CASES, ids=CASE_IDS)
def test_matches_float64_reference(cls, lens, num_splits):
    """NaN in every slot no sequence owns; a kernel that reads or mixes in one returns inf error. The
    one-CTA-per-item kernel (the persistent default has its own cases below)."""
    assert _run(cls, lens, num_splits, persistent=False) <= fuzz.TOLERANCE[cls.dtype]


# One query/output staging tile, 5 stages of 64 keys (head size 128).
ONE_Q_TILE = dict(block_kv=64, num_stages=5, num_q_buffers=1)

# The persistent kernel: (class, lengths, num_splits, num_programs, kwargs). Items are (sequence, KV head,
# partition) in that order, dealt round-robin to the programs; a 1-stage ring makes every step wait for
# the previous one's release, across items; the third default case has one query tile.
PERSISTENT_CASES = [
    (_cls(head=64, block=16, kv_heads=2, group=3, num_seqs=5, width=12), [150, 0, 190, 1, 64], 2, 2,
     dict(num_stages=1)),
    (_cls(head=64, block=8, kv_heads=2, group=3, dtype="float16", fp8=True, num_seqs=3, width=40,
          window=50), [130, 0, 300], 2, 3, {}),
    (_cls(head=128, block=16, group=4, num_seqs=4, width=20, window=70, cap=5.0), [300, 0, 17, 250], 3, 2,
     ONE_Q_TILE),
]
# A converter warpgroup turning fp8 into a 16-bit ring (producer_converts): several items per program,
# empty ones, windows (steps skipped, rows zeroed in the 16-bit slot), one fp8 stage (every copy waits for
# the converter's release of the previous step), one query tile (the compute warpgroup copies the next
# query after the store), a page sliced over steps.
PRODUCER = dict(producer_converts=True, fp8_route="convert")
PERSISTENT_CASES += [
    (_cls(head=64, block=8, kv_heads=2, group=3, dtype="float16", fp8=True, num_seqs=3, width=40,
          window=50), [130, 0, 300], 2, 3, PRODUCER),
    (_cls(head=128, block=16, group=4, fp8=True, num_seqs=4, width=20, window=70, cap=5.0), [300, 0, 17, 250],
     3, 2, dict(block_kv=64, **PRODUCER)),
    (_cls(head=128, block=128, group=1, fp8=True, width=3, cap=30.0), [300, 129], 1, 2,
     dict(num_stages=1, **PRODUCER)),
    (_cls(head=256, block=32, group=1, fp8=True, width=6, window=100), [190, 64], 2, 2, PRODUCER),
]
# fp8 tiles converted by the compute warpgroup beside the other operand's wgmma (convert_ahead; the
# persistent default is the converter warpgroup, producer_converts): step 0's K before each item's loop
# (several items per program, empty ones, windows skipping steps), a 1-stage ring (the next K waits for
# the slot this step's V released), head size 256 (bf16 compute, q padded to 8 rows).
# The fp8 q·kᵀ routes (issue 45): the converter warpgroup quantizes each item's query into fp8 tile k % 2 and
# converts only V; the compute warpgroup reads K from the fp8 ring. "qk8t" (keys as the wgmma rows): 3, 4 and
# 12 heads per KV head (one and two 8-column tiles), 64-key steps (one 64-row group), a page sliced over steps
# with a 1-stage ring, windows, soft caps, f16 and bf16 queries, empty items. "qk8" (the query in e4m3, 64 rows).
# The interpreter runs the first of each route (the CPU suite's time), the GPU all of them.
QK8T = dict(fp8_route="qk8t")
QK8 = dict(fp8_route="qk8")
_COMPILED = pytest.mark.skipif(INTERPRET and not os.environ.get("JAXKV_MGPU_FUZZ"),
                               reason="compiled run (the GPU); interpreted with JAXKV_MGPU_FUZZ=N")
PERSISTENT_CASES += [
    (_cls(head=128, block=16, kv_heads=2, group=12, fp8=True, width=12, window=100), [150, 77], 2, 2, QK8T),
    (_cls(head=128, block=16, group=4, fp8=True, num_seqs=4, width=20, window=70, cap=5.0), [300, 0, 17, 250],
     3, 2, QK8),
    pytest.param(_cls(head=64, block=8, kv_heads=2, group=3, dtype="float16", fp8=True, num_seqs=3, width=40,
                      window=50), [130, 0, 300], 2, 3, QK8T, marks=_COMPILED),
    pytest.param(_cls(head=128, block=16, group=4, fp8=True, num_seqs=4, width=20, window=70, cap=5.0),
                 [300, 0, 17, 250], 3, 2, dict(block_kv=64, **QK8T), marks=_COMPILED),
    pytest.param(_cls(head=128, block=128, group=1, fp8=True, width=3, cap=30.0), [300, 129], 1, 2,
                 dict(num_stages=1, **QK8T), marks=_COMPILED),
    pytest.param(_cls(head=64, block=8, kv_heads=2, group=3, dtype="float16", fp8=True, num_seqs=3, width=40,
                      window=50), [130, 0, 300], 2, 3, dict(num_stages=1, **QK8), marks=_COMPILED),
]
# The memory warpgroup loading each step's page ids first (page_ids_first; with the next item's length loaded
# during the current one, prefetch_item, in the first): a 1-stage ring over several items (bf16), and the fp8
# default route over windows and a page sliced over steps (compiled).
PERSISTENT_CASES += [
    (_cls(head=64, block=16, kv_heads=2, group=3, num_seqs=5, width=12), [150, 0, 190, 1, 64], 2, 2,
     dict(num_stages=1, page_ids_first=True, prefetch_item=True)),
    pytest.param(_cls(head=128, block=16, group=4, fp8=True, num_seqs=4, width=20, window=70, cap=5.0),
                 [300, 0, 17, 250], 3, 2, dict(page_ids_first=True), marks=_COMPILED),
    pytest.param(_cls(head=128, block=128, group=1, fp8=True, width=3, cap=30.0), [300, 129], 1, 2,
                 dict(num_stages=1, block_kv=64, page_ids_first=True), marks=_COMPILED),
]
# The memory warpgroup loading the next item's sequence length during the current one (prefetch_item): empty items,
# several per program, 2 and 3 programs (the prefetch past a program's last item is clamped and unused).
PERSISTENT_CASES += [
    pytest.param(_cls(head=64, block=8, kv_heads=2, group=3, dtype="float16", fp8=True, num_seqs=3, width=40,
                      window=50), [130, 0, 300], 2, 3, dict(prefetch_item=True), marks=_COMPILED),
    pytest.param(_cls(head=64, block=16, kv_heads=2, group=3, num_seqs=5, width=12), [150, 0, 190, 1, 64], 2, 2,
                 dict(num_stages=1, prefetch_item=True), marks=_COMPILED),
    pytest.param(_cls(head=128, block=16, group=4, fp8=True, num_seqs=4, width=20, window=70, cap=5.0),
                 [300, 0, 17, 250], 3, 2, dict(prefetch_item=True, balance=False), marks=_COMPILED),
]
AHEAD = dict(convert_ahead=True, producer_converts=False)
PERSISTENT_CASES += [
    (_cls(head=64, block=8, kv_heads=2, group=3, dtype="float16", fp8=True, num_seqs=3, width=40,
          window=50), [130, 0, 300], 2, 3, AHEAD),
    (_cls(head=128, block=128, group=1, fp8=True, width=3, cap=30.0), [300, 129], 1, 2,
     dict(num_stages=1, **AHEAD)),
    (_cls(head=256, block=32, group=1, fp8=True, width=6, window=100), [190, 64], 2, 2, AHEAD),
]
_SLOW = pytest.mark.skipif(not os.environ.get("JAXKV_MGPU_FUZZ"), reason="set JAXKV_MGPU_FUZZ=N (slow)")
PERSISTENT_CASES += [pytest.param(c, lens, sp, 2 + i % 2, {}, marks=_SLOW)
                     for i, (c, lens, sp) in enumerate(CASES)]


def _persistent_id(case) -> str:
    cls, lens, num_splits, programs, kw = case.values if hasattr(case, "values") else case
    return f"{cls.describe()} {lens} s{num_splits} G{programs}" + "".join(f" {k}={v}" for k, v in kw.items())


@pytest.mark.parametrize("cls,lens,num_splits,num_programs,kw", PERSISTENT_CASES,
                         ids=[_persistent_id(c) for c in PERSISTENT_CASES])
def test_persistent_matches_float64_reference(cls, lens, num_splits, num_programs, kw):
    earlier = {}
    for c in PERSISTENT_CASES:
        c = c.values if hasattr(c, "values") else c
        if c[0] is cls and c[1] is lens and c[4] is kw:
            break
        earlier.setdefault((_resolved(c[0], c[2], persistent=True, num_programs=c[3], **c[4]), tuple(c[1])),
                           f"test_persistent_matches_float64_reference[{_persistent_id(c)}]")
    resolved = _resolved(cls, num_splits, persistent=True, num_programs=num_programs, **kw)
    _skip_repeat((resolved, tuple(lens)), earlier, "a repeat")
    err = _run(cls, lens, num_splits, persistent=True, num_programs=num_programs, **kw)
    assert err <= _tolerance(cls, resolved)


@pytest.mark.parametrize("k,ahead", [(2, True), (5, True), (5, False)],
                         ids=["head64-s1-ahead", "head128-block128-cap-ahead", "head128-block128-cap-in-order"])
def test_compute_warpgroup_conversion_matches_float64_reference(k, ahead):
    """The one-CTA-per-item kernel on the fp8 classes of ``CASES`` (NaN in the slots no sequence owns),
    each tile converted beside the other operand's ``wgmma`` (``convert_ahead``) or in step order."""
    cls, lens, num_splits = CASES[k]
    assert cls.fp8
    _skip_repeat(_resolved(cls, num_splits, persistent=False, convert_ahead=ahead, producer_converts=False),
                 {_resolved(cls, num_splits, persistent=False): f"test_matches_float64_reference[{CASE_IDS[k]}]"},
                 "the kernel's default conversion")
    err = _run(cls, lens, num_splits, persistent=False, convert_ahead=ahead, producer_converts=False)
    assert err <= fuzz.TOLERANCE[cls.dtype]


def test_persistent_agrees_with_non_persistent():
    """Same items, same per-item arithmetic: the outputs agree (bit for bit in the interpreter); the default
    number of programs (at most 4 in the interpreter) over 2 sequences x 3 KV heads x 2 partitions."""
    cls = _cls(head=128, block=16, kv_heads=3, group=2, width=10)
    case = fuzz.make_case(np.random.default_rng(4), cls, [(150, 1), (40, 1)])
    arrays, kwargs = case.kernel_args()
    ref = paged_attention_mgpu(*arrays, **kwargs, num_splits=2, interpret=INTERPRET, persistent=False)
    out = paged_attention_mgpu(*arrays, **kwargs, num_splits=2, interpret=INTERPRET, persistent=True)
    ref, out = np.asarray(ref, np.float32), np.asarray(out, np.float32)
    np.testing.assert_allclose(out, ref, rtol=1e-2, atol=1e-2 * np.abs(ref).max())
    if INTERPRET:
        np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("num_programs", [2, 3])
def test_balanced_deal_agrees_with_batch_order(num_programs):
    """Items dealt longest sequence first in a snake (``balance``, the default) give the batch-order deal's
    output bit for bit, and the one-CTA-per-item kernel's: 5 items over 2 programs (an even last round of
    one item) and over 3 (an odd, partial last round), lengths out of order."""
    cls = _cls(head=64, block=16, kv_heads=1, group=2, num_seqs=5, width=20)
    case = fuzz.make_case(np.random.default_rng(7), cls, [(40, 1), (300, 1), (0, 1), (170, 1), (90, 1)])
    arrays, kwargs = case.kernel_args()
    common = dict(**kwargs, num_splits=1, interpret=INTERPRET, persistent=True, num_programs=num_programs)
    balanced = np.asarray(paged_attention_mgpu(*arrays, **common), np.float32)
    in_order = np.asarray(paged_attention_mgpu(*arrays, **common, balance=False), np.float32)
    ref = np.asarray(paged_attention_mgpu(*arrays, **kwargs, num_splits=1, interpret=INTERPRET, persistent=False),
                     np.float32)
    np.testing.assert_array_equal(balanced, in_order)
    np.testing.assert_allclose(balanced, ref, rtol=1e-2, atol=1e-2 * np.abs(ref).max())


def test_persistent_bad_num_programs_raises():
    q = jnp.zeros((1, 4, 64), jnp.bfloat16)
    kv = jnp.zeros((2, 4, 1, 16, 64), jnp.bfloat16)
    args = (q, kv, jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32))
    with pytest.raises(ValueError, match="num_programs=0"):
        paged_attention_mgpu(*args, scale=0.1, persistent=True, num_programs=0, interpret=True)
    with pytest.raises(ValueError, match="needs persistent=True"):
        paged_attention_mgpu(*args, scale=0.1, num_programs=2, persistent=False, interpret=True)


def test_zero_length_sequence_gives_zeros():
    cls = _cls(head=64, width=2)
    case = fuzz.make_case(np.random.default_rng(1), cls, [(0, 1), (5, 1)])
    arrays, kwargs = case.kernel_args()
    arrays[3] = arrays[3].at[0].set(0)  # sequence 0 empty: its output is 0
    out = paged_attention_mgpu(*arrays, **kwargs, interpret=INTERPRET)
    assert np.all(np.asarray(out[0], np.float32) == 0.0)
    assert np.isfinite(np.asarray(out, np.float32)).all()


@pytest.mark.parametrize("change,match", fuzz.MGPU_UNSUPPORTED)
def test_unsupported_calls_say_why(change, match):
    """The kernel refuses what it does not implement, naming the field (the dispatch falls back)."""
    args, q, kv, extra = fuzz.mgpu_unsupported_call(change, num_tokens=1)
    reason = unsupported_reason(args["dtype"], args["kv_dtype"], *args["heads"], args["head"], args["block"],
                                alibi=args["alibi"])
    assert reason is not None and match in reason
    with pytest.raises(NotImplementedError, match=match):
        paged_attention_mgpu(q, kv, jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32), scale=0.1,
                             interpret=True, **extra)


def test_bad_block_kv_raises():
    q = jnp.zeros((1, 4, 64), jnp.bfloat16)
    kv = jnp.zeros((2, 4, 1, 16, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="block_kv=48"):
        paged_attention_mgpu(q, kv, jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32), scale=0.1,
                             block_kv=48, interpret=True)


def test_dispatch_uses_mosaic_kernel_and_falls_back_with_a_reason(monkeypatch):
    """``impl="pallas_mosaic"`` (``_interpret`` on CPU): a supported decode batch runs the Mosaic kernel and matches
    the reference; ALiBi falls back to the Triton kernel with a warning naming it."""
    calls = []

    def spy(name, fn):
        def wrapped(*a, **k):
            calls.append(name)
            return fn(*a, **k)
        return wrapped
    monkeypatch.setattr(mgpu_mod, "paged_attention_mgpu", spy("mosaic", mgpu_mod.paged_attention_mgpu))
    monkeypatch.setattr(triton_mod, "paged_attention", spy("triton", triton_mod.paged_attention))
    monkeypatch.setattr(attention_dispatch, "_warned_fallbacks", set())
    cls = _cls(head=64, block=8, kv_heads=2, group=2, width=4)
    case = fuzz.make_case(np.random.default_rng(2), cls, [(20, 1), (8, 1)])
    (q, kv, tables, lens), kwargs = case.kernel_args()
    md = jaxkv.build_attn_metadata(np.asarray(tables), [20, 8], [1, 1], cls.block_size)
    scale = kwargs["scale"]
    impl = "pallas_mosaic" if ON_GPU else "pallas_mosaic_interpret"
    out = jaxkv.paged_attention(q, kv, md, scale=scale, impl=impl)
    assert calls == ["mosaic"]
    assert fuzz.error(out, case) <= fuzz.TOLERANCE[cls.dtype]

    slopes = jnp.full((cls.num_heads,), 0.1, jnp.float32)
    with pytest.warns(UserWarning, match="falls back to the Triton kernel: alibi"):
        jaxkv.paged_attention(q, kv, md, scale=scale, impl=impl, alibi_slopes=slopes)
    assert calls == ["mosaic", "triton"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per reason
        jaxkv.paged_attention(q, kv, md, scale=scale, impl=impl, alibi_slopes=slopes)


@pytest.mark.skipif(not os.environ.get("JAXKV_MGPU_FUZZ"), reason="set JAXKV_MGPU_FUZZ=N (slow, ~2 s a case)")
def test_random_classes_interpreted():
    rng = np.random.default_rng(13)
    failed = []
    for cls in fuzz.shape_classes(rng, "decode", int(os.environ["JAXKV_MGPU_FUZZ"])):
        cls = mosaic_class(cls, rng)
        lengths = fuzz.random_lengths(rng, cls)
        case = fuzz.make_case(rng, cls, lengths)
        arrays, kwargs = case.kernel_args()
        err = fuzz.error(paged_attention_mgpu(*arrays, **kwargs, interpret=INTERPRET), case)
        if not err <= fuzz.TOLERANCE[cls.dtype]:
            failed.append((cls.describe(), lengths, err))
    assert not failed, failed


def mosaic_class(cls: fuzz.ShapeClass, rng: np.random.Generator) -> fuzz.ShapeClass:
    """The nearest class the Mosaic kernel supports: head size 64/128/256, bf16/f16, no ALiBi."""
    head = int(rng.choice(mgpu_mod.HEAD_SIZES))
    dtype = "bfloat16" if cls.dtype == "float32" else cls.dtype
    return dataclasses.replace(cls, head_size=head, dtype=dtype, alibi=False)


def test_persistent_split_rule_fills_one_round_of_programs():
    """The persistent kernel's split rule: no split once the (sequence, KV head) items fill the CTAs;
    otherwise as many as fit in one round of CTAs, never more than one per 128-key step (a loop over
    the rule's definition, on the decode bench grid and random shapes)."""
    from pallas_kernels import tuning
    grid = {(1, 4096): 16, (1, 32768): 16, (8, 4096): 2, (8, 32768): 2, (64, 1024): 1, (256, 4096): 1}
    for (batch, ctx), want in grid.items():
        assert tuning.mgpu_decode_num_splits(batch, 8, ctx // 16, 16, 128, 132) == want, (batch, ctx)
    rng = np.random.default_rng(0)
    for _ in range(200):
        seqs, kvh, pages, programs = (int(rng.integers(1, n)) for n in (300, 9, 600, 200))
        s = tuning.mgpu_decode_num_splits(seqs, kvh, pages, 16, 128, programs)
        steps = -(-pages * 16 // 128)
        assert 1 <= s <= max(1, steps)
        assert s == 1 or seqs * kvh * s <= programs
        assert s == steps or seqs * kvh * (s + 1) > programs   # the most that fit one round


def test_merge_partitions_matches_float64():
    """The split merge (partition by partition) against a float64 log-sum-exp merge, with empty partitions (``-inf``),
    a row where every partition is empty (zeros), and log-sum-exps 300 apart (exp2 of the raw values
    would overflow float32)."""
    rng = np.random.default_rng(5)
    o = rng.standard_normal((6, 3, 4, 32)).astype(np.float32)
    lse = rng.uniform(-150.0, 150.0, (6, 3, 4)).astype(np.float32)
    lse[1, 0, 0] = lse[4, 2, 3] = -np.inf
    lse[:, 1, 2] = -np.inf
    o[:, 1, 2] = 0.0                       # the kernel writes zeros for an empty partition
    out = np.asarray(mgpu_mod.merge_partitions(jnp.asarray(o), jnp.asarray(lse)), np.float64)

    ref = np.zeros(o.shape[1:])
    for idx in np.ndindex(*lse.shape[1:]):
        col = lse[(slice(None), *idx)].astype(np.float64)
        if np.all(np.isneginf(col)):
            continue
        w = np.exp2(col - col.max())
        ref[idx] = (w[:, None] * o[(slice(None), *idx)]).sum(0) / w.sum()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    assert np.all(out[1, 2] == 0.0)


@pytest.mark.parametrize("route", ["convert", "qk8t"])
def test_fp8_cache_with_a_query_past_float16_range(route):
    """An fp8 cache under a bf16 query: "convert" computes in f16 with the query scaled by ``F16_Q_SCALE``, "qk8t"
    quantizes each query row to e4m3 with its own scale. Query values past f16's 65504 (here up to ~2**17) in
    one head, a head of zeros (the smallest scale, ``QK8_MIN_ABSMAX``) and one of tiny values (~2**-20) beside
    them still give the float64 reference's result, not inf/NaN."""
    cls = _cls(head=128, block=16, group=4, fp8=True, width=12)
    case = fuzz.make_case(np.random.default_rng(8), cls, [(150, 1), (33, 1)])
    q = case.q.copy()
    q[:, 0] *= 2.0 ** 15       # exact in bf16: a power of two
    q[0, 1] = 0.0
    q[1, 2] *= 2.0 ** -20
    case = dataclasses.replace(case, q=q)
    assert np.abs(case.q).max() > 65504
    arrays, kwargs = case.kernel_args()
    out = paged_attention_mgpu(*arrays, **kwargs, interpret=INTERPRET, fp8_route=route)
    assert fuzz.error(out, case) <= fuzz.TOLERANCE[cls.dtype]


@pytest.mark.parametrize("route", ["qk8t", "convert", "qk8"])
def test_fp8_error_does_not_grow_with_context(route):
    """One sequence of 32k tokens (2k in the interpreter, the default route only: ~3 s) against one of 1k (256),
    f16 query, fp8 cache: the error against the float64 reference (dequantized cache, unquantized query) stays
    within the tolerance and does not grow with the context: online softmax and the output accumulate in float32
    across the 256 steps (a 16-bit accumulator would drift). Both lengths' errors are printed (-s)."""
    if not ON_GPU and route != mgpu_mod._fp8_route(None, fp8=True, persistent=True, producer_converts=True,
                                                   head_size=128, group=4):
        pytest.skip("the interpreter runs the default route only (the GPU runs all three)")
    lengths = (1024, 32768) if ON_GPU else (256, 2048)
    errs = []
    for n in lengths:
        cls = _cls(head=128, block=16, group=4, num_seqs=1, fp8=True, dtype="float16", width=n // 16)
        errs.append(_run(cls, [n], 1, seed=n, persistent=True, num_programs=1, fp8_route=route))
    tol = fuzz.FP8_Q_TOLERANCE if route == "qk8" else fuzz.TOLERANCE["float16"]
    print(f"\n{route}: error {errs[0]:.3e} at {lengths[0]} tokens, {errs[1]:.3e} at {lengths[1]}")
    assert max(errs) <= tol
    assert errs[1] <= max(2.0 * errs[0], tol / 8), errs


def _mosaic_smem_bytes(fp8, head, block_kv, kw) -> int:
    """The shared memory Mosaic GPU counts for one kernel configuration, from its own check: lowered for
    sm_90 on CPU under an artificial limit of 0 bytes, the "exceeds available shared memory" error names
    the kernel's ``smem_bytes``."""
    from jax import export
    from jax.experimental.mosaic.gpu import core as mgpu_core
    cls = _cls(head=head, block=16, group=4, fp8=fp8, width=8)
    case = fuzz.make_case(np.random.default_rng(0), cls, [(100, 1), (30, 1)])
    arrays, kwargs = case.kernel_args()
    fn = jax.jit(lambda *a: paged_attention_mgpu(*a, **kwargs, num_splits=1, block_kv=block_kv, **kw))
    with mgpu_core.artificial_shared_memory_limit(0), pytest.raises(ValueError, match="smem_bytes=") as err:
        export.export(fn, platforms=("cuda",))(*arrays)
    return int(re.search(r"smem_bytes=(\d+)", str(err.value)).group(1))


# (fp8, head size, keys a step, kernel kwargs): both kernels, one and two staging tiles, P through shared
# memory or not, fp8 and 16-bit rings, head size 256 (no separate swizzled query tile), the producer rings.
SMEM_CONFIGS = [
    (False, 128, 128, dict(persistent=True, num_stages=2, num_q_buffers=2, pv_from_smem=False)),
    (True, 128, 128, dict(persistent=True, num_stages=4, num_q_buffers=1, pv_from_smem=False,
                          producer_converts=False)),
    (True, 128, 128, dict(persistent=False, num_stages=3, pv_from_smem=True)),
    (False, 256, 64, dict(persistent=True, num_stages=3, num_q_buffers=2, pv_from_smem=False)),
    (True, 64, 64, dict(persistent=True, num_stages=1, num_q_buffers=2, pv_from_smem=True, producer_converts=False)),
    (True, 128, 64, dict(persistent=True, num_stages=3, producer_converts=True, pv_from_smem=False)),
    (True, 128, 128, dict(persistent=True, num_stages=2, producer_converts=True, pv_from_smem=False, fp8_route="qk8t")),
    (True, 128, 128, dict(persistent=True, num_stages=3, producer_converts=True, pv_from_smem=False, fp8_route="qk8")),
]


@pytest.mark.skipif(ON_GPU, reason="CPU lowering check (sm_90); the GPU compiles the real kernels")
@pytest.mark.parametrize("fp8,head,block_kv,kw", SMEM_CONFIGS, ids=[str(i) for i in range(len(SMEM_CONFIGS))])
def test_shared_memory_count_matches_mosaic(fp8, head, block_kv, kw):
    """``tuning.mgpu_decode_smem_bytes`` is Mosaic GPU's own count, byte for byte (so the ring-depth rule
    may fill a CTA's 227 KiB exactly: a kernel past it fails to lower)."""
    from pallas_kernels import tuning
    kw = dict(kw)
    persistent = kw["persistent"]
    producer = kw.get("producer_converts", tuning.MGPU_DECODE_PRODUCER_CONVERTS and persistent)
    route = mgpu_mod._fp8_route(kw.get("fp8_route"), fp8=fp8, persistent=persistent, producer_converts=bool(producer),
                                head_size=head, group=4)       # _mosaic_smem_bytes' class: 4 heads per KV head
    if kw.get("producer_converts"):
        stages, stages16, q_tiles = tuning.mgpu_decode_producer_stages(block_kv, head, p_tile=kw["pv_from_smem"],
                                                                       num_stages=kw["num_stages"], fp8_route=route)
    else:
        stages, stages16, q_tiles = kw["num_stages"], 0, kw.get("num_q_buffers", 1)
    want = tuning.mgpu_decode_smem_bytes(block_kv, head, stages, fp8=fp8, q_tiles=q_tiles, p_tile=kw["pv_from_smem"],
                                         persistent=persistent, num_stages16=stages16, fp8_route=route)
    assert _mosaic_smem_bytes(fp8, head, block_kv, dict(kw, interpret=False)) == want


def test_ring_rule_fills_the_budget():
    """The ring rule (``tuning.mgpu_decode_ring``) against the byte count: two staging tiles where a stage
    still fits beside them, then the deepest ring that fits (or the cap), for one CTA per SM and for two
    (each half an SM's shared memory less the 1 KiB the system keeps per CTA)."""
    from pallas_kernels import tuning
    assert tuning.mgpu_decode_smem_budget(1) == 227 * 1024
    assert tuning.mgpu_decode_smem_budget(2) == 113 * 1024
    for budget in (tuning.mgpu_decode_smem_budget(1), tuning.mgpu_decode_smem_budget(2)):
        for head in (64, 128, 256):
            for block_kv in (64, 128):
                for fp8 in (False, True):
                    for p_tile in (False, True):
                        size = functools.partial(tuning.mgpu_decode_smem_bytes, block_kv, head, fp8=fp8,
                                                 p_tile=p_tile)
                        st, qb = tuning.mgpu_decode_ring(block_kv, head, fp8=fp8, p_tile=p_tile, budget=budget)
                        assert qb == (2 if size(1, q_tiles=2) <= budget else 1)
                        assert size(st, q_tiles=qb) <= budget or st == 1
                        assert st == tuning.MGPU_DECODE_MAX_STAGES or size(st + 1, q_tiles=qb) > budget
                        st1, qb1 = tuning.mgpu_decode_ring(block_kv, head, fp8=fp8, p_tile=p_tile, budget=budget,
                                                           persistent=False)
                        assert qb1 == 1 and (st1 == tuning.MGPU_DECODE_MAX_STAGES
                                             or size(st1 + 1, persistent=False) > budget)
    # Head size 128, 128 keys, P from registers, one CTA per SM: bf16 2 stages + 2 tiles (measured in
    # session 12), fp8 3 + 2.
    assert tuning.mgpu_decode_ring(128, 128, fp8=False, p_tile=False) == (2, 2)
    assert tuning.mgpu_decode_ring(128, 128, fp8=True, p_tile=False) == (3, 2)
    assert tuning.mgpu_decode_ring(128, 128, fp8=True, p_tile=False, num_q_buffers=1) == (4, 1)
