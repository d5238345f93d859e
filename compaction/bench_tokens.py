"""Text token counts for the compaction bench with real tokenizers, offline.

OpenAI's ``o200k_base`` (GPT-4o and later) and ``cl100k_base`` (GPT-4) tables ship inside
the ``bpe-openai`` wheel (a dev dependency), so nothing is downloaded at run time. Claude's
current tokenizer is not public; these two bracket it on English. Without the package the
counts are None and the bench says so, falling back to Arbor's own estimate.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

ENCODINGS = ("o200k_base", "cl100k_base")


@functools.cache
def _encoding(name: str) -> Any:
    import bpe_openai

    return bpe_openai.get_encoding(name)


def available() -> bool:
    try:
        _encoding(ENCODINGS[0])
    except (ImportError, RuntimeError, OSError):
        return False
    return True


def count(texts: Iterable[str]) -> dict[str, int] | None:
    """Tokens of ``texts`` (each encoded on its own, as messages are) per encoding; text
    that looks like a special token is counted as text. None without the tokenizers."""
    if not available():
        return None
    items = list(texts)
    return {
        name: sum(len(_encoding(name).encode_ordinary(text)) for text in items)
        for name in ENCODINGS
    }
