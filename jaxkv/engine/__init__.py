"""The serving engine: sampling parameters, outputs, the model runner and the request-level engine.

vLLM: ``vllm/v1/engine/`` (``LLMEngine`` / ``EngineCore``), ``vllm/sampling_params.py``,
``vllm/outputs.py``. The host-side scheduler and KV-cache manager are in :mod:`jaxkv.core`.
"""

from jaxkv.engine.core import EngineStats, LLMEngine
from jaxkv.engine.model_runner import ModelRunner
from jaxkv.engine.outputs import CompletionOutput, RequestOutput
from jaxkv.engine.sampling_params import SamplingParams

__all__ = ["CompletionOutput", "EngineStats", "LLMEngine", "ModelRunner", "RequestOutput", "SamplingParams"]
