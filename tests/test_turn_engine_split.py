"""The turn engine against a scripted in-memory provider: the order of its events, how
its attempt ends (done, error, a closed stream), the last round's tool choice, and the
attempt services it records through.

The provider is swapped by setting ``turns.make_provider``, as the benches do: the engine
looks it up there when it opens the provider.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from types import GeneratorType
from typing import Any
from unittest import mock

from django.test import TestCase, TransactionTestCase, override_settings
from django.utils import timezone

from conversations import selectors, services, turns
from conversations.errors import InvalidInput, NotFound
from conversations.models import AttemptStatus, Conversation, Message, TurnAttempt
from conversations.providers import (
    ContextOverflow,
    Done,
    Reply,
    Request,
    StreamEvent,
    TextDelta,
    ToolCallStarted,
    Usage,
)
from conversations.providers.errors import RateLimited
from tests.builders import make_user, new_conversation, text

Step = list[StreamEvent] | Exception


class ScriptedProvider:
    """Answers each request with the next step of its script: stream events, or an
    exception raised before any event."""

    def __init__(self, *steps: Step) -> None:
        self.steps = list(steps)
        self.requests: list[Request] = []

    def __call__(self, spec: Any, **kwargs: Any) -> ScriptedProvider:
        return self  # stands in for make_provider

    def __enter__(self) -> ScriptedProvider:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def stream(self, request: Request) -> Iterator[StreamEvent]:
        self.requests.append(request)
        step = self.steps.pop(0)
        if isinstance(step, Exception):
            raise step
        yield from step


def answer(words: str) -> list[StreamEvent]:
    reply = Reply(parts=text(words), usage=Usage(input_tokens=10, output_tokens=2))
    return [TextDelta(words), Done(reply)]


def calculator_call(call_id: str = "c1") -> list[StreamEvent]:
    call = {
        "type": "tool_call",
        "id": call_id,
        "name": "calculator",
        "arguments": {"expression": "6*7"},
    }
    return [ToolCallStarted(0, call_id, "calculator"), Done(Reply(parts=[call]))]


class TurnEngineTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user()

    def setUp(self) -> None:
        self.conv, _ = new_conversation(self.user, "hello>hi")

    def run_turn(self, provider: ScriptedProvider, words: str = "go") -> list[dict[str, Any]]:
        with mock.patch.object(turns, "make_provider", provider):
            return list(turns.turn_events(conversation=self.conv, parts=text(words)))

    def attempt(self, events: list[dict[str, Any]]) -> TurnAttempt:
        return TurnAttempt.objects.get(pk=events[0]["attempt"])

    def test_it_runs_a_tool_round_then_answers_in_event_order(self) -> None:
        provider = ScriptedProvider(calculator_call(), answer("42"))
        events = self.run_turn(provider, "what is 6*7?")
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
        assert (
            attempt.status == AttemptStatus.COMPLETED
            and str(attempt.result_tip_id) == (done["tip"])
        )
        # The second request carried the turn so far; neither forbade tools.
        assert [r.tool_choice for r in provider.requests] == [None, None]
        assert "42" in str(provider.requests[1].messages)

    @override_settings(ARBOR_MAX_TOOL_ROUNDS=1)
    def test_the_last_round_lets_the_model_call_no_tool(self) -> None:
        provider = ScriptedProvider(calculator_call(), answer("done"))
        events = self.run_turn(provider)
        assert events[-1]["event"] == "done"
        assert [r.tool_choice for r in provider.requests] == [None, "none"]
        assert provider.requests[1].tools  # defined still: the history holds a call

    def test_a_provider_error_is_the_last_event_and_fails_the_attempt(self) -> None:
        before = Message.objects.count()
        events = self.run_turn(ScriptedProvider(RateLimited("slow down")))
        assert [e["event"] for e in events] == ["attempt", "error"]
        assert events[-1]["error"] == "rate_limited"
        attempt = self.attempt(events)
        assert attempt.status == AttemptStatus.FAILED and attempt.error_code == "rate_limited"
        assert Message.objects.count() == before

    def test_an_overflow_of_a_first_message_fails_without_compacting(self) -> None:
        conv = services.conversation_create(owner=self.user, title="empty")
        provider = ScriptedProvider(ContextOverflow(5000, 4000))
        with mock.patch.object(turns, "make_provider", provider):
            events = list(turns.turn_events(conversation=conv, parts=text("hi")))
        # Nothing archived to compact: no second request, and no "compacted" event.
        assert [e["event"] for e in events] == ["attempt", "error"]
        assert events[-1]["error"] == "context_overflow" and len(provider.requests) == 1

    def test_a_closed_stream_leaves_the_attempt_failed_as_interrupted(self) -> None:
        before = Message.objects.count()
        provider = ScriptedProvider(answer("never kept"))
        with mock.patch.object(turns, "make_provider", provider):
            events = turns.turn_events(conversation=self.conv, parts=text("go"))
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
