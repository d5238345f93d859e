"""The shared template components (templates/components/): a message part, a checkpoint
or fork badge, a snapshot page and a record's row look the same on every page that
shows them, so a fix made in one place shows everywhere (issue #16: the audit once
showed a failed tool result like a good one, and the chat and tree disagreed on what
a checkpoint badge says)."""

from __future__ import annotations

import re
from typing import Any

from django.template import Context, Template
from django.test import TestCase
from django.urls import reverse

from compaction.models import CompactionRecord, RecordStatus, SnapshotPage, Trigger
from conversations import services
from conversations.models import Checkpoint, CheckpointSource, Conversation, Message
from conversations.templatetags.arbor_ui import RENDER_MAX_PARTS, first_parts, rung_names
from tests.builders import make_user, text
from tests.test_ui_pages import png_bytes

FAILED_RESULT = '<details class="tool-result error"><summary>Tool result (error)</summary>'
BADGE = re.compile(r'<span class="badge checkpoint [^"]*"[^>]*>[^<]*</span>')
FORK_BADGE = re.compile(r'<a class="badge fork" [^>]*>.*?</a>')
SNAPSHOT_PAGE = re.compile(r'<a href="[^"]*"><img src="[^"]*" [^>]*alt="snapshot page 0"[^>]*></a>')


def between(html: str, start: str, end: str) -> str:
    return html.split(start, 1)[1].split(end, 1)[0]


class ComponentsTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.alice = make_user("alice")
        cls.staff = make_user("root", staff=True)
        cls.blob = services.blob_store(owner=cls.alice, data=png_bytes("red"))
        cls.conv = services.conversation_create(owner=cls.alice, title="components")
        image = {"type": "image", "blob": cls.blob.sha256, "mime": "image/png"}
        image.update(width=8, height=8)
        services.turn_append(
            conversation=cls.conv,
            parent_id=None,
            expected_version=cls.conv.version,
            messages=[
                {"role": "user", "parts": [*text("look"), image]},
                {
                    "role": "assistant",
                    "parts": [{"type": "tool_call", "id": "c1", "name": "ls", "arguments": {}}],
                },
                {
                    "role": "tool",
                    "parts": [
                        {
                            "type": "tool_result",
                            "call_id": "c1",
                            "is_error": True,
                            "parts": text("no such file"),
                        }
                    ],
                },
                {"role": "assistant", "parts": text("it failed")},
            ],
        )
        cls.conv.refresh_from_db()
        cls.path = list(Message.objects.filter(conversation=cls.conv).order_by("depth"))
        services.checkpoint_create(conversation=cls.conv, label="end")
        Checkpoint.objects.create(
            conversation=cls.conv, label="planned", message=cls.path[1],
            source=CheckpointSource.MODEL,
        )  # fmt: skip
        dropped = Checkpoint.objects.create(
            conversation=cls.conv, label="gone", message=cls.path[1]
        )
        services.checkpoint_drop(checkpoint=dropped, reason="trimmed on resume")
        cls.fork = services.conversation_fork(message=cls.path[1], owner=cls.alice, title="Side")
        cls.record = cls._record()
        # As the gateway leaves it: the tip says which record the last request came from.
        tip = cls.path[-1]
        tip.metadata = {
            "gateway_forwarded": {
                "messages": 4, "model": "m", "estimate": 9, "compacted": True,
                "rungs": ["snapshot"], "record": str(cls.record.pk),
            }
        }  # fmt: skip
        tip.save(update_fields=["metadata"])
        Conversation.objects.filter(pk=cls.conv.pk).update(harness="agent/1.0")

    @classmethod
    def _record(cls) -> CompactionRecord:
        """A record whose view holds the path as sent and a snapshot page."""
        page_part: dict[str, Any] = {
            "type": "image", "blob": cls.blob.sha256, "mime": "image/png", "width": 8,
            "height": 8, "snapshot_page": {"index": 0},
        }  # fmt: skip
        view = [{"id": str(m.id), "role": m.role, "parts": m.parts} for m in cls.path]
        record = CompactionRecord.objects.create(
            conversation=cls.conv, anchor=cls.path[-1], model="m", trigger=Trigger.MANUAL,
            status=RecordStatus.READY, rungs=[{"rung": "elision"}, {"rung": "snapshot"}],
            view=[{"id": "snapshot:0", "role": "user", "parts": [page_part]}, *view],
        )  # fmt: skip
        SnapshotPage.objects.create(
            record=record, index=0, blob=cls.blob, width=8, height=8, billed_tokens=4,
            chars=3, text_hash="h", first_message_id="a", last_message_id="b",
        )  # fmt: skip
        return record

    def page(self, url: str, user: Any = None) -> str:
        self.client.force_login(user or self.alice)
        response = self.client.get(url)
        assert response.status_code == 200, (url, response.status_code)
        return response.content.decode()

    def record_pages(self) -> dict[str, str]:
        """The record for its owner and for staff."""
        c, r = self.conv.pk, self.record.pk
        return {
            "owner": self.page(f"/c/{c}/compactions/{r}/"),
            "audit": self.page(f"/audit/{r}/", self.staff),
        }

    def test_a_failed_tool_result_is_marked_alike_in_the_chat_and_the_record(self) -> None:
        chat = self.page(f"/c/{self.conv.pk}/")
        assert chat.count(FAILED_RESULT) == 1
        for scope, html in self.record_pages().items():
            # Once among the originals, once in what the model saw.
            assert html.count(FAILED_RESULT) == 2, scope
            assert '<details class="tool-result">' not in html, scope

    def test_the_checkpoint_badges_are_the_same_in_the_chat_and_the_tree(self) -> None:
        chat = BADGE.findall(self.page(f"/c/{self.conv.pk}/"))
        tree = BADGE.findall(self.page(f"/c/{self.conv.pk}/tree/"))
        assert len(chat) == 3 and sorted(chat) == sorted(tree)
        assert (
            '<span class="badge checkpoint live model" title="set by the model">'
            "⚑ planned (model)</span>"
        ) in chat
        assert (
            '<span class="badge checkpoint dropped user" '
            'title="set by you · dropped: trimmed on resume">⚑ gone</span>'
        ) in chat

    def test_the_fork_badges_are_the_same_in_the_chat_and_the_tree(self) -> None:
        chat = FORK_BADGE.findall(self.page(f"/c/{self.conv.pk}/"))
        tree = FORK_BADGE.findall(self.page(f"/c/{self.conv.pk}/tree/"))
        assert len(chat) == 1 and chat == tree
        badge = chat[0]
        assert f'<a class="badge fork" href="/c/{self.fork.pk}/" title="Fork: Side">' in badge
        # Its icon is drawn, not a glyph most fonts lack.
        assert "⑂" not in badge and '<svg class="icon"' in badge and badge.endswith("Side</a>")

    def test_the_checkpoints_page_says_who_set_live_and_dropped_ones_alike(self) -> None:
        html = self.page(f"/c/{self.conv.pk}/checkpoints/")
        dropped = between(html, '<ul class="checkpoints dropped">', "</ul>")
        assert '<span class="badge user">set by you</span>' in dropped
        live = between(html, '<ul class="checkpoints">', "</ul>")
        assert '<span class="badge model">set by the model</span>' in live
        # Its link to the message is the one every page uses.
        mid = self.path[1].pk
        assert f'href="/c/{self.conv.pk}/?m={mid}#msg-{mid}"' in live

    def test_the_snapshot_page_is_the_same_in_the_context_panel_and_the_record(self) -> None:
        panel = self.page(f"/c/{self.conv.pk}/context/")
        shown = SNAPSHOT_PAGE.findall(between(panel, 'id="gateway-pages"', "</div>"))
        owner = SNAPSHOT_PAGE.findall(between(self.record_pages()["owner"], "<figure", "</figure>"))
        assert len(shown) == 1 and shown == owner
        # Sized by the stylesheet: the CSP refuses inline styles.
        assert "style=" not in shown[0]

    def test_images_come_from_the_blob_view_each_page_may_use(self) -> None:
        sha = self.blob.sha256
        chat = self.page(f"/c/{self.conv.pk}/")
        api = reverse("api:get_blob", args=[sha])
        assert f'<img src="{api}" width="8" height="8" alt="attached image"' in chat
        pages = self.record_pages()
        owner = reverse("compaction:record_blob", args=[self.conv.pk, self.record.pk, sha])
        audit = reverse("compaction:audit_blob", args=[self.record.pk, sha])
        for scope, url in (("owner", owner), ("audit", audit)):
            originals = between(pages[scope], "<h3>Original", "</section>")
            assert f'<img src="{url}" width="8" height="8" alt="attached image"' in originals
            assert "/api/blobs/" not in pages[scope], scope

    def test_the_record_rows_show_the_same_cells_in_the_panel_and_the_audit(self) -> None:
        cells = (
            '<td>m</td><td>manual</td><td class="status ready">ready</td>'
            "<td>0 → 0</td><td>0</td><td>elision, snapshot</td>"
        )
        panel = self.page(f"/c/{self.conv.pk}/context/")
        audit = self.page("/audit/", self.staff)
        for html in (panel, audit):
            row = between(html, f'<tr id="record-{self.record.pk}">', "</tr>")
            assert row.rstrip().endswith(cells), row


class FilterTests(TestCase):
    def test_first_parts_keeps_every_part_when_asked_for_the_whole(self) -> None:
        parts = [{"type": "text", "text": str(i)} for i in range(RENDER_MAX_PARTS + 5)]
        assert len(first_parts(parts)) == RENDER_MAX_PARTS
        assert first_parts(parts, True) is parts

    def test_rung_names_lists_the_rungs_in_order(self) -> None:
        assert rung_names([{"rung": "elision"}, {"rung": "summary"}]) == "elision, summary"
        assert rung_names([]) == "" and rung_names(None) == ""

    def test_message_url_is_the_chat_scrolled_to_the_message(self) -> None:
        html = Template("{% load arbor_ui %}{% message_url c m %}").render(
            Context({"c": "abc", "m": "def"})
        )
        assert html == "/c/abc/?m=def#msg-def"
