"""The serving engine: sampling parameters, outputs, the model runner and the request-level engine.

vLLM: ``vllm/v1/engine/`` (``LLMEngine`` / ``EngineCore``), ``vllm/sampling_params.py``,
``vllm/outputs.py``. The host-side scheduler and KV-cache manager are in :mod:`jaxkv.core`.
"""

from jaxkv._lazy import lazy_exports as _lazy_exports

# public name -> the module that defines it; imported on first use (jaxkv/_lazy.py)
_EXPORTS = {
    **dict.fromkeys(("EngineStats", "LLMEngine"), "jaxkv.engine.core"),
    **dict.fromkeys(("ModelRunner",), "jaxkv.engine.model_runner"),
    **dict.fromkeys(("CompletionOutput", "RequestOutput"), "jaxkv.engine.outputs"),
    **dict.fromkeys(("SamplingParams",), "jaxkv.engine.sampling_params"),
}
__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
__all__ = ["CompletionOutput", "EngineStats", "LLMEngine", "ModelRunner", "RequestOutput", "SamplingParams"]
