"""claude.ai data export (Settings → Privacy → Export data): ``conversations.json``, a list
of conversations ``{uuid, name, summary, created_at, updated_at, account, chat_messages}``
(one conversation object on its own is read too).

- A message is ``{uuid, sender (human/assistant), text, content, created_at, attachments,
  files, …}``. Newer exports link messages by ``parent_message_uuid`` (an edit or a retry
  is a sibling; a root's parent is the all-zero sentinel uuid) and name the tip in
  ``current_leaf_message_uuid``; without it (or when it is not in the file) the tip is the
  newest leaf. Older exports have no parent field: their messages are one line, in file
  order.
- ``content`` blocks are read; ``text`` is the same message flattened (with stand-ins
  such as "This block is not supported on your current device yet" for tool blocks), so
  it is read only when the blocks give nothing, never both.
- claude.ai runs its tools itself and keeps the whole exchange in one assistant message:
  ``tool_use`` and ``tool_result`` blocks between text and thinking. It is split the way
  Arbor stores tool traffic: assistant (… calls) → tool (their results) → assistant (…).
  The last piece keeps the message's uuid, so the children and the tip attach below all
  of it. A call without an ``id`` gets ``<message uuid>:call-<block>``; a result without a
  ``tool_use_id`` answers the earliest unanswered call just above it (one of its name
  first), so the report and resume pair them.
- Attachments' ``extracted_content`` becomes a text part headed with the file name;
  ``files`` (images and uploads) are not in the export: a placeholder names each and the
  report lists it as skipped.
- Citations of text blocks, ``stop_reason``, ``truncated`` and the model go to metadata;
  the conversation's summary, account and project to its first message's metadata.
- Empty placeholder messages (no blocks, text, attachments or files) are left out, their
  children moving up, each named in the report.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conversations.importers.base import (
    ConversationReport,
    ImportReport,
    Limits,
    Node,
    Part,
    SourceConversation,
    as_dict,
    as_list,
    as_str,
    json_text,
    parse_time,
    preview_text,
    text_part,
    thinking_part,
    tool_call_part,
    tool_result_part,
)
from conversations.importers.reading import parse_documents

FORMAT = "claudeai"
# The parent claude.ai gives a conversation's first message (not a message itself).
ROOT_PARENTS = frozenset(
    {"00000000-0000-4000-8000-000000000000", "00000000-0000-0000-0000-000000000000"}
)
ROLES = {"human": "user", "assistant": "assistant"}
# Blocks that hold nothing a reader or a model would miss.
_NO_CONTENT = frozenset({"token_budget"})


def parse(path: Path, *, report: ImportReport, limits: Limits) -> Iterator[SourceConversation]:
    return parse_documents(path, report=report, limits=limits, read=conversation_from)


def conversation_from(doc: Any, index: int, report: ImportReport) -> SourceConversation | None:
    if not isinstance(doc, dict):
        report.skipped.add("corrupt_entry", f"conversation {index}", "not an object: skipped")
        return None
    title = as_str(doc.get("name")).strip()
    source_id = as_str(doc.get("uuid")) or None
    where = f"conversation {index} ({title or source_id or 'untitled'})"
    messages = doc.get("chat_messages")
    if not isinstance(messages, list):
        report.skipped.add("corrupt_entry", where, "it has no chat_messages list: skipped")
        return None
    if not messages:
        report.skipped.add("empty_conversation", where, "it has no messages: skipped")
        return None
    crep = ConversationReport(source_id=source_id, title=title)
    model = as_str(doc.get("model"))
    # Newer exports carry the tree on every message; a file without the field anywhere is
    # an older, linear one.
    tree = any(isinstance(m, dict) and "parent_message_uuid" in m for m in messages)
    nodes: list[Node] = []
    previous: str | None = None
    for order, message in enumerate(messages):
        if not isinstance(message, dict):
            crep.skipped.add("corrupt_entry", f"message {order}", "not an object: skipped")
            continue
        uid = as_str(message.get("uuid"))
        generated = not uid
        if generated:
            uid = f"{source_id or index}:message-{order}"
        parent = previous
        if tree and "parent_message_uuid" in message:
            raw = message.get("parent_message_uuid")
            parent = raw if isinstance(raw, str) and raw and raw not in ROOT_PARENTS else None
        pieces = _Message(uid, message, order, model).nodes(parent)
        if generated:
            pieces[-1].note("missing_id", f"a message without a uuid: given the id {uid}")
        if tree and "parent_message_uuid" not in message:
            pieces[-1].note(
                "missing_parent",
                "no parent_message_uuid: placed after the message before it in the file",
            )
        nodes.extend(pieces)
        previous = uid
    _keep_conversation_fields(doc, nodes, crep)
    tip = doc.get("current_leaf_message_uuid")
    return SourceConversation(
        source_id=source_id,
        title=title or preview_text(_first_user_text(messages)) or "claude.ai conversation",
        nodes=nodes,
        report=crep,
        tip=tip if isinstance(tip, str) and tip else None,
        tip_rule="current_leaf_message_uuid",
        created_at=parse_time(doc.get("created_at")),
    )


def _keep_conversation_fields(
    doc: dict[str, Any], nodes: list[Node], crep: ConversationReport
) -> None:
    """The conversation's own fields Arbor has no column for, on its first message."""
    kept: dict[str, Any] = {}
    for name in ("summary", "updated_at", "project_uuid", "model"):
        value = doc.get(name)
        if isinstance(value, str) and value:
            kept[name] = value
    account = as_str(as_dict(doc.get("account")).get("uuid"))
    if account:
        kept["account"] = account
    if not kept:
        return
    # The first message kept that has no kept message above it (an empty placeholder
    # before it is left out).
    by_key = {n.key: n for n in nodes}

    def is_root(node: Node) -> bool:
        seen: set[str] = set()
        key = node.parent
        while key is not None and key in by_key and key not in seen:
            if by_key[key].skip is None:
                return False
            seen.add(key)
            key = by_key[key].parent
        return True

    first = next((n for n in nodes if n.skip is None and is_root(n)), None)
    if first is None:
        crep.skipped.add(
            "conversation_fields",
            "conversation",
            f"{', '.join(sorted(kept))}: no first message to keep them on",
        )
        return
    first.metadata["conversation"] = kept


def _first_user_text(messages: list[Any]) -> str:
    for message in messages:
        if isinstance(message, dict) and message.get("sender") == "human":
            for block in as_list(message.get("content")):
                text = as_str(as_dict(block).get("text")).strip()
                if as_dict(block).get("type") == "text" and text:
                    return text
            text = as_str(message.get("text")).strip()
            if text:
                return text
    return ""


@dataclass
class _Step:
    role: str  # assistant, tool or user
    parts: list[Part] = field(default_factory=list)
    citations: list[dict[str, Any]] = field(default_factory=list)
    calls: list[tuple[str, str]] = field(default_factory=list)  # (id, name) made here


class _Message:
    """One source message → one or more nodes (an assistant message with tool traffic
    becomes assistant → tool → assistant …)."""

    def __init__(self, uid: str, message: dict[str, Any], order: int, model: str) -> None:
        self.uid = uid
        self.message = message
        self.order = order
        self.model = model
        self.sender = as_str(message.get("sender"))
        self.role = ROLES.get(self.sender)
        self.created = parse_time(message.get("created_at"))
        # Notes go on the node that keeps the source uuid (the last one).
        self.final = Node(uid, None, self.role or "user", [], order=order, created_at=self.created)
        self.steps: list[_Step] = []
        self.answered: set[str] = set()
        self.dropped: Counter[str] = Counter()
        self.generated_ids = 0

    def nodes(self, parent: str | None) -> list[Node]:
        if self.role is None:
            self.final.parent = parent
            self.final.skip = f"a message from sender {self.sender or '(none)'!r} (not supported)"
            return [self.final]
        self._read_content()
        self._read_files()
        for kind, count in sorted(self.dropped.items()):
            self.final.note(
                "content_dropped", f"{count} {kind} block(s) with nothing readable left out"
            )
        if self.generated_ids:
            self.final.note(
                "tool_id_generated",
                f"{self.generated_ids} tool call/result id(s) missing: made from the message "
                "uuid so calls and results pair",
            )
        steps = [s for s in self.steps if s.parts]
        if not steps:
            self.final.parent = parent
            self.final.skip = (
                "an empty placeholder message (no content, text, attachments or files): left out"
            )
            return [self.final]
        out: list[Node] = []
        for i, step in enumerate(steps):
            last = i == len(steps) - 1
            node = self.final if last else Node(f"{self.uid}#{i + 1}", None, step.role, [])
            node.parent = out[-1].key if out else parent
            node.role = step.role
            node.parts = step.parts
            node.order = self.order
            node.created_at = self.created
            node.metadata = self._metadata(step, last, i + 1 if len(steps) > 1 else None)
            out.append(node)
        return out

    def _metadata(self, step: _Step, last: bool, segment: int | None) -> dict[str, Any]:
        source: dict[str, Any] = {"format": FORMAT, "id": self.uid}
        if segment is not None:
            source["segment"] = segment
        meta: dict[str, Any] = {"source": source}
        if step.role == "assistant" and self.model:
            meta["model"] = self.model
        if step.citations:
            meta["citations"] = step.citations
        if not last:
            return meta
        message = self.message
        if isinstance(message.get("stop_reason"), str):
            meta["finish_reason"] = message["stop_reason"]
        if message.get("truncated") is True:
            meta["truncated"] = True
        attachments = [
            {k: a[k] for k in ("file_name", "file_type", "file_size") if k in a}
            for a in map(as_dict, as_list(message.get("attachments")))
            if a
        ]
        if attachments:
            meta["attachments"] = attachments
        files = [
            {k: f[k] for k in ("file_name", "file_uuid", "file_kind") if k in f}
            for f in self._file_entries()
        ]
        if files:
            meta["files"] = files
        return meta

    # -- steps --

    def _step(self, role: str) -> _Step:
        if not self.steps or self.steps[-1].role != role:
            self.steps.append(_Step(role))
        return self.steps[-1]

    def _say(self, part: Part, citations: Any = None) -> None:
        """A part of the message's own voice: the user's, or the assistant's (after any
        tool results, a new assistant piece)."""
        step = self._step("user" if self.role == "user" else "assistant")
        if isinstance(citations, list) and citations:
            step.citations.append({"part": len(step.parts), "citations": citations})
        step.parts.append(part)

    # -- content --

    def _read_content(self) -> None:
        content = self.message.get("content")
        blocks = content if isinstance(content, list) else []
        if isinstance(content, str) and content.strip():
            self._say(text_part(content))
        for i, block in enumerate(blocks):
            if isinstance(block, dict):
                self._block(i, block)
            else:
                self.dropped["non-object"] += 1
        if not any(s.parts for s in self.steps):
            # Nothing readable in the blocks: the flattened text is all there is.
            text = as_str(self.message.get("text"))
            if text.strip():
                self._say(text_part(text))
        self._read_attachments()

    def _block(self, i: int, block: dict[str, Any]) -> None:
        kind = as_str(block.get("type")) or "untyped"
        assistant = self.role == "assistant"
        if kind == "text":
            text = as_str(block.get("text"))
            if text.strip():
                self._say(text_part(text), block.get("citations"))
        elif kind == "thinking" and assistant:
            text = as_str(block.get("thinking")) or "\n".join(
                as_str(as_dict(s).get("summary")) for s in as_list(block.get("summaries"))
            )
            if text.strip():
                self._say(thinking_part(text, block.get("signature")))
        elif kind == "tool_use" and assistant:
            call_id = block.get("id")
            if not isinstance(call_id, str) or not call_id:
                call_id = f"{self.uid}:call-{i}"
                self.generated_ids += 1
            part = tool_call_part(call_id, block.get("name"), block.get("input"))
            self._say(part)
            self.steps[-1].calls.append((part["id"], part["name"]))
        elif kind == "tool_result" and assistant:
            call_id = self._answered_call(i, block)
            parts = self._result_parts(block.get("content"))
            self._step("tool").parts.append(
                tool_result_part(call_id, parts, is_error=block.get("is_error") is True)
            )
        elif kind in _NO_CONTENT:
            return
        elif as_str(block.get("text")).strip():
            # voice_note and other text-bearing blocks
            self._say(text_part(as_str(block["text"])))
        else:
            self.dropped[kind] += 1

    def _answered_call(self, i: int, block: dict[str, Any]) -> str:
        """The call a result answers: its tool_use_id, or else the earliest unanswered
        call of the assistant piece just above (one of the result's name first)."""
        raw = block.get("tool_use_id")
        if isinstance(raw, str) and raw:
            self.answered.add(raw)
            return raw
        self.generated_ids += 1
        # Steps alternate, so this is the piece directly above the run of results: only
        # its calls can pair with them.
        above = next((s for s in reversed(self.steps) if s.role == "assistant"), None)
        open_calls = [c for c in above.calls if c[0] not in self.answered] if above else []
        name = as_str(block.get("name"))
        match = next((c for c in open_calls if c[1] == name), None)
        match = match or (open_calls[0] if open_calls else None)
        if match is None:
            return f"{self.uid}:result-{i}"
        self.answered.add(match[0])
        return match[0]

    def _result_parts(self, content: Any) -> list[Part]:
        if isinstance(content, str):
            return [text_part(content)] if content else []
        parts: list[Part] = []
        for item in as_list(content):
            if isinstance(item, str):
                if item:
                    parts.append(text_part(item))
                continue
            if not isinstance(item, dict):
                continue
            kind = as_str(item.get("type"))
            text = as_str(item.get("text"))
            if kind == "text":
                if text:
                    parts.append(text_part(text))
            elif text:
                # e.g. web search "knowledge" items: keep where the text came from
                head = " ".join(as_str(item.get(k)) for k in ("title", "url") if item.get(k))
                parts.append(text_part(f"[{kind or 'item'}] {head}\n{text}" if head else text))
            elif kind == "image":
                name = as_str(item.get("file_name")) or "an image"
                parts.append(text_part(f"[image {name}: not in the export]"))
                self.final.note(
                    "file_not_in_export",
                    f"{name} in a tool result: the export does not hold it",
                    skipped=True,
                )
            else:
                parts.append(text_part(json_text(item)))
        return parts

    # -- attachments and files --

    def _read_attachments(self) -> None:
        for attachment in map(as_dict, as_list(self.message.get("attachments"))):
            if not attachment:
                continue
            name = as_str(attachment.get("file_name")).strip() or "pasted text"
            bits = [as_str(attachment.get("file_type"))]
            size = attachment.get("file_size")
            if isinstance(size, int) and not isinstance(size, bool):
                bits.append(f"{size} bytes")
            about = ", ".join(b for b in bits if b)
            head = f"[attachment: {name}{f' ({about})' if about else ''}]"
            content = attachment.get("extracted_content")
            if isinstance(content, str):
                self._say(text_part(f"{head}\n{content}" if content else f"{head} (empty)"))
                continue
            self._say(text_part(f"{head}: its content is not in the export"))
            self.final.note(
                "file_not_in_export",
                f"attachment {name!r}: no extracted_content in the export (a placeholder names it)",
                skipped=True,
            )

    def _file_entries(self) -> list[dict[str, Any]]:
        """``files`` and ``files_v2`` (which repeat each other), once each."""
        seen: set[str] = set()
        out: list[dict[str, Any]] = []
        for entry in as_list(self.message.get("files")) + as_list(self.message.get("files_v2")):
            if not isinstance(entry, dict):
                continue
            key = as_str(entry.get("file_uuid")) or as_str(entry.get("file_name"))
            if key and key in seen:
                continue
            seen.add(key)
            out.append(entry)
        return out

    def _read_files(self) -> None:
        # A file whose text came as an attachment is not missing.
        attached = {
            as_str(a.get("file_name"))
            for a in map(as_dict, as_list(self.message.get("attachments")))
            if isinstance(a.get("extracted_content"), str)
        }
        for entry in self._file_entries():
            name = as_str(entry.get("file_name"))
            if name and name in attached:
                continue
            kind = as_str(entry.get("file_kind")) or "file"
            shown = name or as_str(entry.get("file_uuid")) or "unnamed"
            self._say(text_part(f"[{kind} {shown}: not in the export]"))
            self.final.note(
                "file_not_in_export",
                f"{kind} {shown!r}: the export does not hold its bytes (a placeholder names it)",
                skipped=True,
            )
