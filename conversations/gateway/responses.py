"""The OpenAI Responses API in front of a Chat Completions upstream: a request's
``input`` items as chat messages, and the upstream's whole answer as a Response (output
items, usage) or as the SSE events the real service streams. Pure: no Django, no I/O.

What does not translate is dropped, never invented: reasoning items (opaque to any other
upstream), tools other than functions. ``function_call`` / ``function_call_output``
pairs become assistant ``tool_calls`` and ``tool`` messages, so the gateway places and
compacts a Responses session exactly like a Chat Completions one.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Mapping
from typing import Any

Item = dict[str, Any]
Message = dict[str, Any]


class ResponsesError(ValueError):
    """A request the Responses API would refuse (the message names the field)."""


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ResponsesError(f"{where}: content is a string or a list of parts")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise ResponsesError(f"{where}.content.{i}: a part is an object")
        if part.get("type") in ("input_text", "output_text", "text", "summary_text"):
            texts.append(str(part.get("text", "")))
    return "".join(texts)


def _chat_content(content: Any, where: str) -> Any:
    """A message's content as Chat Completions content: text, or text and image parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ResponsesError(f"{where}: content is a string or a list of parts")
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise ResponsesError(f"{where}.content.{i}: a part is an object")
        kind = part.get("type")
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str) or not url:
                raise ResponsesError(f"{where}.content.{i}.image_url: a URL is required")
            parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "refusal":
            parts.append({"type": "text", "text": str(part.get("refusal", ""))})
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _items(body: Mapping[str, Any]) -> list[Any]:
    raw_input = body.get("input")
    if isinstance(raw_input, str):
        return [{"type": "message", "role": "user", "content": raw_input}]
    if isinstance(raw_input, list):
        return raw_input
    raise ResponsesError("input: a string or a list of items is required")


def _message(item: Mapping[str, Any], where: str) -> Message:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise ResponsesError(f"{where}.role: user, assistant, system or developer")
    if role in ("system", "developer"):
        return {"role": "system", "content": _text_of(item.get("content"), where)}
    return {"role": role, "content": _chat_content(item.get("content"), where)}


def _add_call(messages: list[Message], item: Mapping[str, Any], where: str) -> None:
    """A function_call as a tool call of the assistant message it belongs to:
    consecutive calls, and the text just before them, are one assistant message."""
    call_id, name = item.get("call_id"), item.get("name")
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise ResponsesError(f"{where}: a function_call has a call_id and a name")
    arguments = item.get("arguments")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments or {})
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant" and "tool_calls" in last:
        last["tool_calls"].append(call)
    elif last is not None and last["role"] == "assistant" and isinstance(last.get("content"), str):
        last["tool_calls"] = [call]
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _output(item: Mapping[str, Any], where: str) -> Message:
    call_id = item.get("call_id")
    if not isinstance(call_id, str):
        raise ResponsesError(f"{where}: a function_call_output has a call_id")
    output = item.get("output")
    text = output if isinstance(output, str) else _text_of(output or [], where)
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": str(t.get("description") or ""),
                "parameters": t.get("parameters") or {"type": "object", "properties": {}},
            },
        }
        for t in body.get("tools") or []
        if isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("name"), str)
    ]


def to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """A Chat Completions request for a Responses request (never streamed: the
    gateway streams the Response's events itself)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ResponsesError("model: a model name is required")
    messages: list[Message] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    for i, item in enumerate(_items(body)):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise ResponsesError(f"{where}: an item is an object")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            _add_call(messages, item, where)
        elif kind == "function_call_output":
            messages.append(_output(item, where))
        # reasoning, web search and other items have no Chat Completions form: dropped
    return {"model": model, "messages": messages, "stream": False, **_options(body)}


def _options(body: Mapping[str, Any]) -> dict[str, Any]:
    """Tools and sampling options, in Chat Completions' names."""
    options: dict[str, Any] = {}
    tools = _tools(body)
    if tools:
        options["tools"] = tools
        if body.get("parallel_tool_calls") is not None:
            options["parallel_tool_calls"] = bool(body["parallel_tool_calls"])
    if isinstance(body.get("max_output_tokens"), int):
        options["max_tokens"] = body["max_output_tokens"]
    for key in ("temperature", "top_p", "user"):
        if body.get(key) is not None:
            options[key] = body[key]
    return options


def from_chat(answer: Mapping[str, Any], *, model: str) -> dict[str, Any]:
    """The Response for a Chat Completions answer."""
    choice = (answer.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    output: list[Item] = []
    text = message.get("content")
    if isinstance(text, str) and text:
        output.append(
            {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        )
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex}",
                "call_id": str(call.get("id") or f"call_{uuid.uuid4().hex}"),
                "name": str(function.get("name", "")),
                "arguments": str(function.get("arguments") or "{}"),
                "status": "completed",
            }
        )
    usage = answer.get("usage") or {}
    prompt = int(usage.get("prompt_tokens") or 0)
    completion = int(usage.get("completion_tokens") or 0)
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "completed",
        "model": model,
        "output": output,
        "usage": {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion,
        },
    }


def stream_events(response: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The SSE events of ``response`` as the service streams them: created, each output
    item added, its text or arguments in deltas, done, then completed."""
    head = {k: v for k, v in response.items() if k not in ("output", "usage")}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": {**head, "status": "in_progress", "output": []}},
        {
            "type": "response.in_progress",
            "response": {**head, "status": "in_progress", "output": []},
        },
    ]
    for index, item in enumerate(response.get("output") or []):
        started = {**item, "status": "in_progress"}
        if item["type"] == "message":
            started["content"] = []
        events.append(
            {"type": "response.output_item.added", "output_index": index, "item": started}
        )
        if item["type"] == "message":
            text = item["content"][0]["text"]
            part = {"type": "output_text", "text": "", "annotations": []}
            events.append(
                {
                    "type": "response.content_part.added",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "part": part,
                }
            )
            for piece in re.findall(r"\S+\s*|\s+", text):
                events.append(
                    {
                        "type": "response.output_text.delta",
                        "item_id": item["id"],
                        "output_index": index,
                        "content_index": 0,
                        "delta": piece,
                    }
                )
            events.append(
                {
                    "type": "response.output_text.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "text": text,
                }
            )
            events.append(
                {
                    "type": "response.content_part.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "part": {**part, "text": text},
                }
            )
        elif item["type"] == "function_call":
            events.append(
                {
                    "type": "response.function_call_arguments.delta",
                    "item_id": item["id"],
                    "output_index": index,
                    "delta": item["arguments"],
                }
            )
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "arguments": item["arguments"],
                }
            )
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    events.append({"type": "response.completed", "response": dict(response)})
    return [{**event, "sequence_number": n} for n, event in enumerate(events)]


def sse(events: list[dict[str, Any]]) -> bytes:
    return "".join(
        f"event: {e['type']}\ndata: {json.dumps(e, ensure_ascii=False)}\n\n" for e in events
    ).encode()
