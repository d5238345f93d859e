"""What a request bills under Anthropic's prompt caching, for the gateway benchmark.

Anthropic caches the prompt prefix (tools, then system, then messages) up to each
``cache_control`` breakpoint. A later request whose prefix matches a cached one reads
those tokens at 0.1× the input price; the tokens from there to its last breakpoint are
written to the cache at 1.25×; what follows the last breakpoint is billed at 1.0×. A hit
is looked for up to 20 blocks before each breakpoint. Pure: the token count is the
loopback upstream's own (``conversations.providers.fake``), per content block.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from conversations.providers.fake import _count_anthropic_blocks, count_text_tokens

UNCACHED, WRITE, READ = 1.0, 1.25, 0.1
LOOKBACK = 20


_TOKENS: dict[str, int] = {}


def _tokens(ident: str, block: Mapping[str, Any]) -> int:
    found = _TOKENS.get(ident)
    if found is None:
        found = _TOKENS[ident] = _count_anthropic_blocks([block], "claude")
    return found


def _blocks(body: Mapping[str, Any]) -> list[tuple[str, int, bool]]:
    """(identity, tokens, breakpoint) per cacheable block, in cache order."""
    out: list[tuple[str, int, bool]] = []
    for tool in body.get("tools") or []:
        text = json.dumps(tool, sort_keys=True)
        out.append((text, count_text_tokens(text), "cache_control" in tool))
    system = body.get("system") or []
    if isinstance(system, str):
        system = [{"type": "text", "text": system}]
    for block in system:
        out.append((json.dumps(block, sort_keys=True), count_text_tokens(block.get("text", "")),
                    "cache_control" in block))  # fmt: skip
    for message in body.get("messages") or []:
        content = message.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        for block in content or []:
            ident = message["role"] + json.dumps(
                {k: v for k, v in block.items() if k != "cache_control"}, sort_keys=True
            )
            out.append((ident, _tokens(ident, block), "cache_control" in block))
    return out


@dataclass
class Bill:
    uncached: int = 0
    written: int = 0
    read: int = 0

    @property
    def billed(self) -> float:
        return self.uncached * UNCACHED + self.written * WRITE + self.read * READ

    @property
    def total(self) -> int:
        return self.uncached + self.written + self.read


@dataclass
class PromptCache:
    """The provider's cache across the requests of one session (no expiry: a replay
    runs well within the five-minute lifetime)."""

    entries: set[str] = field(default_factory=set)

    def bill(self, body: Mapping[str, Any]) -> Bill:
        blocks = _blocks(body)
        hashes: list[str] = []
        running = hashlib.sha256()
        for ident, _, _ in blocks:
            running.update(ident.encode())
            hashes.append(running.copy().hexdigest())
        breakpoints = [i for i, (_, _, mark) in enumerate(blocks) if mark]
        hit = -1
        for point in breakpoints:
            for j in range(point, max(-1, point - LOOKBACK), -1):
                if hashes[j] in self.entries:
                    hit = max(hit, j)
                    break
        last = breakpoints[-1] if breakpoints else -1
        tokens = [t for _, t, _ in blocks]
        bill = Bill(
            read=sum(tokens[: hit + 1]),
            written=sum(tokens[hit + 1 : last + 1]) if last > hit else 0,
            uncached=sum(tokens[max(hit, last) + 1 :]),
        )
        self.entries.update(hashes[p] for p in breakpoints)
        return bill


def session_bill(bodies: Iterable[Mapping[str, Any]]) -> Bill:
    cache = PromptCache()
    total = Bill()
    for body in bodies:
        bill = cache.bill(body)
        total.uncached += bill.uncached
        total.written += bill.written
        total.read += bill.read
    return total
