"""Exports: Arbor JSON round-trips byte for byte (export → import → export) for every
imported file (the repository's own real sessions and exports, and the third-party
samples when they are beside it) and for a native conversation with branches,
checkpoints and images; a ChatGPT export re-imports to the same tree; Markdown shows the
current branch."""

from __future__ import annotations

import io
import json
import tempfile
from pathlib import Path
from typing import Any

from django.test import TestCase, override_settings
from PIL import Image

from conversations import services
from conversations.exporters import conversation_export, ordered_messages
from conversations.importers import transcript_import
from conversations.models import Checkpoint, Conversation, Message
from tests.builders import build_tree, make_user, new_conversation, text
from tests.sample_loaders import requires_samples
from tests.test_import_samples import ALL_SAMPLES

DATA = Path(__file__).parent / "data"
# Files the repository holds: sessions the real CLIs wrote, a claude.ai export, Codex
# rollouts and generated ChatGPT browsing (tests/data).
OWN_FILES = [
    DATA / "chatgpt/browsing.json",
    DATA / "claudeai/conversations.json",
    DATA / "codex/codex-compacted.jsonl",
    DATA / "codex/codex-parallel.jsonl",
    DATA / "sessions/claude-code-2.1-parallel.jsonl",
    DATA / "sessions/claude-code-2.1-subagent/12e3243d-21d4-4122-8336-869594c2c067.jsonl",
    DATA / "sessions/pi-parallel.jsonl",
]


def png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (3, 2), (seed, 40, 90)).save(buf, format="PNG")
    return buf.getvalue()


class ExportSetup(TestCase):
    """A user, and media and temporary folders of the class's own."""

    @classmethod
    def setUpClass(cls) -> None:
        media = tempfile.TemporaryDirectory()
        cls.addClassCleanup(media.cleanup)
        cls.enterClassContext(override_settings(MEDIA_ROOT=media.name))
        cls.tmp = tempfile.TemporaryDirectory()
        cls.addClassCleanup(cls.tmp.cleanup)
        super().setUpClass()

    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user()


class ExportTestCase(ExportSetup):
    def export(self, conv: Conversation, format: str = "arbor") -> bytes:
        return conversation_export(conversation=conv, format=format).content

    def reimport(self, content: bytes, name: str = "export.json") -> list[Conversation]:
        path = Path(self.tmp.name) / name
        path.write_bytes(content)
        report = transcript_import(owner_id=self.user.pk, path=path)
        return [Conversation.objects.get(pk=i) for i in report.conversation_ids]

    def shape(self, conv: Conversation) -> dict[str, Any]:
        """The tree without its ids: each message as (parent position, role, depth,
        parts), depth-first, and the tip's position."""
        rows = ordered_messages(conv)
        position: dict[Any, int] = {m.id: i for i, m in enumerate(rows)}
        return {
            "messages": [
                (position.get(m.parent_id), m.role, m.depth, m.parts, m.origin) for m in rows
            ],
            "tip": position.get(conv.tip_id),
        }


class ArborRoundTripTests(ExportTestCase):
    def check_round_trips(self, files: list[Path]) -> None:
        assert files
        for sample in files:
            report = transcript_import(owner_id=self.user.pk, path=sample, duplicates="copy")
            assert report.conversation_ids, sample
            for cid in report.conversation_ids:
                with self.subTest(sample=sample.name, conversation=str(cid)):
                    original = Conversation.objects.get(pk=cid)
                    first = self.export(original)
                    (copy,) = self.reimport(first)
                    assert copy.pk != original.pk
                    second = self.export(copy)
                    assert first == second
                    assert self.shape(copy) == self.shape(original)
                    # Nothing in the file names a database id.
                    for mid in Message.objects.filter(conversation=original).values_list(
                        "id", flat=True
                    )[:50]:
                        assert str(mid) not in first.decode()

    def test_every_imported_file_of_the_repository_round_trips_byte_for_byte(self) -> None:
        self.check_round_trips(OWN_FILES)

    @requires_samples
    def test_every_imported_sample_round_trips_byte_for_byte(self) -> None:
        self.check_round_trips(ALL_SAMPLES)

    def test_importing_the_same_export_twice_makes_two_conversations(self) -> None:
        conv, _ = new_conversation(self.user, "a>b>c, b>d", tip="c")
        content = self.export(conv)
        (one,) = self.reimport(content)
        (two,) = self.reimport(content)
        assert len({conv.pk, one.pk, two.pk}) == 3
        assert self.export(one) == self.export(two) == content

    def test_a_native_tree_with_checkpoints_images_and_tools_round_trips(self) -> None:
        conv, nodes = new_conversation(self.user, "a>b>c, b>d, a>e", tip="c", title="Native ✓")
        services.checkpoint_create(conversation=conv, label="start")
        blob = services.blob_store(owner=self.user, data=png(7))
        conv.refresh_from_db()
        services.turn_append(
            conversation=conv,
            parent_id=nodes["d"].id,
            expected_version=conv.version,
            messages=[
                {
                    "role": "user",
                    "parts": [*text("look 한국어 \u2028"), {"type": "image", "blob": blob.sha256}],
                },
                {
                    "role": "assistant",
                    "parts": [
                        {"type": "thinking", "text": "hmm", "signature": "sig"},
                        {
                            "type": "tool_call",
                            "id": "c1",
                            "name": "see",
                            "arguments": {"x": [1, 2.5]},
                        },
                    ],
                },
                {
                    "role": "tool",
                    "parts": [
                        {
                            "type": "tool_result",
                            "call_id": "c1",
                            "is_error": True,
                            "parts": [{"type": "image", "blob": blob.sha256}, *text("seen")],
                        }
                    ],
                },
                {"role": "assistant", "parts": text("done"), "metadata": {"usage": {"in": 3}}},
            ],
        )
        conv.refresh_from_db()
        services.checkpoint_create(conversation=conv, label="after")
        conv.refresh_from_db()
        services.checkpoint_rewind(conversation=conv, label="start", digest="went elsewhere")
        conv.refresh_from_db()
        fork = services.conversation_fork(message=nodes["d"], owner=self.user)
        build_tree(fork, "d")  # forked messages carry fork_of metadata

        for source in (conv, fork):
            first = self.export(source)
            doc = json.loads(first)
            assert doc["format"] == "arbor" and doc["version"] == 1
            (copy,) = self.reimport(first)
            assert self.export(copy) == first
            assert self.shape(copy) == self.shape(source)
        doc = json.loads(self.export(conv))
        assert [b["sha256"] for b in doc["blobs"]] == [blob.sha256]
        assert {(c["label"], c["state"]) for c in doc["checkpoints"]} == {
            ("start", "live"),
            ("after", "live"),
        }
        (copy,) = self.reimport(self.export(conv))
        copied = Checkpoint.objects.get(conversation=copy, label="start")
        assert copied.digest_message is not None and copied.digest_message.origin == "digest"
        assert copy.title == "Native ✓" and copy.created_at == conv.created_at

    def test_sibling_order_survives_equal_timestamps(self) -> None:
        conv, nodes = new_conversation(self.user, "a>b, a>c, a>d", tip="c")
        moment = nodes["b"].created_at
        Message.objects.filter(conversation=conv, parent=nodes["a"]).update(created_at=moment)
        first = self.export(conv)
        (copy,) = self.reimport(first)
        second = self.export(copy)
        assert first == second
        (again,) = self.reimport(second)
        assert self.export(again) == first


class ChatGptExportTests(ExportTestCase):
    def check_reimports(self, files: list[Path]) -> None:
        assert files
        for sample in files:
            report = transcript_import(owner_id=self.user.pk, path=sample, duplicates="copy")
            for cid in report.conversation_ids:
                with self.subTest(sample=sample.name, conversation=str(cid)):
                    original = Conversation.objects.get(pk=cid)
                    content = self.export(original, "chatgpt")
                    (doc,) = json.loads(content)
                    assert doc["current_node"] == str(original.tip_id)
                    assert len(doc["mapping"]) == original.messages.count() + 1  # + root
                    (copy,) = self.reimport(content, "conversations.json")
                    assert copy.title == original.title
                    assert self.shape(copy) == self.shape(original)

    def test_a_chatgpt_export_of_the_repositorys_files_reimports_to_the_same_tree(self) -> None:
        self.check_reimports(OWN_FILES)

    @requires_samples
    def test_a_chatgpt_export_reimports_to_the_same_tree(self) -> None:
        self.check_reimports(ALL_SAMPLES)

    def test_the_file_reads_like_chatgpt_without_the_arbor_metadata(self) -> None:
        conv, _ = new_conversation(self.user, "a>b>c, b>d", tip="c")
        (doc,) = json.loads(self.export(conv, "chatgpt"))
        for node in doc["mapping"].values():
            if node["message"]:
                del node["message"]["metadata"]["arbor"]
        (copy,) = self.reimport(json.dumps([doc]).encode(), "conversations.json")
        assert self.shape(copy)["tip"] == self.shape(conv)["tip"]
        assert [(p, r, d, parts) for p, r, d, parts, _ in self.shape(copy)["messages"]] == [
            (p, r, d, parts) for p, r, d, parts, _ in self.shape(conv)["messages"]
        ]


class MarkdownExportTests(ExportTestCase):
    def test_it_shows_the_current_branch_only(self) -> None:
        conv, _ = new_conversation(self.user, "hello>hi there>tell me more, hi there>other")
        services.tip_move(
            conversation=conv,
            message_id=Message.objects.get(conversation=conv, parts=text("tell me more")).id,
            expected_version=conv.version,
        )
        conv.refresh_from_db()
        export = conversation_export(conversation=conv, format="markdown")
        assert export.content_type.startswith("text/markdown")
        body = export.content.decode()
        assert body.startswith("# test\n")
        assert "## User\n\nhello" in body and "## Assistant\n\nhi there" in body
        assert "tell me more" in body and "other" not in body

    def test_it_renders_tool_traffic_in_fences(self) -> None:
        # Claude Code's session: Bash calls and their results (tests/data/sessions).
        report = transcript_import(
            owner_id=self.user.pk, path=DATA / "sessions/claude-code-2.1-parallel.jsonl"
        )
        conv = Conversation.objects.get(pk=report.conversation_ids[0])
        body = self.export(conv, "markdown").decode()
        parts = [p for m in ordered_messages(conv) for p in m.parts]
        call = next(p for p in parts if p["type"] == "tool_call")
        result = next(p for p in parts if p["type"] == "tool_result" and p["call_id"] == call["id"])
        output = "".join(q["text"] for q in result["parts"] if q["type"] == "text")
        assert call["name"] == "Bash" and "echo letter" in json.dumps(call["arguments"])
        assert f"**Tool call** `Bash` ({call['id']})" in body
        assert json.dumps(call["arguments"]["command"]) in body
        assert f"**Tool result** for {call['id']}\n\n```\n{output.strip()}" in body

    def test_an_unknown_format_is_refused(self) -> None:
        conv, _ = new_conversation(self.user, "a")
        with self.assertRaisesMessage(Exception, "format must be one of"):
            conversation_export(conversation=conv, format="pdf")
