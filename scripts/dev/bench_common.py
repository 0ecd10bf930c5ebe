"""Inputs shared by the decode benchmarks (ours and the transformers baseline), so both see the same tokens."""

from __future__ import annotations

import argparse

_TEXT = ("The history of the city of Paris begins with a small settlement on an island in the Seine river, "
         "where a Celtic tribe called the Parisii lived and traded. ") * 4


def decode_prompts(tok, batch: int, length: int) -> list[list[int]]:
    """``batch`` prompts of exactly ``length`` tokens (shifted windows of one English text, repeated as often
    as a long prompt needs), after the BOS token where the tokenizer adds one (Gemma; SmolLM2 adds none, so
    its prompts are unchanged)."""
    text = tok.encode(_TEXT)
    base = text * -(-(length + 7) // len(text))
    bos = tok.encode("", add_special_tokens=True)
    if length <= len(bos):
        raise ValueError(f"length={length} leaves no text token after the BOS token")
    return [bos + base[i % 7: i % 7 + length - len(bos)] for i in range(batch)]


def add_workload_args(p: argparse.ArgumentParser, *, batches: str) -> None:
    """``--batches``, ``--new-tokens``, ``--prompt-len``: the workload both decode benchmarks must share
    (same defaults, so an unflagged run of each measures the same thing)."""
    p.add_argument("--batches", default=batches, help="comma-separated batch sizes")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=32)
