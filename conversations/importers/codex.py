"""Codex CLI rollouts (``~/.codex/sessions/YYYY/MM/DD/rollout-*.jsonl``, written by
OpenAI's ``@openai/codex``): one record per line, ``{"timestamp", "type", "payload"}``,
in the order Codex saw them. A rollout is one line of history (a resumed session appends
to its file), so every message follows the one before it.

- ``session_meta``: the session id is the source id; its ``base_instructions`` (older
  files: ``instructions``) are the conversation's system prompt, as Codex sends them
  ahead of the history; cwd, CLI version, originator, provider and git details go on the
  first message as ``metadata.codex_session``. A second ``session_meta`` is reported.
- ``response_item`` records are the history the model sees:
  - the items of one model response (``reasoning``, an assistant ``message``,
    ``function_call``, ``custom_tool_call``, ``local_shell_call``) are one assistant
    message; a response ends at its usage record (``token_usage_record``, or an
    ``event_msg``/``token_count`` in older files), whose usage goes in the message's
    metadata, or at the next item that is not the model's;
  - reasoning becomes thinking parts: the summary (or raw reasoning text, which open
    models return), never ``encrypted_content``, which only the issuing organisation can
    read and which is left out and reported;
  - ``function_call_output`` / ``custom_tool_call_output`` become one ``tool`` message
    each, in file order, so the results of parallel calls follow their call;
  - a ``web_search_call`` is a server-side search with no result in the file: it is kept
    as a line of assistant text, reported;
  - ``user`` messages stay user messages and ``developer`` messages become system
    messages (``metadata.codex_role = "developer"``). Context Codex injects itself —
    ``<environment_context>``, ``<user_instructions>``, AGENTS.md text, skills,
    permissions, ``<turn_aborted>`` and the like — is kept where the model saw it, marked
    ``metadata.codex_context`` (the tag) and ``metadata.meta``, and never used as the
    title. Dropping it would misstate what the model was told.
- ``compacted`` becomes a compaction marker: a system message holding the summary Codex
  went on from, with ``metadata.compaction_marker``. Codex writes its summariser's answer
  just before as an assistant message (``metadata.compaction_output``); when the marker
  holds that text, the answer is folded into it (reported) rather than said twice. The
  ``replacement_history`` (the copies of earlier context Codex resumed from) is counted
  in the marker and reported, not imported again.
- ``turn_context`` gives the model (and provider) put on the assistant messages that
  follow. ``event_msg`` records are the UI's copy of the same items, ``world_state`` and
  the rest are state snapshots: none is a message; they are counted in the report, and
  errors, warnings and aborted turns are listed one by one.
- The old un-wrapped layout (before ``payload`` records, mid-2025) is not read.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from conversations.importers.base import (
    ConversationReport,
    FileIssues,
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
from conversations.importers.media import url_image
from conversations.importers.reading import iter_jsonl

FORMAT = "codex"
_CALLS = ("function_call", "custom_tool_call", "local_shell_call")
_OUTPUTS = ("function_call_output", "custom_tool_call_output")
# Events that say something the response items do not: listed one by one.
_TOLD_EVENTS = ("error", "stream_error", "warning", "turn_aborted")
# User-role text Codex writes itself (codex-rs contextual_user_message and instructions).
_CONTEXT_TAGS = (
    "environment_context",
    "user_instructions",
    "turn_aborted",
    "tool_context",
    "reasoning_context",
    "pinned_notes",
    "subagent_notification",
    "context_update",
    "user_shell_command",
    "skill",
)
# A whole message in one snake_case tag (``<apps_instructions>…</apps_instructions>``).
_WRAPPED = re.compile(r"^<([a-z][a-z0-9]*_[a-z0-9_]+)[ >].*</\1>\s*$", re.S)
_OPEN_TAG = re.compile(r"^<([a-z][a-z0-9_ ]*)>")
BRIDGE_PREFIX = "Another language model started to solve this problem"


def parse(path: Path, *, report: ImportReport, limits: Limits) -> Iterator[SourceConversation]:
    reader = _Reader()
    for lineno, record in iter_jsonl(path, issues=FileIssues(report), limits=limits):
        reader.add(lineno, record)
    conversation = reader.conversation()
    if conversation is None:
        report.skipped.add("empty", "file", "no response items: nothing to import")
        return
    yield conversation


def context_kind(role: str, text: str, payload: dict[str, Any]) -> str | None:
    """What Codex context a user or developer message is, or None for the user's own."""
    head = text.lstrip()
    lowered = head[:200].lower()
    if role in ("developer", "system"):
        opening = _OPEN_TAG.match(lowered)
        return opening.group(1).split(" ")[0] if opening else "developer_instructions"
    for tag in _CONTEXT_TAGS:
        if lowered.startswith(f"<{tag}>") or lowered.startswith(f"<{tag} "):
            return tag
    if lowered.startswith("# agents.md instructions"):
        return "agents_md"
    if head.startswith(BRIDGE_PREFIX):
        return "compaction_bridge"
    wrapped = _WRAPPED.match(head)
    if wrapped:
        return wrapped.group(1)
    # Newer CLIs say where each content item came from.
    passthrough = as_dict(payload.get("internal_chat_message_metadata_passthrough"))
    provenance = [
        as_str(as_dict(as_dict(m).get("provenance")).get("type"))
        for m in as_list(passthrough.get("content_item_metadata"))
    ]
    if provenance and "user" not in provenance:
        kinds = [k for k in as_list(passthrough.get("content_item_kinds")) if isinstance(k, str)]
        return kinds[0] if kinds else provenance[0] or "harness"
    return None


class _Reader:
    def __init__(self) -> None:
        self.report = ConversationReport(source_id=None)
        self.nodes: list[Node] = []
        self.previous: str | None = None
        self.open: Node | None = None  # the assistant message of the response being read
        self.unbilled: Node | None = None  # the last assistant message without usage
        self.summary: Node | None = None  # the compaction summariser's answer, if last
        self.session: dict[str, Any] = {}
        self.system_prompt = ""
        self.model = ""
        self.provider = ""
        self.call_names: dict[str, str] = {}
        self.ignored: Counter[str] = Counter()
        self.order = 0

    # -- records --

    def add(self, lineno: int, record: dict[str, Any]) -> None:
        self.order += 1
        kind = as_str(record.get("type"))
        payload = record.get("payload")
        if not isinstance(payload, dict):
            self.ignored[f"{kind or 'untyped'} without a payload"] += 1
            return
        created = parse_time(record.get("timestamp"))
        if kind == "session_meta":
            self._session_meta(lineno, payload)
        elif kind == "turn_context":
            self._close()
            self.model = as_str(payload.get("model")) or self.model
            self.ignored["turn_context (its model is on the messages)"] += 1
        elif kind == "response_item":
            self._item(lineno, payload, as_dict(record.get("metadata")), created)
        elif kind == "compacted":
            self._compacted(lineno, payload, created)
        elif kind == "token_usage_record":
            self._usage(payload.get("usage"))
            self.ignored["token_usage_record (usage is on the messages)"] += 1
        elif kind == "event_msg":
            self._event(lineno, payload)
        else:
            self.ignored[kind or "untyped"] += 1

    def _session_meta(self, lineno: int, payload: dict[str, Any]) -> None:
        if self.session:
            self.report.skipped.add(
                "session_meta",
                f"line {lineno}",
                f"a second session_meta record (session {as_str(payload.get('id'))!r}): "
                "the first one's id and instructions are used",
            )
            return
        self.session = {
            key: payload[key]
            for key in (
                "id",
                "timestamp",
                "cwd",
                "originator",
                "cli_version",
                "source",
                "model_provider",
                "forked_from_id",
                "git",
            )
            if payload.get(key) is not None
        }
        self.session.setdefault("id", as_str(payload.get("session_id")))
        self.provider = as_str(payload.get("model_provider"))
        instructions = payload.get("base_instructions", payload.get("instructions"))
        if isinstance(instructions, dict):
            instructions = instructions.get("text")
        self.system_prompt = as_str(instructions)

    def _event(self, lineno: int, payload: dict[str, Any]) -> None:
        sub = as_str(payload.get("type"))
        if sub == "token_count":
            # Older files have no token_usage_record: the event carries the usage.
            info = as_dict(payload.get("info"))
            if info.get("last_token_usage") is not None:
                self._usage(info["last_token_usage"])
        if sub in _TOLD_EVENTS:
            said = as_str(payload.get("message")) or as_str(payload.get("reason")) or sub
            self.report.skipped.add(
                "event", f"line {lineno}", f"a {sub} event (not a message): {said[:300]}"
            )
            return
        self.ignored[f"event_msg/{sub or 'untyped'}"] += 1

    def _usage(self, usage: Any) -> None:
        if self.unbilled is not None and isinstance(usage, dict):
            self.unbilled.metadata["usage"] = usage
        self.unbilled = None
        self._close()  # the response is over

    # -- nodes --

    def _node(self, lineno: int, role: str, source_id: Any, created: Any) -> Node:
        key = f"line-{lineno}"
        if self.nodes and self.nodes[-1].metadata["source"]["line"] == lineno:
            key = f"line-{lineno}.{self.order}"  # several records on one line
        node = Node(key, self.previous, role, [], order=self.order, created_at=created)
        node.metadata = {
            "source": {"format": FORMAT, "id": as_str(source_id) or key, "line": lineno}
        }
        self.nodes.append(node)
        self.previous = key
        self.summary = None
        return node

    def _close(self) -> None:
        self.open = None

    def _assistant(self, lineno: int, payload: dict[str, Any], created: Any) -> Node:
        """The assistant message the item belongs to: the open one, or a new one."""
        item_id = as_str(payload.get("id")) or as_str(payload.get("call_id"))
        if self.open is not None:
            self.open.metadata["source"]["items"].append(item_id)
            return self.open
        node = self._node(lineno, "assistant", item_id, created)
        node.metadata["source"]["items"] = [item_id]
        if self.model:
            node.metadata["model"] = self.model
        if self.provider:
            node.metadata["provider"] = self.provider
        self.open = self.unbilled = node
        return node

    def _item(
        self, lineno: int, payload: dict[str, Any], meta: dict[str, Any], created: Any
    ) -> None:
        kind = as_str(payload.get("type"))
        if kind == "message" and as_str(payload.get("role")) == "assistant":
            if meta.get("compaction_output"):
                self._close()  # the summariser's answer is a response of its own
            node = self._assistant(lineno, payload, created)
            node.parts.extend(_content_parts(payload.get("content"), node))
            if meta.get("compaction_output"):
                node.metadata["compaction_output"] = True
                self._close()
                self.summary = node
        elif kind == "message":
            self._close()
            self._input_message(lineno, payload, created)
        elif kind == "reasoning":
            node = self._assistant(lineno, payload, created)
            part = _reasoning(payload, node)
            if part is not None:
                node.parts.append(part)
        elif kind in _CALLS:
            node = self._assistant(lineno, payload, created)
            node.parts.append(self._call(kind, payload, node))
        elif kind == "web_search_call":
            node = self._assistant(lineno, payload, created)
            action = as_dict(payload.get("action"))
            what = as_str(action.get("query")) or as_str(action.get("url")) or json_text(action)
            node.parts.append(text_part(f"[web search: {what}]"))
            node.note(
                "web_search_call",
                "a server-side web search (its results are not in the file) kept as text",
            )
        elif kind in _OUTPUTS:
            self._close()
            self._output(lineno, payload, created)
        elif kind in ("compaction", "compaction_summary"):
            self.report.skipped.add(
                "encrypted", f"line {lineno}", "an encrypted compaction item: left out"
            )
        elif kind == "ghost_snapshot":
            self.ignored["response_item/ghost_snapshot (an undo snapshot)"] += 1
        else:
            self.report.skipped.add(
                "response_item", f"line {lineno}", f"a {kind or 'untyped'} item: not supported"
            )

    def _input_message(self, lineno: int, payload: dict[str, Any], created: Any) -> None:
        role = as_str(payload.get("role"))
        if role not in ("user", "developer", "system"):
            self.report.skipped.add(
                "response_item", f"line {lineno}", f"a message with role {role!r}: not supported"
            )
            return
        node = self._node(
            lineno, "user" if role == "user" else "system", payload.get("id"), created
        )
        node.parts = _content_parts(payload.get("content"), node)
        if role != "user":
            node.metadata["codex_role"] = role
        text = "\n".join(p["text"] for p in node.parts if p.get("type") == "text")
        kind = context_kind(role, text, payload)
        if kind is not None:
            node.metadata["codex_context"] = kind
            node.metadata["meta"] = True

    def _call(self, kind: str, payload: dict[str, Any], node: Node) -> Part:
        call_id = as_str(payload.get("call_id")) or as_str(payload.get("id"))
        if not call_id:
            call_id = f"{node.key}-call-{len(node.parts)}"
            node.note("call_id_missing", f"a {kind} without a call_id: named {call_id}")
        arguments: Any
        if kind == "local_shell_call":
            name, arguments = "local_shell", as_dict(payload.get("action"))
        elif kind == "custom_tool_call":
            # Freeform input (an apply_patch body, say) stays the text it was.
            name, arguments = as_str(payload.get("name")), {"input": payload.get("input")}
        else:
            name, arguments = as_str(payload.get("name")), payload.get("arguments")
        part = tool_call_part(call_id, name, arguments)
        self.call_names[part["id"]] = part["name"]
        return part

    def _output(self, lineno: int, payload: dict[str, Any], created: Any) -> None:
        node = self._node(lineno, "tool", payload.get("id") or payload.get("call_id"), created)
        call_id = as_str(payload.get("call_id"))
        if not call_id:
            call_id = f"{node.key}-no-call"
            node.note("call_id_missing", f"a tool output without a call_id: named {call_id}")
        inner, is_error = _output_parts(payload.get("output"), node)
        part = tool_result_part(call_id, inner, is_error=is_error)
        node.parts = [part]
        if part["call_id"] in self.call_names:
            node.metadata["tool_name"] = self.call_names[part["call_id"]]

    def _compacted(self, lineno: int, payload: dict[str, Any], created: Any) -> None:
        self._close()
        summary_node = self.summary
        message = as_str(payload.get("message"))
        answer = _texts(summary_node) if summary_node is not None else ""
        text = message or answer
        history = payload.get("replacement_history")
        node = self._node(lineno, "system", None, created)
        if text:
            head = "[Conversation compacted here. Codex went on from this summary:]"
            node.parts = [text_part(f"{head}\n\n{text}")]
        else:
            node.parts = [text_part("[Conversation compacted here; no summary in the file.]")]
        marker: dict[str, Any] = {
            "format": FORMAT,
            "summary_included": bool(text),
            "replacement_history": len(history) if isinstance(history, list) else None,
        }
        if summary_node is not None and answer and answer.strip() in text:
            # Said once, in the marker: the answer was a side request's, not a turn.
            summary_node.skip = (
                "the compaction summariser's answer: its text is in the compaction "
                "marker that follows"
            )
            if "usage" in summary_node.metadata:
                marker["summary_usage"] = summary_node.metadata["usage"]
        node.metadata["compaction_marker"] = marker
        if isinstance(history, list):
            self.report.skipped.add(
                "replacement_history",
                f"line {lineno}",
                f"the {len(history)} items Codex went on from after compacting (the "
                "context, the user's messages and the summary again): not imported a "
                "second time",
            )

    # -- the conversation --

    def conversation(self) -> SourceConversation | None:
        if not self.nodes:
            return None
        if self.ignored:
            listed = ", ".join(
                f"{k} \N{MULTIPLICATION SIGN}{n}" for k, n in sorted(self.ignored.items())
            )
            self.report.skipped.add(
                "not_a_message", "file", f"records that are not messages: {listed}"
            )
        first = next((n for n in self.nodes if n.skip is None), self.nodes[0])
        if self.session:
            first.metadata["codex_session"] = self.session
        session_id = as_str(self.session.get("id")) or None
        self.report.source_id = session_id
        prompt = next(
            (
                _texts(n)
                for n in self.nodes
                if n.role == "user" and "codex_context" not in n.metadata and _texts(n).strip()
            ),
            "",
        )
        return SourceConversation(
            source_id=session_id,
            title=preview_text(prompt) or "Codex session",
            nodes=self.nodes,
            report=self.report,
            created_at=parse_time(self.session.get("timestamp"))
            or min((n.created_at for n in self.nodes if n.created_at), default=None),
            system_prompt=self.system_prompt,
        )


def _texts(node: Node) -> str:
    return "\n".join(p["text"] for p in node.parts if p.get("type") == "text")


def _content_parts(content: Any, node: Node) -> list[Part]:
    """A message's content items: text (input or output), images, refusals."""
    parts: list[Part] = []
    for item in as_list(content):
        kind = as_str(as_dict(item).get("type"))
        if kind in ("input_text", "output_text", "text"):
            text = as_str(item.get("text"))
            if text:
                parts.append(text_part(text))
        elif kind == "refusal":
            parts.append(text_part(as_str(item.get("refusal"))))
        elif kind == "input_image":
            parts.append(url_image(item.get("image_url"), node, "input_image"))
        else:
            node.note("content_dropped", f"a {kind or 'non-object'} content item left out")
    if isinstance(content, str) and content:
        parts.append(text_part(content))
    return parts


def _reasoning(payload: dict[str, Any], node: Node) -> Part | None:
    summary = [as_str(as_dict(s).get("text")) for s in as_list(payload.get("summary"))]
    raw = [as_str(as_dict(c).get("text")) for c in as_list(payload.get("content"))]
    text = "\n\n".join(t for t in summary if t) or "\n\n".join(t for t in raw if t)
    if payload.get("encrypted_content"):
        node.note(
            "encrypted_reasoning",
            "encrypted reasoning content left out (only the issuing organisation can read it)",
            skipped=True,
        )
    if not text:
        node.note("content_dropped", "a reasoning item without summary or text left out")
        return None
    return thinking_part(text)


def _output_parts(output: Any, node: Node) -> tuple[list[Part], bool]:
    """A tool output: a string, a list of content items, or (older) ``{content,
    success}``."""
    is_error = False
    if isinstance(output, dict):
        is_error = output.get("success") is False
        output = output.get("content", output.get("content_items", ""))
    if isinstance(output, str):
        return ([text_part(output)] if output else []), is_error
    if isinstance(output, list):
        parts: list[Part] = []
        for item in output:
            kind = as_str(as_dict(item).get("type"))
            if kind in ("input_text", "output_text", "text"):
                parts.append(text_part(as_str(item.get("text"))))
            elif kind == "input_image":
                parts.append(url_image(item.get("image_url"), node, "tool output image"))
            else:
                parts.append(text_part(json_text(item)))
        return parts, is_error
    return ([text_part(json_text(output))] if output is not None else []), is_error
