"""Proactive compaction as a real Celery task: Redis broker, a real worker process.

CI runs Redis on 127.0.0.1:6379; there a missing Redis fails this test instead of
skipping it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import TransactionTestCase
from kombu import pools as kombu_pools

from arbor.celery import app as celery_app
from compaction.models import CompactionJob, CompactionRecord
from conversations import services
from conversations.providers.fake import FakeLLMServer, Step
from conversations.turns import turn_run
from tests.builders import grow, make_user, text
from tests.fake_models import child_env, serve_fake_models

ROOT = Path(__file__).resolve().parent.parent
BROKER = "redis://127.0.0.1:6379/14"
FAKE = FakeLLMServer(context_window=4000)


def redis_available() -> bool:
    try:
        return bool(redis.Redis.from_url(BROKER, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


@pytest.fixture(scope="module", autouse=True)
def broker() -> Iterator[None]:
    if not redis_available():
        if os.environ.get("CI") == "true":
            pytest.fail("Redis is not reachable on 127.0.0.1:6379 (CI must provide it)")
        pytest.skip("Redis is not running on 127.0.0.1:6379")
    redis.Redis.from_url(BROKER).flushdb()
    with serve_fake_models(FAKE):
        yield


class CeleryWorkerTests(TransactionTestCase):
    def setUp(self) -> None:
        saved = dict(celery_app.conf)
        celery_app.conf.update(broker_url=BROKER, task_always_eager=False)
        self.addCleanup(celery_app.conf.update, saved)
        # Connections and producers are pooled per app and keep the broker they were made
        # with: start from fresh ones, and leave none behind for later tests.
        self._reset_pools()
        self.addCleanup(self._reset_pools)
        env = dict(child_env(), CELERY_BROKER_URL=BROKER)
        self.worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "arbor", "worker", "--pool", "solo",
             "--concurrency", "1", "--loglevel", "WARNING", "--without-heartbeat",
             "--without-gossip", "--without-mingle"],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.addCleanup(self.worker.wait, 20)
        self.addCleanup(self.worker.terminate)

    @staticmethod
    def _reset_pools() -> None:
        kombu_pools.reset()  # kombu keeps producer pools per connection, process-wide
        celery_app._pool = None
        celery_app.amqp._producer_pool = None

    def test_a_turn_over_the_threshold_is_compacted_by_a_worker(self) -> None:
        user = make_user("agent")
        conv = services.conversation_create(owner=user, title="long", model="openai/textonly")
        grow(conv, 10)  # ten turns, each reading a long, uneventful tool result
        FAKE.push(Step.reply("All steps done. " * 40))
        # This turn's request fits; with its long answer, the next one would not.
        question = "Summarise the progress so far, considering these notes. " * 24
        outcome = turn_run(conversation=conv, parts=text(question))
        job = CompactionJob.objects.get(conversation=conv)
        assert job.anchor_id == outcome.tip and job.trigger == "proactive"
        deadline = time.monotonic() + 90
        while True:
            job.refresh_from_db()
            if job.state in ("done", "failed"):
                break
            if self.worker.poll() is not None or time.monotonic() > deadline:
                self.worker.kill()  # so that reading its output cannot block
                output = self.worker.communicate(timeout=10)[0].decode()
                raise AssertionError(f"the worker did not finish the job ({job.state}): {output}")
            time.sleep(0.2)
        assert job.state == "done", job.error
        assert job.attempts == 1
        assert job.record_id is not None
        record = CompactionRecord.objects.get(pk=job.record_id)
        assert record.status == "ready" and record.trigger == "proactive"
        assert record.anchor_id == outcome.tip
        assert record.rungs[0]["rung"] == "elision"
        assert record.tokens_after < record.tokens_before
        # The originals are untouched and reachable from every placeholder.
        placeholders = [
            p["parts"][0]["text"]
            for m in record.view
            for p in m["parts"]
            if p.get("type") == "tool_result" and "elided tool result" in p["parts"][0]["text"]
        ]
        assert placeholders
        assert all(services.Message.objects.filter(pk=t.split()[3].rstrip(":")).exists()
                   for t in placeholders)  # fmt: skip

    def test_an_uploaded_transcript_is_imported_by_a_worker(self) -> None:
        user = make_user("importer")
        sample = Path(__file__).resolve().parents[2] / "shared" / "samples" / "pi"
        data = (sample / "pi-mono__compact.jsonl").read_bytes()
        job = services.import_job_create(
            owner=user, upload=SimpleUploadedFile("session.jsonl", data), format="pi"
        )
        deadline = time.monotonic() + 120
        while True:
            job.refresh_from_db()
            if job.state in ("done", "failed"):
                break
            if self.worker.poll() is not None or time.monotonic() > deadline:
                self.worker.kill()
                output = self.worker.communicate(timeout=10)[0].decode()
                raise AssertionError(
                    f"the worker did not finish the import ({job.state}): {output}"
                )
            time.sleep(0.2)
        assert job.state == "done", job.error
        assert job.conversations_done == 1 and job.messages_done == 1007
        conversation_id = job.report["conversation_ids"][0]
        assert services.Message.objects.filter(conversation_id=conversation_id).count() == 1007
        assert not job.upload  # the kept upload is removed once imported
