"""The gateway's own ASGI handler: Django's, without the site's middleware.

A harness sends the gateway a request per model call, and waits for it. The site's
middleware (sessions, CSRF, authentication, messages, security headers, CSP, htmx,
login throttling) serves browsers; under ASGI each class-based one runs its hooks on a
thread hop, which cost a gateway request ~9 ms before its view ran (bench_gateway). The
gateway authenticates by token in its views, is CSRF-exempt and answers JSON or event
streams, so it needs none of them. What it keeps: Django's request handling (URL
resolution, the request signals that close database connections, exception to
response), ``gateway_guard`` (the Host header checked against ALLOWED_HOSTS, nosniff)
and ``private_pages`` (no-store and the Permissions-Policy on every answer), both plain
async functions.
"""

from __future__ import annotations

import asyncio
from typing import Any

from django.conf import settings
from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.exception import convert_exception_to_response
from django.utils.module_loading import import_string

from conversations.gateway.pending import WRITE_BEHIND

GATEWAY_MIDDLEWARE = ("arbor.middleware.gateway_guard", "arbor.middleware.private_pages")


class GatewayHandler(ASGIHandler):
    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if settings.ARBOR_GATEWAY_DB_THREADS <= 0:
            # Sync work runs in Django's per-request thread context, which ends with the
            # request: a write after it would open a thread and a connection nobody
            # closes. Without the gateway's own threads, the view writes, then answers.
            await super().__call__(scope, receive, send)
            return
        # This server's event loop outlives the request: the view may write the exchange
        # behind its answer (conversations/gateway/pending.py), once the answer is sent
        # (so that the write does not compete with sending it).
        answered = asyncio.Event()
        try:
            # Django gives each request a thread of its own for its sync code (a
            # ThreadSensitiveContext): a thread started and stopped per request. The
            # gateway's views run their sync work on their own long-lived threads
            # (conversations/gateway/dbthreads.py), so what is left here (the request
            # signals' receivers) runs on asgiref's one shared thread instead.
            await self.handle({**scope, WRITE_BEHIND: answered}, receive, send)
        finally:
            answered.set()

    def load_middleware(self, is_async: bool = False) -> None:
        # What BaseHandler.load_middleware builds from settings.MIDDLEWARE, from ours.
        assert is_async, "the gateway handler is ASGI only"
        self._view_middleware: list[Any] = []
        self._template_response_middleware: list[Any] = []
        self._exception_middleware: list[Any] = []
        # django-stubs leave out BaseHandler's private _get_response_async (the innermost
        # handler Django itself wraps in load_middleware).
        handler = convert_exception_to_response(self._get_response_async)  # type: ignore[attr-defined]
        for path in reversed(GATEWAY_MIDDLEWARE):
            handler = convert_exception_to_response(import_string(path)(handler))
        self._middleware_chain = handler
