"""Flax NNX decoder models and their weight loaders; they attend through jaxkv."""

from jaxkv._lazy import lazy_exports as _lazy_exports

# public name -> the module that defines it; imported on first use (jaxkv/_lazy.py)
_EXPORTS = {
    **dict.fromkeys(("LlamaConfig",), "models.decoder_config"),
    **dict.fromkeys(("DecoderForCausalLM",), "models.decoder"),
    **dict.fromkeys(("ArchSwitches", "DecoderConfig"), "models.decoder_config"),
    **dict.fromkeys(("Gemma3Config",), "models.gemma3_config"),
    **dict.fromkeys(("LLM", "resolve_model"), "models.entrypoints"),
    **dict.fromkeys(("find_smollm2_gguf", "load_llama_gguf"), "models.gguf_loader"),
    **dict.fromkeys(("LlamaForCausalLM", "from_weights"), "models.llama"),
    **dict.fromkeys(("dense_logits", "init_kv_caches", "kv_cache_spec", "layer_names",
                    "load_gguf_checkpoint", "make_engine", "make_model_fn"), "models.engine_setup"),
    **dict.fromkeys(("HFTokenizer", "PlaceholderTokenizer"), "models.hf_tokenizer"),
    **dict.fromkeys(("GGUFTokenizer",), "models.tokenizer"),
}
__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS)
__all__ = ["ArchSwitches", "DecoderConfig", "DecoderForCausalLM", "GGUFTokenizer", "Gemma3Config", "HFTokenizer",
           "LLM", "LlamaConfig", "LlamaForCausalLM", "PlaceholderTokenizer", "dense_logits",
           "find_smollm2_gguf", "from_weights", "init_kv_caches", "kv_cache_spec", "layer_names",
           "load_gguf_checkpoint", "load_llama_gguf", "make_engine", "make_model_fn", "registry",
           "resolve_model"]
