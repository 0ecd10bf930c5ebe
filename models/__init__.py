"""Flax NNX decoder models and their weight loaders; they attend through jaxkv."""

from models import registry
from models.config import LlamaConfig
from models.gemma3_config import Gemma3Config
from models.entrypoints import LLM, resolve_model
from models.gguf_loader import find_smollm2_gguf, load_llama_gguf
from models.llama import LlamaForCausalLM, from_weights
from models.runner import (dense_logits, init_kv_caches, kv_cache_spec, layer_names, load_gguf_checkpoint,
                           make_engine, make_model_fn)
from models.tokenizer import GGUFTokenizer

__all__ = ["GGUFTokenizer", "Gemma3Config", "LLM", "LlamaConfig", "LlamaForCausalLM", "dense_logits",
           "find_smollm2_gguf", "from_weights", "init_kv_caches", "kv_cache_spec", "layer_names",
           "load_gguf_checkpoint", "load_llama_gguf", "make_engine", "make_model_fn", "registry", "resolve_model"]
