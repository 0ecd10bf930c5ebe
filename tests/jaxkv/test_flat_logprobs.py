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
