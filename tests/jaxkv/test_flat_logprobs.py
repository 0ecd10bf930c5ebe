"""``FlatLogprobs`` against the list of dicts it stands for (built by a plain loop here)."""

import math

import numpy as np
import pytest

from jaxkv.outputs import FlatLogprobs, Logprob


def _reference(ids, lps, ranks, texts):
    out = []
    for row_ids, row_lps, rank in zip(ids, lps, ranks):
        d = {row_ids[0]: Logprob(row_lps[0], rank, texts.get(row_ids[0]))}
        for j in range(1, len(row_ids)):
            if row_ids[j] not in d:  # the chosen token is also among the top ones: it keeps its own rank
                d[row_ids[j]] = Logprob(row_lps[j], j, texts.get(row_ids[j]))
        out.append(d)
    return out


def test_flat_logprobs_reads_as_the_list_of_dicts():
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 6, (9, 4)).tolist()  # a small vocabulary: repeats within a row
    lps = rng.standard_normal((9, 4)).tolist()
    ranks = rng.integers(1, 7, 9).tolist()
    texts = {t: f"<{t}>" for t in range(6)}
    flat = FlatLogprobs(texts=texts)
    flat.extend_rows(ids[:4], lps[:4], ranks[:4])
    flat.extend_rows(ids[4:], lps[4:], ranks[4:])
    ref = _reference(ids, lps, ranks, texts)
    assert len(flat) == 9 and list(flat) == ref and flat == ref and ref == flat
    assert flat[-1] == ref[-1] and flat[2:5] == ref[2:5] and isinstance(flat[2:5], FlatLogprobs)
    assert flat != ref[:-1] and flat != ref[::-1]
    assert math.isclose(flat.chosen_logprob_sum(), sum(row[0] for row in lps), rel_tol=1e-12)
    with pytest.raises(IndexError):
        flat[9]
    assert FlatLogprobs(ids, lps, ranks)[0][ids[0][0]].decoded_token is None  # no texts: no decoded_token


def test_logprobs_lists_round_trip_through_the_wire_as_raw_arrays():
    from jaxkv.engine.protocol import EngineCoreOutput, EngineCoreOutputs, LogprobsLists, decode_output, encode

    rng = np.random.default_rng(1)
    ids = rng.integers(0, 50_000, (7, 6)).astype(np.int32)
    lps = rng.standard_normal((7, 6)).astype(np.float32)
    ranks = rng.integers(1, 9, 7).astype(np.int32)
    lists = LogprobsLists.from_arrays(ids, lps, ranks)
    msg = decode_output(encode(EngineCoreOutputs(0, [EngineCoreOutput("r", [1, 2], new_logprobs=lists)])))
    got = msg.outputs[0].new_logprobs
    assert len(got) == 7 and got.width == 6
    np.testing.assert_array_equal(got.token_ids, ids)
    np.testing.assert_array_equal(got.logprobs, lps)
    np.testing.assert_array_equal(got.ranks, ranks)
    texts = {int(t): str(t) for t in ids.ravel()}
    assert list(FlatLogprobs(got.token_ids, got.logprobs, got.ranks, texts)) == _reference(
        ids.tolist(), lps.tolist(), ranks.tolist(), texts)
    with pytest.raises(ValueError, match="ranks"):
        LogprobsLists.from_arrays(ids, lps, ranks[:3])


def test_flat_logprobs_rejects_rows_of_another_width():
    flat = FlatLogprobs([[1, 2]], [[-0.5, -0.25]], [2])
    with pytest.raises(ValueError, match="width 3 after rows of width 2"):
        flat.extend_rows([[1, 2, 3]], [[-0.5, -0.25, -1.0]], [2])


def test_lists_of_reads_back_as_the_dicts_with_the_chosen_token_anywhere():
    """The in-process path's dicts -> rows -> dicts: chosen token first in the top-k, last in it, and outside."""
    from models.entrypoints.async_llm import lists_of

    top = {10: Logprob(-0.5, 1), 11: Logprob(-1.0, 2), 12: Logprob(-1.5, 3)}
    dicts = [dict(top), dict(top), {**top, 99: Logprob(-4.0, 17)}]
    chosen = [10, 12, 99]
    rows = lists_of(dicts, chosen)
    assert rows.width == 5  # the widest position: the chosen token then four entries
    assert list(FlatLogprobs(rows.token_ids, rows.logprobs, rows.ranks)) == dicts
