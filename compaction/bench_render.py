"""Benchmark of the snapshot renderer: speed, tokens saved and legibility (``make bench``).

``run()`` returns a dict and prints nothing. Text comes from the shared sample transcripts
(read in place, never copied into the repository) when they exist, else from a small
built-in English and Korean text so the bench runs anywhere.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from compaction.render import (
    DENSITIES,
    RenderedPage,
    Segment,
    ocr_cer,
    page_profile,
    render_pages,
    tesseract_available,
)

# The shared samples sit next to the repository (../shared/samples); ARBOR_SAMPLES overrides.
_DEFAULT_SAMPLES = Path(__file__).resolve().parents[2] / "shared" / "samples"
SAMPLES = Path(os.environ.get("ARBOR_SAMPLES", _DEFAULT_SAMPLES))
ENGLISH_TRANSCRIPTS = (
    "pi/pi-mono__compact.jsonl",
    "claude-code/claude-code-viewer__fe5e1c67-53e7-4862-81ae-d0e013e3270b.jsonl",
    "claude-code/claude-code-log__dag_compact_after_rewind.jsonl",
)
KOREAN_TEXT = "text/000_f44600f37aa72e34.txt"

# Written for this bench (not sample data): used when the samples are absent.
_FALLBACK_ENGLISH = (
    "Let me check the failing test first.\n"
    "$ pytest -q tests/test_fork.py\n"
    "F.....\n"
    "FAILED tests/test_fork.py::test_it_copies_the_path - AssertionError: 3 != 4\n"
    "The fork copies the path but skips the checkpoint row; I'll fix `conversation_fork`"
    " so it locks the conversation with select_for_update() before copying.\n"
)
_FALLBACK_KOREAN = (
    "긴 대화는 결국 컨텍스트 창의 한계에 부딪힙니다. 오래된 도구 결과는 생략하고, "
    "이미지는 자리표시자로 바꾸고, 중간 부분은 픽셀 페이지로 남깁니다. "
    "요약은 마지막 수단이며 모델 호출 한 번이 필요합니다.\n"
)

# Text tokens the same content would cost (DESIGN.md §5 estimator rates).
_CHARS_PER_TOKEN = {"english": 4.0, "korean": 1.0}


def _strings(value: Any) -> Iterator[str]:
    """Text inside a message's content blocks, skipping image data and signatures."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, dict):
        kind = value.get("type")
        if kind == "image":
            return
        for key in ("text", "thinking", "content"):
            if key in value:
                yield from _strings(value[key])
        for key in ("arguments", "input"):
            if key in value:
                yield json.dumps(value[key], ensure_ascii=False)


def transcript_segments(path: Path) -> list[Segment]:
    """One segment per message record of a pi or Claude Code JSONL transcript."""
    segments: list[Segment] = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines):
            decoder = json.JSONDecoder()
            rest = line.strip()
            # pi's last line holds two records with no newline between them.
            while rest:
                try:
                    record, end = decoder.raw_decode(rest)
                except json.JSONDecodeError:
                    break
                rest = rest[end:].lstrip()
                if not isinstance(record, dict):
                    continue
                message = record.get("message")
                if not isinstance(message, dict):
                    continue
                text = "\n".join(_strings(message.get("content")))
                if not text:
                    continue
                role = str(message.get("role") or record.get("type") or "message")
                ident = str(record.get("uuid") or message.get("id") or f"line{number}")
                segments.append(Segment(role, ident, text))
    return segments


def english_segments() -> list[Segment]:
    segments: list[Segment] = []
    for name in ENGLISH_TRANSCRIPTS:
        if (SAMPLES / name).exists():
            segments.extend(transcript_segments(SAMPLES / name))
    if not segments:
        segments = [Segment("assistant", f"m{i}", _FALLBACK_ENGLISH) for i in range(2000)]
    return segments


def korean_segments() -> list[Segment]:
    path = SAMPLES / KOREAN_TEXT
    text = path.read_text(encoding="utf-8") if path.exists() else _FALLBACK_KOREAN * 40
    # Cut into message-sized pieces so headers cost what they do in a real transcript.
    pieces = [text[i : i + 800] for i in range(0, len(text), 800)]
    return [Segment("user", f"k{i}", piece) for i, piece in enumerate(pieces)]


def _figures(segments: list[Segment], language: str, rule: str, density: str) -> dict[str, Any]:
    result = render_pages(segments, rule=rule, density=density)
    chars = sum(len(s.text) for s in segments)
    image_tokens = sum(page.billed_tokens for page in result.pages)
    text_tokens = chars / _CHARS_PER_TOKEN[language]
    return {
        "pages": len(result.pages),
        "chars": chars,
        "image_tokens": image_tokens,
        "text_tokens": round(text_tokens),
        "saving": round(text_tokens / image_tokens, 2) if image_tokens else None,
        "chars_per_page": round(chars / len(result.pages)) if result.pages else 0,
        "missing_glyphs": result.missing_glyphs,
        "substituted": result.substituted,
        "png_bytes_per_page": (
            round(sum(len(p.png) for p in result.pages) / len(result.pages)) if result.pages else 0
        ),
        "_result": result,
    }


def _speed(segments: list[Segment], rule: str, density: str, repeat: int = 3) -> float:
    """Characters per second on one core, best of ``repeat`` (after a warm-up)."""
    chars = sum(len(s.text) for s in segments)
    render_pages(segments, rule=rule, density=density)  # fill the glyph atlas
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        render_pages(segments, rule=rule, density=density)
        best = min(best, time.perf_counter() - started)
    return chars / best


def _repeat_to(segments: list[Segment], chars: int) -> list[Segment]:
    out: list[Segment] = []
    total = 0
    while total < chars:
        for segment in segments:
            out.append(segment)
            total += len(segment.text)
            if total >= chars:
                break
    return out


def _ocr(pages: list[RenderedPage], count: int, lang: str, height: int) -> dict[str, Any]:
    """CER of ``count`` full pages spread evenly through the text."""
    full = [page for page in pages if page.height == height] or pages
    step = max(1, len(full) // count)
    chosen = full[step // 2 :: step][:count]
    rates = [rate for page in chosen if (rate := ocr_cer(page, lang=lang)) is not None]
    return {
        "pages": len(rates),
        "mean": round(sum(rates) / len(rates), 4) if rates else None,
        "max": round(max(rates), 4) if rates else None,
        "each": [round(rate, 4) for rate in rates],
    }


def run(*, ocr_pages: int = 4, speed_chars: int = 1_000_000) -> dict[str, Any]:
    """Speed, token saving and OCR legibility per rule and density.

    Savings compare billed image tokens with the text estimate (English 4 characters per
    token, Korean 1). ``ocr_pages`` English pages (and up to that many Korean ones) are
    OCR'd per density on the Claude rule, about 10 s each; 0 skips OCR.
    """
    english = english_segments()
    korean = korean_segments()
    report: dict[str, Any] = {
        "samples": str(SAMPLES) if SAMPLES.exists() else "built-in fallback text",
        "english_chars": sum(len(s.text) for s in english),
        "korean_chars": sum(len(s.text) for s in korean),
        "tesseract": tesseract_available("eng"),
        "profiles": {},
    }
    for density in DENSITIES:
        for rule in ("claude", "openai-tile", "openai-patch", "gemini"):
            profile = page_profile(rule, density)
            entry: dict[str, Any] = {
                "page": [profile.width, profile.height],
                "cell": [profile.cell_width, profile.row_height],
                "full_page_tokens": profile.full_page_tokens,
            }
            for language, segments in (("english", english), ("korean", korean)):
                figures = _figures(segments, language, rule, density)
                result = figures.pop("_result")
                lang = "eng" if language == "english" else "kor"
                if rule == "claude" and ocr_pages and tesseract_available(lang):
                    figures["ocr_cer"] = _ocr(result.pages, ocr_pages, lang, profile.height)
                entry[language] = figures
            if rule == "claude":
                entry["chars_per_second"] = {
                    "english": round(_speed(_repeat_to(english, speed_chars), rule, density)),
                    "korean": round(_speed(_repeat_to(korean, speed_chars // 4), rule, density)),
                }
            report["profiles"][f"{rule}/{density}"] = entry
    return report
