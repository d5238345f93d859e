"""Stop and follow a running turn (#15): Stop cuts the model's request, even a silent
one, and the turn is written with what streamed, marked ``stopped``, at a clean
boundary; a chat opened mid-answer shows the question and the answer so far and follows
it to its end.

TransactionTestCase: the turn's watcher thread reads the stop request on a connection
of its own, as it would from another process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from unittest import mock

from django.test import TransactionTestCase
from django.utils import timezone

from arbor.procs import process_identity
from conversations import selectors, services, turns
from conversations.models import AttemptStatus, Conversation, TurnAttempt
from conversations.parts import DraftMessage
from conversations.providers.fake import FakeLLMServer, RecordedRequest, Step
from conversations.resume import resume_view
from tests.builders import make_user, new_conversation, text
from tests.fake_models import serve_fake_models
from tests.live_server import READY_SECONDS

LONG = " ".join(f"word{i}" for i in range(400))


def wait_until(condition: Callable[[], bool], what: str, seconds: float = READY_SECONDS) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


class TurnInThread:
    """A turn's events consumed on a thread of its own, as a streaming request would."""

    def __init__(self, **kwargs: Any) -> None:
        self.events: list[dict[str, Any]] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(kwargs,), daemon=True)
        self.thread.start()

    def _run(self, kwargs: dict[str, Any]) -> None:
        from django.db import connections

        try:
            for event in turns.turn_events(**kwargs):
                self.events.append(event)
        except BaseException as exc:  # reported by join()
            self.error = exc
        finally:
            connections.close_all()

    def deltas(self) -> list[str]:
        return [e["text"] for e in self.events if e["event"] == "delta"]

    def join(self) -> dict[str, Any]:
        self.thread.join(30)
        assert not self.thread.is_alive(), "the turn did not end"
        assert self.error is None, self.error
        return self.events[-1]


class StopTests(TransactionTestCase):
    def setUp(self) -> None:
        self.fake = FakeLLMServer()
        self.models = serve_fake_models(self.fake)
        self.models.__enter__()
        self.addCleanup(self.models.__exit__, None, None, None)
        self.user = make_user("stopper")
        self.conv, self.nodes = new_conversation(self.user, "a>b")
        self.conv.model = "openai/test"
        self.conv.save()

    def last_request(self) -> RecordedRequest:
        return self.fake.requests[-1]

    def start(self, prompt: str = "Tell me a long story") -> TurnInThread:
        return TurnInThread(conversation=self.conv, parts=text(prompt))

    def assert_clean_boundary(self, conv: Conversation) -> None:
        """The transcript resumes without trimming or repairing anything."""
        path = selectors.message_path(conversation_id=conv.pk, tip_id=conv.tip_id)
        _, report = resume_view(list(path))
        assert not report.changed, report

    def test_stop_mid_answer_keeps_what_streamed_and_cuts_the_request(self) -> None:
        self.fake.push(Step.reply(LONG, pace=0.02))
        run = self.start()
        wait_until(lambda: len(run.deltas()) >= 5, "five words streamed")
        asked = turns.turn_stop(conversation=self.conv)
        done = run.join()

        assert done["event"] == "done" and done["stopped"] is True, done
        self.conv.refresh_from_db()
        answer = self.conv.tip
        assert answer.metadata == {"stopped": True}
        streamed = "".join(run.deltas())
        assert answer.parts == text(streamed), "the answer is exactly what the client saw"
        assert 5 <= len(streamed.split()) < 400
        assert answer.parent.parts == text("Tell me a long story")
        assert answer.parent.parent_id == self.nodes["b"].pk
        wait_until(lambda: self.last_request().cut, "the model's request cut")
        attempt = TurnAttempt.objects.get(pk=asked[0])
        assert attempt.status == AttemptStatus.COMPLETED and attempt.live == {}
        assert attempt.error_code == "stopped"
        self.assert_clean_boundary(self.conv)
        # A stopped turn is a completed one: nothing to retry, nothing to stop.
        with self.assertRaises(turns.NothingToRetry):
            turns.retry_target(user=self.user, conversation_id=self.conv.pk)
        with self.assertRaises(turns.NothingRunning):
            turns.turn_stop(conversation=self.conv)

    def test_stop_cuts_a_model_that_went_silent(self) -> None:
        # Three events, then nothing for a minute: the run is blocked reading the socket
        # and cannot look for a stop itself.
        self.fake.push(Step.stall("one two three four five six", after=3, hang=60))
        run = self.start()
        wait_until(lambda: len(run.deltas()) >= 1, "a word streamed")
        turns.turn_stop(conversation=self.conv)
        done = run.join()
        assert done["event"] == "done" and done["stopped"], done
        self.conv.refresh_from_db()
        assert self.conv.tip.parts == text("".join(run.deltas()))
        assert self.last_request().cut

    def test_stop_while_waiting_for_the_first_byte(self) -> None:
        self.fake.push(Step.wait(60, "too late"))
        run = self.start()
        wait_until(lambda: len(self.fake.requests) >= 1, "the request sent")
        turns.turn_stop(conversation=self.conv)
        done = run.join()
        assert done["stopped"], done
        self.conv.refresh_from_db()
        # The question stays; the answer is empty and marked.
        assert self.conv.tip.parts == text("")
        assert self.conv.tip.metadata == {"stopped": True}
        assert self.conv.tip.parent.parts == text("Tell me a long story")

    def test_stop_in_a_later_round_keeps_the_whole_rounds_before(self) -> None:
        self.fake.push(Step.tools({"name": "calculator", "arguments": {"expression": "6*7"}}))
        self.fake.push(Step.reply(LONG, pace=0.02))
        run = self.start("Compute, then explain at length")
        wait_until(lambda: len(run.deltas()) >= 3, "the second round streaming")
        turns.turn_stop(conversation=self.conv)
        done = run.join()
        assert done["stopped"], done
        self.conv.refresh_from_db()
        path = selectors.message_path(conversation_id=self.conv.pk, tip_id=self.conv.tip_id)
        roles = [m.role for m in path][-4:]
        assert roles == ["user", "assistant", "tool", "assistant"], roles
        assert path[-2].parts[0]["type"] == "tool_result"
        assert path[-1].metadata == {"stopped": True}
        self.assert_clean_boundary(self.conv)

    def test_a_tool_call_cut_short_is_not_kept(self) -> None:
        # The answer's text streams, then a tool call starts and the model goes silent:
        # the stopped answer keeps the words and drops the unfinished call.
        self.fake.push(
            Step(
                text="Let me look that up.",
                tool_calls=[{"name": "calculator", "arguments": {"expression": "1+1"}}],
                stall_after=8,
                hang=60,
            )
        )
        run = self.start()
        wait_until(lambda: any(e["event"] == "tool_call" for e in run.events), "a call began")
        turns.turn_stop(conversation=self.conv)
        run.join()
        self.conv.refresh_from_db()
        assert [p["type"] for p in self.conv.tip.parts] == ["text"]
        self.assert_clean_boundary(self.conv)

    def test_a_reloaded_chat_follows_the_running_turn_to_its_end(self) -> None:
        self.fake.push(Step.reply(LONG, pace=0.01))
        run = self.start()
        wait_until(lambda: len(run.deltas()) >= 3, "the answer streaming")
        attempt = TurnAttempt.objects.get(conversation=self.conv, status=AttemptStatus.RUNNING)
        followed = list(turns.turn_follow(attempt_id=attempt.pk))
        run.join()
        # The first event has the text so far, the next ones only what was added.
        assert "text" in followed[0] and all("append" in e for e in followed[1:-1]), followed
        live, text = [], ""
        for event in followed[:-1]:
            text = event["text"] if "text" in event else text + event["append"]
            live.append(text)
        assert len(live) >= 2, followed
        assert all(LONG.startswith(t) for t in live) and len(set(live)) == len(live)
        assert followed[-1] == {"event": "done", "attempt": str(attempt.pk), "stopped": False}

    def test_a_follower_sees_a_stop(self) -> None:
        self.fake.push(Step.reply(LONG, pace=0.02))
        run = self.start()
        wait_until(lambda: len(run.deltas()) >= 3, "the answer streaming")
        attempt = TurnAttempt.objects.get(conversation=self.conv, status=AttemptStatus.RUNNING)
        follower = turns.turn_follow(attempt_id=attempt.pk)
        assert next(follower)["event"] == "live"
        turns.turn_stop(conversation=self.conv, attempt_id=attempt.pk)
        rest = list(follower)
        run.join()
        assert rest[-1]["event"] == "done" and rest[-1]["stopped"] is True


class StopEndpointsTests(TransactionTestCase):
    """The chat's Stop form, the live page and the API's stop, without a model: the
    running turn is an attempt row a live process holds."""

    def setUp(self) -> None:
        self.user = make_user("owner")
        self.conv, self.nodes = new_conversation(self.user, "a>b")
        self.client.force_login(self.user)

    def running(self, *, parent: Any = None, live: dict[str, Any] | None = None) -> TurnAttempt:
        return TurnAttempt.objects.create(
            conversation=self.conv,
            parent=parent or self.nodes["b"],
            input_parts=text("What is the tallest tree?"),
            model="fake/demo",
            worker=process_identity(),
            live=live or {"text": "The tallest known tree is", "tools": ["search"]},
        )

    def test_a_chat_opened_mid_answer_shows_the_question_and_the_answer_so_far(self) -> None:
        attempt = self.running()
        page = self.client.get(f"/c/{self.conv.pk}/").content.decode()
        assert 'id="chat" class="streaming"' in page
        assert "What is the tallest tree?" in page
        assert "The tallest known tree is" in page and "⚙ search…" in page
        assert f'data-live-url="/c/{self.conv.pk}/live/{attempt.pk}/"' in page
        assert f'action="/c/{self.conv.pk}/stop/"' in page
        assert "The last turn failed" not in page

    def test_a_turn_on_another_branch_is_said_not_shown_below_this_one(self) -> None:
        self.running(parent=self.nodes["a"])
        page = self.client.get(f"/c/{self.conv.pk}/").content.decode()
        assert "A turn is running from an earlier message" in page
        # Not below this branch's last message, but followed, and stoppable.
        assert '<li class="msg assistant live" id="live-answer"' not in page
        assert 'class="notice running-elsewhere"' in page and 'id="live-answer"' in page
        assert 'id="chat" class="streaming"' in page

    def test_stop_form_and_api(self) -> None:
        attempt = self.running()
        response = self.client.post(f"/c/{self.conv.pk}/stop/", HTTP_ACCEPT="application/json")
        assert response.status_code == 202
        assert response.json() == {"stopping": [str(attempt.pk)]}
        attempt.refresh_from_db()
        assert attempt.stop_requested_at is not None
        page = self.client.get(f"/c/{self.conv.pk}/").content.decode()
        assert "Stopping…" in page
        # Without JavaScript: back to the chat.
        assert self.client.post(f"/c/{self.conv.pk}/stop/").status_code == 302
        # The API: the running one, by id.
        _, token = services.api_token_create(user=self.user, name="t")
        url = f"/api/conversations/{self.conv.pk}/stop?attempt={attempt.pk}"
        response = self.client.post(url, HTTP_AUTHORIZATION=f"Bearer {token}")
        assert response.status_code == 202, response.content
        assert response.json() == {"stopping": [str(attempt.pk)]}

    def test_nothing_running_is_a_409_naming_it(self) -> None:
        response = self.client.post(f"/c/{self.conv.pk}/stop/", HTTP_ACCEPT="application/json")
        assert response.status_code == 409
        assert response.json()["error"] == "nothing_running"
        # A turn whose process is gone is not running: retry offers it instead.
        TurnAttempt.objects.create(
            conversation=self.conv,
            parent=self.nodes["b"],
            input_parts=text("lost"),
            worker="elsewhere:999999999",
            heartbeat_at=timezone.now() - timedelta(hours=1),
        )
        response = self.client.post(f"/c/{self.conv.pk}/stop/", HTTP_ACCEPT="application/json")
        assert response.status_code == 409
        _, token = services.api_token_create(user=self.user, name="t")
        response = self.client.post(
            f"/api/conversations/{self.conv.pk}/stop", HTTP_AUTHORIZATION=f"Bearer {token}"
        )
        assert response.status_code == 409 and response.json()["error"] == "nothing_running"

    def test_a_turn_that_ends_as_stop_is_asked_is_not_marked(self) -> None:
        attempt = self.running()
        seen_running = TurnAttempt.objects.get(pk=attempt.pk)
        # It completes between stop's look and its write.
        services.turn_attempt_finish(attempt=attempt, status=AttemptStatus.COMPLETED)
        with (
            mock.patch.object(turns, "turn_running", return_value=[seen_running]),
            self.assertRaises(turns.NothingRunning),
        ):
            turns.turn_stop(conversation=self.conv)
        attempt.refresh_from_db()
        assert attempt.stop_requested_at is None
        # A stop asked as the last round ended: the answer is whole, and followers say so.
        TurnAttempt.objects.filter(pk=attempt.pk).update(stop_requested_at=timezone.now())
        (done,) = turns.turn_follow(attempt_id=attempt.pk)
        assert done == {"event": "done", "attempt": str(attempt.pk), "stopped": False}

    def test_a_stranger_can_neither_stop_nor_follow(self) -> None:
        attempt = self.running()
        stranger = make_user("stranger")
        self.client.force_login(stranger)
        assert self.client.post(f"/c/{self.conv.pk}/stop/").status_code == 404
        assert self.client.get(f"/c/{self.conv.pk}/live/{attempt.pk}/").status_code == 404
        _, token = services.api_token_create(user=stranger, name="t")
        response = self.client.post(
            f"/api/conversations/{self.conv.pk}/stop", HTTP_AUTHORIZATION=f"Bearer {token}"
        )
        assert response.status_code == 404
        attempt.refresh_from_db()
        assert attempt.stop_requested_at is None
        # Another conversation's attempt id under one's own conversation: 404 as well.
        mine, _ = new_conversation(stranger, "x")
        assert self.client.get(f"/c/{mine.pk}/live/{attempt.pk}/").status_code == 404
        assert self.client.get(f"/c/{mine.pk}/live/not-a-uuid/").status_code == 404

    def test_the_live_page_streams_the_running_turn_then_its_end(self) -> None:
        attempt = self.running()

        def finish() -> None:
            time.sleep(0.5)
            services.turn_attempt_finish(attempt=attempt, status=AttemptStatus.COMPLETED)

        threading.Thread(target=finish, daemon=True).start()
        response = self.client.get(f"/c/{self.conv.pk}/live/{attempt.pk}/")
        assert response["Content-Type"] == "text/event-stream"
        body = b"".join(response.streaming_content).decode()
        assert body.startswith("event: live\n")
        assert '"text": "The tallest known tree is"' in body
        assert "event: done" in body

    def test_a_stopped_answer_is_marked_in_the_chat(self) -> None:
        services.turn_append(
            conversation=self.conv,
            parent_id=self.nodes["b"].pk,
            expected_version=None,
            messages=[
                DraftMessage(role="user", parts=text("Go on"), metadata={}),
                DraftMessage(role="assistant", parts=text(""), metadata={"stopped": True}),
            ],
        )
        page = self.client.get(f"/c/{self.conv.pk}/").content.decode()
        assert 'class="badge stopped"' in page
        assert "Stopped before any answer arrived." in page
