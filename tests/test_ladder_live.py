"""The ladder through a live server, as a harness meets it: uvicorn (the `make run`
server, jobs on its worker thread), bearer-token HTTP, the loopback provider enforcing a
smaller window than declared. A GET of the context writes nothing; a turn that crosses
the threshold answers at once while its compaction runs after it; a turn built from
that record and then rejected by the provider recovers from the originals."""

from __future__ import annotations

import http.client
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from django.test import TransactionTestCase

from compaction.models import CompactionJob, CompactionRecord, JobState
from conversations import services
from conversations.models import Message
from conversations.providers.fake import FakeLLMServer, Step, count_openai_request
from tests.builders import grow, make_user, snapshot_page_blobs
from tests.fake_models import child_env
from tests.live_server import READY_SECONDS, free_port, start_uvicorn, stop

MODEL = "openai/vision-live"


class LiveLadderTests(TransactionTestCase):
    def setUp(self) -> None:
        self.fake = FakeLLMServer(context_window=12_000).start()
        self.addCleanup(self.fake.stop)
        models = Path(tempfile.mkdtemp()) / "models.json"
        spec = {
            "base_url": self.fake.openai_base_url,
            "context_window": 12_000,
            "max_output": 256,
            "vision": True,
        }
        models.write_text(json.dumps({"models": {MODEL: spec}}))
        self.port = free_port()
        env = dict(
            child_env(),
            ALLOWED_HOSTS="127.0.0.1",
            ARBOR_MODELS=str(models),
            OPENAI_API_KEY="sk-test",
            ARBOR_INPROCESS_JOBS="thread",
        )
        server = start_uvicorn(env, self.port, path="/api/conversations")
        self.addCleanup(stop, server)
        self.user = make_user("harness")
        _, self.secret = services.api_token_create(user=self.user, name="live")

    def call(self, method: str, path: str, body: Any = None, *, auth: bool = True) -> Any:
        client = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        headers = {"Content-Type": "application/json"}
        if auth:
            headers["Authorization"] = f"Bearer {self.secret}"
        client.request(method, path, body=json.dumps(body) if body else None, headers=headers)
        response = client.getresponse()
        raw = response.read()
        client.close()
        return response.status, raw

    def test_get_safe_turn_unblocked_and_recovery_from_the_originals(self) -> None:
        conv = services.conversation_create(owner=self.user, title="agent", model=MODEL)
        grow(conv, 30, result_chars=1200, error=True)  # eventful: only pages make room

        # 1. A GET reports the next request and writes nothing, calls nothing.
        status, raw = self.call("GET", f"/api/conversations/{conv.pk}/context")
        assert status == 200, raw
        looked = json.loads(raw)
        assert looked["record"] is None and looked["rungs"][-1]["rung"] == "snapshot"
        assert not CompactionRecord.objects.exists() and self.fake.requests == []

        # 2. A turn: its own request is compacted inline (a record), and it is answered;
        # the proactive job for the next request runs on the server's worker thread.
        self.fake.push(Step.reply("Looked at the logs. " * 30))
        status, raw = self.call(
            "POST", f"/api/conversations/{conv.pk}/messages", {"parts": [text("go on")]}
        )
        assert status == 201, raw
        first = json.loads(raw)
        record = CompactionRecord.objects.filter(conversation=conv).latest("created_at")
        assert "snapshot" in record.rung_names
        deadline = time.monotonic() + READY_SECONDS
        while CompactionJob.objects.filter(
            conversation=conv, state__in=[JobState.QUEUED, JobState.RUNNING]
        ).exists():
            assert time.monotonic() < deadline, "the proactive job never finished"
            time.sleep(0.2)
        assert not CompactionJob.objects.filter(conversation=conv, state=JobState.FAILED).exists()

        # 3. The provider enforces a little less than the request now built counts: it
        # rejects it, and the turn recovers from the originals, pages intact.
        status, raw = self.call("GET", f"/api/conversations/{conv.pk}/context")
        counted = count_openai_request(json.loads(raw)["request"])
        self.fake.context_window = counted - 20
        self.fake.clear()
        status, raw = self.call(
            "POST", f"/api/conversations/{conv.pk}/messages", {"parts": [text("and now?")]}
        )
        assert status == 201, raw
        log = self.fake.requests
        rejected = [r for r in log if r.status == 400]
        assert len(rejected) == 1, [(r.status, r.prompt_tokens) for r in log]
        retry = log[log.index(rejected[0]) + 1]
        assert retry.status == 200 and (retry.prompt_tokens or 0) <= counted - 20
        sent = json.dumps(retry.body["messages"])
        assert "data:image/png;base64," in sent  # the middle is still there, as pages
        pages = snapshot_page_blobs(conv)
        assert pages and not any(f"[image {sha}" in sent for sha in pages)
        assert json.dumps(rejected[0].body, sort_keys=True) != json.dumps(
            retry.body, sort_keys=True
        )
        # The turn landed on the tree below the previous one; the originals are intact.
        answer = Message.objects.get(pk=json.loads(raw)["tip"])
        assert answer.parent is not None and str(answer.parent.parent_id) == first["tip"]
        assert all("log line ok" in json.dumps(m.parts) for m in conv.messages.filter(role="tool"))


def text(words: str) -> dict[str, str]:
    return {"type": "text", "text": words}
