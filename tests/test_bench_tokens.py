"""The compaction bench's honest measures (#17 item 2): real tokenizers, offline, and a
plain CER beside the lenient one."""

from __future__ import annotations

import os
from typing import Any

import pytest

from compaction import bench_render, bench_tokens
from compaction.render import Segment, plain_cer
from compaction.render.atlas import INVERT
from compaction.render.ocr import _levenshtein


def inverted(text: str) -> str:
    """``text`` as drawn white on black (a message header)."""
    return "".join(chr(INVERT + ord(c)) for c in text)


def test_real_tokenizers_count_offline() -> None:
    counted = bench_tokens.count(["hello world", "안녕하세요"])
    assert counted is not None, "bpe-openai is a dev dependency"
    o200k = bench_tokens._encoding("o200k_base")
    assert counted["o200k_base"] == len(o200k.encode_ordinary("hello world")) + len(
        o200k.encode_ordinary("안녕하세요")
    )
    hello = bench_tokens.count(["hello world"])
    assert hello is not None and hello["o200k_base"] == 2 and hello["cl100k_base"] == 2
    # Text that looks like a special token is counted as text, not refused.
    assert bench_tokens.count(["<|endoftext|>"])["o200k_base"] > 1  # type: ignore[index]


def require_claude() -> None:
    if bench_tokens._claude() is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{bench_tokens.CLAUDE_TABLE} is missing: `make harness` installs it")
        pytest.skip("the legacy Claude tokenizer is not installed (run `make harness`)")


def test_the_legacy_claude_tokenizer_counts_as_its_package_does() -> None:
    require_claude()
    # The package's own test cases: a count, and text counted in its NFKC form.
    assert bench_tokens.claude_count("hello world!") == 3
    assert bench_tokens.claude_count("™") == 1 and bench_tokens.claude_count("ϰ") == 1
    counted = bench_tokens.count(["hello world!", "안녕하세요"])
    assert counted is not None
    assert counted["claude_legacy"] == 3 + bench_tokens.claude_count("안녕하세요")
    assert bench_tokens.names() == ["o200k_base", "cl100k_base", "claude_legacy"]


def test_the_bench_reports_each_count_and_the_estimate() -> None:
    tokens = bench_render.text_tokens([Segment("user", "a", "The quick brown fox.")])
    assert set(tokens) >= {"o200k_base", "cl100k_base", "arbor_estimate"}
    assert tokens["o200k_base"] == 5
    require_claude()
    assert "claude_legacy" in tokens
    # Each counted saving is judged against the goal; o200k's is the verdict.
    entry: dict[str, Any] = {
        language: {"saving": {"o200k_base": 3.5, "claude_legacy": 4.5}, "ocr_cer": {}}
        for language in ("english", "prose", "korean")
    }
    korean = [g for g in bench_render._goals(entry) if g["figure"].startswith("korean saving")]
    assert [(g["figure"], g["met"]) for g in korean] == [
        ("korean saving (o200k_base)", False),
        ("korean saving (claude_legacy)", True),
    ]


def test_levenshtein() -> None:
    assert _levenshtein("kitten", "sitting") == 3
    assert _levenshtein("", "abc") == 3 and _levenshtein("same", "same") == 0


def test_plain_cer_counts_every_character_and_separates_body_rows() -> None:
    drawn = [inverted(" user abc123 "), "hello world", "x = 1\n"]
    # The header read badly, one body letter wrong, the ↵ mark read as nothing.
    reading = "user abcl23\nhello wor1d\nx = 1\n"
    figures = plain_cer(drawn, reading)
    body = ["hello world", "x = 1↵"]
    header = "user abc123"
    assert figures["plain_body"] == (1 + 1) / sum(map(len, body))
    assert figures["plain"] == (1 + 1 + 1) / (sum(map(len, body)) + len(header))
    # The ↵ is the one body character tesseract's English model cannot output.
    assert figures["plain_body_floor"] == 1 / sum(map(len, body))


def test_the_floor_counts_what_the_reader_cannot_output() -> None:
    drawn = ["run `make test`\t→ done", "한국어\n"]
    reading = "run 'make test' -» done\n한국머\n"
    english = plain_cer(drawn, reading)
    # Two backticks, the ▸ and the arrow on the first row; the ↵ and 한국어 on the second.
    assert english["plain_body_floor"] == (4 + 4) / (len("run `make test`▸→ done") + 4)
    # For Korean only the marks count (a lower bound: no alphabet is listed for its model).
    korean = plain_cer(drawn, reading, lang="kor")
    assert korean["plain_body_floor"] == 2 / (len("run `make test`▸→ done") + 4)


def test_plain_cer_without_matching_lines_compares_the_page_whole() -> None:
    figures = plain_cer(["one line", "two line"], "one line two line")
    assert set(figures) == {"plain"}
    assert 0 < figures["plain"] < 0.2


def test_the_bench_times_a_naive_pillow_draw_and_states_the_speed_goals() -> None:
    segments = [Segment("user", "a", "A line of ordinary text, long enough to wrap. " * 200)]
    assert bench_render._naive_speed(segments, "claude", "default", repeat=1) > 0
    entry: dict[str, Any] = {
        language: {"saving": {"o200k_base": 5.0}, "ocr_cer": {}}
        for language in ("english", "prose", "korean")
    }
    entry["chars_per_second"] = {"english": 1_500_000, "prose": 900_000, "korean": 300_000}
    entry["over_naive"] = {"english": 16.0, "prose": 9.0}
    speed = {g["figure"]: g["met"] for g in bench_render._goals(entry) if "speed" in g["figure"]}
    assert speed == {
        "english render speed (chars/s, one core)": True,
        "english render speed over a naive per-line Pillow draw": True,
        "prose render speed (chars/s, one core)": False,
        "prose render speed over a naive per-line Pillow draw": False,
    }


@pytest.mark.slow  # OCR (tesseract)
def test_the_tesseract_control_reads_plain_numbers_in_a_large_clean_font() -> None:
    from compaction import bench_ladder
    from compaction.render import tesseract_available

    if not tesseract_available("eng"):
        pytest.skip("tesseract is not installed (.ci/run installs it)")
    assert bench_ladder.CONTROL_FONT.is_file(), ".ci/run installs fonts-dejavu-core"
    numbers = {str(1000 + 37 * i) for i in range(30)}
    control = bench_ladder._control({"numbers": numbers, "hex": set()})
    assert control is not None
    assert control["numbers"] == {"tokens": 30, "exact_pct": 100.0}
    assert "hex" not in control  # nothing of a kind: nothing to read
