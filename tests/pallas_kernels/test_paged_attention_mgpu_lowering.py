"""The Mosaic GPU decode kernel lowered for sm_90 on CPU (every class of test_paged_attention_mgpu.py's ``CASES``
and its kernel variants): unsupported ops, casts and layouts fail here. In its own file so that each file's tests
stay within the per-file time budget (tests/file_time_budget.py)."""

from __future__ import annotations

import dataclasses
import os

import jax
import numpy as np
import pytest

from pallas_kernels.paged_attention_mgpu import paged_attention_mgpu
from tests.pallas_kernels import fuzz
from tests.pallas_kernels.test_paged_attention_mgpu import (
    _SLOW,
    AHEAD,
    CASES,
    ON_GPU,
    ONE_Q_TILE,
    PRODUCER,
    QK8,
    QK8T,
    _resolved,
)


@pytest.mark.skipif(ON_GPU, reason="CPU-only lowering check; the GPU runs the compiled tests")
@pytest.mark.parametrize("fp8,persistent", [  # by default the 16-bit grid and every fp8 persistent variant
    (False, False), pytest.param(False, True, marks=_SLOW), pytest.param(True, False, marks=_SLOW), (True, True),
], ids=["False-grid", "False-persistent", "True-grid", "True-persistent"])
def test_lowers_for_sm90(fp8, persistent):
    """Every class of ``CASES`` (fp8 or not) lowers through Pallas Mosaic GPU for CUDA on CPU, as the
    one-CTA-per-item grid and as the persistent kernel (default programs: the items, up to 132 on CPU; and
    2 programs with one query tile, ``ONE_Q_TILE``).

    Export stops after Mosaic GPU has lowered the kernel to its MLIR module (the module is serialised
    into the custom call), so unsupported ops, casts and layouts fail here; shared-memory budget and
    ptxas issues show only on the GPU."""
    from jax import export
    extra = [dict(persistent=True)] if persistent else [dict(persistent=False)]
    for k, (cls, lens, num_splits) in enumerate(CASES):
        cls = dataclasses.replace(cls, fp8=fp8)
        case = fuzz.make_case(np.random.default_rng(0), cls, [(n - 1, 1) for n in lens])
        arrays, kwargs = case.kernel_args()
        variants = extra + ([dict(persistent=True, num_programs=2, **ONE_Q_TILE)]
                            if persistent and k == 0 else [])
        if persistent and fp8:      # the converter warpgroup: 128- and 64-key steps
            variants += [dict(persistent=True, **PRODUCER), dict(persistent=True, block_kv=64, **PRODUCER),
                         dict(persistent=True, **AHEAD)]
            if k in (0, 2):         # the fp8 q·kᵀ routes (head sizes 128 and 64; "qk8" at 128)
                variants += [dict(persistent=True, **QK8T)] + [dict(persistent=True, **QK8)] * (k == 0)
        if fp8 and not persistent:
            variants += [dict(persistent=False, **AHEAD)]
        seen = set()
        for kw in variants:
            key = _resolved(cls, num_splits, **kw)   # a variant naming the default knobs: lowered once
            if key in seen and not os.environ.get("JAXKV_MGPU_FUZZ"):
                continue
            seen.add(key)
            fn = jax.jit(lambda *a, kw=kw: paged_attention_mgpu(*a, **kwargs, num_splits=num_splits, **kw))
            exported = export.export(fn, platforms=("cuda",))(*arrays)
            assert "mosaic_gpu" in exported.mlir_module()
