"""PostgreSQL under uvicorn keeps its connection count bounded: every sync_to_async
thread would otherwise hold a persistent connection until PostgreSQL refuses clients
("too many clients already"). A thousand requests later the count is where it began."""

from __future__ import annotations

import http.client
import json
import unittest
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.db import connection
from django.test import TransactionTestCase

from conversations import services
from tests.builders import make_user, new_conversation
from tests.gateway_live import LiveGateway


def backends() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
        return int(cursor.fetchone()[0])


@pytest.mark.postgres
@unittest.skipUnless(connection.vendor == "postgresql", "needs PostgreSQL")
class ConnectionCountTests(TransactionTestCase):
    def test_a_thousand_requests_leave_the_connection_count_bounded(self) -> None:
        gateway = LiveGateway().start()
        self.addCleanup(gateway.stop)
        user = make_user("many")
        _, secret = services.api_token_create(user=user, name="t")
        conv, _ = new_conversation(user, "a>b")
        before = backends()

        def hit(i: int) -> int:
            client = http.client.HTTPConnection("127.0.0.1", gateway.port, timeout=60)
            path = f"/api/conversations/{conv.pk}" if i % 2 else "/api/conversations"
            client.request("GET", path, headers={"Authorization": f"Bearer {secret}"})
            status = client.getresponse().status
            client.close()
            return status

        with ThreadPoolExecutor(max_workers=20) as pool:
            statuses = list(pool.map(hit, range(1000)))
        assert set(statuses) == {200}, json.dumps(sorted(set(statuses)))
        after = backends()
        # The server's connections close with each request: a handful at most remain.
        assert after - before <= 5, (before, after)
