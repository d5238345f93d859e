"""An import killed midway (kill -9 of the process running it) does not stay "running"
forever: the next look at it says it was interrupted, after how many conversations, and
keeps those; every conversation it wrote is whole."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
from django.core.files.base import ContentFile
from django.test import Client, TransactionTestCase

from conversations.models import Conversation, ImportJob, ImportState, Message
from tests.builders import make_user
from tests.fake_models import child_env
from tests.live_server import READY_SECONDS
from tests.test_asgi_streaming import ROOT


def chatgpt_export(count: int, turns: int = 30) -> bytes:
    conversations = []
    for c in range(count):
        mapping: dict[str, Any] = {}
        parent = None
        for t in range(turns):
            key = f"c{c}-m{t}"
            role = "user" if t % 2 == 0 else "assistant"
            mapping[key] = {
                "id": key,
                "parent": parent,
                "children": [],
                "message": {
                    "id": key,
                    "author": {"role": role},
                    "content": {
                        "content_type": "text",
                        "parts": [f"{role} {t} of {c}: " + "words " * 40],
                    },
                },
            }
            if parent:
                mapping[parent]["children"].append(key)
            parent = key
        conversations.append(
            {"title": f"conversation {c}", "mapping": mapping, "current_node": parent}
        )
    return json.dumps(conversations).encode()


@pytest.mark.slow  # chaos: an import child killed mid-import
class ImportKillTests(TransactionTestCase):
    def test_an_import_killed_midway_is_reported_interrupted_with_what_it_kept(self) -> None:
        user = make_user()
        job = ImportJob(owner=user, filename="export.json", format="auto")
        job.upload.save("export.upload", ContentFile(chatgpt_export(400)), save=False)
        job.save()
        child = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "import_child.py"), str(job.pk)],
            cwd=ROOT, env=child_env(),
        )  # fmt: skip
        self.addCleanup(child.wait, 10)
        deadline = time.monotonic() + READY_SECONDS  # the child starts Django first
        while time.monotonic() < deadline:
            job.refresh_from_db()
            if job.conversations_done >= 5:
                break
            time.sleep(0.05)
        self.assertGreaterEqual(job.conversations_done, 5, "the import never got going")
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        job.refresh_from_db()
        self.assertEqual(job.state, ImportState.RUNNING)  # what the row says after a kill

        browser = Client()
        browser.force_login(user)
        page = browser.get(f"/import/{job.pk}/").content.decode()
        job.refresh_from_db()
        self.assertEqual(job.state, ImportState.FAILED)
        self.assertIn("interrupted", job.error)
        self.assertIn("interrupted", page)
        kept = Conversation.objects.filter(owner=user)
        self.assertGreaterEqual(kept.count(), job.conversations_done)
        self.assertLess(kept.count(), 400)
        # Each conversation it wrote is whole (a conversation is one transaction).
        for conversation in kept:
            self.assertEqual(Message.objects.filter(conversation=conversation).count(), 30)
        self.assertTrue(set(job.report["conversation_ids"]) <= {str(c.pk) for c in kept})


class ImportOnAnotherHostTests(TransactionTestCase):
    """A worker on another host cannot be checked for life from here: its import says
    it is alive on a timer, and one silent past IMPORT_STALE_SECONDS is ended."""

    def test_a_silent_import_of_another_host_is_ended_and_a_live_one_is_not(self) -> None:
        import datetime

        from django.utils import timezone

        from conversations import services

        user = make_user()
        live = ImportJob.objects.create(
            owner=user, filename="a.json", state=ImportState.RUNNING,
            worker="another-host:4242:99",
        )  # fmt: skip
        silent = ImportJob.objects.create(
            owner=user, filename="b.json", state=ImportState.RUNNING,
            worker="another-host:4243:99", conversations_done=7,
        )  # fmt: skip
        long_ago = timezone.now() - datetime.timedelta(seconds=services.IMPORT_STALE_SECONDS + 5)
        ImportJob.objects.filter(pk=silent.pk).update(updated_at=long_ago)
        silent.refresh_from_db()
        assert services.import_job_sweep(live).state == ImportState.RUNNING
        swept = services.import_job_sweep(silent)
        assert swept.state == ImportState.FAILED
        assert "after 7 conversations" in swept.error
        assert ImportJob.objects.get(pk=silent.pk).state == ImportState.FAILED
        assert ImportJob.objects.get(pk=live.pk).state == ImportState.RUNNING
