"""Shared pieces of the importers: the report, limits, errors, the source-node shape every
format parser produces, part constructors and the sanitiser. No database access here.

A format parser turns a file into ``SourceConversation`` objects: flat lists of ``Node``
(source key, parent key, role, Arbor parts, metadata, timestamp, file position). The tree
builder (``importers.tree``) repairs and orders them; the writer stores them.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from conversations.errors import ArborError, InvalidInput
from conversations.parts import MAX_ID_CHARS

Part = dict[str, Any]

FORMATS = ("chatgpt", "claude-code", "pi", "openwebui", "arbor", "claudeai", "codex")


class ImportRejected(InvalidInput):
    """The file as a whole cannot be imported (unknown format, not JSON, empty)."""

    code = "import_rejected"


class ImportTooLarge(ArborError):
    status = 413
    code = "import_too_large"


@dataclass(frozen=True)
class Limits:
    """Size and count limits. Each can be overridden by a setting of the same name."""

    max_file_bytes: int
    max_conversations: int
    max_messages: int
    # One JSON document, or one element of a top-level array (one conversation).
    max_document_bytes: int
    max_line_bytes: int
    max_part_chars: int
    max_metadata_bytes: int
    # One image file of an export zip (a ChatGPT archive's images become blobs).
    max_blob_bytes: int

    @classmethod
    def from_settings(cls) -> Limits:
        # Django's settings are read here only, when a caller asks for them: the parsers
        # take a Limits, so they import (and run in a script or a test) without Django.
        from django.conf import settings

        def _limit(name: str, default: int) -> int:
            return int(getattr(settings, name, default))

        return cls(
            max_file_bytes=_limit("ARBOR_IMPORT_MAX_FILE_BYTES", 2 * 1024**3),
            max_conversations=_limit("ARBOR_IMPORT_MAX_CONVERSATIONS", 20_000),
            max_messages=_limit("ARBOR_IMPORT_MAX_MESSAGES", 200_000),
            # JSON read as Python objects takes up to ~26x its size (tiny objects):
            # one document or line is bounded far below the file limit (files stream).
            max_document_bytes=_limit("ARBOR_IMPORT_MAX_DOCUMENT_BYTES", 32 * 1024**2),
            max_line_bytes=_limit("ARBOR_IMPORT_MAX_LINE_BYTES", 32 * 1024**2),
            max_part_chars=_limit("ARBOR_MAX_PART_CHARS", 2_000_000),
            max_metadata_bytes=_limit("ARBOR_IMPORT_MAX_METADATA_BYTES", 64 * 1024),
            max_blob_bytes=_limit("ARBOR_MAX_BLOB_BYTES", 10 * 1024**2),
        )


# --- the report ----------------------------------------------------------------------

MAX_LISTED_ISSUES = 500


@dataclass
class Issue:
    kind: str
    where: str
    detail: str

    def as_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "where": self.where, "detail": self.detail}


class Issues:
    """A list of issues that keeps the first few hundred and counts the rest, so a file
    with a million broken lines gives a report of bounded size."""

    def __init__(self) -> None:
        self.items: list[Issue] = []
        self.total = 0
        self.by_kind: Counter[str] = Counter()

    def add(self, kind: str, where: str, detail: str) -> None:
        self.total += 1
        self.by_kind[kind] += 1
        if len(self.items) < MAX_LISTED_ISSUES:
            self.items.append(Issue(kind, where, detail))

    def kinds(self) -> set[str]:
        return set(self.by_kind)

    def __len__(self) -> int:
        return self.total

    def as_list(self) -> list[dict[str, str]]:
        out = [i.as_dict() for i in self.items]
        if self.total > len(self.items):
            out.append(
                {
                    "kind": "more",
                    "where": "",
                    "detail": f"{self.total - len(self.items)} more not listed",
                }
            )
        return out


@dataclass
class ConversationReport:
    source_id: str | None
    title: str = ""
    id: Any = None  # the new conversation's id once written
    messages: int = 0
    roots: int = 0
    leaves: int = 0
    tool_calls: int = 0
    tool_results: int = 0
    tool_pairs: int = 0  # on the path to the tip
    tool_pairs_elsewhere: int = 0  # on other branches
    images: int = 0
    compaction_markers: int = 0
    checkpoints: int = 0
    tip: Any = None
    tip_rule: str = ""
    sidechain_of: str | None = None  # the source id of the conversation it branched from
    spawned_by: Any = None  # the message holding the call that started it, once linked
    skipped: Issues = field(default_factory=Issues)
    repaired: Issues = field(default_factory=Issues)
    flagged: Issues = field(default_factory=Issues)

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": str(self.id) if self.id else None,
            "source_id": self.source_id,
            "title": self.title,
            "messages": self.messages,
            "roots": self.roots,
            "leaves": self.leaves,
            "tool_calls": self.tool_calls,
            "tool_results": self.tool_results,
            "tool_pairs": self.tool_pairs,
            "tool_pairs_elsewhere": self.tool_pairs_elsewhere,
            "images": self.images,
            "compaction_markers": self.compaction_markers,
            "checkpoints": self.checkpoints,
            "tip": str(self.tip) if self.tip else None,
            "tip_rule": self.tip_rule,
            "sidechain_of": self.sidechain_of,
            "spawned_by": str(self.spawned_by) if self.spawned_by else None,
            "skipped": self.skipped.as_list(),
            "repaired": self.repaired.as_list(),
            "flagged": self.flagged.as_list(),
        }


@dataclass
class ImportReport:
    file: str
    format: str = ""
    conversations: list[ConversationReport] = field(default_factory=list)
    # File-level items: whole conversations not imported, unreadable lines or elements.
    skipped: Issues = field(default_factory=Issues)
    repaired: Issues = field(default_factory=Issues)
    # Set when the file ends before its last line or element does: in words, what was
    # lost (the report's first line; the browser shows it at the top).
    truncated: str = ""
    # Conversations imported before and so skipped: {source_key, title, existing,
    # existing_title}.
    duplicates: list[dict[str, Any]] = field(default_factory=list)

    @property
    def conversation_ids(self) -> list[Any]:
        return [c.id for c in self.conversations if c.id]

    def as_dict(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "format": self.format,
            "conversation_ids": [str(i) for i in self.conversation_ids],
            "conversations": [c.as_dict() for c in self.conversations],
            "truncated": self.truncated,
            "duplicates": self.duplicates,
            "skipped": self.skipped.as_list(),
            "repaired": self.repaired.as_list(),
        }


# --- what parsers produce ------------------------------------------------------------


@dataclass
class Node:
    """One future message, as a parser read it from the source."""

    key: str
    parent: str | None
    role: str
    parts: list[Part]
    metadata: dict[str, Any] = field(default_factory=dict)
    created_at: datetime | None = None
    order: int = 0  # position in the file: the tip rule and sibling tie-break
    origin: str = "import"
    # Set when the node is not a message (a null root, an empty or non-message entry):
    # it is left out and its children move up to its parent.
    skip: str | None = None
    # What the parser repaired or left out of this record: (list, kind, detail), with
    # list "repaired" or "skipped"; copied into the conversation's report.
    notes: list[tuple[str, str, str]] = field(default_factory=list)

    def note(self, kind: str, detail: str, *, skipped: bool = False) -> None:
        self.notes.append(("skipped" if skipped else "repaired", kind, detail))


@dataclass
class SourceCheckpoint:
    label: str
    message: str  # a node key
    state: str = "live"
    reason: str = ""
    source: str = "user"
    digest_message: str | None = None


@dataclass
class SourceConversation:
    source_id: str | None
    title: str
    nodes: list[Node]
    report: ConversationReport
    tip: str | None = None  # the format's own current node, when it has one
    tip_rule: str = ""
    created_at: datetime | None = None
    model: str = ""
    system_prompt: str = ""
    checkpoints: list[SourceCheckpoint] = field(default_factory=list)
    # Children naming a key here attach to the key it maps to (a source record that
    # became several messages, or several records merged into one message).
    aliases: dict[str, str] = field(default_factory=dict)
    # Bytes of images the file carries, by sha256 (Arbor JSON).
    blob_data: dict[str, bytes] = field(default_factory=dict)
    # Arbor JSON: metadata and origin are kept exactly, nothing is added.
    verbatim: bool = False
    # A sub-agent's run: the id of the tool call (in a conversation of the same import)
    # that started it; the writer links the two.
    spawned_by_call: str | None = None


NEWEST_LEAF = "newest leaf: the leaf written last in the file"


# --- part constructors ---------------------------------------------------------------


def text_part(text: str) -> Part:
    return {"type": "text", "text": text}


BlockReader = Callable[[dict[str, Any]], "Part | None"]


def block_parts(
    content: Any, readers: Mapping[str, BlockReader], unknown: BlockReader
) -> list[Part]:
    """A message's content as parts, in the Anthropic-like shape several formats share:
    a string (one text part, none when empty) or a list of typed blocks. Each block goes
    to the reader for its ``type`` (``unknown`` for any other type); a reader returns a
    part or None (left out, having noted why). Non-object blocks are skipped."""
    if isinstance(content, str):
        return [text_part(content)] if content else []
    parts: list[Part] = []
    for block in content if isinstance(content, list) else []:
        if isinstance(block, dict):
            kind = block.get("type")  # whatever JSON value the file holds
            reader = readers.get(kind, unknown) if isinstance(kind, str) else unknown
            part = reader(block)
            if part is not None:
                parts.append(part)
    return parts


def nonempty_text(block: dict[str, Any]) -> Part | None:
    """A text block's part, or None for an empty one."""
    text = as_str(block.get("text"))
    return text_part(text) if text else None


def thinking_part(text: str, signature: Any = None) -> Part:
    part: Part = {"type": "thinking", "text": text}
    if isinstance(signature, str) and signature:
        part["signature"] = signature
    return part


def norm_id(value: Any) -> str:
    """A tool-call id Arbor accepts (a non-empty string of at most 200 characters). Long
    ids keep a readable prefix and a hash, so calls and results still match."""
    text = str(value) if value is not None else ""
    if len(text) <= MAX_ID_CHARS:
        return text
    return text[:150] + "-" + hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:40]


def tool_call_part(call_id: Any, name: Any, arguments: Any) -> Part:
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except (ValueError, RecursionError):
            parsed = None
        arguments = parsed if isinstance(parsed, dict) else {"input": arguments}
    elif not isinstance(arguments, dict):
        arguments = {} if arguments is None else {"input": arguments}
    name_text = str(name) if name else "unknown"
    return {
        "type": "tool_call",
        "id": norm_id(call_id),
        "name": norm_id(name_text),
        "arguments": arguments,
    }


def tool_result_part(call_id: Any, parts: list[Part], *, is_error: bool = False) -> Part:
    return {
        "type": "tool_result",
        "call_id": norm_id(call_id),
        "is_error": bool(is_error),
        "parts": parts,
    }


def image_data_part(data: bytes, mime: str | None, where: str) -> Part:
    """An image whose bytes the file carries; the writer stores it as a blob."""
    return {"type": "image", "data": data, "mime": mime or "", "where": where}


def image_ref_part(sha256: str, where: str) -> Part:
    """An image named by the sha256 of a blob (Arbor and Arbor-made ChatGPT files)."""
    return {"type": "image", "blob": sha256, "where": where}


def json_text(value: Any, limit: int = 20_000) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False, default=str)
    except (ValueError, TypeError, RecursionError):
        text = str(value)
    return text if len(text) <= limit else text[:limit] + "…"


# --- time ----------------------------------------------------------------------------


def parse_time(value: Any) -> datetime | None:
    """A timestamp from an ISO string, or Unix seconds / milliseconds."""
    if value is None or isinstance(value, bool):
        return None
    try:
        if isinstance(value, int | float):
            seconds = float(value)
            if seconds > 1e11:  # milliseconds
                seconds /= 1000.0
            if not 0 < seconds < 32503680000:  # before the year 3000
                return None
            return datetime.fromtimestamp(round(seconds, 6), tz=UTC)
        if isinstance(value, str) and value.strip():
            parsed = datetime.fromisoformat(value.strip())
            if parsed.tzinfo is None:
                parsed = parsed.replace(tzinfo=UTC)
            return parsed.astimezone(UTC)
    except (ValueError, OverflowError, OSError):
        return None
    return None


def format_time(value: datetime) -> str:
    return value.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


# --- sanitising ----------------------------------------------------------------------

_BAD_CHARS = re.compile("[\x00\ud800-\udfff]")
MAX_NESTING = 64


class Sanitiser:
    """Makes JSON values storable in PostgreSQL: no NUL characters, no lone surrogates
    (both refused in text and jsonb), bounded nesting. Counts what it changed."""

    def __init__(self) -> None:
        self.nul = 0
        self.surrogates = 0
        self.too_deep = 0
        self.non_finite = 0

    def text(self, value: str) -> str:
        if not _BAD_CHARS.search(value):
            return value

        def swap(match: re.Match[str]) -> str:
            if match.group() == "\x00":
                self.nul += 1
            else:
                self.surrogates += 1
            return "\ufffd"

        return _BAD_CHARS.sub(swap, value)

    def value(self, value: Any, depth: int = 0) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if depth >= MAX_NESTING and isinstance(value, dict | list):
            self.too_deep += 1
            return "[nested too deeply]"
        if isinstance(value, dict):
            return {self.text(str(k)): self.value(v, depth + 1) for k, v in value.items()}
        if isinstance(value, list):
            return [self.value(v, depth + 1) for v in value]
        if isinstance(value, float) and not math.isfinite(value):
            # 1e400 parses as inf: JSON (and jsonb) cannot hold it.
            self.non_finite += 1
            return None
        return value

    def changed(self) -> bool:
        return bool(self.nul or self.surrogates or self.too_deep or self.non_finite)

    def describe(self) -> str:
        bits = []
        if self.nul:
            bits.append(f"{self.nul} NUL character(s) replaced with U+FFFD")
        if self.surrogates:
            bits.append(f"{self.surrogates} unpaired surrogate(s) replaced with U+FFFD")
        if self.too_deep:
            bits.append(f"{self.too_deep} value(s) nested deeper than {MAX_NESTING} replaced")
        if self.non_finite:
            bits.append(f"{self.non_finite} infinite number(s) replaced with null")
        return "; ".join(bits)


def preview_text(text: str, limit: int = 80) -> str:
    flat = " ".join(re.sub(r"<[^>]{1,200}>", " ", text).split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def first_text(nodes: list[Node], role: str = "user") -> str:
    for node in nodes:
        if node.role == role and node.skip is None:
            for part in node.parts:
                if part.get("type") == "text" and part.get("text", "").strip():
                    return str(part["text"])
    return ""


class FileIssues(Issues):
    """Issues found while reading the file, sent to the file report's skipped or
    repaired list by kind."""

    REPAIRS = frozenset({"nul_bytes", "invalid_utf8", "two_records_on_one_line"})

    def __init__(self, report: ImportReport) -> None:
        super().__init__()
        self.report = report

    def add(self, kind: str, where: str, detail: str) -> None:
        super().add(kind, where, detail)
        target = self.report.repaired if kind in self.REPAIRS else self.report.skipped
        target.add(kind, where, detail)
        if kind == "truncated" and not self.report.truncated:
            self.report.truncated = detail


ORIGINS = ("turn", "edit", "regenerate", "fork", "import", "digest")
ROLES = ("system", "user", "assistant", "tool")


def as_str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []
