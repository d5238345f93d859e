"""Open WebUI chats: one chat (``{history: {messages, currentId}, …}``, or a row
``{chat: {…}}``) or "export all" (a list of rows).

- ``history.messages`` is a map of ``{id, parentId, role, content, …}``; ``currentId`` is
  the tip. An old chat with only the flat ``messages`` list is read as a linear chain.
- An assistant message with Responses-style ``output[]`` items is split the way Arbor
  stores tool traffic: reasoning → thinking, ``function_call`` → a tool call, its
  ``function_call_output`` → a tool message, then the answer text as a new assistant
  message. Without ``output``, ``<details type="reasoning">`` in ``content`` becomes a
  thinking part and ``<details type="tool_calls">`` with its attributes a call/result
  pair.
- Images attached as ``files`` with data: URLs go to the blob store.
- Text is kept as written: some exports came through an SQL dump and show doubled
  apostrophes (``you''re``); they are not "fixed", since a real '' cannot be told apart.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterator
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
    as_str,
    first_text,
    json_text,
    parse_time,
    preview_text,
    text_part,
    thinking_part,
    tool_call_part,
    tool_result_part,
)
from conversations.importers.media import url_image
from conversations.importers.reading import parse_documents

FORMAT = "openwebui"
# ``<details …>body</details>`` and ``<summary>…</summary>`` are found tag by tag
# (``_blocks``), not with ``<details\b[^>]*>.*?</details>``: that regex rescans to the
# end of the text from every opening without a closing tag (16,000 of them in 140 KB
# took a minute). An attribute name is tried only where a name can begin, for the same
# reason (``[\w-]+="`` from each letter of a long word).
_DETAILS_OPEN = re.compile(r"<details\b", re.IGNORECASE)
_DETAILS_CLOSE = re.compile(r"</details>", re.IGNORECASE)
_SUMMARY_OPEN = re.compile(r"<summary>", re.IGNORECASE)
_SUMMARY_CLOSE = re.compile(r"</summary>", re.IGNORECASE)
_ATTR = re.compile(r'(?<![\w-])([\w-]+)="([^"]*)"')


def parse(path: Path, *, report: ImportReport, limits: Limits) -> Iterator[SourceConversation]:
    return parse_documents(path, report=report, limits=limits, read=conversation_from)


def conversation_from(doc: Any, index: int, report: ImportReport) -> SourceConversation | None:
    if not isinstance(doc, dict):
        report.skipped.add("corrupt_entry", f"chat {index}", "not an object: skipped")
        return None
    chat = doc["chat"] if isinstance(doc.get("chat"), dict) else doc
    title = as_str(doc.get("title")) or as_str(chat.get("title"))
    source_id = as_str(doc.get("id")) or as_str(chat.get("id")) or None
    history = as_dict(chat.get("history"))
    raw = history.get("messages")
    tip: str | None = None
    # (key, message, linear, parent when linear)
    items: list[tuple[str, Any, bool, str | None]] = []
    if isinstance(raw, dict) and raw:
        items = [(str(k), v, False, None) for k, v in raw.items()]
        current = history.get("currentId")
        tip = str(current) if isinstance(current, str | int) and current != "" else None
    elif isinstance(chat.get("messages"), list) and chat["messages"]:
        previous: str | None = None
        for i, message in enumerate(chat["messages"]):
            key = str(message.get("id") or f"m{i}") if isinstance(message, dict) else f"m{i}"
            items.append((key, message, True, previous))
            previous = key
    else:
        report.skipped.add(
            "corrupt_entry", f"chat {index} ({title or source_id})", "no messages: skipped"
        )
        return None
    crep = ConversationReport(source_id=source_id, title=title)
    nodes: list[Node] = []
    aliases: dict[str, str] = {}
    for order, (key, message, linear, previous_key) in enumerate(items):
        if not isinstance(message, dict):
            crep.skipped.add("corrupt_entry", f"message {key}", "not an object: skipped")
            continue
        parent_key = previous_key
        if not linear:
            parent = message.get("parentId")
            parent_key = str(parent) if isinstance(parent, str | int) and parent != "" else None
        nodes.extend(_nodes(key, parent_key, message, order))
    created = parse_time(doc.get("created_at")) or parse_time(chat.get("timestamp"))
    return SourceConversation(
        source_id=source_id,
        title=title or preview_text(first_text(nodes)) or "Open WebUI chat",
        nodes=nodes,
        report=crep,
        tip=tip,
        tip_rule="history.currentId",
        created_at=created,
        aliases=aliases,
    )


def _metadata(key: str, message: dict[str, Any]) -> dict[str, Any]:
    meta: dict[str, Any] = {"source": {"format": FORMAT, "id": key}}
    for name, field in (("model", "model"), ("model_name", "modelName"), ("usage", "usage")):
        if message.get(field) is not None:
            meta[name] = message[field]
    if message.get("done") is False:
        meta["status"] = "incomplete"
    return meta


def _nodes(key: str, parent: str | None, message: dict[str, Any], order: int) -> list[Node]:
    """One source message → one or more Arbor messages (an assistant turn with tool
    traffic becomes assistant → tool → assistant). The last keeps the source id, so the
    source's children attach below all of them."""
    role = as_str(message.get("role"))
    created = parse_time(message.get("timestamp"))
    content = as_str(message.get("content"))
    if role in ("user", "system"):
        node = Node(key, parent, role, [], order=order, created_at=created)
        node.metadata = _metadata(key, message)
        node.parts = [text_part(content)] if content else []
        if role == "user":
            node.parts += _files(message.get("files"), node)
        return [node]
    if role != "assistant":
        node = Node(key, parent, "user", [], order=order, created_at=created)
        node.skip = f"a message with role {role!r} (not supported)"
        return [node]
    output = message.get("output")
    steps = _from_output(output) if isinstance(output, list) and output else _from_content(content)
    if (
        isinstance(output, list)
        and output
        and not any(
            p.get("type") == "text" for kind, parts in steps if kind == "assistant" for p in parts
        )
    ):
        steps = _with_content_text(steps, content)
    steps = _merge_steps(steps) or [("assistant", [])]
    nodes: list[Node] = []
    for i, (kind, parts) in enumerate(steps):
        last = i == len(steps) - 1
        node_key = key if last else f"{key}#{i + 1}"
        node = Node(
            node_key,
            nodes[-1].key if nodes else parent,
            kind,
            parts,
            order=order,
            created_at=created,
        )
        node.metadata = (
            _metadata(key, message) if last else {"source": {"format": FORMAT, "id": key}}
        )
        nodes.append(node)
    return nodes


def _merge_steps(steps: list[tuple[str, list[Part]]]) -> list[tuple[str, list[Part]]]:
    """Consecutive assistant steps become one message; so do consecutive tool steps."""
    merged: list[tuple[str, list[Part]]] = []
    for kind, parts in steps:
        if not parts:
            continue
        if merged and merged[-1][0] == kind:
            merged[-1][1].extend(parts)
        else:
            merged.append((kind, list(parts)))
    return merged


def _output_text(items: Any) -> str:
    texts = []
    for item in items if isinstance(items, list) else []:
        if isinstance(item, dict) and isinstance(item.get("text"), str):
            texts.append(item["text"])
        elif isinstance(item, str):
            texts.append(item)
    return "\n".join(texts)


def _from_output(output: list[Any]) -> list[tuple[str, list[Part]]]:
    steps: list[tuple[str, list[Part]]] = []
    for item in output:
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "reasoning":
            text = _output_text(item.get("content")) or _output_text(item.get("summary"))
            if text:
                steps.append(("assistant", [thinking_part(text)]))
        elif kind == "message":
            text = _output_text(item.get("content"))
            if text:
                steps.append(("assistant", [text_part(text)]))
        elif kind == "function_call":
            call_id = item.get("call_id") or item.get("id")
            steps.append(
                ("assistant", [tool_call_part(call_id, item.get("name"), item.get("arguments"))])
            )
        elif kind == "function_call_output":
            out = item.get("output")
            text = _output_text(out) if isinstance(out, list) else as_str(out) or json_text(out)
            is_error = item.get("status") not in (None, "completed")
            steps.append(
                (
                    "tool",
                    [tool_result_part(item.get("call_id"), [text_part(text)], is_error=is_error)],
                )
            )
    return steps


def _blocks(
    text: str, opening: re.Pattern[str], closing: re.Pattern[str], *, head: bool
) -> Iterator[tuple[int, int, str, str]]:
    """Each ``<tag …>body</tag>`` of ``text`` as (start, end, attributes, body): the first
    closing tag after an opening one ends it (nesting is not counted), and the text after
    a block is searched from its end. With ``head``, the opening tag's attributes run to
    its first ``>``. One pass: once an opening has no ``>`` or no closing tag after it, no
    later one has."""
    pos = 0
    while (found := opening.search(text, pos)) is not None:
        start = inside = found.end()
        if head:
            inside = text.find(">", start) + 1
            if not inside:
                return
        close = closing.search(text, inside)
        if close is None:
            return
        attributes = text[start : inside - 1] if head else ""
        yield found.start(), close.end(), attributes, text[inside : close.start()]
        pos = close.end()


def _without_summaries(body: str) -> str:
    pieces, at = [], 0
    for start, end, _, _ in _blocks(body, _SUMMARY_OPEN, _SUMMARY_CLOSE, head=False):
        pieces.append(body[at:start])
        at = end
    pieces.append(body[at:])
    return "".join(pieces)


def _segments(content: str) -> list[tuple[str, str, dict[str, str]]]:
    """``content`` in order: ("text", text, {}) for the prose between ``<details>``
    blocks and ("details", body, attributes) for each block."""
    out: list[tuple[str, str, dict[str, str]]] = []
    at = 0
    for start, end, head, body in _blocks(content, _DETAILS_OPEN, _DETAILS_CLOSE, head=True):
        attrs = dict(_ATTR.findall(head))
        if attrs.get("type") not in ("reasoning", "tool_calls"):
            continue  # a <details> the model wrote, or one of another kind: kept as text
        text = content[at:start].strip()
        if text:
            out.append(("text", text, {}))
        out.append(("details", body, attrs))
        at = end
    text = content[at:].strip()
    if text:
        out.append(("text", text, {}))
    return out


def _from_content(content: str) -> list[tuple[str, list[Part]]]:
    """The rendered ``content`` as steps, in the order it was written: prose, thinking,
    tool call and result."""
    steps: list[tuple[str, list[Part]]] = []
    for kind, body, attrs in _segments(content):
        if kind == "text":
            steps.append(("assistant", [text_part(body)]))
            continue
        body = html.unescape(_without_summaries(body)).strip()
        if attrs.get("type") == "reasoning":
            lines = [ln[2:] if ln.startswith("> ") else ln.lstrip(">") for ln in body.split("\n")]
            steps.append(("assistant", [thinking_part("\n".join(lines).strip())]))
        elif attrs.get("type") == "tool_calls" and attrs.get("id") and attrs.get("name"):
            arguments = html.unescape(attrs.get("arguments", ""))
            result = html.unescape(attrs.get("result", "")) or body
            steps.append(("assistant", [tool_call_part(attrs["id"], attrs["name"], arguments)]))
            steps.append(("tool", [tool_result_part(attrs["id"], [text_part(result)])]))
    return steps


def _with_content_text(
    steps: list[tuple[str, list[Part]]], content: str
) -> list[tuple[str, list[Part]]]:
    """``output[]`` steps (no message item) with the prose of ``content`` put where it
    was written: a text before the block of a call goes before that call, a text
    before a reasoning block before that reasoning, the rest at the end."""
    segments = _segments(content)
    used = 0  # segments consumed so far

    def texts_before(match: Any) -> list[tuple[str, list[Part]]]:
        nonlocal used
        for index in range(used, len(segments)):
            kind, _, attrs = segments[index]
            if kind == "details" and match(attrs):
                out = [
                    ("assistant", [text_part(t)]) for k, t, _ in segments[used:index] if k == "text"
                ]
                used = index + 1
                return out
        return []

    out: list[tuple[str, list[Part]]] = []
    for kind, parts in steps:
        first = parts[0] if parts else {}
        if kind == "assistant" and first.get("type") == "tool_call":
            call_id = str(first.get("id"))
            out.extend(texts_before(lambda a, c=call_id: a.get("id") == c))
        elif kind == "assistant" and first.get("type") == "thinking":
            out.extend(texts_before(lambda a: a.get("type") == "reasoning"))
        out.append((kind, parts))
    out.extend(("assistant", [text_part(t)]) for k, t, _ in segments[used:] if k == "text")
    return out


def _files(files: Any, node: Node) -> list[Part]:
    parts: list[Part] = []
    for item in files if isinstance(files, list) else []:
        if isinstance(item, dict) and item.get("type") == "image":
            parts.append(url_image(item.get("url"), node, "attached image"))
    return parts
