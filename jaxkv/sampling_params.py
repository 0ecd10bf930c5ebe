"""Per-request sampling and stopping parameters. vLLM: ``vllm/sampling_params.py`` (the subset served)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request samples and when it stops (vLLM ``SamplingParams`` names and defaults).

    Attributes:
        max_tokens: most tokens to generate (``None``: up to ``max_model_len``).
        temperature: 0 = greedy; > 0 divides the logits.
        top_p: nucleus mass in ``(0, 1]`` (1 = off).
        top_k: keep the ``top_k`` most likely tokens; ``-1`` or ``0`` = off.
        seed: the request's own PRNG seed; with it, its tokens do not depend on the rest of the batch.
            ``None``: the engine draws one.
        stop_token_ids: generation ends when one of these is sampled. The stop token is not part of
            ``CompletionOutput.token_ids``; it is the ``stop_reason``.
        ignore_eos: keep generating after the EOS token (used by throughput benchmarks).
        min_tokens: EOS and ``stop_token_ids`` cannot be sampled before this many tokens (vLLM masks
            their logits).

    Raises:
        ValueError: naming the field and its value, for a value out of range.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be -1 or 0 (off) or >= 1")
        if self.seed is not None and not 0 <= self.seed < 2 ** 63:
            raise ValueError(f"seed={self.seed} must be in [0, 2**63)")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens={self.min_tokens} must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be <= max_tokens={self.max_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids} must be non-negative token ids")

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature == 0
