"""Text token counts for the compaction bench with real tokenizers, offline.

- OpenAI's ``o200k_base`` (GPT-4o and later) and ``cl100k_base`` (GPT-4): their tables
  ship inside the ``bpe-openai`` wheel (a dev dependency).
- ``claude_legacy``: Anthropic's legacy public Claude tokenizer (``@anthropic-ai/tokenizer``
  on npm, MIT; Claude 2's). ``make harness`` installs the package; its table is read from
  there and run by ``tiktoken`` (a dev dependency), the engine that package uses too.

Nothing is downloaded at run time. Claude's current tokenizer is not public; these
bracket it. Whatever is missing is left out of the counts (and the bench says which it
used); without any, the counts are None and the bench falls back to Arbor's estimate.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import unicodedata
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ENCODINGS = ("o200k_base", "cl100k_base")
CLAUDE = "claude_legacy"
_HARNESS = Path(
    os.environ.get("ARBOR_HARNESS_DIR", Path(__file__).resolve().parents[1] / "var" / "harness")
)
CLAUDE_TABLE = _HARNESS / "node_modules" / "@anthropic-ai" / "tokenizer" / "claude.json"


@functools.cache
def _encoding(name: str) -> Any:
    import bpe_openai

    return bpe_openai.get_encoding(name)


@functools.cache
def _claude() -> Any:
    """The legacy Claude tokenizer, or None when its table or engine is not installed."""
    try:
        import tiktoken
    except ImportError:
        return None
    try:
        table = json.loads(CLAUDE_TABLE.read_text(encoding="utf-8"))
    except OSError:
        return None
    # The table's ranks are lines of "<label> <first rank> <token> <token> …", each token
    # base64 and ranked one after the one before it.
    ranks: dict[bytes, int] = {}
    for line in table["bpe_ranks"].split("\n"):
        if not line:
            continue
        _, first, *tokens = line.split(" ")
        for offset, token in enumerate(tokens):
            ranks[base64.b64decode(token)] = int(first) + offset
    return tiktoken.Encoding(
        CLAUDE,
        pat_str=table["pat_str"],
        mergeable_ranks=ranks,
        special_tokens=table["special_tokens"],
    )


def available() -> bool:
    try:
        _encoding(ENCODINGS[0])
    except (ImportError, RuntimeError, OSError):
        return False
    return True


def names() -> list[str]:
    """The tokenizers ``count`` reports, in its order."""
    if not available():
        return []
    return [*ENCODINGS, CLAUDE] if _claude() is not None else list(ENCODINGS)


def claude_count(text: str) -> int:
    """Tokens of ``text`` by the legacy Claude tokenizer, which counts its NFKC form (as
    the package's ``countTokens`` does; unlike it, text that looks like one of its
    special tokens is counted as text, as ``count`` does for every tokenizer)."""
    return len(_claude().encode_ordinary(unicodedata.normalize("NFKC", text)))


def count(texts: Iterable[str]) -> dict[str, int] | None:
    """Tokens of ``texts`` (each encoded on its own, as messages are) per tokenizer; text
    that looks like a special token is counted as text. None without the tokenizers."""
    if not available():
        return None
    items = list(texts)
    counted = {
        name: sum(len(_encoding(name).encode_ordinary(text)) for text in items)
        for name in ENCODINGS
    }
    if _claude() is not None:
        counted[CLAUDE] = sum(claude_count(text) for text in items)
    return counted
