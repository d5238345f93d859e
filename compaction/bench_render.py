"""Benchmark of the snapshot renderer: speed, tokens saved and legibility (``make bench``).

``run()`` returns a dict and prints nothing. Text comes from the shared sample transcripts,
the shared DESIGN.md (English prose) and a Korean text (read in place, never copied into
the repository) when they exist, else from a small built-in text so the bench runs
anywhere.

Text tokens are counted with real tokenizers (``compaction.bench_tokens``: o200k,
cl100k and the legacy public Claude tokenizer, offline) next to Arbor's own estimate;
savings are billed image tokens against each. Legibility is reported as the lenient
CER Arbor's audit uses and as plain Levenshtein CER, over every row and over body rows
alone (``render.ocr_page``). #17's goals on the Claude rule are checked per density in
``goals``.
"""

from __future__ import annotations

import io
import json
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from compaction import bench_tokens
from compaction.estimate import count_text_tokens
from compaction.render import (
    DENSITIES,
    RenderedPage,
    Segment,
    ocr_page,
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
# English prose: the project's design document, next to the samples.
ENGLISH_PROSE = SAMPLES.parent / "DESIGN.md"

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

# #17's goals on the Claude rule: image tokens at least this many times fewer than the
# text's tokens (o200k: the fewest tokens for Korean, so the strictest count; the legacy
# Claude tokenizer's is reported beside it), and a plain CER on body rows at most
# PLAIN_BODY_CER_GOAL.
SAVING_GOALS = {"english": 4.0, "prose": 3.0, "korean": 4.0}
PLAIN_BODY_CER_GOAL = 0.03
# And the renderer's speed on one core, on transcripts and on ASCII prose, and against
# the naive per-line Pillow draw (_naive_speed).
SPEED_GOAL = 1_000_000
OVER_NAIVE_GOAL = 15.0
VERDICT_ENCODING = "o200k_base"


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


def _pieces(text: str, prefix: str, role: str) -> list[Segment]:
    # Cut into message-sized pieces so headers cost what they do in a real transcript.
    pieces = [text[i : i + 800] for i in range(0, len(text), 800)]
    return [Segment(role, f"{prefix}{i}", piece) for i, piece in enumerate(pieces)]


def korean_segments() -> list[Segment]:
    path = SAMPLES / KOREAN_TEXT
    text = path.read_text(encoding="utf-8") if path.exists() else _FALLBACK_KOREAN * 40
    return _pieces(text, "k", "user")


def prose_segments() -> list[Segment]:
    path = ENGLISH_PROSE if ENGLISH_PROSE.exists() else Path(__file__).parents[1] / "README.md"
    return _pieces(path.read_text(encoding="utf-8"), "p", "assistant")


def text_tokens(segments: list[Segment]) -> dict[str, int]:
    """The text's tokens per real tokenizer (when installed) and by Arbor's estimate."""
    counted: dict[str, int] = dict(bench_tokens.count(s.text for s in segments) or {})
    counted["arbor_estimate"] = sum(count_text_tokens(s.text) for s in segments)
    return counted


def _figures(
    segments: list[Segment], tokens: dict[str, int], rule: str, density: str
) -> dict[str, Any]:
    result = render_pages(segments, rule=rule, density=density)
    chars = sum(len(s.text) for s in segments)
    image_tokens = sum(page.billed_tokens for page in result.pages)
    return {
        "pages": len(result.pages),
        "chars": chars,
        "image_tokens": image_tokens,
        "text_tokens": tokens,
        "saving": {
            name: round(count / image_tokens, 2) if image_tokens else None
            for name, count in tokens.items()
        },
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


def _naive_speed(segments: list[Segment], rule: str, density: str, repeat: int = 3) -> float:
    """Characters per second of the renderer one would write first, for comparison: the
    text wrapped at the page's columns, each line drawn by ``ImageDraw.text`` in
    Pillow's default font, a page per screenful of rows, each page saved as a PNG."""
    profile = page_profile(rule, density)
    columns = max(1, profile.width // profile.cell_width)
    rows = max(1, profile.height // profile.row_height)
    font = ImageFont.load_default()
    chars = sum(len(s.text) for s in segments)

    def draw() -> None:
        lines = [
            line[i : i + columns] or ""
            for segment in segments
            for line in segment.text.splitlines()
            for i in range(0, max(1, len(line)), columns)
        ]
        for start in range(0, len(lines), rows):
            page = Image.new("L", (profile.width, profile.height), 255)
            pen = ImageDraw.Draw(page)
            for row, line in enumerate(lines[start : start + rows]):
                pen.text((0, row * profile.row_height), line, fill=0, font=font)
            page.save(io.BytesIO(), format="PNG")

    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        draw()
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
    """Both CERs of ``count`` full pages spread evenly through the text: ``lenient``
    (the audit's), ``plain`` and ``plain_body``, and ``plain_body_floor``, the part of
    ``plain_body`` no glyph can remove (see ``render.ocr_page``)."""
    full = [page for page in pages if page.height == height] or pages
    step = max(1, len(full) // count)
    chosen = full[step // 2 :: step][:count]
    readings = [figures for page in chosen if (figures := ocr_page(page, lang=lang))]
    out: dict[str, Any] = {"pages": len(readings)}
    for kind in ("lenient", "plain", "plain_body", "plain_body_floor"):
        rates = [r[kind] for r in readings if kind in r]
        out[kind] = {
            "mean": round(statistics.mean(rates), 4) if rates else None,
            "max": round(max(rates), 4) if rates else None,
            "each": [round(rate, 4) for rate in rates],
        }
    return out


def _goals(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """#17's goals for one Claude profile: each figure, its goal, and whether it is met."""
    goals = []
    for language, goal in SAVING_GOALS.items():
        saving = entry[language]["saving"].get(VERDICT_ENCODING)
        goals.append(
            {
                "figure": f"{language} saving ({VERDICT_ENCODING})",
                "goal": f">= {goal}x",
                "value": saving,
                "met": saving is not None and saving >= goal,
            }
        )
        # The same goal counted by Claude's own (legacy, public) tokenizer, when installed.
        claude = entry[language]["saving"].get(bench_tokens.CLAUDE)
        if claude is not None:
            goals.append(
                {
                    "figure": f"{language} saving ({bench_tokens.CLAUDE})",
                    "goal": f">= {goal}x",
                    "value": claude,
                    "met": claude >= goal,
                }
            )
        speed = entry.get("chars_per_second", {}).get(language)
        if language != "korean" and speed is not None:
            goals.append(
                {
                    "figure": f"{language} render speed (chars/s, one core)",
                    "goal": f">= {SPEED_GOAL:,}",
                    "value": speed,
                    "met": speed >= SPEED_GOAL,
                }
            )
            over = entry["over_naive"][language]
            goals.append(
                {
                    "figure": f"{language} render speed over a naive per-line Pillow draw",
                    "goal": f">= {OVER_NAIVE_GOAL}x",
                    "value": over,
                    "met": over >= OVER_NAIVE_GOAL,
                }
            )
        ocr = entry[language].get("ocr_cer") or {}
        body = ocr.get("plain_body", {}).get("mean")
        floor = ocr.get("plain_body_floor", {}).get("mean")
        goals.append(
            {
                "figure": f"{language} plain CER, body rows (mean)",
                "goal": f"<= {PLAIN_BODY_CER_GOAL:.0%}",
                "value": body,
                "met": body is not None and body <= PLAIN_BODY_CER_GOAL,
                # The reader's own limit: characters tesseract cannot output at all.
                "floor": floor,
            }
        )
    return goals


def run(*, ocr_pages: int = 4, speed_chars: int = 1_000_000) -> dict[str, Any]:
    """Speed, token saving and OCR legibility per rule and density.

    Savings compare billed image tokens with the text's tokens (see the module
    docstring). ``ocr_pages`` pages of each text are OCR'd per density on the Claude
    rule, about 10 s each; 0 skips OCR.
    """
    wall, cpu = time.perf_counter(), time.process_time()
    english = english_segments()
    korean = korean_segments()
    prose = prose_segments()
    texts = {"english": english, "prose": prose, "korean": korean}
    tokens = {language: text_tokens(segments) for language, segments in texts.items()}
    report: dict[str, Any] = {
        "samples": str(SAMPLES) if SAMPLES.exists() else "built-in fallback text",
        "english_chars": sum(len(s.text) for s in english),
        "prose_chars": sum(len(s.text) for s in prose),
        "korean_chars": sum(len(s.text) for s in korean),
        "tokenizers": bench_tokens.names() or None,
        "tesseract": tesseract_available("eng"),
        "profiles": {},
        "goals": {},
    }
    for density in DENSITIES:
        for rule in ("claude", "openai-tile", "openai-patch", "gemini"):
            profile = page_profile(rule, density)
            entry: dict[str, Any] = {
                "page": [profile.width, profile.height],
                "cell": [profile.cell_width, profile.row_height],
                "full_page_tokens": profile.full_page_tokens,
            }
            for language, segments in texts.items():
                figures = _figures(segments, tokens[language], rule, density)
                result = figures.pop("_result")
                lang = "kor" if language == "korean" else "eng"
                if rule == "claude" and ocr_pages and tesseract_available(lang):
                    figures["ocr_cer"] = _ocr(result.pages, ocr_pages, lang, profile.height)
                entry[language] = figures
            if rule == "claude":
                timed = {
                    "english": _repeat_to(english, speed_chars),
                    "prose": _repeat_to(prose, speed_chars),
                    "korean": _repeat_to(korean, speed_chars // 4),
                }
                entry["chars_per_second"] = {
                    language: round(_speed(segments, rule, density))
                    for language, segments in timed.items()
                }
                # The naive draw is ~10x slower: timed on a fifth of the text, once more.
                naive = {
                    language: _naive_speed(
                        _repeat_to(texts[language], speed_chars // 5), rule, density, repeat=2
                    )
                    for language in ("english", "prose")
                }
                entry["naive_chars_per_second"] = {k: round(v) for k, v in naive.items()}
                entry["over_naive"] = {
                    k: round(entry["chars_per_second"][k] / v, 1) for k, v in naive.items()
                }
            report["profiles"][f"{rule}/{density}"] = entry
            if rule == "claude":
                report["goals"][density] = _goals(entry)
    report["wall_seconds"] = round(time.perf_counter() - wall, 1)
    report["cpu_seconds"] = round(time.process_time() - cpu, 1)
    return report
