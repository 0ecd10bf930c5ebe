"""Which data-parallel rank takes a request. vLLM: the load balancing of ``DPLBAsyncMPClient``
(``vllm/v1/engine/core_client.py``), which sends a request to the engine with the fewest waiting and
running requests.

The front end counts each rank's *outstanding* requests (placed, not yet finished), their *outstanding
output budget* (the sum of their ``max_tokens``: the decode steps they may hold a seat for) and their
outstanding *prompt tokens* (the prefill they bring). A request goes to a rank whose count is within a small
slack of the lowest (``1 + lowest // 32``: about 3 %), and among those:

1. the rank that last took a prompt with the same first block of tokens, if any (its prefix cache likely
   holds the prefix; vLLM leaves prefix-aware routing to an external router);
2. otherwise the rank where it adds least to the sum of squares of the two loads, each in units of its mean
   per request so far (output budget and prompt tokens: a greedy balance of both at once); ties in turn.

Why not the count alone: a batch submitted at once (``LLM.generate``) is split by counts alone in
alternation, and on ShareGPT's heavy-tailed lengths that gives one of two ranks ~3 % more output tokens
(3,000 requests), which the run's length then waits for. Why both loads: balancing the output budget alone
split the output tokens to within 0.1 % but left rank 0 with 9-10 % more prompt tokens (3,000-4,000 requests),
and at 8B, where prefill is a quarter of the work, rank 0 spent 12 % longer in its steps (session 19, H200);
both loads balanced: each within 0.1 % (1,000-4,256 requests), counts within 3 %.
A request without ``max_tokens`` counts :data:`UNKNOWN_BUDGET` tokens. ``JAXKV_DP_PLACEMENT=count`` (for
A/B measurements) turns step 2 into vLLM's rule: the fewest outstanding requests, ties in turn.
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
from typing import Sequence

UNKNOWN_BUDGET = 256
PREFIX_TOKENS = 16
_PREFIX_KEYS = 8192


class LoadBalancer:
    """Placement over ``num_engines`` ranks. Thread-safe: the synchronous client places requests on its
    caller's thread while its reader thread forgets finished ones.

    Attributes:
        outstanding: ``[num_engines]`` placed, unfinished requests per rank.
        outstanding_tokens: ``[num_engines]`` their summed output budget per rank.
        outstanding_prompt_tokens: ``[num_engines]`` their summed prompt tokens per rank.
    """

    def __init__(self, num_engines: int, by_budget: bool | None = None):
        if num_engines < 1:
            raise ValueError(f"num_engines={num_engines} must be >= 1")
        self.num_engines = num_engines
        self.by_budget = os.environ.get("JAXKV_DP_PLACEMENT", "budget") != "count" if by_budget is None else by_budget
        self.outstanding = [0] * num_engines
        self.outstanding_tokens = [0] * num_engines
        self.outstanding_prompt_tokens = [0] * num_engines
        self._placed: dict[str, tuple[int, int, int]] = {}  # request_id -> (rank, budget, prompt tokens)
        self._prefix_rank: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._turn = itertools.count()
        self._seen = [0, 0, 0]  # requests placed so far, their output budgets and prompt tokens (the units)
        self._lock = threading.Lock()

    def place(self, request_id: str, prompt_token_ids: Sequence[int], max_tokens: int | None = None) -> int:
        """:meth:`choose` a rank for a request and :meth:`assign` it there, in one step; returns the rank."""
        with self._lock:
            rank = self._choose(prompt_token_ids, max_tokens) if self.num_engines > 1 else 0
            self._assign(request_id, rank, max_tokens, len(prompt_token_ids))
            return rank

    def choose(self, prompt_token_ids: Sequence[int], max_tokens: int | None = None) -> int:
        """The rank for a request (not yet counted: :meth:`assign` does that)."""
        if self.num_engines == 1:
            return 0
        with self._lock:
            return self._choose(prompt_token_ids, max_tokens)

    def _choose(self, prompt_token_ids: Sequence[int], max_tokens: int | None) -> int:
        n = self.num_engines
        low = min(self.outstanding)
        slack = low + 1 + low // 32
        key = (hash(tuple(prompt_token_ids[:PREFIX_TOKENS])) if len(prompt_token_ids) >= PREFIX_TOKENS
               else None)
        if key is not None:
            r = self._prefix_rank.get(key)
            if r is not None and self.outstanding[r] <= slack:
                self._prefix_rank.move_to_end(key)
                return r
        start = next(self._turn)
        order = [(start + i) % n for i in range(n)]
        eligible = [i for i in order if self.outstanding[i] <= slack]
        if self.by_budget:
            r = min(eligible, key=self._cost_fn(_budget(max_tokens), len(prompt_token_ids)))
        else:
            r = min(eligible, key=lambda i: self.outstanding[i])
        if key is not None:
            self._prefix_rank[key] = r
            if len(self._prefix_rank) > _PREFIX_KEYS:
                self._prefix_rank.popitem(last=False)
        return r

    def _cost_fn(self, budget: int, num_prompt_tokens: int):
        """Per rank, how much the request grows the sum of squared loads (each load over its mean per
        request, this request included), less the part that is the same on every rank."""
        count, budgets, prompts = self._seen
        mean_out = max(1.0, (budgets + budget) / (count + 1))
        mean_prompt = max(1.0, (prompts + num_prompt_tokens) / (count + 1))
        wo, wp = budget / mean_out ** 2, num_prompt_tokens / mean_prompt ** 2
        return lambda i: self.outstanding_tokens[i] * wo + self.outstanding_prompt_tokens[i] * wp

    def assign(self, request_id: str, rank: int, max_tokens: int | None = None, num_prompt_tokens: int = 0) -> None:
        """Count ``request_id`` on ``rank`` until :meth:`forget`."""
        with self._lock:
            self._assign(request_id, rank, max_tokens, num_prompt_tokens)

    def _assign(self, request_id: str, rank: int, max_tokens: int | None, num_prompt_tokens: int) -> None:
        budget = _budget(max_tokens)
        self._placed[request_id] = (rank, budget, num_prompt_tokens)
        self.outstanding[rank] += 1
        self.outstanding_tokens[rank] += budget
        self.outstanding_prompt_tokens[rank] += num_prompt_tokens
        self._seen[0] += 1
        self._seen[1] += budget
        self._seen[2] += num_prompt_tokens

    def rank_of(self, request_id: str) -> int | None:
        """The rank ``request_id`` was placed on, while it is outstanding."""
        placed = self._placed.get(request_id)
        return None if placed is None else placed[0]

    def forget(self, request_id: str) -> None:
        """``request_id`` finished or was aborted (unknown ids are ignored)."""
        with self._lock:
            placed = self._placed.pop(request_id, None)
            if placed is not None:
                rank, budget, prompt = placed
                self.outstanding[rank] -= 1
                self.outstanding_tokens[rank] -= budget
                self.outstanding_prompt_tokens[rank] -= prompt


def _budget(max_tokens: int | None) -> int:
    return UNKNOWN_BUDGET if max_tokens is None else int(max_tokens)
