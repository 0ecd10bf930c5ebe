"""The engine options' vocabularies, in one place and without JAX (vLLM: the ``Literal`` types of
``vllm/config``): what ``EngineArgs``, the command line and the engine accept.

Front-end processes (the HTTP server, ``LLM``'s caller) import this module to build their parsers and check
options before an engine-core process starts, so it imports nothing heavy.
"""

from __future__ import annotations

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
"""``kv_cache_dtype`` (vLLM ``--kv-cache-dtype`` on CUDA): ``auto`` is the model dtype; ``fp8`` is ``fp8_e4m3``."""

MODEL_DTYPES = ("auto", "float32", "bfloat16", "float16")
"""``dtype`` of the weights and activations: ``auto`` is bfloat16 on GPU, float32 elsewhere."""

ATTENTION_IMPLS = ("pallas", "pallas_interpret", "pallas_mosaic", "pallas_mosaic_interpret", "reference")
"""``attention_impl``: the Pallas kernels (Triton, and Mosaic GPU on Hopper where measured faster), Mosaic
GPU only, either in its interpreter, or the XLA implementation (the CPU default)."""

QUANTIZATIONS = (None, "fp8")
"""``quantization`` (vLLM ``--quantization``): ``None`` runs the checkpoint's weights as they are (an fp8
compressed-tensors checkpoint stays fp8); ``fp8`` quantizes a float checkpoint's Linears to e4m3 at load time."""

LOAD_FORMATS = ("auto", "dummy")
"""``load_format`` (vLLM ``--load-format``): the checkpoint's weights, or random weights made on the device."""

PREEMPTION_MODES = ("recompute", "swap")
"""``preemption_mode`` (vLLM V0's names): prefill a preempted request again, or swap its blocks to the host."""

SCHEDULING_POLICIES = ("fcfs", "priority")
"""``scheduling_policy`` (vLLM ``--scheduling-policy``): arrival order, or the requests' ``priority`` (smaller first,
ties by arrival; the running request with the largest is preempted first)."""

STRUCTURED_OUTPUTS_BACKENDS = ("auto", "guidance", "outlines")
"""``structured_outputs_backend`` (vLLM ``--structured-outputs-config.backend``): a token automaton on the device
where one expresses the request exactly, llguidance otherwise; llguidance always; automata only."""

COMPILE_AHEAD_MODES = ("auto", "on", "off")
"""``compile_ahead``: compile every step bucket before the engine reports ready (``auto``: on GPU only)."""
