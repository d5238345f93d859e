"""pi coding-agent sessions (``~/.pi/agent/sessions/…/*.jsonl``).

Version 1 is a linear list of entries (each follows the one before); versions 2 and 3
link entries with ``id``/``parentId`` into a tree. Both are read here, entry by entry.

- ``message`` entries: ``user``, ``assistant`` (text, thinking, toolCall),
  ``toolResult`` (a tool message; images go to the blob store), ``bashExecution`` (a
  user message showing the command and its output), ``custom``/``hookMessage``.
- ``compaction`` entries become compaction markers: a system message holding the summary,
  with ``metadata.compaction_marker`` {tokens_before, first_kept, …}.
- ``branch_summary`` becomes a user message (pi sends it to the model as one).
- ``label`` entries become checkpoints on their target (when it is a turn boundary);
  ``session_info`` names the conversation; other entries (model or thinking-level
  changes, extension state) are not messages and are left out, reported.
- There is no stored current node: the tip is the newest leaf (the leaf written last),
  which is where pi itself resumes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from conversations.importers.base import (
    ConversationReport,
    FileIssues,
    ImportReport,
    Limits,
    Node,
    Part,
    SourceCheckpoint,
    SourceConversation,
    as_str,
    block_parts,
    first_text,
    json_text,
    nonempty_text,
    parse_time,
    preview_text,
    text_part,
    thinking_part,
    tool_call_part,
    tool_result_part,
)
from conversations.importers.media import b64_image
from conversations.importers.reading import iter_jsonl

FORMAT = "pi"


def parse(path: Path, *, report: ImportReport, limits: Limits) -> Iterator[SourceConversation]:
    header: dict[str, Any] = {}
    nodes: list[Node] = []
    labels: dict[str, str | None] = {}
    name = ""
    previous: str | None = None
    index = 0
    for lineno, entry in iter_jsonl(path, issues=FileIssues(report), limits=limits):
        kind = as_str(entry.get("type"))
        if kind == "session" and not header and not nodes:
            header = entry
            continue
        index += 1
        entry_id = entry.get("id")
        if isinstance(entry_id, str) and entry_id:
            key = entry_id
            raw_parent = entry.get("parentId")
            parent = raw_parent if isinstance(raw_parent, str) and raw_parent else None
        else:  # version 1: linear
            key = f"entry-{index}"
            parent = previous
        node = Node(
            key, parent, "user", [], order=index, created_at=parse_time(entry.get("timestamp"))
        )
        node.metadata = {"source": {"format": FORMAT, "id": key, "line": lineno}}
        if kind == "message":
            _message(node, entry.get("message"))
        elif kind == "compaction":
            _compaction(node, entry)
        elif kind == "branch_summary":
            _branch_summary(node, entry)  # the same fields as the message role
        elif kind == "custom_message":
            _custom_message(node, entry)
        elif kind == "label":
            target = entry.get("targetId")
            if isinstance(target, str):
                label = entry.get("label")
                labels[target] = label if isinstance(label, str) and label.strip() else None
            node.skip = "a label entry (kept as a checkpoint on its target)"
        elif kind == "session_info":
            name = as_str(entry.get("name")) or name
            node.skip = "a session_info entry (its name is the title)"
        else:
            node.skip = f"a {kind or 'untyped'} entry (not a message)"
        nodes.append(node)
        previous = key
    if not nodes:
        report.skipped.add("empty", "file", "no entries after the session header")
        return
    session_id = as_str(header.get("id")) or None
    checkpoints = [
        SourceCheckpoint(label=label, message=target) for target, label in labels.items() if label
    ]
    yield SourceConversation(
        source_id=session_id,
        title=name or preview_text(first_text(nodes)) or "pi session",
        nodes=nodes,
        report=ConversationReport(source_id=session_id),
        created_at=parse_time(header.get("timestamp")),
        checkpoints=checkpoints,
    )


def _message(node: Node, message: Any) -> None:
    if not isinstance(message, dict):
        node.skip = "a message entry without a message"
        return
    role = as_str(message.get("role"))
    created = parse_time(message.get("timestamp"))
    node.created_at = node.created_at or created
    reader = _MESSAGE_READERS.get(role)
    if reader is None:
        node.skip = f"a message with role {role!r} (not supported)"
        return
    reader(node, message)


def _user_message(node: Node, message: dict[str, Any]) -> None:
    node.parts = _user_content(message.get("content"), node)


# Assistant message fields kept as metadata: metadata key, pi field.
_ASSISTANT_FIELDS = (
    ("model", "model"),
    ("provider", "provider"),
    ("api", "api"),
    ("stop_reason", "stopReason"),
    ("usage", "usage"),
    ("error", "errorMessage"),
)


def _assistant_message(node: Node, message: dict[str, Any]) -> None:
    node.role = "assistant"
    node.parts = _assistant_content(message.get("content"), node)
    for key, field in _ASSISTANT_FIELDS:
        if message.get(field) is not None:
            node.metadata[key] = message[field]
    if not node.parts:
        node.skip = f"an empty assistant message (stopReason {message.get('stopReason')!r})"


def _tool_result_message(node: Node, message: dict[str, Any]) -> None:
    node.role = "tool"
    node.metadata["tool_name"] = as_str(message.get("toolName"))
    inner = _user_content(message.get("content"), node)
    node.parts = [
        tool_result_part(message.get("toolCallId"), inner, is_error=message.get("isError") is True)
    ]


def _bash_message(node: Node, message: dict[str, Any]) -> None:
    # A command the user ran in pi's shell: shown to the model as a user message.
    command = as_str(message.get("command"))
    output = as_str(message.get("output"))
    code = message.get("exitCode")
    text = f"Ran `{command}`\n```\n{output}\n```"
    if code not in (None, 0):
        text += f"\nExit code {code}"
    if message.get("cancelled"):
        text += "\n(cancelled)"
    node.parts = [text_part(text)]
    node.metadata["bash_execution"] = {
        "exit_code": code,
        "cancelled": bool(message.get("cancelled")),
        "truncated": bool(message.get("truncated")),
        "exclude_from_context": bool(message.get("excludeFromContext")),
    }


def _custom_message(node: Node, message: dict[str, Any]) -> None:
    node.parts = _user_content(message.get("content"), node)
    node.metadata["custom_type"] = as_str(message.get("customType"))


def _branch_summary(node: Node, message: dict[str, Any]) -> None:
    node.parts = [text_part(f"[Summary of a branch left behind]\n{as_str(message.get('summary'))}")]
    node.metadata["branch_summary"] = {"from_id": message.get("fromId")}


def _compaction(node: Node, entry: dict[str, Any]) -> None:
    summary = as_str(entry.get("summary"))
    tokens = entry.get("tokensBefore")
    first_kept = entry.get("firstKeptEntryId", entry.get("firstKeptEntryIndex"))
    node.role = "system"
    head = "[Conversation compacted here"
    head += f" ({tokens} tokens before)" if tokens is not None else ""
    node.parts = [text_part(f"{head}. Summary of what came before:]\n\n{summary}")]
    node.metadata["compaction_marker"] = {
        "format": FORMAT,
        "tokens_before": tokens if isinstance(tokens, int) else None,
        "first_kept": first_kept if isinstance(first_kept, str | int) else None,
        "summary_included": bool(summary),
    }


# The reader of each message role; any other role is left out, reported.
_MESSAGE_READERS: dict[str, Callable[[Node, dict[str, Any]], None]] = {
    "user": _user_message,
    "assistant": _assistant_message,
    "toolResult": _tool_result_message,
    "bashExecution": _bash_message,
    "custom": _custom_message,
    "hookMessage": _custom_message,
    "branchSummary": _branch_summary,
    "compactionSummary": _compaction,
}


def _image(block: dict[str, Any], node: Node) -> Part:
    return b64_image(block.get("data"), block.get("mimeType"), node, "image block")


def _user_content(content: Any, node: Node) -> list[Part]:
    # pi keeps empty text blocks, and any other block as its JSON.
    return block_parts(
        content,
        {
            "text": lambda b: text_part(as_str(b.get("text"))),
            "image": lambda b: _image(b, node),
        },
        lambda b: text_part(json_text(b)),
    )


def _assistant_content(content: Any, node: Node) -> list[Part]:
    def left_out(block: dict[str, Any]) -> None:
        node.note("content_dropped", f"a {block.get('type')} block left out")

    return block_parts(
        content,
        {
            "text": nonempty_text,
            "thinking": lambda b: thinking_part(
                as_str(b.get("thinking")), b.get("thinkingSignature") or None
            ),
            "toolCall": lambda b: tool_call_part(b.get("id"), b.get("name"), b.get("arguments")),
        },
        left_out,
    )
