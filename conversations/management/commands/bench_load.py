"""``manage.py bench_load``: 20 clients at once against the `make run` server.

Starts uvicorn on this command's database (``DATABASE_URL``, SQLite by default; the
Makefile also runs it on PostgreSQL when one is reachable) and runs ``--clients``
threads for ``--seconds``, each looping over what a browser and a harness do: list
conversations, read a conversation's path, run a chat turn (the offline demo model),
move the tip. Prints one JSON object: requests, failures by status, "database is locked"
answers, and p50/p95/p99 per kind of request. Its user and data are deleted after.
"""

from __future__ import annotations

import http.client
import json
import os
import statistics
import threading
import time
from collections import Counter, defaultdict
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandParser
from django.db import connection

from conversations import services
from conversations.management.liveserver import (
    percentile,
    process_cpu_seconds,
    uvicorn_process,
)
from conversations.models import Conversation

BENCH_USERNAME = "__arbor_bench_load__"


class Command(BaseCommand):
    help = "Concurrent clients against a live server: failures and latency percentiles."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--clients", type=int, default=20)
        parser.add_argument("--seconds", type=float, default=60.0)

    def handle(self, *args: Any, **options: Any) -> None:
        user_model = get_user_model()
        user_model.objects.filter(username=BENCH_USERNAME).delete()
        user = user_model.objects.create_user(BENCH_USERNAME)
        _, token = services.api_token_create(user=user, name="load")
        conversations = [
            services.conversation_create(owner=user, title=f"load {i}", model="fake/demo")
            for i in range(options["clients"])
        ]
        env = dict(os.environ, ALLOWED_HOSTS="127.0.0.1", ARBOR_INPROCESS_JOBS="thread")
        try:
            with uvicorn_process(env) as (port, pid):
                cpu_from = process_cpu_seconds(pid)
                result = self._load(port, token, conversations, options)
                cpu = process_cpu_seconds(pid) - cpu_from
            # The server's own CPU (its process's: SQLite's work is in it, PostgreSQL's
            # is not), per request answered.
            result["server_cpu_ms_per_request"] = round(cpu / max(1, result["requests"]) * 1000, 2)
        finally:
            for conversation in Conversation.objects.filter(owner=user):
                services.conversation_delete(conversation=conversation)
            user.delete()
        result["database"] = connection.vendor
        self.stdout.write(json.dumps(result))

    def _load(
        self, port: int, token: str, conversations: list[Conversation], options: dict[str, Any]
    ) -> dict[str, Any]:
        timings: dict[str, list[float]] = defaultdict(list)
        statuses: Counter[str] = Counter()
        locked = 0
        lock = threading.Lock()
        stop_at = time.monotonic() + options["seconds"]
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}

        def client(conversation: Conversation) -> None:
            nonlocal locked
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            cid = conversation.pk
            steps = [
                ("list", "GET", "/api/conversations", None),
                ("turn", "POST", f"/api/conversations/{cid}/messages",
                 {"parts": [{"type": "text", "text": "hello under load"}]}),
                ("path", "GET", f"/api/conversations/{cid}/path", None),
                ("detail", "GET", f"/api/conversations/{cid}", None),
            ]  # fmt: skip
            i = 0
            while time.monotonic() < stop_at:
                name, method, path, body = steps[i % len(steps)]
                i += 1
                started = time.perf_counter()
                try:
                    conn.request(method, path, body=json.dumps(body) if body else None,
                                 headers=headers)  # fmt: skip
                    response = conn.getresponse()
                    raw = response.read()
                    status = str(response.status)
                except (OSError, http.client.HTTPException) as exc:
                    conn.close()
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                    raw, status = b"", type(exc).__name__
                elapsed = time.perf_counter() - started
                with lock:
                    timings[name].append(elapsed)
                    statuses[status] += 1
                    if b"database is locked" in raw:
                        locked += 1
            conn.close()

        threads = [threading.Thread(target=client, args=(c,)) for c in conversations]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        total = sum(statuses.values())
        ok = sum(n for s, n in statuses.items() if s in ("200", "201"))
        return {
            "clients": options["clients"],
            "seconds": options["seconds"],
            "requests": total,
            "failures": total - ok,
            "statuses": dict(statuses),
            "database_is_locked": locked,
            "latency_ms": {
                name: {
                    "count": len(values),
                    "p50": round(statistics.median(values) * 1000, 1),
                    "p95": round(percentile(values, 0.95) * 1000, 1),
                    "p99": round(percentile(values, 0.99) * 1000, 1),
                }
                for name, values in sorted(timings.items())
            },
        }
