"""Glyphs redrawn over a shipped font where its own shape is misread.

Schumacher Clean 5x10 is the most legible 5-px font we measured, but a few of its glyphs
cost most of the OCR errors on agent transcripts (paths, versions, package names):

- ``+ -`` span all five columns and touch their neighbours: ``swc+helpers`` read as
  ``swcthelpers``, ``-`` vanished into the next letter (``=`` keeps its full width: a
  ``====`` rule drawn with gaps reads as ``ssss``);
- ``0`` has a diagonal inside and reads as ``8`` or ``6``;
- ``@`` is x-height only and reads as ``e``, ``G`` or ``¢``;
- ``5`` has a flat foot and reads as ``S``;
- the 1x2 ``.`` and the ``,`` differ by one pixel and ``.`` often reads as ``,``;
- ``/`` reaches the last column, so it touches a ``w`` or ``m`` after it (the two
  letters that use the first column): ``badlogic/workspaces`` read as
  ``badlogicAvorkspaces``, ``./models.js`` as ``.fmodels.js``. Drawn in the middle
  three columns, the paths on the pages bench_ladder samples came back exact 67% ->
  79% of the time (numbers, hex and call ids unchanged).

Each replacement keeps the cell (5 columns, the same ascent and descent) so the layout
is unchanged; the first column stays blank as in the font, so no glyph touches the
previous one. Measured with tesseract on ten full Claude pages of the English sample
transcripts (``compaction.bench_render``): mean CER 2.66% -> 1.71%, worst page 3.99% ->
2.64%. Over all 54 pages (with ESC drawn as a mark, atlas.py) the mean is 2.2% and 46
pages read within 3%; the rest are terminal output (npm prompts full of colour codes,
``+++`` progress bars) and random temp-folder names, up to 4.1%. Shapes that measured
worse were left as the font draws them (``m``, ``B``, ``=``).

A table maps a font file to its redrawn glyphs: a character and its rows top to bottom,
``#`` ink and ``.`` paper, as many rows as the font's ascent plus descent.

Hangul in Baekmuk Gulim (12 px in efont, and 10 px) draws the circle ㅇ as a rectangle
with its four corner pixels cut, one pixel from ㅁ (a rectangle with one corner cut), and
tesseract read 이 에 아 어 여 as 미 메 마 머 며: half of its errors on the Korean sample
(plain CER on body rows 11.2%). ``round_loops`` cuts such a loop's corners one pixel
deeper, so ㅇ is an octagon beside the square ㅁ: 5.8%, the rest being ↵ ▸ marks (2.9%)
and other jamo (ㅊ read as ㅈ, a flat ㅇ under ㅡ as ㄹ). At 10 px the ㅇ beside ㅔ is four
pixels wide and cannot be rounder; that density reads at 8.2%.
"""

from __future__ import annotations

from collections.abc import Iterator

from compaction.render.pcf import Glyph

# clR5x10: ascent 8 (the top row is blank), descent 2; the baseline is under row 7.
_CLEAN_5X10: dict[str, tuple[str, ...]] = {
    # A 3x3 plus at the x-height centre, clear of both neighbours (a 3x5 one read as "t").
    "+": (".....", ".....", ".....", "..#..", ".###.", "..#..", ".....", ".....", ".....", "....."),
    "-": (".....", ".....", ".....", ".....", ".###.", ".....", ".....", ".....", ".....", "....."),
    # An open zero, the same as O: the reader tells them apart by the digits around it.
    "0": (".....", "..##.", ".#..#", ".#..#", ".#..#", ".#..#", ".#..#", "..##.", ".....", "....."),
    "5": (".....", ".####", ".#...", ".###.", "....#", "....#", ".#..#", "..##.", ".....", "....."),
    "@": (".....", "..##.", ".#..#", ".#.##", ".#.##", ".#.##", ".#...", "..###", ".....", "....."),
    # A 2x2 full stop; the comma is the same dot with a tail below the baseline.
    ".": (".....", ".....", ".....", ".....", ".....", ".....", "..##.", "..##.", ".....", "....."),
    ",": (".....", ".....", ".....", ".....", ".....", ".....", "..##.", "..##.", "...#.", "..#.."),
    # Three columns wide, clear of the next glyph's first column.
    "/": (".....", ".....", "...#.", "...#.", "...#.", "..#..", "..#..", ".#...", ".#...", ".#..."),
}

# clR5x8 (density "dense"): ascent 7 with no blank top row, descent 1, the same shapes one
# row up; the comma's tail is one pixel. Measured on six pages: mean CER 4.2% -> 3.5%.
_CLEAN_5X8: dict[str, tuple[str, ...]] = {
    char: rows[1:9] for char, rows in _CLEAN_5X10.items() if char != ","
} | {",": (".....", ".....", ".....", ".....", ".....", "..##.", "..##.", "..#..")}

REDRAWN: dict[str, dict[str, tuple[str, ...]]] = {
    "clR5x10.pcf.gz": _CLEAN_5X10,
    "clR5x8.pcf.gz": _CLEAN_5X8,
}


def redrawn_glyphs(file: str, *, ascent: int, descent: int) -> dict[int, Glyph]:
    """The replacement glyphs for font ``file`` (metrics ``ascent``/``descent``)."""
    glyphs: dict[int, Glyph] = {}
    for char, rows in REDRAWN.get(file, {}).items():
        width = len(rows[0])
        if len(rows) != ascent + descent or any(len(row) != width for row in rows):
            raise ValueError(f"redrawn {char!r} for {file} does not fit its cell")
        bits = tuple(int(row.replace(".", "0").replace("#", "1"), 2) for row in rows)
        glyphs[ord(char)] = Glyph(width, 0, ascent, descent, width, bits)
    return glyphs


def round_loops(glyph: Glyph) -> Glyph:
    """``glyph`` with each ㅇ-shaped loop drawn rounder; other strokes untouched.

    A loop is a rectangle at least 5x5 pixels whose four edges are inked between its
    corners, whose four corner pixels are paper and whose inside is empty; strokes may
    touch it from outside (the bar of ㅔ does). Its corners are cut one pixel deeper:
    each corner's two edge pixels go and the diagonal pixel inside them is inked, so the
    outline stays closed. A ㅁ has an inked corner and is never matched. (Squaring ㅁ's
    one cut corner instead measured no better, and a 4-pixel-wide ㅇ, as in Gulim 10's
    에, cannot be drawn rounder.)
    """
    width, rows = glyph.width, list(glyph.rows)
    loops = list(_loops(rows, width))
    if not loops:
        return glyph
    for x0, y0, x1, y1 in loops:
        for x, y, dx, dy in ((x0, y0, 1, 1), (x1, y0, -1, 1), (x0, y1, 1, -1), (x1, y1, -1, -1)):
            rows[y] &= ~_bit(x + dx, width)
            rows[y + dy] &= ~_bit(x, width)
            rows[y + dy] |= _bit(x + dx, width)
    return Glyph(glyph.advance, glyph.left, glyph.ascent, glyph.descent, width, tuple(rows))


def _bit(x: int, width: int) -> int:
    return 1 << (width - 1 - x)


def _loops(rows: list[int], width: int) -> Iterator[tuple[int, int, int, int]]:
    """(x0, y0, x1, y1) of each loop ``round_loops`` rounds, corners included."""
    for y0 in range(len(rows) - 4):
        for x0 in range(width - 4):
            corner, edge = _bit(x0, width), _bit(x0 + 1, width)
            if rows[y0] & corner or not (rows[y0] & edge and rows[y0 + 1] & corner):
                continue
            for x1 in range(x0 + 4, width):
                top = ((1 << (x1 - x0 - 1)) - 1) << (width - x1)  # columns x0+1 .. x1-1
                if rows[y0] & top != top:
                    break  # the top edge ended: wider loops fail too
                sides = corner | _bit(x1, width)
                if rows[y0] & sides:
                    continue  # an inked corner
                for y1 in range(y0 + 4, len(rows)):
                    if rows[y1 - 1] & sides != sides or rows[y1 - 1] & top:
                        break  # a side ended or the inside is inked
                    if rows[y1] & top == top and not rows[y1] & sides:
                        yield x0, y0, x1, y1
