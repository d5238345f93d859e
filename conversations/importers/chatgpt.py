"""ChatGPT ``conversations.json``: a list of conversations (or one), each a ``mapping`` of
nodes ``{id, message, parent, children}`` with ``current_node`` as the tip.

- ``message: null`` nodes (the root) and hidden empty system nodes are left out; their
  children move up.
- Custom instructions (``user_editable_context``) become a hidden system message.
- An assistant message addressed to a tool (``recipient`` other than ``all``) becomes a
  tool call whose id is the node id; the ``tool`` messages below it become its results.
- Several tool messages answering one call (``mclick([0, 3, 7])`` answered by one
  ``tether_quote`` per page) become one result holding every page, so each is paired.
- Browsing keeps its sources: a ``tether_quote``'s URL, title and domain and a search
  page's ``_cite_metadata`` list go to ``metadata.sources``; an answer's
  ``metadata.citations`` (and the newer ``content_references``) go to
  ``metadata.citations`` as {marker, url, title}, so ``【6†source】`` markers link to their
  page. Content fields not kept are reported.
- Images are not inside conversations.json (they are separate files of the export zip):
  imported from the zip (importers.archive) they become blobs; from conversations.json
  alone each becomes a text placeholder naming the asset, reported as ``image_missing``.
- A message carrying ``metadata.arbor`` (a file Arbor exported) is read from those exact
  parts, so an Arbor → ChatGPT → Arbor trip keeps tool calls, thinking and images.
"""

from __future__ import annotations

import mimetypes
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

from conversations.importers.base import (
    ORIGINS,
    ConversationReport,
    ImportReport,
    Limits,
    Node,
    Part,
    SourceConversation,
    as_dict,
    as_list,
    as_str,
    image_data_part,
    image_ref_part,
    json_text,
    parse_time,
    text_part,
    thinking_part,
    tool_call_part,
    tool_result_part,
)
from conversations.importers.reading import parse_documents

ARBOR_BLOB_PREFIX = "arbor-blob://"


# An export zip's files (importers.archive): image pointer, byte limit → (bytes, name).
Media = Callable[[str, int], tuple[bytes, str] | None]
# The same with the limit bound: image pointer → (bytes, name), or None.
ImageLookup = Callable[[str], tuple[bytes, str] | None]


def parse(
    path: Path, *, report: ImportReport, limits: Limits, media: Media | None = None
) -> Iterator[SourceConversation]:
    read = partial(conversation_from, images=_bounded(media, limits.max_blob_bytes))
    return parse_documents(path, report=report, limits=limits, read=read)


def _bounded(media: Media | None, max_bytes: int) -> ImageLookup | None:
    """The archive's lookup with the blob size limit bound, so the readers below only
    ask for a pointer (and an image over the limit is simply not found)."""
    if media is None:
        return None
    return lambda pointer: media(pointer, max_bytes)


def conversation_from(
    doc: Any, index: int, report: ImportReport, *, images: ImageLookup | None = None
) -> SourceConversation | None:
    if not isinstance(doc, dict):
        report.skipped.add("corrupt_entry", f"conversation {index}", "not an object: skipped")
        return None
    title = as_str(doc.get("title"))
    source_id = doc.get("conversation_id") or doc.get("id")
    mapping = doc.get("mapping")
    if not isinstance(mapping, dict) or not mapping:
        report.skipped.add(
            "corrupt_entry",
            f"conversation {index} ({title or source_id})",
            "it has no mapping (no messages): skipped",
        )
        return None
    crep = ConversationReport(source_id=str(source_id) if source_id else None, title=title)
    nodes: list[Node] = []
    for order, (key, entry) in enumerate(mapping.items()):
        key = str(key)
        if not isinstance(entry, dict):
            crep.skipped.add("corrupt_entry", f"node {key}", "not an object: skipped")
            continue
        parent = entry.get("parent")
        parent_key = str(parent) if isinstance(parent, str | int) else None
        message = entry.get("message")
        if not isinstance(message, dict):
            nodes.append(
                Node(key, parent_key, "system", [], order=order, skip="no message (a root node)")
            )
            continue
        nodes.append(_node(key, parent_key, message, order, mapping, crep, images))
    tip = doc.get("current_node")
    aliases = _merge_results(nodes)
    return SourceConversation(
        source_id=crep.source_id,
        title=title,
        nodes=[n for n in nodes if n.key not in aliases],
        report=crep,
        aliases=aliases,
        tip=str(tip) if isinstance(tip, str) and tip else None,
        tip_rule="current_node",
        created_at=parse_time(doc.get("create_time")),
    )


def _node(
    key: str,
    parent: str | None,
    message: dict[str, Any],
    order: int,
    mapping: dict[str, Any],
    crep: ConversationReport,
    images: ImageLookup | None,
) -> Node:
    author = as_dict(message.get("author"))
    role = as_str(author.get("role"))
    meta = as_dict(message.get("metadata"))
    created = parse_time(message.get("create_time"))
    node = Node(key, parent, role, [], order=order, created_at=created)
    arbor = meta.get("arbor")
    if isinstance(arbor, dict) and isinstance(arbor.get("parts"), list):
        return _arbor_node(node, arbor)

    node.metadata = _metadata(key, message, meta)
    content = as_dict(message.get("content"))
    kind = as_str(content.get("content_type")) or "text"
    if kind == "reasoning_recap":
        node.skip = "a reasoning recap (shown in the ChatGPT UI only)"
        return node
    read = _content(content, kind, key, crep, images)
    sources = _sources(content, kind, meta)
    if sources:
        node.metadata["sources"] = sources
    citations = _citations("".join(read.texts), meta)
    if citations:
        node.metadata["citations"] = citations
    if kind in ("user_editable_context", "model_editable_context"):
        node.role = "system"
        node.metadata["hidden"] = True
        node.metadata["content_type"] = kind
    _fill_parts(node, read, message, kind, mapping)
    return node


def _arbor_node(node: Node, arbor: dict[str, Any]) -> Node:
    """A message Arbor exported: its exact parts, metadata and origin."""
    node.parts = [_arbor_part(p, node.key) for p in arbor["parts"]]
    metadata = arbor.get("metadata")
    node.metadata = dict(metadata) if isinstance(metadata, dict) else {}
    node.metadata.setdefault("source", {"format": "chatgpt", "id": node.key})
    if arbor.get("origin") in ORIGINS:
        node.origin = arbor["origin"]
    if node.role not in ("system", "user", "assistant", "tool"):
        node.skip = f"unknown author role {node.role!r}"
    return node


def _fill_parts(
    node: Node, read: _Content, message: dict[str, Any], kind: str, mapping: dict[str, Any]
) -> None:
    """The message's parts for its role: an assistant message addressed to a tool is a
    call, a tool message the result of the call above it."""
    texts = [text_part(t) for t in read.texts]
    if node.role == "system":
        node.parts = texts
        if not node.parts:
            node.skip = "an empty system message"
    elif node.role == "user":
        node.parts = texts + read.images
    elif node.role == "assistant":
        recipient = as_str(message.get("recipient"))
        if recipient and recipient != "all":
            node.parts = [tool_call_part(node.key, recipient, "\n".join(read.texts))]
            node.metadata["recipient"] = recipient
        else:
            node.parts = read.thoughts + texts + read.images
    elif node.role == "tool":
        call_id = _calling_node(node.parent, mapping) or node.key
        node.metadata["tool_name"] = as_str(as_dict(message.get("author")).get("name"))
        node.parts = [
            tool_result_part(call_id, texts + read.images, is_error=kind == "system_error")
        ]
    else:
        node.skip = f"unknown author role {node.role!r}"


def _metadata(key: str, message: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"source": {"format": "chatgpt", "id": key}}
    if isinstance(meta.get("model_slug"), str):
        out["model"] = meta["model_slug"]
    finish = meta.get("finish_details")
    if isinstance(finish, dict) and isinstance(finish.get("type"), str):
        out["finish_reason"] = finish["type"]
    status = message.get("status")
    if isinstance(status, str) and status != "finished_successfully":
        out["status"] = status
    if meta.get("is_visually_hidden_from_conversation"):
        out["hidden"] = True
    weight = message.get("weight")
    if isinstance(weight, int | float) and weight != 1:
        out["weight"] = weight
    return out


class _Content:
    """What one message's content reads as: texts, images and thoughts, with what was
    left out reported on the conversation."""

    def __init__(
        self, key: str, kind: str, crep: ConversationReport, images: ImageLookup | None
    ) -> None:
        self.key = key
        self.kind = kind
        self.crep = crep
        self.lookup = images
        self.texts: list[str] = []
        self.images: list[Part] = []
        self.thoughts: list[Part] = []

    def item(self, value: Any) -> None:
        """One item of ``parts`` (or a single text field): a string, an image pointer or
        a typed object."""
        if isinstance(value, str):
            if value:
                self.texts.append(value)
            return
        if not isinstance(value, dict):
            if value is not None:
                self.texts.append(json_text(value))
            return
        sub = value.get("content_type")
        if sub == "image_asset_pointer":
            self.image(value)
        elif isinstance(value.get("text"), str):
            if value["text"]:
                self.texts.append(value["text"])
        else:
            self.crep.repaired.add(
                "content_dropped", f"node {self.key}", f"a {sub or 'non-text'} item was left out"
            )

    def image(self, value: dict[str, Any]) -> None:
        """An image pointer: a blob Arbor exported, a file of the export zip, or (when
        neither holds it) a placeholder naming it."""
        where = f"node {self.key}"
        pointer = as_str(value.get("asset_pointer"))
        if pointer.startswith(ARBOR_BLOB_PREFIX):
            self.images.append(image_ref_part(pointer[len(ARBOR_BLOB_PREFIX) :], where))
            return
        found = self.lookup(pointer) if self.lookup and pointer else None
        if found is not None:
            data, name = found
            self.images.append(image_data_part(data, mimetypes.guess_type(name)[0], where))
            return
        size = f" {value.get('width')}x{value.get('height')}" if value.get("width") else ""
        held = "not in the archive" if self.lookup else "not in conversations.json"
        self.texts.append(f"[image {pointer or 'without a pointer'}{size}: {held}]")
        self.crep.repaired.add(
            "image_missing",
            where,
            f"image {pointer} is a separate file of the export"
            + (" that the archive does not hold (or is over the size limit)" if self.lookup else "")
            + ": a placeholder was kept",
        )

    # -- one reader per content type (``_BY_KIND``) --

    def parts(self, content: dict[str, Any]) -> None:
        parts = content.get("parts")
        for value in parts if isinstance(parts, list) else []:
            self.item(value)

    def code(self, content: dict[str, Any]) -> None:
        self.item(as_str(content.get("text")))

    def reasoning(self, content: dict[str, Any]) -> None:
        for thought in content.get("thoughts") or []:
            if isinstance(thought, dict):
                body = "\n".join(
                    s for s in (as_str(thought.get("summary")), as_str(thought.get("content"))) if s
                )
                if body:
                    self.thoughts.append(thinking_part(body))

    def user_context(self, content: dict[str, Any]) -> None:
        # Custom instructions: both fields in one text (the hidden system message).
        texts: list[str] = []
        for label, field in (
            ("User profile", "user_profile"),
            ("Instructions", "user_instructions"),
        ):
            value = as_str(content.get(field)).strip()
            if value:
                texts.append(f"{label}:\n{value}")
        self.texts = ["\n\n".join(texts)] if texts else []

    def model_context(self, content: dict[str, Any]) -> None:
        self.item(as_str(content.get("model_set_context")))

    def other(self, content: dict[str, Any]) -> None:
        """Any other content type: its first text-like field, or reported as dropped."""
        for field in ("text", "result", "summary"):
            if isinstance(content.get(field), str) and content[field]:
                self.texts.append(content[field])
                return
        self.crep.repaired.add(
            "content_dropped", f"node {self.key}", f"content type {self.kind!r} is not supported"
        )


_BY_KIND: dict[str, Callable[[_Content, dict[str, Any]], None]] = {
    "text": _Content.parts,
    "multimodal_text": _Content.parts,
    "code": _Content.code,
    "thoughts": _Content.reasoning,
    "user_editable_context": _Content.user_context,
    "model_editable_context": _Content.model_context,
}


def _content(
    content: dict[str, Any],
    kind: str,
    key: str,
    crep: ConversationReport,
    images: ImageLookup | None = None,
) -> _Content:
    read = _Content(key, kind, crep, images)
    # Any content type holding ``parts`` is read as parts, whatever its name.
    reader = _Content.parts if "parts" in content else _BY_KIND.get(kind, _Content.other)
    reader(read, content)
    dropped = _left_out_fields(content, kind)
    if dropped:
        crep.repaired.add(
            "content_dropped", f"node {key}", f"{kind} fields left out: {', '.join(dropped)}"
        )
    return read


# Content fields read for each content type; anything else is reported as left out.
_READ = {"content_type", "parts", "text", "result", "summary", "thoughts", "language"}
_READ_BY_KIND = {
    "tether_quote": {"url", "domain", "title", "tether_id"},
    "tether_browsing_display": {"assets", "tether_id"},
    "user_editable_context": {"user_profile", "user_instructions"},
    "model_editable_context": {"model_set_context", "repository", "repo_summary"},
    "thoughts": {"source_analysis_msg_id"},
    "system_error": {"name"},
}


def _left_out_fields(content: dict[str, Any], kind: str) -> list[str]:
    known = _READ | _READ_BY_KIND.get(kind, set())
    return sorted(k for k, v in content.items() if k not in known and v not in (None, "", [], {}))


def _sources(content: dict[str, Any], kind: str, meta: dict[str, Any]) -> list[dict[str, str]]:
    """The web pages a browsing tool message showed the model: a quoted page, or the
    numbered results of a search (``_cite_metadata.metadata_list``)."""
    out: list[dict[str, str]] = []
    if kind == "tether_quote":
        out.append(_page(content))
    listed = as_dict(meta.get("_cite_metadata")).get("metadata_list")
    for item in listed if isinstance(listed, list) else []:
        if isinstance(item, dict):
            out.append(_page(item))
    return [p for p in out if p.get("url") or p.get("title")]


def _page(item: dict[str, Any]) -> dict[str, str]:
    page = {k: as_str(item.get(k)) for k in ("url", "title", "domain")}
    return {k: v for k, v in page.items() if v}


def _citations(text: str, meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Citation markers of an answer with the page each points to: ``metadata.citations``
    (``start_ix``/``end_ix`` into the text, the page in ``metadata``) and the newer
    ``content_references`` (``matched_text`` and ``items``)."""
    out: list[dict[str, Any]] = []
    for item in as_list(meta.get("citations")):
        if not isinstance(item, dict):
            continue
        start, end = item.get("start_ix"), item.get("end_ix")
        marker = (
            text[start:end]
            if isinstance(start, int) and isinstance(end, int) and 0 <= start < end <= len(text)
            else ""
        )
        page = _page(as_dict(item.get("metadata")))
        if marker or page:
            out.append({"marker": marker, **page})
    for ref in as_list(meta.get("content_references")):
        if not isinstance(ref, dict):
            continue
        items = [i for i in as_list(ref.get("items")) if isinstance(i, dict)]
        pages = [_page(i) for i in items] or [_page(ref)]
        marker = as_str(ref.get("matched_text"))
        for page in pages:
            if page.get("url"):
                out.append({"marker": marker, **page})
    return out


def _single_result(parts: list[Part]) -> bool:
    """Whether a message is exactly one tool result with a call id (one that can take
    the pages of another result for the same call)."""
    if len(parts) != 1 or not isinstance(parts[0], dict):
        return False
    part = parts[0]
    return (
        part.get("type") == "tool_result"
        and bool(part.get("call_id"))
        and isinstance(part.get("parts"), list)
    )


def _merge_results(nodes: list[Node]) -> dict[str, str]:
    """Tool messages that continue the result of the same call (one per page of an
    ``mclick``) are merged into the first one: one result holding every page. Returns
    the merged keys → the message they joined."""
    by_key = {n.key: n for n in nodes}
    children: dict[str | None, int] = {}
    for n in nodes:
        children[n.parent] = children.get(n.parent, 0) + 1
    aliases: dict[str, str] = {}
    for node in nodes:
        above = aliases.get(node.parent, node.parent) if node.parent else None
        target = by_key.get(above) if above is not None else None
        if (
            target is None
            or node.role != "tool"
            or target.role != "tool"
            or node.skip is not None
            or target.skip is not None
            or children.get(node.parent, 0) != 1
            or not _single_result(node.parts)
            or not _single_result(target.parts)
            or node.parts[0].get("call_id") != target.parts[0].get("call_id")
        ):
            continue
        result = target.parts[0]
        result["parts"] = [*result["parts"], *node.parts[0]["parts"]]
        result["is_error"] = bool(result.get("is_error")) and bool(node.parts[0].get("is_error"))
        source = target.metadata.setdefault("source", {})
        source.setdefault("records", [source.get("id")]).append(node.key)
        if node.metadata.get("sources"):
            target.metadata["sources"] = [
                *target.metadata.get("sources", []),
                *node.metadata["sources"],
            ]
        aliases[node.key] = target.key
    return aliases


def _calling_node(parent: str | None, mapping: dict[str, Any]) -> str | None:
    """The assistant node addressed to a tool that a tool message answers: the nearest
    ancestor above any tool messages."""
    seen = 0
    while parent is not None and seen < 1000:
        seen += 1
        entry = mapping.get(parent)
        message = entry.get("message") if isinstance(entry, dict) else None
        if not isinstance(message, dict):
            return None
        author = as_dict(message.get("author"))
        if author.get("role") == "tool":
            nxt = entry.get("parent") if isinstance(entry, dict) else None
            parent = str(nxt) if isinstance(nxt, str | int) else None
            continue
        recipient = message.get("recipient")
        if author.get("role") == "assistant" and isinstance(recipient, str) and recipient != "all":
            return parent
        return None
    return None


def _arbor_part(part: Any, key: str) -> Any:
    if isinstance(part, dict) and part.get("type") == "image":
        return image_ref_part(as_str(part.get("blob")), f"node {key}")
    if isinstance(part, dict) and part.get("type") == "tool_result":
        inner = part.get("parts")
        if isinstance(inner, list):
            return {**part, "parts": [_arbor_part(p, key) for p in inner]}
    return part
