"""The scheduler and KV-cache manager on the host alone (no model): budgets, chunking, blocks on
demand, preemption order, prefix hits, stop checks."""

from __future__ import annotations

import pytest

from jaxkv.core.kv_cache_manager import KVCacheManager
from jaxkv.core.prefix_cache import block_hashes
from jaxkv.core.request import Request, RequestStatus
from jaxkv.core.scheduler import Scheduler, SchedulerConfig
from jaxkv.sampling_params import SamplingParams

BS = 4


def _req(i, prompt_len, max_tokens=8, **kw):
    return Request(f"r{i}", list(range(100 * i, 100 * i + prompt_len)),
                   SamplingParams(max_tokens=max_tokens, temperature=0, **kw), arrival_index=i, seed=i,
                   max_model_len=64, eos_token_ids=frozenset({7}))


def _scheduler(num_blocks=16, prefix=False, **cfg):
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, num_scheduler_steps=1) | cfg
    return Scheduler(SchedulerConfig(**cfg), KVCacheManager(num_blocks, BS, enable_prefix_caching=prefix))


def _run(s, out, token=1):
    """Pretend the model sampled ``token`` for every scheduled request."""
    return s.update_from_output(out, [[token] * max(1, n) for _, n in out.scheduled])


def test_budget_chunking_and_blocks_on_demand():
    s = _scheduler(long_prefill_token_threshold=6)
    a, b, c = _req(1, 10), _req(2, 3), _req(3, 12)
    for r in (a, b, c):
        s.add_request(r)
    out = s.schedule()
    # a: 6 (threshold), b: 3, c: 6 (threshold; 7 of the 16-token budget were left)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("r1", 6), ("r2", 3), ("r3", 6)]
    assert [len(r.block_ids) for r in (a, b, c)] == [2, 1, 2]  # blocks for scheduled tokens only
    _run(s, out)
    assert (a.num_output_tokens, b.num_output_tokens, c.num_output_tokens) == (0, 1, 0)
    out = s.schedule()  # running first: a's rest (4), b decodes (1), c's next chunk (6); in the batch the
    # one-token rows come first (the attention op's leading decodes), the rest in scheduling order
    assert [(r.request_id, n) for r, n in out.scheduled] == [("r2", 1), ("r1", 4), ("r3", 6)]
    _run(s, out)
    out = s.schedule()  # a, b, c decode now
    assert [n for _, n in out.scheduled] == [1, 1, 1]


def test_preempts_the_most_recently_admitted_and_requeues_it_first():
    s = _scheduler(num_blocks=4)
    reqs = [_req(i, 4, max_tokens=8) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    _run(s, s.schedule())  # three 4-token prompts, one block each, 1 token generated each
    assert s.kv_cache_manager.allocator.num_free_blocks == 1
    out = s.schedule()  # each now needs a 2nd block: r0 gets the last one, r1 needs one -> r2 preempted
    assert [r.request_id for r, _ in out.scheduled] == ["r0", "r1"] or out.preempted
    assert [r.request_id for r in out.preempted] == ["r2"]
    assert reqs[2].status == RequestStatus.PREEMPTED and reqs[2].num_computed_tokens == 0
    assert reqs[2].output_token_ids == [1] and reqs[2].block_ids == []
    assert s.waiting[0] is reqs[2] and s.num_preemptions == 1
    _run(s, out)
    # every request ends with its 8 tokens (re-prefilled with prompt + generated tokens after each
    # preemption) and every block comes back
    while s.has_unfinished_requests():
        out = s.schedule()
        for r, n in out.scheduled:
            if r.num_preemptions and r.num_computed_tokens == 0:
                assert n == r.num_tokens  # prompt + the tokens it had generated
        _run(s, out)
    assert all(r.num_output_tokens == 8 for r in reqs)
    assert s.kv_cache_manager.num_free_blocks == 4


def test_multi_step_decode_when_nothing_waits():
    s = _scheduler(num_scheduler_steps=4)
    a, b = _req(1, 3, max_tokens=3), _req(2, 3, max_tokens=9)
    s.add_request(a)
    s.add_request(b)
    _run(s, s.schedule())
    out = s.schedule()
    assert out.num_decode_steps == 4 and [n for _, n in out.scheduled] == [2, 4]  # a has 2 tokens left
    s.update_from_output(out, [[5, 5, 5, 5], [6, 6, 6, 6]])
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and a.output_token_ids == [1, 5, 5]
    assert b.num_output_tokens == 5 and b.num_computed_tokens == 3 + 4


def test_waiting_request_caps_the_loop_at_the_first_length_cap():
    s = _scheduler(max_num_seqs=2, num_scheduler_steps=8)
    for r in (_req(1, 3, max_tokens=3), _req(2, 3, max_tokens=20), _req(3, 3)):
        s.add_request(r)
    _run(s, s.schedule())
    out = s.schedule()  # r3 waits for a seat: the loop ends when r1's seat frees (2 more tokens)
    assert out.num_decode_steps == 2


def test_stop_checks_eos_stop_tokens_min_tokens():
    s = _scheduler()
    eos, stop, ign = _req(1, 3), _req(2, 3, stop_token_ids=[9]), _req(3, 3, ignore_eos=True)
    mt = _req(4, 3, min_tokens=2)
    for r in (eos, stop, ign, mt):
        s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, [[7], [9], [7], [7]])
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.output_token_ids == [7] and eos.stop_reason is None
    assert stop.status == RequestStatus.FINISHED_STOPPED and stop.stop_reason == 9 and stop.output_token_ids == [9]
    assert ign.status == RequestStatus.RUNNING and ign.output_token_ids == [7]
    assert mt.status == RequestStatus.RUNNING and mt.output_token_ids == [7]  # before min_tokens
    assert s.kv_cache_manager.num_free_blocks == 16 - 2  # finished requests freed their blocks


def test_a_rows_tokens_stop_as_a_per_token_check_would():
    """A device loop hands back several tokens per row: the first stop token counted after
    ``min_tokens`` ends the request before the length cap, as vLLM's ``check_stop`` token by token."""
    import random

    def per_token(req, tokens):  # the reference: vLLM V1's check_stop after each appended token, in its order
        kept, status, reason = [], RequestStatus.RUNNING, None
        for t in tokens:
            kept.append(t)
            n = len(req.output_token_ids) + len(kept)
            if n >= req.max_tokens:
                status = RequestStatus.FINISHED_LENGTH_CAPPED
                break
            if n < req.sampling_params.min_tokens:  # vLLM: num_output_tokens (this token included) < min_tokens
                continue
            if t in req.eos_token_ids:
                status = RequestStatus.FINISHED_STOPPED
                break
            if t in req.stop_token_ids:
                status, reason = RequestStatus.FINISHED_STOPPED, t
                break
        return kept, status, reason

    rng = random.Random(0)
    for i in range(400):
        max_tokens = rng.randint(1, 10)
        req = _req(i, 3, max_tokens=max_tokens, min_tokens=rng.randint(0, max_tokens),
                   stop_token_ids=rng.choice([[], [9], [7, 9]]), ignore_eos=rng.random() < 0.3)
        done = rng.randint(0, req.max_tokens - 1)  # tokens generated before this step
        req.append_output_tokens([1] * done)
        req.status = RequestStatus.RUNNING
        # the scheduler never hands back more than the room left; longer rows check the cap's order too
        tokens = [rng.choice([1, 2, 7, 9]) for _ in range(rng.randint(0, req.max_tokens - done + 2))]
        want = per_token(req, tokens)
        got = Scheduler._append(req, tokens)
        assert (got, req.status, req.stop_reason) == want, (i, tokens)
        assert req.output_token_ids == [1] * done + got


def test_prefix_hits_and_cached_blocks_become_evictable():
    s = _scheduler(prefix=True)
    a = _req(1, 10, max_tokens=1)
    s.add_request(a)
    _run(s, s.schedule())
    assert a.is_finished
    kv = s.kv_cache_manager
    assert kv.prefix_cache.num_cached_blocks == 2 and kv.num_free_blocks == 16
    b = Request("b", list(a.prompt_token_ids) + [5, 5], SamplingParams(max_tokens=1), arrival_index=2,
                seed=0, max_model_len=64, eos_token_ids=frozenset())
    assert b.hashes_of_full_blocks(8, BS) == block_hashes(b.all_token_ids[:8], BS)
    s.add_request(b)
    out = s.schedule()
    assert out.scheduled == [(b, 4)] and out.context_lens == [8] and b.num_cached_prompt_tokens == 8
    assert kv.prefix_cache_hit_rate == pytest.approx(8 / 22)


def test_config_validation():
    with pytest.raises(ValueError, match="max_num_batched_tokens=4 < max_num_seqs=8"):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="num_scheduler_steps=0"):
        SchedulerConfig(num_scheduler_steps=0)


def _preq(i, prompt_len, priority, max_tokens=8):
    r = _req(i, prompt_len, max_tokens=max_tokens)
    r.priority = priority
    return r


def test_priority_policy_admits_by_priority_then_arrival():
    """vLLM's ``--scheduling-policy priority``: waiting requests by ``(priority, arrival)``, smaller first; FCFS
    ignores the priorities. A plain sort of the same keys is the reference."""
    import random

    rng = random.Random(0)
    prios = [rng.choice([-1, 0, 0, 2, 5]) for _ in range(12)]
    for policy, want in (("priority", sorted(range(12), key=lambda i: (prios[i], i))), ("fcfs", list(range(12)))):
        s = _scheduler(num_blocks=64, max_num_seqs=1, max_num_batched_tokens=16, policy=policy)
        for i in range(12):
            s.add_request(_preq(i, 3, prios[i], max_tokens=1))
        admitted = []
        while s.has_unfinished_requests():
            out = s.schedule()
            admitted += [r.arrival_index for r, _ in out.scheduled if r.arrival_index not in admitted]
            _run(s, out)
        assert admitted == want, policy


def test_priority_policy_preempts_the_largest_priority_even_if_scheduled_earlier_in_the_step():
    """With blocks short, the running request with the largest ``(priority, arrival)`` is preempted (vLLM's
    choice), also when it already got its tokens earlier in this step: it leaves the step and waits again in
    priority order; every request still ends with all its tokens and every block comes back."""
    s = _scheduler(num_blocks=4, policy="priority")
    reqs = [_preq(0, 4, 9), _preq(1, 4, 0), _preq(2, 4, 1)]  # r0: the lowest priority, admitted first (alone)
    s.add_request(reqs[0])
    _run(s, s.schedule())
    for r in reqs[1:]:
        s.add_request(r)
    out = s.schedule()
    assert [r.request_id for r, _ in out.scheduled] == ["r0", "r1", "r2"]  # r0 decodes first, then the prompts
    _run(s, out)
    assert s.kv_cache_manager.allocator.num_free_blocks == 0  # r0: 2 blocks (6 tokens), r1 and r2: one each
    out = s.schedule()
    # running order r0, r1, r2: r0 (6 tokens, room in its block) is scheduled first; r1 then needs a 2nd block
    # and none is free: r0 (priority 9) is the victim although it is already in the step, and leaves it
    assert [r.request_id for r in out.preempted] == ["r0"]
    assert "r0" not in [r.request_id for r, _ in out.scheduled]
    assert {r.request_id for r, _ in out.scheduled} == {"r1", "r2"}
    assert reqs[0].status == RequestStatus.PREEMPTED and list(s.waiting) == [reqs[0]]
    s.add_request(_preq(3, 4, 0))
    assert [r.request_id for r in s.waiting] == ["r3", "r0"]  # the new priority-0 request goes first
    _run(s, out)
    while s.has_unfinished_requests():
        _run(s, s.schedule())
    assert all(r.num_output_tokens == 8 for r in reqs)
    assert s.kv_cache_manager.num_free_blocks == 4


def test_priority_queue_is_a_sorted_deque():
    from jaxkv.core.request_queue import PriorityQueue, make_waiting_queue

    q = PriorityQueue()
    reqs = [_preq(i, 1, p) for i, p in enumerate([3, 1, 3, 0, 1])]
    for r in reqs:
        q.append(r)
    assert [r.arrival_index for r in q] == [3, 1, 4, 0, 2] and q[0] is reqs[3] and len(q) == 5
    q.remove(reqs[1])
    assert reqs[1] not in q and q.popleft() is reqs[3]
    q.appendleft(reqs[1])  # a preempted request: back by its priority, not to the front
    assert [r.arrival_index for r in q] == [1, 4, 0, 2]
    with pytest.raises(ValueError, match="scheduling_policy='lifo'"):
        make_waiting_queue("lifo")
    with pytest.raises(ValueError, match="policy='lifo'"):
        SchedulerConfig(policy="lifo")


def test_structured_outputs_take_one_step_of_a_decode_loop_the_others_loop():
    """A structured output's mask comes from the host for each token: in a decode loop it decodes once while
    the others run every step; with its last token still in flight it sits the loop out; structured outputs
    alone run single (mixed) steps."""
    s = _scheduler(num_scheduler_steps=4)
    g, a, b = _req(0, 3, max_tokens=20), _req(1, 3, max_tokens=20), _req(2, 3, max_tokens=20)
    for r in (g, a, b):
        s.add_request(r)
    _run(s, s.schedule())  # the prompts
    g.grammar = object()  # the scheduler only asks whether there is one
    out = s.schedule()
    assert out.num_decode_steps == 4 and [(r.request_id, n) for r, n in out.scheduled] == [
        ("r0", 1), ("r1", 4), ("r2", 4)]
    # async scheduling: the next pass is planned before this one's tokens are back; g's token is in flight
    nxt = s.schedule()
    assert nxt.num_decode_steps == 4 and [r.request_id for r, _ in nxt.scheduled] == ["r1", "r2"]
    _run(s, out)  # the first loop's tokens are back (g's one, a's and b's four)
    assert g.num_output_tokens == 2 and g.num_output_placeholders == 0
    for r in (a, b):
        s.finish_request(r, RequestStatus.FINISHED_ABORTED)
    only = s.schedule()
    assert only.num_decode_steps == 0 and [(r.request_id, n) for r, n in only.scheduled] == [("r0", 1)]
