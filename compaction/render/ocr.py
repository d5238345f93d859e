"""Legibility of rendered pages: tesseract OCR and a character error rate (CER).

Tesseract is trained on smooth print, not 1-bit pixel fonts, so a page is padded, scaled
up by nearest neighbour and lightly blurred first; that roughly halves its errors on
pixel-font glyphs. The CER ignores whitespace (rows wrap anywhere) and treats characters
tesseract's model cannot output at all (the ↵ ▸ ␛ marks, the backtick) as wildcards that
match one OCR character or none, so the figure measures the glyphs, not the OCR alphabet;
and runs of one character count as three (tesseract reads "=====" rules as graphics).
White-on-black labels (message headers, escapes) are wildcards too: tesseract cannot read
inverted runs inside a normal line, and they are structure, not the archived text.
"""

from __future__ import annotations

import functools
import io
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from PIL import Image, ImageFilter, ImageOps

from compaction.render.atlas import INVERT, MARK_TEXT

if TYPE_CHECKING:
    from compaction.render.engine import RenderedPage

# Characters the LSTM model in tesseract-ocr-eng (tessdata_fast) can output; every other
# character is a wildcard when scoring English.
ENG_CHARSET = frozenset(
    "!\"#$%&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]_abcdefghijklmnopqrstuvwxyz"
    "{|}~£¥§©«®°»é€™¢"
)
# Typographic quotes and dashes fold to ASCII (escaped: they look like the ASCII ones).
_FOLD = str.maketrans(
    {
        "\u201c": '"',  # left double quotation mark
        "\u201d": '"',  # right double quotation mark
        "\u201e": '"',  # double low-9 quotation mark
        "\u2018": "'",  # left single quotation mark
        "\u2019": "'",  # right single quotation mark
        "\u201a": "'",  # single low-9 quotation mark
        "\u2014": "-",  # em dash
        "\u2013": "-",  # en dash
        "\u2026": "...",  # horizontal ellipsis
    }
)
# Tesseract reads a long run of one character (a "=====" rule, a "-----" table border)
# as a graphic and emits a few characters or a run of something else; any run of four or
# more equal ASCII characters counts as three, in the reference and in the reading.
# (Runs of wildcards stay: each may absorb one character of the reading.)
_RULE = re.compile(r"([!-~])\1{3,}")
WILDCARD = "\ufffc"  # stands for a white-on-black character in a reference text
_ALWAYS_WILD = frozenset({*MARK_TEXT.values(), WILDCARD})
_BAND = 160  # cells each side of the expected alignment (more than one dropped row)


def cer(reference: str, hypothesis: str, *, lang: str = "eng") -> float:
    """Character error rate of ``hypothesis`` against ``reference``, whitespace ignored.

    When both have the same number of non-blank lines (the usual case for a page OCR'd
    with its rows spaced apart) lines are compared one to one; otherwise the texts are
    aligned as a whole within a band that follows the alignment.
    """
    ref_lines = [line for line in reference.splitlines() if line.strip()]
    hyp_lines = [line for line in hypothesis.splitlines() if line.strip()]
    if len(ref_lines) < 2 or len(ref_lines) != len(hyp_lines):
        ref_lines, hyp_lines = [reference], [hypothesis]
    errors = counted = 0
    for ref_line, hyp_line in zip(ref_lines, hyp_lines, strict=True):
        ref = _normalise(ref_line)
        if lang == "eng":
            wild = [char not in ENG_CHARSET for char in ref]
        else:
            wild = [char in _ALWAYS_WILD for char in ref]
        errors += _distance(ref, _normalise(hyp_line), wild)
        counted += len(ref) - sum(wild)
    return errors / counted if counted else 0.0


def _normalise(text: str) -> str:
    return _RULE.sub(r"\1\1\1", "".join(text.translate(_FOLD).split()))


def _distance(ref: str, hyp: str, wild: list[bool]) -> int:
    """Levenshtein distance within a band that follows the alignment; wildcards are free.

    A fixed band around the diagonal fails on pages where tesseract drops a run of
    wildcards (a box-drawing diagram), so each row's band covers both the diagonal of the
    non-wildcard characters and the previous row's best cell.
    """
    n, m = len(ref), len(hyp)
    if m == 0:
        return n - sum(wild)
    counted = max(1, n - sum(wild))
    big = n + m + 1
    # prev[j - prev_lo] is the cost of aligning ref[:i-1] with hyp[:j].
    prev_lo, prev = 0, list(range(min(m, _BAND) + 1))
    best_j, seen = 0, 0
    for i in range(1, n + 1):
        char, free = ref[i - 1], wild[i - 1]
        seen += not free
        centre = seen * m // counted
        lo = max(0, min(centre, best_j) - _BAND)
        hi = min(m, max(centre, best_j) + _BAND)
        prev_hi = prev_lo + len(prev) - 1
        delete = 0 if free else 1
        cur = [big] * (hi - lo + 1)
        for j in range(lo, hi + 1):
            best = prev[j - prev_lo] + delete if prev_lo <= j <= prev_hi else big
            if j > lo and cur[j - 1 - lo] + 1 < best:
                best = cur[j - 1 - lo] + 1
            if j > 0 and prev_lo <= j - 1 <= prev_hi:
                cost = prev[j - 1 - prev_lo] + (0 if free or hyp[j - 1] == char else 1)
                if cost < best:
                    best = cost
            cur[j - lo] = best
        prev_lo, prev = lo, cur
        best_j = lo + cur.index(min(cur))
    # Whatever of the OCR text lies past the band's end was inserted.
    return min(cost + (m - (prev_lo + j)) for j, cost in enumerate(prev))


@functools.cache
def tesseract_available(lang: str = "eng") -> bool:
    """True when the ``tesseract`` CLI and its ``lang`` model are installed."""
    if shutil.which("tesseract") is None:
        return False
    listed = subprocess.run(
        ["tesseract", "--list-langs"], capture_output=True, text=True, check=False
    ).stdout
    return lang in listed.split()


def ocr_image(
    png: bytes,
    *,
    lang: str = "eng",
    scale: int = 3,
    row_boxes: Sequence[tuple[int, int]] = (),
) -> str | None:
    """Tesseract's reading of a page, or None when tesseract (or ``lang``) is missing.

    With ``row_boxes`` the rows are spaced apart first (pixels unchanged): box-drawing
    characters otherwise join adjacent rows and tesseract's line finder reads them out
    of order.
    """
    if not tesseract_available(lang):
        return None
    with Image.open(io.BytesIO(png)) as page:
        grey = page.convert("L")
    if row_boxes:
        grey = _spaced_rows(grey, row_boxes)
    grey = ImageOps.expand(grey, border=8, fill=255)
    big = grey.resize((grey.width * scale, grey.height * scale), Image.Resampling.NEAREST)
    big = big.filter(ImageFilter.GaussianBlur(0.55 * scale))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "page.png"
        big.save(path)
        # One thread: OCR runs beside other work (tests, a job worker), and tesseract's
        # OpenMP threads mostly add contention on pages this size.
        env = {**os.environ, "OMP_THREAD_LIMIT": "1"}
        done = subprocess.run(
            ["tesseract", str(path), "-", "-l", lang, "--psm", "6"],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
    return done.stdout


def _spaced_rows(page: Image.Image, row_boxes: Sequence[tuple[int, int]]) -> Image.Image:
    gap = max(height for _, height in row_boxes)
    out = Image.new("L", (page.width, sum(h + gap for _, h in row_boxes)), 255)
    y = 0
    for top, height in row_boxes:
        out.paste(page.crop((0, top, page.width, top + height)), (0, y))
        y += height + gap
    return out


def ocr_cer(page: RenderedPage, *, lang: str = "eng", scale: int = 3) -> float | None:
    """CER of tesseract's reading of ``page`` against what was drawn; None without OCR."""
    text = ocr_image(page.png, lang=lang, scale=scale, row_boxes=page.row_boxes)
    if text is None:
        return None
    return cer(reference_text(page), text, lang=lang)


def ocr_page(page: RenderedPage, *, lang: str = "eng", scale: int = 3) -> dict[str, float] | None:
    """Both error rates of one OCR of ``page``: ``lenient`` (``cer``: whitespace ignored,
    wildcards free, rules collapsed) and ``plain`` (``plain_cer``: every character drawn
    counts), with ``plain_body`` for the body rows alone when the rows line up (else
    absent); None without OCR."""
    text = ocr_image(page.png, lang=lang, scale=scale, row_boxes=page.row_boxes)
    if text is None:
        return None
    figures = {"lenient": cer(reference_text(page), text, lang=lang)}
    figures.update(plain_cer(page.drawn, text, lang=lang))
    return figures


def unreadable(char: str, lang: str = "eng") -> bool:
    """True when tesseract's ``lang`` model has no output for ``char``, so every one drawn
    is a plain-CER error whatever its glyph: outside the English model's alphabet (↵ ▸,
    the backtick, box drawing, arrows); for other languages only the marks, a lower
    bound (no alphabet of their models is listed here)."""
    if char.isspace():
        return False
    if lang == "eng":
        return char not in ENG_CHARSET
    return char in _ALWAYS_WILD


def plain_cer(drawn: Sequence[str], hypothesis: str, *, lang: str = "eng") -> dict[str, float]:
    """Plain Levenshtein CER of an OCR reading against the rows drawn, read as a person
    would (``readable``: marks as ↵ ▸, white-on-black as plain): only runs of blanks are
    folded to one, nothing is free. ``plain`` covers every row; ``plain_body`` only the
    rows without a white-on-black label (message headers, escapes), when the reading has
    one line per drawn row so the two can be matched, and ``plain_body_floor`` the share
    of those rows' characters the reader cannot output (``unreadable``): the lowest
    ``plain_body`` any glyph could reach on these rows."""
    from compaction.render.engine import readable

    def folded(line: str) -> str:
        return " ".join(line.split())

    rows = [(folded(readable(row)), any(ord(c) >= INVERT for c in row)) for row in drawn]
    rows = [(text, labelled) for text, labelled in rows if text]
    lines = [folded(line) for line in hypothesis.splitlines() if line.strip()]
    if len(rows) != len(lines):
        # Rows and lines do not pair up: the whole page at once, in a band that follows
        # the alignment (a full table of a page's 10,000 characters squared is too slow).
        reference = "\n".join(text for text, _ in rows)
        errors = _distance(reference, "\n".join(lines), [False] * len(reference))
        return {"plain": errors / max(1, len(reference))}
    errors = counted = body_errors = body_counted = body_unreadable = 0
    for (text, labelled), line in zip(rows, lines, strict=True):
        distance = _levenshtein(text, line)
        errors, counted = errors + distance, counted + len(text)
        if not labelled:
            body_errors, body_counted = body_errors + distance, body_counted + len(text)
            body_unreadable += sum(unreadable(char, lang) for char in text)
    return {
        "plain": errors / max(1, counted),
        "plain_body": body_errors / max(1, body_counted),
        "plain_body_floor": body_unreadable / max(1, body_counted),
    }


def _levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions each cost one)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, char in enumerate(a, 1):
        current = [i]
        for j, other in enumerate(b, 1):
            current.append(
                min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char != other))
            )
        previous = current
    return previous[-1]


class _ReferenceTable(dict[int, str | int]):
    """``str.translate`` table from display characters to a CER reference."""

    def __missing__(self, codepoint: int) -> str | int:
        char = chr(codepoint)
        value: str | int = MARK_TEXT.get(char, codepoint)
        if codepoint >= INVERT:
            value = WILDCARD
        self[codepoint] = value
        return value


_REFERENCE = _ReferenceTable()


def reference_text(page: RenderedPage) -> str:
    """What a perfect reader would read off ``page``; white-on-black as wildcards."""
    return "\n".join(row.translate(_REFERENCE) for row in page.drawn)
