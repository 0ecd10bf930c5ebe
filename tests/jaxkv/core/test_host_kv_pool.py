"""The host tier on the host alone: the host block pool (LRU, locks, one pass's copies), swap preemption
and host prefix hits in the scheduler (the exact copies asked for), and the host arrays' copies (NumPy
references)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.core.host_kv_pool import HostBlockPool
from jaxkv.core.kv_cache_manager import KVCacheManager
from jaxkv.core.prefix_cache import block_hashes
from jaxkv.core.request import Request, RequestStatus
from jaxkv.core.scheduler import Scheduler, SchedulerConfig
from jaxkv.sampling_params import SamplingParams
from jaxkv.worker import kv_offload
from jaxkv.worker.kv_offload import MIN_PAIRS, KVOffloader, bytes_per_block, chunks, num_host_blocks_for

BS = 4


# -- HostBlockPool -------------------------------------------------------------------------------------------
def test_prefix_cache_evicts_least_recently_used_and_not_locked_blocks():
    pool = HostBlockPool(3)
    for key, dev in (("a", 10), ("b", 11), ("c", 12)):
        assert pool.offload(key, dev)
    assert pool.offload("a", 99)  # already here: refreshed (now most recent), no copy
    assert pool.end_pass()[0] == [(10, 0), (11, 1), (12, 2)]
    pool.load(pool.match(["b"]), [20])  # b read this pass: locked (and most recent); LRU order c, a, b
    assert pool.offload("d", 13)  # full: c, the least recently used, goes
    assert pool.offload("e", 14)  # then a; b is locked
    assert pool.match(["c"]) == pool.match(["a"]) == [] and pool.match(["b"]) == [1]
    assert pool.match(["d", "e"]) == [2, 0] and pool.num_host_evictions == 2
    out, into = pool.end_pass()
    assert out == [(13, 2), (14, 0)] and into == [(1, 20)]


def test_a_locked_block_is_not_evicted_until_the_pass_ends():
    pool = HostBlockPool(1)
    pool.offload("a", 3)
    pool.end_pass()
    pool.load([0], [5])
    assert not pool.offload("b", 4) and pool.match(["a"]) == [0]  # dropped: a is being read
    assert pool.end_pass() == ([], [(0, 5)])
    assert pool.offload("b", 4) and pool.match(["a"]) == [] and pool.match(["b"]) == [0]


def test_swap_blocks_are_never_evicted_and_freed_blocks_wait_for_the_pass_end():
    pool = HostBlockPool(4)
    pool.offload("x", 5)
    host = pool.swap_out([1, 2, 3, 4])  # evicts x
    assert host is not None and len(set(host)) == 4 and pool.match(["x"]) == []
    assert pool.swap_out([6]) is None  # swapped blocks are not evictable: nothing changes
    pool.end_pass()
    pool.swap_in(host, [7, 8, 9, 10])
    assert pool.allocator.num_free_blocks == 0  # read by this pass's swap-in: not reusable yet
    assert pool.swap_out([6]) is None
    out, into = pool.end_pass()
    assert out == [] and into == list(zip(host, [7, 8, 9, 10])) and pool.allocator.num_free_blocks == 4
    assert pool.num_swaps_out == pool.num_swaps_in == 1 and pool.num_blocks_swapped_in == 4


def test_a_host_block_written_twice_in_a_pass_keeps_the_last_copy():
    pool = HostBlockPool(1)
    pool.offload("a", 3)
    pool.offload("b", 4)  # a evicted, its block reused in the same pass
    assert pool.end_pass()[0] == [(4, 0)] and pool.match(["b"]) == [0]


def test_copying_out_a_block_written_in_the_same_pass_is_refused():
    pool = HostBlockPool(4)
    (h,) = pool.swap_out([1])
    pool.end_pass()
    pool.swap_in([h], [2])
    with pytest.raises(RuntimeError, match="device block 2"):
        pool.swap_out([2])


def test_a_held_block_outlives_passes_and_a_free_of_it_waits_for_its_release():
    """A load in flight holds its host blocks across passes (not evicted, not reused); one freed meanwhile
    (a swap-in's) is freed at the last release."""
    pool = HostBlockPool(2)
    pool.offload("a", 3)
    host = pool.swap_out([4])
    pool.end_pass()
    pool.load(pool.match(["a"]), [5])
    pool.swap_in(host, [6])
    pairs = pool.take_swap_ins()
    assert pairs == [(0, 5), (host[0], 6)] and pool.blocks_to_swap_in == []
    for _ in range(2):
        assert pool.end_pass() == ([], []) and pool.num_held_blocks == 2
        assert not pool.offload("b", 7) and pool.match(["a"]) == [0]  # held: not evicted
        assert pool.allocator.num_free_blocks == 0  # the swap-in's host block: freed, but still read
    pool.release([h for h, _ in pairs])
    assert pool.num_held_blocks == 0 and pool.allocator.num_free_blocks == 1
    assert pool.offload("b", 7) and pool.match(["b"]) == [host[0]]


# -- the scheduler's copies ------------------------------------------------------------------------------------
def _req(i, prompt, max_tokens=8):
    return Request(f"r{i}", list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0), arrival_index=i,
                   seed=i, max_model_len=64, eos_token_ids=frozenset())


def _scheduler(num_blocks, host_blocks, *, mode="swap", prefix=False, async_loads=False, steps=1, delay=0):
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=prefix, host_pool=HostBlockPool(host_blocks))
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, num_scheduler_steps=steps,
                          preemption_mode=mode, max_admission_delay_steps=delay)
    return Scheduler(cfg, kv, async_loads=async_loads)


def _run(s, out, token=1):
    return s.update_from_output(out, [[token] * max(1, n) for _, n in out.scheduled])


def test_swap_preemption_copies_the_blocks_out_and_back_without_recompute():
    s = _scheduler(num_blocks=4, host_blocks=8)
    reqs = [_req(i, range(10 * i, 10 * i + 4)) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    _run(s, s.schedule())  # one block each
    victim_blocks = list(reqs[2].block_ids)
    out = s.schedule()  # r0 takes the last block, r1 needs one: r2 is swapped out
    assert [r.request_id for r in out.preempted] == ["r2"]
    r2 = reqs[2]
    assert r2.num_computed_tokens == 4 and r2.block_ids == [] and r2.host_block_ids is not None
    (host,) = r2.host_block_ids
    assert out.blocks_to_swap_out == list(zip(victim_blocks, host)) and out.blocks_to_swap_in == []
    _run(s, out)
    s.finish_request(reqs[0], RequestStatus.FINISHED_ABORTED)
    out = s.schedule()  # r0's blocks are free: r2 comes back from the host, decoding its next token only
    row = [r for r, _ in out.scheduled].index(r2)
    assert out.scheduled[row][1] == 1 and out.context_lens[row] == 4  # nothing recomputed
    assert [h for h, _ in out.blocks_to_swap_in] == host
    assert [d for _, d in out.blocks_to_swap_in] == r2.block_ids[:1] and r2.host_block_ids is None
    assert s.kv_cache_manager.host_pool.allocator.num_free_blocks == 8


def test_full_host_pool_falls_back_to_recompute():
    s = _scheduler(num_blocks=4, host_blocks=1)
    reqs = [_req(i, range(10 * i, 10 * i + 8)) for i in range(2)]  # two blocks each
    for r in reqs:
        s.add_request(r)
    _run(s, s.schedule())
    out = s.schedule()  # r0 needs a 3rd block: r1 is preempted, its 2 blocks do not fit 1 host block
    assert [r.request_id for r in out.preempted] == ["r1"]
    assert reqs[1].num_computed_tokens == 0 and reqs[1].host_block_ids is None
    assert s.num_swap_fallbacks == 1 and out.blocks_to_swap_out == []


def test_host_prefix_hits_are_copied_back_and_cached_on_the_device():
    s = _scheduler(num_blocks=3, host_blocks=8, mode="recompute", prefix=True)
    kv, host = s.kv_cache_manager, s.kv_cache_manager.host_pool
    a = _req(0, range(9))  # 2 full blocks + 1 token
    s.add_request(a)
    _run(s, s.schedule())
    s.finish_request(a, RequestStatus.FINISHED_ABORTED)  # its 2 full blocks stay cached (evictable)
    b = _req(1, range(100, 109))  # needs all 3 blocks: a's cached blocks are evicted to the host
    s.add_request(b)
    out = s.schedule()
    assert len(out.blocks_to_swap_out) == 2 and host.num_cached_blocks == 2
    _run(s, out)
    s.finish_request(b, RequestStatus.FINISHED_ABORTED)
    c = _req(2, list(range(9)) + [50, 51])  # a's prefix: 2 blocks found on the host, not on the device
    s.add_request(c)
    out = s.schedule()
    (row,) = [i for i, (r, _) in enumerate(out.scheduled) if r is c]
    assert out.context_lens[row] == 8 and out.scheduled[row][1] == 3  # 8 tokens from the host, 3 computed
    assert [h for h, _ in out.blocks_to_swap_in] == host.match(block_hashes(list(range(8)), BS))
    assert [d for _, d in out.blocks_to_swap_in] == c.block_ids[:2]
    assert set(c.block_ids[:2]) <= c.cached_block_ids  # cached on the device again, under the same hashes
    assert kv.prefix_cache_hits == 8 and host.num_host_prefix_hit_blocks == 2


def test_async_host_hits_wait_for_their_load_and_are_cached_only_once_it_landed():
    """With async loads a request with host hits waits (WAITING_FOR_REMOTE_KVS, seat and blocks held, not
    scheduled) while others run; its new device blocks are not found by another request's lookup until the
    load landed; then it runs from its hits on and they are cached on the device."""
    s = _scheduler(num_blocks=4, host_blocks=8, mode="recompute", prefix=True, async_loads=True)
    kv, host = s.kv_cache_manager, s.kv_cache_manager.host_pool
    a = _req(0, range(9))
    s.add_request(a)
    _run(s, s.schedule())
    s.finish_request(a, RequestStatus.FINISHED_ABORTED)
    b = _req(1, range(100, 113))  # needs all 4 blocks: a's cached blocks go to the host
    s.add_request(b)
    _run(s, s.schedule())
    s.finish_request(b, RequestStatus.FINISHED_ABORTED)
    c, d = _req(2, list(range(9)) + [50, 51]), _req(3, [7])
    s.add_request(c)
    s.add_request(d)
    out = s.schedule()
    assert [r for r, _ in out.scheduled] == [d] and out.loads == [c] and out.blocks_to_swap_in == []
    assert c.status == RequestStatus.WAITING_FOR_REMOTE_KVS and s.loading == [c]
    assert [h for h, _ in c.kv_load_pairs] == host.match(block_hashes(list(range(8)), BS))
    assert [t for _, t in c.kv_load_pairs] == c.block_ids[:2] and c.num_computed_tokens == 8
    assert host.num_held_blocks == 2 and not set(c.block_ids) & c.cached_block_ids
    e = _req(4, list(range(9)) + [60])  # the same prefix while c loads: no device hit on c's blocks
    assert kv.get_computed_blocks(e)[0] == []
    _run(s, out)
    out = s.schedule()
    assert out.scheduled == [(d, 1)]  # still loading: c is not scheduled
    _run(s, out)
    host.release([h for h, _ in c.kv_load_pairs])
    s.finish_loading(c)
    assert set(c.block_ids[:2]) <= c.cached_block_ids and kv.get_computed_blocks(e)[0] == c.block_ids[:2]
    out = s.schedule()
    (row,) = [i for i, (r, _) in enumerate(out.scheduled) if r is c]
    assert out.context_lens[row] == 8 and out.scheduled[row][1] == 3 and c.status == RequestStatus.RUNNING


@pytest.mark.parametrize("delay", [0, 3])
def test_decode_loops_run_while_a_load_is_in_flight_within_the_admission_delay(delay):
    """While a request loads, the others run decode loops holding it back at most max_admission_delay_steps
    steps in all (as an admissible waiting request): with 3, one 3-step loop, then single steps until a
    pass admits; with 0, single steps only (a landed load joins at the next pass)."""
    s = _scheduler(num_blocks=8, host_blocks=8, mode="recompute", prefix=True, async_loads=True, steps=4,
                   delay=delay)
    a = _req(0, range(9))
    s.add_request(a)
    _run(s, s.schedule())
    s.finish_request(a, RequestStatus.FINISHED_ABORTED)
    b = _req(1, range(100, 129), max_tokens=2)  # 31 tokens in all 8 blocks: a's cached blocks go to the host
    s.add_request(b)
    for _ in range(4):
        _run(s, s.schedule())
    assert b.is_finished
    d, c = _req(3, [7], max_tokens=20), _req(2, list(range(9)) + [50, 51])
    s.add_request(d)
    s.add_request(c)
    out = s.schedule()  # d's prefill; c's host hits start loading
    assert out.loads == [c] and out.scheduled == [(d, 1)] and s.loading == [c]
    _run(s, out)
    steps = []
    for _ in range(3):
        out = s.schedule()
        steps.append(out.num_decode_steps)
        _run(s, out)
    assert steps == ([3, 0, 3] if delay else [0, 0, 0])  # a plain step (0) admits nothing: the budget resets
    s.kv_cache_manager.host_pool.release([h for h, _ in c.kv_load_pairs])
    s.finish_loading(c)
    out = s.schedule()
    assert out.num_decode_steps == 0 and c in [r for r, _ in out.scheduled]


def test_an_async_load_cancelled_by_an_abort_frees_its_device_blocks_at_once():
    s = _scheduler(num_blocks=4, host_blocks=8, async_loads=True)
    reqs = [_req(i, range(10 * i, 10 * i + 4)) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    _run(s, s.schedule())
    out = s.schedule()  # r2 preempted: swapped out
    _run(s, out)
    s.finish_request(reqs[0], RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    assert out.loads == [reqs[2]]

    class Load:
        cancelled = False

        def cancel(self):
            self.cancelled = True

    reqs[2].kv_load = load = Load()
    free = s.kv_cache_manager.allocator.num_free_blocks
    s.finish_request(reqs[2], RequestStatus.FINISHED_ABORTED)
    assert load.cancelled and s.loading == [] and s.kv_cache_manager.allocator.num_free_blocks == free + 2


# -- KVOffloader -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("reuse_staging,budget,dtype,pinned,threads", [
    (False, None, "float32", False, 1), (True, None, "float32", False, 1), (True, 0, "float32", False, 1),
    (True, None, "bfloat16", False, 1), (True, None, "bfloat16", None, 3), (True, 0, "float32", None, 2)],
    ids=["fresh-staging", "reused-staging", "staging-over-budget", "bfloat16", "pinned-bfloat16-3-threads",
         "pinned-over-budget-2-threads"])
def test_offloader_copies_blocks_both_ways_like_numpy(reuse_staging, budget, dtype, pinned, threads, monkeypatch):
    """Both directions against NumPy indexing; with staging buffers reused (the GPU's path, forced here) two
    host -> device copies of one padded size in a row each deliver their own blocks; past the staging budget
    every copy gets a fresh buffer and none is kept; bfloat16 caches (moved as their bytes) arrive bit-exact.
    The pinned path (pinned_host staging written through a NumPy view, copies split over threads by tensor)
    delivers the same, and its arrays reach the scatter uncommitted: the caches it returns stay uncommitted (a
    committed cache would make every step program compile again)."""
    if budget is not None:
        monkeypatch.setattr(kv_offload, "STAGING_BYTES", budget)
    rng = np.random.default_rng(0)
    shape = (2, 40, 2, BS, 8)  # [2, num_blocks, num_kv_heads, block_size, head_size]
    # three tensors in two groups (one transfer each): two of one shape around one with another head count
    dev_np = [rng.standard_normal(shp).astype(jnp.dtype(dtype)) for shp in (shape, (2, 40, 1, BS, 8), shape)]
    caches = [jnp.asarray(c) for c in dev_np]
    off = KVOffloader(caches, 24, pinned=pinned, num_copy_threads=threads)
    assert (off.pinned is not None) == (pinned is None)  # this JAX's CPU backend has pinned_host memory
    if pinned is False:
        off._reuse_staging = reuse_staging
    assert off.groups == ((0, 2), (1,)) and [h.shape[:3] for h in off.host_caches] == [(2, 2, 24), (1, 2, 24)]
    assert off.host_bytes == 24 * bytes_per_block(caches) == 24 * 2 * (5 * BS * 8 * jnp.dtype(dtype).itemsize)
    out = list(zip(rng.permutation(40)[:20].tolist(), rng.permutation(24)[:20].tolist()))  # 20 pairs: padded to 32
    off.swap_out(caches, out)
    off.poll()
    for d, h in out:
        for t in range(3):
            np.testing.assert_array_equal(off.host_block(h)[t], dev_np[t][:, d])
    ref = [c.copy() for c in dev_np]
    src_of = {hh: dd for dd, hh in out}
    for into in ([(h, d) for (_, h), d in zip(out[:5], (0, 7, 8, 39, 3))],
                 [(h, d) for (_, h), d in zip(out[5:9], (1, 2, 38, 9))]):  # one padded size: 16
        caches = off.swap_in(caches, into)
        for h, d in into:
            for t in range(3):
                ref[t][:, d] = dev_np[t][:, src_of[h]]
    for t in range(3):
        np.testing.assert_array_equal(np.asarray(caches[t]).view(np.uint8), ref[t].view(np.uint8))  # bit-exact
    assert off.bytes_to_host == 20 * off.block_bytes and off.bytes_to_device == 9 * off.block_bytes
    kept = sum(len(ring) for ring in off._staging.values())
    assert (kept > 0) == (reuse_staging and budget is None)
    assert off.staging_bytes <= kv_offload.STAGING_BYTES
    assert not any(c.committed for c in caches)


def test_kv_offloading_size_in_gib_rounds_down_and_rejects_bad_values():
    caches = [jnp.zeros((2, 4, 1, BS, 8), jnp.float32)]  # 256 bytes a block
    assert num_host_blocks_for(1000 * 256 / 2**30, caches) == 1000
    assert num_host_blocks_for(1000.9 * 256 / 2**30, caches) == 1000
    for bad in (0, -1.0, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match="kv_offloading_size"):
            num_host_blocks_for(bad, caches)
    with pytest.raises(ValueError, match="holds no block of 256 bytes"):
        num_host_blocks_for(100 / 2**30, caches)


def test_copies_go_in_power_of_two_chunks_with_little_padding():
    for n in (1, 15, 16, 17, 20, 100, 600, 1536):
        pieces = chunks(n)
        assert [s for s, _, _ in pieces] == list(np.cumsum([0] + [c for _, c, _ in pieces[:-1]]))
        assert sum(c for _, c, _ in pieces) == n
        assert all(size & (size - 1) == 0 and size >= MIN_PAIRS and c <= size for _, c, size in pieces)
        assert sum(size - c for _, c, size in pieces) < MIN_PAIRS


def test_a_load_lands_like_numpy_after_the_writes_it_reads():
    """start_load / finish_load (the engine's asynchronous host -> device copy) against NumPy: it reads host
    blocks whose device -> host copies were still pending when it started (one of them rewritten by a later
    pass), and 20 pairs land in two padded chunks."""
    rng = np.random.default_rng(2)
    dev_np = rng.standard_normal((2, 40, 1, BS, 4)).astype(np.float32)
    caches = [jnp.asarray(dev_np)]
    off = KVOffloader(caches, 24)
    off.swap_out(caches, [(d, d) for d in range(20)])  # host block h <- device block h ...
    off.swap_out(caches, [(39, 3)])  # ... host block 3 rewritten by a later pass
    pairs = [(h, 20 + h) for h in range(20)]
    load = off.start_load(pairs)
    load.wait(10.0)
    assert load.gathered and load.ready
    caches = off.finish_load(caches, load)
    ref = dev_np.copy()
    for h, d in pairs:
        ref[:, d] = dev_np[:, 39 if h == 3 else h]
    np.testing.assert_array_equal(np.asarray(caches[0]), ref)
    assert off.bytes_to_device == 20 * off.block_bytes and off.load_s > 0


@pytest.mark.parametrize("pinned", [False, None], ids=["pageable", "pinned"])
def test_a_host_to_device_copy_sees_the_latest_pending_write_and_leaves_unrelated_ones_pending(pinned):
    """Pageable staging keeps an unrelated copy pending; pinned staging hands every copy to the writer thread
    when it is issued (the writer then waits for the gather), in order, so the latest write wins there too."""
    rng = np.random.default_rng(1)
    dev_np = rng.standard_normal((2, 8, 1, BS, 4)).astype(np.float32)
    caches = [jnp.asarray(dev_np)]
    off = KVOffloader(caches, 4, pinned=pinned)
    off.swap_out(caches, [(1, 0)])  # host block 0 <- device block 1 ...
    off.swap_out(caches, [(2, 0)])  # ... then <- device block 2 (a later pass reused host block 0)
    off.swap_out(caches, [(3, 1)])  # unrelated to the copy below
    caches = off.swap_in(caches, [(0, 5)])
    np.testing.assert_array_equal(np.asarray(caches[0])[:, 5], dev_np[:, 2])
    assert len(off._pending) == (1 if pinned is False else 0)  # pageable: host block 1's copy is on its way
    np.testing.assert_array_equal(off.host_block(1)[0], dev_np[:, 3])
