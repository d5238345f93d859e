"""Pure conversions between Arbor messages and the two wire protocols.

Requests: Arbor ``{role, parts}`` messages + system prompt + tools → OpenAI chat
completions ``messages``/``tools``, or Anthropic ``system``/``messages``/``tools``.
Replies: a provider's JSON reply (or its stream events) → Arbor assistant parts, usage and
a finish reason. No network and no database here; images come through ``load_blob``.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from conversations.providers.base import (
    Done,
    LoadBlob,
    Part,
    Reply,
    StreamEvent,
    TextDelta,
    ThinkingDelta,
    ToolCallFinished,
    ToolCallStarted,
    ToolSpec,
    Usage,
)

EMPTY_TOOL_RESULT = "(empty result)"
TOOL_ERROR_PREFIX = "Error: "
# OpenAI tool messages hold text only, so images a tool returned travel in a user message
# right after the tool messages; the tool message says so.
TOOL_IMAGE_NOTE = "[image returned by the tool; attached in the next message]"


# --- shared helpers -------------------------------------------------------------------


def _sniff_mime(data: bytes) -> str:
    if data.startswith(b"\x89PNG"):
        return "image/png"
    if data.startswith(b"\xff\xd8"):
        return "image/jpeg"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return "application/octet-stream"


def _image_data(part: Mapping[str, Any], load_blob: LoadBlob | None) -> tuple[str, str]:
    """(mime, base64 data) of an image part."""
    if load_blob is None:
        raise ValueError("the messages hold images but no load_blob was given to read them")
    data = load_blob(part["blob"])
    mime = part.get("mime") or _sniff_mime(data)
    return mime, base64.b64encode(data).decode("ascii")


def _texts(parts: Sequence[Mapping[str, Any]]) -> list[str]:
    return [p["text"] for p in parts if p.get("type") == "text" and p.get("text")]


def parse_arguments(raw: Any) -> dict[str, Any]:
    """Tool-call arguments as a dict. Models sometimes emit invalid JSON (or JSON that is
    not an object); that is kept verbatim as ``{"_raw": …}`` instead of failing the turn,
    so the tool can report the error and the model can retry."""
    if isinstance(raw, dict):
        return raw
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    try:
        value = json.loads(raw)
    except (TypeError, ValueError):
        return {"_raw": str(raw)}
    return value if isinstance(value, dict) else {"_raw": str(raw)}


def _arguments_json(arguments: Mapping[str, Any]) -> str:
    # Send invalid arguments back exactly as the model wrote them.
    if set(arguments) == {"_raw"} and isinstance(arguments["_raw"], str):
        return arguments["_raw"]
    return json.dumps(arguments, ensure_ascii=False)


def _new_call_id() -> str:
    # Some OpenAI-compatible servers omit tool call ids; Arbor pairs results by id.
    return f"call_{uuid.uuid4().hex[:24]}"


# --- requests: OpenAI chat completions ------------------------------------------------


@dataclass
class OpenAIPayload:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)


def _openai_image(part: Mapping[str, Any], load_blob: LoadBlob | None) -> dict[str, Any]:
    mime, data = _image_data(part, load_blob)
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{data}"}}


def _openai_user_content(
    parts: Sequence[Mapping[str, Any]], load_blob: LoadBlob | None
) -> str | list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for part in parts:
        if part.get("type") == "text" and part.get("text"):
            items.append({"type": "text", "text": part["text"]})
        elif part.get("type") == "image":
            items.append(_openai_image(part, load_blob))
    # A lone text part goes as a plain string: every OpenAI-compatible server takes that.
    if len(items) == 1 and items[0]["type"] == "text":
        return str(items[0]["text"])
    return items or ""


def openai_tools(tools: Sequence[ToolSpec | Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for tool in map(ToolSpec.coerce, tools):
        out.append(
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": dict(tool.parameters),
                },
            }
        )
    return out


def _openai_assistant(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """One assistant message, or None when nothing in it can travel (e.g. thinking only)."""
    text = "".join(_texts(parts))
    calls = [
        {
            "id": p["id"],
            "type": "function",
            "function": {
                "name": p["name"],
                "arguments": _arguments_json(p.get("arguments") or {}),
            },
        }
        for p in parts
        if p.get("type") == "tool_call"
    ]
    if not text and not calls:
        return None
    entry: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        entry["tool_calls"] = calls
    return entry


def _openai_tool_results(
    parts: Sequence[Mapping[str, Any]],
    load_blob: LoadBlob | None,
    pending_images: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """One ``role: tool`` message per tool_result; their images go to ``pending_images``,
    to be sent in the user message that follows the tool messages."""
    out: list[dict[str, Any]] = []
    for result in parts:
        if result.get("type") != "tool_result":
            continue
        inner: Sequence[Mapping[str, Any]] = result.get("parts") or []
        lines = _texts(inner)
        images = [p for p in inner if p.get("type") == "image"]
        if images:
            lines.append(TOOL_IMAGE_NOTE)
            pending_images.extend(_openai_image(p, load_blob) for p in images)
        content = "\n".join(lines) or EMPTY_TOOL_RESULT
        if result.get("is_error"):
            content = TOOL_ERROR_PREFIX + content
        out.append({"role": "tool", "tool_call_id": result["call_id"], "content": content})
    return out


def _openai_message(
    role: str, parts: Sequence[Mapping[str, Any]], load_blob: LoadBlob | None
) -> list[dict[str, Any]]:
    """The chat-completions messages for one non-tool Arbor message (none or one)."""
    if role == "system":
        return [{"role": "system", "content": "\n\n".join(_texts(parts))}]
    if role == "user":
        return [{"role": "user", "content": _openai_user_content(parts, load_blob)}]
    if role == "assistant":
        entry = _openai_assistant(parts)
        return [entry] if entry is not None else []
    raise ValueError(f"unknown message role {role!r}")


def to_openai(
    messages: Sequence[Mapping[str, Any]],
    *,
    system: str = "",
    tools: Sequence[ToolSpec | Mapping[str, Any]] = (),
    load_blob: LoadBlob | None = None,
) -> OpenAIPayload:
    """Arbor messages → OpenAI chat-completions ``messages`` and ``tools``.

    Thinking parts are dropped (chat completions has no way to send them back). Each
    tool_result becomes its own ``role: tool`` message.
    """
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": system})
    pending_images: list[dict[str, Any]] = []

    def flush_images() -> None:
        if pending_images:
            out.append({"role": "user", "content": list(pending_images)})
            pending_images.clear()

    for message in messages:
        role = message["role"]
        parts: Sequence[Mapping[str, Any]] = message.get("parts") or []
        if role == "tool":
            # Consecutive tool messages share one user message for their images.
            out.extend(_openai_tool_results(parts, load_blob, pending_images))
            continue
        flush_images()
        out.extend(_openai_message(role, parts, load_blob))
    flush_images()
    return OpenAIPayload(messages=out, tools=openai_tools(tools))


# --- requests: Anthropic messages ------------------------------------------------------


@dataclass
class AnthropicPayload:
    system: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = field(default_factory=list)


def _anthropic_image(part: Mapping[str, Any], load_blob: LoadBlob | None) -> dict[str, Any]:
    mime, data = _image_data(part, load_blob)
    return {"type": "image", "source": {"type": "base64", "media_type": mime, "data": data}}


def _anthropic_blocks(
    parts: Sequence[Mapping[str, Any]], load_blob: LoadBlob | None
) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    for part in parts:
        kind = part.get("type")
        # Anthropic rejects empty text blocks ("text content blocks must be non-empty").
        if kind == "text" and part.get("text"):
            blocks.append({"type": "text", "text": part["text"]})
        elif kind == "image":
            blocks.append(_anthropic_image(part, load_blob))
        elif kind == "thinking" and part.get("signature"):
            # Only signed thinking can be sent back; unsigned text (from another
            # provider, or an import) would be rejected.
            blocks.append(
                {"type": "thinking", "thinking": part["text"], "signature": part["signature"]}
            )
        elif kind == "tool_call":
            blocks.append(
                {
                    "type": "tool_use",
                    "id": part["id"],
                    "name": part["name"],
                    "input": dict(part.get("arguments") or {}),
                }
            )
        elif kind == "tool_result":
            block: dict[str, Any] = {"type": "tool_result", "tool_use_id": part["call_id"]}
            content = _anthropic_blocks(part.get("parts") or [], load_blob)
            if content:
                block["content"] = content
            if part.get("is_error"):
                block["is_error"] = True
            blocks.append(block)
    return blocks


def anthropic_tools(tools: Sequence[ToolSpec | Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"name": t.name, "description": t.description, "input_schema": dict(t.parameters)}
        for t in map(ToolSpec.coerce, tools)
    ]


def to_anthropic(
    messages: Sequence[Mapping[str, Any]],
    *,
    system: str = "",
    tools: Sequence[ToolSpec | Mapping[str, Any]] = (),
    load_blob: LoadBlob | None = None,
) -> AnthropicPayload:
    """Arbor messages → Anthropic ``system``, ``messages`` and ``tools``.

    Tool results go in a user message as tool_result blocks, first in its content;
    consecutive same-role messages are merged because Anthropic expects alternation.
    """
    system_texts = [system] if system else []
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        parts: Sequence[Mapping[str, Any]] = message.get("parts") or []
        if role == "system":
            texts = _texts(parts)
            if not out:
                system_texts.extend(texts)
                continue
            # Anthropic has no system turn mid-conversation; say it as the user.
            blocks = [{"type": "text", "text": "[system] " + t} for t in texts]
            wire_role = "user"
        elif role in ("user", "tool"):
            blocks = _anthropic_blocks(parts, load_blob)
            wire_role = "user"
        elif role == "assistant":
            blocks = _anthropic_blocks(parts, load_blob)
            wire_role = "assistant"
        else:
            raise ValueError(f"unknown message role {role!r}")
        if not blocks:
            continue
        if out and out[-1]["role"] == wire_role:
            out[-1]["content"].extend(blocks)
        else:
            out.append({"role": wire_role, "content": blocks})
    for entry in out:
        if entry["role"] == "user":
            # tool_result blocks must open the user message that answers the tool_use.
            entry["content"].sort(key=lambda b: b["type"] != "tool_result")
    return AnthropicPayload(
        system="\n\n".join(system_texts), messages=out, tools=anthropic_tools(tools)
    )


# --- replies --------------------------------------------------------------------------

_OPENAI_FINISH = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",
    "content_filter": "content_filter",
}
_ANTHROPIC_FINISH = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}


def _openai_usage(raw: Any) -> Usage | None:
    if not isinstance(raw, Mapping):
        return None
    details = raw.get("prompt_tokens_details") or {}
    return Usage(
        input_tokens=int(raw.get("prompt_tokens") or 0),
        output_tokens=int(raw.get("completion_tokens") or 0),
        cache_read_tokens=int(details.get("cached_tokens") or 0),
    )


def _anthropic_usage(raw: Any, previous: Usage | None = None) -> Usage | None:
    if not isinstance(raw, Mapping):
        return previous
    usage = previous or Usage()
    # Streams send usage twice (message_start, then message_delta with the final output
    # count, and sometimes input counts again): later non-null values win.
    read = raw.get("cache_read_input_tokens")
    write = raw.get("cache_creation_input_tokens")
    if read is not None:
        usage.cache_read_tokens = int(read)
    if write is not None:
        usage.cache_write_tokens = int(write)
    if raw.get("input_tokens") is not None:
        # Anthropic's input_tokens excludes cached tokens; Usage.input_tokens is the
        # whole prompt.
        usage.input_tokens = (
            int(raw["input_tokens"]) + usage.cache_read_tokens + usage.cache_write_tokens
        )
    if raw.get("output_tokens") is not None:
        usage.output_tokens = int(raw["output_tokens"])
    return usage


def _reasoning(raw: Mapping[str, Any]) -> str:
    # Not OpenAI itself: DeepSeek and vLLM send reasoning_content, OpenRouter reasoning.
    value = raw.get("reasoning_content") or raw.get("reasoning")
    return value if isinstance(value, str) else ""


def from_openai(response: Mapping[str, Any]) -> Reply:
    """An OpenAI chat-completions JSON reply → Reply."""
    choices = response.get("choices") or []
    parts: list[Part] = []
    raw_finish = None
    if choices:
        choice = choices[0]
        raw_finish = choice.get("finish_reason")
        message = choice.get("message") or {}
        if thinking := _reasoning(message):
            parts.append({"type": "thinking", "text": thinking})
        content = message.get("content")
        if isinstance(content, list):  # a few compatible servers answer with parts
            content = "".join(c.get("text", "") for c in content if isinstance(c, Mapping))
        if content:
            parts.append({"type": "text", "text": content})
        if message.get("refusal"):
            parts.append({"type": "text", "text": message["refusal"]})
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            parts.append(
                {
                    "type": "tool_call",
                    "id": call.get("id") or _new_call_id(),
                    "name": function.get("name") or "",
                    "arguments": parse_arguments(function.get("arguments")),
                }
            )
    return Reply(
        parts=parts,
        usage=_openai_usage(response.get("usage")),
        finish_reason=_OPENAI_FINISH.get(raw_finish or "", "other"),
        raw_finish_reason=raw_finish,
        model=response.get("model"),
        response_id=response.get("id"),
    )


def _anthropic_part(block: Mapping[str, Any]) -> Part | None:
    kind = block.get("type")
    if kind == "text":
        return {"type": "text", "text": block.get("text") or ""}
    if kind == "thinking":
        part: Part = {"type": "thinking", "text": block.get("thinking") or ""}
        if block.get("signature"):
            part["signature"] = block["signature"]
        return part
    if kind == "tool_use":
        return {
            "type": "tool_call",
            "id": block.get("id") or _new_call_id(),
            "name": block.get("name") or "",
            "arguments": parse_arguments(block.get("input")),
        }
    # redacted_thinking and server-side tool blocks have no Arbor part shape.
    return None


def from_anthropic(response: Mapping[str, Any]) -> Reply:
    """An Anthropic Messages JSON reply → Reply."""
    parts = [p for p in map(_anthropic_part, response.get("content") or []) if p is not None]
    parts = [p for p in parts if not (p["type"] == "text" and not p["text"])]
    raw_finish = response.get("stop_reason")
    return Reply(
        parts=parts,
        usage=_anthropic_usage(response.get("usage")),
        finish_reason=_ANTHROPIC_FINISH.get(raw_finish or "", "other"),
        raw_finish_reason=raw_finish,
        model=response.get("model"),
        response_id=response.get("id"),
    )


# --- stream accumulators --------------------------------------------------------------


@dataclass
class _Call:
    index: int
    id: str
    name: str
    arguments: str = ""
    started: bool = False
    finished: bool = False

    def part(self) -> Part:
        return {
            "type": "tool_call",
            "id": self.id,
            "name": self.name,
            "arguments": parse_arguments(self.arguments),
        }


class OpenAIStreamAccumulator:
    """Feeds on chat.completion.chunk dicts; yields stream events and, at the end, the
    same Reply a non-streamed request would have produced."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.thinking: list[str] = []
        self.calls: dict[int, _Call] = {}
        self.usage: Usage | None = None
        self.raw_finish: str | None = None
        self.model: str | None = None
        self.response_id: str | None = None

    def feed(self, chunk: Mapping[str, Any]) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        self.model = chunk.get("model") or self.model
        self.response_id = chunk.get("id") or self.response_id
        if chunk.get("usage"):
            self.usage = _openai_usage(chunk["usage"])
        for choice in chunk.get("choices") or []:
            # We ask for one choice; other indexes would be another answer entirely.
            if choice.get("index", 0) != 0:
                continue
            events.extend(self._feed_delta(choice.get("delta") or {}))
            if choice.get("finish_reason"):
                self.raw_finish = choice["finish_reason"]
                events.extend(self._finish_calls())
        return events

    def _feed_delta(self, delta: Mapping[str, Any]) -> list[StreamEvent]:
        """Thinking, then text, then tool-call fragments of one choice's delta."""
        events: list[StreamEvent] = []
        if thinking := _reasoning(delta):
            self.thinking.append(thinking)
            events.append(ThinkingDelta(thinking))
        for key in ("content", "refusal"):
            if delta.get(key):
                self.text.append(delta[key])
                events.append(TextDelta(delta[key]))
        for raw in delta.get("tool_calls") or []:
            started = self._feed_call(raw)
            if started is not None:
                events.append(started)
        return events

    def _feed_call(self, raw: Mapping[str, Any]) -> StreamEvent | None:
        """Merge one tool-call fragment; a ToolCallStarted once the call has its name."""
        index = int(raw.get("index") or 0)
        function = raw.get("function") or {}
        call = self.calls.get(index)
        if call is None:
            call = self.calls[index] = _Call(index=index, id="", name="")
        if raw.get("id"):
            call.id = raw["id"]
        if function.get("name"):
            call.name = function["name"]
        call.arguments += function.get("arguments") or ""
        if call.started or not call.name:
            return None
        call.id = call.id or _new_call_id()
        call.started = True
        return ToolCallStarted(index=index, id=call.id, name=call.name)

    def _finish_calls(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        for index in sorted(self.calls):
            call = self.calls[index]
            if not call.finished:
                call.id = call.id or _new_call_id()
                if not call.started:
                    call.started = True
                    events.append(ToolCallStarted(index=index, id=call.id, name=call.name))
                call.finished = True
                events.append(ToolCallFinished(index=index, part=call.part()))
        return events

    def finish(self) -> list[StreamEvent]:
        """Call when the stream ended: any calls still open, then Done."""
        events = self._finish_calls()
        parts: list[Part] = []
        if self.thinking:
            parts.append({"type": "thinking", "text": "".join(self.thinking)})
        if self.text:
            parts.append({"type": "text", "text": "".join(self.text)})
        parts.extend(self.calls[i].part() for i in sorted(self.calls))
        reply = Reply(
            parts=parts,
            usage=self.usage,
            finish_reason=_OPENAI_FINISH.get(self.raw_finish or "", "other"),
            raw_finish_reason=self.raw_finish,
            model=self.model,
            response_id=self.response_id,
        )
        return [*events, Done(reply)]


class AnthropicStreamAccumulator:
    """Feeds on Anthropic stream event dicts (message_start … message_stop)."""

    def __init__(self) -> None:
        self.blocks: dict[int, dict[str, Any]] = {}
        self.json: dict[int, list[str]] = {}
        self.tool_ordinal: dict[int, int] = {}
        self.usage: Usage | None = None
        self.raw_finish: str | None = None
        self.model: str | None = None
        self.response_id: str | None = None

    def feed(self, event: Mapping[str, Any]) -> list[StreamEvent]:
        kind = event.get("type")
        handler = self._HANDLERS.get(kind) if isinstance(kind, str) else None
        # Unknown events (ping, and any the protocol adds later) carry nothing we keep.
        return handler(self, event) if handler is not None else []

    def _on_message_start(self, event: Mapping[str, Any]) -> list[StreamEvent]:
        message = event.get("message") or {}
        self.model = message.get("model")
        self.response_id = message.get("id")
        self.usage = _anthropic_usage(message.get("usage"), self.usage)
        return []

    def _on_block_start(self, event: Mapping[str, Any]) -> list[StreamEvent]:
        index = int(event.get("index") or 0)
        block = dict(event.get("content_block") or {})
        self.blocks[index] = block
        if block.get("type") == "tool_use":
            # The start block carries input {}; the real input arrives as JSON deltas.
            self.json[index] = []
            ordinal = self.tool_ordinal[index] = len(self.tool_ordinal)
            block["id"] = block.get("id") or _new_call_id()
            return [ToolCallStarted(index=ordinal, id=block["id"], name=block["name"])]
        if block.get("type") == "text" and block.get("text"):
            return [TextDelta(block["text"])]
        return []

    def _on_block_delta(self, event: Mapping[str, Any]) -> list[StreamEvent]:
        index = int(event.get("index") or 0)
        block = self.blocks.setdefault(index, {"type": "text", "text": ""})
        delta = event.get("delta") or {}
        dtype = delta.get("type")
        if dtype == "text_delta":
            block["text"] = (block.get("text") or "") + delta.get("text", "")
            return [TextDelta(delta.get("text", ""))]
        if dtype == "thinking_delta":
            block["thinking"] = (block.get("thinking") or "") + delta.get("thinking", "")
            return [ThinkingDelta(delta.get("thinking", ""))]
        if dtype == "signature_delta":
            block["signature"] = (block.get("signature") or "") + delta.get("signature", "")
        elif dtype == "input_json_delta":
            self.json.setdefault(index, []).append(delta.get("partial_json", ""))
        return []

    def _on_block_stop(self, event: Mapping[str, Any]) -> list[StreamEvent]:
        index = int(event.get("index") or 0)
        block = self.blocks.get(index, {})
        if block.get("type") != "tool_use":
            return []
        block["input"] = "".join(self.json.get(index, [])) or block.get("input")
        part = _anthropic_part(block)
        # finish() may stop a call the stream already stopped: report it once.
        if part is None or block.get("_finished"):
            return []
        block["_finished"] = True
        return [ToolCallFinished(index=self.tool_ordinal[index], part=part)]

    def _on_message_delta(self, event: Mapping[str, Any]) -> list[StreamEvent]:
        delta = event.get("delta") or {}
        if delta.get("stop_reason"):
            self.raw_finish = delta["stop_reason"]
        self.usage = _anthropic_usage(event.get("usage"), self.usage)
        return []

    _HANDLERS: ClassVar[
        dict[str, Callable[[AnthropicStreamAccumulator, Mapping[str, Any]], list[StreamEvent]]]
    ] = {
        "message_start": _on_message_start,
        "content_block_start": _on_block_start,
        "content_block_delta": _on_block_delta,
        "content_block_stop": _on_block_stop,
        "message_delta": _on_message_delta,
    }

    def finish(self) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        for index in sorted(self.blocks):
            block = self.blocks[index]
            if block.get("type") == "tool_use" and not block.get("_finished"):
                # The stream ended without content_block_stop for this call.
                events.extend(self.feed({"type": "content_block_stop", "index": index}))
        parts = [
            p
            for p in (_anthropic_part(self.blocks[i]) for i in sorted(self.blocks))
            if p is not None and not (p["type"] == "text" and not p["text"])
        ]
        reply = Reply(
            parts=parts,
            usage=self.usage,
            finish_reason=_ANTHROPIC_FINISH.get(self.raw_finish or "", "other"),
            raw_finish_reason=self.raw_finish,
            model=self.model,
            response_id=self.response_id,
        )
        return [*events, Done(reply)]
