"""Chat turns against the loopback fake provider over real HTTP, both protocols.

The fake (conversations.providers.fake) is a real HTTP server on 127.0.0.1; the engine
talks to it through the official SDKs, exactly as it would talk to a real provider.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from django.db import connection, connections
from django.test import Client, TestCase, TransactionTestCase
from django.test.utils import CaptureQueriesContext

from compaction.models import ModelCalibration
from conversations import selectors, services, turns
from conversations.models import Checkpoint, Conversation, Message, TurnAttempt
from conversations.providers.fake import FakeLLMServer, Step
from conversations.services import transcript_resume
from conversations.turns import attempt_is_stale
from tests.builders import make_user, new_conversation, text, tool_turn
from tests.fake_models import PROTOCOLS, child_env, serve_fake_models
from tests.live_server import READY_SECONDS

ROOT = Path(__file__).resolve().parent.parent
# Started (and stopped) by the module fixture below.
FAKE = FakeLLMServer(context_window=4000)


@pytest.fixture(scope="module", autouse=True)
def fake_provider() -> Iterator[FakeLLMServer]:
    with serve_fake_models(FAKE) as server:
        yield server


def sse_events(response: Any) -> list[tuple[str, dict[str, Any]]]:
    raw = b"".join(response.streaming_content).decode()
    events = []
    for block in raw.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((lines["event"], json.loads(lines["data"])))
    return events


class ChatTestCase(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user()
        _, cls.secret = services.api_token_create(user=cls.user, name="t")

    def setUp(self) -> None:
        FAKE.clear()
        self.api = Client(HTTP_AUTHORIZATION=f"Bearer {self.secret}")

    def chat(self, conv: Conversation, words: str, model: str, **extra: Any) -> Any:
        return self.api.post(
            f"/api/conversations/{conv.pk}/messages",
            {"parts": text(words), "model": model, **extra},
            content_type="application/json",
        )

    def path_roles(self, conv: Conversation) -> list[str]:
        conv.refresh_from_db()
        return [m.role for m in selectors.message_path(conversation_id=conv.pk, tip_id=conv.tip_id)]


@pytest.mark.parametrize("model", PROTOCOLS)
class TestTurnsBothProtocols:
    """The same behaviour through OpenAI chat completions and Anthropic messages."""

    @pytest.fixture(autouse=True)
    def _setup(self, db: Any) -> None:
        FAKE.clear()
        self.user = make_user("p")
        _, secret = services.api_token_create(user=self.user, name="t")
        self.api = Client(HTTP_AUTHORIZATION=f"Bearer {secret}")
        self.conv, _ = new_conversation(self.user, "hello>hi")

    def post(self, words: str, model: str, **extra: Any) -> Any:
        return self.api.post(
            f"/api/conversations/{self.conv.pk}/messages",
            {"parts": text(words), "model": model, **extra},
            content_type="application/json",
        )

    def test_it_runs_a_plain_turn_and_stores_measured_usage(self, model: str) -> None:
        FAKE.push(Step.reply("Jeju is an island."))
        response = self.post("where is jeju?", model)
        assert response.status_code == 201, response.content
        body = response.json()
        answer = Message.objects.get(pk=body["tip"])
        assert answer.parts == [{"type": "text", "text": "Jeju is an island."}]
        assert answer.metadata["usage"]["input_tokens"] > 0
        assert answer.metadata["usage"]["output_tokens"] > 0
        assert answer.parent.parts == text("where is jeju?")
        assert answer.parent.parent.parts == text("hi")  # continued from the tip
        # The model saw the whole path, in order.
        sent = FAKE.requests[-1].body["messages"]
        assert "hello" in json.dumps(sent) and "where is jeju?" in json.dumps(sent)
        attempt = TurnAttempt.objects.get(pk=body["attempt"])
        assert attempt.status == "completed" and attempt.result_tip_id == answer.id

    def test_it_streams_deltas_then_done(self, model: str) -> None:
        FAKE.push(Step.reply("one two three four"))
        response = self.post("count", model, stream=True)
        assert response.status_code == 200
        assert response["Content-Type"] == "text/event-stream"
        events = sse_events(response)
        kinds = [kind for kind, _ in events]
        assert kinds[0] == "attempt" and kinds[-1] == "done"
        deltas = [data["text"] for kind, data in events if kind == "delta"]
        assert len(deltas) > 1 and "".join(deltas) == "one two three four"
        done = events[-1][1]
        assert Message.objects.get(pk=done["tip"]).parts == text("one two three four")

    def test_two_tool_rounds_are_persisted_as_one_turn(self, model: str) -> None:
        FAKE.push(
            Step.tools({"name": "calculator", "arguments": {"expression": "6*7"}, "id": "c1"}),
            Step.tools({"name": "current_time", "arguments": {}, "id": "c2"}),
            Step.reply("42, and it is now."),
        )
        before = Message.objects.count()
        response = self.post("what is 6*7 and the time?", model)
        assert response.status_code == 201, response.content
        path = selectors.message_path(conversation_id=self.conv.pk, tip_id=response.json()["tip"])
        assert [m.role for m in path[2:]] == [
            "user", "assistant", "tool", "assistant", "tool", "assistant"
        ]  # fmt: skip
        calc = path[4].parts[0]
        assert calc["call_id"] == "c1" and calc["parts"] == text("42") and not calc["is_error"]
        assert Message.objects.count() == before + 6
        # The second and third requests carried the tool results back to the model.
        assert len(FAKE.requests) == 3
        assert "42" in json.dumps(FAKE.requests[1].body["messages"])

    def test_a_provider_500_is_retried(self, model: str) -> None:
        FAKE.push(Step.error(500, "upstream exploded"), Step.reply("fine now"))
        response = self.post("hi", model)
        assert response.status_code == 201, response.content
        assert len(FAKE.requests) == 2

    def test_a_429_waits_for_retry_after(self, model: str) -> None:
        FAKE.push(Step.error(429, "slow down", retry_after=1), Step.reply("thanks"))
        response = self.post("hi", model)
        assert response.status_code == 201, response.content
        first, second = FAKE.requests
        assert second.received_at - first.received_at >= 0.9

    def test_an_overflow_fails_the_attempt_and_writes_nothing(self, model: str) -> None:
        before = Message.objects.count()
        response = self.post("x " * 20000, model)
        assert response.status_code == 413, response.content
        body = response.json()
        assert body["error"] == "context_overflow"
        attempt = TurnAttempt.objects.get(pk=body["attempt"])
        assert attempt.status == "failed" and attempt.error_code == "context_overflow"
        assert Message.objects.count() == before


class TurnQueryCountTests(ChatTestCase):
    """A whole chat turn (attempt, path, calibration, transcript) costs a fixed number of
    queries however long the path is: the path is one recursive read, the turn one
    INSERT, and learning the calibration one guarded UPDATE."""

    # Inside a TestCase: the conversation read, the attempt INSERT (in a savepoint pair:
    # inside a caller's transaction), the path, the calibration read, its guarded
    # UPDATE; then the transcript transaction (a savepoint pair here, BEGIN and COMMIT
    # outside tests): the conversation locked with the parent's depth read, one INSERT,
    # the tip UPDATE, the attempt's end. 11 outside tests (bench_turns).
    QUERIES = 13

    def _turn_queries(self, conv: Conversation) -> int:
        turns.turn_run(conversation=conv, parts=text("warm up"), model="openai/test")
        conv.refresh_from_db()
        with CaptureQueriesContext(connection) as ctx:
            turns.turn_run(conversation=conv, parts=text("counted"), model="openai/test")
        # A calibration event is logged only when the factor moves by over 1% (see
        # calibration_observe): not part of every turn, so not counted.
        return sum("calibrationevent" not in q["sql"] for q in ctx.captured_queries)

    def test_a_turn_costs_the_same_queries_on_a_short_and_a_long_path(self) -> None:
        short = services.conversation_create(owner=self.user, title="short")
        long = services.conversation_create(owner=self.user, title="long")
        services.turn_append(
            conversation=long,
            parent_id=None,
            expected_version=None,
            messages=[
                {"role": "user" if i % 2 == 0 else "assistant", "parts": text(f"m{i}")}
                for i in range(60)
            ],
        )
        assert self._turn_queries(short) == self._turn_queries(long) == self.QUERIES


class TurnTransactionTests(TransactionTestCase):
    """Outside a test's wrapping transaction, the real commits of a turn: its attempt
    (before the provider is asked: a restart finds it) and its transcript, with the
    attempt's end and what the reply taught the estimator in the same transaction."""

    def test_a_turn_commits_its_attempt_then_its_transcript_and_nothing_else(self) -> None:
        user = make_user()
        conv = services.conversation_create(owner=user, title="commits")
        for words in ("one", "two"):  # the calibration row exists; its samples grow
            turns.turn_run(conversation=conv, parts=text(words), model="openai/test")
        before = ModelCalibration.objects.get()
        with CaptureQueriesContext(connection) as ctx:
            turns.turn_run(conversation=conv, parts=text("three"), model="openai/test")
        sql = [str(q["sql"]).lstrip() for q in ctx.captured_queries]
        # ("BEGIN IMMEDIATE" on SQLite: see arbor/env.py.)
        begins = [i for i, q in enumerate(sql) if q.startswith("BEGIN")]
        commits = [i for i, q in enumerate(sql) if q == "COMMIT"]
        assert len(begins) == len(commits) == 1, sql
        begin, commit = begins[0], commits[0]
        writes = ("INSERT", "UPDATE", "DELETE")
        outside = [q for i, q in enumerate(sql) if q.startswith(writes) and not begin < i < commit]
        assert len(outside) == 1 and "conversations_turnattempt" in outside[0], outside
        inside = sql[begin + 1 : commit]
        assert any('"compaction_modelcalibration"' in q and q.startswith("UPDATE") for q in inside)
        assert ModelCalibration.objects.get().samples == before.samples + 1

    def test_a_failed_second_round_still_learns_from_the_first(self) -> None:
        user = make_user()
        conv = services.conversation_create(owner=user, title="fails")
        FAKE.clear()
        FAKE.push(Step.tools({"name": "current_time", "arguments": {}, "id": "c1"}))
        FAKE.push(Step.error(400, "bad request"))
        with pytest.raises(turns.TurnFailed):
            turns.turn_run(conversation=conv, parts=text("what time"), model="openai/test")
        assert ModelCalibration.objects.get().samples == 1
        assert not Message.objects.filter(conversation=conv).exists()


class TurnCommitTests(ChatTestCase):
    def test_the_turn_and_its_attempts_completion_commit_together(self) -> None:
        """If recording the attempt as completed fails, the turn is not written either:
        a turn whose attempt looks interrupted would be run again by retry."""
        conv = services.conversation_create(owner=self.user, title="atomic")
        turns.turn_run(conversation=conv, parts=text("first"), model="openai/test")
        conv.refresh_from_db()
        tip, count = conv.tip_id, Message.objects.filter(conversation=conv).count()
        real = services.turn_attempt_finish

        def finish(**kwargs: Any) -> None:
            if kwargs.get("status") == "completed":
                raise RuntimeError("the attempt's row could not be written")
            real(**kwargs)

        with (
            mock.patch.object(services, "turn_attempt_finish", finish),
            pytest.raises(Exception),  # noqa: B017 - whatever the engine makes of it
        ):
            turns.turn_run(conversation=conv, parts=text("second"), model="openai/test")
        conv.refresh_from_db()
        assert conv.tip_id == tip
        assert Message.objects.filter(conversation=conv).count() == count
        assert (
            not TurnAttempt.objects.filter(conversation=conv, status="completed")
            .exclude(result_tip_id=tip)
            .exists()
        )


class RetryTests(ChatTestCase):
    def retry(self, conv_id: Any, client: Client | None = None) -> Any:
        return (client or self.api).post(f"/api/conversations/{conv_id}/retry")

    def test_nothing_loaded_for_a_missing_conversation(self) -> None:
        response = self.retry("6f1c1f7e-5b8e-4d43-9a55-000000000000")
        assert response.status_code == 404 and response.json()["error"] == "nothing_loaded"

    def test_nothing_loaded_for_an_empty_conversation_without_attempts(self) -> None:
        conv, _ = new_conversation(self.user)
        response = self.retry(conv.pk)
        assert response.status_code == 404 and response.json()["error"] == "nothing_loaded"

    def test_nothing_to_retry_after_a_completed_turn(self) -> None:
        conv, _ = new_conversation(self.user)
        FAKE.push(Step.reply("done"))
        assert self.chat(conv, "hi", "openai/test").status_code == 201
        response = self.retry(conv.pk)
        assert response.status_code == 409 and response.json()["error"] == "nothing_to_retry"

    def test_nothing_to_retry_for_a_transcript_without_attempts(self) -> None:
        conv, _ = new_conversation(self.user, "a>b")
        response = self.retry(conv.pk)
        assert response.status_code == 409 and response.json()["error"] == "nothing_to_retry"

    def test_a_failed_first_turn_is_retried_on_an_empty_transcript_after_a_restart(
        self,
    ) -> None:
        conv, _ = new_conversation(self.user)
        FAKE.push(Step.error(400, "model is sulking", body={"error": {"message": "nope"}}))
        failed = self.chat(conv, "first words", "openai/test")
        assert failed.status_code == 502, failed.content
        assert not Message.objects.filter(conversation=conv).exists()
        # A new client: nothing in memory survives, only the database.
        restarted = Client(HTTP_AUTHORIZATION=f"Bearer {self.secret}")
        FAKE.push(Step.reply("hello at last"))
        response = self.retry(conv.pk, restarted)
        assert response.status_code == 201, response.content
        assert self.path_roles(conv) == ["user", "assistant"]
        user_message = Message.objects.get(conversation=conv, role="user")
        assert user_message.parts == text("first words")
        retried = TurnAttempt.objects.get(pk=response.json()["attempt"])
        assert retried.retry_of_id == TurnAttempt.objects.get(status="failed").pk
        assert self.retry(conv.pk, restarted).json()["error"] == "nothing_to_retry"

    def test_bad_input_is_refused_before_any_attempt(self) -> None:
        conv, _ = new_conversation(self.user)
        response = self.api.post(
            f"/api/conversations/{conv.pk}/messages",
            {"parts": [{"type": "tool_call", "id": "x", "name": "y"}]},
            content_type="application/json",
        )
        assert response.status_code == 422
        assert not TurnAttempt.objects.exists()
        response = self.chat(conv, "hi", "nonsense-model")
        assert response.status_code == 422 and response.json()["error"] == "bad_model"
        # A real-looking id nobody configured (a costly model the keys might reach).
        response = self.chat(conv, "hi", "openai/o1-pro")
        assert response.status_code == 422 and response.json()["error"] == "bad_model"
        assert "not configured" in response.json()["detail"]
        assert not TurnAttempt.objects.exists()


class ResumeTrimTests(ChatTestCase):
    def test_a_turn_from_a_mid_turn_tip_sends_a_trimmed_transcript(self) -> None:
        conv, _ = new_conversation(self.user)
        result = services.turn_append(
            conversation=conv,
            parent_id=None,
            expected_version=0,
            messages=tool_turn("go"),
        )
        call_id = result.message_ids[1]
        conv.refresh_from_db()
        services.tip_move(conversation=conv, message_id=call_id, expected_version=conv.version)
        # An imported checkpoint sitting on the call (importers keep what files say).
        imported = Checkpoint.objects.create(
            conversation=conv, label="odd", message_id=call_id, source="user"
        )
        FAKE.push(Step.reply("ok"))
        response = self.chat(conv, "again", "openai/test")
        assert response.status_code == 201, response.content
        sent = FAKE.requests[-1].body["messages"]
        assert [m["role"] for m in sent] == ["user", "user"]
        assert "tool_calls" not in json.dumps(sent)
        imported.refresh_from_db()
        assert imported.state == "dropped" and imported.message_id == call_id
        assert "trimmed on resume" in imported.reason
        # The tree still holds the trimmed call.
        assert Message.objects.filter(pk=call_id).exists()

    def test_transcript_for_model_reports_what_it_trimmed(self) -> None:
        conv, _ = new_conversation(self.user)
        result = services.turn_append(
            conversation=conv,
            parent_id=None,
            expected_version=0,
            messages=tool_turn("go"),
        )
        messages, report = transcript_resume(conversation=conv, tip_id=result.message_ids[1])
        assert [m["role"] for m in messages] == ["user"]
        assert report.trimmed == [str(result.message_ids[1])]


@pytest.mark.slow  # chaos: child processes killed at random moments
class CrashTests(TransactionTestCase):
    """A turn run in a real subprocess and SIGKILLed mid-turn leaves the previous turn."""

    def setUp(self) -> None:
        FAKE.clear()
        self.user = make_user("crash")
        _, secret = services.api_token_create(user=self.user, name="t")
        self.api = Client(HTTP_AUTHORIZATION=f"Bearer {secret}")
        self.conv, _ = new_conversation(self.user, "plan a trip>sure")
        self.before = list(
            Message.objects.filter(conversation=self.conv).values_list("id", flat=True)
        )

    def spawn(self, *extra: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "turn_child.py"), str(self.conv.pk),
             "openai/test", "book the ferry", *extra],
            env=child_env(),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )  # fmt: skip

    def wait_for(self, condition: Any, what: str, child: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + READY_SECONDS  # the child starts Django first
        while not condition():
            if child.poll() is not None:
                raise AssertionError(f"child exited early: {child.stderr.read().decode()}")
            if time.monotonic() > deadline:
                child.kill()
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def assert_previous_turn_and_retry(self) -> None:
        # Exactly the previous turn: no message of the killed turn, no orphan.
        assert (
            list(Message.objects.filter(conversation=self.conv).values_list("id", flat=True))
            == self.before
        )
        self.conv.refresh_from_db()
        path = selectors.message_path(conversation_id=self.conv.pk, tip_id=self.conv.tip_id)
        assert [m.parts for m in path] == [text("plan a trip"), text("sure")]
        attempt = TurnAttempt.objects.get(conversation=self.conv)
        assert attempt.status == "running" and attempt_is_stale(attempt)
        FAKE.push(
            Step.tools({"name": "current_time", "arguments": {}, "id": "t1"}),
            Step.reply("Ferry booked."),
        )
        response = self.api.post(f"/api/conversations/{self.conv.pk}/retry")
        assert response.status_code == 201, response.content
        attempt.refresh_from_db()
        assert attempt.status == "failed" and attempt.error_code == "interrupted"
        path = selectors.message_path(conversation_id=self.conv.pk, tip_id=response.json()["tip"])
        assert [m.role for m in path] == [
            "user",
            "assistant",
            "user",
            "assistant",
            "tool",
            "assistant",
        ]
        assert path[2].parts == text("book the ferry")
        assert path[-1].parts == text("Ferry booked.")

    def test_killed_while_the_model_streams(self) -> None:
        FAKE.push(Step.stall("I am booking the ferry for", after=3, hang=60))
        child = self.spawn()
        self.wait_for(lambda: len(FAKE.requests) >= 1, "the streamed request", child)
        time.sleep(0.5)  # let the first deltas arrive
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        self.assert_previous_turn_and_retry()

    def test_killed_after_a_tool_call_before_its_result(self) -> None:
        ready = Path(tempfile.mkdtemp()) / "ready"
        FAKE.push(Step.tools({"name": "block", "arguments": {}, "id": "b1"}))
        child = self.spawn("--block-tool", str(ready))
        self.wait_for(ready.exists, "the tool to start", child)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        self.assert_previous_turn_and_retry()

    def test_killed_at_random_moments(self) -> None:
        """kill -9 at moments drawn over a whole turn (a tool call, its tool, a streamed
        answer): each run ends either exactly at the previous turn, then retried, or
        with the whole turn when the kill came after its commit; never in between."""
        rng = random.Random(20261202)
        outcomes = []
        for run in range(6):
            FAKE.clear()
            self.conv, _ = new_conversation(self.user, "plan a trip>sure")
            self.before = list(
                Message.objects.filter(conversation=self.conv).values_list("id", flat=True)
            )
            # About a second from the first request to the last byte.
            FAKE.push(
                Step(tool_calls=[{"name": "current_time", "arguments": {}, "id": f"t{run}"}],
                     delay=0.3),
                Step.reply("Ferry booked for the morning crossing. " * 6, delay=0.4),
            )  # fmt: skip
            child = self.spawn()
            self.wait_for(lambda: len(FAKE.requests) >= 1, "the first request", child)
            time.sleep(rng.uniform(0.0, 1.6))
            if child.poll() is None:
                child.send_signal(signal.SIGKILL)
            child.wait(10)
            # Whatever the moment, the database holds the previous turn or the whole new
            # one (a kill after the commit, before the process ended).
            committed = Message.objects.filter(conversation=self.conv).count() > len(self.before)
            if committed:
                self.conv.refresh_from_db()
                path = selectors.message_path(conversation_id=self.conv.pk, tip_id=self.conv.tip_id)
                assert [m.role for m in path] == [
                    "user", "assistant", "user", "assistant", "tool", "assistant",
                ]  # fmt: skip
                assert path[-1].parts == text("Ferry booked for the morning crossing. " * 6)
                attempt = TurnAttempt.objects.get(conversation=self.conv)
                assert attempt.status == "completed"
                assert self.api.post(f"/api/conversations/{self.conv.pk}/retry").status_code == 409
            else:
                FAKE.clear()  # the killed turn's unused script
                self.assert_previous_turn_and_retry()
            outcomes.append("whole" if committed else "killed")
        # The draws cover both sides of the commit (fixed seed: the same every run,
        # though where the commit falls depends on the machine).
        assert "killed" in outcomes, outcomes


class LeaseTests(TransactionTestCase):
    """A model silent past the stale limit is still a turn in progress: the running
    turn renews its lease on a timer, so a retry meanwhile is refused (never two answers
    to one prompt); once the turn ends, it is done."""

    def test_a_silent_model_keeps_its_turn_and_retry_waits(self) -> None:
        import threading

        from django.test import override_settings

        user = make_user("patient")
        with (
            serve_fake_models(FakeLLMServer()) as server,
            override_settings(ARBOR_ATTEMPT_STALE_SECONDS=1),
        ):
            conv = services.conversation_create(owner=user, title="slow", model="openai/test")
            server.push(Step.wait(3.0, "a slow answer"))
            events: list[Any] = []

            def run() -> None:
                try:
                    events.extend(turns.turn_events(conversation=conv, parts=text("hi")))
                finally:
                    connections.close_all()  # this thread's own (the test database drops)

            runner = threading.Thread(target=run)
            runner.start()
            try:
                deadline = time.monotonic() + READY_SECONDS
                while not TurnAttempt.objects.filter(conversation=conv).exists():
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                time.sleep(2.0)  # twice the stale limit, the model still silent
                with self.assertRaises(turns.TurnInProgress):
                    turns.retry_target(user=user, conversation_id=conv.pk)
            finally:
                runner.join(30)
        assert events[-1]["event"] == "done", events[-1]
        assert TurnAttempt.objects.filter(conversation=conv).count() == 1
        assert Message.objects.filter(conversation=conv, role="assistant").count() == 1
