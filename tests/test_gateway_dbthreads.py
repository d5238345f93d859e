"""The gateway's database work on its own long-lived threads (conversations/gateway/
dbthreads.py), and its fast body parser, on a live server:

- requests keep working, and keep the connection count bounded, across many requests;
- a connection the database dropped (PostgreSQL: its backend terminated) is replaced at
  the next request, which answers and lands in the tree;
- the fast parser keeps what Python's parser keeps: an integer past 64 bits stays exact
  in the tree, NaN is refused with a message naming it, and chain keys are the same
  whether they were cached or not.
"""

from __future__ import annotations

import http.client
import json
import unittest
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from django.db import connection
from django.test import TransactionTestCase

from conversations.gateway import wire
from conversations.models import Conversation, Message
from conversations.providers.fake import Step
from tests.gateway_live import ANTHROPIC_MODEL, LiveGateway

THREADS = 2


def request(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": ANTHROPIC_MODEL, "max_tokens": 100, "messages": messages}


def backends() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid()"
        )
        return int(cursor.fetchone()[0])


class GatewayDatabaseThreadTests(TransactionTestCase):
    def setUp(self) -> None:
        self.gateway = LiveGateway(extra_env={"ARBOR_GATEWAY_DB_THREADS": str(THREADS)}).start()
        self.addCleanup(self.gateway.stop)
        self.headers = {"x-api-key": self.gateway.token}

    def post(self, body: Any) -> tuple[int, Any]:
        status, answer, _ = self.gateway.call(
            "POST", "/gateway/anthropic/v1/messages", body, headers=self.headers
        )
        return status, json.loads(answer)

    def test_an_integer_past_64_bits_stays_exact_and_nan_is_refused(self) -> None:
        big = 123456789012345678901234567890
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": "Look it up."},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "toolu_big", "name": "lookup", "input": {"n": big}}
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_big", "content": "x"}],
            },
        ]
        self.gateway.fake.push(Step.reply("done"))
        tools = [{"name": "lookup", "input_schema": {"type": "object"}}]
        status, answer = self.post({**request(messages), "tools": tools})
        assert status == 200, answer
        self.gateway.settle()
        conversation = Conversation.objects.get(owner=self.gateway.user)
        stored = json.dumps([m.parts for m in Message.objects.filter(conversation=conversation)])
        assert str(big) in stored  # not 1.2345678901234568e+29
        sent = self.gateway.fake.requests[-1].body
        assert sent["messages"][1]["content"][0]["input"]["n"] == big

        client_body = json.dumps(request(messages)).replace('"Look it up."', "NaN")
        status, raw = self._post_raw(client_body.encode())
        assert status == 400
        assert "NaN" in json.loads(raw)["error"]["message"]

    def _post_raw(self, body: bytes) -> tuple[int, bytes]:
        client = http.client.HTTPConnection("127.0.0.1", self.gateway.port, timeout=60)
        client.request(
            "POST",
            "/gateway/anthropic/v1/messages",
            body=body,
            headers={"content-type": "application/json", **self.headers},
        )
        response = client.getresponse()
        out = response.status, response.read()
        client.close()
        return out

    def test_many_requests_in_parallel_all_land(self) -> None:
        def one(i: int) -> int:
            self.gateway.fake.push(Step.reply(f"answer {i}"))
            status, _ = self.post(request([{"role": "user", "content": f"task {i}"}]))
            return status

        with ThreadPoolExecutor(max_workers=8) as pool:
            statuses = list(pool.map(one, range(40)))
        assert statuses == [200] * 40
        self.gateway.settle()
        conversations = Conversation.objects.filter(owner=self.gateway.user)
        assert conversations.count() == 40
        for conversation in conversations:
            assert conversation.tip_id is not None
            assert Message.objects.filter(conversation=conversation).count() == 2

    @pytest.mark.postgres
    @unittest.skipUnless(connection.vendor == "postgresql", "needs PostgreSQL")
    def test_connections_stay_bounded_and_a_dropped_one_is_replaced(self) -> None:
        before = backends()

        def one(i: int) -> int:
            self.gateway.fake.push(Step.reply("ok"))
            status, _ = self.post(request([{"role": "user", "content": f"job {i}"}]))
            return status

        with ThreadPoolExecutor(max_workers=10) as pool:
            assert set(pool.map(one, range(60))) == {200}
        self.gateway.settle()
        # The gateway's threads keep one connection each; the site's close per request.
        assert backends() - before <= THREADS + 2, (before, backends())

        # The database drops every other connection (a restart, a failover): the next
        # gateway requests reconnect instead of failing.
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        for i in range(THREADS * 2):
            assert one(100 + i) == 200
        self.gateway.settle()
        assert Conversation.objects.filter(owner=self.gateway.user).count() == 60 + THREADS * 2


def test_chain_keys_are_the_same_cached_or_not() -> None:
    digests = [f"d{i}" for i in range(50)]
    first = wire.chain_keys(digests)  # hashed
    again = wire.chain_keys(digests)  # from the cache
    assert first == again
    previous = wire.CHAIN_SEED
    for digest, key in zip(digests, first, strict=True):
        previous = wire.chain_next(previous, digest)
        assert key == previous
    # A different history never shares a key with this one.
    assert not set(wire.chain_keys(["x", *digests[1:]])) & set(first)


def test_strict_json_is_the_same_for_bytes_and_text() -> None:
    from conversations.parts import NotJSON, strict_json

    big = "123456789012345678901234567890"
    document = '{"n": ' + big + ', "f": 1.5, "s": "\\u00e9", "neg": -7}'
    for raw in (document, document.encode()):
        value = strict_json(raw)
        assert value == {"n": int(big), "f": 1.5, "s": "é", "neg": -7}
        assert isinstance(value["n"], int)  # exact, not a float
    for bad in (b'{"x": NaN}', b"[Infinity]", b"[1e400]", b"[-1e400]"):
        try:
            strict_json(bad)
        except NotJSON:
            continue
        raise AssertionError(f"{bad!r} was accepted")
