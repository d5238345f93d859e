"""The snapshot renderer (compaction/render): archived text drawn as packed bitmap pages.

OCR checks need the ``tesseract`` CLI (apt-get install tesseract-ocr). Locally they skip
with a message when it is missing; with CI=true a missing tesseract fails the run.
"""

from __future__ import annotations

import hashlib
import inspect
import io
import os
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
from PIL import Image

from compaction.bench_render import transcript_segments
from compaction.render import (
    DENSITIES,
    LEGEND,
    REQUEST_LIMITS,
    Renderer,
    Segment,
    cache_key,
    cer,
    fits_unscaled,
    ocr_cer,
    page_profile,
    readable,
    render_pages,
    tesseract_available,
)
from compaction.render.atlas import INVERT, font_stack, legacy_code, load_font
from compaction.render.engine import WRAP_CELLS
from compaction.render.ocr import ocr_image
from compaction.render.profiles import FONT_DIR
from compaction.render.redrawn import REDRAWN, round_loops
from conversations.providers.billing import BILLING_RULES, image_tokens
from tests.sample_loaders import requires_samples, samples_dir

ROOT = Path(__file__).resolve().parent.parent

# Written for these tests: an agent transcript in the shape of the real ones (prose,
# shell commands, tool output, code), so the OCR bound does not depend on sample files.
AGENT_TRANSCRIPT = [
    Segment(
        "user",
        "u1",
        "The fork endpoint returns 500 when the source conversation has a checkpoint.\n"
        "Can you find out why and fix it? Keep the change small.",
    ),
    Segment(
        "assistant",
        "a1",
        "I'll start by reproducing the failure with the existing tests, then read the\n"
        "service that copies the path.\n"
        '{"command": "cd /home/dev/arbor && pytest -q tests/test_fork.py -x"}',
    ),
    Segment(
        "tool",
        "t1",
        "F.....\n"
        "FAILED tests/test_fork.py::test_it_copies_checkpoints - IntegrityError: NOT NULL\n"
        "constraint failed: conversations_checkpoint.message_id\n"
        "1 failed, 5 passed in 2.31s",
    ),
    Segment(
        "assistant",
        "a2",
        "The copy creates checkpoints before the messages they point at exist. Reading\n"
        "conversations/services.py around line 214:\n"
        '{"path": "conversations/services.py", "offset": 200, "limit": 30}',
    ),
    Segment(
        "tool",
        "t2",
        "200  def conversation_fork(*, conversation_id: int, message_id: int) -> Conversation:\n"
        '201      """Copy the path ending at message_id into a new conversation."""\n'
        "202      with transaction.atomic():\n"
        "203          source = Conversation.objects.select_for_update().get(id=conversation_id)\n"
        "204          path = selectors.path_to(message_id)\n"
        "205          fork = Conversation.objects.create(owner=source.owner, title=source.title)\n"
        "206          for checkpoint in source.checkpoints.all():\n"
        "207              Checkpoint.objects.create(conversation=fork, message_id=None)\n"
        "208          copies = {}\n"
        "209          for message in path:\n"
        "210              copies[message.id] = _copy_message(message, fork, copies)\n"
        "211      return fork",
    ),
    Segment(
        "assistant",
        "a3",
        "Found it: checkpoints are copied in the loop on line 206, before any message is\n"
        "copied, so message_id is None. Moving the loop after the messages and mapping\n"
        "each checkpoint through copies fixes it. Checkpoints on messages outside the\n"
        "path are skipped, since the fork cannot point at them.",
    ),
    Segment(
        "tool",
        "t3",
        "diff --git a/conversations/services.py b/conversations/services.py\n"
        "@@ -203,9 +203,11 @@ def conversation_fork(*, conversation_id, message_id):\n"
        "-        for checkpoint in source.checkpoints.all():\n"
        "-            Checkpoint.objects.create(conversation=fork, message_id=None)\n"
        "         copies = {}\n"
        "         for message in path:\n"
        "             copies[message.id] = _copy_message(message, fork, copies)\n"
        "+        for checkpoint in source.checkpoints.filter(message_id__in=copies):\n"
        "+            new_id = copies[checkpoint.message_id].id\n"
        "+            Checkpoint.objects.create(conversation=fork, message_id=new_id)\n"
        "6 passed in 2.05s",
    ),
    Segment(
        "assistant",
        "a4",
        "All six fork tests pass now. The fix copies the messages first and then the\n"
        "checkpoints that belong to the copied path; nothing else changed.",
    ),
]

KOREAN = (
    "긴 대화는 결국 컨텍스트 창의 한계에 부딪힙니다. 오래된 도구 결과는 생략하고,\n"
    "이미지는 자리표시자로 바꾸고, 중간 부분은 픽셀 페이지로 남깁니다.\n"
    "요약은 마지막 수단이며 모델 호출 한 번이 필요합니다. 똠방각하 쀍 햏 (드문 음절)\n"
)
MIXED = (
    "naïve café — “quotes” ‘single’ … π≈3.14, ½ × 2 = 1, Ω, Ж, שלום, مرحبا\n"
    "中文字符 日本語のテキスト カタカナ ひらがな 한국어\n"
    "emoji 😀 👍🏽 ❤️, zero\u200bwidth, soft\u00adhyphen, bell \x07, escape \x1b[31mred\x1b[0m, "
    "CRLF\r\n, private \ue000, NFD " + unicodedata.normalize("NFD", "한글") + ", tab\tend\n"
    "combining e\u0301 and lone surrogate \ud800 and noncharacter \uffff"
)

# Korean prose written for the tests (tests/data/text), drawn with or without the samples.
OWN_KOREAN = "text/korean.txt"
SAMPLE_FILES = [
    "text/000_f44600f37aa72e34.txt",
    "pi/pi-mono__compact.jsonl",
    "claude-code/claude-code-viewer__fe5e1c67-53e7-4862-81ae-d0e013e3270b.jsonl",
    "claude-code/claude-code-log__dag_compact_after_rewind.jsonl",
]


def _require_tesseract(lang: str = "eng") -> None:
    if tesseract_available(lang):
        return
    message = f"tesseract with the {lang!r} model is not installed (apt-get install tesseract-ocr)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must install tesseract: {message}")
    pytest.skip(f"OCR check skipped: {message}")


def _sample_segments(name: str) -> list[Segment]:
    # The third-party samples: skipped without them (failed under CI=true).
    path = ROOT / "tests" / "data" / name if name == OWN_KOREAN else samples_dir() / name
    if path.suffix == ".jsonl":
        return transcript_segments(path)
    return [Segment("user", "doc", path.read_text(encoding="utf-8"))]


def _long_english(chars: int = 60_000) -> list[Segment]:
    segments: list[Segment] = []
    while sum(len(s.text) for s in segments) < chars:
        n = len(segments)
        segments += [Segment(s.role, f"{s.message_id}-{n}", s.text) for s in AGENT_TRANSCRIPT]
    return segments


# -- determinism and re-rendering ----------------------------------------------------------


def test_it_renders_identical_bytes_for_identical_text() -> None:
    first = render_pages(AGENT_TRANSCRIPT)
    second = render_pages(list(AGENT_TRANSCRIPT))
    fresh_a = Renderer("claude", "default").render(AGENT_TRANSCRIPT)
    fresh_b = Renderer("claude", "default").render(AGENT_TRANSCRIPT)
    pngs = [[page.png for page in result.pages] for result in (first, second, fresh_a, fresh_b)]
    assert pngs[0] and all(p == pngs[0] for p in pngs)


def test_it_renders_identical_bytes_in_a_fresh_process() -> None:
    # The test module imports the sample loaders, which import Django models.
    script = (
        "import hashlib, os, django\n"
        "os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'arbor.settings')\n"
        "os.environ.setdefault('SECRET_KEY', 'test-only-secret-key-not-for-production')\n"
        "django.setup()\n"
        "from tests.test_snapshot_render import AGENT_TRANSCRIPT\n"
        "from compaction.render import render_pages\n"
        "pages = render_pages(AGENT_TRANSCRIPT).pages\n"
        "print(hashlib.sha256(b''.join(p.png for p in pages)).hexdigest())\n"
    )
    # A new interpreter has a new string hash seed and empty glyph caches.
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    here = hashlib.sha256(b"".join(p.png for p in render_pages(AGENT_TRANSCRIPT).pages))
    assert done.stdout.strip() == here.hexdigest()


def test_it_takes_only_text_so_it_never_reads_old_pixels() -> None:
    parameters = inspect.signature(render_pages).parameters
    assert list(parameters) == ["segments", "rule", "density", "max_pages"]
    assert {field for field in Segment.__dataclass_fields__} == {"role", "message_id", "text"}


def test_it_draws_different_pages_after_a_settings_change() -> None:
    default = render_pages(AGENT_TRANSCRIPT, density="default")
    dense = render_pages(AGENT_TRANSCRIPT, density="dense")
    gemini = render_pages(AGENT_TRANSCRIPT, rule="gemini")
    assert default.settings != dense.settings != gemini.settings
    assert default.pages[0].png != dense.pages[0].png
    assert default.pages[0].png != gemini.pages[0].png
    # The same text reaches the page whatever the settings.
    assert default.pages[0].text == dense.pages[0].text == gemini.pages[0].text


def test_it_keys_the_cache_on_text_and_settings() -> None:
    key = cache_key(AGENT_TRANSCRIPT, rule="claude", density="default")
    assert key == cache_key(list(AGENT_TRANSCRIPT), rule="claude", density="default")
    assert key != cache_key(AGENT_TRANSCRIPT, rule="claude", density="dense")
    assert key != cache_key(AGENT_TRANSCRIPT, rule="gemini", density="default")
    edited = [*AGENT_TRANSCRIPT[:-1], Segment("assistant", "a4", "All six fork tests pass.")]
    assert key != cache_key(edited, rule="claude", density="default")
    # Field boundaries count: moving a character between role and text changes the key.
    assert cache_key([Segment("ab", "1", "c")], rule="claude", density="default") != cache_key(
        [Segment("a", "1", "bc")], rule="claude", density="default"
    )


# -- glyph coverage ---------------------------------------------------------------------------


@pytest.mark.parametrize("density", list(DENSITIES))
def test_it_draws_korean_and_mixed_text_without_missing_glyphs(density: str) -> None:
    result = render_pages(
        [Segment("user", "k1", KOREAN), Segment("assistant", "m1", MIXED)], density=density
    )
    assert result.missing_glyphs == 0
    drawn = "".join(readable(row) for page in result.pages for row in page.drawn)
    for word in (
        "컨텍스트",
        "똠방각하",
        "쀍",
        "한국어",
        "中文字符",
        "日本語",
        "שלום",
        "naïve",
        "한글",
    ):
        assert word in drawn
    # Escaped, each counted once: 😀 👍 🏽 (two code points) U+FE0F ZWSP soft hyphen BEL
    # CR, private use, surrogate, noncharacter.
    for label in ("U+1F600", "U+1F44D", "U+1F3FD", "U+FE0F", "U+200B", "U+00AD", "^G", "^M"):
        assert label in drawn
    assert result.substituted == 11
    # ESC (terminal colour codes) is a one-cell mark, not a label.
    assert "␛[31mred␛[0m" in drawn and "^[" not in drawn


@pytest.mark.parametrize("density", list(DENSITIES))
def test_it_draws_every_hangul_syllable(density: str) -> None:
    syllables = "".join(chr(cp) for cp in range(0xAC00, 0xD7A4))
    result = render_pages([Segment("user", "h", syllables)], density=density)
    assert result.missing_glyphs == 0 and result.substituted == 0
    assert sum(page.chars for page in result.pages) == len(syllables)


def test_dense_hangul_is_two_cells_wide_and_keeps_the_row_short() -> None:
    """Gulim 10 px at density "dense": KS X 1001 syllables in two Latin cells, rows no
    taller than its 10 px; a syllable outside KS X 1001 falls back to a larger font."""
    assert legacy_code(ord("가"), "euc_kr") == 0x3021
    assert legacy_code(ord("똠"), "euc_kr") is None  # not in KS X 1001
    assert legacy_code(ord("A"), "euc_kr") is None
    stack = font_stack(DENSITIES["dense"])
    found = stack.find(ord("한"))
    assert found is not None and found[0].advance == 2 * stack.cell_width
    rare = stack.find(ord("똠"))
    assert rare is not None and rare[0].advance > 2 * stack.cell_width
    (page,) = render_pages([Segment("user", "k", KOREAN[:80] * 3)], density="dense").pages
    assert max(height for _, height in page.row_boxes) == 10
    (page,) = render_pages([Segment("user", "k", KOREAN[:80] * 3)], density="default").pages
    assert max(height for _, height in page.row_boxes) == 12


def _jamo(syllable: str) -> tuple[int, int, int]:
    """(initial, medial, final) indices of a precomposed Hangul syllable."""
    index = ord(syllable) - 0xAC00
    return index // 588, index % 588 // 28, index % 28


IEUNG, HIEUH = (11, 21), (18, 27)  # (as initial, as final): ㅇ, and ㅎ with its circle


@pytest.mark.parametrize(("file", "codec"), [("f12.pcf.gz", None), ("gulim10.pcf.gz", "euc_kr")])
def test_only_the_circles_of_hangul_are_redrawn(file: str, codec: str | None) -> None:
    font = load_font(file)
    changed = []
    for codepoint in range(0xAC00, 0xD7A4):
        code = legacy_code(codepoint, codec) if codec else codepoint
        glyph = font.glyph(code) if code is not None else None
        if glyph is None:
            continue
        rounded = round_loops(glyph)
        if rounded.rows == glyph.rows:
            continue
        changed.append(chr(codepoint))
        assert len(rounded.rows) == len(glyph.rows) and rounded.advance == glyph.advance
        initial, _, final = _jamo(chr(codepoint))
        assert initial in (IEUNG[0], HIEUH[0]) or final in (IEUNG[1], HIEUH[1]), chr(codepoint)
    # 12 px: every ㅇ beside a vertical vowel is tall enough to round; 10 px: only some.
    assert len(changed) >= (100 if codec is None else 15)
    for square in "미메마머":  # ㅁ keeps its shape
        code = legacy_code(ord(square), codec) if codec else ord(square)
        glyph = font.glyph(code)  # type: ignore[arg-type]
        assert glyph is not None and round_loops(glyph) is glyph


def test_round_loops_cuts_each_corner_one_pixel_deeper() -> None:
    glyph = load_font("f12.pcf.gz").glyph(ord("이"))
    assert glyph is not None
    picture = [f"{row:012b}"[:8].replace("0", ".").replace("1", "#") for row in glyph.rows[:9]]
    assert picture == ["..####..", *[".#....#."] * 7, "..####.."]  # a rectangle less 4 pixels
    rows = [f"{row:012b}"[:8] for row in round_loops(glyph).rows[:9]]
    rounded = [row.replace("0", ".").replace("1", "#") for row in rows]
    assert rounded == [
        "...##...",
        "..#..#..",
        *[".#....#."] * 5,
        "..#..#..",
        "...##...",
    ]


# No syllable here starts with ㅁ; before ㅇ was rounded, tesseract read 이 에 아 어 여 as
# 미 메 마 머 며 (12 of these 20 words wrong).
IEUNG_WORDS = (
    "이것은 아이에게 어울리는 이야기이다 오늘 우리는 이웃에게 인사를 했다 영어와 한국어 "
    "여행 은행 연필 오이 우유 아버지 이름 얼음 요약"
)


@pytest.mark.slow  # OCR (tesseract)
@pytest.mark.parametrize("density", list(DENSITIES))
def test_korean_circles_read_back_as_circles(density: str) -> None:
    _require_tesseract("kor")
    text = "\n".join([IEUNG_WORDS] * 3)
    (page,) = render_pages([Segment("user", "k", text)], density=density).pages
    reading = ocr_image(page.png, lang="kor", row_boxes=page.row_boxes) or ""
    hangul = [char for char in reading if 0xAC00 <= ord(char) <= 0xD7A3]
    assert len(hangul) > 100, reading
    # Gulim 10's ㅇ beside ㅔ is four pixels wide and still reads as ㅁ now and then.
    read_as_mieum = [char for char in hangul if _jamo(char)[0] == 6]
    assert len(read_as_mieum) <= {"default": 2, "dense": 6}[density], reading
    words = IEUNG_WORDS.split()
    exact = sum(reading.split().count(word) for word in words)
    assert exact >= 0.6 * 3 * len(words), reading


@pytest.mark.parametrize(
    "name", [OWN_KOREAN, *(pytest.param(n, marks=requires_samples) for n in SAMPLE_FILES)]
)
def test_it_draws_the_sample_files_without_missing_glyphs(name: str) -> None:
    segments = _sample_segments(name)
    for density in DENSITIES:
        result = render_pages(segments, density=density)
        assert result.missing_glyphs == 0
        assert sum(page.chars for page in result.pages) == sum(
            len(unicodedata.normalize("NFC", s.text)) for s in segments
        )
    if name.startswith("text/"):
        assert result.substituted == 0


# -- pages and billing -------------------------------------------------------------------------


@pytest.mark.parametrize("density", list(DENSITIES))
@pytest.mark.parametrize("rule", BILLING_RULES)
def test_it_sizes_pages_so_the_provider_never_resamples(rule: str, density: str) -> None:
    segments = [*_long_english(), Segment("user", "k", KOREAN * 20)]
    result = render_pages(segments, rule=rule, density=density)
    profile = page_profile(rule, density)
    limits = REQUEST_LIMITS[rule]
    assert len(result.pages) >= 2
    for page in result.pages:
        assert fits_unscaled(rule, page.width, page.height)
        assert page.billed_tokens == image_tokens(rule, page.width, page.height)
        assert page.width == profile.width and page.height <= profile.height
        assert page.height % profile.height_step == 0
        assert len(page.png) <= limits.max_image_bytes
        assert max(page.width, page.height) <= limits.edge_limit(len(result.pages))
        with Image.open(io.BytesIO(page.png)) as image:
            assert image.format == "PNG" and image.mode == "1"
            assert image.size == (page.width, page.height)
        for top, height in page.row_boxes:
            assert top + height <= page.height
            if profile.band:  # no row straddles a provider tile edge
                assert top // profile.band == (top + height - 1) // profile.band
    # Full pages cost what the profile says.
    assert result.pages[0].billed_tokens == profile.full_page_tokens


def test_it_exposes_request_limits_as_data() -> None:
    claude = REQUEST_LIMITS["claude"]
    assert claude.max_image_bytes == 5 * 1024 * 1024
    assert claude.max_request_bytes == 32 * 1024 * 1024
    assert claude.max_images == 100
    assert claude.edge_limit(20) == 8000
    assert claude.edge_limit(21) == 2000
    assert set(REQUEST_LIMITS) == set(BILLING_RULES)


def test_it_chooses_billing_optimal_full_pages() -> None:
    claude = page_profile("claude")
    assert (claude.width, claude.height) == (952, 1204)  # 34 x 43 patches, 1.146 MP
    assert claude.full_page_tokens == 1462
    assert not fits_unscaled("claude", 1092, 1092)  # 1.19 MP: Claude would scale it
    assert page_profile("openai-tile").full_page_tokens == 765
    assert page_profile("openai-patch").full_page_tokens == 1536
    assert page_profile("gemini").full_page_tokens == 516


def test_it_stops_at_max_pages() -> None:
    segments = _long_english(120_000)
    full = render_pages(segments)
    capped = render_pages(segments, max_pages=2)
    assert len(full.pages) > 2 and not full.truncated
    assert len(capped.pages) == 2 and capped.truncated
    assert [p.png for p in capped.pages] == [p.png for p in full.pages[:2]]
    with pytest.raises(ValueError):
        render_pages(segments, max_pages=0)


def test_it_rejects_unknown_rules_and_densities() -> None:
    with pytest.raises(ValueError, match="billing rule"):
        render_pages(AGENT_TRANSCRIPT, rule="dall-e")
    with pytest.raises(ValueError, match="density"):
        render_pages(AGENT_TRANSCRIPT, density="huge")


# -- layout: marks, headers, text per page ---------------------------------------------------


def test_it_marks_newlines_and_tabs_instead_of_breaking_rows() -> None:
    text = "line one\nline two\n\tindented\nlast"
    result = render_pages([Segment("user", "u1", text)])
    (page,) = result.pages
    assert len(page.drawn) == 1  # four lines of source text share one row
    row = page.drawn[0]
    assert row.count("\n") == 3 and row.count("\t") == 1
    assert readable(row).endswith("line one↵line two↵▸indented↵last")
    assert "↵" in LEGEND and "▸" in LEGEND


def test_it_starts_each_message_with_an_inverted_role_and_id_header() -> None:
    segments = [
        Segment("user", "3f2a1b2c-9d8e-4f00-a1b2-c3d4e5f60718", "hello"),
        Segment("assistant", "msg_02", "hi there"),
    ]
    (page,) = render_pages(segments).pages
    row = page.drawn[0]
    inverted = "".join(chr(ord(c) - INVERT) if ord(c) >= INVERT else "|" for c in row)
    # The header's id is the recall id: the last 12 characters (imported ids share
    # their first ones within a conversation).
    assert " user c3d4e5f60718 " in inverted and " assistant msg_02 " in inverted
    assert readable(row) == " user c3d4e5f60718 hello assistant msg_02 hi there"
    assert page.first_message_id == segments[0].message_id
    assert page.last_message_id == "msg_02"
    assert page.text == (
        "── user 3f2a1b2c-9d8e-4f00-a1b2-c3d4e5f60718 ──\nhello\n── assistant msg_02 ──\nhi there"
    )
    assert page.chars == len("hello") + len("hi there")


def test_it_splits_long_text_across_pages_without_losing_a_character() -> None:
    segments = _long_english(150_000)
    result = render_pages(segments)
    profile = page_profile("claude")
    assert len(result.pages) >= 3
    assert sum(page.chars for page in result.pages) == sum(len(s.text) for s in segments)
    for page in result.pages:
        for row in page.drawn:
            assert len(row) * profile.cell_width <= profile.width  # all-Latin rows
    # A message cut by a page break continues on the next page.
    assert result.pages[1].first_message_id == result.pages[0].last_message_id or (
        result.pages[1].text.startswith("── ")
    )


def test_it_wraps_rows_at_spaces_near_the_edge() -> None:
    words = " ".join(f"word{i:04d}" for i in range(400))
    (page,) = render_pages([Segment("user", "u", words)]).pages
    for row in page.drawn[:-1]:
        assert readable(row).endswith(" ")  # no word is cut in two


# -- legibility ------------------------------------------------------------------------------


def test_it_scores_ocr_text_by_character_error_rate() -> None:
    assert cer("hello world", "hello world") == 0.0
    assert cer("hello world", "helloworld") == 0.0  # whitespace is ignored
    assert cer("abcd", "abxd") == pytest.approx(0.25)
    # Characters tesseract cannot output (marks, backtick) match one character or none.
    assert cer("a↵b `c`", "a4b 'c'") == 0.0
    assert cer("a↵b", "ab") == 0.0
    # Long runs of one character count as three.
    assert cer("x" + "=" * 40 + "y", "x==y") == pytest.approx(1 / 5)


@pytest.mark.slow  # OCR (tesseract)
def test_it_reads_back_english_pages_with_tesseract() -> None:
    _require_tesseract("eng")
    result = render_pages(_long_english(12_000))
    rates = [ocr_cer(page) for page in result.pages]
    assert all(rate is not None for rate in rates)
    assert max(r for r in rates if r is not None) <= 0.03


@pytest.mark.slow  # OCR (tesseract)
def test_real_agent_transcript_pages_read_back_within_three_percent() -> None:
    """The bound on real text: the first, middle and last pages of a Claude Code sample
    (paths full of ``@0.5.15``, ``swc+helpers``, and narration) read within 3% on
    average, none past 3.5% (tesseract 5.3: 2.1%, 2.5% and 3.2%; over nine pages of it
    1.4-3.7%, mean 2.5%, the same at 5x10 and at 5x11 cells)."""
    _require_tesseract("eng")
    segments = _sample_segments(
        "claude-code/claude-code-viewer__fe5e1c67-53e7-4862-81ae-d0e013e3270b.jsonl"
    )
    pages = render_pages(segments).pages
    full = [page for page in pages if page.height == pages[0].height]
    assert len(full) >= 8
    chosen = [full[0], full[len(full) // 2], full[-1]]
    rates = [rate for page in chosen if (rate := ocr_cer(page)) is not None]
    assert len(rates) == 3 and sum(rates) / 3 <= 0.03 and max(rates) <= 0.035, rates


# Lines from the sample transcripts where a "w" or "m" follows a slash; before the slash
# was redrawn clear of the last column, tesseract read "badlogicAvorkspaces",
# "badlogicfworkspaces", ".fmodels.js", "readfwrite".
SLASHED_LINES = (
    "Files the agent opened in this session:",
    "/Users/badlogic/workspaces/pi-mono/packages/coding-agent/src/core/agent-session.ts",
    "import { loadModels } from ./models.js and then ./messages.js",
    "the read/write/edit tools, and complete/whatever",
    "cd /Users/badlogic/workspaces/pi-mono && npm run check",
)
SLASHED = (
    "badlogic/workspaces/pi-mono/packages/coding-agent/src/core/agent-session.ts",
    "./models.js",
    "read/write/edit",
    "complete/whatever",
    "badlogic/workspaces/pi-mono&&npm",
)


@pytest.mark.slow  # OCR (tesseract)
def test_a_slash_before_w_or_m_reads_back_exactly() -> None:
    _require_tesseract("eng")
    (page,) = render_pages([Segment("tool", "paths", "\n".join(SLASHED_LINES))]).pages
    reading = ocr_image(page.png, row_boxes=page.row_boxes) or ""
    read = "".join(reading.split())
    missing = [token for token in SLASHED if token not in read]
    assert not missing, (missing, reading)


@pytest.mark.parametrize("density", sorted(DENSITIES))
def test_misread_glyphs_are_redrawn_in_their_cell(density: str) -> None:
    stack = font_stack(DENSITIES[density])
    font = stack.fonts[0]
    table = REDRAWN[DENSITIES[density].faces[0].file]
    assert set(table) >= {"+", "-", "0", "5", "@", ".", ",", "/"}
    for char, rows in table.items():
        found = stack.find(ord(char))
        assert found is not None
        glyph, _box = found
        own = font.glyph(ord(char))
        assert own is not None and glyph.rows != own.rows  # drawn over the font's own
        assert (glyph.advance, glyph.ascent, glyph.descent) == (
            own.advance,
            own.ascent,
            own.descent,
        )
        assert len(rows) == font.ascent + font.descent
        assert not any(row[0] == "#" for row in rows)  # the first column stays blank
    # The cache key covers the redrawn shapes, not only the font files.
    files_only = hashlib.sha256()
    for face in DENSITIES[density].faces:
        files_only.update((FONT_DIR / face.file).read_bytes())
    assert stack.digest != files_only.hexdigest()[:16]


def test_it_bills_english_three_times_and_korean_five_times_fewer_tokens() -> None:
    english = _long_english(200_000)
    pages = render_pages(english).pages
    english_text_tokens = sum(len(s.text) for s in english) / 4
    assert english_text_tokens / sum(p.billed_tokens for p in pages) >= 3.0
    korean = [Segment("user", f"k{i}", KOREAN * 6) for i in range(40)]
    pages = render_pages(korean).pages
    korean_text_tokens = sum(len(s.text) for s in korean)  # ~1 token per Hangul character
    assert korean_text_tokens / sum(p.billed_tokens for p in pages) >= 5.0


# Characters outside the Latin cells but one cell wide (their own glyph box), and wide ones.
_ONE_CELL_CANDIDATES = "é→—│ü…·°±×"


def _one_cell_specials(renderer: Renderer) -> str:
    cw = renderer.stack.cell_width
    return "".join(
        c for c in _ONE_CELL_CANDIDATES if renderer._narrow.match(c) and renderer._width(c)[0] == cw
    )


@pytest.mark.parametrize("density", ["default", "dense"])
def test_one_cell_characters_wrap_exactly_as_the_character_walk_does(density: str) -> None:
    """The shortcut for text whose every character is one cell wide (accents, arrows, box
    drawing) must end every row where the character-by-character walk ends it, with the
    same row box: pages are re-rendered from the archived text, and must not move. (No
    one-cell symbol of today's fonts is taller than a Latin row, so the boxes agree
    trivially; the check stays for the day one is.)"""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    renderer = Renderer("claude", density)
    specials = _one_cell_specials(renderer)
    assert len(specials) >= 3, "the font stack lost its one-cell symbols"
    cw = renderer.stack.cell_width
    columns = renderer.profile.width // cw
    # Words of every length around the wrap distance, one breaker between them.
    words = st.text(st.sampled_from(list("abcKLM0123-_/." + specials)), min_size=1, max_size=40)
    texts = st.lists(st.tuples(words, st.sampled_from([" ", "\n", "\t"])), min_size=15).map(
        lambda pairs: "".join(word + gap for word, gap in pairs)
    )

    # Every row position against one break at every distance from the row's end.
    symbol = specials[0]
    for before in range(0, 2 * WRAP_CELLS + 2):
        text = symbol * (columns - WRAP_CELLS - before) + " " + "a" * (3 * WRAP_CELLS)
        for used in range(columns + 1):
            for pos in (0, 1):
                x = used * cw
                assert renderer._fit_cells(text, pos, x) == renderer._fit_slow(text, pos, x)

    @settings(max_examples=500, deadline=None)
    @given(
        text=texts,
        start=st.integers(0, 3 * columns),
        # Often near the row's end, where the walk decides between wrapping and cutting.
        used=st.integers(0, columns + 2) | st.integers(columns - 2 * WRAP_CELLS, columns),
    )
    def check(text: str, start: int, used: int) -> None:
        pos = min(start, len(text) - 1)
        x = used * cw
        assert renderer._fit_cells(text, pos, x) == renderer._fit_slow(text, pos, x)

    check()
