"""Streaming readers: JSON Lines one line at a time, and JSON arrays one element at a time,
so a file of hundreds of MB never sits in memory whole. Format detection reads only the
head of the file.

The array reader decodes each element with the C-accelerated ``raw_decode`` as soon as
the buffer holds all of it; when an element is corrupt it falls back to a small bracket
scanner to find where the element ends and goes on with the next one.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from conversations.importers.base import (
    FileIssues,
    ImportRejected,
    ImportReport,
    Issues,
    Limits,
    SourceConversation,
)
from conversations.parts import reject_constant

CHUNK = 1 << 20
_WS = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder(parse_constant=reject_constant)


def _decode_bytes(raw: bytes, issues: Issues, where: str) -> str:
    if b"\x00" in raw:
        count = raw.count(b"\x00")
        raw = raw.replace(b"\x00", b"")
        issues.add("nul_bytes", where, f"{count} NUL byte(s) removed")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        issues.add("invalid_utf8", where, "bytes that are not UTF-8 replaced with U+FFFD")
        return raw.decode("utf-8", errors="replace")


# --- JSON Lines ----------------------------------------------------------------------


def iter_jsonl(
    path: Path, *, issues: Issues, limits: Limits
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line number, record)`` for each JSON object in the file. A line holding
    several records one after the other gives all of them; corrupt lines are reported
    and skipped."""
    with open(path, "rb") as stream:
        lineno = 0
        while True:
            start = stream.tell()
            raw = stream.readline(limits.max_line_bytes + 1)
            if not raw:
                return
            lineno += 1
            where = f"line {lineno}"
            if not raw.endswith(b"\n") and len(raw) <= limits.max_line_bytes and _cut(raw):
                size = start + len(raw)
                issues.add(
                    "truncated",
                    where,
                    f"The file was cut at byte {size}, inside line {lineno}: that line "
                    f"({len(raw)} bytes, the last) could not be read and is lost; the "
                    f"{lineno - 1} lines before it were read.",
                )
                return
            if len(raw) > limits.max_line_bytes and not raw.endswith(b"\n"):
                while rest := stream.readline(CHUNK):  # skip to the end of the long line
                    if rest.endswith(b"\n"):
                        break
                issues.add(
                    "line_too_long", where, f"longer than {limits.max_line_bytes} bytes: skipped"
                )
                continue
            text = _decode_bytes(raw, issues, where).strip().lstrip("\ufeff")
            if not text:
                continue
            yield from ((lineno, rec) for rec in _decode_line(text, issues, where))


def _cut(raw: bytes) -> bool:
    """Whether the last line of a file (no newline after it) ends before its JSON does:
    a value still open, not a line of garbage."""
    text = _decode_bytes(raw, Issues(), "").strip().lstrip("\ufeff")
    if not text:
        return False
    pos = 0
    try:
        while pos < len(text):
            _, end = _DECODER.raw_decode(text, pos)
            pos = _ws(text, end)
    except ValueError as exc:
        # Cut: the JSON was still open where the text ends (a garbage tail fails before).
        at = getattr(exc, "pos", 0)
        msg = getattr(exc, "msg", "")
        return at >= len(text) or msg.startswith("Unterminated string")
    except RecursionError:
        return False
    return False


def _decode_line(text: str, issues: Issues, where: str) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    pos = 0
    while pos < len(text):
        try:
            value, end = _DECODER.raw_decode(text, pos)
        except RecursionError:
            issues.add("corrupt_entry", where, "nested too deeply to read: skipped")
            break
        except ValueError as exc:
            what = "the rest of the line" if records else "the line"
            issues.add("corrupt_entry", where, f"not valid JSON ({exc}): {what} skipped")
            break
        if isinstance(value, dict):
            records.append(value)
        else:
            issues.add("corrupt_entry", where, "a JSON value that is not an object: skipped")
        pos = _ws(text, end)
    if len(records) > 1:
        issues.add(
            "two_records_on_one_line",
            where,
            f"{len(records)} records without a newline between them: all recovered",
        )
    return records


# --- JSON documents and arrays -------------------------------------------------------


class _Scanner:
    """Finds where a JSON value ends without decoding it: depth and string state only."""

    _OUT = re.compile(r'[\[\]{}"]')
    _IN = re.compile(r'["\\]')

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.started = False

    def feed(self, text: str, pos: int) -> int | None:
        """Scan from ``pos``; the index just after the value's end, or None if the text
        ran out first (state is kept for the next chunk)."""
        n = len(text)
        while pos < n:
            if self.escape:
                self.escape = False
                pos += 1
                continue
            if self.in_string:
                m = self._IN.search(text, pos)
                if m is None:
                    return None
                pos = m.end()
                if m.group() == "\\":
                    self.escape = True
                else:
                    self.in_string = False
                    if self.depth == 0 and self.started:
                        return pos
                continue
            m = self._OUT.search(text, pos)
            if m is None:
                return None
            pos = m.end()
            char = m.group()
            self.started = True
            if char == '"':
                self.in_string = True
            elif char in "[{":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth <= 0:
                    return pos
        return None


class JsonReader:
    """Reads a JSON file: either one document, or a top-level array element by element."""

    def __init__(self, path: Path, *, issues: Issues, limits: Limits) -> None:
        self.path = path
        self.issues = issues
        self.limits = limits
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._bad_utf8_reported = False
        self._nul = 0
        self._stream: BinaryIO | None = None
        self.buf = ""
        self.pos = 0
        self.eof = False

    def _read(self, stream: BinaryIO, size: int) -> tuple[str, bool]:
        data = stream.read(size)
        eof = not data
        if b"\x00" in data:
            self._nul += data.count(b"\x00")
            data = data.replace(b"\x00", b"")
        text = self._decoder.decode(data, final=eof)
        if "\ufffd" in text and not self._bad_utf8_reported:
            self._bad_utf8_reported = True
            self.issues.add(
                "invalid_utf8", "file", "bytes that are not UTF-8 (or U+FFFD) read as U+FFFD"
            )
        return text, eof

    def _finish(self) -> None:
        if self._nul:
            self.issues.add("nul_bytes", "file", f"{self._nul} NUL byte(s) removed")
            self._nul = 0

    def load_document(self) -> Any:
        """The whole file as one JSON value (bounded by the document limit)."""
        size = self.path.stat().st_size
        if size > self.limits.max_document_bytes:
            raise ImportRejected(
                f"a single JSON document of {size} bytes is larger than the limit of "
                f"{self.limits.max_document_bytes}; export it as a list instead",
                code="import_too_large",
            )
        with open(self.path, "rb") as stream:
            text, _ = self._read(stream, size + 1)
            text += self._decoder.decode(b"", final=True)
        self._finish()
        text = text.lstrip("\ufeff")
        try:
            value, end = _DECODER.raw_decode(text, _ws(text, 0))
        except RecursionError:
            raise ImportRejected("the JSON is nested too deeply to read") from None
        except ValueError as exc:
            at = getattr(exc, "pos", 0)
            if at >= len(text.rstrip()) - 1 or getattr(exc, "msg", "").startswith("Unterminated"):
                raise ImportRejected(
                    f"the file is truncated: it was cut at byte {size}, before its JSON "
                    "document ends, so nothing in it is complete",
                    code="truncated",
                ) from None
            raise ImportRejected(f"the file is not valid JSON: {exc}") from None
        if text[end:].strip():
            self.issues.add("corrupt_entry", "end of file", "text after the JSON value ignored")
        return value

    # -- arrays, incrementally --

    def _more(self, at_least: int = CHUNK) -> bool:
        """Append more text to the buffer (dropping what was consumed). False at EOF."""
        if self.eof or self._stream is None:
            return False
        text, self.eof = self._read(self._stream, max(CHUNK, at_least))
        self.buf = self.buf[self.pos :] + text
        self.pos = 0
        return True

    def _skip_ws(self) -> bool:
        """Move past whitespace; False if the file ends first."""
        while True:
            self.pos = _ws(self.buf, self.pos)
            if self.pos < len(self.buf):
                return True
            if not self._more():
                return False

    def iter_array(self) -> Generator[tuple[int, Any], None, None]:
        """Yield ``(index, element)`` of a top-level JSON array. Corrupt elements are
        reported and skipped; a truncated file yields what came before the damage."""
        with open(self.path, "rb") as stream:
            self._stream = stream
            self.buf, self.pos, self.eof = "", 0, False
            self._more()
            self.buf = self.buf.lstrip("\ufeff")
            if not self._skip_ws() or self.buf[self.pos] != "[":
                raise ImportRejected("expected a JSON array")
            self.pos += 1
            index = 0
            while True:
                if not self._skip_ws():
                    self._unclosed()
                    break
                if self.buf[self.pos] == "]":
                    self.pos += 1
                    if self._skip_ws():
                        self.issues.add(
                            "corrupt_entry", "end of file", "text after the array ignored"
                        )
                    break
                outcome = self._element(index)
                if outcome is _END:
                    break
                if outcome is not _BAD:
                    yield index, outcome
                index += 1
                if not self._skip_ws():
                    self._unclosed()
                    break
                char = self.buf[self.pos]
                if char == ",":
                    self.pos += 1
                elif char != "]":
                    self.issues.add(
                        "corrupt_entry",
                        f"after element {index - 1}",
                        f"expected ',' or ']' but found {char!r}: the rest of the file skipped",
                    )
                    break
        self._stream = None
        self._finish()

    def _cut_inside(self, where: str) -> None:
        index = where.split()[-1]
        self.issues.add(
            "truncated",
            where,
            f"The file was cut at byte {self.path.stat().st_size}, inside {where}: it is "
            f"lost; the {index} element{'' if index == '1' else 's'} before it were read.",
        )

    def _unclosed(self) -> None:
        self.issues.add(
            "truncated",
            "end of file",
            f"The file was cut at byte {self.path.stat().st_size}: the JSON list is not "
            "closed (every element before the cut was read; anything after it is lost).",
        )

    def _element(self, index: int) -> Any:
        """Decode the element at the cursor. Returns the value, _BAD (reported, skipped,
        cursor after it) or _END (the rest of the file is unreadable)."""
        where = f"element {index}"
        start = self.pos
        while True:
            size = len(self.buf) - start
            try:
                value, end = _DECODER.raw_decode(self.buf, start)
            except RecursionError:
                self.issues.add("corrupt_entry", where, "nested too deeply to read: skipped")
                return self._skip_from(start, where)
            except ValueError as exc:
                pos = getattr(exc, "pos", len(self.buf))
                msg = getattr(exc, "msg", str(exc))
                incomplete = pos >= len(self.buf) - 8 or msg.startswith("Unterminated string")
                if incomplete and not self.eof:
                    if size > self.limits.max_document_bytes:
                        self.issues.add(
                            "too_large",
                            where,
                            f"larger than {self.limits.max_document_bytes} bytes: skipped",
                        )
                        return self._skip_from(start, where)
                    # Grow geometrically so a big element is re-decoded O(log n) times.
                    self._more(max(CHUNK, size))
                    start = self.pos
                    continue
                if pos >= len(self.buf.rstrip()) or msg.startswith("Unterminated string"):
                    # The file ends while the element is still open: cut, not corrupt.
                    self._cut_inside(where)
                    return _END
                self.issues.add("corrupt_entry", where, f"not valid JSON ({msg}): skipped")
                return self._skip_from(start, where)
            self.pos = end
            if end - start > self.limits.max_document_bytes:
                self.issues.add(
                    "too_large", where, f"larger than {self.limits.max_document_bytes}: skipped"
                )
                return _BAD
            return value

    def _skip_from(self, start: int, where: str) -> Any:
        """Find the end of a broken element with the bracket scanner, reading on as
        needed, and put the cursor after it."""
        scanner = _Scanner()
        pos = start
        while True:
            end = scanner.feed(self.buf, pos)
            if end is not None:
                self.pos = end
                return _BAD
            self.pos = len(self.buf)  # everything so far is consumed
            if not self._more():
                self._cut_inside(where)
                return _END
            pos = 0


_BAD = object()
_END = object()


def _ws(text: str, pos: int) -> int:
    match = _WS.match(text, pos)
    return match.end() if match else pos


# --- what a file holds ---------------------------------------------------------------

HEAD_BYTES = 256 * 1024


def iter_documents(path: Path, *, issues: Issues, limits: Limits) -> Iterator[tuple[int, Any]]:
    """The JSON values of a file: each element of a top-level array, or the one document."""
    reader = JsonReader(path, issues=issues, limits=limits)
    if _first_char(path) == "[":
        yield from reader.iter_array()
    else:
        yield 0, reader.load_document()


def _head(path: Path) -> str:
    with open(path, "rb") as stream:
        raw = stream.read(HEAD_BYTES)
    return raw.replace(b"\x00", b"").decode("utf-8", errors="replace").lstrip("\ufeff")


def _first_char(path: Path) -> str:
    head = _head(path).lstrip()
    return head[:1]


def document_format(value: Any) -> str | None:
    """Which format one JSON document (or array element) is in, from its keys."""
    if not isinstance(value, dict):
        return None
    if value.get("format") == "arbor":
        return "arbor"
    # Before the others: a claude.ai conversation may also hold keys they look for.
    if "chat_messages" in value:
        return "claudeai"
    if "mapping" in value or ("current_node" in value and "title" in value):
        return "chatgpt"
    chat = value.get("chat")
    if "history" in value or (isinstance(chat, dict) and ("history" in chat or "messages" in chat)):
        return "openwebui"
    messages = value.get("messages")
    first = messages[0] if isinstance(messages, list) and messages else None
    if isinstance(first, dict) and "role" in first and "content" in first:
        return "openwebui"
    return None


_CLAUDE_TYPES = {"user", "assistant", "summary", "system", "file-history-snapshot"}
_PI_TYPES = {"session", "message", "compaction", "branch_summary", "model_change", "label"}
# Codex rollout records: every one wraps its content in a payload (pi and Claude Code never do).
_CODEX_TYPES = {
    "session_meta",
    "response_item",
    "event_msg",
    "turn_context",
    "compacted",
    "world_state",
    "token_usage_record",
}


def record_format(records: list[dict[str, Any]]) -> str | None:
    """Which JSON Lines format a few records are in."""
    for record in records:
        # A "type" that is an object or a list names no format (and is not hashable).
        kind = record.get("type") if isinstance(record.get("type"), str) else None
        if kind in _CODEX_TYPES and "payload" in record:
            return "codex"
        if "uuid" in record or "parentUuid" in record or "sessionId" in record:
            return "claude-code"
        if kind == "session" or (kind in _PI_TYPES and "message" in record):
            return "pi"
        if kind in _PI_TYPES and "uuid" not in record:
            return "pi"
        if kind in _CLAUDE_TYPES:
            return "claude-code"
    return None


_SNIFF = (
    (re.compile(r'"format"\s*:\s*"arbor"'), "arbor"),
    (re.compile(r'"chat_messages"\s*:'), "claudeai"),
    (re.compile(r'"mapping"\s*:'), "chatgpt"),
    (re.compile(r'"history"\s*:|"currentId"\s*:'), "openwebui"),
)


def detect_format(path: Path, *, limits: Limits) -> str:
    """Guess the format from the head of the file (and at most the first few array
    elements). Raises ImportRejected when nothing fits."""
    head = _head(path)
    stripped = head.lstrip()
    if not stripped:
        raise ImportRejected("the file is empty", code="empty_file")
    if stripped[0] == "[":
        return _array_format(path, head, limits)
    if stripped[0] != "{":
        raise ImportRejected("the file is neither JSON nor JSON Lines", code="unknown_format")
    return _object_format(stripped, head)


def _sniff(head: str) -> str | None:
    """The format a telltale key in the raw head names (the head may not parse)."""
    return next((fmt for pattern, fmt in _SNIFF if pattern.search(head)), None)


def _array_format(path: Path, head: str, limits: Limits) -> str:
    """A top-level array: the format of its first recognisable element."""
    reader = JsonReader(path, issues=Issues(), limits=limits)
    fmt, decoded = _first_elements_format(reader)
    if fmt:
        return fmt
    kinds = reader.issues.kinds()
    if "truncated" in kinds and "corrupt_entry" not in kinds and not decoded:
        guess = _sniff(head)
        what = f"a {guess} export" if guess else "a JSON list"
        raise ImportRejected(
            f"the file is truncated: {what} cut at byte {path.stat().st_size}, inside "
            "its first element, so nothing in it is complete",
            code="truncated",
        )
    raise ImportRejected(
        "a JSON list, but not of ChatGPT or claude.ai conversations, Open WebUI chats or Arbor "
        "exports",
        code="unknown_format",
    )


def _first_elements_format(reader: JsonReader) -> tuple[str | None, int]:
    """The format of the first of (at most six) array elements that has one, and how
    many elements were decoded to find it."""
    elements = reader.iter_array()
    decoded = 0
    try:
        for seen, (_, element) in enumerate(elements):
            decoded += 1
            fmt = document_format(element)
            if fmt:
                return fmt, decoded
            if seen >= 5:
                break
    finally:
        elements.close()
    return None, decoded


def _object_format(stripped: str, head: str) -> str:
    """A file starting with an object: JSON Lines (records) or one JSON document."""
    lines = [line.strip() for line in stripped.split("\n")[:50]]
    records = _json_records(lines)
    several = len(records) > 1 or (bool(records) and len([ln for ln in lines if ln]) > 1)
    fmt = (
        _records_format(records, several)
        or _sniff(head)
        or (record_format(records) if records else None)
    )
    if fmt:
        return fmt
    raise ImportRejected(
        "could not tell the format; pass one of chatgpt, claude-code, pi, openwebui, arbor, "
        "claudeai, codex",
        code="unknown_format",
    )


def _json_records(lines: list[str]) -> list[dict[str, Any]]:
    """The lines of the head that parse as JSON objects (a cut last line does not)."""
    records: list[dict[str, Any]] = []
    for line in lines:
        if not line:
            continue
        try:
            value = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(value, dict):
            records.append(value)
    return records


def _records_format(records: list[dict[str, Any]], several: bool) -> str | None:
    """Several lines: JSON Lines records; one line alone: a document or a record."""
    if records and several:
        return record_format(records)
    if len(records) == 1 and not several:
        return document_format(records[0]) or record_format(records)
    return None


def parse_documents(
    path: Path,
    *,
    report: ImportReport,
    limits: Limits,
    read: Callable[[Any, int, ImportReport], SourceConversation | None],
) -> Iterator[SourceConversation]:
    """The conversations of a file of JSON documents (one, an array, or one per line),
    each read by ``read(document, index, report)``; a document it cannot use (None) is
    left out, with the reason in the report."""
    for index, doc in iter_documents(path, issues=FileIssues(report), limits=limits):
        conversation = read(doc, index, report)
        if conversation is not None:
            yield conversation
