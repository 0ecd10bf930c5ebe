"""The model runner sends a step's host inputs as one int32 and one float32 buffer; unpacked inside jit
they must equal the arrays they came from (dtypes, shapes, uint32 bit patterns included)."""

from __future__ import annotations

import jax
import numpy as np

from jaxkv.worker.model_runner import _pack, _unpack


def test_pack_unpack_round_trip_under_jit():
    rng = np.random.default_rng(0)
    arrays = {
        "input_ids": rng.integers(-1, 50000, 37).astype(np.int32),
        "block_tables": rng.integers(0, 1 << 20, (5, 9)).astype(np.int32),
        "num_steps": np.int32(7),
        "temperature": rng.random(5).astype(np.float32),
        "seeds": np.array([0, 1, 2**31 - 1, 2**31, 2**32 - 1], np.uint32),  # high bit set: bit patterns
        "top_p": np.array([1.0, 0.5, 0.0, 1e-7, 0.99], np.float32),
    }
    ints, floats, layout = _pack(arrays)
    assert ints.dtype == np.int32 and floats.dtype == np.float32
    # every array starts 256 bytes (64 elements) after the previous one's start or later: Mosaic GPU kernels refuse
    # unaligned inputs, and a static slice of the buffer reaches them as a pointer into it
    assert ints.size == 4 * 64 and floats.size == 2 * 64
    out = jax.jit(_unpack, static_argnums=2)(ints, floats, layout)
    assert set(out) == set(arrays)
    int_sizes = [np.size(a) for a in arrays.values() if np.asarray(a).dtype != np.float32]
    starts = np.cumsum([0] + [-(-n // 64) * 64 for n in int_sizes])[:-1]
    for start, (name, want) in zip(starts, ((k, v) for k, v in arrays.items() if np.asarray(v).dtype != np.float32)):
        assert start % 64 == 0
        np.testing.assert_array_equal(ints[start:start + np.size(want)], np.asarray(want).view(np.int32).ravel()
                                      if np.asarray(want).dtype == np.uint32 else np.ravel(want), err_msg=name)
    for name, want in arrays.items():
        got = np.asarray(out[name])
        assert got.dtype == np.asarray(want).dtype, name
        assert got.shape == np.shape(want), name
        np.testing.assert_array_equal(got, want, err_msg=name)
