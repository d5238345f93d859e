"""Provider wire messages ↔ Arbor messages, and the hashes that match a request to the
tree. Pure: no database, no network.

A harness resends its whole conversation with every request. Each wire message gets a
*digest* of what it says (role and content, ignoring what does not change meaning:
``cache_control`` breakpoints that move from request to request, thinking blocks that
some clients drop or keep); the request's *chain keys* hash the digests in order, so
``chain_keys(...)[i]`` names the conversation up to and including message ``i``. The
gateway stores the key on the last Arbor message written for a wire message and finds a
request's longest stored prefix with one indexed lookup.

One wire message may become several Arbor messages: an Anthropic user message holding
``tool_result`` blocks becomes a ``tool`` message (the results) followed by a ``user``
message (any text or images beside them), as Arbor keeps tool results apart.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

Part = dict[str, Any]
Draft = dict[str, Any]  # {"role", "parts", "metadata"}

CHAIN_SEED = hashlib.sha256(b"arbor-gateway-chain-1").hexdigest()

# Keys of a content block that do not change what it says.
_NOISE = {"cache_control", "citations"}


class WireError(ValueError):
    """The request's messages are not valid for the protocol (the client gets a 400)."""


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _clean_text(text: Any) -> str:
    # PostgreSQL refuses NUL in text and jsonb; the forwarded bytes keep it.
    return str(text).replace("\x00", "\ufffd")


# --- Anthropic -------------------------------------------------------------------------


def _anthropic_blocks(content: Any, where: str) -> list[Mapping[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise WireError(f"{where}.content: must be a string or a list of content blocks")
    for i, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise WireError(f"{where}.content.{i}: a content block is an object with a type")
    return content


def _block_key(block: Mapping[str, Any]) -> Any:
    kind = block["type"]
    if kind == "text":
        return ["text", block.get("text", "")]
    if kind in ("thinking", "redacted_thinking"):
        return None  # clients differ on resending these; they do not identify a message
    if kind == "image":
        source = block.get("source") or {}
        data = source.get("data") or source.get("url") or ""
        return ["image", hashlib.sha256(str(data).encode()).hexdigest()]
    if kind == "tool_use":
        return ["tool_use", block.get("id"), block.get("name"), block.get("input")]
    if kind == "tool_result":
        content = block.get("content", "")
        inner = [] if content in ("", None) else _anthropic_blocks(content, "tool_result")
        keys = [k for k in (_block_key(b) for b in inner) if k is not None]
        return ["tool_result", block.get("tool_use_id"), bool(block.get("is_error")), keys]
    return [kind, {k: v for k, v in block.items() if k not in _NOISE}]


def anthropic_digest(message: Mapping[str, Any]) -> str:
    """What a wire message says, as a hash: role and content blocks, without
    ``cache_control``, thinking blocks or empty text."""
    blocks = _anthropic_blocks(message.get("content", ""), "message")
    keys = [k for k in (_block_key(b) for b in blocks) if k is not None and k != ["text", ""]]
    return hashlib.sha256(_json([message.get("role"), keys]).encode()).hexdigest()


def chain_next(previous: str, digest: str) -> str:
    """The key of a conversation whose key was ``previous``, after one more message."""
    return hashlib.sha256(f"{previous}:{digest}".encode()).hexdigest()


# (previous key, digest) -> key: a harness resends the same conversation every request,
# so all but its newest steps were hashed before.
_STEPS: dict[tuple[str, str], str] = {}
_STEPS_MAX = 50_000


def chain_keys(digests: Sequence[str], seed: str = CHAIN_SEED) -> list[str]:
    """``keys[i]`` hashes ``digests[0..i]``: the conversation up to message ``i``."""
    keys: list[str] = []
    previous = seed
    for digest in digests:
        step = (previous, digest)
        key = _STEPS.get(step)
        if key is None:
            if len(_STEPS) >= _STEPS_MAX:
                _STEPS.clear()
            key = _STEPS[step] = chain_next(previous, digest)
        keys.append(key)
        previous = key
    return keys


def _image_part(source: Mapping[str, Any], where: str) -> Part:
    """An inline image, its bytes carried in ``data`` until the gateway stores it as a
    blob (which validates it); a URL image, which Arbor cannot fetch, as a note."""
    if source.get("type") == "base64":
        try:
            data = base64.b64decode(str(source.get("data", "")), validate=True)
        except (binascii.Error, ValueError):
            raise WireError(f"{where}: the image's base64 data is not valid") from None
        return {"type": "image", "data": data, "mime": str(source.get("media_type", ""))}
    return {"type": "text", "text": f"[image at {source.get('url') or source.get('type')}]"}


def _other_text(block: Mapping[str, Any]) -> Part:
    """A block Arbor has no part for (documents, server tool traffic, …): kept as
    readable text in the tree; the wire form forwarded upstream is the client's own."""
    body = {k: v for k, v in block.items() if k not in _NOISE}
    return {"type": "text", "text": _clean_text(f"[{block['type']}] {_json(body)[:20_000]}")}


def _result_parts(content: Any, where: str) -> list[Part]:
    if content in ("", None):
        return []
    parts: list[Part] = []
    for block in _anthropic_blocks(content, where):
        if block["type"] == "text":
            parts.append({"type": "text", "text": _clean_text(block.get("text", ""))})
        elif block["type"] == "image":
            parts.append(_image_part(block.get("source") or {}, where))
        else:
            parts.append(_other_text(block))
    return parts


def _assistant_part(block: Mapping[str, Any]) -> Part:
    """One block of an Anthropic assistant message as an Arbor part."""
    kind = block["type"]
    if kind == "text":
        return {"type": "text", "text": _clean_text(block.get("text", ""))}
    if kind == "thinking":
        part: Part = {"type": "thinking", "text": _clean_text(block.get("thinking", ""))}
        if block.get("signature"):
            part["signature"] = str(block["signature"])
        return part
    if kind == "tool_use":
        arguments = block.get("input")
        return {
            "type": "tool_call",
            "id": str(block.get("id", "")),
            "name": str(block.get("name", "")),
            "arguments": arguments if isinstance(arguments, dict) else {},
        }
    return _other_text(block)


def _user_drafts(blocks: Sequence[Mapping[str, Any]], where: str) -> list[Draft]:
    """An Anthropic user message: its tool results as a ``tool`` message, then whatever
    else it says as a ``user`` message (an empty one when it says nothing at all)."""
    results: list[Part] = []
    rest: list[Part] = []
    for i, block in enumerate(blocks):
        kind = block["type"]
        if kind == "tool_result":
            results.append(
                {
                    "type": "tool_result",
                    "call_id": str(block.get("tool_use_id", "")),
                    "is_error": bool(block.get("is_error", False)),
                    "parts": _result_parts(block.get("content", ""), f"{where}.content.{i}"),
                }
            )
        elif kind == "text":
            rest.append({"type": "text", "text": _clean_text(block.get("text", ""))})
        elif kind == "image":
            rest.append(_image_part(block.get("source") or {}, f"{where}.content.{i}"))
        else:
            rest.append(_other_text(block))
    drafts: list[Draft] = []
    if results:
        drafts.append({"role": "tool", "parts": results})
    if rest or not results:
        drafts.append({"role": "user", "parts": rest or [{"type": "text", "text": ""}]})
    return drafts


def anthropic_drafts(message: Mapping[str, Any], where: str = "messages") -> list[Draft]:
    """One Anthropic wire message as Arbor messages (see the module docstring)."""
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise WireError(f"{where}.role: must be 'user' or 'assistant', got {role!r}")
    blocks = _anthropic_blocks(message.get("content", ""), where)
    if role == "user":
        return _user_drafts(blocks, where)
    parts = [_assistant_part(block) for block in blocks]
    # Arbor keeps no message without parts; an empty answer is an empty text.
    return [{"role": "assistant", "parts": parts or [{"type": "text", "text": ""}]}]


def anthropic_system_text(system: Any) -> str:
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        return "\n\n".join(
            str(b.get("text", ""))
            for b in system
            if isinstance(b, dict) and b.get("type") == "text"
        )
    return ""


# --- the answer, assembled from a stream ------------------------------------------------


@dataclass
class AnthropicAnswer:
    """The upstream's reply message, built from SSE events as they are relayed."""

    message: dict[str, Any] = field(default_factory=dict)
    blocks: dict[int, dict[str, Any]] = field(default_factory=dict)
    partial_json: dict[int, str] = field(default_factory=dict)
    complete: bool = False

    def feed(self, event: Mapping[str, Any]) -> None:
        kind = event.get("type")
        handler = self._HANDLERS.get(kind) if isinstance(kind, str) else None
        # ping, error and events the protocol adds later change nothing in the answer.
        if handler is not None:
            handler(self, event)

    def _on_message_start(self, event: Mapping[str, Any]) -> None:
        self.message = dict(event.get("message") or {})

    def _on_block_start(self, event: Mapping[str, Any]) -> None:
        self.blocks[int(event.get("index", 0))] = dict(event.get("content_block") or {})

    def _on_block_delta(self, event: Mapping[str, Any]) -> None:
        index = int(event.get("index", 0))
        block = self.blocks.setdefault(index, {"type": "text", "text": ""})
        delta = event.get("delta") or {}
        dtype = delta.get("type")
        if dtype == "text_delta":
            block["text"] = block.get("text", "") + delta.get("text", "")
        elif dtype == "thinking_delta":
            block["thinking"] = block.get("thinking", "") + delta.get("thinking", "")
        elif dtype == "signature_delta":
            block["signature"] = block.get("signature", "") + delta.get("signature", "")
        elif dtype == "input_json_delta":
            self.partial_json[index] = self.partial_json.get(index, "") + delta.get(
                "partial_json", ""
            )
        elif dtype == "citations_delta":
            block.setdefault("citations", []).append(delta.get("citation"))

    def _on_block_stop(self, event: Mapping[str, Any]) -> None:
        index = int(event.get("index", 0))
        if index in self.partial_json:
            # A tool call's input arrives as JSON text in pieces; whole only now.
            raw = self.partial_json.pop(index)
            try:
                self.blocks[index]["input"] = json.loads(raw) if raw.strip() else {}
            except json.JSONDecodeError:
                self.blocks[index]["input"] = {}

    def _on_message_delta(self, event: Mapping[str, Any]) -> None:
        delta = event.get("delta") or {}
        self.message.update({k: v for k, v in delta.items() if v is not None})
        # The final usage adds to message_start's (output tokens); keep both.
        usage = dict(self.message.get("usage") or {})
        usage.update(event.get("usage") or {})
        self.message["usage"] = usage

    def _on_message_stop(self, event: Mapping[str, Any]) -> None:
        self.complete = True

    _HANDLERS: ClassVar[dict[str, Callable[[AnthropicAnswer, Mapping[str, Any]], None]]] = {
        "message_start": _on_message_start,
        "content_block_start": _on_block_start,
        "content_block_delta": _on_block_delta,
        "content_block_stop": _on_block_stop,
        "message_delta": _on_message_delta,
        "message_stop": _on_message_stop,
    }

    def result(self) -> dict[str, Any]:
        """The message as a non-streaming answer would give it."""
        return {**self.message, "content": [self.blocks[i] for i in sorted(self.blocks)]}


def answer_metadata(answer: Mapping[str, Any], *, model_id: str) -> dict[str, Any]:
    usage = answer.get("usage") or {}
    metadata: dict[str, Any] = {"model": model_id, "finish_reason": answer.get("stop_reason")}
    if usage:
        metadata["usage"] = {
            k: usage[k]
            for k in (
                "input_tokens",
                "output_tokens",
                "cache_creation_input_tokens",
                "cache_read_input_tokens",
            )
            if isinstance(usage.get(k), int)
        }
    if answer.get("id"):
        metadata["provider_message_id"] = str(answer["id"])
    return metadata


# --- OpenAI chat completions ----------------------------------------------------------------


def _openai_content(content: Any, where: str) -> list[Mapping[str, Any]]:
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise WireError(f"{where}.content: must be a string, null or a list of content parts")
    for i, item in enumerate(content):
        if not isinstance(item, dict) or not isinstance(item.get("type"), str):
            raise WireError(f"{where}.content.{i}: a content part is an object with a type")
    return content


def _openai_item_key(item: Mapping[str, Any]) -> Any:
    if item["type"] == "text":
        return ["text", item.get("text", "")]
    if item["type"] == "image_url":
        url = str((item.get("image_url") or {}).get("url", ""))
        return ["image", hashlib.sha256(url.encode()).hexdigest()]
    return [item["type"], {k: v for k, v in item.items() if k not in _NOISE}]


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def openai_digest(message: Mapping[str, Any]) -> str:
    role = message.get("role")
    content = [
        k
        for k in (_openai_item_key(i) for i in _openai_content(message.get("content"), "message"))
        if k != ["text", ""]
    ]
    calls = [
        [
            c.get("id"),
            (c.get("function") or {}).get("name"),
            _arguments((c.get("function") or {}).get("arguments")),
        ]
        for c in message.get("tool_calls") or []
        if isinstance(c, dict)
    ]
    key = [role, content, calls, message.get("tool_call_id")]
    return hashlib.sha256(_json(key).encode()).hexdigest()


def _openai_parts(content: Any, where: str) -> list[Part]:
    parts: list[Part] = []
    for i, item in enumerate(_openai_content(content, where)):
        if item["type"] == "text":
            parts.append({"type": "text", "text": _clean_text(item.get("text", ""))})
        elif item["type"] == "image_url":
            url = str((item.get("image_url") or {}).get("url", ""))
            if url.startswith("data:") and ";base64," in url:
                head, data = url[5:].split(";base64,", 1)
                parts.append(
                    _image_part(
                        {"type": "base64", "media_type": head, "data": data}, f"{where}.content.{i}"
                    )
                )
            else:
                parts.append({"type": "text", "text": f"[image at {url[:500]}]"})
        else:
            parts.append(_other_text(item))
    return parts


def openai_drafts(message: Mapping[str, Any], where: str = "messages") -> list[Draft]:
    role = message.get("role")
    if role in ("system", "developer"):
        parts = _openai_parts(message.get("content"), where)
        return [
            {
                "role": "system",
                "parts": [p for p in parts if p["type"] == "text"]
                or [{"type": "text", "text": ""}],
            }
        ]
    if role == "user":
        parts = _openai_parts(message.get("content"), where)
        return [{"role": "user", "parts": parts or [{"type": "text", "text": ""}]}]
    if role == "assistant":
        parts = []
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            parts.append({"type": "thinking", "text": _clean_text(reasoning)})
        parts += _openai_parts(message.get("content"), where)
        for j, call in enumerate(message.get("tool_calls") or []):
            if not isinstance(call, dict):
                raise WireError(f"{where}.tool_calls.{j}: a tool call is an object")
            function = call.get("function") or {}
            arguments = _arguments(function.get("arguments"))
            parts.append(
                {
                    "type": "tool_call",
                    "id": str(call.get("id", "")),
                    "name": str(function.get("name", "")),
                    "arguments": arguments if isinstance(arguments, dict) else {},
                }
            )
        return [{"role": "assistant", "parts": parts or [{"type": "text", "text": ""}]}]
    if role == "tool":
        result: Part = {
            "type": "tool_result",
            "call_id": str(message.get("tool_call_id", "")),
            "is_error": False,
            "parts": _openai_parts(message.get("content"), where),
        }
        return [{"role": "tool", "parts": [result]}]
    raise WireError(
        f"{where}.role: must be one of system, developer, user, assistant, tool; got {role!r}"
    )


def openai_split_system(messages: list[Any]) -> tuple[str, list[Any]]:
    """The leading system/developer messages (the agent's instructions) and the rest."""
    texts: list[str] = []
    i = 0
    while i < len(messages) and isinstance(messages[i], dict):
        if messages[i].get("role") not in ("system", "developer"):
            break
        texts += [
            p["text"]
            for p in _openai_parts(messages[i].get("content"), "system")
            if p["type"] == "text"
        ]
        i += 1
    return "\n\n".join(texts), messages[i:]


@dataclass
class OpenAIAnswer:
    """The upstream's reply, built from chat.completion.chunk events."""

    message: dict[str, Any] = field(default_factory=lambda: {"role": "assistant"})
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    id: str = ""
    complete: bool = False

    def feed(self, chunk: Mapping[str, Any]) -> None:
        self.id = self.id or str(chunk.get("id", ""))
        if chunk.get("usage"):
            self.usage = dict(chunk["usage"])
        for choice in chunk.get("choices") or []:
            # The gateway relays choice 0 only (n > 1 is not something harnesses ask).
            if choice.get("index", 0) != 0:
                continue
            self._feed_delta(choice.get("delta") or {})
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def _feed_delta(self, delta: Mapping[str, Any]) -> None:
        if delta.get("content"):
            self.message["content"] = (self.message.get("content") or "") + delta["content"]
        for key in ("reasoning_content", "reasoning"):
            if isinstance(delta.get(key), str):
                self.message[key] = self.message.get(key, "") + delta[key]
        for call in delta.get("tool_calls") or []:
            self._feed_call(call)

    def _feed_call(self, call: Mapping[str, Any]) -> None:
        """Merge one tool-call fragment: the id once, name and arguments in pieces."""
        slot = self.calls.setdefault(
            int(call.get("index", 0)),
            {"id": "", "type": "function", "function": {"name": "", "arguments": ""}},
        )
        if call.get("id"):
            slot["id"] = call["id"]
        function = call.get("function") or {}
        slot["function"]["name"] += function.get("name") or ""
        slot["function"]["arguments"] += function.get("arguments") or ""

    def result(self) -> dict[str, Any]:
        message = dict(self.message)
        message.setdefault("content", None)
        if self.calls:
            message["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        return message


def openai_answer_metadata(
    message: Mapping[str, Any],
    *,
    model_id: str,
    finish_reason: Any,
    usage: Mapping[str, Any],
    response_id: str,
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"model": model_id, "finish_reason": finish_reason}
    if usage:
        metadata["usage"] = {
            "input_tokens": usage.get("prompt_tokens"),
            "output_tokens": usage.get("completion_tokens"),
        }
    if response_id:
        metadata["provider_message_id"] = response_id
    return metadata


# --- Arbor messages the ladder made, back to the wire ----------------------------------------


def to_anthropic_messages(messages: Sequence[Mapping[str, Any]], load_blob: Any) -> list[Any]:
    from conversations.providers.convert import to_anthropic

    payload = to_anthropic(messages, load_blob=load_blob)
    if payload.system:  # a summary's system note, said as the user
        return [
            {"role": "user", "content": [{"type": "text", "text": payload.system}]},
            *payload.messages,
        ]
    return list(payload.messages)


def to_openai_messages(messages: Sequence[Mapping[str, Any]], load_blob: Any) -> list[Any]:
    from conversations.providers.convert import to_openai

    return list(to_openai(messages, load_blob=load_blob).messages)
