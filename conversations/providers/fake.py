"""A loopback fake model provider: the test double, and the offline demo model.

A real HTTP server on 127.0.0.1 that speaks both protocols the provider layer uses:

- OpenAI chat completions: ``POST /v1/chat/completions`` (JSON, or SSE with
  ``stream: true``: role chunk, content / tool_calls deltas, a finish chunk, a usage chunk
  when ``stream_options.include_usage`` is set, then ``[DONE]``);
- Anthropic messages: ``POST /v1/messages`` (JSON, or SSE: message_start,
  content_block_start / _delta / _stop, message_delta, message_stop).

It behaves like the real services where Arbor depends on their behaviour:

- it counts tokens its own way, deliberately more than a chars/4 guess for JSON and
  Korean (Hangul/CJK 1.5 tokens a character, every JSON punctuation mark a token), and
  bills images by the provider's rule from their real pixel size (read with Pillow), so
  Arbor's estimate undercounts as it will against a real model;
- a prompt over the context window gets the provider's own 400 overflow body;
- unpaired tool calls / results get the provider's own 400 body;
- it follows a script of steps (reply text, reply tool calls, an HTTP error with a body
  and Retry-After, a delay, a stream that stalls mid-way), and when the script is empty it
  answers with a deterministic echo (the ``fake/*`` demo models);
- it records every request (path, headers without credentials, parsed JSON body, arrival
  time) in a thread-safe log.

Run standalone: ``python -m conversations.providers.fake --port 8765`` and point
``ARBOR_FAKE_BASE_URL`` (or any OpenAI / Anthropic client) at it.
"""

from __future__ import annotations

import argparse
import atexit
import base64
import binascii
import contextlib
import hashlib
import io
import json
import math
import re
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from PIL import Image, UnidentifiedImageError

from conversations.providers.billing import image_tokens

# Headers never written to the log: they carry credentials.
AUTH_HEADERS = {"authorization", "x-api-key", "api-key", "proxy-authorization", "cookie"}

# --- the fake's own token count --------------------------------------------------------

_TOKEN_RE = re.compile(
    r"(?P<cjk>[\u1100-\u11ff\u2e80-\u2fdf\u3040-\u30ff\u3130-\u318f\u3400-\u4dbf"
    r"\u4e00-\u9fff\ua960-\ua97f\uac00-\ud7af\uf900-\ufaff\uff00-\uffef])"
    r"|(?P<word>[A-Za-z\u00c0-\u024f\u0370-\u03ff\u0400-\u04ff]+)"
    r"|(?P<num>[0-9]+)"
    r"|(?P<space>\s+)"
    r"|(?P<other>.)",
    re.S,
)


def count_text_tokens(text: str) -> int:
    """The fake's tokenizer: a word is a token per 4 letters (at least one), digits go
    three to a token, Hangul/CJK cost 1.5 tokens a character, and every punctuation mark
    (all of JSON's braces, quotes, colons and commas) is a token of its own."""
    total = 0.0
    for match in _TOKEN_RE.finditer(text or ""):
        kind = match.lastgroup
        piece = match.group()
        if kind == "cjk":
            total += 1.5
        elif kind == "word":
            total += math.ceil(len(piece) / 4)
        elif kind == "num":
            total += math.ceil(len(piece) / 3)
        elif kind == "other":
            total += 1
    return math.ceil(total)


def count_bytes_tokens(text: str) -> int:
    """A pessimistic tokenizer, as a careful reviewer counts: UTF-8 bytes / 3 (real
    tokenizers give 3.5-4.5 bytes a token on English and code)."""
    return math.ceil(len((text or "").encode("utf-8", "surrogatepass")) / 3)


def _no_count(text: str) -> int:
    return 0


TOKENIZERS: dict[str, Callable[[str], int]] = {
    "words": count_text_tokens,
    "bytes": count_bytes_tokens,
    # A trivial upstream: no work per request, so a latency bench's difference is Arbor's.
    "none": _no_count,
}


def _image_size(data_b64: str) -> tuple[int, int]:
    raw = base64.b64decode(data_b64, validate=True)
    with Image.open(io.BytesIO(raw)) as image:
        return image.size


class _BadImage(Exception):
    pass


def _bill_image(data_b64: str, rule: str) -> int:
    try:
        width, height = _image_size(data_b64)
    except (binascii.Error, ValueError, UnidentifiedImageError, OSError):
        raise _BadImage from None
    return image_tokens(rule, width, height)


def _data_url_payload(url: str) -> str | None:
    if url.startswith("data:") and ";base64," in url:
        return url.split(";base64,", 1)[1]
    return None


# Per-message and per-request overheads, as chat templates add role markers.
_MESSAGE_OVERHEAD = 4
_REQUEST_OVERHEAD = 3


def count_openai_request(
    body: Mapping[str, Any],
    *,
    image_billing: str = "openai-tile",
    count_text_tokens: Callable[[str], int] = count_text_tokens,
) -> int:
    total = _REQUEST_OVERHEAD
    for message in body.get("messages") or []:
        total += _MESSAGE_OVERHEAD
        content = message.get("content")
        if isinstance(content, str):
            total += count_text_tokens(content)
        elif isinstance(content, list):
            for item in content:
                if item.get("type") == "text":
                    total += count_text_tokens(item.get("text", ""))
                elif item.get("type") == "image_url":
                    url = (item.get("image_url") or {}).get("url", "")
                    payload = _data_url_payload(url)
                    # A remote URL cannot be fetched offline: bill it as a 512x512 image.
                    total += (
                        _bill_image(payload, image_billing)
                        if payload is not None
                        else image_tokens(image_billing, 512, 512)
                    )
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            total += count_text_tokens(function.get("name", ""))
            total += count_text_tokens(function.get("arguments", ""))
    if body.get("tools"):
        total += count_text_tokens(json.dumps(body["tools"]))
    return total


def _count_anthropic_blocks(
    blocks: Any, image_billing: str, count_text_tokens: Callable[[str], int] = count_text_tokens
) -> int:
    if isinstance(blocks, str):
        return count_text_tokens(blocks)
    total = 0
    for block in blocks or []:
        kind = block.get("type")
        if kind == "text":
            total += count_text_tokens(block.get("text", ""))
        elif kind == "image":
            source = block.get("source") or {}
            if source.get("type") == "base64":
                total += _bill_image(source.get("data", ""), image_billing)
            else:
                total += image_tokens(image_billing, 512, 512)
        elif kind == "thinking":
            total += count_text_tokens(block.get("thinking", ""))
        elif kind == "tool_use":
            total += count_text_tokens(block.get("name", ""))
            total += count_text_tokens(json.dumps(block.get("input") or {}, ensure_ascii=False))
        elif kind == "tool_result":
            inner = block.get("content") or []
            total += 2 + _count_anthropic_blocks(inner, image_billing, count_text_tokens)
    return total


def count_anthropic_request(
    body: Mapping[str, Any],
    *,
    image_billing: str = "claude",
    count_text_tokens: Callable[[str], int] = count_text_tokens,
) -> int:
    count = count_text_tokens
    total = _REQUEST_OVERHEAD + _count_anthropic_blocks(
        body.get("system") or "", image_billing, count
    )
    for message in body.get("messages") or []:
        content = message.get("content")
        total += _MESSAGE_OVERHEAD + _count_anthropic_blocks(content, image_billing, count)
    if body.get("tools"):
        total += count_text_tokens(json.dumps(body["tools"]))
    return total


# --- a scripted agent ---------------------------------------------------------------

ROUND_MARK = re.compile(r"ROUND-(\d+)")
# How harnesses ask a model to summarise their own history (Claude Code's and pi's
# compaction prompts, as their CLIs word them): such a request gets a short summary,
# never a tool call.
_SUMMARY_ASK = re.compile(
    r"create a detailed summary of the conversation|conversation to summarize"
    r"|create a structured (?:context checkpoint )?summary|CONTEXT CHECKPOINT COMPACTION",
    re.IGNORECASE,
)


def round_command(n: int, *, lines: int = 48) -> str:
    """A shell command printing round ``n``'s marker and ~3.4 KB of output."""
    return (
        f"echo ROUND-{n}; for i in $(seq 1 {lines}); do "
        f'echo "round {n} line $i: the quick brown fox jumps over the lazy dog 0123456789"; done'
    )


def _last_user_text(body: Mapping[str, Any]) -> str:
    for message in reversed(body.get("messages") or []):
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            return content
        return " ".join(
            str(b.get("text", ""))
            for b in content or []
            if isinstance(b, dict) and b.get("type") == "text"
        )
    return ""


def scripted_agent(
    rounds: int,
    *,
    tool_names: tuple[str, ...] = ("Bash", "bash", "exec_command"),
) -> Callable[[str, Mapping[str, Any]], Step | None]:
    """A responder for FakeLLMServer: an agent that runs ``rounds`` shell commands, one
    per request that offers a shell tool (Claude Code's and pi's Bash, Codex's
    exec_command), then says it finished. The round number is read
    back from the transcript (the newest round is always in what a harness or Arbor
    sends verbatim), so it survives any compaction. A request without a Bash tool, or
    one asking for a summary of the history, gets a short text answer."""

    def respond(protocol: str, body: Mapping[str, Any]) -> Step | None:
        tools = body.get("tools") or []
        names = {t.get("name") or (t.get("function") or {}).get("name") for t in tools}
        tool = next((n for n in tool_names if n in names), None)
        text = json.dumps(body.get("messages") or [])
        done = max((int(n) for n in ROUND_MARK.findall(text)), default=0)
        if tool is None or _SUMMARY_ASK.search(_last_user_text(body)):
            return Step.reply(f"Summary: {done} rounds of shell commands ran, each succeeded.")
        if done >= rounds:
            return Step.reply(f"FINISHED {done} rounds.")
        # Codex's shell tool takes ``cmd``; Claude Code's and pi's ``command``.
        key = "cmd" if tool == "exec_command" else "command"
        arguments: dict[str, Any] = {key: round_command(done + 1)}
        if tool == "Bash":
            arguments["description"] = f"round {done + 1}"
        return Step.tools({"name": tool, "arguments": arguments})

    return respond


# --- real-shaped error bodies ----------------------------------------------------------


def openai_error(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: Any = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def anthropic_error(message: str, *, type: str = "invalid_request_error") -> dict[str, Any]:
    return {"type": "error", "error": {"type": type, "message": message}}


def openai_overflow(measured: int, limit: int) -> dict[str, Any]:
    return openai_error(
        f"This model's maximum context length is {limit} tokens. However, your messages "
        f"resulted in {measured} tokens. Please reduce the length of the messages.",
        param="messages",
        code="context_length_exceeded",
    )


def anthropic_overflow(measured: int, limit: int) -> dict[str, Any]:
    return anthropic_error(f"prompt is too long: {measured} tokens > {limit} maximum")


def _default_error_body(protocol: str, status: int, message: str | None) -> dict[str, Any]:
    if protocol == "openai":
        if status == 429:
            return openai_error(
                message or "Rate limit reached for requests. Please try again in 1s.",
                type="requests",
                code="rate_limit_exceeded",
            )
        if status == 401:
            return openai_error(message or "Incorrect API key provided.", code="invalid_api_key")
        if status >= 500:
            return openai_error(
                message
                or "The server had an error while processing your request. Sorry about that!",
                type="server_error",
            )
        return openai_error(message or f"fake error {status}")
    kind = {
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
        529: "overloaded_error",
    }.get(status, "api_error" if status >= 500 else "invalid_request_error")
    default = {
        "rate_limit_error": "Number of request tokens has exceeded your per-minute rate limit",
        "overloaded_error": "Overloaded",
        "api_error": "Internal server error",
        "authentication_error": "invalid x-api-key",
    }.get(kind, f"fake error {status}")
    return anthropic_error(message or default, type=kind)


# --- tool pairing, as the real services check it -------------------------------------


def openai_pairing_error(messages: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    for index, message in enumerate(messages):
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            expected = [call.get("id") for call in message["tool_calls"]]
            answered = set()
            follow = index + 1
            while follow < len(messages) and messages[follow].get("role") == "tool":
                answered.add(messages[follow].get("tool_call_id"))
                follow += 1
            missing = [str(call_id) for call_id in expected if call_id not in answered]
            if missing:
                return openai_error(
                    "An assistant message with 'tool_calls' must be followed by tool "
                    "messages responding to each 'tool_call_id'. The following "
                    f"tool_call_ids did not have response messages: {', '.join(missing)}",
                    param=f"messages.[{index}].role",
                )
        elif role == "tool":
            back = index - 1
            while back >= 0 and messages[back].get("role") == "tool":
                back -= 1
            previous = messages[back] if back >= 0 else {}
            ids = {call.get("id") for call in previous.get("tool_calls") or []}
            if previous.get("role") != "assistant" or message.get("tool_call_id") not in ids:
                return openai_error(
                    "Invalid parameter: messages with role 'tool' must be a response to a "
                    "preceeding message with 'tool_calls'.",
                    param=f"messages.[{index}].role",
                )
    return None


def _blocks(message: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    content = message.get("content")
    return content if isinstance(content, list) else []


def anthropic_pairing_error(messages: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    for index, message in enumerate(messages):
        if message.get("role") == "assistant":
            uses = [b.get("id") for b in _blocks(message) if b.get("type") == "tool_use"]
            if not uses:
                continue
            after = messages[index + 1] if index + 1 < len(messages) else {}
            results = {
                b.get("tool_use_id")
                for b in _blocks(after)
                if after.get("role") == "user" and b.get("type") == "tool_result"
            }
            missing = [str(use) for use in uses if use not in results]
            if missing:
                return anthropic_error(
                    f"messages.{index}: `tool_use` ids were found without `tool_result` "
                    f"blocks immediately after: {', '.join(missing)}. Each `tool_use` block "
                    "must have a corresponding `tool_result` block in the next message."
                )
        elif message.get("role") == "user":
            before = messages[index - 1] if index > 0 else {}
            use_ids = {
                b.get("id")
                for b in _blocks(before)
                if before.get("role") == "assistant" and b.get("type") == "tool_use"
            }
            for position, block in enumerate(_blocks(message)):
                if block.get("type") == "tool_result" and block.get("tool_use_id") not in use_ids:
                    return anthropic_error(
                        f"messages.{index}.content.{position}: unexpected `tool_use_id` found "
                        f"in `tool_result` blocks: {block.get('tool_use_id')}. Each "
                        "`tool_result` block must have a corresponding `tool_use` block in "
                        "the previous message."
                    )
    return None


# Anthropic's limit on one base64 image, as its API enforces it.
ANTHROPIC_MAX_IMAGE_BYTES = 5 * 1024 * 1024


def anthropic_request_error(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The real API's 400s for a request it cannot take as sent: no ``max_tokens``,
    tool blocks in the history without tool definitions, an image over 5 MB."""
    if not isinstance(body.get("max_tokens"), int):
        return anthropic_error("max_tokens: Field required")
    messages = body.get("messages") or []
    has_tool_blocks = any(
        b.get("type") in ("tool_use", "tool_result") for m in messages for b in _blocks(m)
    )
    if has_tool_blocks and not body.get("tools"):
        return anthropic_error(
            "Requests which include `tool_use` or `tool_result` blocks must define tools."
        )
    for index, message in enumerate(messages):
        for position, block in enumerate(_blocks(message)):
            inner = block.get("content") if block.get("type") == "tool_result" else [block]
            for item in inner if isinstance(inner, list) else []:
                source = item.get("source") or {} if item.get("type") == "image" else {}
                data = source.get("data") if source.get("type") == "base64" else None
                size = len(data) * 3 // 4 if isinstance(data, str) else 0
                if size > ANTHROPIC_MAX_IMAGE_BYTES:
                    return anthropic_error(
                        f"messages.{index}.content.{position}.image.source.base64: image "
                        f"exceeds 5 MB maximum: {size} bytes > {ANTHROPIC_MAX_IMAGE_BYTES} bytes"
                    )
    return None


# --- the script -----------------------------------------------------------------------


@dataclass
class Step:
    """One scripted answer. Build with the class methods; each request takes one step
    (error steps are taken before the request is checked, reply steps after, so a 400
    for a malformed request does not use up a scripted reply)."""

    text: str = ""
    tool_calls: Sequence[Mapping[str, Any]] = ()
    thinking: str = ""
    status: int = 200
    message: str | None = None
    body: Mapping[str, Any] | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    # Seconds to wait before answering.
    delay: float = 0.0
    # Streams: how many SSE events to send before going silent; plain requests: go
    # silent before answering. Then the connection hangs for `hang` seconds and drops.
    stall_after: int | None = None
    hang: float = 30.0
    # While stalled, send SSE keep-alive comments (": keep-alive") every this many
    # seconds instead of going silent: a stream that never ends but never times out.
    keepalive: float | None = None
    # Arbor's vocabulary (stop, length, tool_calls); mapped to each protocol's word.
    finish_reason: str | None = None
    # Streams: seconds between two events, as a model's token pace spreads them out.
    pace: float = 0.0

    @property
    def is_error(self) -> bool:
        return self.status >= 400

    @classmethod
    def reply(cls, text: str, *, thinking: str = "", delay: float = 0.0, pace: float = 0.0) -> Step:
        return cls(text=text, thinking=thinking, delay=delay, pace=pace)

    @classmethod
    def tools(cls, *calls: Mapping[str, Any], text: str = "") -> Step:
        """Reply with tool calls: each ``{"name", "arguments", "id"?}`` (arguments a dict,
        or a string to send verbatim, e.g. invalid JSON)."""
        return cls(text=text, tool_calls=list(calls))

    @classmethod
    def error(
        cls,
        status: int,
        message: str | None = None,
        *,
        body: Mapping[str, Any] | None = None,
        retry_after: float | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Step:
        """An HTTP error. Without ``body`` the protocol's real error shape is used."""
        all_headers = dict(headers or {})
        if retry_after is not None:
            all_headers["retry-after"] = f"{retry_after:g}"
        return cls(status=status, message=message, body=body, headers=all_headers)

    @classmethod
    def stall(cls, text: str, *, after: int = 2, hang: float = 30.0) -> Step:
        """A reply whose stream sends ``after`` events and then hangs (crash tests)."""
        return cls(text=text, stall_after=after, hang=hang)

    @classmethod
    def trickle(cls, text: str, *, after: int = 2, every: float = 0.2, hang: float = 30.0) -> Step:
        """A stream that sends ``after`` events, then only keep-alive comments."""
        return cls(text=text, stall_after=after, hang=hang, keepalive=every)

    @classmethod
    def wait(cls, seconds: float, text: str = "") -> Step:
        return cls(text=text, delay=seconds)


@dataclass
class RecordedRequest:
    path: str
    protocol: str
    # Request headers, lower-cased, without credentials (see AUTH_HEADERS).
    headers: dict[str, str]
    body: Any
    # time.monotonic() when the request arrived; compare entries, not wall clocks.
    received_at: float
    stream: bool
    # Whether a credential header was present (its value is never kept).
    authenticated: bool
    status: int | None = None
    prompt_tokens: int | None = None
    # The query string as sent (``beta=true``), without the ``?``.
    query: str = ""
    # The client closed the connection before the answer ended (a cancelled call).
    cut: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "protocol": self.protocol,
            "headers": self.headers,
            "body": self.body,
            "received_at": self.received_at,
            "stream": self.stream,
            "authenticated": self.authenticated,
            "status": self.status,
            "prompt_tokens": self.prompt_tokens,
        }


class _Refused(Exception):
    """A request the fake answers with an error: the status, body and extra headers."""

    def __init__(self, status: int, payload: Any, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(status)
        self.status = status
        self.payload = payload
        self.headers = headers


def _masked_key(handler: BaseHTTPRequestHandler) -> str:
    # The real services echo a masked key; so does the fake, to test redaction.
    given = handler.headers.get("authorization") or handler.headers.get("x-api-key")
    masked = (given or "").removeprefix("Bearer ")
    return f"{masked[:8]}****{masked[-4:]}" if len(masked) > 12 else "****"


def _request_error(protocol: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The protocol's 400 body for messages it would not take (none, or tool calls and
    results that do not pair up), or None."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        error_shape = openai_error if protocol == "openai" else anthropic_error
        return error_shape("messages: at least one message is required")
    if protocol == "openai":
        return openai_pairing_error(messages)
    return anthropic_pairing_error(messages) or anthropic_request_error(body)


_OPENAI_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}
_ANTHROPIC_FINISH = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


# --- the server -----------------------------------------------------------------------


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    owner: FakeLLMServer

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, addr = super().get_request()
        # Headers and body go out as separate writes: without this, Nagle's algorithm
        # holds the body until the client's delayed ACK (~40 ms a request on Linux).
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.owner._track(conn)
        return conn, addr


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    record: RecordedRequest  # the request being answered
    protocol_version = "HTTP/1.1"
    server_version = "ArborFake/1"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the request log is the record; keep test output clean

    def do_GET(self) -> None:
        path = urlsplit(self.path).path.rstrip("/")
        if path.endswith("/models"):
            models = sorted(self.server.owner.windows) or ["echo"]
            self._json(
                200, {"object": "list", "data": [{"id": m, "object": "model"} for m in models]}
            )
        elif path in ("", "/health"):
            self._json(200, {"ok": True})
        else:
            self._json(404, openai_error(f"no route GET {path}"))

    def do_POST(self) -> None:
        received = time.monotonic()
        path = urlsplit(self.path).path.rstrip("/")
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        if path.endswith("/chat/completions"):
            protocol = "openai"
        elif path.endswith("/messages"):
            protocol = "anthropic"
        else:
            self._json(404, openai_error(f"no route POST {path}"))
            return
        try:
            body = json.loads(raw or b"null")
        except ValueError:
            body = None
        self.server.owner._answer(self, protocol, path, body, received)

    # -- writing ------------------------------------------------------------------------

    def _json(self, status: int, payload: Any, headers: Mapping[str, str] | None = None) -> None:
        data = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.send_header("x-request-id", f"req_fake_{time.monotonic_ns()}")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)
        self.wfile.flush()

    def _start_sse(self) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("cache-control", "no-cache")
        # The end of the stream is the end of the connection.
        self.send_header("connection", "close")
        self.end_headers()
        self.close_connection = True

    def _sse(self, data: str, event: str | None = None) -> None:
        chunk = (f"event: {event}\n" if event else "") + f"data: {data}\n\n"
        self.wfile.write(chunk.encode("utf-8"))
        self.wfile.flush()


def _pieces(text: str) -> list[str]:
    # A word (with its trailing space) per delta, like a tokenizer-paced stream.
    return re.findall(r"\S+\s*|\s+", text)


def _json_pieces(text: str, size: int = 8) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)] or [""]


# --- the answers, in each protocol's shapes ---------------------------------------------

_Calls = Sequence[tuple[str, str, str]]  # (id, name, arguments JSON text) per tool call


@dataclass
class _OpenAIReply:
    """One answer as chat completions says it: a whole completion, or its chunks."""

    step: Step
    calls: _Calls
    finish: str
    usage: dict[str, int]
    response_id: str
    created: int
    model: Any
    include_usage: bool

    def completion(self) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": self.step.text or None,
            "refusal": None,
        }
        if self.step.thinking:
            message["reasoning_content"] = self.step.thinking
        if self.calls:
            message["tool_calls"] = [
                {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                for cid, name, args in self.calls
            ]
        return {
            "id": self.response_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [
                {"index": 0, "message": message, "logprobs": None, "finish_reason": self.finish}
            ],
            "usage": self.usage,
            "system_fingerprint": "fp_arbor_fake",
        }

    def _chunk(self, choices: list[dict[str, Any]], usage_value: Any = None) -> str:
        data: dict[str, Any] = {
            "id": self.response_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": "fp_arbor_fake",
            "choices": choices,
        }
        # With include_usage, every chunk has a usage key (null until the last one).
        if self.include_usage:
            data["usage"] = usage_value
        return json.dumps(data, ensure_ascii=False)

    def _delta(self, value: dict[str, Any], finish_reason: str | None = None) -> str:
        return self._chunk(
            [{"index": 0, "delta": value, "logprobs": None, "finish_reason": finish_reason}]
        )

    def _call_chunks(self, index: int, cid: str, name: str, args: str) -> Iterator[str]:
        # The first delta names the call; its arguments follow in small pieces.
        yield self._delta(
            {
                "tool_calls": [
                    {
                        "index": index,
                        "id": cid,
                        "type": "function",
                        "function": {"name": name, "arguments": ""},
                    }
                ]
            }
        )
        for piece in _json_pieces(args):
            yield self._delta({"tool_calls": [{"index": index, "function": {"arguments": piece}}]})

    def chunks(self) -> Iterator[str]:
        """The SSE data lines: role, thinking, text, tool calls, finish, usage, [DONE]."""
        yield self._delta({"role": "assistant", "content": "", "refusal": None})
        for piece in _pieces(self.step.thinking):
            yield self._delta({"reasoning_content": piece})
        for piece in _pieces(self.step.text):
            yield self._delta({"content": piece})
        for index, (cid, name, args) in enumerate(self.calls):
            yield from self._call_chunks(index, cid, name, args)
        yield self._delta({}, self.finish)
        if self.include_usage:
            yield self._chunk([], self.usage)
        yield "[DONE]"


def _sse_event(kind: str, data: dict[str, Any]) -> tuple[str, str | None]:
    """An Anthropic SSE event: its data line and its ``event:`` name."""
    return json.dumps({"type": kind, **data}, ensure_ascii=False), kind


def _anthropic_content(step: Step, calls: _Calls) -> list[dict[str, Any]]:
    """The answer's content blocks: thinking (signed), text, then tool_use blocks."""
    blocks: list[dict[str, Any]] = []
    if step.thinking:
        # Real signatures are opaque; a hash of the thinking stands in, the same every run.
        signature = base64.b64encode(hashlib.sha256(step.thinking.encode()).digest()).decode()
        blocks.append({"type": "thinking", "thinking": step.thinking, "signature": signature})
    if step.text:
        blocks.append({"type": "text", "text": step.text})
    for cid, name, args in calls:
        try:
            tool_input = json.loads(args)
        except ValueError:
            tool_input = {"_raw": args}
        blocks.append({"type": "tool_use", "id": cid, "name": name, "input": tool_input})
    return blocks


def _thinking_events(index: int, block: Mapping[str, Any]) -> Iterator[tuple[str, str | None]]:
    yield _sse_event(
        "content_block_start",
        {"index": index, "content_block": {"type": "thinking", "thinking": ""}},
    )
    for piece in _pieces(block["thinking"]):
        yield _sse_event(
            "content_block_delta",
            {"index": index, "delta": {"type": "thinking_delta", "thinking": piece}},
        )
    yield _sse_event(
        "content_block_delta",
        {"index": index, "delta": {"type": "signature_delta", "signature": block["signature"]}},
    )


def _text_events(index: int, block: Mapping[str, Any]) -> Iterator[tuple[str, str | None]]:
    yield _sse_event(
        "content_block_start",
        {"index": index, "content_block": {"type": "text", "text": ""}},
    )
    for piece in _pieces(block["text"]):
        yield _sse_event(
            "content_block_delta",
            {"index": index, "delta": {"type": "text_delta", "text": piece}},
        )


@dataclass
class _AnthropicReply:
    """One answer as the Messages API says it: a whole message, or its SSE events."""

    calls: _Calls
    blocks: list[dict[str, Any]]
    stop_reason: str
    usage: dict[str, int]
    completion: int
    message_id: str
    model: Any

    def message(self) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": self.blocks,
            "stop_reason": self.stop_reason,
            "stop_sequence": None,
            "usage": self.usage,
        }

    def _tool_use_events(
        self, index: int, block: Mapping[str, Any]
    ) -> Iterator[tuple[str, str | None]]:
        start = {"type": "tool_use", "id": block["id"], "name": block["name"]}
        yield _sse_event(
            "content_block_start",
            {"index": index, "content_block": {**start, "input": {}}},
        )
        # The arguments as the script wrote them, not re-serialised from the block.
        args = next(a for c, _, a in self.calls if c == block["id"])
        for piece in _json_pieces(args):
            yield _sse_event(
                "content_block_delta",
                {"index": index, "delta": {"type": "input_json_delta", "partial_json": piece}},
            )

    def _block_events(
        self, index: int, block: Mapping[str, Any]
    ) -> Iterator[tuple[str, str | None]]:
        kind = block["type"]
        if kind == "thinking":
            yield from _thinking_events(index, block)
        elif kind == "text":
            yield from _text_events(index, block)
        else:
            yield from self._tool_use_events(index, block)
        yield _sse_event("content_block_stop", {"index": index})

    def events(self) -> Iterator[tuple[str, str | None]]:
        """message_start, ping, each block's start / deltas / stop, message_delta, stop."""
        yield _sse_event(
            "message_start",
            {
                "message": {
                    "id": self.message_id,
                    "type": "message",
                    "role": "assistant",
                    "model": self.model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    # The real API reports 1 output token at the start.
                    "usage": {**self.usage, "output_tokens": 1},
                }
            },
        )
        yield _sse_event("ping", {})
        for index, block in enumerate(self.blocks):
            yield from self._block_events(index, block)
        yield _sse_event(
            "message_delta",
            {
                "delta": {"stop_reason": self.stop_reason, "stop_sequence": None},
                "usage": {"output_tokens": self.completion},
            },
        )
        yield _sse_event("message_stop", {})


class FakeLLMServer:
    """The fake provider. ``with FakeLLMServer(context_window=4000) as fake: …`` then
    point a client at ``fake.openai_base_url`` or ``fake.anthropic_base_url``."""

    def __init__(
        self,
        *,
        context_window: int = 16_384,
        script: Iterable[Step] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        openai_image_billing: str = "openai-tile",
        anthropic_image_billing: str = "claude",
        require_api_key: str | None = None,
        responder: Callable[[str, Mapping[str, Any]], Step | None] | None = None,
        log_limit: int | None = None,
        tokenizer: str = "words",
    ) -> None:
        self.context_window = context_window
        # How the fake counts a prompt: its own word rules, or UTF-8 bytes / 3 (the
        # pessimistic count the gateway's economy is judged by).
        self.count_text = TOKENIZERS[tokenizer]
        # Answers a request the script has no step for, from what it holds (protocol,
        # parsed body): a scripted agent whose next move depends on the transcript.
        self.responder = responder
        self.windows: dict[str, int] = {}
        self.openai_image_billing = openai_image_billing
        self.anthropic_image_billing = anthropic_image_billing
        self.require_api_key = require_api_key
        self._host = host
        self._port = port
        self._lock = threading.Lock()
        self._script: deque[Step] = deque(script)
        # Every request by default (tests read the whole log); the demo server behind
        # fake/* keeps only the newest, so a long-running `make run` does not hold every
        # request body (images and all) in memory.
        self._log: deque[RecordedRequest] = deque(maxlen=log_limit)
        self._ids = 0
        self._stopping = threading.Event()
        self._connections: set[socket.socket] = set()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> FakeLLMServer:
        if self._server is not None:
            return self
        self._stopping.clear()
        server = _Server((self._host, self._port), _Handler)
        server.owner = self
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.name = f"fake-llm-{self.port}"
        self._thread.start()
        return self

    def stop(self) -> None:
        server = self._server
        if server is None:
            return
        self._stopping.set()  # wakes delayed and stalled handlers
        server.shutdown()
        server.server_close()
        with self._lock:
            connections = list(self._connections)
            self._connections.clear()
        for conn in connections:
            # Idle keep-alive connections would otherwise hold their threads.
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None
        self._thread = None

    def __enter__(self) -> FakeLLMServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _track(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections = {c for c in self._connections if c.fileno() != -1}
            self._connections.add(conn)

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the fake server is not running; call start()")
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}"

    @property
    def openai_base_url(self) -> str:
        return self.url + "/v1"

    @property
    def anthropic_base_url(self) -> str:
        # The Anthropic SDK appends /v1/messages itself.
        return self.url

    # -- configuration ----------------------------------------------------------------

    def push(self, *steps: Step) -> None:
        """Append steps to the script."""
        with self._lock:
            self._script.extend(steps)

    def set_window(self, model: str, window: int) -> None:
        """Enforce ``window`` for requests naming ``model`` (others use context_window)."""
        with self._lock:
            self.windows[model] = window

    @property
    def pending_steps(self) -> int:
        with self._lock:
            return len(self._script)

    # -- the log ------------------------------------------------------------------------

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._lock:
            return list(self._log)

    def log_text(self) -> str:
        """The whole request log as JSON text (what a test would print or store)."""
        return json.dumps([r.as_dict() for r in self.requests], ensure_ascii=False, indent=1)

    def clear(self) -> None:
        with self._lock:
            self._log.clear()
            self._script.clear()

    # -- answering --------------------------------------------------------------------

    def _next_id(self, prefix: str) -> str:
        with self._lock:
            self._ids += 1
            return f"{prefix}{self._ids:06d}"

    def _take(self, *, errors_only: bool) -> Step | None:
        with self._lock:
            if not self._script:
                return None
            if errors_only and not self._script[0].is_error:
                return None
            return self._script.popleft()

    def _window_for(self, model: Any) -> int:
        with self._lock:
            return self.windows.get(str(model), self.context_window)

    def _authorized(self, handler: _Handler) -> bool:
        if self.require_api_key is None:
            return True
        # Anthropic takes x-api-key or a bearer token (its newer SDKs send the latter).
        bearer = (handler.headers.get("authorization") or "").removeprefix("Bearer ")
        return self.require_api_key in (bearer, handler.headers.get("x-api-key"))

    def _record(
        self, handler: _Handler, protocol: str, path: str, body: Any, received: float
    ) -> RecordedRequest:
        """Log the request as it arrived, before anything can refuse it."""
        headers = {k.lower(): v for k, v in handler.headers.items()}
        record = RecordedRequest(
            path=path,
            protocol=protocol,
            headers={k: v for k, v in headers.items() if k not in AUTH_HEADERS},
            body=body,
            received_at=received,
            stream=bool(isinstance(body, dict) and body.get("stream")),
            authenticated=any(k in AUTH_HEADERS for k in headers),
            query=urlsplit(handler.path).query,
        )
        with self._lock:
            self._log.append(record)
        return record

    def _answer(
        self, handler: _Handler, protocol: str, path: str, body: Any, received: float
    ) -> None:
        record = self._record(handler, protocol, path, body, received)
        handler.record = record
        try:
            prompt = self._admit(handler, protocol, body, record)
        except _Refused as refused:
            record.status = refused.status
            handler._json(refused.status, refused.payload, refused.headers)
            return
        if prompt is None:
            return  # the server stopped while a scripted error was waiting
        step = self._reply_step(protocol, body, prompt)
        if self._pause(step.delay):
            return
        record.status = 200
        if protocol == "openai":
            self._answer_openai(handler, body, step, prompt)
        else:
            self._answer_anthropic(handler, body, step, prompt)

    def _admit(
        self, handler: _Handler, protocol: str, body: Any, record: RecordedRequest
    ) -> int | None:
        """The prompt's token count, once the request passed what the real service
        checks, in its order; raises _Refused with the answer when it did not pass, and
        returns None when the server stopped meanwhile."""
        if not self._authorized(handler):
            message = f"Incorrect API key: {_masked_key(handler)}"
            raise _Refused(401, _default_error_body(protocol, 401, message))
        error_shape = openai_error if protocol == "openai" else anthropic_error
        if not isinstance(body, dict):
            raise _Refused(400, error_shape("We could not parse the JSON body of your request."))
        # A scripted error answers before the request is checked (see Step).
        step = self._take(errors_only=True)
        if step is not None:
            if self._pause(step.delay):
                return None
            payload = step.body or _default_error_body(protocol, step.status, step.message)
            raise _Refused(step.status, payload, step.headers)
        invalid = _request_error(protocol, body)
        if invalid is not None:
            raise _Refused(400, invalid)
        try:
            prompt = (
                count_openai_request(
                    body,
                    image_billing=self.openai_image_billing,
                    count_text_tokens=self.count_text,
                )
                if protocol == "openai"
                else count_anthropic_request(
                    body,
                    image_billing=self.anthropic_image_billing,
                    count_text_tokens=self.count_text,
                )
            )
        except _BadImage:
            raise _Refused(400, error_shape("Could not process image")) from None
        record.prompt_tokens = prompt
        window = self._window_for(body.get("model"))
        if prompt > window:
            overflow = openai_overflow if protocol == "openai" else anthropic_overflow
            raise _Refused(400, overflow(prompt, window))
        return prompt

    def _reply_step(self, protocol: str, body: Mapping[str, Any], prompt: int) -> Step:
        """The script's next reply, else the responder's, else the demo echo."""
        step = (
            self._take(errors_only=False)
            or (self.responder(protocol, body) if self.responder else None)
            or Step(text=self._echo(protocol, body, prompt))
        )
        choice = body.get("tool_choice")
        if step.tool_calls and (choice == "none" or (choice or {}) == {"type": "none"}):
            # tool_choice "none": the model answers in words, whatever the script says.
            step = replace(step, tool_calls=(), text=step.text or "(no tool calls allowed)")
        return step

    def _pause(self, seconds: float) -> bool:
        """Sleep; True when the server is stopping meanwhile."""
        return seconds > 0 and self._stopping.wait(seconds)

    def _hang(self, handler: _Handler, step: Step) -> None:
        handler.close_connection = True
        if step.keepalive:
            until = time.monotonic() + step.hang
            while time.monotonic() < until and not self._stopping.wait(step.keepalive):
                handler.wfile.write(b": keep-alive\n\n")
                handler.wfile.flush()
            return
        # Silent, but watching the socket: a client that hangs up is recorded as cut.
        until = time.monotonic() + step.hang
        while time.monotonic() < until and not self._stopping.is_set():
            readable, _, _ = select.select([handler.connection], [], [], 0.05)
            if readable and not handler.connection.recv(1, socket.MSG_PEEK):
                handler.record.cut = True
                return

    def _echo(self, protocol: str, body: Mapping[str, Any], prompt: int) -> str:
        """The demo answer: deterministic, and it shows the fake's own token count."""
        said = ""
        for message in reversed(body.get("messages") or []):
            if message.get("role") == "tool":
                said = f"(tool result) {message.get('content')}"
                break
            if message.get("role") != "user":
                continue
            content = message.get("content")
            if isinstance(content, str):
                said = content
            else:
                texts = []
                for block in content or []:
                    if block.get("type") == "text":
                        texts.append(block.get("text", ""))
                    elif block.get("type") == "tool_result":
                        texts.append(f"(tool result) {json.dumps(block.get('content'))}")
                    elif block.get("type") in ("image", "image_url"):
                        texts.append("(an image)")
                said = " ".join(texts)
            break
        said = said.strip()
        if len(said) > 400:
            said = said[:400] + "…"
        window = self._window_for(body.get("model"))
        return (
            f"Echo: {said or '(nothing)'}\n\n"
            f"(offline demo model — not an LLM; this request was {prompt} of {window} tokens "
            "by the fake's count)"
        )

    def _calls(self, step: Step, prefix: str) -> list[tuple[str, str, str]]:
        """(id, name, arguments JSON text) for each scripted call."""
        out = []
        for call in step.tool_calls:
            arguments = call.get("arguments", {})
            text = arguments if isinstance(arguments, str) else json.dumps(arguments)
            out.append((str(call.get("id") or self._next_id(prefix)), str(call["name"]), text))
        return out

    def _completion_tokens(self, step: Step, calls: Sequence[tuple[str, str, str]]) -> int:
        pieces = [step.text, step.thinking] + [name + args for _, name, args in calls]
        return max(1, sum(count_text_tokens(p) for p in pieces))

    # -- OpenAI -----------------------------------------------------------------------

    def _answer_openai(
        self, handler: _Handler, body: Mapping[str, Any], step: Step, prompt: int
    ) -> None:
        # Ids come from one counter: calls first, then the response, as before.
        calls = self._calls(step, "call_fake_")
        completion = self._completion_tokens(step, calls)
        reply = _OpenAIReply(
            step=step,
            calls=calls,
            finish=_OPENAI_FINISH.get(
                step.finish_reason or ("tool_calls" if calls else "stop"), "stop"
            ),
            usage={
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            },
            response_id=self._next_id("chatcmpl-fake"),
            created=int(time.time()),
            model=body.get("model", "fake"),
            include_usage=bool((body.get("stream_options") or {}).get("include_usage")),
        )
        if body.get("stream"):
            self._stream(handler, step, ((data, None) for data in reply.chunks()))
        elif step.stall_after is not None:
            self._hang(handler, step)
        else:
            handler._json(200, reply.completion())

    # -- Anthropic --------------------------------------------------------------------

    def _answer_anthropic(
        self, handler: _Handler, body: Mapping[str, Any], step: Step, prompt: int
    ) -> None:
        calls = self._calls(step, "toolu_fake_")
        completion = self._completion_tokens(step, calls)
        reply = _AnthropicReply(
            calls=calls,
            blocks=_anthropic_content(step, calls),
            stop_reason=_ANTHROPIC_FINISH.get(
                step.finish_reason or ("tool_calls" if calls else "stop"), "end_turn"
            ),
            usage={
                "input_tokens": prompt,
                "output_tokens": completion,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
            completion=completion,
            message_id=self._next_id("msg_fake_"),
            model=body.get("model", "fake"),
        )
        if body.get("stream"):
            self._stream(handler, step, reply.events())
        elif step.stall_after is not None:
            self._hang(handler, step)
        else:
            handler._json(200, reply.message())

    def _stream(
        self, handler: _Handler, step: Step, events: Iterable[tuple[str, str | None]]
    ) -> None:
        handler._start_sse()
        try:
            for sent, (data, name) in enumerate(events):
                if step.stall_after is not None and sent >= step.stall_after:
                    self._hang(handler, step)
                    return
                if sent and step.pace and self._pause(step.pace):
                    return  # the server is stopping
                handler._sse(data, name)
        except (BrokenPipeError, ConnectionResetError):
            # The client went away (a timeout, a cancelled call, a test that stopped
            # reading).
            handler.record.cut = True


# --- the shared demo server -----------------------------------------------------------

_shared: FakeLLMServer | None = None
_shared_lock = threading.Lock()


SHARED_LOG_LIMIT = 50


def shared_server() -> FakeLLMServer:
    """The process-wide fake server behind ``fake/*`` models, started on first use."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = FakeLLMServer(log_limit=SHARED_LOG_LIMIT).start()
            atexit.register(_shared.stop)
        return _shared


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m conversations.providers.fake",
        description="Run Arbor's loopback fake model provider (offline demo, not an LLM).",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--window", type=int, default=16_384, help="context window in tokens")
    args = parser.parse_args(argv)
    server = FakeLLMServer(context_window=args.window, host=args.host, port=args.port).start()
    print(f"fake provider on {server.url}")
    print(f"  OpenAI-compatible: OPENAI_BASE_URL={server.openai_base_url}")
    print(f"  Anthropic:         ANTHROPIC_BASE_URL={server.anthropic_base_url}")
    print(f"  Arbor fake/* ids:  ARBOR_FAKE_BASE_URL={server.openai_base_url}")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
