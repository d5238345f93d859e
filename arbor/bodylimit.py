"""Request bodies refused by size before anything is stored (an ASGI layer in front of
Django).

Django's ASGI handler reads the whole body into a temporary file before any view, any
authentication or even URL resolution runs: a 300 MB POST to ``/login/`` or to a 404
costs 300 MB of disk first. Here the limit is checked on the ``Content-Length`` header
(413 at once, nothing read) and on the bytes actually received (a chunked body, or one
longer than it said, is cut off at the limit with a 413).

The limit depends on the route: uploads of images, imports, the gateway and the API
each have theirs; anything else (forms, unknown URLs) gets the smallest. A reverse proxy
in front should have a limit of its own at least as large as the largest here
(README "Deploying").

The import routes take the largest bodies (hundreds of MB), so there a body is read only
for a signed-in user: the session cookie or bearer token is checked from the headers
first, and an anonymous request is refused (401 for the API, 403 for the page) before
one byte of it is read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from importlib import import_module
from typing import Any

from asgiref.sync import sync_to_async

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[..., Awaitable[None]]

MIB = 1024 * 1024


def _env_bytes(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() else default


def limits() -> list[tuple[str, int]]:
    """(path prefix, byte limit), most specific first; "" is everything else."""
    blob = _env_bytes("ARBOR_MAX_BLOB_BYTES", 10 * MIB)
    imports = _env_bytes("ARBOR_IMPORT_MAX_UPLOAD_BYTES", 512 * MIB) + MIB  # + the envelope
    return [
        ("/api/blobs", blob + MIB),  # the image plus the multipart envelope
        ("/api/imports", imports),
        ("/import/", imports),
        ("/gateway/", _env_bytes("ARBOR_GATEWAY_MAX_BODY", 32 * MIB)),
        ("/api/", _env_bytes("ARBOR_MAX_REQUEST_BYTES", 16 * MIB)),
        ("/c/", _env_bytes("ARBOR_MAX_REQUEST_BYTES", 16 * MIB)),
        ("", _env_bytes("ARBOR_MAX_FORM_BYTES", 1 * MIB)),
    ]


# Routes whose bodies are read only for a signed-in user (the API's accepts a bearer
# token too): the largest uploads, which anyone could otherwise make Django spool.
SIGNED_IN_ONLY = ("/api/imports", "/import/")
_READS_BODY = frozenset({"POST", "PUT", "PATCH"})


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    """Wraps an ASGI application; HTTP requests over their route's limit get a 413."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.limits = limits()

    def limit_for(self, path: str) -> int:
        for prefix, limit in self.limits:
            if path.startswith(prefix):
                return limit
        return self.limits[-1][1]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(scope.get("path", ""))
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _refuse(scope, send, limit)
            return
        if _signed_in_only(scope) and not await sync_to_async(_signed_in)(scope):
            await _refuse_anonymous(scope, send)
            return
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await _refuse(scope, send, limit)


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", []):
        if key == name:
            return bytes(value).decode("latin-1")
    return ""


def _signed_in_only(scope: Scope) -> bool:
    path: str = scope.get("path", "")
    return scope.get("method") in _READS_BODY and path.startswith(SIGNED_IN_ONLY)


def _signed_in(scope: Scope) -> bool:
    """Whether the request's headers carry a live session (or, on the API, a valid
    bearer token): what the view will check, checked before the body is read."""
    from django.conf import settings
    from django.contrib.auth import get_user
    from django.http import HttpRequest
    from django.http.cookie import parse_cookie

    from conversations.errors import TokenExpired
    from conversations.services import api_token_authenticate

    authorization = _header(scope, b"authorization")
    if scope.get("path", "").startswith("/api/") and authorization[:7].lower() == "bearer ":
        try:
            return api_token_authenticate(secret=authorization[7:].strip()) is not None
        except TokenExpired:
            return False
    key = parse_cookie(_header(scope, b"cookie")).get(settings.SESSION_COOKIE_NAME)
    if not key:
        return False
    request = HttpRequest()
    request.session = import_module(settings.SESSION_ENGINE).SessionStore(key)
    return bool(get_user(request).is_authenticated)


async def _refuse_anonymous(scope: Scope, send: Send) -> None:
    if scope.get("path", "").startswith("/api/"):
        status, body = (
            401,
            {
                "error": "unauthorized",
                "detail": "sign in, or send Authorization: Bearer <token>",
            },
        )
    else:
        status, body = 403, {"error": "forbidden", "detail": "sign in to import"}
    await _answer(send, status, body)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", []):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _refuse(scope: Scope, send: Send, limit: int) -> None:
    path = scope.get("path", "")
    detail = f"the request body is larger than {limit} bytes, the limit for {path or '/'}"
    if path.startswith("/gateway/anthropic"):
        body: dict[str, Any] = {
            "type": "error",
            "error": {"type": "request_too_large", "message": detail},
        }
    elif path.startswith("/gateway/openai"):
        body = {
            "error": {
                "message": detail,
                "type": "invalid_request_error",
                "code": "request_too_large",
            }
        }
    else:
        body = {"error": "request_too_large", "detail": detail, "limit": limit}
    await _answer(send, 413, body)


async def _answer(send: Send, status: int, body: dict[str, Any]) -> None:
    """A JSON answer sent before the request's body is read (the connection closes)."""
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})
