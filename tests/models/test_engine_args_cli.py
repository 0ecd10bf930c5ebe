"""The engine's flags, declared once (:meth:`EngineArgs.add_cli_args`) and read the same by every command:
``jaxkv serve``, ``jaxkv generate``, ``jaxkv bench throughput`` and ``scripts/bench_multiturn.py``; their
choices are :mod:`jaxkv.config`'s tuples; EngineArgs' own checks (no model is loaded)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxkv import config
from models.benchmarks import throughput
from models.entrypoints.cli import generate
from models.entrypoints.engine_args import EngineArgs, llm_kwargs_from_cli
from models.entrypoints.openai import server
from tests.conftest import load_script

# command -> (parse_args, base argv, the defaults it sets itself)
COMMANDS = {
    "generate": (generate.parse_args, ["--prompt", "x"], {}),
    "serve": (server.parse_args, [], {"compile_top_k_top_p": True, "compile_structured_outputs": True}),
    "bench throughput": (throughput.parse_args, [], {}),
    "bench_multiturn": (lambda argv: load_script("bench_multiturn").parse_args(argv), [],
                        {"num_gpu_blocks": 2048, "kv_offloading_size": 8.0, "preemption_mode": "swap"}),
}
CHOICES = {"--kv-cache-dtype": config.KV_CACHE_DTYPES, "--dtype": config.MODEL_DTYPES,
           "--attention-impl": config.ATTENTION_IMPLS, "--load-format": config.LOAD_FORMATS,
           "--preemption-mode": config.PREEMPTION_MODES, "--compile-ahead": config.COMPILE_AHEAD_MODES}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_reads_the_engine_flags_alike(command):
    parse, base, own = COMMANDS[command]
    assert EngineArgs.from_cli_args(parse(base)) == EngineArgs(**own)  # unset flags: EngineArgs' defaults
    argv = ["--model", "llama-3.1-8b", "--load-format", "dummy", "--kv-cache-dtype", "fp8", "--block-size", "32",
            "--max-num-seqs", "7", "--num-blocks", "99", "--no-enable-prefix-caching", "--prefill-chunk-size", "64",
            "--steps-per-sync", "2", "--attention-impl", "reference", "--kv-offloading-size", "1.5",
            "--preemption-mode", "swap", "-tp", "2", "-dp", "3", "--no-compilation-cache"]
    args = parse(base + argv)
    want = EngineArgs(**{**own, **dict(
        model="llama-3.1-8b", load_format="dummy", kv_cache_dtype="fp8", block_size=32, max_num_seqs=7,
        num_gpu_blocks=99, enable_prefix_caching=False, long_prefill_token_threshold=64, num_scheduler_steps=2,
        attention_impl="reference", kv_offloading_size=1.5, preemption_mode="swap", tensor_parallel_size=2,
        compilation_cache_dir=None)})
    assert EngineArgs.from_cli_args(args) == want
    kwargs = llm_kwargs_from_cli(args)
    assert kwargs == {**dataclasses.asdict(want), "data_parallel_size": 3, "enable_multiprocessing": None}


@pytest.mark.parametrize("command", COMMANDS)
def test_choices_are_the_canonical_tuples(command, capsys):
    parse, base, _ = COMMANDS[command]
    for flag, choices in CHOICES.items():
        assert getattr(parse(base + [flag, choices[-1]]), flag[2:].replace("-", "_")) == choices[-1]
        with pytest.raises(SystemExit):
            parse(base + [flag, "no-such-value"])
        assert f"argument {flag}: invalid choice: 'no-such-value'" in capsys.readouterr().err


def test_add_cli_args_rejects_a_default_for_no_flag():
    import argparse
    with pytest.raises(ValueError, match=r"defaults \['max_num_seq'\] name no engine flag"):
        EngineArgs.add_cli_args(argparse.ArgumentParser(), max_num_seq=3)


def test_gguf_replaces_the_model():
    args = generate.parse_args(["--prompt", "x", "--model", "gemma3-270m", "--gguf", "/tmp/m.gguf"])
    assert EngineArgs.from_cli_args(args).model == "/tmp/m.gguf"


@pytest.mark.parametrize("options,message", [
    (dict(preemption_mode="swap"), "preemption_mode='swap' needs a host tier"),
    (dict(preemption_mode="offload"), "preemption_mode='offload' is not one of"),
    (dict(kv_offloading_size=0), "kv_offloading_size=0 must be a finite number of GiB > 0"),
    (dict(kv_offloading_size=float("nan")), "kv_offloading_size=nan must be"),
    (dict(kv_offloading_size="2"), "kv_offloading_size='2' must be"),
    (dict(kv_cache_dtype="int8"), "kv_cache_dtype='int8' is not one of"),
    (dict(attention_impl="flash"), "attention_impl='flash' is not one of"),
    (dict(structured_outputs_in_step=True, tensor_parallel_size=2),
     "structured_outputs_in_step=True needs one device per engine, not tensor_parallel_size=2"),
])
def test_engine_args_reject_bad_options(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        EngineArgs(**options)


def test_memory_report_gives_the_largest_device_in_gib(monkeypatch):
    """The engine's ``memory_gib`` report: per device after the warm-up, the largest over the mesh, in GiB, with the
    activation reserve the cache was sized with (by hand: the logits of 256 rows x4 and 64 f32 per hidden unit of
    each batched token) and the programs' largest temporary buffers; ``None`` without memory statistics (CPU)."""
    from types import SimpleNamespace

    import jax

    from models.entrypoints import engine_args as ea

    config = SimpleNamespace(vocab_size=128256, hidden_size=8192)
    args = EngineArgs(model="x", max_num_seqs=256)
    engine = SimpleNamespace(runner=SimpleNamespace(warmup_temp_bytes=3 * 2**30))
    gib = 2**30
    stats = [dict(bytes_limit=100 * gib, bytes_in_use=70 * gib, peak_bytes_in_use=80 * gib),
             dict(bytes_limit=100 * gib, bytes_in_use=72 * gib, peak_bytes_in_use=79 * gib)]
    mesh = SimpleNamespace(devices=np.array([SimpleNamespace(memory_stats=lambda s=s: s) for s in stats]))
    report = ea._memory_report(engine, mesh, config, args, 8192)
    reserve = 4 * 4 * 256 * 128256 + 64 * 8192 * 8192 * 4
    assert report == dict(limit=100.0, in_use=72.0, peak=80.0, activation_reserve=round(reserve / gib, 2),
                          program_temp_max=3.0)
    monkeypatch.setattr(jax, "devices", lambda: [SimpleNamespace(memory_stats=lambda: None)])
    assert ea._memory_report(engine, None, config, args, 8192) is None
