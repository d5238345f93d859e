"""The turn engine against the loopback fake provider (real HTTP, a script of answers):
the order of its events, how its attempt ends (done, error, a closed stream), the last
round's tool choice, and the attempt services it records through."""

from __future__ import annotations

from datetime import timedelta
from types import GeneratorType
from typing import Any

from django.test import TestCase, TransactionTestCase, override_settings
from django.utils import timezone

from conversations import selectors, services, turns
from conversations.errors import InvalidInput, NotFound
from conversations.models import AttemptStatus, Conversation, Message, TurnAttempt
from conversations.providers.fake import FakeLLMServer, Step, openai_overflow
from tests.builders import make_user, new_conversation, text
from tests.fake_models import serve_fake_models

MODEL = "openai/test"
CALCULATOR = {"name": "calculator", "arguments": {"expression": "6*7"}, "id": "c1"}


class TurnEngineTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user()

    def setUp(self) -> None:
        self.conv, _ = new_conversation(self.user, "hello>hi")
        self.fake = self.enterContext(serve_fake_models(FakeLLMServer(), window=100_000))

    def run_turn(self, *steps: Step, words: str = "go") -> list[dict[str, Any]]:
        self.fake.push(*steps)
        return list(turns.turn_events(conversation=self.conv, parts=text(words), model=MODEL))

    def attempt(self, events: list[dict[str, Any]]) -> TurnAttempt:
        return TurnAttempt.objects.get(pk=events[0]["attempt"])

    def test_it_runs_a_tool_round_then_answers_in_event_order(self) -> None:
        events = self.run_turn(Step.tools(CALCULATOR), Step.reply("42"), words="what is 6*7?")
        assert [e["event"] for e in events] == [
            "attempt", "tool_call", "tool_result", "delta", "done"
        ]  # fmt: skip
        assert events[2] == {
            "event": "tool_result", "call_id": "c1", "name": "calculator", "is_error": False
        }  # fmt: skip
        done = events[-1]
        path = selectors.message_path(conversation_id=self.conv.pk, tip_id=done["tip"])
        assert [m.role for m in path[2:]] == ["user", "assistant", "tool", "assistant"]
        assert path[4].parts[0]["parts"] == text("42")
        assert done["message_ids"] == [str(m.id) for m in path[2:]]
        attempt = self.attempt(events)
        assert attempt.status == AttemptStatus.COMPLETED
        assert str(attempt.result_tip_id) == done["tip"]
        # The second request carried the turn so far; neither forbade tools.
        bodies = [r.body for r in self.fake.requests]
        assert [b.get("tool_choice") for b in bodies] == [None, None]
        assert "42" in str(bodies[1]["messages"])

    @override_settings(ARBOR_MAX_TOOL_ROUNDS=1)
    def test_the_last_round_lets_the_model_call_no_tool(self) -> None:
        events = self.run_turn(Step.tools(CALCULATOR), Step.reply("done"))
        assert events[-1]["event"] == "done"
        bodies = [r.body for r in self.fake.requests]
        assert [b.get("tool_choice") for b in bodies] == [None, "none"]
        assert bodies[1]["tools"]  # defined still: the history holds a call

    def test_a_provider_error_is_the_last_event_and_fails_the_attempt(self) -> None:
        before = Message.objects.count()
        # The SDK itself tries a 429 three times before it gives up.
        events = self.run_turn(*[Step.error(429, "slow down", retry_after=0)] * 3)
        assert [e["event"] for e in events] == ["attempt", "error"]
        assert events[-1]["error"] == "rate_limited"
        attempt = self.attempt(events)
        assert attempt.status == AttemptStatus.FAILED and attempt.error_code == "rate_limited"
        assert Message.objects.count() == before

    def test_an_overflow_of_a_first_message_fails_without_compacting(self) -> None:
        self.conv = services.conversation_create(owner=self.user, title="empty")
        events = self.run_turn(Step.error(400, body=openai_overflow(5000, 4000)), words="hi")
        # Nothing archived to compact: no second request, and no "compacted" event.
        assert [e["event"] for e in events] == ["attempt", "error"]
        assert events[-1]["error"] == "context_overflow" and len(self.fake.requests) == 1

    def test_a_closed_stream_leaves_the_attempt_failed_as_interrupted(self) -> None:
        before = Message.objects.count()
        self.fake.push(Step.reply("never kept"))
        events = turns.turn_events(conversation=self.conv, parts=text("go"), model=MODEL)
        assert isinstance(events, GeneratorType)
        first = next(events)
        assert next(events)["event"] == "delta"
        events.close()  # the client went away mid-answer
        attempt = TurnAttempt.objects.get(pk=first["attempt"])
        assert attempt.status == AttemptStatus.FAILED
        assert (attempt.error_code, attempt.error_text) == ("interrupted", "stream closed")
        assert Message.objects.count() == before

    def test_bad_input_on_a_retry_fails_its_attempt(self) -> None:
        retry = services.turn_attempt_start(
            conversation=self.conv, parent_id=None, input_parts=[], model="fake/demo"
        )
        with self.assertRaises(InvalidInput):
            list(turns.turn_events(conversation=self.conv, parts=[{"type": "nope"}], attempt=retry))
        retry.refresh_from_db()
        assert retry.status == AttemptStatus.FAILED and retry.error_code


class AttemptServiceTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user()

    def setUp(self) -> None:
        self.conv, self.nodes = new_conversation(self.user, "hello>hi")
        self.attempt = services.turn_attempt_start(
            conversation=self.conv,
            parent_id=self.conv.tip_id,
            input_parts=text("go"),
            model="fake/demo",
        )

    def test_it_starts_a_running_attempt_of_this_process(self) -> None:
        row = TurnAttempt.objects.get(pk=self.attempt.pk)
        assert row.status == AttemptStatus.RUNNING and row.worker
        assert row.parent_id == self.conv.tip_id and row.input_parts == text("go")
        assert not turns.attempt_is_stale(row)

    def test_a_heartbeat_writes_at_most_every_few_seconds(self) -> None:
        past = timezone.now() - timedelta(minutes=1)
        TurnAttempt.objects.filter(pk=self.attempt.pk).update(heartbeat_at=past)
        self.attempt.heartbeat_at = past
        with self.assertNumQueries(1):
            services.turn_attempt_heartbeat(attempt=self.attempt)
        with self.assertNumQueries(0):
            services.turn_attempt_heartbeat(attempt=self.attempt)
        assert TurnAttempt.objects.get(pk=self.attempt.pk).heartbeat_at > past

    def test_finish_records_the_end_and_cuts_the_code_to_its_column(self) -> None:
        services.turn_attempt_finish(
            attempt=self.attempt, status=AttemptStatus.FAILED, code="x" * 100, text="why"
        )
        row = TurnAttempt.objects.get(pk=self.attempt.pk)
        assert row.status == AttemptStatus.FAILED and row.error_code == "x" * 64
        assert row.error_text == "why" and row.finished_at is not None

    def test_rebase_makes_a_retry_continue_from_the_digest(self) -> None:
        digest = self.nodes["hello"].id
        services.turn_attempt_rebase(attempt=self.attempt, parent_id=digest)
        row = TurnAttempt.objects.get(pk=self.attempt.pk)
        assert row.parent_id == digest and row.input_parts == []


class AttemptStartRaceTests(TransactionTestCase):
    """Committed for real: the foreign key is checked when the insert commits."""

    def test_it_refuses_an_attempt_for_a_conversation_deleted_a_moment_ago(self) -> None:
        conv, _ = new_conversation(make_user())
        gone = Conversation(pk=conv.pk)
        services.conversation_delete(conversation=conv)
        with self.assertRaises(NotFound):
            services.turn_attempt_start(
                conversation=gone, parent_id=None, input_parts=[], model="m"
            )
        assert not TurnAttempt.objects.exists()
