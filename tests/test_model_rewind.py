"""The model's own checkpoint and rewind during a run (DESIGN.md invariant 6).

The fake provider scripts the model: it labels the turn's starting boundary, explores
with several tool rounds, then rewinds with a digest. What the model is sent next, and
what the tree keeps, is checked on the fake's request log and in the database.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.test import Client, TestCase, TransactionTestCase

from conversations import selectors, services
from conversations.models import Checkpoint, Conversation, Message
from conversations.providers.fake import FakeLLMServer, Step
from conversations.turns import turn_run
from tests.builders import make_user, text
from tests.fake_models import child_env, serve_fake_models
from tests.live_server import READY_SECONDS

ROOT = Path(__file__).resolve().parent.parent
FAKE = FakeLLMServer(context_window=8000)
SECRET_RESULT = "exploration-result-{}"


@pytest.fixture(scope="module", autouse=True)
def fake_provider() -> Iterator[FakeLLMServer]:
    with serve_fake_models(FAKE, window=8000) as server:
        yield server


def calc(i: int) -> dict[str, Any]:
    # Each exploration step computes a distinctive number the test can look for.
    return {"name": "calculator", "arguments": {"expression": f"{1000 + i}*7"}, "id": f"x{i}"}


def api_conversation(client: Client, **extra: Any) -> Conversation:
    response = client.post(
        "/api/conversations", {"title": "agent run", **extra}, content_type="application/json"
    )
    assert response.status_code == 201, response.content
    return Conversation.objects.get(pk=response.json()["id"])


def chat(client: Client, conv: Conversation, words: str) -> Any:
    return client.post(
        f"/api/conversations/{conv.pk}/messages",
        {"parts": text(words), "model": "openai/test"},
        content_type="application/json",
    )


class ModelRewindTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user()
        _, cls.secret = services.api_token_create(user=cls.user, name="harness")

    def setUp(self) -> None:
        FAKE.clear()
        self.api = Client(HTTP_AUTHORIZATION=f"Bearer {self.secret}")
        self.conv = api_conversation(self.api)
        FAKE.push(Step.reply("Understood: find the bug."))
        first = chat(self.api, self.conv, "the task: find the bug")
        assert first.status_code == 201
        self.boundary = first.json()["tip"]

    def explore_and_rewind(self, label: str = "start", rewind_to: str = "start") -> Any:
        FAKE.push(
            Step.tools({"name": "checkpoint", "arguments": {"label": label}, "id": "cp"}),
            Step.tools(calc(1)),
            Step.tools(calc(2)),
            Step.tools(calc(3)),
            Step.tools(
                {
                    "name": "rewind",
                    "arguments": {
                        "label": rewind_to,
                        "digest": "The bug is in parse(): off by one.",
                    },
                    "id": "rw",
                }
            ),
            Step.reply("Fixed parse()."),
        )
        return chat(self.api, self.conv, "explore the code")

    def test_harness_conversations_offer_the_tools_and_browser_ones_can_switch(self) -> None:
        assert self.conv.checkpoint_tools is True
        FAKE.push(Step.reply("ok"))
        chat(self.api, self.conv, "hi")
        offered = {t["function"]["name"] for t in FAKE.requests[-1].body["tools"]}
        assert {"checkpoint", "rewind"} <= offered
        response = self.api.patch(
            f"/api/conversations/{self.conv.pk}",
            {"checkpoint_tools": False},
            content_type="application/json",
        )
        assert response.json()["checkpoint_tools"] is False
        FAKE.push(Step.reply("ok"))
        chat(self.api, self.conv, "hi again")
        offered = {t["function"]["name"] for t in FAKE.requests[-1].body["tools"]}
        assert not {"checkpoint", "rewind"} & offered

    def test_the_request_after_a_rewind_holds_the_digest_not_the_exploration(self) -> None:
        response = self.explore_and_rewind()
        assert response.status_code == 201, response.content
        requests = FAKE.requests
        assert len(requests) == 1 + 6
        before_rewind, after_rewind = requests[-2].body, requests[-1].body
        # While exploring, the model saw its tool results ...
        assert "7021" in json.dumps(before_rewind)  # 1003*7
        # ... after the rewind it sees the head, the checkpoint's message and the digest.
        sent = json.dumps(after_rewind["messages"])
        assert "The bug is in parse(): off by one." in sent
        assert "the task: find the bug" in sent and "Understood: find the bug." in sent
        for value in ("7007", "7014", "7021", "explore the code"):
            assert value not in sent, value
        assert len(json.dumps(after_rewind)) < len(json.dumps(before_rewind))

    def test_the_tree_keeps_the_whole_exploration(self) -> None:
        response = self.explore_and_rewind()
        tip = Message.objects.get(pk=response.json()["tip"])
        assert tip.parts == text("Fixed parse().")
        digest = tip.parent
        assert digest.origin == "digest" and str(digest.parent_id) == self.boundary
        abandoned_tip = Message.objects.get(pk=digest.metadata["abandoned_tip"])
        path = selectors.message_path(conversation_id=self.conv.pk, tip_id=abandoned_tip.id)
        roles = [m.role for m in path]
        assert roles[2:] == ["user"] + ["assistant", "tool"] * 5
        assert "7021" in json.dumps([m.parts for m in path])
        # The abandoned branch ends on the rewind's own (paired) result.
        assert abandoned_tip.parts[0]["call_id"] == "rw"
        checkpoint = Checkpoint.objects.get(conversation=self.conv, label="start")
        assert checkpoint.source == "model" and str(checkpoint.message_id) == self.boundary
        assert checkpoint.digest_message_id == digest.id

    def test_checkpoint_reports_the_message_it_labelled(self) -> None:
        self.explore_and_rewind()
        result = FAKE.requests[2].body["messages"][-1]
        assert result["role"] == "tool"
        assert self.boundary in result["content"]

    def test_reusing_a_live_label_is_a_tool_error(self) -> None:
        services.checkpoint_create(conversation=self.conv, label="start")
        FAKE.push(
            Step.tools({"name": "checkpoint", "arguments": {"label": "start"}, "id": "cp"}),
            Step.reply("noted"),
        )
        response = chat(self.api, self.conv, "label again")
        assert response.status_code == 201
        tool_message = FAKE.requests[-1].body["messages"][-1]
        assert "label_taken" in tool_message["content"]

    def test_an_unknown_label_is_a_tool_error_and_nothing_moves(self) -> None:
        response = self.explore_and_rewind(rewind_to="nowhere")
        assert response.status_code == 201, response.content
        rewind_result = FAKE.requests[-1].body["messages"][-1]
        assert "unknown_checkpoint" in rewind_result["content"]
        # The turn was persisted normally, on the same branch, with the exploration.
        tip = Message.objects.get(pk=response.json()["tip"])
        assert tip.parts == text("Fixed parse().")
        assert not Message.objects.filter(conversation=self.conv, origin="digest").exists()
        path = selectors.message_path(conversation_id=self.conv.pk, tip_id=tip.id)
        assert str(path[1].id) == self.boundary and len(path) == 2 + 1 + 2 * 5 + 1

    def test_a_dropped_label_is_a_tool_error_and_nothing_moves(self) -> None:
        checkpoint = services.checkpoint_create(conversation=self.conv, label="old")
        services.checkpoint_drop(checkpoint=checkpoint, reason="trimmed on resume")
        response = self.explore_and_rewind(rewind_to="old")
        assert response.status_code == 201
        rewind_result = FAKE.requests[-1].body["messages"][-1]
        assert "checkpoint_dropped" in rewind_result["content"]
        assert "trimmed on resume" in rewind_result["content"]
        checkpoint.refresh_from_db()
        assert checkpoint.state == "dropped" and str(checkpoint.message_id) == self.boundary
        assert not Message.objects.filter(conversation=self.conv, origin="digest").exists()


@pytest.mark.slow  # chaos: a child killed mid-turn
class ModelRewindCrashTests(TransactionTestCase):
    def test_a_label_survives_a_kill_between_checkpoint_and_rewind(self) -> None:
        FAKE.clear()
        user = make_user("agent")
        conv = services.conversation_create(owner=user, title="run", checkpoint_tools=True)
        FAKE.push(Step.reply("Task noted."))
        first = turn_run(conversation=conv, parts=text("the task"), model="openai/test")
        ready = Path(tempfile.mkdtemp()) / "ready"
        FAKE.push(
            Step.tools({"name": "checkpoint", "arguments": {"label": "safe"}, "id": "cp"}),
            Step.tools({"name": "block", "arguments": {}, "id": "b1"}),
        )
        child = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "turn_child.py"), str(conv.pk),
             "openai/test", "explore", "--block-tool", str(ready)],
            env=child_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        deadline = time.monotonic() + READY_SECONDS  # the child starts Django first
        while not ready.exists():
            assert child.poll() is None, child.stderr.read().decode()
            assert time.monotonic() < deadline, "the child never reached the tool"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        # Start again: the label is where the model attached it.
        checkpoint = Checkpoint.objects.get(conversation=conv, label="safe")
        assert checkpoint.message_id == first.tip and checkpoint.state == "live"
        conv.refresh_from_db()
        assert conv.tip_id == first.tip  # the killed turn left nothing else
        FAKE.push(
            Step.tools(
                {"name": "rewind", "arguments": {"label": "safe", "digest": "dead end"}, "id": "r"}
            ),
            Step.reply("Back on track."),
        )
        outcome = turn_run(conversation=conv, parts=text("carry on"), model="openai/test")
        tip = Message.objects.get(pk=outcome.tip)
        assert tip.parts == text("Back on track.")
        assert tip.parent.origin == "digest" and tip.parent.parent_id == first.tip


class TreeMapMarksTests(TestCase):
    def test_the_tree_map_marks_model_labels_and_each_rewind(self) -> None:
        user = make_user("viewer")
        conv = services.conversation_create(owner=user, title="run", checkpoint_tools=True)
        services.turn_append(
            conversation=conv,
            parent_id=None,
            expected_version=0,
            messages=[
                {"role": "user", "parts": text("task")},
                {"role": "assistant", "parts": text("ok")},
            ],
        )
        conv.refresh_from_db()
        services.checkpoint_create(conversation=conv, label="base", source="model")
        services.turn_append(
            conversation=conv,
            parent_id=conv.tip_id,
            expected_version=None,
            messages=[{"role": "user", "parts": text("explore")}],
        )
        conv.refresh_from_db()
        explored_tip = conv.tip_id
        result = services.checkpoint_rewind(conversation=conv, label="base", digest="nothing there")
        self.client.force_login(user)
        body = self.client.get(f"/c/{conv.pk}/tree/").content.decode()
        assert "⚑ base (model)" in body
        assert "↶ rewind to ⚑ base" in body
        assert f'href="/c/{conv.pk}/?m={explored_tip}#msg-{explored_tip}"' in body
        assert f'id="node-{result.digest_message}"' in body
