"""SamplingParams: vLLM defaults, validation errors naming field and value, immutability."""

from __future__ import annotations

import dataclasses

import pytest

from jaxkv.sampling_params import SamplingParams


def test_defaults_follow_vllm():
    sp = SamplingParams()
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.seed) == (16, 1.0, 1.0, -1, None)
    assert (sp.stop_token_ids, sp.ignore_eos, sp.min_tokens) == ((), False, 0)
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sp.temperature = 0.5


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_tokens=0), "max_tokens=0 must be >= 1"),
    (dict(temperature=-0.5), "temperature=-0.5 must be >= 0"),
    (dict(top_p=0.0), "top_p=0.0 must be in (0, 1]"),
    (dict(top_p=1.5), "top_p=1.5"),
    (dict(top_k=-2), "top_k=-2"),
    (dict(seed=-1), "seed=-1"),
    (dict(min_tokens=-1), "min_tokens=-1"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens=5 must be <= max_tokens=4"),
    (dict(stop_token_ids=[-3]), "stop_token_ids=(-3,)"),
])
def test_validation_names_field_and_value(kwargs, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert message in str(e.value)


def test_top_k_zero_and_minus_one_both_mean_off():
    assert SamplingParams(top_k=0).top_k == 0 and SamplingParams(top_k=-1).top_k == -1
