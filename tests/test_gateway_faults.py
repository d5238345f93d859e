"""The gateway's boundaries under faults and between users: a server killed (-9) between
two upstream events leaves the tree at the previous boundary and the harness's retry
continues it; a client that hangs up mid-stream writes nothing for that answer; a
second user's token never reaches the first user's gateway conversations.

The exchange is written behind its answer (conversations/gateway/pending.py). Holding a
lock on the conversation from the test makes that write wait, so the tests can see:
the answer arrives while its write waits, the harness's next request waits for it, a
server stopping finishes it, and a server killed before it loses nothing the next
request does not carry."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from django.db import transaction
from django.test import TransactionTestCase

from conversations import services
from conversations.models import Conversation, Message
from conversations.providers.fake import Step
from tests.builders import make_user
from tests.gateway_live import ANTHROPIC_MODEL, LiveGateway
from tests.live_server import READY_SECONDS


def request(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": ANTHROPIC_MODEL, "max_tokens": 100, "messages": messages, **extra}


# A live server per test, killed and restarted: tens of seconds (make test-quick skips).
pytestmark = pytest.mark.slow

FIRST = [{"role": "user", "content": "Start the work."}]
# An upstream stall long enough that a busy machine's gateway still hangs up inside it.
STALL = 60


class GatewayCase(TransactionTestCase):
    def setUp(self) -> None:
        self.gateway = LiveGateway().start()
        self.addCleanup(self.gateway.stop)
        self.headers = {"x-api-key": self.gateway.token, "anthropic-version": "2023-06-01"}

    def open_stream(self, body: dict[str, Any]) -> tuple[http.client.HTTPConnection, Any]:
        client = http.client.HTTPConnection("127.0.0.1", self.gateway.port, timeout=60)
        client.request(
            "POST",
            "/gateway/anthropic/v1/messages",
            body=json.dumps({**body, "stream": True}),
            headers={"content-type": "application/json", **self.headers},
        )
        return client, client.getresponse()

    def read_events(self, response: Any, count: int) -> list[bytes]:
        events: list[bytes] = []
        buffer = b""
        while len(events) < count:
            chunk = response.read1(65536) if hasattr(response, "read1") else response.read(1)
            if not chunk:
                break
            buffer += chunk
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                events.append(event)
        return events

    def first_exchange(self) -> tuple[Conversation, list[dict[str, Any]]]:
        self.gateway.fake.push(Step.reply("Working on it."))
        status, raw, _ = self.gateway.call(
            "POST", "/gateway/anthropic/v1/messages", request(FIRST), headers=self.headers
        )
        self.assertEqual(status, 200, raw)
        self.gateway.settle()
        conversation = Conversation.objects.get(owner=self.gateway.user)
        second = [
            *FIRST,
            {"role": "assistant", "content": json.loads(raw)["content"]},
            {"role": "user", "content": "Now the second part."},
        ]
        return conversation, second


class StreamFaultTests(GatewayCase):
    def test_kill_9_between_two_upstream_events_then_the_retry_continues(self) -> None:
        conversation, second = self.first_exchange()
        conversation.refresh_from_db()
        tip, version = conversation.tip_id, conversation.version
        self.gateway.fake.push(Step.stall("This answer never ends", after=3, hang=60))
        client, response = self.open_stream(request(second))
        self.assertEqual(response.status, 200)
        events = self.read_events(response, 2)
        self.assertGreaterEqual(len(events), 2)  # the upstream's first events got through
        self.gateway.kill()
        client.close()
        conversation.refresh_from_db()
        self.assertEqual((conversation.tip_id, conversation.version), (tip, version))
        self.assertEqual(Message.objects.filter(conversation=conversation).count(), 2)

        # The harness retries the same request against the restarted server.
        self.gateway.serve()
        self.gateway.fake.push(Step.reply("Second part done."))
        status, raw, _ = self.gateway.call(
            "POST", "/gateway/anthropic/v1/messages", request(second), headers=self.headers
        )
        self.assertEqual(status, 200, raw)
        self.gateway.settle()
        conversation.refresh_from_db()
        path = services.transcript_resume(conversation=conversation, tip_id=conversation.tip_id)
        texts = [p["text"] for m in path[0] for p in m["parts"] if p["type"] == "text"]
        self.assertEqual(
            texts,
            ["Start the work.", "Working on it.", "Now the second part.", "Second part done."],
        )
        self.assertEqual(Message.objects.filter(conversation=conversation).count(), 4)

    def test_a_client_that_hangs_up_mid_stream_writes_no_answer(self) -> None:
        conversation, second = self.first_exchange()
        self.gateway.fake.push(Step.stall("Half an answer", after=3, hang=STALL))
        client, response = self.open_stream(request(second))
        self.read_events(response, 2)
        client.sock.close() if client.sock else None
        client.close()
        # The gateway hangs up on the upstream too (the model stops generating): the
        # stalled upstream sees its connection closed before its stall ends (the fake
        # records `cut` only then, and its stall ends there).
        deadline = time.monotonic() + READY_SECONDS
        while not self.gateway.fake.requests[-1].cut and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertTrue(self.gateway.fake.requests[-1].cut)
        self.gateway.settle()  # whatever the gateway would write is written by now
        conversation.refresh_from_db()
        self.assertEqual(Message.objects.filter(conversation=conversation).count(), 2)
        self.assertEqual(conversation.tip.parts, [{"type": "text", "text": "Working on it."}])

    def test_an_unreachable_upstream_is_a_502_in_the_clients_shape(self) -> None:
        conversation, second = self.first_exchange()
        self.gateway.fake.stop()  # the upstream is gone: its port refuses connections
        for stream in (False, True):
            with self.subTest(stream=stream):
                status, raw, _ = self.gateway.call(
                    "POST",
                    "/gateway/anthropic/v1/messages",
                    request(second, stream=stream),
                    headers=self.headers,
                )
                self.assertEqual(status, 502, raw)
                body = json.loads(raw)
                self.assertEqual(body["type"], "error")
                self.assertEqual(body["error"]["type"], "api_error")
                self.assertIn("upstream is unreachable", body["error"]["message"])
        # Nothing half-written: the first exchange is all the tree holds.
        self.gateway.settle()
        conversation.refresh_from_db()
        self.assertEqual(Message.objects.filter(conversation=conversation).count(), 2)


@contextmanager
def writes_held(conversation: Conversation) -> Iterator[None]:
    """Until the block ends, nobody else can write the conversation: its row is locked
    (PostgreSQL), or the database's write lock is held (SQLite: transactions begin
    IMMEDIATE here)."""
    with transaction.atomic():
        list(Conversation.objects.select_for_update().filter(pk=conversation.pk))
        Conversation.objects.filter(pk=conversation.pk).update(title=conversation.title)
        yield


class WriteBehindTests(GatewayCase):
    """Writing behind the answer, seen from outside the server."""

    def pending(self) -> int:
        status, raw, _ = self.gateway.call("GET", "/gateway/status", headers=self.headers)
        self.assertEqual(status, 200, raw)
        return int(json.loads(raw)["pending_writes"])

    def texts(self, conversation: Conversation) -> list[str]:
        conversation.refresh_from_db()
        path, _ = services.transcript_resume(conversation=conversation, tip_id=conversation.tip_id)
        return [p["text"] for m in path for p in m["parts"] if p["type"] == "text"]

    def post(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        status, raw, _ = self.gateway.call(
            "POST", "/gateway/anthropic/v1/messages", request(messages), headers=self.headers
        )
        self.assertEqual(status, 200, raw)
        return dict(json.loads(raw))

    def test_the_answer_goes_out_before_its_write_and_the_next_request_waits_for_it(
        self,
    ) -> None:
        conversation, second = self.first_exchange()
        self.gateway.fake.push(Step.reply("Second part done."), Step.reply("Third done."))
        # The pool outlives the lock: leaving it waits for the third request, which
        # waits for the lock to go.
        with ThreadPoolExecutor(1) as pool, writes_held(conversation):
            answer = self.post(second)  # answered while its write cannot happen
            self.assertEqual(answer["content"][0]["text"], "Second part done.")
            self.assertEqual(self.pending(), 1)
            third = [
                *second,
                {"role": "assistant", "content": answer["content"]},
                {"role": "user", "content": "Third."},
            ]
            forwarded = len(self.gateway.fake.requests)
            later = pool.submit(self.post, third)
            time.sleep(1.0)
            # The next request waits for the write before it is placed or forwarded.
            self.assertFalse(later.done())
            self.assertEqual(len(self.gateway.fake.requests), forwarded)
            # (the lock is released here)
        self.assertEqual(later.result(timeout=30)["content"][0]["text"], "Third done.")
        self.gateway.settle()
        self.assertEqual(self.pending(), 0)
        self.assertEqual(
            self.texts(conversation),
            [
                "Start the work.",
                "Working on it.",
                "Now the second part.",
                "Second part done.",
                "Third.",
                "Third done.",
            ],
        )
        self.assertEqual(Message.objects.filter(conversation=conversation).count(), 6)

    def test_a_server_stopping_finishes_its_pending_writes(self) -> None:
        conversation, second = self.first_exchange()
        self.gateway.fake.push(Step.reply("Second part done."))
        server = self.gateway.server
        assert server is not None
        with writes_held(conversation):
            self.post(second)
            server.terminate()  # SIGTERM: uvicorn's graceful stop
            time.sleep(1.0)
            self.assertIsNone(server.poll(), "the server stopped with a write pending")
        server.wait(30)
        self.gateway.server = None
        self.assertEqual(self.texts(conversation)[-1], "Second part done.")
        self.assertEqual(Message.objects.filter(conversation=conversation).count(), 4)

    def test_a_server_killed_before_its_write_loses_nothing_the_next_request_carries(
        self,
    ) -> None:
        conversation, second = self.first_exchange()
        self.gateway.fake.push(Step.reply("Second part done."))
        with writes_held(conversation):
            answer = self.post(second)
            self.gateway.kill()
        self.assertEqual(Message.objects.filter(conversation=conversation).count(), 2)
        # The harness holds the answer; its next request carries it, and lands whole.
        self.gateway.serve()
        self.gateway.fake.push(Step.reply("Third done."))
        third = [
            *second,
            {"role": "assistant", "content": answer["content"]},
            {"role": "user", "content": "Third."},
        ]
        self.post(third)
        self.gateway.settle()
        self.assertEqual(len(self.texts(conversation)), 6)
        self.assertEqual(Message.objects.filter(conversation=conversation).count(), 6)

    def test_the_status_endpoint_needs_the_token_and_a_sane_wait(self) -> None:
        status, raw, _ = self.gateway.call("GET", "/gateway/status")
        self.assertEqual(status, 401, raw)
        self.assertEqual(json.loads(raw)["error"]["type"], "authentication_error")
        for wait in ("soon", "-1", "nan", "31", "inf"):
            with self.subTest(wait=wait):
                status, raw, _ = self.gateway.call(
                    "GET", f"/gateway/status?wait={wait}", headers=self.headers
                )
                self.assertEqual(status, 400, raw)
                self.assertIn("wait", json.loads(raw)["error"]["message"])
        self.assertEqual(self.pending(), 0)


class InlineWriteTests(TransactionTestCase):
    """Without the gateway's own database threads (ARBOR_GATEWAY_DB_THREADS=0) a view's
    sync work runs in Django's per-request thread context, which ends with the request:
    the exchange is written before the answer, and no thread or connection is left
    behind per request."""

    def test_the_exchange_is_in_the_tree_when_the_answer_arrives(self) -> None:
        gateway = LiveGateway(extra_env={"ARBOR_GATEWAY_DB_THREADS": "0"}).start()
        self.addCleanup(gateway.stop)
        assert gateway.server is not None
        descriptors = Path(f"/proc/{gateway.server.pid}/fd")
        headers = {"x-api-key": gateway.token}
        opened = 0
        for i in range(40):
            gateway.fake.push(Step.reply(f"answer {i}"))
            status, raw, _ = gateway.call(
                "POST",
                "/gateway/anthropic/v1/messages",
                request([{"role": "user", "content": f"task {i}"}]),
                headers=headers,
            )
            self.assertEqual(status, 200, raw)
            # No settle: it was written before the answer went out.
            conversation = Conversation.objects.get(owner=gateway.user, title=f"task {i}")
            self.assertEqual(conversation.tip.parts[0]["text"], f"answer {i}")
            if i == 4:
                opened = len(list(descriptors.iterdir()))
        self.assertLessEqual(len(list(descriptors.iterdir())) - opened, 5)


class IsolationTests(TransactionTestCase):
    def setUp(self) -> None:
        self.gateway = LiveGateway().start()
        self.addCleanup(self.gateway.stop)
        self.other = make_user("intruder")
        _, self.other_token = services.api_token_create(user=self.other, name="b")

    def test_another_users_token_never_reaches_a_gateway_conversation(self) -> None:
        metadata = {"user_id": json.dumps({"session_id": "shared-session-id"})}
        body = request(FIRST, metadata=metadata)
        status, _, _ = self.gateway.call(
            "POST",
            "/gateway/anthropic/v1/messages",
            body,
            headers={"x-api-key": self.gateway.token},
        )
        self.assertEqual(status, 200)
        self.gateway.settle()
        mine = Conversation.objects.get(owner=self.gateway.user)
        count = Message.objects.filter(conversation=mine).count()

        # Naming A's conversation in the header: refused like a missing one, before
        # anything goes upstream (on Arbor's key).
        forwarded = len(self.gateway.fake.requests)
        for header in (str(mine.pk), "00000000-0000-0000-0000-000000000000"):
            status, raw, _ = self.gateway.call(
                "POST",
                "/gateway/anthropic/v1/messages",
                body,
                headers={
                    "authorization": f"Bearer {self.other_token}",
                    "x-arbor-conversation": header,
                },
            )
            self.assertEqual(status, 404)
            self.assertEqual(json.loads(raw)["error"]["type"], "not_found_error")
        self.assertEqual(len(self.gateway.fake.requests), forwarded)
        # The same session id and the same content land in B's own conversation.
        status, _, _ = self.gateway.call(
            "POST",
            "/gateway/anthropic/v1/messages",
            body,
            headers={"x-api-key": self.other_token},
        )
        self.assertEqual(status, 200)
        self.gateway.settle(self.other_token)
        self.assertEqual(Message.objects.filter(conversation=mine).count(), count)
        theirs = Conversation.objects.get(owner=self.other)
        self.assertNotEqual(theirs.pk, mine.pk)
        # OpenAI's endpoint answers in its own shape.
        status, raw, _ = self.gateway.call(
            "POST",
            "/gateway/openai/v1/chat/completions",
            {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x"}]},
            headers={
                "authorization": f"Bearer {self.other_token}",
                "x-arbor-conversation": str(mine.pk),
            },
        )
        self.assertEqual(status, 404)
        self.assertIn("message", json.loads(raw)["error"])
