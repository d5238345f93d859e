"""Proactive compaction as a real Celery task: Redis broker, a real worker process.

CI runs Redis on 127.0.0.1:6379; there a missing Redis fails this test instead of
skipping it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import TransactionTestCase
from kombu import pools as kombu_pools

from arbor.celery import app as celery_app
from compaction import services as compaction_services
from compaction.models import CompactionJob, CompactionRecord
from conversations import services
from conversations.models import Conversation, ImportJob, Message
from conversations.providers.fake import FakeLLMServer, Step
from conversations.turns import turn_run
from tests.builders import grow, make_user, text
from tests.fake_models import child_env, serve_fake_models
from tests.live_server import READY_SECONDS
from tests.test_import_kill import chatgpt_export

WAIT = READY_SECONDS  # the ceiling on waiting for a worker to do its part
ROOT = Path(__file__).resolve().parent.parent
# One Redis database per test process: make test runs the suite in several (xdist).
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
BROKER = f"redis://127.0.0.1:6379/{14 - _WORKER % 10}"
FAKE = FakeLLMServer(context_window=4000)


def redis_available(url: str = BROKER) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
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
    @staticmethod
    def _use_broker(case: TransactionTestCase, url: str) -> None:
        """Send this test's tasks to ``url`` (restored after the test)."""
        # Only the two keys: updating with the whole saved conf also writes the old
        # setting names, which then shadow the new ones (the next test ran eagerly).
        conf = celery_app.conf
        saved = {"broker_url": conf.broker_url, "task_always_eager": conf.task_always_eager}
        celery_app.conf.update(broker_url=url, task_always_eager=False)
        case.addCleanup(celery_app.conf.update, saved)
        # Connections and producers are pooled per app and keep the broker they were made
        # with: start from fresh ones, and leave none behind for later tests.
        CeleryWorkerTests._reset_pools()
        case.addCleanup(CeleryWorkerTests._reset_pools)

    def setUp(self) -> None:
        self._use_broker(self, BROKER)
        self.worker = start_worker()
        self.addCleanup(stop, self.worker)

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
        wait_for(
            "the job to end", lambda: _state(job) in ("done", "failed"), self.worker, READY_SECONDS
        )
        job.refresh_from_db()
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
        # A session the real pi CLI wrote (tests/data/sessions): 9 messages.
        data = (Path(__file__).parent / "data" / "sessions" / "pi-parallel.jsonl").read_bytes()
        job = services.import_job_create(
            owner=user, upload=SimpleUploadedFile("session.jsonl", data), format="pi"
        )
        ended = ("done", "failed")
        wait_for(
            "the import to end", lambda: _import_state(job) in ended, self.worker, READY_SECONDS
        )
        job.refresh_from_db()
        assert job.state == "done", job.error
        assert job.conversations_done == 1 and job.messages_done == 9
        conversation_id = job.report["conversation_ids"][0]
        assert services.Message.objects.filter(conversation_id=conversation_id).count() == 9
        assert not job.upload  # the kept upload is removed once imported


def start_worker(
    *, pool: str = "solo", broker: str = BROKER, **env: str
) -> subprocess.Popen[bytes]:
    """A real Celery worker on ``broker``, in a session of its own (so that a test can
    kill it with its pool processes), with ``env`` added to the test's environment."""
    command = [
        sys.executable, "-m", "celery", "-A", "arbor", "worker", "--pool", pool,
        "--concurrency", "1", "--loglevel", "WARNING", "--without-heartbeat",
        "--without-gossip", "--without-mingle",
    ]  # fmt: skip
    return subprocess.Popen(
        command,
        cwd=ROOT,
        env={**child_env(), "CELERY_BROKER_URL": broker, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def stop(worker: subprocess.Popen[bytes]) -> None:
    if worker.poll() is None:
        os.killpg(worker.pid, signal.SIGKILL)
    worker.communicate(timeout=20)


def wait_for(what: str, check: Any, worker: subprocess.Popen[bytes] | None, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        dead = worker is not None and worker.poll() is not None
        if dead or time.monotonic() > deadline:
            output = ""
            if worker is not None:
                stop(worker)
                output = worker.communicate()[0].decode(errors="replace")
            raise AssertionError(f"timed out waiting for {what}; worker output:\n{output}")
        time.sleep(0.1)


def pool_children(worker: subprocess.Popen[bytes]) -> list[int]:
    listed = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(worker.pid)], capture_output=True, text=True
    ).stdout
    return [int(pid) for pid in listed.split()]


class JobScene(TransactionTestCase):
    """A conversation whose compaction needs a summary (the loopback provider can hold
    that call), and what every fault below must end in: the job done exactly once, one
    record, the originals untouched, no job left running or queued."""

    def setUp(self) -> None:
        CeleryWorkerTests._use_broker(self, BROKER)
        FAKE.clear()
        self.user = make_user("agent")
        self.conv = services.conversation_create(
            owner=self.user, title="long", model="openai/textonly"
        )
        # Failing tool results are eventful: elision cannot shrink them, and a text-only
        # model gets no pages, so the job must ask the model for a summary.
        grow(self.conv, 14, result_chars=1200, error=True)
        self.conv.refresh_from_db()
        self.originals = {
            m.pk: (m.parts, m.parent_id)
            for m in services.Message.objects.filter(conversation=self.conv)
        }

    def messages(self) -> dict[Any, Any]:
        rows = services.Message.objects.filter(conversation=self.conv)
        return {m.pk: (m.parts, m.parent_id) for m in rows}

    def enqueue(self) -> CompactionJob:
        assert self.conv.tip_id is not None
        job = compaction_services.job_enqueue(
            conversation=self.conv, anchor_id=self.conv.tip_id, model_id="openai/textonly",
            trigger="manual",
        )  # fmt: skip
        assert job is not None
        return job

    def summary_requests(self) -> int:
        return sum(1 for r in FAKE.requests if "summar" in json.dumps(r.body).lower())

    def assert_done_once(self, job: CompactionJob, attempts: int) -> None:
        job.refresh_from_db()
        assert job.state == "done", job.error
        assert job.attempts == attempts
        records = CompactionRecord.objects.filter(conversation=self.conv)
        assert [r.status for r in records] == ["ready"]
        assert job.record_id == records[0].pk
        assert "summary" in [r["rung"] for r in records[0].rungs]
        assert not CompactionJob.objects.filter(state__in=["queued", "running"]).exists()
        assert self.messages() == self.originals


@pytest.mark.slow  # chaos: workers and the broker killed
class WorkerDeathTests(JobScene):
    """kill -9 in the middle of a compaction job, held inside its summary call."""

    def test_a_pool_process_killed_mid_compaction(self) -> None:
        FAKE.push(Step.reply("Summary: the first try.", delay=120), Step.reply("Summary: done."))
        worker = start_worker(pool="prefork")
        self.addCleanup(stop, worker)
        job = self.enqueue()
        wait_for("the summary call", lambda: self.summary_requests() == 1, worker, READY_SECONDS)
        (child,) = pool_children(worker)
        os.kill(child, signal.SIGKILL)
        # The worker redelivers the task at once (acks_late, reject_on_worker_lost); the
        # new pool process takes the job from the dead one without waiting for its lease.
        wait_for("the job to end", lambda: _state(job) in ("done", "failed"), worker, READY_SECONDS)
        self.assert_done_once(job, attempts=2)
        assert worker.poll() is None

    def test_the_whole_worker_killed_mid_compaction(self) -> None:
        FAKE.push(Step.reply("Summary: the first try.", delay=120), Step.reply("Summary: done."))
        first = start_worker(pool="prefork")
        self.addCleanup(stop, first)
        job = self.enqueue()
        wait_for("the summary call", lambda: self.summary_requests() == 1, first, READY_SECONDS)
        stop(first)  # kill -9 of the worker and its pool process
        job.refresh_from_db()
        assert job.state == "running"
        # The next worker to start sweeps: the job's process is gone, so it runs again.
        second = start_worker(pool="prefork")
        self.addCleanup(stop, second)
        wait_for("the job to end", lambda: _state(job) in ("done", "failed"), second, READY_SECONDS)
        self.assert_done_once(job, attempts=2)


def _state(job: CompactionJob) -> str:
    return CompactionJob.objects.values_list("state", flat=True).get(pk=job.pk)


def _import_state(job: ImportJob) -> str:
    return ImportJob.objects.values_list("state", flat=True).get(pk=job.pk)


@pytest.mark.slow  # chaos: workers and the broker killed
class ImportWorkerDeathTests(TransactionTestCase):
    """kill -9 in the middle of a 400-conversation import: the job ends as interrupted,
    with what it kept, each kept conversation whole and nothing else written."""

    def setUp(self) -> None:
        CeleryWorkerTests._use_broker(self, BROKER)
        self.user = make_user("importer")

    def import_under_way(self, worker: subprocess.Popen[bytes]) -> ImportJob:
        job: ImportJob = services.import_job_create(
            owner=self.user, upload=SimpleUploadedFile("export.json", chatgpt_export(400))
        )
        wait_for(
            "the first conversations",
            lambda: ImportJob.objects.get(pk=job.pk).conversations_done >= 3,
            worker,
            READY_SECONDS,
        )
        return job

    def assert_interrupted_with_what_it_kept(
        self, job: ImportJob, worker: subprocess.Popen[bytes]
    ) -> None:
        wait_for("the job to end", lambda: _import_state(job) != "running",
                 worker, READY_SECONDS)  # fmt: skip
        job.refresh_from_db()
        assert job.state == "failed" and job.error.startswith("interrupted"), job.error
        kept = job.report["conversation_ids"]
        assert 3 <= len(kept) == job.conversations_done < 400
        assert f"after {len(kept)} conversations" in job.error
        counts = [Message.objects.filter(conversation_id=c).count() for c in kept]
        assert counts == [30] * len(kept)
        assert Conversation.objects.filter(owner=self.user).count() == len(kept)
        assert not job.upload

    def test_a_pool_process_killed_mid_import(self) -> None:
        worker = start_worker(pool="prefork")
        self.addCleanup(stop, worker)
        job = self.import_under_way(worker)
        (child,) = pool_children(worker)
        os.kill(child, signal.SIGKILL)
        # Redelivered at once; the new pool process ends the job, with what it kept.
        self.assert_interrupted_with_what_it_kept(job, worker)
        assert worker.poll() is None

    def test_the_whole_worker_killed_mid_import(self) -> None:
        first = start_worker(pool="prefork")
        self.addCleanup(stop, first)
        job = self.import_under_way(first)
        stop(first)  # kill -9 of the worker and its pool process
        assert ImportJob.objects.get(pk=job.pk).state == "running"
        # The next worker to start sweeps: the import's process is gone.
        second = start_worker(pool="prefork")
        self.addCleanup(stop, second)
        self.assert_interrupted_with_what_it_kept(job, second)


class PrivateRedis:
    """A Redis of the test's own on a free loopback port, without persistence, that the
    test may restart (CI's shared Redis is left alone)."""

    def __init__(self) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_for("redis", lambda: redis_available(self.url), None, 20)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.mark.slow  # chaos: workers and the broker killed
class BrokerRestartTests(JobScene):
    """A broker restarted without persistence forgets its queue: a queued job is sent
    again by the sweeper, and a running job finishes while the worker reconnects."""

    def setUp(self) -> None:
        if shutil.which("redis-server") is None:
            if os.environ.get("CI") == "true":
                pytest.fail("redis-server is not installed (CI must provide it)")
            pytest.skip("redis-server is not installed")
        self.redis = PrivateRedis()
        self.redis.start()
        self.addCleanup(self.redis.stop)
        super().setUp()
        CeleryWorkerTests._use_broker(self, self.redis.url)

    def test_a_queued_job_lost_with_the_broker_is_sent_again(self) -> None:
        FAKE.push(Step.reply("Summary: done."))
        job = self.enqueue()  # sent to the broker; no worker is running yet
        assert redis.Redis.from_url(self.redis.url).llen("celery") == 1
        self.redis.restart()
        assert redis.Redis.from_url(self.redis.url).llen("celery") == 0  # the send is lost
        time.sleep(1.2)
        worker = start_worker(broker=self.redis.url, ARBOR_JOB_REQUEUE_SECONDS="1")
        self.addCleanup(stop, worker)
        wait_for("the job to end", lambda: _state(job) in ("done", "failed"), worker, READY_SECONDS)
        self.assert_done_once(job, attempts=1)

    def test_a_job_running_through_a_broker_restart_finishes(self) -> None:
        FAKE.push(Step.reply("Summary: done.", delay=4))
        worker = start_worker(broker=self.redis.url)
        self.addCleanup(stop, worker)
        job = self.enqueue()
        wait_for("the summary call", lambda: self.summary_requests() == 1, worker, READY_SECONDS)
        self.redis.restart()
        wait_for("the job to end", lambda: _state(job) in ("done", "failed"), worker, READY_SECONDS)
        self.assert_done_once(job, attempts=1)
        # The worker is still there, back on the broker: the next job runs too.
        other = services.conversation_create(owner=self.user, title="next", model="openai/textonly")
        grow(other, 14, result_chars=1200, error=True)
        other.refresh_from_db()
        assert other.tip_id is not None
        FAKE.push(Step.reply("Summary: the next one."))
        second = compaction_services.job_enqueue(
            conversation=other, anchor_id=other.tip_id, model_id="openai/textonly",
            trigger="manual",
        )  # fmt: skip
        assert second is not None
        wait_for(
            "the next job", lambda: _state(second) in ("done", "failed"), worker, READY_SECONDS
        )
        assert _state(second) == "done"
