"""POST /api/imports, GET /api/conversations/{cid}/export and the import_transcripts
command.

Until ``conversations.api_imports.router`` is registered on the project's NinjaAPI
(arbor/api.py), these tests mount it on a local NinjaAPI with the same authentication
and error handlers; once it is registered they use the real /api/ URLs unchanged.
"""

from __future__ import annotations

import json
import tempfile
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client, TestCase, override_settings
from django.urls import include, path
from ninja import NinjaAPI

from arbor import api as project_api
from arbor import urls as project_urls
from conversations import api_imports, services
from conversations.auth import api_auth
from conversations.models import Conversation, Message
from tests.builders import make_user, new_conversation
from tests.sample_loaders import SAMPLES, requires_samples

DATA = Path(__file__).parent / "data"
BROWSING = DATA / "chatgpt/browsing.json"
MEDIA = tempfile.TemporaryDirectory()


def _registered() -> bool:
    return any(reg[1] is api_imports.router for reg in project_api.api._router_registrations)


if _registered():
    urlpatterns = project_urls.urlpatterns
else:
    _local = NinjaAPI(auth=api_auth, urls_namespace="imports_test", title="imports test")
    _local.add_router("/", api_imports.router)
    for _exc, _handler in project_api.api._exception_handlers.items():
        _local.add_exception_handler(_exc, _handler)
    urlpatterns = [
        path("api/", _local.urls),
        *[p for p in project_urls.urlpatterns if "api/" not in str(p.pattern)],
        path("", include("conversations.urls")),
    ]


@override_settings(ROOT_URLCONF=__name__, MEDIA_ROOT=MEDIA.name)
class ImportApiTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.alice = make_user("alice")
        cls.bob = make_user("bob")
        _, cls.alice_secret = services.api_token_create(user=cls.alice, name="a")
        _, cls.bob_secret = services.api_token_create(user=cls.bob, name="b")

    def client_for(self, secret: str) -> Client:
        return Client(enforce_csrf_checks=True, HTTP_AUTHORIZATION=f"Bearer {secret}")

    def upload(self, client: Client, path: Path, **fields: Any) -> Any:
        data = path.read_bytes()
        upload = SimpleUploadedFile(path.name, data, content_type="application/json")
        return client.post("/api/imports", {"file": upload, **fields})

    @requires_samples
    def test_it_imports_an_upload_and_answers_with_the_report(self) -> None:
        response = self.upload(
            self.client_for(self.alice_secret),
            SAMPLES / "chatgpt/librechat__chatgpt-modern-export.json",
        )
        assert response.status_code == 201, response.content
        body = response.json()
        assert body["format"] == "chatgpt"
        assert body["file"] == "librechat__chatgpt-modern-export.json"
        assert len(body["conversation_ids"]) == 2
        assert [c["messages"] for c in body["conversations"]] == [5, 2]
        assert body["skipped"][0]["kind"] == "corrupt_entry"
        owned = Conversation.objects.filter(owner=self.alice)
        assert sorted(str(c.pk) for c in owned) == sorted(body["conversation_ids"])
        assert not Conversation.objects.filter(owner=self.bob).exists()

    @requires_samples
    def test_the_format_can_be_forced(self) -> None:
        client = self.client_for(self.alice_secret)
        response = self.upload(client, SAMPLES / "pi/pi-mono__compact.jsonl", format="pi")
        assert response.status_code == 201
        report = response.json()["conversations"][0]
        assert (report["messages"], report["images"], report["compaction_markers"]) == (1007, 3, 2)
        assert report["tip_rule"].startswith("newest leaf")
        assert len(report["flagged"]) == 3

    @requires_samples
    def test_a_raw_body_is_accepted(self) -> None:
        data = (SAMPLES / "openwebui/openwebui-importer__webui-json.json").read_bytes()
        response = self.client_for(self.alice_secret).post(
            "/api/imports?format=openwebui", data, content_type="application/json"
        )
        assert response.status_code == 201, response.content
        assert response.json()["conversations"][0]["messages"] == 2

    def test_unreadable_or_empty_uploads_are_422_and_write_nothing(self) -> None:
        client = self.client_for(self.alice_secret)
        for content, code in [
            (b"not json at all", "unknown_format"),
            (b"", "empty_file"),
            (b'[{"title": "x"}]', "unknown_format"),
            (b'[{"title": "x", "mapping": {}}]', "nothing_imported"),
        ]:
            with self.subTest(content=content):
                upload = SimpleUploadedFile("x.json", content)
                response = client.post("/api/imports", {"file": upload})
                assert response.status_code == 422, response.content
                assert response.json()["error"] == code
        response = client.post("/api/imports", {"file": SimpleUploadedFile("x", b"{}")})
        assert response.status_code == 422
        bad = client.post("/api/imports?format=word", b"{}", content_type="application/json")
        assert bad.status_code == 422 and bad.json()["error"] == "bad_format"
        assert not Conversation.objects.exists()

    @override_settings(ARBOR_IMPORT_MAX_FILE_BYTES=1000)
    def test_an_upload_over_the_limit_is_413(self) -> None:
        response = self.upload(self.client_for(self.alice_secret), BROWSING)
        assert response.status_code == 413
        assert response.json()["error"] == "import_too_large"
        raw = self.client_for(self.alice_secret).post(
            "/api/imports", b"[" + b" " * 2000 + b"]", content_type="application/json"
        )
        assert raw.status_code == 413
        assert not Conversation.objects.exists()

    def test_anonymous_callers_are_refused(self) -> None:
        response = self.upload(Client(), BROWSING)
        assert response.status_code == 401
        assert response.json()["error"] == "unauthorized"
        conv, _ = new_conversation(self.alice, "a>b")
        assert Client().get(f"/api/conversations/{conv.pk}/export").status_code == 401
        assert not Conversation.objects.exclude(pk=conv.pk).exists()

    def test_a_browser_session_needs_the_csrf_token(self) -> None:
        client = Client(enforce_csrf_checks=True)
        client.force_login(self.alice)
        response = self.upload(client, BROWSING)
        assert response.status_code == 403
        assert not Conversation.objects.exists()

    def test_export_in_each_format(self) -> None:
        conv, _ = new_conversation(self.alice, "a>b>c, b>d", tip="c", title="Plans")
        client = self.client_for(self.alice_secret)
        arbor = client.get(f"/api/conversations/{conv.pk}/export")
        assert arbor.status_code == 200
        assert arbor["Content-Type"] == "application/json"
        assert arbor["Content-Disposition"].startswith('attachment; filename="plans-')
        assert json.loads(arbor.content)["format"] == "arbor"
        chatgpt = client.get(f"/api/conversations/{conv.pk}/export?format=chatgpt")
        assert json.loads(chatgpt.content)[0]["current_node"] == str(conv.tip_id)
        markdown = client.get(f"/api/conversations/{conv.pk}/export?format=markdown")
        assert markdown["Content-Type"].startswith("text/markdown")
        assert markdown.content.decode().startswith("# Plans")
        bad = client.get(f"/api/conversations/{conv.pk}/export?format=pdf")
        assert bad.status_code == 422 and bad.json()["error"] == "bad_format"

    def test_an_export_reimported_through_the_api_is_identical(self) -> None:
        client = self.client_for(self.alice_secret)
        created = self.upload(client, DATA / "sessions/claude-code-2.1-parallel.jsonl")
        (cid,) = created.json()["conversation_ids"]
        first = client.get(f"/api/conversations/{cid}/export").content
        again = client.post(
            "/api/imports", {"file": SimpleUploadedFile("c.arbor.json", first)}
        ).json()
        (copy,) = again["conversation_ids"]
        assert again["format"] == "arbor"
        assert client.get(f"/api/conversations/{copy}/export").content == first

    def test_a_stranger_gets_404_exactly_like_a_missing_id(self) -> None:
        conv, _ = new_conversation(self.alice, "a>b")
        bob = self.client_for(self.bob_secret)
        theirs = bob.get(f"/api/conversations/{conv.pk}/export")
        missing_id = "00000000-0000-4000-8000-000000000000"
        missing = bob.get(f"/api/conversations/{missing_id}/export")
        assert theirs.status_code == missing.status_code == 404
        assert theirs.json()["error"] == missing.json()["error"] == "not_found"
        assert theirs.json()["detail"].replace(str(conv.pk), "<id>") == missing.json()[
            "detail"
        ].replace(missing_id, "<id>")
        assert bob.get("/api/conversations/not-a-uuid/export").status_code == 404


@override_settings(MEDIA_ROOT=MEDIA.name)
class ImportCommandTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user("alice")

    def run_command(self, *args: Any) -> tuple[str, str]:
        out, err = StringIO(), StringIO()
        call_command("import_transcripts", *args, stdout=out, stderr=err)
        return out.getvalue(), err.getvalue()

    @requires_samples
    def test_it_imports_several_files_with_progress_on_stderr(self) -> None:
        out, err = self.run_command(
            str(SAMPLES / "chatgpt/librechat__chatgpt-tree.json"),
            str(SAMPLES / "claude-code/claude-code-log__dag_compact_after_rewind.jsonl"),
            "--user",
            "alice",
        )
        assert "[1/2]" in err and "[2/2]" in err and "imported 'Start': 12 messages" in err
        assert "chatgpt, 1 conversation(s) imported" in out
        assert "claude-code, 1 conversation(s) imported" in out
        assert "1 compaction markers; tip by newest leaf" in out
        assert Conversation.objects.filter(owner=self.user).count() == 2
        assert Message.objects.count() == 11 + 12

    @requires_samples
    def test_json_output_and_a_forced_format(self) -> None:
        out, _ = self.run_command(
            str(SAMPLES / "openwebui/librechat__openwebui-export.json"),
            "--user",
            "alice",
            "--format",
            "openwebui",
            "--json",
        )
        (report,) = json.loads(out)
        assert report["format"] == "openwebui" and len(report["conversation_ids"]) == 3

    @requires_samples
    def test_running_it_twice_imports_twice(self) -> None:
        sample = str(SAMPLES / "openwebui/openwebui-importer__webui-json.json")
        self.run_command(sample, "--user", "alice")
        self.run_command(sample, "--user", "alice")
        assert Conversation.objects.count() == 2

    def test_clear_errors(self) -> None:
        sample = str(BROWSING)
        with pytest.raises(CommandError, match="no user named 'nobody'"):
            self.run_command(sample, "--user", "nobody")
        with pytest.raises(CommandError, match="no such file"):
            self.run_command("/nonexistent.json", "--user", "alice")
        bad = Path(MEDIA.name) / "bad.json"
        bad.write_text("nonsense")
        with pytest.raises(CommandError, match="no file could be imported"):
            self.run_command(str(bad), "--user", "alice")
        assert not Conversation.objects.exists()
