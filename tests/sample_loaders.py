"""Small loaders that turn the real sample sessions into Arbor-shaped message lists, and a
density-model fake of the snapshot renderer. For the compaction tests and bench only.

The samples are read in place from ``../shared/samples`` (never copied into the repo).
These loaders keep just what the ladder needs; the real importer is a separate piece of
work and handles more (branches, sidechains as conversations, compaction records).

Arbor shape: ``{"id", "role" (system/user/assistant/tool), "parts", "metadata"}`` with
parts ``text``, ``image`` (blob = sha256 of the bytes, mime, width, height),
``tool_call``, ``tool_result`` (in a ``tool`` message right after its call) and
``thinking``. Measured usage becomes ``metadata.usage.input_tokens`` (the whole prompt:
uncached + cache read + cache write).

- **pi** (session format v1): ``message`` records with role user / assistant /
  toolResult and content blocks text / toolCall / image / thinking. Messages get ids
  ``pi-<line>-<n>``. One line of the file holds two records with no newline; both are
  kept. ``bashExecution`` records (a shell command the user ran outside the model) are
  skipped. Tool calls that never got a result (aborted steps) are left out, as
  conversations/resume.py does, so the list is a valid request.
- **Claude Code**: ``user``/``assistant`` records linked by ``parentUuid`` (one file may
  hold several chains: Task sub-agents are written as sidechains). A chain is read from
  a leaf back to its root, following ``logicalParentUuid`` across a compaction boundary.
  Assistant records that share ``message.id`` are one API message and are merged.
  ``tool_result`` blocks in user records become ``tool`` messages.
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conversations.providers.billing import image_tokens

SAMPLES = Path(__file__).resolve().parents[2] / "shared" / "samples"
PI_SAMPLE = SAMPLES / "pi" / "pi-mono__compact.jsonl"
CLAUDE_CODE_DIR = SAMPLES / "claude-code"

Message = dict[str, Any]


@dataclass
class Sample:
    name: str
    messages: list[Message]
    blob_sizes: dict[str, int] = field(default_factory=dict)
    # Index (into messages) of the first message after each compaction the tool made.
    compactions: list[int] = field(default_factory=list)
    dropped_calls: int = 0


def _png_size(data: bytes) -> tuple[int, int]:
    if data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) >= 24:
        width, height = struct.unpack(">II", data[16:24])
        return int(width), int(height)
    return 0, 0


def _image_part(data_b64: str, mime: str, blob_sizes: dict[str, int]) -> dict[str, Any]:
    raw = base64.b64decode(data_b64)
    sha = hashlib.sha256(raw).hexdigest()
    blob_sizes[sha] = len(raw)
    width, height = _png_size(raw)
    return {"type": "image", "blob": sha, "mime": mime, "width": width, "height": height}


def _records(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Every JSON record of a JSONL file, even two on one line (pi's last line)."""
    decoder = json.JSONDecoder()
    with path.open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle):
            text, pos = line.strip(), 0
            while pos < len(text):
                record, pos = decoder.raw_decode(text, pos)
                while pos < len(text) and text[pos].isspace():
                    pos += 1
                yield lineno, record


def _drop_unanswered_calls(messages: list[Message]) -> tuple[list[Message], int]:
    answered = {
        p["call_id"]
        for m in messages
        if m["role"] == "tool"
        for p in m["parts"]
        if p["type"] == "tool_result"
    }
    out: list[Message] = []
    dropped = 0
    for m in messages:
        if m["role"] == "assistant":
            parts = [p for p in m["parts"] if p["type"] != "tool_call" or p["id"] in answered]
            dropped += len(m["parts"]) - len(parts)
            if not parts:
                continue
            m = {**m, "parts": parts}
        out.append(m)
    return out, dropped


def load_pi(path: Path = PI_SAMPLE) -> Sample:
    messages: list[Message] = []
    blob_sizes: dict[str, int] = {}
    compactions: list[int] = []
    for n, (lineno, record) in enumerate(_records(path)):
        if record.get("type") == "compaction":
            compactions.append(len(messages))
            continue
        if record.get("type") != "message":
            continue
        raw = record["message"]
        role = raw.get("role")
        mid = f"pi-{lineno}-{n}"
        content = raw.get("content") or []
        if role == "toolResult":
            inner: list[dict[str, Any]] = []
            for block in content:
                if block.get("type") == "text":
                    inner.append({"type": "text", "text": block.get("text", "")})
                elif block.get("type") == "image":
                    inner.append(_image_part(block["data"], block["mimeType"], blob_sizes))
            part = {
                "type": "tool_result",
                "call_id": raw["toolCallId"],
                "is_error": bool(raw.get("isError")),
                "parts": inner,
            }
            messages.append({"id": mid, "role": "tool", "parts": [part], "metadata": {}})
            continue
        if role not in ("user", "assistant"):
            continue  # bashExecution: a command the user ran, not part of the prompt
        parts: list[dict[str, Any]] = []
        for block in content:
            kind = block.get("type")
            if kind == "text":
                parts.append({"type": "text", "text": block.get("text", "")})
            elif kind == "image":
                parts.append(_image_part(block["data"], block["mimeType"], blob_sizes))
            elif kind == "toolCall":
                parts.append(
                    {
                        "type": "tool_call",
                        "id": block["id"],
                        "name": block["name"],
                        "arguments": block.get("arguments") or {},
                    }
                )
            elif kind == "thinking":
                parts.append({"type": "thinking", "text": block.get("thinking", "")})
        metadata: dict[str, Any] = {}
        usage = raw.get("usage")
        if role == "assistant" and usage:
            prompt = (
                int(usage.get("input", 0))
                + int(usage.get("cacheRead", 0))
                + int(usage.get("cacheWrite", 0))
            )
            metadata["usage"] = {
                "input_tokens": prompt,
                "output_tokens": int(usage.get("output", 0)),
            }
        if parts:
            messages.append({"id": mid, "role": role, "parts": parts, "metadata": metadata})
    messages, dropped = _drop_unanswered_calls(messages)
    return Sample("pi", messages, blob_sizes, compactions, dropped)


def claude_code_chains(path: Path) -> dict[str, list[dict[str, Any]]]:
    """Every chain of a Claude Code file, root first, keyed by its leaf uuid."""
    records = [r for _, r in _records(path) if "uuid" in r]
    by_uuid = {r["uuid"]: r for r in records}
    has_child = {r.get("parentUuid") for r in records} | {
        r.get("logicalParentUuid") for r in records
    }
    chains: dict[str, list[dict[str, Any]]] = {}
    for leaf in (r["uuid"] for r in records if r["uuid"] not in has_child):
        chain: list[dict[str, Any]] = []
        uuid: str | None = leaf
        while uuid and uuid in by_uuid:
            record = by_uuid[uuid]
            chain.append(record)
            uuid = record.get("parentUuid") or record.get("logicalParentUuid")
        chains[leaf] = chain[::-1]
    return chains


def _chain_chars(chain: list[dict[str, Any]]) -> int:
    return sum(len(json.dumps(r.get("message"))) for r in chain)


def _cc_blocks(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    return list(content or [])


def load_claude_code(path: Path, *, leaf: str | None = None, name: str | None = None) -> Sample:
    """One chain of a Claude Code session: ``leaf``'s, or the one with the most text."""
    chains = claude_code_chains(path)
    if leaf is None:
        leaf = max(chains, key=lambda k: _chain_chars(chains[k]))
    messages: list[Message] = []
    blob_sizes: dict[str, int] = {}
    last_api_id: str | None = None
    for record in chains[leaf]:
        kind = record.get("type")
        body = record.get("message")
        if kind not in ("user", "assistant") or not isinstance(body, dict):
            last_api_id = None
            continue
        if kind == "assistant":
            parts: list[dict[str, Any]] = []
            for block in _cc_blocks(body.get("content")):
                if block.get("type") == "text":
                    parts.append({"type": "text", "text": block.get("text", "")})
                elif block.get("type") == "tool_use":
                    parts.append(
                        {
                            "type": "tool_call",
                            "id": block["id"],
                            "name": block["name"],
                            "arguments": block.get("input") or {},
                        }
                    )
                elif block.get("type") == "thinking":
                    part: dict[str, Any] = {"type": "thinking", "text": block.get("thinking", "")}
                    if block.get("signature"):
                        part["signature"] = block["signature"]
                    parts.append(part)
            usage = body.get("usage") or {}
            prompt = sum(
                int(usage.get(k) or 0)
                for k in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
            )
            metadata = {"usage": {"input_tokens": prompt}} if prompt else {}
            api_id = body.get("id")
            if api_id and api_id == last_api_id and messages:
                # One API message written as several records: merge them.
                merged = messages[-1]
                messages[-1] = {**merged, "parts": merged["parts"] + parts}
            elif parts:
                messages.append(
                    {
                        "id": record["uuid"],
                        "role": "assistant",
                        "parts": parts,
                        "metadata": metadata,
                    }
                )
            last_api_id = api_id
            continue
        last_api_id = None
        results: list[dict[str, Any]] = []
        texts: list[dict[str, Any]] = []
        for block in _cc_blocks(body.get("content")):
            if block.get("type") == "tool_result":
                inner: list[dict[str, Any]] = []
                for item in _cc_blocks(block.get("content")):
                    if item.get("type") == "text":
                        inner.append({"type": "text", "text": item.get("text", "")})
                    elif item.get("type") == "image":
                        source = item.get("source") or {}
                        inner.append(_image_part(source["data"], source["media_type"], blob_sizes))
                results.append(
                    {
                        "type": "tool_result",
                        "call_id": block["tool_use_id"],
                        "is_error": bool(block.get("is_error")),
                        "parts": inner,
                    }
                )
            elif block.get("type") == "text":
                texts.append({"type": "text", "text": block.get("text", "")})
            elif block.get("type") == "image":
                source = block.get("source") or {}
                texts.append(_image_part(source["data"], source["media_type"], blob_sizes))
        if results:
            messages.append(
                {"id": record["uuid"], "role": "tool", "parts": results, "metadata": {}}
            )
        if texts:
            mid = record["uuid"] if not results else f"{record['uuid']}-text"
            messages.append({"id": mid, "role": "user", "parts": texts, "metadata": {}})
    messages, dropped = _drop_unanswered_calls(messages)
    return Sample(name or f"claude-code:{path.stem}", messages, blob_sizes, [], dropped)


def load_samples() -> list[Sample]:
    """Every real sample the ladder is measured on: pi, and per Claude Code file the
    chain with the most text plus each main (non-sidechain) chain that differs from it."""
    samples = [load_pi()]
    for path in sorted(CLAUDE_CODE_DIR.glob("*.jsonl")):
        chains = claude_code_chains(path)
        longest = max(chains, key=lambda k: _chain_chars(chains[k]))
        samples.append(load_claude_code(path, leaf=longest, name=f"{path.stem}:longest"))
        for n, (leaf, chain) in enumerate(chains.items()):
            if leaf != longest and not chain[-1].get("isSidechain"):
                samples.append(load_claude_code(path, leaf=leaf, name=f"{path.stem}:main{n}"))
    return samples


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
