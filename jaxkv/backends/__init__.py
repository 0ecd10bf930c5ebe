"""Attention backends: each one fixes the memory layout of a layer's KV cache."""

from jaxkv.backends.base import AttentionBackend
from jaxkv.backends.pallas import PallasAttentionBackend

__all__ = ["AttentionBackend", "PallasAttentionBackend"]
