"""Exchanges answered but not yet written: the gateway writes behind its answers.

A harness waits for each answer, and the write of the exchange (the request's new
messages, the answer and the tip move: one transaction) cost it ~1.5-2 ms of every
request when it came before the answer's last byte (bench_gateway). So the write is
started when the upstream's answer is complete and the answer goes out at once; the
write finishes while the harness reads the answer and runs its tools.

What keeps that safe:

- **the harness's next request** (by the same token, in this process) waits for the
  writes still pending under that token before it is placed in the tree, so it finds its
  previous answer stored (a request served by another process re-checks its place when
  it is written: ``services.exchange_store``);
- **a server stopping** (the ASGI lifespan shutdown) waits for every pending write;
- **a server killed** before a write finished loses only what the harness already holds:
  its next request carries the answer, and is stored with it;
- **readers that must see a write** (tests, scripts) ask ``GET /gateway/status?wait=S``
  with the token, which answers once the token's writes are done (in the process that
  answers it: with several server processes, each knows only its own).

Tasks belong to an event loop, so the registry is kept per loop; and only a request
served by the server's own loop (the ASGI gateway handler marks its scope with
``WRITE_BEHIND``) writes behind. Elsewhere (WSGI, Django's test client) the loop ends
with the request, and the view writes before it answers, as it always may.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import weakref
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("arbor.gateway")

WRITE_BEHIND = "arbor.write_behind"  # an ASGI scope key

_pending: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, dict[str, set[asyncio.Task[None]]]
] = weakref.WeakKeyDictionary()


def _key(secret: str) -> str:
    # The registry never holds a token's secret, only its digest.
    return hashlib.sha256(secret.encode()).hexdigest()


def _tasks() -> dict[str, set[asyncio.Task[None]]]:
    loop = asyncio.get_running_loop()
    found = _pending.get(loop)
    if found is None:
        found = _pending[loop] = {}
    return found


async def _once(answered: asyncio.Event, write: Coroutine[Any, Any, None]) -> None:
    try:
        await answered.wait()
    except asyncio.CancelledError:  # the loop is being torn down (a forced stop)
        write.close()
        log.warning("gateway: an exchange was not written: the server stopped first")
        raise
    await write


def start(
    secret: str, write: Coroutine[Any, Any, None], *, after: asyncio.Event
) -> asyncio.Task[None]:
    """Run ``write`` (a coroutine) once ``after`` is set (the answer is sent, so the
    write does not compete with sending it), as a task registered under the token's
    secret."""
    tasks = _tasks()
    key = _key(secret)
    task = asyncio.ensure_future(_once(after, write))
    tasks.setdefault(key, set()).add(task)

    def done(finished: asyncio.Task[None]) -> None:
        mine = tasks.get(key)
        if mine is not None:
            mine.discard(finished)
            if not mine:
                del tasks[key]
        if not finished.cancelled() and finished.exception() is not None:
            log.error("gateway: writing an exchange failed", exc_info=finished.exception())

    task.add_done_callback(done)
    return task


def count(secret: str) -> int:
    """How many of the token's writes are still pending in this process."""
    return len(_tasks().get(_key(secret), ()))


async def settle(secret: str, timeout: float | None = None) -> bool:
    """Wait for the token's pending writes (those started before this call); False when
    ``timeout`` ran out first. A failed write counts as done: it was logged."""
    waiting = set(_tasks().get(_key(secret), ()))
    if not waiting:
        return True
    _, still = await asyncio.wait(waiting, timeout=timeout)
    return not still


DRAIN_TIMEOUT = 30.0


async def drain(timeout: float = DRAIN_TIMEOUT) -> None:
    """Wait for every pending write of this loop (the server's shutdown), for at most
    ``timeout`` seconds (a write held by a database lock must not hold the stop)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    tasks = _tasks()
    while True:
        waiting = {task for group in tasks.values() for task in group if not task.done()}
        left = deadline - loop.time()
        if not waiting:
            return
        if left <= 0:
            log.warning("gateway: stopping with %d exchanges not yet written", len(waiting))
            return
        await asyncio.wait(waiting, timeout=left)
