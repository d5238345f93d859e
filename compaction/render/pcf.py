"""A small reader for X11 PCF bitmap fonts (the format ``xfonts-*`` packages ship).

Pillow can read PCF only as a 256-glyph ``.pil`` font and FreeType only at the native
size with one call per string, so we read the tables ourselves: the encoding table gives
any BMP code point's glyph index in O(1), and a glyph's bitmap is decoded on first use.
Format reference: https://fontforge.org/docs/techref/pcf-format.html
"""

from __future__ import annotations

import gzip
import struct
import sys
from array import array
from dataclasses import dataclass
from pathlib import Path

_PCF_MAGIC = b"\x01fcp"
_PCF_ACCELERATORS = 1 << 1
_PCF_METRICS = 1 << 2
_PCF_BITMAPS = 1 << 3
_PCF_BDF_ENCODINGS = 1 << 5
_PCF_BDF_ACCELERATORS = 1 << 8

_GLYPH_PAD_MASK = 3
_BYTE_MASK = 1 << 2  # set: integers and bitmap bytes are most significant first
_BIT_MASK = 1 << 3  # set: the leftmost pixel is the most significant bit of a byte
_SCAN_UNIT_MASK = 3 << 4
_COMPRESSED_METRICS = 0x100
_NO_GLYPH = 0xFFFF

_REVERSE_BITS = bytes(int(f"{b:08b}"[::-1], 2) for b in range(256))


@dataclass(frozen=True, slots=True)
class Glyph:
    """One glyph: ``rows`` are bit masks, most significant bit = leftmost ink pixel."""

    advance: int
    left: int  # left side bearing: x of the first bitmap column in the cell
    ascent: int  # rows above the baseline
    descent: int  # rows below the baseline
    width: int  # bitmap width in pixels
    rows: tuple[int, ...]


class PcfFont:
    """Glyphs of one PCF font file, looked up by Unicode code point (BMP only)."""

    def __init__(self, path: Path) -> None:
        raw = path.read_bytes()
        self.path = path
        self._data = gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw
        if self._data[:4] != _PCF_MAGIC:
            raise ValueError(f"{path} is not a PCF font")
        (count,) = struct.unpack_from("<i", self._data, 4)
        self._tables: dict[int, int] = {}  # table type -> offset
        for i in range(count):
            kind, _fmt, _size, offset = struct.unpack_from("<iiii", self._data, 8 + 16 * i)
            self._tables[kind] = offset
        self._read_accelerators()
        self._read_metrics()
        self._read_bitmaps()
        self._read_encodings()
        self._glyphs: dict[int, Glyph | None] = {}

    def _table(self, kind: int) -> tuple[str, int, int]:
        offset = self._tables[kind]
        # Each table repeats its format; its byte-order bit governs the table's integers.
        (fmt,) = struct.unpack_from("<i", self._data, offset)
        return (">" if fmt & _BYTE_MASK else "<"), fmt, offset + 4

    def _int_array(self, code: str, endian: str, offset: int, count: int) -> array[int]:
        values = array(code)
        values.frombytes(self._data[offset : offset + values.itemsize * count])
        if (endian == ">") != (sys.byteorder == "big"):
            values.byteswap()
        return values

    def _read_accelerators(self) -> None:
        kind = _PCF_BDF_ACCELERATORS if _PCF_BDF_ACCELERATORS in self._tables else _PCF_ACCELERATORS
        endian, _fmt, pos = self._table(kind)
        # Eight one-byte flags, then font ascent, font descent and max overlap.
        self.ascent, self.descent = struct.unpack_from(endian + "ii", self._data, pos + 8)

    def _read_metrics(self) -> None:
        endian, fmt, pos = self._table(_PCF_METRICS)
        if fmt & _COMPRESSED_METRICS:
            (count,) = struct.unpack_from(endian + "H", self._data, pos)
            block = self._data[pos + 2 : pos + 2 + 5 * count]
            # Each field is stored as an unsigned byte offset by 0x80.
            self._metrics: list[tuple[int, int, int, int, int]] = [
                (block[i] - 128, block[i + 1] - 128, block[i + 2] - 128, block[i + 3] - 128,
                 block[i + 4] - 128)
                for i in range(0, 5 * count, 5)
            ]  # fmt: skip
        else:
            (count,) = struct.unpack_from(endian + "i", self._data, pos)
            self._metrics = [
                m[:5]
                for m in struct.iter_unpack(
                    endian + "hhhhhH", self._data[pos + 4 : pos + 4 + 12 * count]
                )
            ]

    def _read_bitmaps(self) -> None:
        endian, fmt, pos = self._table(_PCF_BITMAPS)
        (count,) = struct.unpack_from(endian + "i", self._data, pos)
        self._offsets = self._int_array("i", endian, pos + 4, count)
        pad_index = fmt & _GLYPH_PAD_MASK
        self._pad = 1 << pad_index
        self._scan_unit = 1 << ((fmt & _SCAN_UNIT_MASK) >> 4)
        self._msb_bytes = bool(fmt & _BYTE_MASK)
        self._msb_bits = bool(fmt & _BIT_MASK)
        self._bitmap_start = pos + 4 + 4 * count + 16

    def _read_encodings(self) -> None:
        endian, _fmt, pos = self._table(_PCF_BDF_ENCODINGS)
        min2, max2, min1, max1, _default = struct.unpack_from(endian + "hhhhh", self._data, pos)
        self._min2, self._max2, self._min1, self._max1 = min2, max2, min1, max1
        self._span2 = max2 - min2 + 1
        count = self._span2 * (max1 - min1 + 1)
        self._index = self._int_array("H", endian, pos + 10, count)

    def glyph_index(self, codepoint: int) -> int | None:
        byte1, byte2 = codepoint >> 8, codepoint & 0xFF
        if not (self._min1 <= byte1 <= self._max1 and self._min2 <= byte2 <= self._max2):
            return None
        index = self._index[(byte1 - self._min1) * self._span2 + byte2 - self._min2]
        return None if index == _NO_GLYPH else index

    def has(self, codepoint: int) -> bool:
        return self.glyph_index(codepoint) is not None

    def codepoints(self) -> list[int]:
        return [
            (b1 << 8) | b2
            for b1 in range(self._min1, self._max1 + 1)
            for b2 in range(self._min2, self._max2 + 1)
            if self._index[(b1 - self._min1) * self._span2 + b2 - self._min2] != _NO_GLYPH
        ]

    def glyph(self, codepoint: int) -> Glyph | None:
        if codepoint in self._glyphs:
            return self._glyphs[codepoint]
        index = self.glyph_index(codepoint)
        glyph = None if index is None else self._decode(index)
        self._glyphs[codepoint] = glyph
        return glyph

    def _decode(self, index: int) -> Glyph:
        left, right, advance, ascent, descent = self._metrics[index]
        width, height = right - left, ascent + descent
        stride = -(-((width + 7) // 8) // self._pad) * self._pad
        start = self._bitmap_start + self._offsets[index]
        bitmap = bytearray(self._data[start : start + stride * height])
        if self._msb_bytes != self._msb_bits and self._scan_unit > 1:
            # Bytes are stored in the bit order's opposite within each scan unit.
            unit = self._scan_unit
            for i in range(0, len(bitmap), unit):
                bitmap[i : i + unit] = bitmap[i : i + unit][::-1]
        if not self._msb_bits:
            bitmap = bytearray(bitmap.translate(_REVERSE_BITS))
        rows = []
        used = (width + 7) // 8
        for y in range(height):
            value = int.from_bytes(bitmap[y * stride : y * stride + used], "big")
            rows.append(value >> (used * 8 - width) if width else 0)
        return Glyph(advance, left, ascent, descent, width, tuple(rows))
