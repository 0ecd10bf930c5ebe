"""``jaxkv generate`` as a user runs it: bad input gives one clear line; a real run prints a summary; a hybrid
(sliding + full attention) model over ``-tp 2 -dp 2`` gets a cache sized for its KV-cache groups."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.conftest import jaxkv_command
from tests.models.hf_checkpoints import write_checkpoint


def run(*args, timeout=300, env=None):
    return subprocess.run([*jaxkv_command(), "generate", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.parametrize("args,message", [
    (["--prompt", "hi", "--block-size", "12"], "error: --block-size=12 not supported"),
    (["--prompt", "hi", "--temperature", "-1"], "error: temperature=-1.0 must be >= 0"),
    (["--prompt", "hi", "--top-p", "0"], "error: top_p=0.0 must be in (0, 1]"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "error: max_tokens=0 must be >= 1"),
    (["--prompt", "hi", "--tokenizer", "/nonexistent"], "error: tokenizer='/nonexistent' is not a directory holding"),
])
def test_bad_arguments_fail_fast_with_one_line(args, message):
    proc = run(*args)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_end_to_end_cpu_run_and_errors_on_real_weights(gguf_path):
    proc = run("--prompt", "The capital of France is", "--max-new-tokens", "4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Paris" in proc.stdout
    summary = [line for line in proc.stdout.splitlines() if line.startswith("summary:")]
    assert len(summary) == 1 and "generated_tokens=" in summary[0] and "attention=reference" in summary[0]
    assert "using the XLA reference attention" in proc.stderr  # the CPU fallback says so
    empty = run("--prompt", "")
    assert empty.returncode != 0 and "error: prompts[0] is empty" in empty.stderr


def test_hybrid_model_over_tp_and_dp_gets_blocks_for_every_group(tmp_path):
    """A Gemma 3 checkpoint (one sliding-window and one full-attention layer: two KV-cache groups) over
    ``-tp 2 -dp 2`` on 4 host devices. The cache is sized per group as the engine allocates it; sizing it as one
    group at tp > 1 left 4 blocks for a 23-token request that needs 5 ("the cache has 4 in all")."""
    ckpt = tmp_path / "gemma3"
    write_checkpoint(ckpt, "Gemma3ForCausalLM")
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu", JAXKV_ENABLE_MULTIPROCESSING="1")  # -dp needs engine-core processes
    proc = run(str(ckpt), "-tp", "2", "-dp", "2", "--prompt", "The capital of France is Paris and",
               "--max-tokens", "4", env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tp=2, dp=2" in proc.stderr and "generated_tokens=4" in proc.stdout
