"""How providers bill an image in input tokens, by rule name.

Pure arithmetic on the pixel size. The fake provider bills with these; the compaction
estimator can use them too (the registry's ``image_billing`` names the rule).
"""

from __future__ import annotations

import math

BILLING_RULES = ("claude", "openai-tile", "openai-patch", "gemini")


def _fit(width: int, height: int, scale: float) -> tuple[int, int]:
    if scale >= 1:
        return width, height
    return max(1, math.floor(width * scale)), max(1, math.floor(height * scale))


def claude_tokens(width: int, height: int) -> int:
    # Claude scales an image down until the long edge is at most 1568 px and it has at
    # most ~1.15 megapixels, then bills one token per 28x28 patch.
    scale = min(1.0, 1568 / max(width, height), math.sqrt(1_150_000 / (width * height)))
    w, h = _fit(width, height, scale)
    return math.ceil(w / 28) * math.ceil(h / 28)


def openai_tile_tokens(width: int, height: int, *, base: int = 85, per_tile: int = 170) -> int:
    # GPT-4o / GPT-4.1 "high" detail: fit in 2048x2048, then shrink so the short side is
    # at most 768, then 170 tokens per 512x512 tile plus 85.
    w, h = _fit(width, height, min(1.0, 2048 / max(width, height)))
    w, h = _fit(w, h, min(1.0, 768 / min(w, h)))
    return base + per_tile * math.ceil(w / 512) * math.ceil(h / 512)


def openai_patch_tokens(width: int, height: int, *, max_patches: int = 1536) -> int:
    # GPT-4.1-mini/nano, o4-mini: one token per 32x32 patch, scaled down to at most 1536
    # patches.
    patches = math.ceil(width / 32) * math.ceil(height / 32)
    if patches <= max_patches:
        return patches
    scale = math.sqrt(max_patches * 32 * 32 / (width * height))
    w, h = _fit(width, height, scale)
    # Shrink a little more until the patch grid fits, as OpenAI does.
    while math.ceil(w / 32) * math.ceil(h / 32) > max_patches:
        w, h = _fit(w, h, 0.99)
    return math.ceil(w / 32) * math.ceil(h / 32)


def gemini_tokens(width: int, height: int) -> int:
    # Gemini: 258 tokens when both sides are at most 384 px, else 258 per 768x768 tile.
    if width <= 384 and height <= 384:
        return 258
    return 258 * math.ceil(width / 768) * math.ceil(height / 768)


def image_tokens(rule: str, width: int, height: int) -> int:
    """Input tokens an image of ``width`` x ``height`` costs under a billing rule."""
    if width <= 0 or height <= 0:
        raise ValueError(f"an image must have a positive size, got {width}x{height}")
    if rule == "claude":
        return claude_tokens(width, height)
    if rule == "openai-tile":
        return openai_tile_tokens(width, height)
    if rule == "openai-patch":
        return openai_patch_tokens(width, height)
    if rule == "gemini":
        return gemini_tokens(width, height)
    raise ValueError(f"unknown image billing rule {rule!r}; expected one of {list(BILLING_RULES)}")
