"""The claude.ai data export (``conversations.json``) imported: the tree of edits and
retries with the current leaf as tip (newest leaf without one), older linear exports in
file order, tool traffic split out of the assistant message so every call is answered
on the path and on resume, attachments kept as labelled text, and everything left out
named in the report. The sample is tests/data/claudeai (see its README).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from django.test import TestCase

from conversations import selectors
from conversations.forms import ImportForm
from conversations.importers import FORMATS, PARSERS, ImportReport, Limits, transcript_import
from conversations.importers.base import NEWEST_LEAF
from conversations.importers.reading import detect_format, document_format
from conversations.models import Conversation, Message
from conversations.providers.convert import to_anthropic
from conversations.providers.fake import anthropic_pairing_error
from conversations.services import transcript_resume
from tests.builders import make_user
from tests.sample_loaders import requires_samples
from tests.test_import_samples import ALL_SAMPLES

SAMPLE = Path(__file__).parent / "data" / "claudeai" / "conversations.json"
RAW: list[dict[str, Any]] = json.loads(SAMPLE.read_text(encoding="utf-8"))
RUST, TOOLS, OLD = RAW


def uid(conversation: dict[str, Any], index: int) -> str:
    return str(conversation["chat_messages"][index]["uuid"])


def write(value: Any) -> Path:
    path = Path(tempfile.mkdtemp()) / "conversations.json"
    path.write_text(json.dumps(value), encoding="utf-8")
    return path


def path_of(conversation: Conversation) -> list[Message]:
    return selectors.message_path(conversation_id=conversation.pk, tip_id=conversation.tip_id)


def source_id(message: Message) -> str:
    return str(message.metadata["source"]["id"])


def texts(message: Message) -> list[str]:
    return [p["text"] for p in message.parts if p["type"] == "text"]


def blocks(conversation: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [
        b for m in conversation["chat_messages"] for b in m.get("content", []) if b["type"] == kind
    ]


class ClaudeAiImportTests(TestCase):
    report: ImportReport
    by_source: dict[str, tuple[Conversation, Any]]

    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user("claudeai")
        cls.report = transcript_import(owner_id=cls.user.pk, path=SAMPLE)
        cls.by_source = {
            str(c.source_id): (Conversation.objects.get(pk=c.id), c)
            for c in cls.report.conversations
        }

    def imported(self, conversation: dict[str, Any]) -> tuple[Conversation, Any]:
        return self.by_source[conversation["uuid"]]

    # -- detection and registration --

    def test_it_detects_the_export_and_imports_every_conversation(self) -> None:
        assert detect_format(SAMPLE, limits=Limits.from_settings()) == "claudeai"
        assert self.report.format == "claudeai"
        assert sorted(self.by_source) == sorted(c["uuid"] for c in RAW)
        assert self.report.skipped.as_list() == []
        # One conversation on its own (what claude.ai's per-chat endpoint gives) too.
        single = write(TOOLS)
        assert detect_format(single, limits=Limits.from_settings()) == "claudeai"

    def test_chat_messages_wins_over_the_keys_other_formats_look_for(self) -> None:
        lookalike = {
            "chat_messages": [],
            "messages": [{"role": "user", "content": "hi"}],
            "history": {},
            "title": "x",
            "current_node": "y",
        }
        assert document_format(lookalike) == "claudeai"
        del lookalike["chat_messages"]
        assert document_format(lookalike) != "claudeai"

    @requires_samples
    def test_every_shared_sample_still_detects_as_its_own_format(self) -> None:
        assert ALL_SAMPLES
        for path in ALL_SAMPLES:
            assert detect_format(path, limits=Limits.from_settings()) == path.parent.name, path

    def test_the_format_lists_agree(self) -> None:
        assert "claudeai" in FORMATS
        assert set(PARSERS) == set(FORMATS)
        choices = [value for value, _ in ImportForm().fields["format"].choices]
        assert choices == ["auto", *FORMATS]
        # The class imported the sample already: again, as copies.
        report = transcript_import(
            owner_id=self.user.pk, path=SAMPLE, format="claudeai", duplicates="copy"
        )
        assert report.format == "claudeai" and len(report.conversations) == 3

    # -- the tree --

    def test_it_keeps_the_edit_branch_and_the_current_leaf_as_tip(self) -> None:
        conversation, summary = self.imported(RUST)
        leaf = RUST["current_leaf_message_uuid"]
        # The sample's current leaf is not the leaf written last: the tip rule is the
        # export's, not the fallback.
        assert leaf != uid(RUST, -1)
        assert summary.tip_rule == "current_leaf_message_uuid"
        assert (summary.messages, summary.roots, summary.leaves) == (6, 1, 2)
        path = path_of(conversation)
        assert [source_id(m) for m in path] == [uid(RUST, i) for i in (0, 1, 2, 3)]
        assert source_id(path[-1]) == leaf
        rows = {source_id(m): m for m in Message.objects.filter(conversation=conversation)}
        edited, original = rows[uid(RUST, 4)], rows[uid(RUST, 2)]
        assert edited.parent_id == original.parent_id == rows[uid(RUST, 1)].id
        assert rows[uid(RUST, 5)].parent_id == edited.id
        assert summary.repaired.as_list() == []

    def test_without_a_current_leaf_the_tip_is_the_newest_leaf(self) -> None:
        conversation, summary = self.imported(TOOLS)
        assert "current_leaf_message_uuid" not in TOOLS
        assert summary.tip_rule == NEWEST_LEAF
        assert source_id(path_of(conversation)[-1]) == uid(TOOLS, -1)

    def test_a_current_leaf_not_in_the_file_falls_back_to_the_newest_leaf(self) -> None:
        broken = {**RUST, "current_leaf_message_uuid": "11111111-2222-4333-8444-555555555555"}
        report = transcript_import(owner_id=self.user.pk, path=write([broken]), duplicates="copy")
        (summary,) = report.conversations
        assert "tip_missing" in summary.repaired.kinds()
        conversation = Conversation.objects.get(pk=summary.id)
        assert source_id(path_of(conversation)[-1]) == uid(RUST, -1)

    def test_an_older_export_is_one_line_in_file_order(self) -> None:
        conversation, summary = self.imported(OLD)
        assert not any("parent_message_uuid" in m for m in OLD["chat_messages"])
        assert (summary.roots, summary.leaves) == (1, 1)
        path = path_of(conversation)
        # The empty placeholder first is left out; the rest follow the file.
        sources = [source_id(m) for m in path]
        assert sources[0] == uid(OLD, 1)
        assert [s for i, s in enumerate(sources) if i == 0 or s != sources[i - 1]] == [
            uid(OLD, i) for i in range(1, 5)
        ]
        assert [m.role for m in path] == ["user", "assistant", "user", "assistant", "tool"]
        # No name: titled after the first question.
        assert conversation.title.startswith("Write a haiku about autumn")
        assert path[0].metadata["conversation"]["account"] == OLD["account"]["uuid"]

    # -- tool traffic --

    def test_tool_traffic_is_split_after_the_text_that_made_each_call(self) -> None:
        conversation, summary = self.imported(TOOLS)
        path = path_of(conversation)
        assert [m.role for m in path] == [
            "user",
            "assistant",
            "tool",
            "assistant",
            "tool",
            "assistant",
            "user",
            "assistant",
        ]
        answer = uid(TOOLS, 1)
        assert [source_id(m) for m in path[1:6]] == [answer] * 5
        first, _, second, _, last = path[1:6]
        assert [p["type"] for p in first.parts] == ["thinking", "text", "tool_call"]
        assert first.parts[2]["id"] == blocks(TOOLS, "tool_use")[0]["id"]
        assert texts(second) == ["It is 21 °C there. Converting:"]
        assert [p["name"] for p in second.parts if p["type"] == "tool_call"] == [
            "repl",
            "web_fetch",
        ]
        assert texts(last)[0].startswith("Lisbon is at about 70 °F")
        # The message's uuid stays on the piece its children hang below.
        assert path[6].parent_id == last.id
        # Each result answers a call of the assistant piece right above it; results
        # without ids are paired by the tool they name, not by position.
        for index, message in enumerate(path):
            if message.role != "tool":
                continue
            made = {p["id"]: p["name"] for p in path[index - 1].parts if p["type"] == "tool_call"}
            results = [p for p in message.parts if p["type"] == "tool_result"]
            assert {r["call_id"] for r in results} == set(made)
            for result in results:
                if result["is_error"]:
                    assert made[result["call_id"]] == "web_fetch"
        assert summary.tool_pairs == len(blocks(TOOLS, "tool_use")) == 3
        assert (summary.tool_calls, summary.tool_results) == (3, 3)
        assert summary.flagged.as_list() == []
        assert "tool_id_generated" in summary.repaired.kinds()

    def test_the_resume_view_holds_every_call_and_result(self) -> None:
        for raw in (TOOLS, OLD):
            conversation, summary = self.imported(raw)
            assert summary.flagged.as_list() == [], raw["uuid"]
            messages, resume = transcript_resume(
                conversation=conversation, tip_id=conversation.tip_id
            )
            assert resume.trimmed == [] and resume.repaired == []
            calls = [p for m in messages for p in m["parts"] if p["type"] == "tool_call"]
            results = [p for m in messages for p in m["parts"] if p["type"] == "tool_result"]
            assert len(calls) == len(results) == len(blocks(raw, "tool_use")) > 0
            assert {c["id"] for c in calls} == {r["call_id"] for r in results}
            wire = to_anthropic(messages).messages
            assert anthropic_pairing_error(wire) is None

    # -- content, attachments and what was left out --

    def test_content_blocks_are_read_once_and_text_only_when_there_are_none(self) -> None:
        conversation, _ = self.imported(RUST)
        first = path_of(conversation)[0]
        question = RUST["chat_messages"][0]["text"]
        assert question == RUST["chat_messages"][0]["content"][0]["text"]
        assert [t for t in texts(first) if question in t] == [question]
        conversation, _ = self.imported(OLD)
        rows = {source_id(m): m for m in path_of(conversation)}
        # `text` only (no content): read from `text`.
        assert texts(rows[uid(OLD, 2)]) == [OLD["chat_messages"][2]["text"]]
        # Both: the blocks win; the flattened text and its stand-in line are not added.
        assert "yet supported on mobile" in OLD["chat_messages"][4]["text"]
        pieces = [m for m in path_of(conversation) if source_id(m) == uid(OLD, 4)]
        said = " ".join(t for m in pieces for t in texts(m))
        assert said == "Here it is:"
        assert [m.role for m in pieces] == ["assistant", "tool"]

    def test_attachments_are_kept_as_labelled_text(self) -> None:
        conversation, summary = self.imported(RUST)
        rows = {source_id(m): m for m in Message.objects.filter(conversation=conversation)}
        (code,) = [t for t in texts(rows[uid(RUST, 0)]) if t.startswith("[attachment: main.rs")]
        assert RUST["chat_messages"][0]["attachments"][0]["extracted_content"] in code
        (paste,) = [t for t in texts(rows[uid(RUST, 4)]) if t.startswith("[attachment:")]
        assert paste.startswith("[attachment: pasted text (txt, 412 bytes)]\n")
        assert RUST["chat_messages"][4]["attachments"][0]["extracted_content"] in paste
        assert rows[uid(RUST, 0)].metadata["attachments"][0]["file_name"] == "main.rs"
        # main.rs is also in `files`, but its text is here: only the image is missing.
        missing = [i["detail"] for i in summary.skipped.as_list()]
        assert len(missing) == 1 and "borrow-error.png" in missing[0]

    def test_files_without_content_and_empty_messages_are_reported(self) -> None:
        conversation, summary = self.imported(OLD)
        skipped = summary.skipped.as_list()
        not_in_export = [i for i in skipped if i["kind"] == "file_not_in_export"]
        assert sorted("draft.pdf" in i["detail"] for i in not_in_export) == [False, True]
        assert any("moodboard.jpg" in i["detail"] for i in not_in_export)
        assert all(i["where"] == f"node {uid(OLD, 1)}" for i in not_in_export)
        (placeholder,) = [i for i in skipped if i["kind"] == "not_a_message"]
        assert placeholder["where"] == f"node {uid(OLD, 0)}"
        assert "placeholder" in placeholder["detail"]
        assert not Message.objects.filter(
            conversation=conversation, metadata__source__id=uid(OLD, 0)
        ).exists()
        # Placeholders name the missing files where the user attached them.
        first = path_of(conversation)[0]
        assert any("draft.pdf" in t and "not in the export" in t for t in texts(first))
        assert any("moodboard.jpg" in t and "not in the export" in t for t in texts(first))
        # A block with nothing readable is named too (the flag on the tools chat).
        _, tools = self.imported(TOOLS)
        dropped = [i for i in tools.repaired.as_list() if i["kind"] == "content_dropped"]
        assert [i["where"] for i in dropped] == [f"node {uid(TOOLS, 3)}"]
        assert "flag" in dropped[0]["detail"]

    def test_citations_and_message_fields_go_to_metadata(self) -> None:
        conversation, _ = self.imported(RUST)
        rows = {source_id(m): m for m in Message.objects.filter(conversation=conversation)}
        answer = rows[uid(RUST, 1)]
        assert answer.metadata["citations"] == [
            {"part": 0, "citations": RUST["chat_messages"][1]["content"][0]["citations"]}
        ]
        assert answer.metadata["finish_reason"] == "end_turn"
        root = rows[uid(RUST, 0)]
        assert root.metadata["conversation"]["summary"] == RUST["summary"]
        assert root.metadata["source"] == {"format": "claudeai", "id": uid(RUST, 0)}

    def test_a_conversation_without_chat_messages_is_skipped_and_the_others_import(self) -> None:
        broken = {"uuid": "b0b0b0b0-0000-4000-8000-000000000001", "name": "Broken"}
        report = transcript_import(
            owner_id=self.user.pk, path=write([RUST, broken, TOOLS]), duplicates="copy"
        )
        assert report.format == "claudeai"
        assert [c.source_id for c in report.conversations] == [RUST["uuid"], TOOLS["uuid"]]
        (issue,) = report.skipped.as_list()
        assert issue["kind"] == "corrupt_entry" and "Broken" in issue["where"]
        assert "chat_messages" in issue["detail"]
