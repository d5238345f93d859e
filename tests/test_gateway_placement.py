"""Placing a gateway request reads the rows of the wanted keys, not the conversation.

A harness resends its whole session with every request; the gateway finds where the
stored path ends by the request's chain keys. On SQLite (no ANALYZE statistics) a filter
on a list of conversation ids made the planner read every message of the conversation
through its conversation index, so each request cost more as the session grew.
"""

from __future__ import annotations

from typing import Any

from django.db import connection
from django.test import TestCase
from django.test.utils import CaptureQueriesContext

from conversations.gateway import services
from conversations.models import Conversation, Message
from tests.builders import make_user


def _exchange(messages: list[dict[str, Any]], session: str = "") -> services.Exchange:
    body = {"model": "claude-sonnet-4-5", "max_tokens": 10, "messages": messages}
    headers = {"x-session-id": session} if session else {}
    return services.exchange_read(
        protocol="anthropic",
        body=body,
        wire_messages=messages,
        system="You are a test agent.",
        tools=[],
        headers=headers,
    )


def _session(rounds: int, task: str) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Start {task}."}]
    for i in range(rounds):
        messages.append({"role": "assistant", "content": f"Step {i}."})
        messages.append({"role": "user", "content": f"Go on after {i}."})
    return messages


class PlacementTests(TestCase):
    def setUp(self) -> None:
        self.user = make_user("placer")

    def _placed(
        self, messages: list[dict[str, Any]], session: str
    ) -> tuple[services.Exchange, services.Placement]:
        exchange = _exchange(messages, session)
        return exchange, services.placement_find(
            user=self.user, exchange=exchange, conversation_id=None
        )

    def _stored(self, messages: list[dict[str, Any]], session: str = "") -> Any:
        exchange = _exchange(messages, session)
        placement = services.placement_find(user=self.user, exchange=exchange, conversation_id=None)
        services.exchange_store(
            placement=placement,
            exchange=exchange,
            answer={"role": "assistant", "content": "Done."},
        )
        return placement.conversation

    def test_a_continued_request_is_placed_after_the_stored_answer(self) -> None:
        for session in ("", "s-1"):
            with self.subTest(session=session):
                messages = _session(20, f"task {session}")
                conversation = self._stored(messages, session)
                more = [
                    *messages,
                    {"role": "assistant", "content": "Done."},
                    {"role": "user", "content": "Next."},
                ]
                placement = services.placement_find(
                    user=self.user, exchange=_exchange(more, session), conversation_id=None
                )
                self.assertEqual(placement.conversation.pk, conversation.pk)
                self.assertEqual(placement.matched, len(more) - 1)
                conversation.refresh_from_db()
                self.assertEqual(placement.parent_id, conversation.tip_id)

    def test_the_placement_query_searches_the_key_index(self) -> None:
        if connection.vendor != "sqlite":
            self.skipTest("the plan checked is SQLite's (PostgreSQL plans from statistics)")
        for session in ("", "s-2"):
            with self.subTest(session=session):
                messages = _session(150, f"long task {session}")
                self._stored(messages, session)
                more = [*messages, {"role": "assistant", "content": "Done."}]
                with CaptureQueriesContext(connection) as queries:
                    services.placement_find(
                        user=self.user, exchange=_exchange(more, session), conversation_id=None
                    )
                table = f'FROM "{Message._meta.db_table}"'
                reads = [q["sql"] for q in queries.captured_queries if table in q["sql"]]
                self.assertTrue(reads)
                for sql in reads:
                    with connection.cursor() as cursor:
                        cursor.execute(f"EXPLAIN QUERY PLAN {sql}")
                        plan = " | ".join(str(row[-1]) for row in cursor.fetchall())
                    self.assertIn("msg_gateway_key", plan, plan)

    def test_a_request_placed_before_the_previous_answer_was_written_writes_nothing_twice(
        self,
    ) -> None:
        # The gateway writes an exchange behind its answer; another server process may
        # place the harness's next request before that write commits. The stale
        # placement is caught up when the next exchange is written.
        first = [{"role": "user", "content": "Start the stale task."}]
        exchange, placement = self._placed(first, "s-3")
        conversation = placement.conversation
        answer = {"role": "assistant", "content": "First answer."}
        second = [*first, answer, {"role": "user", "content": "And then?"}]
        later, stale = self._placed(second, "s-3")
        self.assertEqual((stale.conversation.pk, stale.matched), (conversation.pk, 0))

        services.exchange_store(placement=placement, exchange=exchange, answer=answer)
        # The conversation's lock, the catch-up read, the insert and the tip move, in one
        # transaction (here a savepoint and its release, inside the test's own).
        with self.assertNumQueries(6):
            services.exchange_store(
                placement=stale,
                exchange=later,
                answer={"role": "assistant", "content": "Then this."},
            )
        rows = list(Message.objects.filter(conversation=conversation).order_by("depth"))
        self.assertEqual(
            [m.parts[0]["text"] for m in rows],
            ["Start the stale task.", "First answer.", "And then?", "Then this."],
        )
        self.assertEqual([m.parent_id for m in rows[1:]], [m.pk for m in rows[:-1]])
        conversation.refresh_from_db()
        self.assertEqual(conversation.tip_id, rows[-1].pk)

    def test_a_write_that_comes_after_the_next_exchange_adds_nothing_and_keeps_the_tip(
        self,
    ) -> None:
        # Request A's write is late (another process stored the harness's next request
        # B, which carries A's answer, first): A's answer is not written twice and the
        # tip stays at B's end.
        first = [{"role": "user", "content": "Start the late task."}]
        a, a_place = self._placed(first, "s-4")
        conversation = a_place.conversation
        answer = {"role": "assistant", "content": "A's answer."}
        b, b_place = self._placed([*first, answer, {"role": "user", "content": "Go on."}], "s-4")
        b_tip = services.exchange_store(
            placement=b_place, exchange=b, answer={"role": "assistant", "content": "B's answer."}
        )
        stored = services.exchange_store(placement=a_place, exchange=a, answer=answer)
        rows = list(Message.objects.filter(conversation=conversation).order_by("depth"))
        self.assertEqual(
            [m.parts[0]["text"] for m in rows],
            ["Start the late task.", "A's answer.", "Go on.", "B's answer."],
        )
        self.assertEqual(stored, rows[1].pk)
        conversation.refresh_from_db()
        self.assertEqual(conversation.tip_id, b_tip)

    def test_the_same_request_answered_the_same_way_again_moves_the_tip_to_that_answer(
        self,
    ) -> None:
        messages = [{"role": "user", "content": "Say the same thing twice."}]
        answer = {"role": "assistant", "content": "The same thing."}
        conversation = self._stored(messages, "s-5")  # answered "Done." first
        exchange, first = self._placed(messages, "s-5")
        same = services.exchange_store(placement=first, exchange=exchange, answer=answer)
        # The harness went back to the other answer's branch meanwhile.
        done = Message.objects.get(conversation=conversation, parts__0__text="Done.")
        Conversation.objects.filter(pk=conversation.pk).update(tip_id=done.pk)
        exchange, again = self._placed(messages, "s-5")
        self.assertEqual(
            services.exchange_store(placement=again, exchange=exchange, answer=answer), same
        )
        # Two answers (siblings), not three; the tip on the newest exchange's answer.
        self.assertEqual(Message.objects.filter(conversation=conversation).count(), 3)
        conversation.refresh_from_db()
        self.assertEqual(conversation.tip_id, same)
