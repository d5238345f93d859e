"""The glyph atlas: fonts in fallback order, and each glyph pre-cut as pixel columns.

A glyph is stored *transposed*: ``advance`` columns of ``row height`` bytes (0x00 ink,
0xFF paper). Joining the stored bytes of a row's characters gives the transposed image of
the whole row in one C-level ``bytes.join``; Pillow transposes it back. That is the fast
path: no per-pixel Python work after a glyph's first use.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

from compaction.render.pcf import Glyph, PcfFont
from compaction.render.profiles import FONT_DIR, Density
from compaction.render.redrawn import REDRAWN, redrawn_glyphs, round_loops

INVERT = 0xF0000  # display code point of a white-on-black BMP character (plane 15 PUA)
# A newline is drawn as ↵, a tab as ▸ and ESC as a small hollow diamond (read ␛); the
# layout never breaks a row on them. They are drawn here, in a Latin cell with the
# baseline under the last line, so every density draws the same shapes (the ASCII fonts
# have none); the blank sixth column is dropped for 5-px cells. ESC gets a mark, not a
# white-on-black ^[ label, because terminal output is full of colour codes: a solid label
# before every "[90m" took two cells and made the text beside it unreadable (tesseract
# read a page of npm output at 6.4% CER with labels, 3.9% with the mark).
_MARKS: dict[str, tuple[str, ...]] = {
    "\n": ("....#.", "....#.", ".#..#.", "#####.", ".#...."),
    "\t": (".#....", ".##...", ".###..", ".##...", ".#...."),
    "\x1b": ("......", "..#...", ".#.#..", "..#...", "......"),
}
MARK_TEXT = {"\n": "↵", "\t": "▸", "\x1b": "␛"}
LEGEND = (
    "Pages show archived conversation text. ↵ marks a line break, ▸ a tab and a small"
    " hollow diamond an escape character (ESC, as in terminal colour codes); a"
    " white-on-black label starts each message (role and message id) or stands for a"
    " character that cannot be drawn (U+XXXX code point, ^X control character)."
)


@dataclass(frozen=True, slots=True)
class Box:
    """A row's vertical extent: rows above and below the baseline."""

    ascent: int
    descent: int

    @property
    def height(self) -> int:
        return self.ascent + self.descent

    def union(self, other: Box) -> Box:
        if other == self:
            return self
        return Box(max(self.ascent, other.ascent), max(self.descent, other.descent))


@functools.cache
def load_font(file: str) -> PcfFont:
    return PcfFont(FONT_DIR / file)


class FontStack:
    """The fonts of one density, searched in order for each code point."""

    def __init__(self, density: Density) -> None:
        self.fonts = [load_font(face.file) for face in density.faces]
        self.boxes = [
            Box(font.ascent + face.lead, font.descent)
            for font, face in zip(self.fonts, density.faces, strict=True)
        ]
        self.base_box = self.boxes[0]
        # Glyphs drawn over a font's own where its shape is misread (redrawn.py).
        self.redrawn = [
            redrawn_glyphs(face.file, ascent=font.ascent, descent=font.descent)
            for font, face in zip(self.fonts, density.faces, strict=True)
        ]
        self.faces = density.faces
        latin = self.fonts[0].glyph(ord("M"))
        assert latin is not None, "the first font must cover ASCII"
        self.cell_width = latin.advance
        digest = hashlib.sha256()
        for face in density.faces:
            # The face's settings (lead, legacy codec, ranges, rounding) move pixels too.
            digest.update(repr(face).encode())
            digest.update((FONT_DIR / face.file).read_bytes())
            digest.update(repr(sorted(REDRAWN.get(face.file, {}).items())).encode())
        self.digest = digest.hexdigest()[:16]

    def find(self, codepoint: int) -> tuple[Glyph, Box] | None:
        if codepoint > 0xFFFF:
            return None
        for face, font, box, redrawn in zip(
            self.faces, self.fonts, self.boxes, self.redrawn, strict=True
        ):
            if face.only and not any(codepoint in span for span in face.only):
                continue
            code = legacy_code(codepoint, face.codec) if face.codec else codepoint
            if code is None:
                continue
            glyph = redrawn.get(codepoint) or font.glyph(code)
            if glyph is not None and glyph.advance > 0:
                if any(codepoint in span for span in face.rounded):
                    glyph = round_loops(glyph)
                return glyph, box
        return None

    def mark(self, key: str) -> Glyph:
        width = self.cell_width
        lines = [line[:width].ljust(width, ".") for line in _MARKS[key]]
        rows = tuple(int(line.replace(".", "0").replace("#", "1"), 2) for line in lines)
        return Glyph(width, 0, len(rows), 0, width, rows)


def legacy_code(codepoint: int, codec: str) -> int | None:
    """The glyph code of ``codepoint`` in a font indexed by a two-byte legacy character
    set such as KS X 1001 (codec ``euc_kr``: each byte less its high bit, as X11 fonts
    encoded ``ksc5601.1987-0`` index them); None when the set has no such character.
    (Python's euc_kr spells syllables outside KS X 1001 as 8-byte jamo sequences.)"""
    try:
        encoded = chr(codepoint).encode(codec)
    except UnicodeEncodeError:
        return None
    if len(encoded) != 2:
        return None
    return (encoded[0] & 0x7F) << 8 | (encoded[1] & 0x7F)


@functools.cache
def font_stack(density: Density) -> FontStack:
    return FontStack(density)


def glyph_columns(glyph: Glyph, box: Box, *, inverted: bool = False) -> bytes:
    """The glyph's cell as ``advance`` columns of ``box.height`` bytes, top to bottom."""
    height = box.height
    ink, paper = (0xFF, 0x00) if inverted else (0x00, 0xFF)
    cells = bytearray([paper]) * (glyph.advance * height)
    top = box.ascent - glyph.ascent
    for gy, bits in enumerate(glyph.rows):
        y = top + gy
        if not bits or not 0 <= y < height:
            continue
        for gx in range(glyph.width):
            if bits >> (glyph.width - 1 - gx) & 1:
                x = glyph.left + gx
                if 0 <= x < glyph.advance:
                    cells[x * height + y] = ink
    return bytes(cells)


class Columns(dict[str, bytes]):
    """Display character -> its pre-cut columns for one row box, filled on first use."""

    def __init__(self, stack: FontStack, box: Box) -> None:
        super().__init__()
        self.stack = stack
        self.box = box
        self.missing = 0  # display characters no font could draw (a renderer bug if > 0)

    def __missing__(self, char: str) -> bytes:
        codepoint = ord(char)
        inverted = codepoint >= INVERT
        if inverted:
            codepoint -= INVERT
        found: Glyph | None
        if char in MARK_TEXT:
            found = self.stack.mark(char)
        else:
            hit = self.stack.find(codepoint)
            found = hit[0] if hit else None
        if found is None:
            # Never expected: the layout escapes every character without a glyph. Draw a
            # solid cell rather than nothing, and count it.
            self.missing += 1
            width = self.stack.cell_width
            found = Glyph(width, 0, self.box.ascent, 0, width, (2**width - 1,) * self.box.ascent)
        columns = glyph_columns(found, self.box, inverted=inverted)
        self[char] = columns
        return columns
