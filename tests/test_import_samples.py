"""Every real and synthetic sample in shared/samples imported: counts checked against the
file's own structure (computed here from the raw file) and against the numbers
SOURCES.md states, the tip, and the text of the active branch.

The samples are read in place from ../shared/samples; they are never copied into the
repository (their MIT notices live next to them). Without them every test here is
skipped with one reason (failed under CI=true): tests/sample_loaders.py.
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from django.test import TestCase, override_settings

from conversations import selectors
from conversations.importers import transcript_import
from conversations.models import Blob, Conversation, Message
from conversations.resume import resume_view
from tests.builders import make_user
from tests.sample_loaders import SAMPLES, requires_samples

pytestmark = requires_samples

# Empty without the samples (the tests that use it are skipped then).
ALL_SAMPLES = sorted(
    p for p in SAMPLES.rglob("*") if p.suffix in (".json", ".jsonl") and p.is_file()
)


def raw_records(path: Path) -> list[dict[str, Any]]:
    """Every JSON object of a JSON Lines file, several per line included."""
    decoder = json.JSONDecoder()
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        pos, line = 0, line.strip()
        while pos < len(line):
            value, pos = decoder.raw_decode(line, pos)
            out.append(value)
            while pos < len(line) and line[pos].isspace():
                pos += 1
    return out


def texts(message: Message) -> str:
    """The readable text of a message, tool results included."""
    out = []
    for part in message.parts:
        if part["type"] in ("text", "thinking"):
            out.append(part["text"])
        elif part["type"] == "tool_result":
            out.extend(p["text"] for p in part["parts"] if p["type"] == "text")
    return "\n".join(out)


def path_of(conv: Conversation) -> list[Message]:
    return selectors.message_path(conversation_id=conv.pk, tip_id=conv.tip_id)


def source_id(message: Message) -> str:
    return str(message.metadata["source"]["id"])


def leaves(conv: Conversation) -> list[Message]:
    rows = list(Message.objects.filter(conversation=conv))
    parents = {m.parent_id for m in rows}
    return [m for m in rows if m.id not in parents]


def tool_pairs(conv: Conversation) -> int:
    """Results whose call sits on the nearest non-tool message above them."""
    rows = {m.id: m for m in Message.objects.filter(conversation=conv)}
    pairs = 0
    for m in rows.values():
        if m.role != "tool":
            continue
        owner = rows[m.parent_id] if m.parent_id else None
        while owner is not None and owner.role == "tool":
            owner = rows[owner.parent_id] if owner.parent_id else None
        calls = {p["id"] for p in owner.parts if p["type"] == "tool_call"} if owner else set()
        pairs += sum(1 for p in m.parts if p["type"] == "tool_result" and p["call_id"] in calls)
    return pairs


def markers(conv: Conversation) -> list[Message]:
    return [
        m for m in Message.objects.filter(conversation=conv) if "compaction_marker" in m.metadata
    ]


def images(conv: Conversation) -> list[dict[str, Any]]:
    found = []
    for m in Message.objects.filter(conversation=conv):
        for part in m.parts:
            if part["type"] == "image":
                found.append(part)
            elif part["type"] == "tool_result":
                found.extend(p for p in part["parts"] if p["type"] == "image")
    return found


def assert_tree_is_valid(conv: Conversation) -> None:
    """Depth = parent depth + 1, parents in the conversation, the tip is a message of it."""
    rows = {m.id: m for m in Message.objects.filter(conversation=conv)}
    for m in rows.values():
        if m.parent_id is None:
            assert m.depth == 0
        else:
            assert m.parent_id in rows
            assert m.depth == rows[m.parent_id].depth + 1
        assert m.origin == "import" or "source" not in m.metadata or m.metadata["source"]
    if rows:
        assert conv.tip_id in rows


class SampleTestCase(TestCase):
    sample: str = ""

    @classmethod
    def setUpClass(cls) -> None:
        media = tempfile.TemporaryDirectory()
        cls.addClassCleanup(media.cleanup)
        cls.enterClassContext(override_settings(MEDIA_ROOT=media.name))
        super().setUpClass()

    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user()
        cls.path = SAMPLES / cls.sample
        cls.report = transcript_import(owner_id=cls.user.pk, path=cls.path)
        cls.convs = [Conversation.objects.get(pk=i) for i in cls.report.conversation_ids]

    def kinds(self, bucket: str) -> Counter[str]:
        return Counter(
            i["kind"]
            for c in self.report.as_dict()["conversations"]
            for i in c[bucket]
            if i["kind"] != "more"
        )


# --- ChatGPT -------------------------------------------------------------------------


class ChatGptTreeTests(SampleTestCase):
    sample = "chatgpt/librechat__chatgpt-tree.json"

    def test_it_keeps_every_branch_and_the_current_node(self) -> None:
        (doc,) = json.loads(self.path.read_text())
        mapping = doc["mapping"]
        assert len(mapping) == 13  # SOURCES.md
        null_roots = [k for k, n in mapping.items() if n["message"] is None]
        hidden = [
            k
            for k, n in mapping.items()
            if n["message"] and n["message"]["metadata"].get("is_visually_hidden_from_conversation")
        ]
        assert len(null_roots) == 1 and len(hidden) == 1
        raw_leaves = [k for k, n in mapping.items() if not n["children"]]
        assert len(raw_leaves) == 3  # SOURCES.md

        assert self.report.format == "chatgpt"
        (conv,) = self.convs
        assert conv.title == doc["title"]
        assert Message.objects.filter(conversation=conv).count() == 13 - 2 == 11
        assert sorted(source_id(m) for m in leaves(conv)) == sorted(raw_leaves)
        assert source_id(conv.tip) == doc["current_node"]
        assert self.report.conversations[0].tip_rule == "current_node"
        assert_tree_is_valid(conv)

        # The active path: current_node up to the root, less the null root and hidden node.
        raw_path = []
        key = doc["current_node"]
        while key is not None:
            raw_path.append(key)
            key = mapping[key]["parent"]
        assert len(raw_path) == 8  # SOURCES.md
        expected = [
            "\n".join(mapping[k]["message"]["content"]["parts"])
            for k in reversed(raw_path)
            if k not in null_roots + hidden
        ]
        path = path_of(conv)
        assert [texts(m) for m in path] == expected
        assert [m.role for m in path] == ["user", "assistant"] * 3
        assert path[0].parent_id is None and path[0].depth == 0

    def test_it_keeps_the_edit_and_the_regenerate_as_siblings(self) -> None:
        (doc,) = json.loads(self.path.read_text())
        forks = {k: n["children"] for k, n in doc["mapping"].items() if len(n["children"]) > 1}
        assert len(forks) == 2  # an edit (2 user children) and a regenerate (2 answers)
        (conv,) = self.convs
        by_source = {source_id(m): m for m in Message.objects.filter(conversation=conv)}
        for key, children in forks.items():
            below = Message.objects.filter(parent=by_source[key]).order_by("created_at", "id")
            assert [source_id(m) for m in below] == children
        assert sorted(by_source[k].role for k in forks) == ["assistant", "user"]

    def test_it_keeps_the_interrupted_dead_branch_with_its_status(self) -> None:
        (conv,) = self.convs
        interrupted = [
            m
            for m in Message.objects.filter(conversation=conv)
            if m.metadata.get("status") == "in_progress"
        ]
        assert len(interrupted) == 1
        assert interrupted[0].metadata["finish_reason"] == "interrupted"
        assert interrupted[0].id not in {m.id for m in path_of(conv)}

    def test_it_reports_the_left_out_nodes(self) -> None:
        assert self.kinds("skipped") == Counter({"not_a_message": 2})
        assert not self.report.skipped and not self.report.repaired


class ChatGptModernExampleTests(SampleTestCase):
    sample = "chatgpt/openwebui-importer__gpt_example.json"

    def test_it_imports_the_linear_conversation_with_custom_instructions(self) -> None:
        (doc,) = json.loads(self.path.read_text())
        mapping = doc["mapping"]
        assert len(mapping) == 13 and "client-created-root" in mapping  # SOURCES.md
        (conv,) = self.convs
        assert Message.objects.filter(conversation=conv).count() == 11
        assert len(leaves(conv)) == 1
        assert source_id(conv.tip) == doc["current_node"]
        path = path_of(conv)
        assert len(path) == 11
        # Custom instructions: a hidden system message at the root.
        assert path[0].role == "system" and path[0].metadata["hidden"] is True
        context = mapping[path[0].metadata["source"]["id"]]["message"]["content"]
        assert context["user_instructions"].strip() in texts(path[0])
        visible = [
            "\n".join(n["message"]["content"]["parts"])
            for n in mapping.values()
            if n["message"]
            and n["message"]["content"]["content_type"] == "text"
            and n["message"]["author"]["role"] != "system"
        ]
        assert [texts(m) for m in path[1:]] == visible
        assert path[-1].metadata["model"] == "gpt-4o"
        assert_tree_is_valid(conv)


class ChatGptThreeConversationsTests(SampleTestCase):
    sample = "chatgpt/librechat__chatgpt-modern-export.json"

    def test_it_skips_the_corrupted_entry_and_imports_the_others(self) -> None:
        docs = json.loads(self.path.read_text())
        assert len(docs) == 3
        good = [d for d in docs if "mapping" in d]
        assert [c.title for c in self.convs] == [d["title"] for d in good]
        skipped = self.report.as_dict()["skipped"]
        assert [s["kind"] for s in skipped] == ["corrupt_entry"]
        assert "Corrupted entry" in skipped[0]["where"]
        for conv, doc in zip(self.convs, good, strict=True):
            real = [n for n in doc["mapping"].values() if n["message"]]
            assert Message.objects.filter(conversation=conv).count() == len(real)
            assert source_id(conv.tip) == doc["current_node"]
            assert len(leaves(conv)) == 1
            assert_tree_is_valid(conv)
        assert [texts(m) for m in path_of(self.convs[1])] == [
            "Something with anchovies?",
            "Puttanesca.",
        ]
        first = path_of(self.convs[0])
        assert first[0].role == "system" and "Answer concisely." in texts(first[0])
        assert texts(first[-1]) == "Restore from the last known-good chart."


# --- Claude Code ---------------------------------------------------------------------


class ClaudeCodeSessionTests(SampleTestCase):
    sample = "claude-code/claude-code-viewer__fe5e1c67-53e7-4862-81ae-d0e013e3270b.jsonl"

    @classmethod
    def setUpTestData(cls) -> None:
        super().setUpTestData()
        cls.records = raw_records(SAMPLES / cls.sample)

    def expected_messages(self, records: list[dict[str, Any]]) -> int:
        """Assistant API messages (records sharing message.id are one) + user records
        (a record with tool results is one tool message)."""
        ids = {r["message"]["id"] for r in records if r["type"] == "assistant"}
        users = [r for r in records if r["type"] == "user"]
        return len(ids) + len(users)

    def test_the_file_is_what_sources_md_says(self) -> None:
        kinds = Counter(r["type"] for r in self.records)
        assert len(self.records) == 438
        assert kinds == Counter({"summary": 1, "user": 175, "assistant": 262})
        assert len([r for r in self.records if r.get("isSidechain")]) == 405
        assert len([r for r in self.records if "uuid" in r and r["parentUuid"] is None]) == 6
        assert len({r["message"]["id"] for r in self.records if r["type"] == "assistant"}) == 170

    def test_sidechains_become_their_own_conversations(self) -> None:
        roots = [r for r in self.records if "uuid" in r and r["parentUuid"] is None]
        assert len(self.convs) == len(roots) == 6
        subs = self.convs[1:]
        session = self.records[1]["sessionId"]
        assert self.report.conversations[0].sidechain_of is None
        assert all(c.sidechain_of == session for c in self.report.conversations[1:])
        assert all(c.title.startswith("Sub-agent: ") for c in subs)
        assert {texts(Message.objects.get(conversation=c, parent=None)) for c in subs} == {
            texts_of(r) for r in roots if r["isSidechain"]
        }
        # Each sub-agent is linked to the Task call that started it.
        task_calls = {
            b["id"]
            for r in self.records
            if r["type"] == "assistant" and not r["isSidechain"]
            for b in r["message"]["content"]
            if b.get("type") == "tool_use" and b["name"] == "Task"
        }
        linked = {
            Message.objects.get(conversation=c, parent=None).metadata["sidechain"][
                "parent_tool_call"
            ]
            for c in subs
        }
        assert linked == task_calls and len(linked) == 5

    def test_counts_match_the_raw_file(self) -> None:
        total = Message.objects.filter(conversation__in=self.convs).count()
        assert total == self.expected_messages(self.records) == 345
        main_records = [r for r in self.records if "uuid" in r and not r["isSidechain"]]
        assert Message.objects.filter(conversation=self.convs[0]).count() == (
            self.expected_messages(main_records)
        )
        uses = [
            b
            for r in self.records
            if r["type"] == "assistant"
            for b in r["message"]["content"]
            if b.get("type") == "tool_use"
        ]
        results = [
            b
            for r in self.records
            if r["type"] == "user" and isinstance(r["message"]["content"], list)
            for b in r["message"]["content"]
            if b.get("type") == "tool_result"
        ]
        assert len(uses) == len(results) == 167  # SOURCES.md
        assert [tool_pairs(c) for c in self.convs] == [
            r.tool_pairs for r in self.report.conversations
        ]
        assert (
            self.report.conversations[0].tool_pairs
            + sum(r.tool_pairs for r in self.report.conversations[1:])
            == 167
        )
        assert sum(c.tool_pairs for c in self.report.conversations) == 167
        errors = [
            p
            for c in self.convs
            for m in Message.objects.filter(conversation=c, role="tool")
            for p in m.parts
            if p["is_error"]
        ]
        assert len(errors) == sum(1 for b in results if b.get("is_error")) == 23
        assert all(len(leaves(c)) == 1 for c in self.convs)
        assert not any(markers(c) for c in self.convs) and not any(images(c) for c in self.convs)
        assert not self.kinds("flagged")
        for conv in self.convs:
            assert_tree_is_valid(conv)

    def test_split_assistant_records_are_merged(self) -> None:
        by_id = Counter(r["message"]["id"] for r in self.records if r["type"] == "assistant")
        split = {mid: n for mid, n in by_id.items() if n > 1}
        assert len(split) == 88  # SOURCES.md
        merged = {
            m.metadata["message_id"]: m
            for c in self.convs
            for m in Message.objects.filter(conversation=c, role="assistant")
        }
        assert len(merged) == 170
        for mid, n in split.items():
            assert len(merged[mid].metadata["source"]["records"]) == n

    def test_the_tip_is_the_newest_leaf_and_the_path_is_the_main_chain(self) -> None:
        main = self.convs[0]
        last = [r for r in self.records if "uuid" in r and not r["isSidechain"]][-1]
        assert source_id(main.tip) == last["uuid"]
        assert self.report.conversations[0].tip_rule.startswith("newest leaf")
        path = path_of(main)
        assert len(path) == Message.objects.filter(conversation=main).count()
        assert texts(path[-1]) == last["message"]["content"][0]["text"]
        assert texts(path[0]).startswith("<command-message>orchestrator is running")

    def test_the_foreign_summary_is_reported_not_used(self) -> None:
        (summary,) = [r for r in self.records if r["type"] == "summary"]
        assert summary["summary"] not in [c.title for c in self.convs]
        skipped = self.report.as_dict()["skipped"]
        assert [s["kind"] for s in skipped] == ["summary"]
        assert summary["leafUuid"] in skipped[0]["where"]


def texts_of(record: dict[str, Any]) -> str:
    content = record["message"]["content"]
    return content if isinstance(content, str) else "\n".join(b["text"] for b in content)


class ClaudeCodeCompactionTests(SampleTestCase):
    sample = "claude-code/claude-code-log__dag_compact_after_rewind.jsonl"

    def test_the_rewind_branch_and_the_compaction_marker(self) -> None:
        records = raw_records(self.path)
        (conv,) = self.convs
        rows = {source_id(m): m for m in Message.objects.filter(conversation=conv)}
        assert len(rows) == len(records) == 12
        assert sorted(source_id(m) for m in leaves(conv)) == ["b1a", "p1a"]
        children_of_a1 = Message.objects.filter(parent=rows["a1"]).order_by("created_at")
        assert [source_id(m) for m in children_of_a1] == ["b1u", "b2u"]
        (marker,) = markers(conv)
        assert source_id(marker) == "cb" and marker.role == "system"
        assert marker.parent_id == rows["b2a2"].id  # logicalParentUuid
        assert marker.metadata["compaction_marker"]["trigger"] == "auto"
        assert marker.metadata["compaction_marker"]["tokens_before"] == 150000
        assert rows["cs"].metadata["compact_summary"] is True
        assert rows["cs"].parent_id == marker.id
        assert source_id(conv.tip) == "p1a"
        path = path_of(conv)
        assert [source_id(m) for m in path] == [
            "u1", "a1", "b2u", "b2a", "b2u2", "b2a2", "cb", "cs", "p1u", "p1a",
        ]  # fmt: skip
        assert [texts(m) for m in path if m.id != marker.id] == [
            "Start", "Ready", "Second attempt", "Second answer", "Keep going", "Kept going",
            records[9]["message"]["content"][0]["text"], "After compaction", "Final answer",
        ]  # fmt: skip
        assert_tree_is_valid(conv)


# --- pi ------------------------------------------------------------------------------


class PiSessionTests(SampleTestCase):
    sample = "pi/pi-mono__compact.jsonl"

    @classmethod
    def setUpTestData(cls) -> None:
        super().setUpTestData()
        cls.records = raw_records(SAMPLES / cls.sample)

    def test_the_file_is_what_sources_md_says(self) -> None:
        assert len(self.records) == 1014
        kinds = Counter(r["type"] for r in self.records)
        assert kinds == Counter({"session": 1, "message": 1011, "compaction": 2})
        last_line = self.path.read_text().rstrip("\n").rsplit("\n", 1)[-1]
        with pytest.raises(json.JSONDecodeError, match="Extra data"):
            json.loads(last_line)  # two records on one line

    def test_counts_match_the_raw_file(self) -> None:
        messages = [r["message"] for r in self.records if r["type"] == "message"]
        empty = [m for m in messages if m["role"] == "assistant" and not m["content"]]
        calls = [b for m in messages if m["role"] == "assistant" for b in m["content"]]
        calls = [b for b in calls if b["type"] == "toolCall"]
        results = [m for m in messages if m["role"] == "toolResult"]
        raw_images = [b for m in results for b in m["content"] if b["type"] == "image"]
        assert (len(calls), len(results), len(raw_images)) == (432, 429, 3)  # SOURCES.md
        (conv,) = self.convs
        expected = len(messages) - len(empty) + 2  # two compaction markers
        assert Message.objects.filter(conversation=conv).count() == expected == 1007
        assert len(leaves(conv)) == 1
        assert tool_pairs(conv) == len(results)
        assert len(markers(conv)) == 2
        found = images(conv)
        assert len(found) == 3 and {p["mime"] for p in found} == {"image/png"}
        assert Blob.objects.filter(sha256__in=[p["blob"] for p in found]).count() == 3
        summary = self.report.conversations[0]
        assert (summary.messages, summary.tool_pairs, summary.images) == (1007, 429, 3)
        assert summary.compaction_markers == 2
        assert_tree_is_valid(conv)

    def test_the_two_records_on_the_last_line_are_both_recovered(self) -> None:
        repaired = self.report.as_dict()["repaired"]
        assert [r["kind"] for r in repaired] == ["two_records_on_one_line"]
        (conv,) = self.convs
        final = self.records[-1]
        assert final["type"] == "compaction"
        tip = conv.tip
        assert "compaction_marker" in tip.metadata
        assert final["summary"] in texts(tip)
        before = Message.objects.get(pk=tip.parent_id)
        assert texts(before) == self.records[-2]["message"]["content"][0]["text"]

    def test_unpaired_calls_of_aborted_messages_are_kept_and_flagged(self) -> None:
        messages = [r["message"] for r in self.records if r["type"] == "message"]
        answered = {m["toolCallId"] for m in messages if m["role"] == "toolResult"}
        unpaired = {
            b["id"]
            for m in messages
            if m["role"] == "assistant"
            for b in m["content"]
            if b["type"] == "toolCall" and b["id"] not in answered
        }
        assert len(unpaired) == 3
        (conv,) = self.convs
        flagged = [
            m
            for m in Message.objects.filter(conversation=conv)
            if "unpaired_tool_calls" in m.metadata
        ]
        assert {c for m in flagged for c in m.metadata["unpaired_tool_calls"]} == unpaired
        assert all(m.metadata["stop_reason"] == "aborted" for m in flagged)
        assert self.kinds("flagged") == Counter({"unpaired_tool_call": 3})
        # Six aborted messages had no content at all: left out, reported.
        assert self.kinds("skipped") == Counter({"not_a_message": 6})
        # Resume leaves the unpaired calls out before a model sees them.
        _, resume = resume_view(path_of(conv))
        assert sorted(r["left_out"] for r in resume.repaired) == sorted(
            f"tool call {c}" for c in unpaired
        )

    def test_the_path_text(self) -> None:
        (conv,) = self.convs
        path = path_of(conv)
        assert len(path) == 1007
        assert texts(path[0]) == "https://github.com/badlogic/pi-mono/issues/288"
        compactions = [r for r in self.records if r["type"] == "compaction"]
        marker_texts = [texts(m) for m in path if "compaction_marker" in m.metadata]
        assert [c["summary"] in t for c, t in zip(compactions, marker_texts, strict=True)] == [
            True,
            True,
        ]
        assert path[0].metadata["source"]["format"] == "pi"


# --- Open WebUI ----------------------------------------------------------------------


class OpenWebUiSingleChatTests(SampleTestCase):
    sample = "openwebui/openwebui-importer__webui-json.json"

    def test_it_imports_the_chat_at_its_current_id(self) -> None:
        doc = json.loads(self.path.read_text())
        history = doc["history"]["messages"]
        (conv,) = self.convs
        assert conv.title == doc["title"]
        assert Message.objects.filter(conversation=conv).count() == len(history) == 2
        assert source_id(conv.tip) == doc["history"]["currentId"]
        path = path_of(conv)
        # The flat legacy list is the active path.
        assert [texts(m) for m in path] == [m["content"] for m in doc["messages"]]
        assert "you''re" in texts(path[1])  # kept as written (SQL-dump doubling)
        assert path[1].metadata["model"] == "deepseek/deepseek-chat:free"
        assert path[1].metadata["usage"]["total_tokens"] == 336
        assert_tree_is_valid(conv)


class OpenWebUiExportAllTests(SampleTestCase):
    sample = "openwebui/librechat__openwebui-export.json"

    def test_it_imports_every_chat(self) -> None:
        rows = json.loads(self.path.read_text())
        assert [c.title for c in self.convs] == [r["title"] for r in rows]
        for conv, row in zip(self.convs, rows, strict=True):
            assert source_id(conv.tip) == row["chat"]["history"]["currentId"]
            assert len(leaves(conv)) == 1
            assert_tree_is_valid(conv)

    def test_reasoning_becomes_a_thinking_part(self) -> None:
        path = path_of(self.convs[0])
        assert [m.role for m in path] == ["user", "assistant"]
        assert [p["type"] for p in path[1].parts] == ["thinking", "text"]
        assert path[1].parts[0]["text"].startswith("15 * 17")
        assert path[1].parts[1]["text"] == "255"

    def test_the_tool_call_is_split_into_a_call_and_its_result(self) -> None:
        conv = self.convs[1]
        path = path_of(conv)
        assert [m.role for m in path] == ["user", "assistant", "tool", "assistant"]
        call = path[1].parts[0]
        assert call == {
            "type": "tool_call",
            "id": "call_1",
            "name": "get_weather",
            "arguments": {"city": "Paris"},
        }
        assert path[2].parts[0]["call_id"] == "call_1"
        assert texts(path[2]) == "Paris: 18C, rain"
        assert texts(path[3]) == "The weather in Paris is 18C with rain."
        assert tool_pairs(conv) == 1
        assert [texts(m) for m in path_of(self.convs[2])] == ["Hello", "Hi there!"]


class EverySampleTests(TestCase):
    """A guard: a sample added to shared/samples without tests here still gets checked
    for the basics, and the list of samples is the one these tests were written for."""

    def test_the_sample_list_is_known(self) -> None:
        known = {
            ChatGptTreeTests.sample,
            ChatGptModernExampleTests.sample,
            ChatGptThreeConversationsTests.sample,
            ClaudeCodeSessionTests.sample,
            ClaudeCodeCompactionTests.sample,
            PiSessionTests.sample,
            OpenWebUiSingleChatTests.sample,
            OpenWebUiExportAllTests.sample,
        }
        assert {str(p.relative_to(SAMPLES)) for p in ALL_SAMPLES} == known
