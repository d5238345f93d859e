"""The baselines bench_harness compares Arbor with: trimming with hysteresis keeps what
it trimmed (so the prefix stays cached) and trims only when a request crosses its limit,
counted as the upstream counts."""

from __future__ import annotations

import itertools
from typing import Any

from conversations.gateway.cache_model import PromptCache
from conversations.management.commands.bench_gateway import _HysteresisTrimmer, _naive
from conversations.providers.fake import count_anthropic_request, count_bytes_tokens


def session(rounds: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Go."}]
    for n in range(rounds):
        call = {"type": "tool_use", "id": f"t{n}", "name": "Bash", "input": {"n": n}}
        result = {"type": "tool_result", "tool_use_id": f"t{n}", "content": f"out {n} " * 300}
        messages += [
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [result]},
        ]
    return {"model": "m", "max_tokens": 10, "messages": messages}


def test_trimming_with_hysteresis_keeps_its_prefix_and_stays_under_the_limit() -> None:
    limit = 6_000
    trim = _HysteresisTrimmer(limit, count_bytes_tokens)
    bodies = [trim(session(n)) for n in range(1, 30)]
    sizes = [count_anthropic_request(b, count_text_tokens=count_bytes_tokens) for b in bodies]
    assert max(sizes) <= limit
    # Between two crossings each request extends the one before (its prefix is cached).
    extended = sum(
        1
        for a, b in itertools.pairwise(bodies)
        if b["messages"][: len(a["messages"])] == a["messages"]
    )
    assert extended >= 0.6 * (len(bodies) - 1)
    # Per-request trimming to the same limit rewrites more of the prefix.
    steady, naive = PromptCache(), PromptCache()
    steady_bill = sum(steady.bill(b).billed for b in bodies)
    naive_bill = sum(
        naive.bill(_naive(session(n), limit, count_bytes_tokens)).billed for n in range(1, 30)
    )
    assert steady_bill < naive_bill
