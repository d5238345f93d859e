"""A server killed mid-job leaves jobs no one would run (without a broker they run on a
thread of the web process). When the next server starts, it picks them up: a job still
"running" under a process that is gone, a job queued past the requeue time, and an
import whose process died (ended as interrupted, with what it kept)."""

from __future__ import annotations

import datetime
import http.client
import subprocess
import sys
import time

import pytest
from django.test import TransactionTestCase
from django.utils import timezone

from compaction.models import CompactionJob, JobState
from conversations import services
from conversations.models import ImportJob, ImportState
from tests.builders import gone_process, grow, make_user
from tests.fake_models import child_env
from tests.live_server import READY_SECONDS, ROOT, free_port

MODEL = "openai/gpt-4o-mini"


@pytest.mark.slow  # chaos: what a killed server left, picked up by the next
class StartupSweepTests(TransactionTestCase):
    def test_the_next_server_picks_up_what_the_killed_one_left(self) -> None:
        user = make_user("restarted")
        running = services.conversation_create(owner=user, title="a", model=MODEL)
        queued = services.conversation_create(owner=user, title="b", model=MODEL)
        for conv in (running, queued):
            grow(conv, 2)
            conv.refresh_from_db()
        later = timezone.now() + datetime.timedelta(minutes=5)
        long_ago = timezone.now() - datetime.timedelta(minutes=10)
        assert running.tip_id is not None and queued.tip_id is not None
        orphan = CompactionJob.objects.create(
            conversation=running, anchor_id=running.tip_id, model=MODEL, trigger="manual",
            state=JobState.RUNNING, attempts=1, lease_until=later, worker=gone_process(),
        )  # fmt: skip
        lost = CompactionJob.objects.create(
            conversation=queued, anchor_id=queued.tip_id, model=MODEL, trigger="manual"
        )
        CompactionJob.objects.filter(pk=lost.pk).update(updated_at=long_ago)
        stopped = ImportJob.objects.create(
            owner=user, filename="export.json", state=ImportState.RUNNING,
            worker=gone_process(), conversations_done=2,
        )  # fmt: skip

        port = free_port()
        env = dict(child_env(), ALLOWED_HOSTS="127.0.0.1", ARBOR_INPROCESS_JOBS="thread")
        env.pop("CELERY_BROKER_URL", None)
        server = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "arbor.asgi:application", "--host", "127.0.0.1",
             "--port", str(port), "--log-level", "warning"],
            cwd=ROOT, env=env,
        )  # fmt: skip
        self.addCleanup(server.wait, 20)
        self.addCleanup(server.terminate)

        def states() -> tuple[str, str, str]:
            return (
                CompactionJob.objects.get(pk=orphan.pk).state,
                CompactionJob.objects.get(pk=lost.pk).state,
                ImportJob.objects.get(pk=stopped.pk).state,
            )

        # The server starts, then sweeps: generous on a busy machine (READY_SECONDS).
        deadline = time.monotonic() + READY_SECONDS
        while states() != ("done", "done", "failed"):
            assert server.poll() is None, "the server exited"
            assert time.monotonic() < deadline, states()
            time.sleep(0.2)
        orphan.refresh_from_db()
        assert orphan.attempts == 2  # taken over from the dead process, once
        stopped.refresh_from_db()
        assert stopped.error.startswith("interrupted") and "after 2 conversations" in stopped.error
        # The server serves as usual (lifespan answered, requests go through).
        client = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        client.request("GET", "/login/")
        assert client.getresponse().status == 200
        client.close()
