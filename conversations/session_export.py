"""Exports a harness resumes: a conversation as the session file Claude Code or pi
writes, so a branch made in Arbor goes on in the tool.

- Claude Code: ``claude --resume <session-id>`` reads
  ``~/.claude/projects/<project dir>/<session-id>.jsonl``, where the project dir is the
  working directory with every character other than a letter or digit replaced by ``-``
  (``claude_project_dir``).
- pi: ``pi --session <file>`` (or a file in ``~/.pi/agent/sessions/<dir>/``); the
  header's ``cwd`` is where pi's tools run.

Both formats are trees (``parentUuid`` / ``parentId``), so the whole conversation is
written, parents before children, siblings by (created_at, id) except that the branch
holding the tip comes last at every fork: the tip's line is the last message line of the
file. Where the tools resume:

- Claude Code resumes at the leaf a trailing ``last-prompt`` record names; for a tip with
  messages below it the record says ``explicit`` (what Claude Code writes after a
  rewind), which it honours for an inner message too.
- pi resumes at the last entry of the file: a ``session_info`` entry (the title) hung
  below the tip, preceded by a ``label`` entry per live checkpoint.

What each Arbor message becomes is what the tool itself writes for it:

- Claude Code: a user message is one ``user`` record; an assistant message one
  ``assistant`` record per content block, all sharing ``message.id`` (Claude Code 2.x
  writes them so); a tool message one ``user`` record holding its ``tool_result`` blocks
  (with ``toolUseResult`` and ``sourceToolAssistantUUID``). Records follow one another
  in a single chain, so any reader that follows ``parentUuid`` up from the leaf meets
  every result (Claude Code 2.1 itself hangs each result below its own call's record and
  gathers the others when it loads). Thinking without a signature becomes a text block
  (the API refuses unsigned thinking; pi does the same). Tool-use ids the API would
  refuse are rewritten the same way in calls and results.
- pi: one ``message`` entry per user and assistant message and one ``toolResult`` entry
  per tool result, chained. pi has no message holding several results, so a tool message
  answering several calls is read back from pi as one tool message per result.
- Images travel inline as base64 from the blob store; an image whose file is gone becomes
  a short text saying so. (Claude Code leaves images out of an error result when it
  sends one; the file keeps them.)

Compaction markers and other system messages: a marker imported from the same tool is
written back as that tool's own record (Claude Code's ``compact_boundary`` with its
``logicalParentUuid``, the summary following as an ``isCompactSummary`` user record; pi's
``compaction`` entry with its summary, ``tokensBefore`` and ``firstKeptEntryId``), so the
tool shows the model what it showed before. Any other system message, a marker from the
other tool included, is written as context the model reads in place (an ``isMeta`` user
record; a pi ``custom_message``; an import reads either back as a user message):
nothing is cut that Arbor would send. Compaction
records Arbor made itself are views, not part of the tree, and are not exported (the
tool compacts the originals by its own rules); neither is the conversation's system
prompt (each tool sends its own). pi branch summaries and custom messages go back as pi
entries; live checkpoints become pi labels (Claude Code has no such record).

Ids are derived, not random: the session id from the conversation and the tip, record ids
from the session and the message, so exporting the same branch twice gives the same
file (and the same session, which the new file replaces).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from conversations.errors import InvalidInput
from conversations.models import Blob, Checkpoint, CheckpointState, Conversation, Message
from conversations.parts import image_blobs

# The Claude Code release whose files these records copy (and that the tests resume).
CLAUDE_CODE_VERSION = "2.1.197"
PI_SESSION_VERSION = 3
DEFAULT_CWD = "/"
_NAMESPACE = uuid.UUID("5b0c1f53-8d1e-4a53-9a3c-4f5e2d6a7b10")

Part = dict[str, Any]


@dataclass(frozen=True)
class Session:
    session_id: str
    content: bytes


def claude_project_dir(cwd: str) -> str:
    """The directory under ``~/.claude/projects`` Claude Code keeps a working directory's
    sessions in (its own rule: non-alphanumerics become ``-``; a name over 200
    characters is cut and given a hash of the path)."""
    name = re.sub(r"[^a-zA-Z0-9]", "-", cwd)
    if len(name) <= 200:
        return name
    return f"{name[:200]}-{_base36(abs(_java_hash(cwd)))}"


def _java_hash(text: str) -> int:
    """JavaScript's ``(h << 5) - h + charCode | 0`` over UTF-16 code units."""
    value = 0
    data = text.encode("utf-16-le", "surrogatepass")
    for i in range(0, len(data), 2):
        value = (value * 31 + int.from_bytes(data[i : i + 2], "little")) & 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _base36(value: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        value, rest = divmod(value, 36)
        out = digits[rest] + out
        if not value:
            return out


def check_cwd(cwd: str | None) -> str:
    if cwd is None or cwd == "":
        return DEFAULT_CWD
    absolute = cwd.startswith("/") or re.match(r"^[A-Za-z]:[\\/]", cwd) is not None
    if not absolute or len(cwd) > 4096 or any(c in cwd for c in "\x00\r\n"):
        raise InvalidInput(
            "cwd must be the absolute path of the directory the tool runs in", code="bad_cwd"
        )
    return cwd


# --- what both formats share ---------------------------------------------------------


def _iso(value: datetime) -> str:
    """A time as JavaScript's toISOString writes it (milliseconds, Z)."""
    return value.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _epoch_ms(value: datetime) -> int:
    return int(value.timestamp() * 1000)


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _lines(rows: list[dict[str, Any]]) -> bytes:
    # A lone surrogate (possible on SQLite) is written as its JSON escape.
    return "".join(_dump(r) + "\n" for r in rows).encode("utf-8", errors="backslashreplace")


def _texts(parts: list[Part]) -> str:
    return "\n\n".join(p.get("text", "") for p in parts if p.get("type") == "text")


def _source(message: Message) -> dict[str, Any]:
    source = message.metadata.get("source")
    return source if isinstance(source, dict) else {}


def _marker(message: Message, fmt: str) -> dict[str, Any] | None:
    """The compaction marker an import of ``fmt`` left on a system message."""
    marker = message.metadata.get("compaction_marker")
    if message.role == "system" and isinstance(marker, dict) and marker.get("format") == fmt:
        return marker
    return None


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def usage_counts(usage: Any) -> tuple[int, int, int, int] | None:
    """Measured usage in any of the shapes Arbor keeps — pi's, Anthropic's (input without
    the cache), Arbor's own (input including it) — as (input without cache, output,
    cache read, cache write)."""
    if not isinstance(usage, dict):
        return None
    if "input" in usage or "output" in usage:
        return (
            _count(usage.get("input")),
            _count(usage.get("output")),
            _count(usage.get("cacheRead")),
            _count(usage.get("cacheWrite")),
        )
    if "input_tokens" not in usage and "output_tokens" not in usage:
        return None
    if "cache_read_input_tokens" in usage or "cache_creation_input_tokens" in usage:
        return (
            _count(usage.get("input_tokens")),
            _count(usage.get("output_tokens")),
            _count(usage.get("cache_read_input_tokens")),
            _count(usage.get("cache_creation_input_tokens")),
        )
    read, write = _count(usage.get("cache_read_tokens")), _count(usage.get("cache_write_tokens"))
    total = _count(usage.get("input_tokens"))
    return max(total - read - write, 0), _count(usage.get("output_tokens")), read, write


def _finish(message: Message) -> str | None:
    """The stop reason in whatever vocabulary it was kept (Anthropic's, pi's, Arbor's)."""
    for key in ("stop_reason", "finish_reason"):
        value = message.metadata.get(key)
        if isinstance(value, str) and value:
            return value
    return None


def _has_calls(message: Message) -> bool:
    return any(p.get("type") == "tool_call" for p in message.parts)


def _model_name(message: Message, conversation: Conversation) -> str:
    model = message.metadata.get("model")
    if isinstance(model, str) and model:
        return model
    return conversation.model.split("/", 1)[-1] or "unknown"


class _Images:
    """The images of the exported messages as (mime, base64), read once each."""

    def __init__(self, messages: list[Message]) -> None:
        wanted = {sha for m in messages for sha in image_blobs(m.parts)}
        self.data: dict[str, tuple[str, str]] = {}
        for blob in Blob.objects.filter(sha256__in=wanted) if wanted else []:
            try:
                with blob.file.open("rb") as handle:
                    raw = handle.read()
            except OSError:  # the file is gone from storage: the part says so instead
                continue
            self.data[blob.sha256] = (blob.mime, base64.b64encode(raw).decode())

    def get(self, part: Part) -> tuple[str, str] | None:
        found = self.data.get(str(part.get("blob")))
        if found is None:
            return None
        mime = part.get("mime")
        return (mime if isinstance(mime, str) and mime else found[0]), found[1]


def _missing_image(part: Part) -> str:
    return f"[image {part.get('blob')} is not in Arbor's blob store]"


@dataclass
class _Plan:
    conversation: Conversation
    messages: list[Message]  # parents first, the tip's branch last at every fork
    by_id: dict[uuid.UUID, Message]
    tip: Message
    tip_is_leaf: bool
    session: uuid.UUID
    images: _Images

    def ids(self, message: Message, count: int) -> list[str]:
        return [str(uuid.uuid5(self.session, f"{message.id}/{k}")) for k in range(count)]

    def path(self) -> list[Message]:
        out: list[Message] = []
        current: Message | None = self.tip
        while current is not None:
            out.append(current)
            current = self.by_id.get(current.parent_id) if current.parent_id else None
        return out[::-1]

    def owner(self, message: Message) -> Message | None:
        """The assistant message whose calls a tool message answers: the first message
        above it that is not a tool message."""
        current = self.by_id.get(message.parent_id) if message.parent_id else None
        while current is not None and current.role == "tool":
            current = self.by_id.get(current.parent_id) if current.parent_id else None
        return current

    def walk(self, write: Callable[[Message, str | None], str | None]) -> dict[uuid.UUID, str]:
        """``write`` each message, parents first, given the id of its parent's last
        record or entry; returns each message's last record or entry id."""
        last: dict[uuid.UUID, str] = {}
        for m in self.messages:
            parent = last.get(m.parent_id) if m.parent_id else None
            parent = write(m, parent)
            if parent is not None:
                last[m.id] = parent
        return last

    def call_names(self, message: Message) -> dict[str, str]:
        """The tool name of each call a tool message may answer."""
        owner = self.owner(message)
        return {
            str(p.get("id")): str(p.get("name"))
            for p in (owner.parts if owner is not None else [])
            if p.get("type") == "tool_call"
        }


def _plan(conversation: Conversation, tip: uuid.UUID | None) -> _Plan:
    rows = list(
        Message.objects.filter(conversation=conversation)
        .defer("search_text")
        .order_by("created_at", "id")
    )
    by_id = {m.id: m for m in rows}
    tip_id = tip if tip is not None else conversation.tip_id
    if tip_id is None or tip_id not in by_id:
        raise InvalidInput("the conversation has no messages to export", code="empty_conversation")
    on_path: set[uuid.UUID] = set()
    key: uuid.UUID | None = tip_id
    while key is not None and key not in on_path:
        on_path.add(key)
        key = by_id[key].parent_id
    children: dict[uuid.UUID | None, list[Message]] = {}
    for row in rows:
        children.setdefault(row.parent_id, []).append(row)

    def below(parent: uuid.UUID | None) -> list[Message]:
        # Stable sort: siblings keep (created_at, id); the one on the tip's path goes last.
        return sorted(children.get(parent, []), key=lambda m: m.id in on_path)

    ordered: list[Message] = []
    stack = below(None)[::-1]
    while stack:
        row = stack.pop()
        ordered.append(row)
        stack.extend(below(row.id)[::-1])
    session = uuid.uuid5(_NAMESPACE, f"{conversation.pk}/{tip_id}")
    return _Plan(
        conversation=conversation,
        messages=ordered,
        by_id=by_id,
        tip=by_id[tip_id],
        tip_is_leaf=not children.get(tip_id),
        session=session,
        images=_Images(ordered),
    )


# --- Claude Code ---------------------------------------------------------------------

_ANTHROPIC_ID = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_TO_ANTHROPIC_STOP = {
    # Anthropic's own words, pi's, Arbor's normalised ones.
    "end_turn": "end_turn",
    "stop_sequence": "stop_sequence",
    "max_tokens": "max_tokens",
    "tool_use": "tool_use",
    "refusal": "refusal",
    "pause_turn": "pause_turn",
    "stop": "end_turn",
    "toolUse": "tool_use",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}


def _anthropic_id(value: Any) -> str:
    """A tool-use id the Messages API takes; others are rewritten (the same way in the
    call and its result, so they still pair)."""
    text = str(value)
    if _ANTHROPIC_ID.match(text):
        return text
    digest = hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:16]
    return (re.sub(r"[^a-zA-Z0-9_-]", "_", text)[:40] + "_" + digest).lstrip("_") or digest


def _claude_usage(message: Message) -> dict[str, Any]:
    usage = message.metadata.get("usage")
    if _source(message).get("format") == "claude-code" and isinstance(usage, dict):
        return usage
    fresh, output, read, write = usage_counts(usage) or (0, 0, 0, 0)
    return {
        "input_tokens": fresh,
        "cache_creation_input_tokens": write,
        "cache_read_input_tokens": read,
        "output_tokens": output,
    }


def _claude_image(part: Part, images: _Images) -> dict[str, Any]:
    found = images.get(part)
    if found is None:
        return {"type": "text", "text": _missing_image(part)}
    mime, data = found
    return {"type": "image", "source": {"type": "base64", "media_type": mime, "data": data}}


def _claude_content(parts: list[Part], images: _Images) -> str | list[dict[str, Any]]:
    """User content as Claude Code writes it: a plain prompt as a string, anything else
    as blocks."""
    if len(parts) == 1 and parts[0].get("type") == "text":
        return str(parts[0].get("text", ""))
    blocks: list[dict[str, Any]] = []
    for part in parts:
        if part.get("type") == "image":
            blocks.append(_claude_image(part, images))
        elif part.get("type") == "text":
            blocks.append({"type": "text", "text": part.get("text", "")})
    return blocks


def _claude_block(part: Part, images: _Images) -> dict[str, Any]:
    kind = part.get("type")
    if kind == "tool_call":
        return {
            "type": "tool_use",
            "id": _anthropic_id(part.get("id")),
            "name": part.get("name"),
            "input": part.get("arguments", {}),
        }
    if kind == "thinking":
        signature = part.get("signature")
        if isinstance(signature, str) and signature:
            return {"type": "thinking", "thinking": part.get("text", ""), "signature": signature}
        return {"type": "text", "text": part.get("text", "")}
    if kind == "image":  # the API takes no images from the assistant
        return {"type": "text", "text": f"[image {part.get('blob')}]"}
    return {"type": "text", "text": part.get("text", "")}


def _anthropic_stop(message: Message) -> str:
    """The stop reason in Anthropic's words: Claude Code's own kept as it is, any other
    mapped, else what the message shows (calls made or not)."""
    raw = _finish(message)
    stop = (
        raw
        if raw and _source(message).get("format") == "claude-code"
        else _TO_ANTHROPIC_STOP.get(raw or "")
    )
    return stop or ("tool_use" if _has_calls(message) else "end_turn")


def _message_id_counts(messages: list[Message]) -> dict[str, int]:
    """How often each kept ``message.id`` occurs among the assistant messages."""
    seen: dict[str, int] = {}
    for m in messages:
        kept = m.metadata.get("message_id")
        if m.role == "assistant" and isinstance(kept, str) and kept:
            seen[kept] = seen.get(kept, 0) + 1
    return seen


class _ClaudeCodeWriter:
    """The records of one Claude Code session file. ``write`` adds what one message
    becomes and returns the uuid of its last record (what its children hang below)."""

    def __init__(self, plan: _Plan, cwd: str) -> None:
        self.plan = plan
        self.sid = str(plan.session)
        self.common = {
            "isSidechain": False,
            "userType": "external",
            "cwd": cwd,
            "sessionId": self.sid,
            "version": CLAUDE_CODE_VERSION,
        }
        # message.id must differ between messages: Claude Code merges records sharing one.
        self.seen = _message_id_counts(plan.messages)
        self.call_record: dict[tuple[uuid.UUID, str], str] = {}  # (assistant, call id) → record
        self.rows: list[dict[str, Any]] = []

    def record(self, kind: str, uid: str, parent: str | None, m: Message, **fields: Any) -> None:
        self.rows.append(
            {"parentUuid": parent, **self.common, "type": kind, **fields}
            | {"uuid": uid, "timestamp": _iso(m.created_at)}
        )

    def write(self, m: Message, parent: str | None) -> str | None:
        if m.role == "assistant":
            return self.assistant(m, parent)
        if m.role == "tool":
            return self.tool(m, parent)
        marker = _marker(m, "claude-code")
        if marker is not None:
            return self.boundary(m, parent, marker)
        return self.user(m, parent)

    def message_id(self, m: Message) -> str:
        """The kept API message id when no other message shares it, else a derived one."""
        kept = m.metadata.get("message_id")
        if isinstance(kept, str) and self.seen.get(kept) == 1:
            return kept
        return "msg_" + uuid.uuid5(self.plan.session, f"{m.id}/message").hex[:24]

    def assistant(self, m: Message, parent: str | None) -> str | None:
        """One record per part, all sharing ``message.id`` (as Claude Code 2.x writes)."""
        message_id = self.message_id(m)
        stop = _anthropic_stop(m)
        extra: dict[str, Any] = {}
        if isinstance(m.metadata.get("request_id"), str):
            extra["requestId"] = m.metadata["request_id"]
        if m.metadata.get("api_error"):
            extra["isApiErrorMessage"] = True
        for uid, part in zip(self.plan.ids(m, len(m.parts)), m.parts, strict=True):
            body = {
                "id": message_id,
                "type": "message",
                "role": "assistant",
                "model": _model_name(m, self.plan.conversation),
                "content": [_claude_block(part, self.plan.images)],
                "stop_reason": stop,
                "stop_sequence": None,
                "usage": _claude_usage(m),
            }
            self.record("assistant", uid, parent, m, message=body, **extra)
            if part.get("type") == "tool_call":
                self.call_record[(m.id, str(part.get("id")))] = uid
            parent = uid
        return parent

    def tool(self, m: Message, parent: str | None) -> str:
        # One record for the message, its results as blocks in call order (the message
        # Claude Code sends): an import reads it back as one tool message.
        owner = self.plan.owner(m)
        names = self.plan.call_names(m)
        results = [p for p in m.parts if p.get("type") == "tool_result"]
        blocks = [
            {
                "tool_use_id": _anthropic_id(p.get("call_id")),
                "type": "tool_result",
                "content": _claude_content(p["parts"], self.plan.images) if p.get("parts") else "",
                "is_error": bool(p.get("is_error")),
            }
            for p in results
        ]
        (uid,) = self.plan.ids(m, 1)
        first_call = str(results[0].get("call_id")) if results else ""
        extra = {"toolUseResult": _tool_use_result(names.get(first_call), results)}
        source = self.call_record.get((owner.id, first_call)) if owner is not None else None
        if source is not None:
            extra["sourceToolAssistantUUID"] = source
        self.record("user", uid, parent, m, message={"role": "user", "content": blocks}, **extra)
        return uid

    def boundary(self, m: Message, parent: str | None, marker: dict[str, Any]) -> str:
        (uid,) = self.plan.ids(m, 1)
        # Claude Code starts the line again after a boundary: no parentUuid, the message
        # it follows in logicalParentUuid.
        self.rows.append(
            {"parentUuid": None, "logicalParentUuid": parent, **self.common}
            | {
                "type": "system",
                "subtype": "compact_boundary",
                "content": "Conversation compacted",
                "isMeta": False,
                "level": "info",
                "compactMetadata": {
                    "trigger": marker.get("trigger") or "manual",
                    "preTokens": marker.get("tokens_before") or 0,
                },
                "uuid": uid,
                "timestamp": _iso(m.created_at),
            }
        )
        return uid

    def user(self, m: Message, parent: str | None) -> str:
        """A user message, or a system message said in place as context."""
        (uid,) = self.plan.ids(m, 1)
        flags: dict[str, Any] = {}
        if m.role == "system" or m.metadata.get("meta"):
            flags["isMeta"] = True
        if m.metadata.get("compact_summary"):
            flags["isCompactSummary"] = True
            flags["isVisibleInTranscriptOnly"] = True
        body = {"role": "user", "content": _claude_content(m.parts, self.plan.images)}
        self.record("user", uid, parent, m, message=body, **flags)
        return uid

    def content(self, leaf: str) -> bytes:
        """The file: the title's ``summary`` record first, the ``last-prompt`` pointer to
        ``leaf`` (where Claude Code resumes) last."""
        title = " ".join(self.plan.conversation.title.split())
        head = [{"type": "summary", "summary": title, "leafUuid": leaf}] if title else []
        pointer: dict[str, Any] = {"type": "last-prompt"}
        prompt = _last_prompt(self.plan.path())
        if prompt:
            pointer["lastPrompt"] = prompt
        pointer["leafUuid"] = leaf
        if not self.plan.tip_is_leaf:
            # Without "explicit" Claude Code resumes at a leaf; with it, at the message named.
            pointer["explicit"] = True
        pointer["sessionId"] = self.sid
        return _lines([*head, *self.rows, pointer])


def claude_code_session(
    *, conversation: Conversation, tip: uuid.UUID | None = None, cwd: str = DEFAULT_CWD
) -> Session:
    plan = _plan(conversation, tip)
    writer = _ClaudeCodeWriter(plan, cwd)
    last = plan.walk(writer.write)
    return Session(session_id=writer.sid, content=writer.content(last[plan.tip.id]))


def _tool_use_result(name: str | None, results: list[Part]) -> Any:
    """``toolUseResult``: Claude Code tells a record of tool results from a typed prompt by
    it, and reads it only when the record holds one result. One Bash result gets Bash's
    own shape, an error the text as Claude Code writes it, anything else the text."""
    text = "\n\n".join(_texts(p.get("parts", [])) for p in results)
    if len(results) != 1:
        return text
    if results[0].get("is_error"):
        return f"Error: {text}"
    if name == "Bash":
        return {
            "stdout": text,
            "stderr": "",
            "interrupted": False,
            "isImage": False,
            "noOutputExpected": False,
        }
    return text


def _last_prompt(path: list[Message]) -> str:
    for m in reversed(path):
        if (
            m.role == "user"
            and not m.metadata.get("meta")
            and not m.metadata.get("compact_summary")
        ):
            text = _texts(m.parts)
            if text:
                return text
    return ""


# --- pi ------------------------------------------------------------------------------

_TO_PI_STOP = {
    "stop": "stop",
    "length": "length",
    "toolUse": "toolUse",
    "error": "error",
    "aborted": "aborted",
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "tool_use": "toolUse",
    "tool_calls": "toolUse",
    "refusal": "stop",
    "pause_turn": "stop",
    "content_filter": "stop",
}
_PI_COMPACTION_HEAD = re.compile(
    r"\[Conversation compacted here.*?\. Summary of what came before:\]\n\n", re.S
)
_PI_BRANCH_HEAD = "[Summary of a branch left behind]\n"


def _pi_usage(message: Message) -> dict[str, Any]:
    usage = message.metadata.get("usage")
    if _source(message).get("format") == "pi" and isinstance(usage, dict):
        return usage
    fresh, output, read, write = usage_counts(usage) or (0, 0, 0, 0)
    return {
        "input": fresh,
        "output": output,
        "cacheRead": read,
        "cacheWrite": write,
        "totalTokens": fresh + output + read + write,
        "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0, "total": 0},
    }


def _pi_provider(message: Message, conversation: Conversation) -> tuple[str, str]:
    provider = message.metadata.get("provider")
    api = message.metadata.get("api")
    if not isinstance(provider, str) or not provider:
        if _source(message).get("format") == "claude-code":
            provider = "anthropic"
        elif "/" in conversation.model:
            provider = conversation.model.split("/", 1)[0]
        else:
            provider = "arbor"
    if not isinstance(api, str) or not api:
        api = "anthropic-messages" if provider == "anthropic" else "openai-completions"
    return provider, api


def _pi_content(parts: list[Part], images: _Images) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for part in parts:
        kind = part.get("type")
        if kind == "image":
            found = images.get(part)
            if found is None:
                out.append({"type": "text", "text": _missing_image(part)})
            else:
                out.append({"type": "image", "data": found[1], "mimeType": found[0]})
        elif kind == "thinking":
            block = {"type": "thinking", "thinking": part.get("text", "")}
            if part.get("signature"):
                block["thinkingSignature"] = part["signature"]
            out.append(block)
        elif kind == "tool_call":
            out.append(
                {
                    "type": "toolCall",
                    "id": part.get("id"),
                    "name": part.get("name"),
                    "arguments": part.get("arguments", {}),
                }
            )
        else:
            out.append({"type": "text", "text": part.get("text", "")})
    return out


class _PiWriter:
    """The entries of one pi session file. ``write`` adds what one message becomes and
    returns the id of its last entry (what its children hang below)."""

    def __init__(self, plan: _Plan, cwd: str) -> None:
        self.plan = plan
        self.sid = str(plan.session)
        self.used: set[str] = set()
        self.rows: list[dict[str, Any]] = [
            {
                "type": "session",
                "version": PI_SESSION_VERSION,
                "id": self.sid,
                "timestamp": _iso(plan.conversation.created_at),
                "cwd": cwd,
            }
        ]
        # Source ids an import from pi kept → entry ids here, for the compaction and
        # branch-summary entries that name other entries.
        self.from_source: dict[str, str] = {}
        self.naming: list[dict[str, Any]] = []

    def short_id(self, name: str) -> str:
        # pi's own ids are 8 hex digits; a clash (rare) takes the whole hash.
        full = uuid.uuid5(self.plan.session, name).hex
        chosen = full[:8] if full[:8] not in self.used else full
        self.used.add(chosen)
        return chosen

    def entry(self, kind: str, parent: str | None, m: Message, key: str, **fields: Any) -> str:
        eid = self.short_id(key)
        self.rows.append(
            {"type": kind, "id": eid, "parentId": parent, "timestamp": _iso(m.created_at)} | fields
        )
        return eid

    def write(self, m: Message, parent: str | None) -> str | None:
        first = len(self.rows)
        parent = self._write(m, parent)
        source = _source(m)
        if (
            source.get("format") == "pi"
            and isinstance(source.get("id"), str)
            and first < len(self.rows)
        ):
            self.from_source.setdefault(source["id"], self.rows[first]["id"])
        return parent

    def _write(self, m: Message, parent: str | None) -> str | None:
        if m.role == "tool":
            return self.tool_results(m, parent)
        if m.role == "assistant":
            return self.assistant(m, parent)
        marker = _marker(m, "pi")
        if marker is not None:
            return self.compaction(m, parent, marker)
        if isinstance(m.metadata.get("branch_summary"), dict):
            return self.branch_summary(m, parent)
        if m.role == "system" or m.metadata.get("custom_type"):
            return self.custom_message(m, parent)
        body = {
            "role": "user",
            "content": _pi_content(m.parts, self.plan.images),
            "timestamp": _epoch_ms(m.created_at),
        }
        return self.entry("message", parent, m, f"{m.id}/0", message=body)

    def tool_results(self, m: Message, parent: str | None) -> str | None:
        """One ``toolResult`` entry per result, chained (pi has no message of several)."""
        names = self.plan.call_names(m)
        results = [p for p in m.parts if p.get("type") == "tool_result"]
        for k, part in enumerate(results):
            call_id = str(part.get("call_id"))
            body = {
                "role": "toolResult",
                "toolCallId": call_id,
                "toolName": m.metadata.get("tool_name") or names.get(call_id, "unknown"),
                "content": _pi_content(part.get("parts", []), self.plan.images),
                "isError": bool(part.get("is_error")),
                "timestamp": _epoch_ms(m.created_at),
            }
            parent = self.entry("message", parent, m, f"{m.id}/{k}", message=body)
        return parent

    def assistant(self, m: Message, parent: str | None) -> str:
        provider, api = _pi_provider(m, self.plan.conversation)
        raw = _finish(m)
        body = {
            "role": "assistant",
            "content": _pi_content(m.parts, self.plan.images),
            "api": api,
            "provider": provider,
            "model": _model_name(m, self.plan.conversation),
            "usage": _pi_usage(m),
            "stopReason": _TO_PI_STOP.get(raw or "") or ("toolUse" if _has_calls(m) else "stop"),
            "timestamp": _epoch_ms(m.created_at),
        }
        if isinstance(m.metadata.get("error"), str):
            body["errorMessage"] = m.metadata["error"]
        return self.entry("message", parent, m, f"{m.id}/0", message=body)

    def compaction(self, m: Message, parent: str | None, marker: dict[str, Any]) -> str:
        text = _texts(m.parts)
        head = _PI_COMPACTION_HEAD.match(text)
        fields: dict[str, Any] = {"summary": text[head.end() :] if head else text}
        first_kept = marker.get("first_kept")
        if isinstance(first_kept, int):  # version 1 counted entries, the header as 0
            first_kept = f"entry-{first_kept}"
        if isinstance(first_kept, str):
            fields["firstKeptEntryId"] = first_kept  # a source id, mapped in link_names
        if isinstance(marker.get("tokens_before"), int):
            fields["tokensBefore"] = marker["tokens_before"]
        eid = self.entry("compaction", parent, m, f"{m.id}/0", **fields)
        self.naming.append(self.rows[-1])
        return eid

    def branch_summary(self, m: Message, parent: str | None) -> str:
        summary = _texts(m.parts).removeprefix(_PI_BRANCH_HEAD)
        from_id = m.metadata["branch_summary"].get("from_id")
        eid = self.entry("branch_summary", parent, m, f"{m.id}/0", fromId=from_id, summary=summary)
        self.naming.append(self.rows[-1])
        return eid

    def custom_message(self, m: Message, parent: str | None) -> str:
        return self.entry(
            "custom_message",
            parent,
            m,
            f"{m.id}/0",
            customType=m.metadata.get("custom_type") or "arbor-system",
            content=_pi_content(m.parts, self.plan.images),
            display=True,
        )

    def link_names(self) -> None:
        """Point the entries that name other entries at their ids in this file."""
        for row in self.naming:
            if isinstance(row.get("fromId"), str):
                row["fromId"] = self.from_source.get(row["fromId"], row["fromId"])
            if "firstKeptEntryId" in row:
                if row["firstKeptEntryId"] in self.from_source:
                    row["firstKeptEntryId"] = self.from_source[row["firstKeptEntryId"]]
                else:
                    # Not in this file (an entry the import left out): pi then keeps
                    # nothing from before the compaction but its summary.
                    del row["firstKeptEntryId"]

    def close(self, last: dict[uuid.UUID, str]) -> None:
        """pi resumes at the file's last entry: the live checkpoints as labels, then the
        title, hung below the tip."""
        conversation, tip = self.plan.conversation, self.plan.tip
        parent = last[tip.id]
        checkpoints = Checkpoint.objects.filter(
            conversation=conversation, state=CheckpointState.LIVE
        ).order_by("created_at", "id")
        for cp in checkpoints:
            if cp.message_id in last:
                parent = self.entry(
                    "label",
                    parent,
                    tip,
                    f"label/{cp.pk}",
                    targetId=last[cp.message_id],
                    label=cp.label,
                )
        title = " ".join(conversation.title.split())
        self.entry("session_info", parent, tip, "session_info", name=title)


def pi_session(
    *, conversation: Conversation, tip: uuid.UUID | None = None, cwd: str = DEFAULT_CWD
) -> Session:
    plan = _plan(conversation, tip)
    writer = _PiWriter(plan, cwd)
    last = plan.walk(writer.write)
    writer.link_names()
    writer.close(last)
    return Session(session_id=writer.sid, content=_lines(writer.rows))
