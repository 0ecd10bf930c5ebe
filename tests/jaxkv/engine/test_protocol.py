"""The engine-core messages' msgpack codec: fields survive the round trip."""

from __future__ import annotations

from jaxkv.engine.protocol import AddRequests, EngineCoreRequest, decode_input, encode
from jaxkv.sampling_params import SamplingParams


def test_request_priority_round_trips():
    plain = EngineCoreRequest("a", [1, 2], SamplingParams(max_tokens=3))
    urgent = EngineCoreRequest("b", [3], SamplingParams(max_tokens=3), final_only=True, priority=-5)
    msg = decode_input(encode(AddRequests([plain, urgent], client_index=1)))
    assert [(r.request_id, r.priority, r.final_only) for r in msg.requests] == [("a", 0, False), ("b", -5, True)]
