"""Data-parallel placement (jaxkv.engine.load_balancer) against a brute-force reading of its rule."""

import random

import pytest

from jaxkv.engine.load_balancer import PREFIX_TOKENS, UNKNOWN_BUDGET, LoadBalancer


def _requests(n, seed=0):
    rng = random.Random(seed)
    # heavy-tailed output and prompt lengths like ShareGPT's (a few very long ones), distinct first blocks;
    # long prompts with short answers more often than not (what left rank 0 with more prompt tokens when only
    # the output budget was balanced)
    out = []
    for i in range(n):
        extra = min(int(rng.paretovariate(1.1) * 30), 3000)
        out.append(([i, *range(PREFIX_TOKENS), *[7] * extra], min(int(rng.paretovariate(1.2) * 40), 2048)))
    return out


def test_burst_splits_output_budget_and_prompt_tokens_evenly_and_counts_within_slack():
    reqs = _requests(3000)
    lb = LoadBalancer(2)
    for i, (prompt, max_tokens) in enumerate(reqs):
        assert lb.place(str(i), prompt, max_tokens) == lb.rank_of(str(i))
    total = sum(m for _, m in reqs)
    total_prompt = sum(len(p) for p, _ in reqs)
    alternate = [sum(m for _, m in reqs[r::2]) for r in range(2)]
    assert sum(lb.outstanding_tokens) == total and sum(lb.outstanding) == 3000
    assert sum(lb.outstanding_prompt_tokens) == total_prompt
    assert max(lb.outstanding) - min(lb.outstanding) <= 1 + min(lb.outstanding) // 32
    # each load within 1 % of even, and better than alternation on these lengths
    assert max(lb.outstanding_tokens) < 0.51 * total and max(lb.outstanding_tokens) < max(alternate)
    assert max(lb.outstanding_prompt_tokens) < 0.51 * total_prompt


def test_each_choice_follows_the_rule():
    lb = LoadBalancer(3)
    seen = [0, 0, 0]
    for i, (prompt, max_tokens) in enumerate(_requests(500, seed=1)):
        low = min(lb.outstanding)
        eligible = [r for r in range(3) if lb.outstanding[r] <= low + 1 + low // 32]
        mo, mp = (seen[1] + max_tokens) / (seen[0] + 1), (seen[2] + len(prompt)) / (seen[0] + 1)

        def growth(r):  # of the sum of squared loads in units of their means, placing the request on r
            def sq(o, p):
                return sum((o[k] / mo) ** 2 + (p[k] / mp) ** 2 for k in range(3))
            o, p = list(lb.outstanding_tokens), list(lb.outstanding_prompt_tokens)
            before = sq(o, p)
            o[r] += max_tokens
            p[r] += len(prompt)
            return sq(o, p) - before

        r = lb.choose(prompt, max_tokens)
        assert r in eligible
        assert growth(r) <= min(growth(e) for e in eligible) + 1e-9
        lb.assign(str(i), r, max_tokens, len(prompt))
        seen = [seen[0] + 1, seen[1] + max_tokens, seen[2] + len(prompt)]
        if i % 3 == 0:
            lb.forget(str(i - 1))  # finishes free their rank's count and loads


def test_forget_restores_counts_and_unknown_budget():
    lb = LoadBalancer(2)
    lb.assign("a", 1, None, 5)
    lb.assign("b", 0, 7, 3)
    assert lb.outstanding == [1, 1] and lb.outstanding_tokens == [7, UNKNOWN_BUDGET]
    assert lb.outstanding_prompt_tokens == [3, 5]
    assert (lb.rank_of("a"), lb.rank_of("b"), lb.rank_of("c")) == (1, 0, None)
    lb.forget("a")
    lb.forget("a")  # twice, and an unknown id: ignored
    lb.forget("zzz")
    assert lb.outstanding == [1, 0] and lb.outstanding_tokens == [7, 0] and lb.rank_of("a") is None
    assert lb.outstanding_prompt_tokens == [3, 0]


def test_same_prefix_goes_to_the_same_rank_within_slack():
    lb = LoadBalancer(2)
    shared = list(range(100, 100 + PREFIX_TOKENS))
    first = lb.choose(shared + [1])
    lb.assign("0", first, 10)
    owner, moves = first, 0
    for i in range(1, 9):  # the prefix's last rank while its count is within the slack (1 at a low of 0), else
        low = min(lb.outstanding)  # the other, which then owns the prefix
        r = lb.choose(shared + [i])
        assert r == (owner if lb.outstanding[owner] <= low + 1 + low // 32 else 1 - owner)
        moves += r != owner
        owner = r
        lb.assign(str(i), r, 10)
    assert moves >= 2 and max(lb.outstanding) - min(lb.outstanding) <= 2
    # a short prompt (no full first block) is placed on the loads alone: the rank with the smaller budget
    # (9 requests of 10 tokens, no prompt tokens counted: the loads differ)
    assert lb.outstanding_tokens[0] != lb.outstanding_tokens[1]
    assert lb.choose([1, 2, 3], 10) == lb.outstanding_tokens.index(min(lb.outstanding_tokens))


def test_count_rule_alternates_a_burst():
    lb = LoadBalancer(2, by_budget=False)
    ranks = []
    for i, (prompt, max_tokens) in enumerate(_requests(9)):
        ranks.append(lb.choose(prompt))
        lb.assign(str(i), ranks[-1], max_tokens)
    assert ranks == [0, 1] * 4 + [0]


def test_one_engine_and_bad_size():
    assert LoadBalancer(1).choose([1] * 40) == 0
    with pytest.raises(ValueError, match="num_engines=0"):
        LoadBalancer(0)

