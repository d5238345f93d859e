"""Segments of archived text -> packed 1-bit PNG pages, sized for a billing rule.

Layout: messages follow each other on the same row, each introduced by an inverted header
(" user 3f2a1b2c "); newlines and tabs are drawn as ↵ and ▸ marks instead of breaking
rows; rows wrap at a space when one is near the edge, else mid-word. A character no font
can draw (controls, format characters, private use, beyond the BMP) is drawn as an
inverted escape such as ``U+1F600`` or ``^M`` and counted as substituted.
"""

from __future__ import annotations

import functools
import hashlib
import re
import struct
import unicodedata
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from PIL import Image

from compaction.render.atlas import (
    INVERT,
    MARK_TEXT,
    Box,
    Columns,
    FontStack,
    font_stack,
)
from compaction.render.profiles import DENSITIES, PageProfile, page_profile
from conversations.providers.billing import image_tokens

# Bump when the pixels for the same text and settings change (layout, fonts, marks).
RENDERER_VERSION = "5"

# A row wraps at the last space within this many cells of the edge, else mid-word.
WRAP_CELLS = 16
_BREAKERS = " \n\t"
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
# Default-ignorable characters outside those categories (variation selectors, Hangul
# fillers): invisible in text, and Unifont draws them as dashed boxes that read like a
# missing glyph, so they are escaped too.
_IGNORABLE = frozenset(
    (0x034F, 0x115F, 0x1160, 0x17B4, 0x17B5, 0x180B, 0x180C, 0x180D, 0x180F, 0x3164, 0xFFA0)
).union(range(0xFE00, 0xFE10))
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class Segment:
    """One message's text to render."""

    role: str
    message_id: str
    text: str


class SegmentLike(Protocol):
    """Anything with a segment's three fields (the ladder has its own Segment class)."""

    @property
    def role(self) -> str: ...
    @property
    def message_id(self) -> str: ...
    @property
    def text(self) -> str: ...


@dataclass(frozen=True)
class RenderedPage:
    png: bytes
    width: int
    height: int
    billed_tokens: int
    chars: int  # source characters drawn on this page (headers and escapes not counted)
    text: str  # the source text on this page; each message start as "── role id ──\n"
    first_message_id: str
    last_message_id: str
    # Rows exactly as drawn, in display characters: "\n" and "\t" for the ↵ ▸ marks,
    # white-on-black characters (headers, escapes) shifted by U+F0000; ``readable()``
    # turns them into plain text.
    drawn: tuple[str, ...] = field(default=(), repr=False)
    # (top, height) in pixels of each row in ``drawn``.
    row_boxes: tuple[tuple[int, int], ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class RenderResult:
    pages: list[RenderedPage]
    missing_glyphs: int  # characters drawn as a missing-glyph box: always 0 unless a bug
    substituted: int  # source characters drawn as a visible escape (U+1F600, ^M)
    settings: dict[str, Any]
    truncated: bool = False  # max_pages was reached before the text ran out


@dataclass(slots=True)
class _Row:
    text: str  # display characters
    box: Box
    # (segment index, start, end) of source text, and segment indices whose header is here
    spans: list[tuple[int, int, int]]
    headers: list[int]


class Renderer:
    """Lays out and draws pages for one (rule, density). Holds its glyph atlas."""

    def __init__(self, rule: str = "claude", density: str = "default") -> None:
        self.profile: PageProfile = page_profile(rule, density)
        self.stack: FontStack = font_stack(DENSITIES[density])
        self._cw = self.stack.cell_width
        self._columns: dict[Box, Columns] = {}
        # Source character -> (display text, width in px, box, substituted).
        self._units: dict[str, tuple[str, int, Box, bool]] = {}
        # Display character -> (width in px, box); Latin characters are the common case.
        self._widths: dict[str, tuple[int, Box]] = {}
        self._narrow = self._narrow_pattern()

    @property
    def settings(self) -> dict[str, Any]:
        p = self.profile
        return {
            "renderer": RENDERER_VERSION,
            "rule": p.rule,
            "density": p.density,
            "page": [p.width, p.height],
            "cell": [p.cell_width, p.row_height],
            "fonts": list(p.fonts),
            "font_digest": self.stack.digest,
            "wrap_cells": WRAP_CELLS,
        }

    # -- characters -------------------------------------------------------------------

    def _narrow_pattern(self) -> re.Pattern[str]:
        """Matches a character that is *not* a plain Latin-cell glyph (needs the slow path)."""
        latin = self.stack.fonts[0]
        ok = [
            cp
            for cp in latin.codepoints()
            if self._unit(chr(cp))[1:] == (self._cw, self.stack.base_box, False)
            and self._unit(chr(cp))[0] == chr(cp)
        ]
        ranges: list[list[int]] = []
        for cp in sorted(ok):
            if ranges and ranges[-1][1] == cp - 1:
                ranges[-1][1] = cp
            else:
                ranges.append([cp, cp])
        body = "".join(
            re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}"
            for a, b in ranges
        )
        return re.compile(f"[^{body}\\n\\t]")

    def _unit(self, char: str) -> tuple[str, int, Box, bool]:
        unit = self._units.get(char)
        if unit is not None:
            return unit
        base = self.stack.base_box
        if char in MARK_TEXT:
            unit = (char, self._cw, base, False)
        else:
            hit = None
            drawable = unicodedata.category(char) not in _ESCAPED_CATEGORIES
            if drawable and ord(char) not in _IGNORABLE:
                hit = self.stack.find(ord(char))
            if hit is not None:
                glyph, box = hit
                unit = (char, glyph.advance, box, False)
            else:
                label = _escape_label(ord(char))
                unit = (_inverted(label), len(label) * self._cw, base, True)
        self._units[char] = unit
        return unit

    def _width(self, char: str) -> tuple[int, Box]:
        info = self._widths.get(char)
        if info is None:
            if ord(char) >= INVERT or char in MARK_TEXT:
                info = (self._cw, self.stack.base_box)
            else:
                _, width, box, _ = self._unit(char)
                info = (width, box)
            self._widths[char] = info
        return info

    def _display(self, text: str) -> tuple[str, list[int] | None, int, set[str]]:
        """Display string, its source offset per display char (None if 1:1),
        substitutions, and its characters outside the Latin cells."""
        specials = set(self._narrow.findall(text))
        if all(self._unit(char)[0] == char for char in specials):
            return text, None, 0, specials  # every character drawn as itself (the common case)
        pieces: list[str] = []
        offsets: list[int] = []
        substituted = 0
        for index, char in enumerate(text):
            shown, _, _, sub = self._unit(char)
            pieces.append(shown)
            offsets.extend([index] * len(shown))
            substituted += sub
        display = "".join(pieces)
        offsets_or_none = offsets if len(display) != len(text) else None
        return display, offsets_or_none, substituted, set(self._narrow.findall(display))

    # -- layout -----------------------------------------------------------------------

    def _rows(
        self, segments: Sequence[SegmentLike], texts: list[str], counts: list[int]
    ) -> Iterator[_Row]:
        width = self.profile.width
        cw = self._cw
        base = self.stack.base_box
        parts: list[str] = []
        spans: list[tuple[int, int, int]] = []
        headers: list[int] = []
        x = 0
        box = base

        def flush() -> _Row | None:
            nonlocal parts, spans, headers, x, box
            if not parts:
                return None
            row = _Row("".join(parts), box, spans, headers)
            parts, spans, headers, x, box = [], [], [], 0, base
            return row

        for index, (segment, text) in enumerate(zip(segments, texts, strict=True)):
            label = _inverted(_header_label(segment))
            if x + len(label) * cw > width and (row := flush()):
                yield row
            parts.append(label)
            headers.append(index)
            x += len(label) * cw

            display, offsets, substituted, specials = self._display(text)
            counts[1] += substituted
            pos, n = 0, len(display)
            # Characters outside the Latin cells: any of another width needs the walk
            # character by character; of the cell's width (accents, arrows, box
            # drawing), only their boxes (a taller row) differ from Latin text.
            slow = any(self._width(char)[0] != cw for char in specials)
            while pos < n:
                if slow:
                    end, row_box = self._fit_slow(display, pos, x)
                elif specials:
                    end, row_box = self._fit_cells(display, pos, x)
                else:
                    end, row_box = self._fit_fast(display, pos, x), base
                if end == pos:  # the rest of the row is too short to start this text
                    assert x > 0, "a character wider than the page"
                    if (row := flush()) is not None:
                        yield row
                    continue
                piece = display[pos:end]
                parts.append(piece)
                spans.append(
                    (index, _source(offsets, pos, len(text)), _source(offsets, end, len(text)))
                )
                box = box.union(row_box)
                x += self._measure(piece) if slow else len(piece) * cw
                pos = end
                if pos < n and (row := flush()) is not None:
                    yield row
        if (row := flush()) is not None:
            yield row

    def _fit_fast(self, display: str, pos: int, x: int) -> int:
        """End of the piece of all-Latin ``display`` from ``pos`` that fits after ``x``."""
        free = (self.profile.width - x) // self._cw
        end = pos + free
        if end >= len(display):
            return len(display)
        if free <= 0 or display[end] in _BREAKERS:
            return max(end, pos)
        low = max(pos, end - WRAP_CELLS)
        cut = max(display.rfind(" ", low, end), display.rfind("\n", low, end))
        cut = max(cut, display.rfind("\t", low, end))
        if cut >= low:
            return cut + 1
        if x > 0 and free <= WRAP_CELLS:
            return pos  # start the word on the next row
        return end

    def _fit_cells(self, display: str, pos: int, x: int) -> tuple[int, Box]:
        """``_fit_slow``'s answer for text whose every character is one cell wide, without
        its walk: the same end and the same row box."""
        cw = self._cw
        end = pos + max(0, (self.profile.width - x) // cw)
        if end >= len(display):
            end = len(display)
        else:
            # The walk's last break: after the last space, newline or tab before ``end``.
            cut = max(display.rfind(b, pos, end) for b in _BREAKERS) + 1
            if cut > pos and (end - cut) <= WRAP_CELLS:
                end = cut
            elif cut <= pos and x > 0 and end - pos <= WRAP_CELLS:
                end = pos  # start the word on the next row
        box = self.stack.base_box
        for char in set(self._narrow.findall(display, pos, end)):
            box = box.union(self._width(char)[1])
        return end, box

    def _fit_slow(self, display: str, pos: int, x: int) -> tuple[int, Box]:
        """Like ``_fit_fast`` for text with wide or tall glyphs; also returns the row box."""
        limit = self.profile.width
        wrap_px = WRAP_CELLS * self._cw
        start_x = x
        cut, cut_x = -1, 0  # the last position where the row may end, and x there
        i, n = pos, len(display)
        while i < n:
            char = display[i]
            width = self._width(char)[0]
            if x + width > limit:
                if cut > pos and x - cut_x <= wrap_px:
                    i = cut
                elif cut < 0 and start_x > 0 and x - start_x <= wrap_px:
                    i = pos  # start the word on the next row
                break
            if width > self._cw and i > pos:
                cut, cut_x = i, x  # CJK text may break before any wide character
            x += width
            i += 1
            if char in _BREAKERS or width > self._cw:
                cut, cut_x = i, x
        box = self.stack.base_box
        for char in set(display[pos:i]):
            box = box.union(self._width(char)[1])
        return i, box

    def _measure(self, piece: str) -> int:
        return sum(self._width(char)[0] for char in piece)

    # -- pages ------------------------------------------------------------------------

    def render(
        self, segments: Sequence[SegmentLike], *, max_pages: int | None = None
    ) -> RenderResult:
        profile = self.profile
        counts = [0, 0]  # missing glyphs, substituted characters
        missing_before = sum(c.missing for c in self._columns.values())
        pages: list[RenderedPage] = []
        page_rows: list[tuple[int, _Row]] = []
        y = 0
        truncated = False
        if max_pages is not None and max_pages < 1:
            raise ValueError(f"max_pages must be at least 1, got {max_pages}")
        # Decomposed Hangul (macOS file names) would draw as loose jamo: compose first.
        texts = [
            s.text if s.text.isascii() else unicodedata.normalize("NFC", s.text) for s in segments
        ]
        for row in self._rows(segments, texts, counts):
            height = row.box.height
            band = profile.band
            if band and y // band != (y + height - 1) // band:
                y = (y // band + 1) * band  # keep the row inside one provider tile
            if y + height > profile.height:
                if max_pages is not None and len(pages) + 1 >= max_pages:
                    truncated = True
                    break
                pages.append(self._page(page_rows, profile.height, segments, texts))
                page_rows, y = [], 0
            page_rows.append((y, row))
            y += height
        if page_rows:
            step = profile.height_step
            last_height = min(profile.height, -(-y // step) * step)
            pages.append(self._page(page_rows, last_height, segments, texts))
        counts[0] = sum(c.missing for c in self._columns.values()) - missing_before
        return RenderResult(pages, counts[0], counts[1], self.settings, truncated)

    def _page(
        self,
        rows: list[tuple[int, _Row]],
        height: int,
        segments: Sequence[SegmentLike],
        texts: list[str],
    ) -> RenderedPage:
        width = self.profile.width
        image = Image.new("1", (width, height), 1)
        for y, row in rows:
            columns = self._columns.get(row.box)
            if columns is None:
                columns = self._columns[row.box] = Columns(self.stack, row.box)
            data = b"".join(map(columns.__getitem__, row.text))
            size = (row.box.height, len(data) // row.box.height)
            strip = Image.frombytes("1", size, data, "raw", "1;8")  # one byte per pixel
            image.paste(strip.transpose(Image.Transpose.TRANSPOSE), (0, y))
        text, chars, first, last = _page_text(rows, segments, texts)
        return RenderedPage(
            png=encode_png(image),
            width=width,
            height=height,
            billed_tokens=image_tokens(self.profile.rule, width, height),
            chars=chars,
            text=text,
            first_message_id=first,
            last_message_id=last,
            drawn=tuple(row.text for _, row in rows),
            row_boxes=tuple((y, row.box.height) for y, row in rows),
        )


def _source(offsets: list[int] | None, pos: int, length: int) -> int:
    """Source offset of display position ``pos``."""
    if offsets is None:
        return pos
    return offsets[pos] if pos < len(offsets) else length


def _page_text(
    rows: list[tuple[int, _Row]], segments: Sequence[SegmentLike], texts: list[str]
) -> tuple[str, int, str, str]:
    order: list[int] = []
    ranges: dict[int, list[int]] = {}
    headed: set[int] = set()
    for _, row in rows:
        for index in row.headers:
            headed.add(index)
            if index not in ranges:
                order.append(index)
                ranges[index] = [-1, -1]
        for index, start, end in row.spans:
            if index not in ranges:
                order.append(index)
                ranges[index] = [start, end]
            elif ranges[index][0] < 0:
                ranges[index] = [start, end]
            else:
                ranges[index][1] = end
    portions: list[str] = []
    chars = 0
    for index in order:
        segment = segments[index]
        start, end = ranges[index]
        body = texts[index][start:end] if start >= 0 else ""
        chars += len(body)
        head = f"── {segment.role} {segment.message_id} ──\n" if index in headed else ""
        portions.append(head + body)
    first = segments[order[0]].message_id if order else ""
    last = segments[order[-1]].message_id if order else ""
    return "\n".join(portions), chars, first, last


# Characters of a message id a header shows: its last 12, the recall id. The leading
# characters are no good: imported ids share a per-conversation prefix (ordered ids).
RECALL_ID_CHARS = 12


def recall_id(message_id: str) -> str:
    """The short id a page header shows and the recall tool accepts: the last 12
    characters of a long id (random bits in every id Arbor makes), a short id whole."""
    return message_id[-RECALL_ID_CHARS:]


def _header_label(segment: SegmentLike) -> str:
    # A header never takes more than ~30 cells; the full id is in RenderedPage.text.
    return f" {segment.role[:16]} {recall_id(segment.message_id)} "


def _inverted(label: str) -> str:
    return "".join(chr(INVERT + ord(char)) for char in label)


def _escape_label(codepoint: int) -> str:
    if codepoint < 0x20 or codepoint == 0x7F:
        return "^" + chr(codepoint ^ 0x40)  # caret notation: ^M for CR, ^[ for ESC
    return f"U+{codepoint:04X}"


class _ReadableTable(dict[int, int | str]):
    """``str.translate`` table: inverted characters to plain ones, marks to ↵ and ▸."""

    def __missing__(self, codepoint: int) -> int | str:
        char = chr(codepoint)
        value: int | str = codepoint
        if char in MARK_TEXT:
            value = MARK_TEXT[char]
        elif codepoint >= INVERT:
            value = codepoint - INVERT
        self[codepoint] = value
        return value


_READABLE = _ReadableTable()


def readable(drawn: str) -> str:
    """Display characters as plain text: marks as ↵ ▸, white-on-black as plain."""
    return drawn.translate(_READABLE)


# zlib level 1: on the real samples' pages 2.0 ms a page against 6.6 ms at level 6, for
# 9% more bytes (69 against 64 KB); providers bill a page by its area, not its bytes.
PNG_ZLIB_LEVEL = 1


def encode_png(image: Image.Image) -> bytes:
    """A minimal 1-bit greyscale PNG: no ancillary chunks, fixed zlib level, filter 0.

    Written here rather than with Image.save so the bytes depend only on the pixels and
    this function (no encoder options or metadata that may drift between Pillow versions).
    """
    width, height = image.size
    raw = image.tobytes()
    stride = (width + 7) // 8
    scanlines = b"".join(b"\x00" + raw[i : i + stride] for i in range(0, len(raw), stride))
    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"".join(
        (
            _PNG_SIGNATURE,
            _chunk(b"IHDR", header),
            _chunk(b"IDAT", zlib.compress(scanlines, PNG_ZLIB_LEVEL)),
            _chunk(b"IEND", b""),
        )
    )


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(kind + data) & 0xFFFFFFFF
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


@functools.cache
def _renderer(rule: str, density: str) -> Renderer:
    return Renderer(rule, density)


def render_pages(
    segments: Sequence[SegmentLike],
    *,
    rule: str = "claude",
    density: str = "default",
    max_pages: int | None = None,
) -> RenderResult:
    """Render ``segments`` (archived original text, never earlier pixels) as pages."""
    return _renderer(rule, density).render(segments, max_pages=max_pages)


def cache_key(segments: Sequence[SegmentLike], *, rule: str, density: str) -> str:
    """Hash of (text, settings, renderer version): equal keys give identical pages."""
    digest = hashlib.sha256()
    settings = _renderer(rule, density).settings
    digest.update(repr(sorted(settings.items())).encode())
    for segment in segments:
        for value in (segment.role, segment.message_id, segment.text):
            encoded = value.encode("utf-8", "surrogatepass")
            digest.update(len(encoded).to_bytes(8, "big"))
            digest.update(encoded)
    return digest.hexdigest()
