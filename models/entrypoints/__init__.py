"""User-facing entry points over the engine: the offline :class:`LLM` (vLLM ``vllm/entrypoints/``)."""

from models.entrypoints.llm import LLM, resolve_model

__all__ = ["LLM", "resolve_model"]
