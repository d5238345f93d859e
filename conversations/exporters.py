"""Exports of one conversation: Arbor JSON (lossless), ChatGPT-style conversations.json
(the whole tree), Markdown (the current branch), and the session files Claude Code and
pi resume (``conversations.session_export``). ``tip`` picks the branch (the
conversation's tip by default): the current node of the JSON formats, the path Markdown
shows, where the harnesses resume.

Arbor JSON holds no database ids and no time of export: messages get local ids (their
position in a depth-first walk, siblings by (created_at, id)), the tip and checkpoints
name those, images travel inline as base64. Importing it keeps parts, metadata, origin
and created_at and gives the new messages ids that sort in file order, so export →
import → export is byte-identical. Layout: one JSON object, keys sorted, one message or
blob per line (readable diffs)::

    {"format":"arbor","version":1,
    "conversation":{"created_at":…,"model":…,"system_prompt":…,"title":…},
    "tip":7,
    "checkpoints":[{"digest_message":null,"label":"start","message":3,…}],
    "messages":[
    {"created_at":"2025-01-01T00:00:00.000000Z","id":0,"metadata":{},"origin":"turn",
     "parent":null,"parts":[…],"role":"user"},
    …
    ],
    "blobs":[
    {"data":"iVBOR…","mime":"image/png","sha256":"…"}
    ]}
"""

from __future__ import annotations

import base64
import json
import re
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from conversations import selectors, session_export
from conversations.errors import InvalidInput, NotFound
from conversations.importers.base import format_time
from conversations.importers.chatgpt import ARBOR_BLOB_PREFIX
from conversations.models import Blob, Conversation, Message
from conversations.parts import image_blobs

EXPORT_FORMATS = ("arbor", "chatgpt", "markdown", "claude-code", "pi")


@dataclass(frozen=True)
class Export:
    content: bytes
    content_type: str
    filename: str


def conversation_export(
    *,
    conversation: Conversation,
    format: str = "arbor",
    tip: str | uuid.UUID | None = None,
    cwd: str | None = None,
) -> Export:
    """``cwd`` is the working directory written into a Claude Code or pi session (where
    the tool runs; default ``/``)."""
    if format not in EXPORT_FORMATS:
        raise InvalidInput(
            f"format must be one of {list(EXPORT_FORMATS)}, not {format!r}", code="bad_format"
        )
    tip_id = _tip(conversation, tip)
    if format in ("claude-code", "pi"):
        write = (
            session_export.claude_code_session
            if format == "claude-code"
            else session_export.pi_session
        )
        session = write(conversation=conversation, tip=tip_id, cwd=session_export.check_cwd(cwd))
        return Export(session.content, "application/x-ndjson", f"{session.session_id}.jsonl")
    stem = _slug(conversation.title) or "conversation"
    stem = f"{stem}-{str(conversation.pk)[:8]}"
    if format == "arbor":
        return Export(arbor_json(conversation, tip_id), "application/json", f"{stem}.arbor.json")
    if format == "chatgpt":
        return Export(
            chatgpt_json(conversation, tip_id), "application/json", f"{stem}.chatgpt.json"
        )
    return Export(
        _encode(markdown(conversation, tip_id)), "text/markdown; charset=utf-8", f"{stem}.md"
    )


def _tip(conversation: Conversation, tip: str | uuid.UUID | None) -> uuid.UUID | None:
    """The chosen tip (a message of this conversation), or the conversation's own."""
    if tip is None or tip == "":
        return conversation.tip_id
    try:
        mid = tip if isinstance(tip, uuid.UUID) else uuid.UUID(str(tip))
    except ValueError:
        raise NotFound(f"no such message: {tip!r}") from None
    if not Message.objects.filter(pk=mid, conversation_id=conversation.pk).exists():
        raise NotFound(f"no such message in this conversation: {mid}")
    return mid


def _slug(title: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", title).strip("-").lower()[:60]


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def _encode(text: str) -> bytes:
    # A lone surrogate (possible on SQLite, never on PostgreSQL) is written as its JSON
    # escape rather than failing the whole export.
    return text.encode("utf-8", errors="backslashreplace")


def ordered_messages(conversation: Conversation) -> list[Message]:
    """Every message, depth-first from the roots, siblings by (created_at, id): parents
    always come before their children."""
    # The search text is derived from the parts (an import recomputes it): not exported.
    rows = list(
        Message.objects.filter(conversation=conversation)
        .defer("search_text")
        .order_by("created_at", "id")
    )
    children: dict[Any, list[Message]] = {}
    for row in rows:
        children.setdefault(row.parent_id, []).append(row)
    out: list[Message] = []
    stack = list(reversed(children.get(None, [])))
    while stack:
        row = stack.pop()
        out.append(row)
        stack.extend(reversed(children.get(row.id, [])))
    return out


def _blobs(messages: list[Message]) -> list[Blob]:
    wanted = {sha for m in messages for sha in image_blobs(m.parts)}
    return list(Blob.objects.filter(sha256__in=wanted).order_by("sha256")) if wanted else []


# --- Arbor JSON ----------------------------------------------------------------------


def arbor_json(conversation: Conversation, tip_id: uuid.UUID | None = None) -> bytes:
    tip_id = tip_id or conversation.tip_id
    messages = ordered_messages(conversation)
    local = {m.id: i for i, m in enumerate(messages)}
    head = {
        "created_at": format_time(conversation.created_at),
        "model": conversation.model,
        "system_prompt": conversation.system_prompt,
        "title": conversation.title,
    }
    checkpoints = [
        {
            "digest_message": local.get(cp.digest_message_id) if cp.digest_message_id else None,
            "label": cp.label,
            "message": local[cp.message_id],
            "reason": cp.reason,
            "source": cp.source,
            "state": cp.state,
        }
        for cp in selectors.checkpoint_list(conversation=conversation)
        if cp.message_id in local
    ]
    lines = [
        '{"format":"arbor","version":1,',
        f'"conversation":{_dump(head)},',
        f'"tip":{_dump(local.get(tip_id) if tip_id else None)},',
        f'"checkpoints":{_dump(checkpoints)},',
        '"messages":[',
    ]
    rendered = [
        _dump(
            {
                "created_at": format_time(m.created_at),
                "id": local[m.id],
                "metadata": m.metadata,
                "origin": m.origin,
                "parent": local[m.parent_id] if m.parent_id else None,
                "parts": m.parts,
                "role": m.role,
            }
        )
        for m in messages
    ]
    lines.append(",\n".join(rendered))
    lines.append("],")
    lines.append('"blobs":[')
    blobs = []
    for blob in _blobs(messages):
        try:
            with blob.file.open("rb") as handle:
                data = handle.read()
        except OSError:  # the file is gone from storage: the import will say so
            continue
        blobs.append(
            _dump(
                {"data": base64.b64encode(data).decode(), "mime": blob.mime, "sha256": blob.sha256}
            )
        )
    lines.append(",\n".join(blobs))
    lines.append("]}")
    return _encode("\n".join(line for line in lines if line) + "\n")


# --- ChatGPT conversations.json ------------------------------------------------------

CHATGPT_ROOT = "client-created-root"


def _epoch(value: datetime | None) -> float | None:
    return value.timestamp() if value else None


def _part_text(part: dict[str, Any]) -> str:
    kind = part.get("type")
    if kind == "text":
        return str(part.get("text", ""))
    if kind == "tool_call":
        return f"[tool call {part.get('name')}: {json.dumps(part.get('arguments', {}))}]"
    if kind == "tool_result":
        inner = "\n".join(_part_text(p) for p in part.get("parts", []))
        return ("[error] " if part.get("is_error") else "") + inner
    if kind == "image":
        return f"[image {part.get('blob')}]"
    return ""


def _chatgpt_message(m: Message, tool_names: dict[str, str]) -> dict[str, Any]:
    parts = m.parts
    author: dict[str, Any] = {"role": m.role, "name": None, "metadata": {}}
    recipient = "all"
    calls = [p for p in parts if p.get("type") == "tool_call"]
    content: dict[str, Any]
    if m.role == "assistant" and len(parts) == 1 and calls:
        recipient = calls[0]["name"]
        content = {
            "content_type": "code",
            "language": "json",
            "text": json.dumps(calls[0].get("arguments", {}), ensure_ascii=False),
        }
    elif any(p.get("type") == "image" for p in parts):
        items: list[Any] = []
        for p in parts:
            if p.get("type") == "image":
                items.append(
                    {
                        "content_type": "image_asset_pointer",
                        "asset_pointer": ARBOR_BLOB_PREFIX + str(p.get("blob")),
                        "width": p.get("width"),
                        "height": p.get("height"),
                        "size_bytes": None,
                    }
                )
            elif p.get("type") != "thinking":
                items.append(_part_text(p))
        content = {"content_type": "multimodal_text", "parts": items}
    else:
        texts = [_part_text(p) for p in parts if p.get("type") != "thinking"]
        content = {"content_type": "text", "parts": texts or [""]}
    if m.role == "tool":
        results = [p for p in parts if p.get("type") == "tool_result"]
        if results:
            author["name"] = tool_names.get(results[0].get("call_id", ""))
    metadata: dict[str, Any] = {
        "arbor": {"parts": parts, "origin": m.origin, "metadata": m.metadata},
    }
    if isinstance(m.metadata.get("model"), str):
        metadata["model_slug"] = m.metadata["model"]
    if m.metadata.get("hidden"):
        metadata["is_visually_hidden_from_conversation"] = True
    return {
        "id": str(m.id),
        "author": author,
        "create_time": _epoch(m.created_at),
        "update_time": None,
        "content": content,
        "status": "finished_successfully",
        "end_turn": None,
        "weight": 1.0,
        "metadata": metadata,
        "recipient": recipient,
        "channel": None,
    }


def chatgpt_json(conversation: Conversation, tip_id: uuid.UUID | None = None) -> bytes:
    """The whole tree in the shape of ChatGPT's conversations.json (a list holding this
    one conversation). Each message also keeps its exact Arbor parts under
    ``metadata.arbor``, which Arbor's ChatGPT importer reads back."""
    tip_id = tip_id or conversation.tip_id
    messages = ordered_messages(conversation)
    tool_names = {
        p["id"]: p["name"] for m in messages for p in m.parts if p.get("type") == "tool_call"
    }
    children: dict[str, list[str]] = {CHATGPT_ROOT: []}
    for m in messages:
        children.setdefault(str(m.parent_id) if m.parent_id else CHATGPT_ROOT, []).append(str(m.id))
    mapping: dict[str, Any] = {
        CHATGPT_ROOT: {
            "id": CHATGPT_ROOT,
            "message": None,
            "parent": None,
            "children": children[CHATGPT_ROOT],
        }
    }
    for m in messages:
        mapping[str(m.id)] = {
            "id": str(m.id),
            "message": _chatgpt_message(m, tool_names),
            "parent": str(m.parent_id) if m.parent_id else CHATGPT_ROOT,
            "children": children.get(str(m.id), []),
        }
    doc: list[dict[str, Any]] = [
        {
            "title": conversation.title,
            "create_time": _epoch(conversation.created_at),
            "update_time": _epoch(conversation.updated_at),
            "mapping": mapping,
            "moderation_results": [],
            "current_node": str(tip_id) if tip_id else None,
            "conversation_id": str(conversation.pk),
            "id": str(conversation.pk),
            "default_model_slug": conversation.model or None,
        }
    ]
    return _encode(json.dumps(doc, ensure_ascii=False, indent=1) + "\n")


# --- Markdown ------------------------------------------------------------------------


def _fence(text: str, info: str = "") -> str:
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    ticks = "`" * max(3, longest + 1)
    return f"{ticks}{info}\n{text}\n{ticks}"


def _markdown_part(part: dict[str, Any]) -> str:
    kind = part.get("type")
    if kind == "text":
        return str(part.get("text", ""))
    if kind == "thinking":
        quoted = "\n".join("> " + line for line in str(part.get("text", "")).split("\n"))
        return f"> **Thinking**\n>\n{quoted}"
    if kind == "image":
        size = f" {part.get('width')}×{part.get('height')}" if part.get("width") else ""
        return f"![image{size}](/api/blobs/{part.get('blob')})"
    if kind == "tool_call":
        args = json.dumps(part.get("arguments", {}), ensure_ascii=False, indent=2)
        return f"**Tool call** `{part.get('name')}` ({part.get('id')})\n\n{_fence(args, 'json')}"
    if kind == "tool_result":
        label = "**Tool error**" if part.get("is_error") else "**Tool result**"
        inner = [_markdown_part(p) for p in part.get("parts", [])]
        texts = [p.get("text", "") for p in part.get("parts", []) if p.get("type") == "text"]
        images = [
            t for p, t in zip(part.get("parts", []), inner, strict=True) if p["type"] == "image"
        ]
        body = _fence("\n".join(texts)) if texts else ""
        return "\n\n".join(x for x in [f"{label} for {part.get('call_id')}", body, *images] if x)
    return ""


def markdown(conversation: Conversation, tip_id: uuid.UUID | None = None) -> str:
    """The current branch (root → tip) as Markdown."""
    tip_id = tip_id or conversation.tip_id
    path = selectors.message_path(conversation_id=conversation.pk, tip_id=tip_id)
    title = conversation.title or "Conversation"
    lines = [f"# {title}", "", f"_{len(path)} messages on the current branch._", ""]
    if conversation.system_prompt:
        lines += ["## System prompt", "", conversation.system_prompt, ""]
    for m in path:
        lines += [f"## {m.role.capitalize()}", ""]
        for part in m.parts:
            rendered = _markdown_part(part)
            if rendered:
                lines += [rendered, ""]
    return "\n".join(lines).rstrip() + "\n"
