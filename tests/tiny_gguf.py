"""A tiny Llama-architecture GGUF header (metadata only) for engine tests that start processes.

``LLM(path, load_format="dummy")`` builds a 2-layer model with random weights from it in well under a second
(SmolLM2's 49k-token vocabulary alone takes 6-10 s to parse on the CPU machine, per process). The vocabulary
is GPT-2 byte-level: the 256 byte symbols, a handful of merges, and two control tokens (``<s>`` = BOS,
``</s>`` = EOS), so any text encodes and decodes round trip.
"""

from __future__ import annotations

import pathlib

import gguf


def _byte_symbols() -> list[str]:
    """GPT-2's byte-level alphabet: printable bytes as themselves, the rest shifted past U+0100."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    out, n = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return [out[b] for b in range(256)]

TINY_CONFIG = dict(block_count=2, context_length=512, embedding_length=64, feed_forward_length=96,
                   head_count=4, head_count_kv=2)


def write_tiny_llama_gguf(path: str | pathlib.Path, **overrides) -> pathlib.Path:
    """Write the header GGUF to ``path`` (``overrides`` change :data:`TINY_CONFIG` keys); returns it."""
    cfg = dict(TINY_CONFIG, **overrides)
    symbols = _byte_symbols()
    merges = ["Ġ t", "Ġ a", "h e", "i n", "r e", "o n", "Ġt he", "e r"]
    tokens = symbols + [a + b for a, b in (m.split(" ") for m in merges)] + ["<s>", "</s>"]
    types = [gguf.TokenType.NORMAL] * (len(tokens) - 2) + [gguf.TokenType.CONTROL] * 2
    path = pathlib.Path(path)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg["block_count"])
    w.add_context_length(cfg["context_length"])
    w.add_embedding_length(cfg["embedding_length"])
    w.add_feed_forward_length(cfg["feed_forward_length"])
    w.add_head_count(cfg["head_count"])
    w.add_head_count_kv(cfg["head_count_kv"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(len(tokens) - 2)
    w.add_eos_token_id(len(tokens) - 1)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path
