"""The real sample sessions the ladder is measured on, read with Arbor's own importers.

One way to read a sample file: ``conversations.importers`` parses it (pi's or Claude
Code's parser) and ``importers.tree.build`` repairs and orders it, exactly as an import
does, but nothing is written: images stay in memory (their sha256 and size are kept for
the byte limits) and the result is a plain list of Arbor-shaped messages
(``{"id", "role", "parts", "metadata"}``). The ladder bench (``compaction.bench_ladder``)
and the compaction tests both read the samples here.

What a sample is, on top of the importer's tree:

- a path from a root to a leaf, as ``conversations.resume.resume_view`` would send it
  (tool calls that never got a result, from aborted steps, are left out);
- the tool's own compaction markers are taken out; ``compactions`` keeps where each one
  was, so a caller can look at the session before the tool compacted it;
- ``metadata`` keeps only the measured usage of assistant messages, as the estimator
  reads it: ``usage.input_tokens`` is the whole prompt (uncached, cache read and cache
  write together).

The samples are read in place from ``../shared/samples`` (``ARBOR_SAMPLES`` overrides, as
for ``compaction.bench_render``); they are never copied into the repository. Needs
Django's settings (the importers read their limits from them), but no database.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, UnidentifiedImageError

from conversations.importers import claude_code, pi
from conversations.importers.base import ImportReport, Limits, SourceConversation
from conversations.importers.tree import BuiltConversation, SkipConversation, build
from conversations.parts import image_blobs
from conversations.resume import ViewMessage, resume_view
from conversations.session_export import usage_counts

_DEFAULT_SAMPLES = Path(__file__).resolve().parents[2] / "shared" / "samples"
SAMPLES = Path(os.environ.get("ARBOR_SAMPLES", _DEFAULT_SAMPLES))
PI_SAMPLE = SAMPLES / "pi" / "pi-mono__compact.jsonl"
CLAUDE_CODE_DIR = SAMPLES / "claude-code"

Message = dict[str, Any]
Parser = Callable[..., Iterator[SourceConversation]]


@dataclass
class Sample:
    name: str
    messages: list[Message]
    blob_sizes: dict[str, int] = field(default_factory=dict)
    # Index (into messages) of the first message after each compaction the tool made.
    compactions: list[int] = field(default_factory=list)
    dropped_calls: int = 0


@dataclass
class _Line:
    """One root-to-leaf path of an imported conversation."""

    messages: list[Message]
    blob_sizes: dict[str, int]  # of every image in the conversation
    markers: set[str]  # ids of the tool's own compaction markers
    main: bool  # not a sub-agent's sidechain

    def chars(self) -> int:
        return sum(len(json.dumps(m["parts"])) for m in self.messages)


def read_conversations(path: Path, parse: Parser) -> list[tuple[BuiltConversation, bool]]:
    """Every conversation of one file as the importer builds it, with whether it is the
    main one (not a sidechain); conversations the importer would skip are left out."""
    limits = Limits.from_settings()
    report = ImportReport(file=path.name)
    built: list[tuple[BuiltConversation, bool]] = []
    for source in parse(path, report=report, limits=limits):
        try:
            built.append((build(source, limits), source.report.sidechain_of is None))
        except SkipConversation:
            continue
    return built


def _image_size(data: bytes) -> tuple[int, int]:
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            return int(width), int(height)
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError):
        return 0, 0


def _stored_parts(parts: list[dict[str, Any]], blob_sizes: dict[str, int]) -> list[dict[str, Any]]:
    """Parts as the writer stores them: an image's bytes become a blob reference (sha256,
    mime, size in pixels), its byte count noted in ``blob_sizes``."""
    out: list[dict[str, Any]] = []
    for part in parts:
        if part.get("type") == "image" and "data" in part:
            data: bytes = part["data"]
            sha = hashlib.sha256(data).hexdigest()
            blob_sizes[sha] = len(data)
            width, height = _image_size(data)
            mime = part.get("mime") or ""
            part = {"type": "image", "blob": sha, "mime": mime, "width": width, "height": height}
        elif part.get("type") == "tool_result":
            part = {**part, "parts": _stored_parts(part.get("parts", []), blob_sizes)}
        out.append(part)
    return out


def _metadata(role: str, metadata: dict[str, Any]) -> dict[str, Any]:
    """Only the measured usage, with ``input_tokens`` the whole prompt (pi and Claude
    Code keep the cached part of the prompt apart)."""
    counts = usage_counts(metadata.get("usage")) if role == "assistant" else None
    if counts is None:
        return {}
    fresh, output, read, write = counts
    return {"usage": {"input_tokens": fresh + read + write, "output_tokens": output}}


def _lines(built: BuiltConversation, main: bool) -> list[_Line]:
    """Every root-to-leaf path of a conversation, in the order of their leaves."""
    blob_sizes: dict[str, int] = {}
    by_key: dict[str, Message] = {}
    parent: dict[str, str | None] = {}
    has_child: set[str] = set()
    markers = {m.key for m in built.messages if "compaction_marker" in m.node.metadata}
    for m in built.messages:
        node = m.node
        parts = _stored_parts(node.parts, blob_sizes)
        metadata = _metadata(node.role, node.metadata)
        by_key[m.key] = {"id": m.key, "role": node.role, "parts": parts, "metadata": metadata}
        parent[m.key] = m.parent
        if m.parent is not None:
            has_child.add(m.parent)
    lines: list[_Line] = []
    for leaf in (m.key for m in built.messages if m.key not in has_child):
        path: list[Message] = []
        key: str | None = leaf
        while key is not None:
            path.append(by_key[key])
            key = parent[key]
        lines.append(_Line(path[::-1], blob_sizes, markers, main))
    return lines


def _sample(name: str, line: _Line) -> Sample:
    """A path as the ladder takes it: sendable (resume_view), the tool's compaction
    markers taken out and their places noted."""
    view, _ = resume_view(
        [ViewMessage(m["id"], m["role"], m["parts"], m["metadata"]) for m in line.messages]
    )
    calls_before = sum(_count_calls(m["parts"]) for m in line.messages)
    messages: list[Message] = []
    compactions: list[int] = []
    for v in view:
        if v.id in line.markers:
            compactions.append(len(messages))
            continue
        messages.append({"id": v.id, "role": v.role, "parts": v.parts, "metadata": v.metadata})
    dropped = calls_before - sum(_count_calls(v.parts) for v in view)
    blobs = {sha for m in messages for sha in image_blobs(m["parts"])}
    sizes = {sha: size for sha, size in line.blob_sizes.items() if sha in blobs}
    return Sample(name, messages, sizes, compactions, dropped)


def _count_calls(parts: list[dict[str, Any]]) -> int:
    return sum(1 for p in parts if p.get("type") == "tool_call")


def load_pi(path: Path = PI_SAMPLE) -> Sample:
    """The pi sample: one linear session (format v1) with two compactions."""
    [(built, main)] = read_conversations(path, pi.parse)
    [line] = _lines(built, main)
    return _sample("pi", line)


def load_claude_code(path: Path) -> list[Sample]:
    """A Claude Code file: the path with the most text (a sub-agent's, possibly) as
    ``<file>:longest``, and each other path of the main conversation as
    ``<file>:main<n>`` (``n`` counts the main conversation's leaves)."""
    lines = [
        line
        for built, main in read_conversations(path, claude_code.parse)
        for line in _lines(built, main)
    ]
    if not lines:
        return []
    longest = max(lines, key=_Line.chars)
    samples = [_sample(f"{path.stem}:longest", longest)]
    mains = [line for line in lines if line.main]
    samples += [
        _sample(f"{path.stem}:main{n}", line) for n, line in enumerate(mains) if line is not longest
    ]
    return samples


def load_samples() -> list[Sample]:
    """Every real sample the ladder is measured on: pi, then each Claude Code file."""
    samples = [load_pi()]
    for path in sorted(CLAUDE_CODE_DIR.glob("*.jsonl")):
        samples += load_claude_code(path)
    return samples
