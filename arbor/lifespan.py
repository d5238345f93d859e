"""The server's start and stop: at the start, jobs a previous process left behind are
picked up; at the stop, the gateway's pending writes are finished.

Without a broker, compaction jobs and imports run on a thread of the web process
(arbor.jobs). A server killed mid-job leaves its job "running" under a process that is
gone, or "queued" in an executor that died with it; nothing else would ever run it. So
when the server starts (the ASGI lifespan startup), the same sweep Celery workers run at
their start (compaction.services.jobs_sweep) runs once, on a thread of its own so that
startup never waits on the database. With a broker the workers sweep instead.
"""

from __future__ import annotations

import logging
import threading

from arbor.bodylimit import ASGIApp, Receive, Scope, Send

log = logging.getLogger("arbor.jobs")


def _sweep() -> None:
    from django.db import connection

    from compaction.services import jobs_sweep

    try:
        swept = jobs_sweep()
        if any(swept.values()):
            log.warning("jobs left by a previous process, picked up at start: %s", swept)
    except Exception:
        log.exception("the start-up sweep of background jobs failed")
    finally:
        connection.close()  # this thread's own connection


def sweep_in_background() -> threading.Thread | None:
    """Start the sweep when jobs run in this process (no broker); return its thread."""
    from django.conf import settings

    if settings.CELERY_BROKER_URL:
        return None
    thread = threading.Thread(target=_sweep, name="arbor-startup-sweep", daemon=True)
    thread.start()
    return thread


class Lifespan:
    """Answers the ASGI lifespan protocol (Django's handler does not) and sweeps at
    startup; every other scope goes to the wrapped application."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                sweep_in_background()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                from conversations.gateway import pending
                from conversations.gateway.upstream import close_sessions

                await pending.drain()  # exchanges the gateway answered, not yet written
                await close_sessions()
                await send({"type": "lifespan.shutdown.complete"})
                return
