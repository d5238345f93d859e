"""A write repeated on a timer while some long work runs: the lease of a turn or a job.

The work (a model call silent for minutes, an OCR pass) gives no signal of life of its
own, so a thread renews the row every ``interval`` seconds until the block ends; a
process that dies stops renewing, and its row goes stale for whoever looks next.

Leases and heartbeats are written (``Now()``) and judged (``db_now()``) by the
database's clock, the one every host shares: a worker whose own clock is off by more
than a lease would otherwise take another host's live work for dead, or a dead one's
for alive.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime

from django.db import connection, connections

log = logging.getLogger("arbor.heartbeat")


# The database's time now, as each backend says it (SQLite: its own clock, this host's;
# PostgreSQL: the server's, the time of this statement).
_NOW_SQL = {
    "sqlite": "SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')",
    "postgresql": "SELECT statement_timestamp()",
}


def db_now() -> datetime:
    """The database's clock, timezone-aware (UTC on SQLite): what leases and heartbeats
    written with ``Now()`` are compared with. One query."""
    with connection.cursor() as cursor:
        cursor.execute(_NOW_SQL.get(connection.vendor, "SELECT CURRENT_TIMESTAMP"))
        row = cursor.fetchone()
    value = row[0]
    if isinstance(value, str):
        return datetime.fromisoformat(value).replace(tzinfo=UTC)
    assert isinstance(value, datetime)
    return value


class Heartbeat:
    """``with Heartbeat(renew, interval):`` calls ``renew()`` every ``interval`` seconds
    on a thread of its own (with its own database connection) until the block ends."""

    def __init__(self, renew: Callable[[], object], interval: float, *, name: str) -> None:
        self.renew = renew
        self.interval = max(0.1, interval)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval):
                try:
                    self.renew()
                except Exception:
                    # One failed write (a lock held too long, a dropped connection) must
                    # not end the renewals: a fresh connection, and the next beat.
                    log.exception("renewing %s failed; trying again", self._thread.name)
                    connections.close_all()
        finally:
            connections.close_all()  # this thread's own connection
