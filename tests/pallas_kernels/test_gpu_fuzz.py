"""Fuzz of the paged kernels against a float64 NumPy reference: compiled on a GPU, interpreted on CPU.

On a GPU machine: ``pytest -m gpu tests/pallas_kernels/test_gpu_fuzz.py`` runs >= 500 cases per kernel
compiled (one compile per shape class, the lengths, tables and data varied within it); with
``JAXKV_FUZZ_REPORT=path.json`` it also writes the per-case errors. On CPU the same generator runs a few
classes in the Pallas interpreter, which cannot see compiled-kernel bugs (the block-8 decode bug passed
there): only the GPU run counts as evidence for a kernel change. Seeded: a failure names its class and
case, and re-running reproduces it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time

import jax
import numpy as np
import pytest

from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.paged_attention_mgpu import paged_attention_mgpu
from pallas_kernels.paged_prefill_attention import paged_prefill_attention
from tests.conftest import SLOW
from tests.pallas_kernels import fuzz

ON_GPU = jax.default_backend() == "gpu"
KERNELS = {"decode": paged_attention, "prefill": paged_prefill_attention,
           "decode_mgpu": paged_attention_mgpu,    # Mosaic GPU (Hopper only): -k decode_mgpu
           # its fp8 path with a converter warpgroup converting K and V (every class made fp8)
           "decode_mgpu_producer": functools.partial(paged_attention_mgpu, producer_converts=True, fp8_route="convert"),
           # its fp8 path with the compute warpgroup converting each tile beside the other operand's wgmma
           "decode_mgpu_ahead": functools.partial(paged_attention_mgpu, convert_ahead=True, producer_converts=False),
           # its fp8 q·kᵀ routes (issue 45; every class made fp8, head size 256 made 128): keys as the wgmma rows and
           # the query in two e4m3 halves, and the query in one e4m3 half on 64 rows (looser tolerance)
           "decode_mgpu_qk8t": functools.partial(paged_attention_mgpu, fp8_route="qk8t"),
           "decode_mgpu_qk8": functools.partial(paged_attention_mgpu, fp8_route="qk8")}
GPU_CLASSES, GPU_CASES_PER_CLASS = 64, 8       # 512 cases per kernel, + the regression shapes
GPU_CLASSES = int(os.environ.get("JAXKV_FUZZ_CLASSES", GPU_CLASSES))  # fewer for a short run
CPU_CLASSES, CPU_CASES_PER_CLASS = 5, 1


def run_fuzz(kernel: str, *, num_classes: int, cases_per_class: int, interpret: bool, seed: int):
    rng = np.random.default_rng(seed)
    base = kernel.removesuffix("_producer").removesuffix("_ahead").removesuffix("_qk8t").removesuffix("_qk8")
    base = base.removesuffix("_mgpu")
    classes = [(c, None) for c in fuzz.shape_classes(rng, base, num_classes)]
    if kernel.startswith("decode_mgpu"):  # the nearest classes the Mosaic kernel supports
        from tests.pallas_kernels.test_paged_attention_mgpu import mosaic_class
        classes = [(mosaic_class(c, rng), None) for c, _ in classes]
    if kernel in ("decode_mgpu_producer", "decode_mgpu_ahead"):
        classes = [(dataclasses.replace(c, fp8=True), None) for c, _ in classes]
    if kernel in ("decode_mgpu_qk8t", "decode_mgpu_qk8"):    # these routes take head sizes 64 and 128
        classes = [(dataclasses.replace(c, fp8=True, head_size=min(c.head_size, 128)), None) for c, _ in classes]
    tolerance = (lambda cls: fuzz.FP8_Q_TOLERANCE) if kernel == "decode_mgpu_qk8" else (
        lambda cls: fuzz.TOLERANCE[cls.dtype])
    if kernel == "decode":
        classes = [(c, lens) for c, lens in fuzz.regression_classes()] + classes
    fn = KERNELS[kernel]
    rows = []
    for ci, (cls, fixed_lens) in enumerate(classes):
        for k in range(cases_per_class):
            lengths = ([(n - 1, 1) for n in fixed_lens] if fixed_lens and k == 0
                       else fuzz.random_lengths(rng, cls))
            case = fuzz.make_case(rng, cls, lengths)
            arrays, kwargs = case.kernel_args()
            out = fn(*arrays, **kwargs, interpret=interpret)
            err = fuzz.error(out, case)
            rows.append(dict(kernel=kernel, cls=ci, case=k, shape=cls.describe(),
                             lengths=[int(a + b) for a, b in lengths], err=err,
                             tol=tolerance(cls), block_size=cls.block_size,
                             head_size=cls.head_size, regression=fixed_lens is not None))
    return rows


def _report(rows, kernel: str, seconds: float) -> list[dict]:
    failed = [r for r in rows if not r["err"] <= r["tol"]]
    by_block = {}
    for r in rows:
        n, worst = by_block.get(r["block_size"], (0, 0.0))
        by_block[r["block_size"]] = (n + 1, max(worst, r["err"] / r["tol"]))
    print(f"\n[fuzz] {kernel}: {len(rows)} cases, {len(failed)} failed, {seconds:.0f} s, device "
          f"{jax.devices()[0].device_kind}, worst err {max((r['err'] for r in rows), default=0.0):.3e}")
    for bs, (n, worst) in sorted(by_block.items()):
        print(f"[fuzz]   block {bs:3d}: {n:4d} cases, worst err/tol {worst:.3f}")
    for r in failed[:20]:
        print(f"[fuzz]   FAIL {r}")
    path = os.environ.get("JAXKV_FUZZ_REPORT")
    if path:
        old = json.load(open(path)) if os.path.exists(path) else []
        json.dump(old + rows, open(path, "w"))
    return failed


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="compiled kernels need a GPU (pytest -m gpu on the GPU machine)")
@pytest.mark.parametrize("kernel", ["decode", "prefill", "decode_mgpu", "decode_mgpu_producer", "decode_mgpu_ahead",
                                    "decode_mgpu_qk8t", "decode_mgpu_qk8"])
def test_fuzz_compiled(kernel):
    t0 = time.perf_counter()
    rows = run_fuzz(kernel, num_classes=GPU_CLASSES, cases_per_class=GPU_CASES_PER_CLASS,
                    interpret=False, seed=9)
    failed = _report(rows, kernel, time.perf_counter() - t0)
    assert len(rows) >= GPU_CLASSES * GPU_CASES_PER_CLASS
    assert not failed, f"{len(failed)} of {len(rows)} {kernel} cases off the float64 reference"


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_fuzz_interpreted_smoke(kernel):
    """The generator and reference agree with the kernels in the interpreter (CPU CI)."""
    rows = run_fuzz(kernel, num_classes=CPU_CLASSES, cases_per_class=CPU_CASES_PER_CLASS,
                    interpret=True, seed=1)
    failed = [r for r in rows if not r["err"] <= r["tol"]]
    assert not failed, failed


@pytest.mark.parametrize("cls,lens", fuzz.regression_classes(),
                         ids=lambda x: x.describe() if isinstance(x, fuzz.ShapeClass) else str(x))
def test_issue9_block8_shapes(cls, lens):
    """The decode shapes that were wrong compiled on an H100 (issue 9): compiled on a GPU, interpreted
    on CPU; also checks the step geometry now gives every dot at least 16 keys."""
    from pallas_kernels._paging import MIN_DOT_K, kv_step
    step = kv_step(block_size=cls.block_size, head_size=cls.head_size, itemsize=2, pages=4,
                   max_tile_bytes=32 * 1024, max_pages=cls.table_width)
    assert step.block_k >= MIN_DOT_K
    case = fuzz.make_case(np.random.default_rng(0), cls, [(n - 1, 1) for n in lens])
    arrays, kwargs = case.kernel_args()
    out = paged_attention(*arrays, **kwargs, interpret=not ON_GPU)
    assert fuzz.error(out, case) <= fuzz.TOLERANCE[cls.dtype]


def _lowering_features(cls: fuzz.ShapeClass) -> set:
    """What decides a class's Triton program: page and head size (and padding), GQA rows, dtype, fp8,
    window, soft cap, ALiBi, the query length (prefill) and a table wide enough to split (decode)."""
    from pallas_kernels.tuning import decode_num_splits
    feats = {("block", cls.block_size), ("head", cls.head_size), ("group", cls.group), ("dtype", cls.dtype),
             ("fp8", cls.fp8), ("window", cls.sliding_window is not None), ("cap", cls.logits_soft_cap is not None),
             ("alibi", cls.alibi), ("kv_heads", cls.num_kv_heads)}
    if cls.kernel == "prefill":
        feats.add(("max_query_len", cls.max_query_len))
    else:
        feats.add(("split", decode_num_splits(cls.num_seqs, cls.num_kv_heads, cls.table_width) > 1))
    return feats


def _default_lowering_subset(classes) -> set[int]:
    """The first 12 classes (every block size, head size and GQA ratio of the generator's cycle), plus each
    later class that brings a feature of :func:`_lowering_features` the earlier picks lack."""
    picked, seen = set(), set()
    for i, cls in enumerate(classes):
        feats = _lowering_features(cls)
        if i < 12 or not feats <= seen:
            picked.add(i)
            seen |= feats
    return picked


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_fuzz_classes_lower_for_sm90(kernel, monkeypatch):
    """Every GPU fuzz shape class lowers through Pallas' Triton lowering for sm_90, on CPU. By default the
    classes of :func:`_default_lowering_subset` (every feature of the 32 classes at least once; the cases
    are drawn for all 32 as before, so they are the same cases); all 32 with ``JAXKV_SLOW=1``.

    Catches lowering failures (a `%` on an int32 index once failed to lower inside the prefill loop
    while passing the interpreter) without a GPU; numbers still need the compiled run. Uses a private
    JAX hook (the GPU-info query) and skips where it moved."""
    import types

    from jax import export
    try:
        from jax._src.pallas.triton import pallas_call_registration as registration
        monkeypatch.setattr(registration.gpu_info_lib, "get_gpu_info",
                            lambda: types.SimpleNamespace(compute_capability=90))
    except (ImportError, AttributeError) as e:
        pytest.skip(f"private Pallas-Triton hook moved: {e}")
    rng = np.random.default_rng(9)
    classes = fuzz.shape_classes(rng, kernel, 32)
    lowered = set(range(len(classes))) if SLOW else _default_lowering_subset(classes)
    for i, cls in enumerate(classes):
        case = fuzz.make_case(rng, cls, fuzz.random_lengths(rng, cls))
        if i not in lowered:
            continue
        arrays, kwargs = case.kernel_args()
        try:
            export.export(jax.jit(lambda *a: KERNELS[kernel](*a, **kwargs)), platforms=("cuda",))(*arrays)
        except ValueError as e:  # export stops at the custom call's compatibility check, after lowering
            if "custom call" not in str(e):
                raise
