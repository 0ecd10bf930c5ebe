"""Host memory and time of loading a large Hugging Face checkpoint (models/hf_loader.py).

    python scripts/dev/bench_load_memory.py --size-gb 16 [--dir /tmp/ckpt16] [--keep] [-tp N]   # GPU machine
    python scripts/dev/bench_load_memory.py --size-gb 1                                          # CPU demo

Writes (once; reused when ``--dir`` already holds it) a bf16 safetensors checkpoint of a Llama-3.1-8B-shaped
model (hidden 4096, intermediate 14336, 32 query / 8 KV heads) whose layer count and vocabulary are cut to
about ``--size-gb`` GB (16: the real 8B, 32 layers, vocabulary 128256, 4 GB shards with an index; the values are
a repeated random block: speed and memory do not depend on them), then loads it in a fresh process with
``registry.load_checkpoint`` + ``registry.build_model`` (bf16, every parameter on the device) and reports:

* load time (seconds, the weights on the device: ``block_until_ready``);
* peak host RSS above the baseline taken after JAX has started (``/proc/self/status`` sampled every 2 ms, and
  ``VmHWM`` reset through ``/proc/self/clear_refs``), split into anonymous memory (``RssAnon``: what the
  process allocated) and file-backed pages (``RssFile``: the memory-mapped safetensors pages read so far,
  reclaimable page cache);
* on a CPU backend the "device" is host memory: the weights themselves are part of the RSS, so the line
  ``overhead above the weights`` (peak anonymous RSS above baseline minus the weights' bytes) is the loader's cost.

The issue's bar (issue 28): a 16 GB-class checkpoint loads with host memory < 2 GB above the baseline.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

HIDDEN, INTER, HEADS, KV_HEADS, HEAD = 4096, 14336, 32, 8, 128
LAYER_PARAMS = HIDDEN * (HEADS * HEAD) * 2 + HIDDEN * (KV_HEADS * HEAD) * 2 + 3 * HIDDEN * INTER + 2 * HIDDEN


def plan(size_gb: float) -> dict:
    """``config.json`` of a Llama-3.1-8B-shaped model of about ``size_gb`` GB in bf16."""
    total = size_gb * 1e9 / 2  # parameters
    vocab = 128256 if total >= 7.5e9 else max(1024, int(total / 4 / (2 * HIDDEN)) // 64 * 64)
    layers = max(1, round((total - 2 * vocab * HIDDEN) / LAYER_PARAMS))
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab, hidden_size=HIDDEN,
                intermediate_size=INTER, num_hidden_layers=min(layers, 32), num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, hidden_act="silu", max_position_embeddings=8192, rms_norm_eps=1e-5,
                rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16")


def _shapes(cfg: dict) -> dict[str, tuple]:
    d, v, q, kv, f = cfg["hidden_size"], cfg["vocab_size"], HEADS * HEAD, KV_HEADS * HEAD, cfg["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,), "lm_head.weight": (v, d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                   p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                   p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                   p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                   p + "mlp.down_proj.weight": (d, f)}
    return shapes


def write_checkpoint(directory: pathlib.Path, size_gb: float, shard_gb: float = 4.0) -> int:
    """Write the checkpoint shard by shard (host memory: one shard); returns its bytes."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    directory.mkdir(parents=True, exist_ok=True)
    cfg = plan(size_gb)
    block = (np.random.default_rng(0).standard_normal(1 << 20) * 0.02).astype(ml_dtypes.bfloat16)
    shards, current, size = [], [], 0
    for name, shape in _shapes(cfg).items():
        nbytes = int(np.prod(shape)) * 2
        if current and size + nbytes > shard_gb * 1e9:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += nbytes
    shards.append(current)
    weight_map, total = {}, 0
    for s, group in enumerate(shards):
        fname = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in group:
            n = int(np.prod(shape))
            tensors[name] = (np.ones(n, ml_dtypes.bfloat16) if len(shape) == 1
                             else np.resize(block, n)).reshape(shape)
            total += n * 2
        save_file(tensors, str(directory / fname), metadata={"format": "pt"})
        del tensors
        weight_map.update({name: fname for name, _ in group})
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    import tokenizers  # a stand-in tokenizer.json (the directory must have one; its size does not matter)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<s>": 0, "</s>": 1, "<unk>": 2}, unk_token="<unk>"))
    tok.save(str(directory / "tokenizer.json"))
    return total


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def measure(directory: str, tensor_parallel_size: int) -> dict:
    """Load ``directory`` in this process; the numbers of the module docstring."""
    import jax

    from jaxkv.parallel.mesh import make_mesh
    from models import registry

    jax.devices()  # the backend is up: part of the baseline
    mesh = make_mesh(tensor_parallel_size, 1) if tensor_parallel_size > 1 else None
    try:
        pathlib.Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM
    except OSError:
        pass
    base = _status()
    peak = dict(base)
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            for k, v in _status().items():
                peak[k] = max(peak[k], v)
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    config, weights, _ = registry.load_checkpoint(directory)
    model = registry.build_model(config, weights, dtype="bfloat16", mesh=mesh)
    from flax import nnx
    leaves = jax.tree.leaves(nnx.state(model))
    jax.block_until_ready(leaves)
    elapsed = time.perf_counter() - t0
    stop.set()
    sampler.join()
    for k, v in _status().items():
        peak[k] = max(peak[k], v)
    weight_bytes = sum(x.size * x.dtype.itemsize for x in leaves)
    return dict(backend=jax.default_backend(), device=jax.devices()[0].device_kind, tp=tensor_parallel_size,
                load_s=elapsed, weight_bytes=weight_bytes, baseline_rss=base["VmRSS"],
                peak_rss_above_baseline=max(peak["VmRSS"], peak.get("VmHWM", 0)) - base["VmRSS"],
                peak_anon_above_baseline=peak["RssAnon"] - base["RssAnon"],
                peak_file_above_baseline=peak["RssFile"] - base["RssFile"],
                num_layers=config.num_layers, vocab_size=config.vocab_size)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=16.0, help="checkpoint size to write (GB, bf16)")
    p.add_argument("--dir", default=None, help="where the checkpoint is (written when it holds none)")
    p.add_argument("--keep", action="store_true", help="keep a checkpoint written to a temporary directory")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # internal: the child process
    args = p.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.measure, args.tensor_parallel_size)))
        return 0
    tmp = None
    if args.dir is None:
        tmp = tempfile.mkdtemp(prefix="jaxkv-load-bench-")
        args.dir = tmp
    d = pathlib.Path(args.dir)
    if not (d / "config.json").is_file():
        t0 = time.perf_counter()
        size = write_checkpoint(d, args.size_gb)
        print(f"wrote {size / 1e9:.2f} GB to {d} in {time.perf_counter() - t0:.1f} s")
    try:  # a fresh process: the baseline is a started JAX, nothing of the writer
        r = subprocess.run([sys.executable, __file__, "--measure", str(d), "-tp", str(args.tensor_parallel_size)],
                           capture_output=True, text=True, check=False)
        if r.returncode:
            raise SystemExit(f"error: the loading process failed:\n{r.stderr[-4000:]}")
        m = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        if tmp is not None and not args.keep:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
    gb = 1e9
    print(f"backend {m['backend']} ({m['device']}), tp={m['tp']}: {m['num_layers']} layers, vocab {m['vocab_size']}, "
          f"weights {m['weight_bytes'] / gb:.2f} GB")
    print(f"load time                         {m['load_s']:.1f} s ({m['weight_bytes'] / gb / m['load_s']:.2f} GB/s)")
    print(f"baseline RSS (JAX started)        {m['baseline_rss'] / gb:.2f} GB")
    print(f"peak RSS above baseline           {m['peak_rss_above_baseline'] / gb:.2f} GB "
          f"(anonymous {m['peak_anon_above_baseline'] / gb:.2f} GB, file-backed mapped pages "
          f"{m['peak_file_above_baseline'] / gb:.2f} GB)")
    if m["backend"] == "cpu":
        print(f"overhead above the weights        {(m['peak_anon_above_baseline'] - m['weight_bytes']) / gb:.2f} GB "
              "(CPU: the weights live in host memory)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
