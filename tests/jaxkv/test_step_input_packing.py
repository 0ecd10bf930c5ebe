"""The model runner sends a step's host inputs as one int32 and one float32 buffer; unpacked inside jit
they must equal the arrays they came from (dtypes, shapes, uint32 bit patterns included)."""

from __future__ import annotations

import jax
import numpy as np

from jaxkv.engine.model_runner import _pack, _unpack


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
    assert ints.size == 37 + 45 + 1 + 5 and floats.size == 10
    out = jax.jit(_unpack, static_argnums=2)(ints, floats, layout)
    assert set(out) == set(arrays)
    for name, want in arrays.items():
        got = np.asarray(out[name])
        assert got.dtype == np.asarray(want).dtype, name
        assert got.shape == np.shape(want), name
        np.testing.assert_array_equal(got, want, err_msg=name)
