"""The gateway's database work, on a few long-lived threads that keep their connections.

Django runs a request's sync code on a thread made for that request, so its database
connection is opened and closed with the request. A harness sends the gateway a request
per model call and waits for it: opening a connection and closing it again (SQLite
checkpoints its log when the last connection closes) was a tenth of what the gateway
added to a request (bench_gateway). Here a fixed number of threads
(``ARBOR_GATEWAY_DB_THREADS``) keep one connection each, so the number of connections
stays bounded (PostgreSQL's max_connections), and each call first checks that its
connection still works (a server restart, a dropped link): one that does not is replaced.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connections

P = ParamSpec("P")
R = TypeVar("R")

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None


def executor() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(
                max_workers=settings.ARBOR_GATEWAY_DB_THREADS, thread_name_prefix="gateway-db"
            )
        return _executor


def _checked_connections() -> None:
    """Before a call: a connection that saw an error, or fails its health check (when
    CONN_HEALTH_CHECKS is on), is closed; the call opens a new one."""
    for connection in connections.all(initialized_only=True):
        if connection.in_atomic_block:  # pragma: no cover - calls never leave one open
            connection.close()
            continue
        if connection.errors_occurred:
            if not connection.is_usable():
                connection.close()
                continue
            connection.errors_occurred = False
        # With CONN_HEALTH_CHECKS (PostgreSQL here) Django checks the connection at the
        # first query after this flag is cleared, and reconnects if the check fails.
        connection.health_check_done = False  # type: ignore[attr-defined]  # not in django-stubs


def on_db_thread(func: Callable[P, R]) -> Callable[P, Awaitable[R]]:
    """``func`` as a coroutine function that runs it on one of the gateway's threads."""

    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        _checked_connections()
        return func(*args, **kwargs)

    @functools.wraps(func)
    async def call(*args: P.args, **kwargs: P.kwargs) -> R:
        if settings.ARBOR_GATEWAY_DB_THREADS <= 0:  # on the request's own thread
            return await sync_to_async(func)(*args, **kwargs)
        run = sync_to_async(checked, thread_sensitive=False, executor=executor())
        return await run(*args, **kwargs)

    return call
