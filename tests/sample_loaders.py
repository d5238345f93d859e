"""The third-party samples (``../shared/samples``): where they are, the one way a test
says it needs them, and the real sample sessions for the compaction tests; and a
density-model fake of the snapshot renderer.

The samples sit beside the repository, not in it: a fresh clone has none. A test that
reads them is marked ``@requires_samples`` (the pytest mark ``samples``; root conftest.py
acts on it before the test or its class is set up) or calls ``samples_dir()`` first.
Without the folder such a test is skipped, every one with the same reason, so the run's
summary names it once; under ``CI=true`` it fails instead, naming the missing folder.
Everything else is tested with data the project makes itself (tests/data, generated).

The samples are read by ``compaction.bench_samples`` (Arbor's own importers, no
database), the one reader the ladder bench uses too; the names are re-exported here so
the tests keep one import. ``DensityRenderer`` is a stand-in for compaction/render.py
with the same page size and billing, cheap and deterministic.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from compaction.bench_samples import (
    CLAUDE_CODE_DIR,
    PI_SAMPLE,
    SAMPLES,
    Sample,
    load_claude_code,
    load_pi,
    load_samples,
)
from conversations.providers.billing import image_tokens

__all__ = [
    "CLAUDE_CODE_DIR",
    "PI_SAMPLE",
    "SAMPLES",
    "SAMPLES_ABSENT",
    "DensityRenderer",
    "FakePage",
    "FakeRenderResult",
    "Sample",
    "load_claude_code",
    "load_pi",
    "load_samples",
    "require_samples",
    "requires_samples",
    "samples_dir",
    "samples_present",
]


# --- the third-party samples -------------------------------------------------------------

# The one reason every sample-dependent test is skipped with (pytest folds equal skips
# from one place into one summary line).
SAMPLES_ABSENT = (
    f"needs the third-party samples in ../shared/samples, absent here ({SAMPLES}); "
    "see README's Testing section (CI=true fails instead of skipping)"
)

#: Marks a test, a class or a module (``pytestmark = requires_samples``) as reading the
#: samples: conftest.py skips it (fails it under CI=true) before setting it up when they
#: are absent. Parametrized tests over the samples keep one placeholder case then.
requires_samples = pytest.mark.samples


def samples_present() -> bool:
    return SAMPLES.is_dir()


def require_samples() -> None:
    """Skip the calling test when the samples folder is absent; under ``CI=true`` fail it
    instead, naming the folder (CI has it: its absence is a broken checkout)."""
    if SAMPLES.is_dir():
        return
    if os.environ.get("CI") == "true":
        pytest.fail(
            f"the third-party samples folder {SAMPLES} (../shared/samples beside the "
            "repository, or ARBOR_SAMPLES) is missing: under CI=true the tests that read "
            "it fail instead of skipping",
            pytrace=False,
        )
    pytest.skip(SAMPLES_ABSENT)


def samples_dir() -> Path:
    """The samples folder, for a test that reads it (skipped or failed as
    ``require_samples`` says when it is absent)."""
    require_samples()
    return SAMPLES


# --- a density-model fake of compaction/render.py ---------------------------------------

PAGE_PX = 1092
CELL_W, CELL_H = 6, 13
COLS, ROWS = PAGE_PX // CELL_W, PAGE_PX // CELL_H  # 182 x 84 = 15,288 cells a page


@dataclass(frozen=True)
class FakePage:
    png: bytes
    width: int
    height: int
    billed_tokens: int
    chars: int
    text: str
    first_message_id: str
    last_message_id: str


@dataclass(frozen=True)
class FakeRenderResult:
    pages: list[FakePage]
    missing_glyphs: int
    substituted: int
    settings: dict[str, Any]


def _cells(char: str) -> int:
    # Unifont draws Hangul and CJK two cells wide.
    return 2 if "\u1100" <= char <= "\u115f" or "\u2e80" <= char <= "\uffdc" else 1


class DensityRenderer:
    """Packs text the way DESIGN.md §5 specifies the real renderer: a 1092x1092 page of
    6x13 px cells (182 columns x 84 rows = 15,288 cells), text flowing from message to
    message with a newline drawn as a one-cell mark and each message opened by an inline
    ``⟦role id⟧`` header (Hangul/CJK take two cells). The PNG is a stand-in (a hash of
    the page text and settings), so pages are deterministic and cheap. Every call is
    recorded in ``calls``."""

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []

    def __call__(
        self,
        segments: Sequence[Any],
        *,
        rule: str = "claude",
        density: str = "default",
        max_pages: int | None = None,
    ) -> FakeRenderResult:
        self.calls.append(list(segments))
        capacity = COLS * ROWS
        pages: list[FakePage] = []
        chars: list[str] = []
        ids: list[str] = []
        used = 0

        def flush() -> None:
            nonlocal used
            text = "".join(chars)
            digest = hashlib.sha256(f"{rule}|{density}|{text}".encode()).digest()
            pages.append(
                FakePage(
                    png=b"\x89PNG-fake" + digest,
                    width=PAGE_PX,
                    height=PAGE_PX,
                    billed_tokens=image_tokens(rule, PAGE_PX, PAGE_PX),
                    chars=len(text),
                    text=text,
                    first_message_id=ids[0],
                    last_message_id=ids[-1],
                )
            )
            chars.clear()
            ids.clear()
            used = 0

        for segment in segments:
            flowed = f"⟦{segment.role} {segment.message_id}⟧ " + segment.text.replace("\n", "↵")
            for char in flowed:
                width = _cells(char)
                if used + width > capacity:
                    flush()
                if not ids or ids[-1] != segment.message_id:
                    ids.append(segment.message_id)
                chars.append(char)
                used += width
        if chars:
            flush()
        if max_pages is not None:
            pages = pages[:max_pages]
        return FakeRenderResult(pages, 0, 0, {"rule": rule, "density": density, "fake": True})
