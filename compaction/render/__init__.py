"""Snapshot pages: archived text drawn as packed bitmap pages (DESIGN.md §5, Snapshot).

Pure module, no Django imports: the ladder calls ``render_pages`` on the middle of a
context view and may cache the pages under ``cache_key``.

- ``pcf``: reads the shipped X11 PCF bitmap fonts (``compaction/fonts``).
- ``atlas``: the font fallback chain and each glyph pre-cut as pixel columns.
- ``profiles``: page size per billing rule, fonts per density, request limits.
- ``engine``: layout (inline headers, ↵ ▸ marks, wrapping), drawing, PNG encoding.
- ``ocr``: tesseract reading and character error rate, for the audit and the bench.
"""

from __future__ import annotations

from compaction.render.atlas import LEGEND
from compaction.render.engine import (
    RENDERER_VERSION,
    RenderedPage,
    Renderer,
    RenderResult,
    Segment,
    SegmentLike,
    cache_key,
    readable,
    render_pages,
)
from compaction.render.ocr import cer, ocr_cer, ocr_page, plain_cer, tesseract_available
from compaction.render.profiles import (
    DENSITIES,
    REQUEST_LIMITS,
    PageProfile,
    RequestLimits,
    fits_unscaled,
    page_profile,
)

__all__ = [
    "DENSITIES",
    "LEGEND",
    "RENDERER_VERSION",
    "REQUEST_LIMITS",
    "PageProfile",
    "RenderResult",
    "RenderedPage",
    "Renderer",
    "RequestLimits",
    "Segment",
    "SegmentLike",
    "cache_key",
    "cer",
    "fits_unscaled",
    "ocr_cer",
    "ocr_page",
    "page_profile",
    "plain_cer",
    "readable",
    "render_pages",
    "tesseract_available",
]
