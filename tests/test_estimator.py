"""The token estimator (compaction/estimate.py): text by script, images by billing rule,
tool calls as JSON, calibration from measured usage and from overflow numbers, and the
non-token limits. Pure: no database."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from compaction import estimate
from compaction.estimate import (
    MESSAGE_OVERHEAD,
    TOOL_CALL_OVERHEAD,
    Calibration,
    Limits,
    calibrate_from_usage,
    check_limits,
    margin_tokens,
    message_tokens,
    part_tokens,
    request_tokens,
    text_tokens,
    usage_pairs,
)
from conversations.providers.billing import BILLING_RULES, image_tokens
from tests.sample_loaders import SAMPLES, load_pi, requires_samples

PROSE = (
    "The quick brown fox jumps over the lazy dog while the committee debates whether "
    "the report should be finished before the end of the week or left for later. "
) * 20
KOREAN = "대화 나무는 긴 대화를 가지로 나누고 되감을 수 있게 해 줍니다" * 20
JSON_TEXT = json.dumps(
    [{"id": i, "path": f"src/mod_{i}.py", "ok": i % 2 == 0, "tags": ["a", "b"]} for i in range(60)]
)
CODE = (
    "def handler(request: dict[str, Any]) -> Response:\n"
    "    if not request.get('id'):\n"
    "        return Response({'error': 'missing id'}, status=400)\n"
    "    return Response({'ok': True, 'items': [x.id for x in items]})\n"
) * 15
SHA = "ab" * 32
# Korean prose written for the tests (tests/data/text): no third-party file needed.
KOREAN_PROSE = Path(__file__).parent / "data" / "text" / "korean.txt"


def per_char(text: str) -> float:
    return text_tokens(text) / len(text)


class TestText:
    def test_it_counts_latin_prose_at_about_four_chars_a_token(self):
        assert text_tokens(PROSE) == pytest.approx(len(PROSE) / 4, rel=0.05)

    def test_it_counts_hangul_at_about_one_char_a_token(self):
        hangul = sum(1 for c in KOREAN if "\uac00" <= c <= "\ud7a3")
        spaces = len(KOREAN) - hangul
        assert text_tokens(KOREAN) == pytest.approx(hangul + spaces / 4, rel=0.05)
        assert per_char(KOREAN) > 3 * per_char(PROSE)

    def test_it_counts_json_and_code_denser_than_prose(self):
        assert text_tokens(JSON_TEXT) == pytest.approx(len(JSON_TEXT) / 3, rel=0.05)
        assert per_char(JSON_TEXT) > per_char(PROSE) * 1.25
        assert per_char(CODE) > per_char(PROSE) * 1.15

    @pytest.mark.parametrize(
        "path",
        [
            pytest.param(KOREAN_PROSE, id="own-korean-text"),
            pytest.param(
                SAMPLES / "text" / "000_f44600f37aa72e34.txt",
                id="design-page",
                marks=requires_samples,
            ),
        ],
    )
    def test_it_reads_real_korean_text_as_dense(self, path):
        text = path.read_text(encoding="utf-8")
        hangul = sum(1 for c in text if "\uac00" <= c <= "\ud7a3")
        assert hangul > 1000
        # Every Hangul syllable is a token; the Latin and punctuation around it add more.
        assert hangul <= text_tokens(text) <= hangul + len(text) / 2

    def test_it_counts_emoji_and_other_scripts(self):
        assert text_tokens("🙂" * 10) == 20
        assert text_tokens("Привет мир, " * 10) > text_tokens("Hello word, " * 10)
        assert text_tokens("") == 0


class TestParts:
    @pytest.mark.parametrize("rule", BILLING_RULES)
    @pytest.mark.parametrize("size", [(200, 100), (1092, 1092), (3000, 2000)])
    def test_it_bills_images_by_the_provider_rule(self, rule, size):
        part = {
            "type": "image",
            "blob": SHA,
            "mime": "image/png",
            "width": size[0],
            "height": size[1],
        }
        assert part_tokens(part, rule=rule) == image_tokens(rule, *size)

    def test_it_bills_an_image_of_unknown_size_as_a_large_one(self):
        part = {"type": "image", "blob": SHA}
        assert part_tokens(part, rule="claude") == image_tokens("claude", 2048, 2048)

    def test_it_counts_tool_calls_as_their_json(self):
        call = {"type": "tool_call", "id": "c1", "name": "read", "arguments": {"path": "a.py"}}
        payload = {"id": "c1", "name": "read", "arguments": {"path": "a.py"}}
        assert part_tokens(call, rule="claude") == TOOL_CALL_OVERHEAD + text_tokens(
            json.dumps(payload, ensure_ascii=False)
        )

    def test_it_counts_tool_results_with_their_images(self):
        image = {"type": "image", "blob": SHA, "width": 800, "height": 600}
        result = {
            "type": "tool_result",
            "call_id": "c1",
            "is_error": False,
            "parts": [{"type": "text", "text": PROSE}, image],
        }
        tokens = part_tokens(result, rule="gemini")
        assert tokens > text_tokens(PROSE) + image_tokens("gemini", 800, 600)

    def test_it_counts_only_signed_thinking(self):
        # Unsigned reasoning is never sent back (see providers/convert.py).
        assert part_tokens({"type": "thinking", "text": PROSE}, rule="claude") == 0
        signed = {"type": "thinking", "text": PROSE, "signature": "sig"}
        assert part_tokens(signed, rule="claude") == text_tokens(PROSE)

    def test_it_adds_overheads_for_messages_and_requests(self):
        message = {"id": "m", "role": "user", "parts": [{"type": "text", "text": PROSE}]}
        assert message_tokens(message, rule="claude") == MESSAGE_OVERHEAD + text_tokens(PROSE)
        bare = request_tokens([message], rule="claude")
        with_system = request_tokens([message], rule="claude", system=PROSE)
        assert with_system - bare == MESSAGE_OVERHEAD + text_tokens(PROSE)
        tool = {"name": "read", "description": "Read a file", "parameters": {"type": "object"}}
        assert request_tokens([message], rule="claude", tools=[tool]) > bare

    def test_it_estimates_objects_like_dicts(self):
        @dataclass
        class Row:
            id: str
            role: str
            parts: list[dict[str, Any]]
            metadata: dict[str, Any] = field(default_factory=dict)

        parts = [{"type": "text", "text": PROSE}]
        row = Row("m", "user", parts)
        assert message_tokens(row, rule="claude") == message_tokens(
            {"id": "m", "role": "user", "parts": parts}, rule="claude"
        )


class TestCalibration:
    def test_a_large_first_request_moves_it_most_of_the_way(self):
        cal = Calibration().observe(40_000, 48_000)
        assert cal.factor == pytest.approx(1.0 + 0.2 * 40_000 / 42_000)
        assert cal.samples == 1

    def test_one_observation_moves_it_a_bounded_step(self):
        # "prompt is too long: 250000 tokens > 200000" on a small conversation.
        once = Calibration().observe(60_000, 250_000)
        assert once.factor == pytest.approx(estimate.MAX_STEP)
        down = Calibration(factor=2.0, samples=0).observe(60_000, 30_000)
        assert down.factor == pytest.approx(2.0 / estimate.MAX_STEP)

    def test_a_small_request_barely_moves_it(self):
        # "Hi!" with three tool definitions: a hundred tokens of mostly fixed overhead.
        assert Calibration().observe(100, 400).factor < 1.15
        assert Calibration(factor=1.3, samples=10).observe(100, 30).factor > 1.29

    def test_it_rises_fast_and_falls_slowly(self):
        cal = Calibration(factor=1.0, samples=5)
        weight = 20_000 / 22_000
        up = cal.observe(20_000, 28_000)
        assert up.factor == pytest.approx(1.0 + 0.4 * 0.5 * weight)  # halfway, by weight
        down = up.observe(20_000, 20_000)
        assert down.factor == pytest.approx(up.factor - (up.factor - 1.0) * 0.2 * weight)

    def test_it_never_drops_below_one_when_the_provider_counted_more(self):
        # An overcounting history pulled the factor low; then the provider counts more.
        cal = Calibration(factor=0.6, samples=10).observe(1000, 1050)
        assert cal.factor >= 1.0

    def test_it_is_bounded(self):
        high, low = Calibration(), Calibration()
        for _ in range(20):
            high, low = high.observe(10**6, 10**8), low.observe(10**6, 100)
        assert 3.9 < high.factor <= estimate.MAX_FACTOR
        assert estimate.MIN_FACTOR <= low.factor < 0.51

    def test_it_ignores_empty_measurements(self):
        cal = Calibration(factor=1.2, samples=3)
        assert cal.observe(0, 100) == cal
        assert cal.observe(100, 0) == cal

    def test_it_learns_from_an_overflow_so_the_payload_is_never_underestimated_again(self):
        raw = 150_000
        cal = Calibration().after_overflow(raw, measured=210_000)
        assert cal.apply(raw) >= 210_000
        # A lower overflow ratio never lowers a factor learned earlier.
        assert cal.after_overflow(raw, measured=160_000).factor == cal.factor
        assert cal.after_overflow(raw, measured=None) == cal

    def test_it_learns_from_measured_usage_along_a_path(self):
        ask = {"id": "u", "role": "user", "parts": [{"type": "text", "text": PROSE}]}
        raw_prompt = request_tokens([ask], rule="claude")
        reply = {
            "id": "a",
            "role": "assistant",
            "parts": [{"type": "text", "text": "ok"}],
            "metadata": {"usage": {"input_tokens": int(raw_prompt * 1.25)}},
        }
        messages = [ask, reply]
        assert usage_pairs(messages, rule="claude") == [(raw_prompt, int(raw_prompt * 1.25))]
        cal = calibrate_from_usage(messages, rule="claude")
        weight = raw_prompt / (raw_prompt + estimate.WEIGHT_TOKENS)
        assert cal.factor == pytest.approx(1.0 + 0.25 * weight, abs=0.01)

    @requires_samples
    def test_it_matches_claude_measured_usage_on_the_real_pi_session(self):
        # Before its first compaction, pi's prompt was every earlier message plus a fixed
        # system prompt and tool schemas (what the first request measured beyond them).
        sample = load_pi()
        path = sample.messages[: sample.compactions[0]]
        pairs = usage_pairs(path, rule="claude")
        assert len(pairs) > 300
        first_raw, first_measured = pairs[0]
        fixed = first_measured - first_raw
        cal = calibrate_from_usage(path, rule="claude", fixed_tokens=fixed)
        assert 0.95 <= cal.factor <= 1.15
        for raw, measured in pairs[10:]:
            assert measured == pytest.approx(raw + fixed, rel=0.12)


def test_it_keeps_a_margin_below_a_limit():
    assert margin_tokens(200_000) == 10_000
    assert margin_tokens(1_000) == estimate.MIN_MARGIN_TOKENS


class TestLimits:
    def image(self, blob: str = SHA, **extra: Any) -> dict[str, Any]:
        return {"type": "image", "blob": blob, "width": 10, "height": 10, **extra}

    def test_it_reports_too_many_images(self):
        messages = [{"id": "m", "role": "user", "parts": [self.image() for _ in range(3)]}]
        [violation] = check_limits(messages, Limits(max_images=2))
        assert (violation.limit, violation.allowed, violation.actual) == ("images", 2, 3)

    def test_it_reports_images_too_large_from_blob_sizes_and_page_bytes(self):
        tool = {
            "type": "tool_result",
            "call_id": "c",
            "is_error": False,
            "parts": [self.image("cd" * 32)],
        }
        messages = [
            {"id": "m1", "role": "user", "parts": [self.image(png=b"x" * 2000)]},
            {"id": "m2", "role": "tool", "parts": [tool]},
        ]
        violations = check_limits(
            messages, Limits(max_image_bytes=1000), blob_sizes={"cd" * 32: 5000}
        )
        assert {(v.limit, v.actual, v.where) for v in violations} == {
            ("image_bytes", 2000, "m1"),
            ("image_bytes", 5000, "m2"),
        }

    def test_it_reports_request_bytes_with_images_as_base64(self):
        messages = [{"id": "m", "role": "user", "parts": [self.image(png=b"x" * 3000)]}]
        [violation] = check_limits(messages, Limits(max_request_bytes=3500))
        assert violation.limit == "request_bytes"
        assert violation.actual >= 4000
        assert check_limits(messages, Limits()) == []


@pytest.mark.django_db
def test_the_calibration_bench_runs_and_learns() -> None:
    """``make bench``'s calibration figure, on a short chat with the loopback provider
    (it once broke when calibration became per deployment, and no test ran it)."""
    from compaction import bench_calibration

    result = bench_calibration.run(turn_count=4)
    assert result["requests"] >= 8  # a tool round and an answer per turn
    assert 0.5 < result["factor"] < 2.0 and result["true_ratio"] > 0
