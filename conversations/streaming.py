"""Server-Sent Events for turns, under WSGI and ASGI alike.

Under ASGI, Django drains a *synchronous* streaming iterator completely before sending
anything (it wraps it in ``sync_to_async(list)``), which would defeat streaming. So under
ASGI the synchronous engine runs in its own thread and hands events over through a
queue to an async iterator.

A turn is *primed* before its response starts (``events_primed``): its first event is
taken at once, so bad input raises there and becomes a 4xx, instead of an ``error`` event
inside a 200 stream that has already begun. The HTML views and the JSON API share that.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from asgiref.sync import sync_to_async
from django.core.handlers.asgi import ASGIRequest
from django.db import close_old_connections, connections
from django.http import HttpRequest, StreamingHttpResponse

_END = object()

TurnEvent = dict[str, Any]


def sse(event: TurnEvent) -> bytes:
    name = event.get("event", "message")
    data = json.dumps({k: v for k, v in event.items() if k != "event"}, ensure_ascii=False)
    return f"event: {name}\ndata: {data}\n\n".encode()


def _threaded(
    produce: Callable[[], Iterator[TurnEvent]], *, ends_with_client: bool
) -> AsyncIterator[bytes]:
    handoff: queue.Queue[Any] = queue.Queue()
    # Set when the client goes away: a turn still runs to its end and is persisted (a
    # reload shows the answer), but its events are no longer queued; a stream that only
    # watches (``ends_with_client``) ends there.
    gone = threading.Event()

    def run() -> None:
        close_old_connections()
        try:
            for event in produce():
                if gone.is_set() and ends_with_client:
                    break
                if not gone.is_set():
                    handoff.put(sse(event))
        except Exception as exc:  # the engine recorded it on the attempt already
            handoff.put(sse({"event": "error", "error": "internal", "detail": type(exc).__name__}))
        finally:
            connections.close_all()  # this thread's connections die with it
            handoff.put(_END)

    threading.Thread(target=run, name="arbor-turn", daemon=True).start()

    async def iterate() -> AsyncIterator[bytes]:
        try:
            while True:
                item = await sync_to_async(handoff.get, thread_sensitive=False)()
                if item is _END:
                    return
                yield item
        finally:
            gone.set()

    return iterate()


def _sync(produce: Callable[[], Iterator[TurnEvent]]) -> Iterator[bytes]:
    for event in produce():
        yield sse(event)


def event_stream(
    request: HttpRequest,
    produce: Callable[[], Iterator[TurnEvent]],
    *,
    ends_with_client: bool = False,
) -> StreamingHttpResponse:
    """Stream a turn's events. ``produce`` starts the engine (input was already
    validated, so errors from here on arrive as ``error`` events). A stream that only
    watches a turn run elsewhere says ``ends_with_client``: it stops when its client
    goes away, where a turn runs on to its end."""
    body: AsyncIterator[bytes] | Iterator[bytes] = (
        _threaded(produce, ends_with_client=ends_with_client)
        if isinstance(request, ASGIRequest)
        else _sync(produce)
    )
    response = StreamingHttpResponse(body, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # tell proxies not to buffer the stream
    return response


def events_primed(events: Iterator[TurnEvent]) -> Iterator[TurnEvent]:
    """Start a turn's engine now: its first event is taken here, so bad input (or a
    retry with nothing to retry) raises before any response is under way. The events
    come back whole, the first one included."""
    first = next(events)
    return itertools.chain((first,), events)


def event_stream_primed(request: HttpRequest, events: Iterator[TurnEvent]) -> StreamingHttpResponse:
    """``event_stream`` of a turn's events, primed first (see ``events_primed``): an
    ArborError from bad input propagates to the caller instead of starting a 200."""
    primed = events_primed(events)
    return event_stream(request, lambda: primed)
