"""Arbor JSON: the lossless export (``conversations.exporters``), read back verbatim.

Messages carry small local ids (their position in the file) instead of database ids, so
the same file imports any number of times, each time as a new conversation; parts,
metadata, origin and ``created_at`` are kept exactly, and images come from the file's
``blobs``. Export → import → export gives the same bytes.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from conversations.importers.base import (
    ORIGINS,
    ROLES,
    ConversationReport,
    ImportReport,
    Limits,
    Node,
    SourceCheckpoint,
    SourceConversation,
    as_dict,
    as_list,
    as_str,
    image_ref_part,
    parse_time,
)
from conversations.importers.reading import parse_documents

FORMAT = "arbor"
VERSION = 1
CHECKPOINT_STATES = ("live", "dropped")
CHECKPOINT_SOURCES = ("user", "model")


def parse(path: Path, *, report: ImportReport, limits: Limits) -> Iterator[SourceConversation]:
    return parse_documents(path, report=report, limits=limits, read=conversation_from)


def _key(value: Any) -> str | None:
    if isinstance(value, bool) or value is None:
        return None
    return str(value) if isinstance(value, int | str) else None


def conversation_from(doc: Any, index: int, report: ImportReport) -> SourceConversation | None:
    where = f"conversation {index}"
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        report.skipped.add("corrupt_entry", where, "not an Arbor export: skipped")
        return None
    if doc.get("version") != VERSION:
        report.skipped.add(
            "unsupported_version", where, f"Arbor JSON version {doc.get('version')!r}: skipped"
        )
        return None
    info = as_dict(doc.get("conversation"))
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        report.skipped.add("corrupt_entry", where, "no messages: skipped")
        return None
    crep = ConversationReport(source_id=None, title=as_str(info.get("title")))
    nodes: list[Node] = []
    for order, item in enumerate(messages):
        if not isinstance(item, dict) or _key(item.get("id")) is None:
            crep.skipped.add("corrupt_entry", f"message {order}", "not a message: skipped")
            continue
        key = str(_key(item.get("id")))
        role = item.get("role")
        parts = item.get("parts")
        node = Node(
            key,
            _key(item.get("parent")),
            role if isinstance(role, str) else "",
            [_part(p, key) for p in parts] if isinstance(parts, list) else [],
            metadata=item["metadata"] if isinstance(item.get("metadata"), dict) else {},
            created_at=parse_time(item.get("created_at")),
            order=order,
            origin=item["origin"] if item.get("origin") in ORIGINS else "import",
        )
        if role not in ROLES:
            node.skip = f"role {role!r} is not one of {list(ROLES)}"
        nodes.append(node)
    blobs: dict[str, bytes] = {}
    for item in as_list(doc.get("blobs")):
        sha = as_str(item.get("sha256")) if isinstance(item, dict) else ""
        try:
            blobs[sha] = base64.b64decode(as_str(item.get("data")), validate=True)
        except (binascii.Error, ValueError, AttributeError):
            crep.repaired.add("image_not_imported", f"blob {sha[:12]}", "its base64 is corrupt")
    checkpoints = []
    for item in as_list(doc.get("checkpoints")):
        if not isinstance(item, dict) or _key(item.get("message")) is None:
            crep.skipped.add("checkpoint", "checkpoint", "not a checkpoint: skipped")
            continue
        checkpoints.append(
            SourceCheckpoint(
                label=as_str(item.get("label")),
                message=str(_key(item.get("message"))),
                state=item["state"] if item.get("state") in CHECKPOINT_STATES else "live",
                reason=as_str(item.get("reason")),
                source=item["source"] if item.get("source") in CHECKPOINT_SOURCES else "user",
                digest_message=_key(item.get("digest_message")),
            )
        )
    return SourceConversation(
        source_id=None,
        title=as_str(info.get("title")),
        nodes=nodes,
        report=crep,
        tip=_key(doc.get("tip")),
        tip_rule="tip",
        created_at=parse_time(info.get("created_at")),
        model=as_str(info.get("model")),
        system_prompt=as_str(info.get("system_prompt")),
        checkpoints=checkpoints,
        blob_data=blobs,
        verbatim=True,
    )


def _part(part: Any, key: str) -> Any:
    if isinstance(part, dict) and part.get("type") == "image":
        return image_ref_part(as_str(part.get("blob")), f"message {key}")
    if isinstance(part, dict) and part.get("type") == "tool_result":
        inner = part.get("parts")
        if isinstance(inner, list):
            return {**part, "parts": [_part(p, key) for p in inner]}
    return part
