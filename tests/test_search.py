"""Search over titles and message text (the conversation list) and the hit that opens the
exact branch holding the message, without moving the tip until asked to."""

from __future__ import annotations

import importlib
import tempfile
from io import StringIO
from typing import Any

from django.apps import apps
from django.core.management import call_command
from django.db import connection
from django.test import TestCase, override_settings
from django.test.utils import CaptureQueriesContext

from conversations import selectors, services
from conversations.importers import transcript_import
from conversations.models import Conversation, Message
from conversations.parts import SEARCH_TEXT_MAX_CHARS, searchable_text
from conversations.templatetags.arbor_ui import match_pieces
from tests.builders import make_user, new_conversation, text, tool_turn
from tests.sample_loaders import SAMPLES, requires_samples
from tests.test_ui_pages import parse_tags


def hit_url(message: Message) -> str:
    return f"/c/{message.conversation_id}/?m={message.pk}#msg-{message.pk}"


def path_section(body: str) -> str:
    return body.split('id="path"')[1].split("</ol>")[0]


def hits_section(body: str) -> str:
    return body.split('class="message-hits"')[1].split("</section>")[0]


class SearchTextTests(TestCase):
    """What goes into Message.search_text, and that every way a message is written fills it."""

    @classmethod
    def setUpTestData(cls) -> None:
        cls.alice = make_user("alice")

    def test_it_keeps_text_thinking_tool_calls_and_results_but_no_image_data(self) -> None:
        parts: list[dict[str, Any]] = [
            {"type": "thinking", "text": "pondering\n\n  deeply"},
            {"type": "text", "text": "the answer"},
            {"type": "tool_call", "id": "c1", "name": "grep_logs", "arguments": {"q": "oom"}},
            {"type": "image", "blob": "a" * 64, "mime": "image/png", "width": 1, "height": 1},
        ]
        assert searchable_text(parts) == 'pondering deeply the answer grep_logs {"q": "oom"}'
        result = [
            {
                "type": "tool_result",
                "call_id": "c1",
                "is_error": True,
                "parts": [*text("disk\tfull"), {"type": "image", "blob": "b" * 64}],
            }
        ]
        assert searchable_text(result) == "disk full"
        assert searchable_text("not a list") == "" and searchable_text([{"type": "x"}]) == ""

    def test_it_is_capped(self) -> None:
        capped = searchable_text(text("word " * SEARCH_TEXT_MAX_CHARS))
        assert len(capped) == SEARCH_TEXT_MAX_CHARS

    def test_every_write_path_fills_it(self) -> None:
        conv, nodes = new_conversation(self.alice, "first prompt>first answer")
        assert nodes["first prompt"].search_text == "first prompt"
        services.checkpoint_create(conversation=conv, label="cp")
        conv.refresh_from_db()
        edit = services.message_edit(
            conversation=conv,
            message_id=nodes["first prompt"].pk,
            parts=text("edited prompt"),
            expected_version=conv.version,
        )
        conv.refresh_from_db()
        regen = services.message_regenerate(
            conversation=conv,
            message_id=nodes["first answer"].pk,
            messages=[{"role": "assistant", "parts": text("regenerated answer")}],
            expected_version=conv.version,
        )
        conv.refresh_from_db()
        rewound = services.checkpoint_rewind(
            conversation=conv, label="cp", digest="what we learned"
        )
        fork = services.conversation_fork(
            message=Message.objects.select_related("conversation").get(pk=regen.tip),
            owner=self.alice,
        )
        by_id = {m.pk: m for m in Message.objects.all()}
        assert by_id[edit.tip].search_text == "edited prompt"
        assert by_id[regen.tip].search_text == "regenerated answer"
        assert "what we learned" in by_id[rewound.digest_message].search_text
        copies = Message.objects.filter(conversation=fork)
        assert sorted(m.search_text for m in copies) == ["first prompt", "regenerated answer"]
        for m in Message.objects.all():
            assert m.search_text == searchable_text(m.parts), m.origin

    def test_the_migration_fills_rows_written_before_the_column(self) -> None:
        new_conversation(self.alice, "old words>older words")
        Message.objects.update(search_text="")
        migration = importlib.import_module("conversations.migrations.0005_message_search_text")
        migration.fill_search_text(apps, connection.schema_editor())
        assert set(Message.objects.values_list("search_text", flat=True)) == {
            "old words",
            "older words",
        }

    @override_settings(DEBUG=True)
    def test_the_demo_data_is_searchable(self) -> None:
        with tempfile.TemporaryDirectory() as media, override_settings(MEDIA_ROOT=media):
            call_command("seed_demo", stdout=StringIO())
        rows = list(Message.objects.all())
        assert rows
        for m in rows:
            assert m.search_text == searchable_text(m.parts)


class SearchBase(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.alice = make_user("alice")
        cls.bob = make_user("bob")
        # The walrus branch is the older one; the tip sits on "stay home", the newer answer.
        cls.conv, cls.nodes = new_conversation(
            cls.alice,
            "plan a trip>pack the walrus costume>and then?>sail north, plan a trip>stay home",
            title="Holiday",
        )
        cls.other, cls.other_nodes = new_conversation(cls.bob, "bob asks>bob walrus answer")

    def setUp(self) -> None:
        self.client.force_login(self.alice)


class MessageSearchTests(SearchBase):
    def test_it_finds_a_word_only_present_in_message_text(self) -> None:
        body = self.client.get("/?q=Walrus").content.decode()
        assert "No conversation title matches" in body  # no title says walrus
        hits = hits_section(body)
        assert hit_url(self.nodes["pack the walrus costume"]).replace("&", "&amp;") in hits
        assert "<mark>walrus</mark>" in hits and "Holiday" in hits
        assert "bob walrus" not in body  # Bob's message, not Alice's

    def test_titles_still_match_and_both_sections_show(self) -> None:
        body = self.client.get("/?q=holiday").content.decode()
        assert f'id="conv-{self.conv.pk}"' in body
        assert "No message contains “holiday”." in body

    def test_it_finds_a_word_deep_in_a_long_message(self) -> None:
        long_text = "filler " * 25_000 + "needleword sits here" + " tail" * 2_000
        assert len(long_text) > 175_000
        conv = services.conversation_create(owner=self.alice, title="Long")
        result = services.turn_append(
            conversation=conv,
            parent_id=None,
            expected_version=0,
            messages=[{"role": "user", "parts": text(long_text)}],
        )
        (hit,) = selectors.message_search(user=self.alice, q="NEEDLEWORD", limit=10).items
        assert hit.message_id == result.tip
        assert hit.snippet.startswith("…filler") and hit.snippet.endswith("tail…")
        assert "needleword sits here" in hit.snippet and len(hit.snippet) <= 210
        # Past the cap a word is not found (SEARCH_TEXT_MAX_CHARS, documented in parts.py).
        services.turn_append(
            conversation=conv,
            parent_id=result.tip,
            expected_version=1,
            messages=[{"role": "assistant", "parts": text("x" * SEARCH_TEXT_MAX_CHARS + " lost")}],
        )
        assert selectors.message_search(user=self.alice, q="lost", limit=10).items == []

    def test_it_finds_tool_calls_and_tool_results(self) -> None:
        conv = services.conversation_create(owner=self.alice, title="Agent")
        turn = tool_turn("check the logs", name="grep_logs", result="kernel: segfault in libfoo")
        turn[1]["parts"][0]["arguments"] = {"pattern": "oom-killer"}
        result = services.turn_append(
            conversation=conv, parent_id=None, expected_version=0, messages=turn
        )
        (found,) = selectors.message_search(user=self.alice, q="segfault in", limit=10).items
        assert found.message_id == result.message_ids[2] and found.role == "tool"
        (call,) = selectors.message_search(user=self.alice, q="oom-killer", limit=10).items
        assert call.message_id == result.message_ids[1] and "grep_logs" in call.snippet
        body = self.client.get("/?q=SEGFAULT").content.decode()
        assert "<mark>segfault</mark> in libfoo" in body

    def test_whitespace_in_the_query_matches_line_breaks(self) -> None:
        new_conversation(self.alice, "first line\n\nsecond   line")
        (hit,) = selectors.message_search(user=self.alice, q="line   second", limit=5).items
        assert hit.snippet == "first line second line"

    def test_hits_are_newest_first_and_paged(self) -> None:
        seen = []
        cursor = None
        while True:
            page = selectors.message_search(user=self.alice, q="a", limit=2, cursor=cursor)
            seen += [h.message_id for h in page.items]
            cursor = page.next_cursor
            if cursor is None:
                break
        expected = list(
            Message.objects.filter(conversation__owner=self.alice, search_text__icontains="a")
            .order_by("-created_at", "-id")
            .values_list("id", flat=True)
        )
        assert seen == expected and len(seen) > 2
        body = self.client.get("/?q=a").content.decode()
        assert "Older messages" not in body  # 20 a page: all of them fit
        assert self.client.get("/?q=a&mcursor=garbage").status_code == 404

    def test_another_user_never_sees_my_hits(self) -> None:
        self.client.force_login(self.bob)
        body = self.client.get("/?q=walrus").content.decode()
        hits = hits_section(body)
        assert str(self.other_nodes["bob walrus answer"].pk) in hits
        assert str(self.conv.pk) not in body and "costume" not in body
        assert [h.message_id for h in selectors.message_search(user=self.bob, q="trip", limit=50)
                .items] == []  # fmt: skip

    def test_a_fork_is_searchable_through_its_copies(self) -> None:
        fork = services.conversation_fork(
            message=self.nodes["pack the walrus costume"], owner=self.alice, title="Forked"
        )
        hits = selectors.message_search(user=self.alice, q="walrus costume", limit=10).items
        assert {h.conversation_id for h in hits} == {self.conv.pk, fork.pk}
        copy = Message.objects.get(conversation=fork, search_text__icontains="walrus")
        assert copy.search_text == self.nodes["pack the walrus costume"].search_text

    def test_snippets_and_queries_are_escaped(self) -> None:
        conv = services.conversation_create(owner=self.alice, title="<i>markup</i>")
        services.turn_append(
            conversation=conv,
            parent_id=None,
            expected_version=0,
            messages=[{"role": "user", "parts": text("<script>alert(1)</script> <b>bold</b>")}],
        )
        response = self.client.get("/?q=<script>")
        body = response.content.decode()
        hits = hits_section(body)
        assert "<mark>&lt;script&gt;</mark>alert(1)&lt;/script&gt; &lt;b&gt;bold" in hits
        assert "&lt;i&gt;markup&lt;/i&gt;" in hits
        names = {name for name, _ in parse_tags(body)}
        assert not names & {"b", "i"} and "<script>alert" not in body
        # The query itself, echoed back, is escaped too.
        assert 'value="&lt;script&gt;"' in body

    def test_match_pieces_splits_without_building_html(self) -> None:
        assert match_pieces("a <B> b <b>", "<b>") == [
            ("a ", False),
            ("<B>", True),
            (" b ", False),
            ("<b>", True),
        ]
        assert match_pieces("one  two three", "ONE TWO") == [("one  two", True), (" three", False)]
        assert match_pieces("text", "") == [("text", False)]

    def test_a_too_long_query_is_truncated(self) -> None:
        response = self.client.get("/?q=" + "walrus" + "x" * 500)
        assert response.status_code == 200
        assert 'value="walrus' + "x" * 194 + '"' in response.content.decode()

    def test_the_live_search_fragment_includes_message_hits(self) -> None:
        response = self.client.get("/?q=walrus", headers={"HX-Request": "true"})
        body = response.content.decode()
        assert body.lstrip().startswith('<div id="results">') and "<html" not in body
        assert "Messages" in body and "<mark>walrus</mark>" in body
        assert "HX-Request" in response["Vary"]

    def test_the_query_count_does_not_grow_with_hits_or_conversations(self) -> None:
        with self.assertNumQueries(1):
            few = selectors.message_search(user=self.alice, q="walrus", limit=20)
        for i in range(12):
            new_conversation(self.alice, f"walrus {i}>more walrus {i}", title=f"w{i}")
        with self.assertNumQueries(1):
            many = selectors.message_search(user=self.alice, q="walrus", limit=20)
        assert len(few.items) == 1 and len(many.items) == 20 and many.next_cursor

        def page_queries() -> int:
            with CaptureQueriesContext(connection) as ctx:
                assert self.client.get("/?q=walrus").status_code == 200
            return len(ctx.captured_queries)

        baseline = page_queries()
        for i in range(5):
            new_conversation(self.alice, f"walrus again {i}", title=f"again {i}")
        assert page_queries() == baseline

        # 30 hits: the first page shows 20 and links to the rest.
        first = self.client.get("/?q=walrus").content.decode()
        assert first.count('<li id="hit-') == 20
        older = first.split('<a href="?q=walrus&amp;mcursor=')[1].split('"')[0]
        rest = self.client.get(f"/?q=walrus&mcursor={older}").content.decode()
        assert rest.count('<li id="hit-') == 10 and "Older messages" not in rest


class HitOpensTheBranchTests(SearchBase):
    def test_a_hit_on_another_branch_shows_that_branch_and_leaves_the_tip(self) -> None:
        self.conv.refresh_from_db()
        tip, version = self.conv.tip_id, self.conv.version
        assert tip == self.nodes["stay home"].pk
        costume = self.nodes["pack the walrus costume"]
        response = self.client.get(hit_url(costume))
        assert response.status_code == 200
        body = response.content.decode()
        path = path_section(body)
        # root → the message → the newest leaf below it; not the current branch.
        assert "pack the walrus costume" in path and "sail north" in path
        assert "stay home" not in path
        assert f'id="msg-{costume.pk}" class="msg assistant found"' in path
        assert "You are viewing another branch" in body
        assert f'action="/c/{self.conv.pk}/m/{costume.pk}/select/"' in body
        assert "Continue from this branch" in body
        # The composer continues the branch on screen.
        assert f'name="parent" value="{self.nodes["sail north"].pk}"' in body
        self.conv.refresh_from_db()
        assert (self.conv.tip_id, self.conv.version) == (tip, version)

    def test_continue_from_this_branch_moves_the_tip(self) -> None:
        self.conv.refresh_from_db()
        costume = self.nodes["pack the walrus costume"]
        response = self.client.post(
            f"/c/{self.conv.pk}/m/{costume.pk}/select/", {"version": self.conv.version}
        )
        assert response.status_code == 302
        assert response["Location"] == f"/c/{self.conv.pk}/#msg-{costume.pk}"
        self.conv.refresh_from_db()
        assert self.conv.tip_id == self.nodes["sail north"].pk
        body = self.client.get(hit_url(costume)).content.decode()
        assert "another branch" not in body and "found" in body

    def test_a_hit_on_the_current_branch_shows_the_current_branch(self) -> None:
        root = self.nodes["plan a trip"]
        body = self.client.get(hit_url(root)).content.decode()
        assert "another branch" not in body
        assert "stay home" in path_section(body)
        assert f'id="msg-{root.pk}" class="msg user found"' in body

    @requires_samples
    def test_the_imported_sample_is_searchable_on_its_other_branches(self) -> None:
        sample = SAMPLES / "chatgpt" / "librechat__chatgpt-tree.json"
        report = transcript_import(owner_id=self.alice.pk, path=sample)
        conv = Conversation.objects.get(pk=report.conversation_ids[0])
        (hit,) = selectors.message_search(user=self.alice, q="village nestled", limit=5).items
        assert hit.conversation_id == conv.pk and hit.role == "assistant"
        body = self.client.get("/?q=village+nestled").content.decode()
        assert "<mark>village nestled</mark>" in body
        tip = conv.tip_id
        page = self.client.get(f"/c/{conv.pk}/?m={hit.message_id}").content.decode()
        assert "You are viewing another branch" in page and "village nestled" in page
        conv.refresh_from_db()
        assert conv.tip_id == tip
        self.client.force_login(self.bob)
        assert selectors.message_search(user=self.bob, q="village", limit=5).items == []

    def test_a_bad_or_foreign_message_is_404(self) -> None:
        c = self.conv.pk
        foreign = self.other_nodes["bob asks"].pk
        _, mine = new_conversation(self.alice, "elsewhere")
        for m in [foreign, mine["elsewhere"].pk, "not-a-uuid", "", "0" * 32 + "z"]:
            assert self.client.get(f"/c/{c}/?m={m}").status_code == 404, m
            response = self.client.get(f"/c/{c}/?m={m}", headers={"HX-Request": "true"})
            assert response.status_code == 404, m
        # Bob cannot open Alice's message through his own conversation, nor through hers.
        self.client.force_login(self.bob)
        alice_msg = self.nodes["pack the walrus costume"].pk
        assert self.client.get(f"/c/{self.other.pk}/?m={alice_msg}").status_code == 404
        assert self.client.get(f"/c/{c}/?m={alice_msg}").status_code == 404

    def test_a_message_before_the_chat_window_is_still_shown(self) -> None:
        conv = services.conversation_create(owner=self.alice, title="deep")
        result = services.turn_append(
            conversation=conv, parent_id=None, expected_version=0,
            messages=[{"role": "user" if i % 2 == 0 else "assistant", "parts": text(f"m{i} z")}
                      for i in range(200)],
        )  # fmt: skip
        conv.refresh_from_db()
        services.turn_append(
            conversation=conv, parent_id=conv.tip_id, expected_version=conv.version,
            messages=[{"role": "user" if i % 2 == 0 else "assistant", "parts": text(f"n{i} z")}
                      for i in range(200)],
        )  # fmt: skip
        early = result.message_ids[5]
        body = self.client.get(f"/c/{conv.pk}/?m={early}").content.decode()
        assert f'id="msg-{early}"' in body and "another branch" not in body
        assert f"?m={early}&amp;all=1" in body  # "show earlier" keeps the message
        # The window moves to the message rather than growing: 300 rows, and the rest of
        # the branch below it is counted behind a link.
        assert body.count('<li id="msg-') == 300
        assert "Show the 100 later messages of this branch" in body
        assert f'id="msg-{result.message_ids[0]}"' in body  # 5 above it: all there
