"""Zip archives: a Claude Code project folder (a 2.1 session with its sub-agent run in
``subagents/``, written by the real CLI: tests/data/sessions) imports as two
conversations linked both ways, visible in the browser; a ChatGPT export zip's images
become blobs; the in-file sub-agents of an older Claude Code session are linked the
same way; and an archive that claims to unpack to more than the limit, or holds
nothing readable, is refused with a clear error before anything is written.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.management import call_command
from django.test import TestCase, override_settings
from django.urls import reverse
from PIL import Image

from conversations import services
from conversations.importers import ImportRejected, ImportTooLarge, Limits, transcript_import
from conversations.models import Blob, Conversation, Message
from conversations.providers.fake import FakeLLMServer
from tests import harness_sessions
from tests.builders import make_user
from tests.sample_loaders import SAMPLES, requires_samples

DATA = Path(__file__).parent / "data"
PROJECT = DATA / "sessions" / "claude-code-2.1-subagent"
MEDIA = tempfile.TemporaryDirectory()


def zip_folder(folder: Path, prefix: str = "") -> Path:
    path = Path(tempfile.mkdtemp()) / "archive.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for file in sorted(folder.rglob("*")):
            if file.is_file():
                archive.write(file, prefix + str(file.relative_to(folder)))
    return path


def png(color: str = "red") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (32, 24), color).save(out, "PNG")
    return out.getvalue()


@override_settings(MEDIA_ROOT=MEDIA.name)
class ClaudeCodeProjectTests(TestCase):
    def import_project(self, folder: Path) -> tuple[Conversation, Conversation]:
        self.user = make_user(f"p{Conversation.objects.count()}")
        report = transcript_import(owner_id=self.user.pk, path=zip_folder(folder, "proj/"))
        self.assertEqual(report.format, "zip: claude-code")
        self.assertEqual(len(report.conversations), 2, report.as_dict())
        main, sub = (Conversation.objects.get(pk=c.id) for c in report.conversations)
        self.assertIsNone(main.spawned_by_id)
        self.assertEqual(report.conversations[1].spawned_by, sub.spawned_by_id)
        return main, sub

    def check_link(self, main: Conversation, sub: Conversation) -> None:
        assert sub.spawned_by_id is not None
        call_message = Message.objects.get(pk=sub.spawned_by_id)
        self.assertEqual(call_message.conversation_id, main.pk)
        (call,) = [p for p in call_message.parts if p["type"] == "tool_call"]
        self.assertIn(call["name"], ("Agent", "Task"))
        self.assertEqual(sub.spawned_call, call["id"])
        self.assertEqual(call["arguments"]["prompt"], harness_sessions.SUBAGENT_PROMPT)
        first = Message.objects.filter(conversation=sub, parent=None).get()
        self.assertIn(harness_sessions.SUBAGENT_PROMPT, first.parts[0]["text"])
        # Visible both ways in the browser.
        self.client.force_login(self.user)
        html = self.client.get(reverse("conversations:detail", args=[main.pk])).content.decode()
        self.assertIn(f'class="badge subagent" href="/c/{sub.pk}/"', html)
        html = self.client.get(reverse("conversations:detail", args=[sub.pk])).content.decode()
        self.assertIn(f'href="/c/{main.pk}/?m={call_message.pk}#msg-{call_message.pk}"', html)
        self.assertIn("Sub-agent run started by the call", html)

    def test_the_committed_project_links_the_sub_agent_to_its_call(self) -> None:
        main, sub = self.import_project(PROJECT)
        self.check_link(main, sub)
        self.assertEqual(sub.title, "Sub-agent: print a letter")  # the call's description

    def test_without_the_meta_file_the_agent_id_links_them(self) -> None:
        folder = Path(tempfile.mkdtemp()) / "p"
        shutil.copytree(PROJECT, folder)
        for meta in folder.rglob("*.meta.json"):
            meta.unlink()
        self.check_link(*self.import_project(folder))

    def test_the_command_line_imports_the_folder_itself(self) -> None:
        user = make_user("folder-user")
        out, err = io.StringIO(), io.StringIO()
        call_command("import_transcripts", str(PROJECT), user=user.username, stdout=out, stderr=err)
        convs = Conversation.objects.filter(owner=user).order_by("created_at")
        self.assertEqual(convs.count(), 2, out.getvalue() + err.getvalue())
        sub = next(c for c in convs if c.spawned_by_id)
        self.user = user
        self.check_link(next(c for c in convs if not c.spawned_by_id), sub)

    def test_a_zip_made_by_its_full_path_under_a_dot_folder_imports(self) -> None:
        self.check_link(*self.import_project_zip(zip_folder(PROJECT, "home/me/.claude/p/")))

    def test_one_unreadable_member_does_not_stop_the_others(self) -> None:
        path = zip_folder(PROJECT)
        with zipfile.ZipFile(path, "a") as archive:
            archive.writestr("other/cut.json", b'[{"mapping": {"a": {"id": "a", "mess')
        main, sub = self.import_project_zip(path, skipped="other/cut.json")
        self.check_link(main, sub)

    def import_project_zip(
        self, path: Path, skipped: str | None = None
    ) -> tuple[Conversation, Conversation]:
        self.user = make_user(f"z{Conversation.objects.count()}")
        report = transcript_import(owner_id=self.user.pk, path=path)
        self.assertEqual(len(report.conversations), 2, report.as_dict())
        if skipped:
            self.assertIn(skipped, [i["where"] for i in report.skipped.as_list()])
        main, sub = (Conversation.objects.get(pk=c.id) for c in report.conversations)
        return main, sub

    def test_deleting_the_main_conversation_keeps_the_sub_agent(self) -> None:
        main, sub = self.import_project(PROJECT)
        services.conversation_delete(conversation=main)
        sub.refresh_from_db()
        self.assertIsNone(sub.spawned_by_id)
        self.client.force_login(self.user)
        html = self.client.get(reverse("conversations:detail", args=[sub.pk])).content.decode()
        self.assertNotIn("Sub-agent run started by", html)

    @pytest.mark.slow  # the real Claude Code CLI (make harness)
    def test_today_s_cli_writes_a_project_that_links(self) -> None:
        if not harness_sessions.binary("claude").exists():
            if os.environ.get("CI") == "true":
                self.fail("claude is missing: `make harness` installs it (CI never skips)")
            self.skipTest("claude is not installed (run `make harness`)")
        fake = FakeLLMServer(
            context_window=200_000, responder=harness_sessions.subagent_responder()
        ).start()
        self.addCleanup(fake.stop)
        home = Path(tempfile.mkdtemp(prefix="claude-sub-"))
        self.addCleanup(shutil.rmtree, home, True)
        project = harness_sessions.claude_subagent_project(home, fake.anthropic_base_url)
        self.check_link(*self.import_project(project))


@requires_samples
@override_settings(MEDIA_ROOT=MEDIA.name)
class InFileSubAgentTests(TestCase):
    def test_an_older_session_s_sidechains_are_linked_to_their_task_calls(self) -> None:
        path = (
            SAMPLES
            / "claude-code"
            / "claude-code-viewer__fe5e1c67-53e7-4862-81ae-d0e013e3270b.jsonl"
        )
        report = transcript_import(owner_id=make_user().pk, path=path)
        main = Conversation.objects.get(pk=report.conversations[0].id)
        subs = [Conversation.objects.get(pk=c.id) for c in report.conversations[1:]]
        linked = [s for s in subs if s.spawned_by_id]
        self.assertEqual(len(linked), len(subs))
        for sub in linked:
            assert sub.spawned_by_id is not None
            message = Message.objects.get(pk=sub.spawned_by_id)
            self.assertEqual(message.conversation_id, main.pk)
            self.assertIn(sub.spawned_call, [p.get("id") for p in message.parts])


def chatgpt_with_image(pointer: str) -> list[dict[str, object]]:
    part = {
        "content_type": "image_asset_pointer",
        "asset_pointer": pointer,
        "size_bytes": 100,
        "width": 32,
        "height": 24,
    }
    message = {
        "id": "u1",
        "author": {"role": "user"},
        "create_time": 1_700_000_000,
        "content": {"content_type": "multimodal_text", "parts": [part, "What color is this?"]},
        "metadata": {},
        "recipient": "all",
    }
    answer = {
        "id": "a1",
        "author": {"role": "assistant"},
        "create_time": 1_700_000_001,
        "content": {"content_type": "text", "parts": ["Red."]},
        "metadata": {},
        "recipient": "all",
    }
    mapping = {
        "root": {"id": "root", "message": None, "parent": None, "children": ["u1"]},
        "u1": {"id": "u1", "message": message, "parent": "root", "children": ["a1"]},
        "a1": {"id": "a1", "message": answer, "parent": "u1", "children": []},
    }
    return [{"title": "Colors", "mapping": mapping, "current_node": "a1", "id": "c1"}]


@override_settings(MEDIA_ROOT=MEDIA.name)
class ChatGPTZipTests(TestCase):
    def export_zip(self, members: dict[str, bytes]) -> Path:
        path = Path(tempfile.mkdtemp()) / "chatgpt-export.zip"
        with zipfile.ZipFile(path, "w") as archive:
            for name, data in members.items():
                archive.writestr(name, data)
        return path

    def test_images_of_the_export_become_blobs(self) -> None:
        doc = json.dumps(chatgpt_with_image("file-service://file-AbC123xyz"))
        path = self.export_zip(
            {
                "conversations.json": doc.encode(),
                "file-AbC123xyz-photo.png": png(),
                "user.json": b'{"id": "user-1"}',
                "chat.html": b"<html></html>",
            }
        )
        user = make_user()
        report = transcript_import(owner_id=user.pk, path=path)
        self.assertEqual(report.format, "zip: chatgpt")
        (summary,) = report.conversations
        self.assertEqual(summary.images, 1)
        self.assertNotIn("image_missing", summary.repaired.kinds())
        prompt = Message.objects.get(conversation_id=summary.id, role="user")
        (image,) = [p for p in prompt.parts if p["type"] == "image"]
        self.assertEqual((image["width"], image["height"]), (32, 24))
        self.assertTrue(Blob.objects.filter(sha256=image["blob"], owners=user).exists())

    def test_an_image_the_zip_lacks_is_a_reported_placeholder(self) -> None:
        doc = json.dumps(chatgpt_with_image("sediment://file_missing123"))
        report = transcript_import(
            owner_id=make_user().pk, path=self.export_zip({"conversations.json": doc.encode()})
        )
        (summary,) = report.conversations
        self.assertIn("image_missing", summary.repaired.kinds())
        prompt = Message.objects.get(conversation_id=summary.id, role="user")
        self.assertIn("not in the archive", prompt.parts[0]["text"])

    def test_the_browser_imports_a_zip(self) -> None:
        user = make_user()
        self.client.force_login(user)
        data = self.export_zip(
            {"conversations.json": json.dumps(chatgpt_with_image("file-service://file-Q1w2e3r4")).encode(),
             "file-Q1w2e3r4.png": png("blue")}
        ).read_bytes()  # fmt: skip
        with self.captureOnCommitCallbacks(execute=True):
            response = self.client.post(
                reverse("conversations:import"),
                {"file": SimpleUploadedFile("export.zip", data), "format": "auto"},
            )
        self.assertEqual(response.status_code, 302)
        html = self.client.get(response["Location"]).content.decode()
        self.assertIn("Imported 1 conversation (zip: chatgpt)", html)
        self.assertEqual(Conversation.objects.filter(owner=user).count(), 1)


@override_settings(MEDIA_ROOT=MEDIA.name)
class BadArchiveTests(TestCase):
    def test_a_zip_that_claims_to_unpack_past_the_limit_is_413_before_reading(self) -> None:
        path = Path(tempfile.mkdtemp()) / "bomb.zip"
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
            archive.writestr("conversations.json", b" " * 5_000_000)
        self.assertLess(path.stat().st_size, 100_000)
        limits = dataclasses.replace(Limits.from_settings(), max_file_bytes=1_000_000)
        with self.assertRaises(ImportTooLarge):
            transcript_import(owner_id=make_user().pk, path=path, limits=limits)
        self.assertFalse(Conversation.objects.exists())

    def test_a_zip_without_transcripts_is_a_clear_422(self) -> None:
        path = Path(tempfile.mkdtemp()) / "photos.zip"
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("a.png", png())
            archive.writestr("notes.json", b'{"hello": "world"}')
        with self.assertRaises(ImportRejected) as caught:
            transcript_import(owner_id=make_user().pk, path=path)
        self.assertEqual(caught.exception.code, "unknown_format")

    def test_a_broken_zip_is_a_clear_422(self) -> None:
        path = Path(tempfile.mkdtemp()) / "broken.zip"
        path.write_bytes(b"PK\x03\x04" + b"\x00" * 200)
        with self.assertRaises(ImportRejected) as caught:
            transcript_import(owner_id=make_user().pk, path=path)
        self.assertEqual(caught.exception.code, "bad_archive")
