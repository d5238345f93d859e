"""The ladder's decisions one by one (compaction/ladder.py): which snapshot attempt is the
answer, what the last resort is, how rung 0 treats each image, and elision of several
results in one message. Pure: no database; the snapshot renderer is the density fake."""

from __future__ import annotations

from typing import Any

from compaction.estimate import Limits
from compaction.ladder import (
    ContextView,
    ModelInfo,
    elide,
    fit_images,
    run_ladder,
    snapshot,
    split_view,
    strip_images,
)
from tests.sample_loaders import DensityRenderer

VISION = ModelInfo(context_window=200_000, max_output=8_000, vision=True, image_billing="claude")
BLIND = ModelInfo(context_window=200_000, max_output=8_000, vision=False, image_billing="claude")
FILLER = "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod. " * 40
SHA1, SHA2, SHA3 = "a1" * 32, "b2" * 32, "c3" * 32

Msg = dict[str, Any]


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def image(sha: str, w: int = 64, h: int = 64) -> dict[str, Any]:
    return {"type": "image", "blob": sha, "mime": "image/png", "width": w, "height": h}


def result(call_id: str, body: str, *extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "tool_result",
        "call_id": call_id,
        "is_error": False,
        "parts": [text(body), *extra],
    }


def call(call_id: str, path: str) -> dict[str, Any]:
    return {"type": "tool_call", "id": call_id, "name": "read", "arguments": {"path": path}}


def msg(mid: str, role: str, *parts: dict[str, Any]) -> Msg:
    return {"id": mid, "role": role, "parts": list(parts)}


def long_chat(turns: int = 12) -> list[Msg]:
    """Turns of a read and a long reply: pages are cheaper than this narration."""
    messages = [msg("s0", "system", text("You are a careful coding assistant."))]
    for n in range(turns):
        messages += [
            msg(f"u{n}", "user", text(f"Step {n}: please continue.")),
            msg(f"a{n}", "assistant", text("Reading."), call(f"c{n}", "notes.txt")),
            msg(f"t{n}", "tool", result(f"c{n}", FILLER)),
            msg(f"r{n}", "assistant", text(f"Done with step {n}. {FILLER}")),
        ]
    return messages


def view_of(messages: list[Msg], budget: int = 10**9, **kw: Any) -> ContextView:
    return ContextView.build(messages, budget_tokens=budget, model=kw.pop("model", VISION), **kw)


def free_estimate(messages: list[Msg]) -> int:
    stripped, _ = strip_images(elide(view_of(messages))[0])
    return stripped.estimate()


def head_of(view: ContextView) -> int:
    """Where the head the free rungs leave alone ends, at the view's budget."""
    return split_view(view, tail_budget=0).head_end


def tail_of(view: ContextView, turns: int) -> int:
    return view.estimate_messages(view.messages[-4 * turns :]) + 1


class TestSnapshotAttempts:
    def test_it_tries_smaller_tails_and_stops_at_the_first_snapshot_that_fits(self) -> None:
        messages = long_chat()
        view = view_of(messages, budget=int(free_estimate(messages) * 0.6))
        tail = tail_of(view, 4)
        # Each tail is tried with the last turns' results drawn in full, then with every
        # uneventful result of the middle drawn as its elision line.
        elided, _ = elide(view, head_end=head_of(view))
        lean, _ = elide(view, k_turns=0, head_end=head_of(view))
        fitting = [
            snapshot(source, render=DensityRenderer(), tail_budget=t)[0].fits()
            for t in (tail, tail // 2, tail // 4, 0)
            for source in (elided, lean)
        ]
        assert True in fitting and fitting.index(True) > 0  # not the first attempt
        render = DensityRenderer()
        answer = run_ladder(view, render=render, tail_budget=tail)
        assert answer.fits and answer.rungs == ["elision", "snapshot"]
        assert len(render.calls) == fitting.index(True) + 1

    def test_without_a_summarizer_the_smallest_snapshot_is_the_answer(self) -> None:
        messages = long_chat()
        view = view_of(messages, budget=int(free_estimate(messages) * 0.3))
        tail = tail_of(view, 4)
        render = DensityRenderer()
        answer = run_ladder(view, render=render, tail_budget=tail)
        assert not answer.fits and answer.rungs == ["elision", "snapshot"]
        assert len(render.calls) == 8  # every tail tried, both ways; none fits
        elided, _ = elide(view, head_end=head_of(view))
        lean, _ = elide(view, k_turns=0, head_end=head_of(view))
        sizes = [
            snapshot(source, render=DensityRenderer(), tail_budget=t)[0].estimate()
            for t in (tail, tail // 2, tail // 4, 0)
            for source in (elided, lean)
        ]
        assert answer.view.estimate() == min(sizes)

    def test_a_summary_that_applies_is_preferred_to_a_snapshot_that_does_not_fit(self) -> None:
        messages = long_chat()
        view = view_of(messages, budget=int(free_estimate(messages) * 0.3))
        answer = run_ladder(
            view, render=DensityRenderer(), summarize=lambda prompt: "what happened"
        )
        assert answer.rungs == ["elision", "summary"] and answer.fits

    def test_no_renderer_and_no_summarizer_answers_with_the_free_rungs(self) -> None:
        messages = long_chat()
        view = view_of(messages, budget=int(free_estimate(messages) * 0.3))
        answer = run_ladder(view)
        assert not answer.fits and answer.rungs == ["elision"]
        assert answer.view.messages == elide(view, head_end=head_of(view))[0].messages


class TestElisionOfParallelResults:
    def test_every_uneventful_result_of_one_message_is_elided(self) -> None:
        messages = [
            msg("s0", "system", text("Be brief.")),
            msg("u0", "user", text("Read both.")),
            msg("a0", "assistant", call("c1", "one.txt"), call("c2", "two.txt")),
            msg("t0", "tool", result("c1", FILLER), result("c2", FILLER, image(SHA1))),
            msg("r0", "assistant", text("Both read.")),
            *[msg(f"u{n}", "user", text(f"Next {n}.")) for n in range(1, 6)],
        ]
        after, report = elide(view_of(messages), k_turns=1, head_end=2)
        first, second = after.messages[3]["parts"]
        assert first["parts"] == [text(f"[elided tool result t0: {len(FILLER)} chars]")]
        assert second["parts"] == [
            text(f"[elided tool result t0: {len(FILLER)} chars]"),
            image(SHA1),
        ]
        assert [(r.message_id, r.kind) for r in report.replaced] == [("t0", "tool_result")] * 2
        assert messages[3]["parts"][0]["parts"] == [text(FILLER)]  # the original untouched


class TestImageLimits:
    def test_each_image_over_the_byte_limit_is_recompressed_or_replaced_in_order(self) -> None:
        messages = [
            msg("u0", "user", text("Look"), image(SHA1)),
            msg("a0", "assistant", call("c0", "shot.png")),
            msg("t0", "tool", result("c0", "a screenshot", image(SHA2))),
            msg("u1", "user", text("And this"), image(SHA3)),
        ]
        sizes = {SHA1: 6_000_000, SHA2: 7_000_000, SHA3: 100}

        def shrink(part: dict[str, Any], cap: int) -> dict[str, Any] | None:
            if part["blob"] == SHA2:
                return None  # cannot be made small enough
            return {**part, "blob": "d4" * 32, "data": b"x"}

        after, report = fit_images(view_of(messages, blob_sizes=sizes), shrink=shrink)
        assert [(r.message_id, r.replaced_with) for r in report.replaced] == [
            ("u0", f"recompressed {'d4' * 32}"),
            ("t0", f"[image {SHA2} 64x64 not sent: 7000000 bytes, over 5242880; message t0]"),
        ]
        assert after.messages[3]["parts"] == messages[3]["parts"]  # within the limit
        assert after.source == after.messages  # later rungs start from the fitted view

    def test_a_model_without_vision_gets_no_image_and_the_count_limit_is_then_met(self) -> None:
        messages = [msg(f"u{n}", "user", text(f"shot {n}"), image(SHA1)) for n in range(3)]
        view = view_of(messages, model=BLIND, limits=Limits(max_images=1))
        after, report = fit_images(view)
        assert after.fits()
        assert [r.message_id for r in report.replaced] == ["u0", "u1", "u2"]
        assert all("cannot read images" in r.replaced_with for r in report.replaced)

    def test_nothing_to_fit_returns_the_view_itself(self) -> None:
        view = view_of([msg("u0", "user", text("hi"), image(SHA1))])
        after, report = fit_images(view)
        assert after is view and not report.applied
