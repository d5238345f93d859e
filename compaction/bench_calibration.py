"""Bench: how close the estimator's calibration gets to a provider's own count.

A 20-turn chat against the loopback fake provider (a real HTTP server with its own
tokenizer, which counts differently from Arbor's estimate): each turn the model calls a
tool, reads its result and answers at length, so requests carry tool definitions, tool
calls and results, and grow from a few hundred tokens to several thousand. Every request
goes through the turn engine, so the factor is learned exactly as in production. The
*true ratio* is the provider's count over Arbor's raw estimate of the same requests
(median of the last ten); the goal is a learned factor within 10% of it.

Needs the database (a throwaway user, deleted at the end) and runs from
``manage.py bench_compaction``.
"""

from __future__ import annotations

import statistics
from typing import Any

from django.contrib.auth import get_user_model

from compaction import services as compaction
from compaction.models import ModelCalibration
from conversations import services, turns
from conversations.providers import make_provider, resolve_model
from conversations.providers.fake import FakeLLMServer, Step

BENCH_USERNAME = "__arbor_bench_calibration__"
MODEL = "fake/bench-calibration"
TURNS = 20
ANSWER = (
    "The figures line up with what the log said: the build spends most of its time in "
    "the linker, and the cache misses come from the generated headers. "
)


def run(turn_count: int = TURNS) -> dict[str, Any]:
    User = get_user_model()
    User.objects.filter(username=BENCH_USERNAME).delete()
    # Calibration is kept per model and deployment (ModelSpec.calibration_key).
    key = resolve_model(MODEL).calibration_key
    ModelCalibration.objects.filter(model=key).delete()
    user = User.objects.create_user(username=BENCH_USERNAME)
    fake = FakeLLMServer(context_window=1_000_000).start()
    pairs: list[tuple[int, int]] = []
    original_make, original_observe = turns.make_provider, compaction.calibration_observe

    def provider(spec: Any, **kwargs: Any) -> Any:
        return make_provider(spec, base_url=fake.openai_base_url, **kwargs)

    def observe(*, raw_estimate: int, measured: int, **rest: Any) -> Any:
        pairs.append((raw_estimate, measured))
        return original_observe(raw_estimate=raw_estimate, measured=measured, **rest)

    turns.make_provider = provider  # type: ignore[assignment]
    compaction.calibration_observe = observe
    try:
        conv = services.conversation_create(owner=user, title="calibration", model=MODEL)
        for n in range(turn_count):
            expression = f"{n + 17} * {n + 3} + {n * 7}"
            fake.push(
                Step.tools({"name": "calculator", "arguments": {"expression": expression}}),
                Step.reply(f"Turn {n}: {ANSWER * (2 + n % 4)}"),
            )
            turns.turn_run(
                conversation=conv,
                parts=[{"type": "text", "text": f"Step {n}: compute {expression} and explain."}],
            )
        row = ModelCalibration.objects.get(model=key)
    finally:
        turns.make_provider = original_make
        compaction.calibration_observe = original_observe
        fake.stop()
        for owned in user.conversations.all():
            services.conversation_delete(conversation=owned)
        user.delete()
        ModelCalibration.objects.filter(model=key).delete()
    ratios = [measured / raw for raw, measured in pairs[-10:]]
    true_ratio = statistics.median(ratios)
    error = abs(row.factor - true_ratio) / true_ratio
    return {
        "turns": turn_count,
        "requests": len(pairs),
        "first_request_tokens": pairs[0][1] if pairs else None,
        "last_request_tokens": pairs[-1][1] if pairs else None,
        "factor": round(row.factor, 4),
        "true_ratio": round(true_ratio, 4),
        "error_pct": round(100 * error, 2),
        "goal_pct": 10.0,
        "met": error <= 0.10,
    }
