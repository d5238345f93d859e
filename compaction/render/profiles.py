"""Page sizes, fonts and request limits per billing rule: the one table the renderer reads.

Token costs come from ``conversations.providers.billing`` (no Django imports there); this
module only chooses sizes that each rule bills without resampling, because a provider
that scales a page down smears 1-pixel glyph strokes into grey mush.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from conversations.providers.billing import BILLING_RULES, image_tokens

FONT_DIR = Path(__file__).resolve().parent.parent / "fonts"

MB = 1024 * 1024


@dataclass(frozen=True)
class RequestLimits:
    """Per-request limits a caller must check before sending pages (provider docs, 2025)."""

    max_image_bytes: int  # one encoded image
    max_edge_px: int  # longest side accepted at all
    max_images: int  # images in one request
    max_request_bytes: int  # whole request body (base64 inflates PNG bytes by 4/3)
    many_images: int | None = None  # above this many images ...
    max_edge_px_many: int | None = None  # ... the edge limit drops to this

    def edge_limit(self, image_count: int) -> int:
        if self.many_images is not None and image_count > self.many_images:
            assert self.max_edge_px_many is not None
            return self.max_edge_px_many
        return self.max_edge_px


REQUEST_LIMITS: dict[str, RequestLimits] = {
    # Anthropic: 5 MB per image; 8000 px, or 2000 px when a request has more than 20
    # images; 100 images (models with a 200k window) and 32 MB per request.
    "claude": RequestLimits(5 * MB, 8000, 100, 32 * MB, many_images=20, max_edge_px_many=2000),
    # OpenAI: 20 MB per image, 500 images and 50 MB of image bytes per request.
    "openai-tile": RequestLimits(20 * MB, 8000, 500, 50 * MB),
    "openai-patch": RequestLimits(20 * MB, 8000, 500, 50 * MB),
    # Gemini: 7 MB per inline image (Vertex), 3000 images, 20 MB inline request (API).
    "gemini": RequestLimits(7 * MB, 8000, 3000, 20 * MB),
}


def fits_unscaled(rule: str, width: int, height: int) -> bool:
    """True when ``rule`` bills (and shows the model) the image at its own pixel size."""
    if rule == "claude":
        return max(width, height) <= 1568 and width * height <= 1_150_000
    if rule == "openai-tile":
        return max(width, height) <= 2048 and min(width, height) <= 768
    if rule == "openai-patch":
        return math.ceil(width / 32) * math.ceil(height / 32) <= 1536
    if rule == "gemini":
        # Tiles are 768x768 crops; a page of whole tiles is cut, never scaled.
        return (width <= 384 and height <= 384) or (width % 768 == 0 and height % 768 == 0)
    raise ValueError(f"unknown image billing rule {rule!r}; expected one of {list(BILLING_RULES)}")


@dataclass(frozen=True)
class _PageShape:
    width: int
    height: int  # a full page
    step: int  # a short last page is cut to a multiple of this height
    band: int | None  # no text row straddles a multiple of this (provider tile edge)


# Each full page fills its rule's billing unit exactly:
# - claude: 34x43 patches of 28 px = 952x1204 = 1.146 MP, the most patches under 1.15 MP
#   (1092x1092 is ~1.19 MP and would be scaled); 1462 tokens, 784 px per token.
# - openai-tile: one 512-px tile wide and four high = 85 + 4*170 = 765 tokens, 1371 px per
#   token; 768x2048 costs 1445 tokens for 1088 px per token, so the narrow page wins.
# - openai-patch: 32x48 patches = 1536, the cap, 1024 px per token.
# - gemini: one 768-px tile wide, two high: 516 tokens, 2286 px per token.
_SHAPES: dict[str, _PageShape] = {
    "claude": _PageShape(952, 1204, 28, None),
    "openai-tile": _PageShape(512, 2048, 512, 512),
    "openai-patch": _PageShape(1024, 1536, 32, None),
    "gemini": _PageShape(768, 1536, 768, 768),
}


@dataclass(frozen=True)
class FontFace:
    """One font in a fallback chain and the blank rows added above its glyphs."""

    file: str
    lead: int = 0
    # A font indexed by a legacy two-byte character set (Baekmuk's KS X 1001) names the
    # Python codec that maps a code point to its bytes (``atlas.legacy_code``).
    codec: str | None = None
    # When set, the font is used only for code points in these ranges.
    only: tuple[range, ...] = ()
    # Code points whose glyphs get their ㅇ loops drawn rounder (redrawn.round_loops).
    rounded: tuple[range, ...] = ()


@dataclass(frozen=True)
class Density:
    name: str
    faces: tuple[FontFace, ...]  # first font with a glyph wins


# ASCII first (Schumacher Clean: taller glyphs than misc-fixed at the same width, and
# the most legible 5-px font we measured), then misc-fixed 5x8 for the rest of Latin,
# Greek, Cyrillic and symbols, then efont 12 px (KS X 1001 Hangul from Baekmuk gulim12,
# shinonome kanji), then GNU Unifont for the rest of the BMP (16 px; a row holding such a
# glyph grows to fit). ``lead`` puts every font's baseline on the same pixel row.
# efont's 10-px set is not used: its CJK part has unclear provenance.
# Density "dense" takes Hangul first from Baekmuk Gulim 10 px (the design of efont's
# 12-px Hangul, two pixels smaller): a syllable is 10x10, two Latin cells, where the
# 12-px one is 2.4 cells and makes its row taller. Korean costs 23% fewer image tokens;
# tesseract misreads more of it (bench_compaction prints both), so "default" keeps 12 px.
# Hangul syllables and the compatibility jamo (ㅇ U+3147 among them).
HANGUL = (range(0xAC00, 0xD7A4), range(0x3131, 0x318F))
_CJK = FontFace("f12.pcf.gz", rounded=HANGUL)
_UNIFONT = FontFace("unifont.pcf.gz")
DENSITIES: dict[str, Density] = {
    # 5x10 cells, clR5x10 at its own pitch (its top row is blank, so descenders keep a
    # pixel from the next row's capitals): 190 columns x 120 rows on a Claude page. An
    # extra blank row (5x11) read no better: plain CER on body rows 8.1% against 8.05%
    # over ten sample pages, for 10% fewer characters a page.
    "default": Density(
        "default",
        (FontFace("clR5x10.pcf.gz"), FontFace("5x8.pcf.gz", lead=1), _CJK, _UNIFONT),
    ),
    # 5x9 cells (clR5x8 + 1 blank row): 11% more characters per page and smaller
    # glyphs, with about twice the OCR errors (bench_compaction prints both); for
    # cheap-pixel rules (Gemini tiles) or tight budgets.
    "dense": Density(
        "dense",
        (
            FontFace("clR5x8.pcf.gz", lead=1),
            FontFace("5x8.pcf.gz", lead=1),
            FontFace("gulim10.pcf.gz", codec="euc_kr", only=HANGUL, rounded=HANGUL),
            _CJK,
            _UNIFONT,
        ),
    ),
}


@dataclass(frozen=True)
class PageProfile:
    rule: str
    density: str
    width: int
    height: int  # of a full page; the last page may be shorter
    height_step: int
    band: int | None
    cell_width: int  # of a Latin character
    row_height: int  # of a Latin-only row; rows with CJK or Unifont glyphs are taller
    fonts: tuple[str, ...]
    full_page_tokens: int

    @property
    def columns(self) -> int:
        return self.width // self.cell_width


def page_profile(rule: str, density: str = "default") -> PageProfile:
    """The page size, cell size and fonts used for ``rule`` at ``density``."""
    if rule not in _SHAPES:
        raise ValueError(f"unknown image billing rule {rule!r}; expected one of {list(_SHAPES)}")
    if density not in DENSITIES:
        raise ValueError(f"unknown density {density!r}; expected one of {list(DENSITIES)}")
    shape = _SHAPES[rule]
    from compaction.render.atlas import font_stack  # fonts are parsed once per process

    stack = font_stack(DENSITIES[density])
    return PageProfile(
        rule=rule,
        density=density,
        width=shape.width,
        height=shape.height,
        height_step=shape.step,
        band=shape.band,
        cell_width=stack.cell_width,
        row_height=stack.base_box.height,
        fonts=tuple(face.file for face in DENSITIES[density].faces),
        full_page_tokens=image_tokens(rule, shape.width, shape.height),
    )
