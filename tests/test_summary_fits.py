"""Summary requests always fit (issue 38, item 2): a history many times the window is
summarised in pieces that each fit the window with the reserved output and the margin;
when the provider counts more than the estimate and rejects a piece, the summariser
learns its count and packs that piece again smaller, never resending it; the summary is
written from the originals, not from the elided view."""

from __future__ import annotations

import json
from typing import Any

from compaction.estimate import margin_tokens
from compaction.ladder import ContextView, ModelInfo, SummaryTooLong, run_ladder, summarize_middle
from tests.test_ladder_structure import FILLER, call, msg, result, text

BLIND = ModelInfo(context_window=4_000, max_output=512, vision=False)


def history(rounds: int) -> list[dict[str, Any]]:
    messages = [
        msg("s0", "system", text("You are a build agent.")),
        msg("u0", "user", text("Build it.")),
    ]
    for n in range(rounds):
        messages += [
            msg(f"a{n}", "assistant", text(f"Round {n}."), call(f"c{n}", f"file_{n}.txt")),
            msg(f"t{n}", "tool", result(f"c{n}", f"MARKER-{n} " + FILLER)),
        ]
    messages.append(msg("u1", "user", text("What now?")))
    return messages


class Provider:
    """Counts a prompt as 1.6x Arbor's estimate would (a pessimistic tokenizer) and
    rejects what is over its window, as a provider does."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.prompts: list[str] = []
        self.rejected: list[str] = []

    def __call__(self, prompt: list[dict[str, Any]]) -> str:
        raw = json.dumps(prompt)
        counted = int(len(raw) / 4 * 1.6)
        if counted > self.window:
            self.rejected.append(raw)
            raise SummaryTooLong(counted, self.window)
        assert prompt[0]["metadata"]["max_output"] > 0  # it asks for what it sized
        self.prompts.append(raw)
        return "Built rounds; every step succeeded."


def test_a_history_larger_than_the_window_is_summarised_in_pieces_that_each_fit() -> None:
    messages = history(60)
    view = ContextView.build(messages, budget_tokens=1_500, model=BLIND)
    assert view.estimate() > 5 * BLIND.context_window
    provider = Provider(BLIND.context_window)
    _, report = summarize_middle(view, summarize=provider)
    assert report.applied and report.model_calls >= 6
    capacity = BLIND.context_window - margin_tokens(BLIND.context_window)
    assert all(tokens <= capacity for tokens in report.details["request_tokens"])
    # What the provider rejected was packed again, smaller, and never resent as it was.
    assert provider.rejected and not set(provider.rejected) & set(provider.prompts)
    # Every round's original result reached the summariser (not its elision line).
    seen = "".join(provider.prompts)
    assert all(f"MARKER-{n}" in seen for n in range(60))


def test_the_summary_is_written_from_the_originals_not_the_elided_view() -> None:
    messages = history(20)
    view = ContextView.build(messages, budget_tokens=900, model=BLIND)
    provider = Provider(10**9)
    answer = run_ladder(view, summarize=provider)
    assert "elision" in answer.rungs and "summary" in answer.rungs
    seen = "".join(provider.prompts)
    assert "[elided tool result" not in seen
    assert all(f"MARKER-{n}" in seen for n in range(20))
