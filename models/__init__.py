"""Flax NNX decoder models and their weight loaders; they attend through jaxkv."""

from models import registry
from models.config import LlamaConfig
from models.decoder import DecoderForCausalLM
from models.decoder_config import ArchSwitches, DecoderConfig
from models.gemma3_config import Gemma3Config
from models.entrypoints import LLM, resolve_model
from models.gguf_loader import find_smollm2_gguf, load_llama_gguf
from models.llama import LlamaForCausalLM, from_weights
from models.runner import (dense_logits, init_kv_caches, kv_cache_spec, layer_names, load_gguf_checkpoint,
                           make_engine, make_model_fn)
from models.hf_tokenizer import HFTokenizer, PlaceholderTokenizer
from models.tokenizer import GGUFTokenizer

__all__ = ["ArchSwitches", "DecoderConfig", "DecoderForCausalLM", "GGUFTokenizer", "Gemma3Config", "HFTokenizer", "LLM",
           "LlamaConfig", "PlaceholderTokenizer", "LlamaForCausalLM", "dense_logits",
           "find_smollm2_gguf", "from_weights", "init_kv_caches", "kv_cache_spec", "layer_names",
           "load_gguf_checkpoint", "load_llama_gguf", "make_engine", "make_model_fn", "registry", "resolve_model"]
