"""User-facing entry points over the engine: the offline :class:`LLM` (vLLM ``vllm/entrypoints/``)."""

from jaxkv._lazy import lazy_exports as _lazy_exports

# public name -> the module that defines it; imported on first use (jaxkv/_lazy.py)
_EXPORTS = {
    **dict.fromkeys(("LLM", "resolve_model"), "models.entrypoints.llm"),
}
__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
__all__ = ["LLM", "resolve_model"]
