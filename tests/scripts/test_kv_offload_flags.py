"""``--kv-offloading-size`` / ``--preemption-mode`` on every script that builds an engine, with EngineArgs'
defaults, and EngineArgs' checks of the two options (no model is loaded)."""

from __future__ import annotations

import pytest

from models.entrypoints.engine_args import EngineArgs
from tests.conftest import load_script


@pytest.mark.parametrize("script,base", [("generate", ["--prompt", "x"]), ("serve", []), ("bench_throughput", []),
                                         ("bench_multiturn", [])])
def test_flags_parse_with_the_shared_defaults(script, base):
    mod = load_script(script)
    args = mod.parse_args(base + ["--kv-offloading-size", "1.5", "--preemption-mode", "swap"])
    assert (args.kv_offloading_size, args.preemption_mode) == (1.5, "swap")
    defaults = mod.parse_args(base)
    if script == "bench_multiturn":  # its "on" mode's tier (the "off" mode has none)
        assert (defaults.kv_offloading_size, defaults.preemption_mode) == (8.0, "swap")
    else:
        assert (defaults.kv_offloading_size, defaults.preemption_mode) == (None, "recompute") == (
            EngineArgs.kv_offloading_size, EngineArgs.preemption_mode)
    with pytest.raises(SystemExit):
        mod.parse_args(base + ["--preemption-mode", "evict"])


def test_serve_builds_engine_args_with_the_tier():
    serve = load_script("serve")
    args = serve.engine_args(serve.parse_args(["--kv-offloading-size", "4", "--preemption-mode", "swap"]))
    assert (args.kv_offloading_size, args.preemption_mode) == (4.0, "swap")


@pytest.mark.parametrize("options,message", [
    (dict(preemption_mode="swap"), "preemption_mode='swap' needs a host tier"),
    (dict(preemption_mode="offload"), "preemption_mode='offload' is not one of"),
    (dict(kv_offloading_size=0), "kv_offloading_size=0 must be a finite number of GiB > 0"),
    (dict(kv_offloading_size=float("nan")), "kv_offloading_size=nan must be"),
    (dict(kv_offloading_size="2"), "kv_offloading_size='2' must be"),
])
def test_engine_args_reject_bad_tier_options(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        EngineArgs(**options)
