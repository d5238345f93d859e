"""Broken input: each repair the importers make, the limits, and Hypothesis-generated
damage (truncation, byte flips, random trees with cycles and dangling parents, deep
nesting, huge strings, NUL and surrogate characters). Whatever happens, the answer is a
clear error or a report, never a crash, and never a partial conversation: the
conversations in the database are exactly those the report lists, each whole."""

from __future__ import annotations

import base64
import io
import json
import tempfile
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from django.db import DatabaseError
from django.test import TestCase, override_settings
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.django import TestCase as HypothesisTestCase
from PIL import Image

from conversations import services
from conversations.errors import ArborError
from conversations.importers import ImportRejected, ImportTooLarge, Limits, transcript_import
from conversations.importers.base import Issues
from conversations.importers.reading import JsonReader
from conversations.models import Checkpoint, Conversation, Message
from conversations.parts import clean_messages
from tests.builders import make_user
from tests.sample_loaders import SAMPLES, samples_present
from tests.test_import_samples import assert_tree_is_valid, path_of, texts

DATA = Path(__file__).parent / "data"
MEDIA = tempfile.TemporaryDirectory()
WORK = tempfile.TemporaryDirectory()


def write(name: str, content: bytes | str) -> Path:
    path = Path(WORK.name) / name
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


def jsonl(*records: Any) -> str:
    return "\n".join(json.dumps(r) for r in records) + "\n"


def cc(uid: str, parent: str | None, kind: str = "user", content: Any = "hi", **extra: Any) -> Any:
    """A Claude Code record."""
    message: dict[str, Any] = {"role": kind, "content": content}
    if kind == "assistant":
        message["id"] = extra.pop("mid", f"msg_{uid}")
        if isinstance(content, str):
            message["content"] = [{"type": "text", "text": content}]
    return {
        "type": kind,
        "uuid": uid,
        "parentUuid": parent,
        "isSidechain": False,
        "sessionId": "s",
        "timestamp": "2025-01-01T00:00:00Z",
        "message": message,
        **extra,
    }


def chatgpt(mapping: dict[str, Any], current: str | None = None, title: str = "t") -> str:
    return json.dumps([{"title": title, "mapping": mapping, "current_node": current}])


def gnode(key: str, parent: str | None, role: str = "user", text: str = "x") -> dict[str, Any]:
    return {
        "id": key,
        "parent": parent,
        "children": [],
        "message": {
            "id": key,
            "author": {"role": role},
            "content": {"content_type": "text", "parts": [text]},
        },
    }


def chatgpt_export(*lengths: int) -> str:
    """A ChatGPT conversations.json: one linear conversation per length, the user and
    the assistant taking turns."""
    docs = []
    for n, length in enumerate(lengths):
        mapping: dict[str, Any] = {}
        parent = None
        for i in range(length):
            key = f"c{n}-m{i}"
            role = "user" if i % 2 == 0 else "assistant"
            mapping[key] = gnode(key, parent, role, f"message {i} of conversation {n}")
            if parent is not None:
                mapping[parent]["children"].append(key)
            parent = key
        docs.append({"title": f"conversation {n}", "mapping": mapping, "current_node": parent})
    return json.dumps(docs)


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (2, 2), (1, 2, 3)).save(buf, format="PNG")
    return buf.getvalue()


class InvariantMixin:
    user: Any

    def run_import(self, path: Path, **kwargs: Any) -> Any:
        """Import, and check that the database holds exactly what the report says."""
        before = set(Conversation.objects.values_list("id", flat=True))
        messages_before = Message.objects.count()
        # Many of these files share a session id: each is imported whole, not skipped as
        # imported before (tests/test_import_duplicates.py covers that).
        kwargs.setdefault("duplicates", "copy")
        try:
            report = transcript_import(owner_id=self.user.pk, path=path, **kwargs)
        except ArborError as exc:
            assert set(Conversation.objects.values_list("id", flat=True)) == before
            assert Message.objects.count() == messages_before
            assert exc.detail
            return exc
        new = set(Conversation.objects.values_list("id", flat=True)) - before
        assert new == set(report.conversation_ids)
        total = 0
        for summary in report.conversations:
            conv = Conversation.objects.get(pk=summary.id)
            rows = list(Message.objects.filter(conversation=conv))
            assert len(rows) == summary.messages > 0
            total += len(rows)
            assert_tree_is_valid(conv)
            for row in rows:
                clean_messages(
                    [{"role": row.role, "parts": row.parts, "metadata": {}}],
                    max_messages=1,
                    max_chars=10**9,
                )
                assert "\x00" not in json.dumps(row.parts) + json.dumps(row.metadata)
        assert Message.objects.count() == messages_before + total
        json.dumps(report.as_dict())  # the report itself is always serialisable
        return report


@override_settings(MEDIA_ROOT=MEDIA.name)
class RepairTests(InvariantMixin, TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user()

    def kinds(self, report: Any, bucket: str) -> list[str]:
        out = [i["kind"] for i in report.as_dict().get(bucket, [])]
        for conv in report.as_dict()["conversations"]:
            out += [i["kind"] for i in conv.get(bucket, [])]
        return out

    def test_a_dangling_parent_becomes_a_root(self) -> None:
        path = write(
            "dangling.json",
            chatgpt({"a": gnode("a", None), "b": gnode("b", "ghost", "assistant")}, "b"),
        )
        report = self.run_import(path)
        assert "dangling_parent" in self.kinds(report, "repaired")
        (conv,) = Conversation.objects.filter(pk__in=report.conversation_ids)
        assert Message.objects.filter(conversation=conv, parent=None).count() == 2
        assert conv.tip is not None and texts(conv.tip) == "x"

    def test_a_cycle_is_broken_at_its_earliest_node(self) -> None:
        path = write(
            "cycle.jsonl",
            jsonl(
                cc("r", None, content="root"),
                cc("a", "b", content="A"),
                cc("b", "a", "assistant", "B"),
                cc("c", "b", content="C"),
            ),
        )
        report = self.run_import(path)
        assert self.kinds(report, "repaired") == ["cycle"]
        (conv,) = Conversation.objects.filter(pk__in=report.conversation_ids)
        assert [texts(m) for m in path_of(conv)] == ["A", "B", "C"]

    def test_a_duplicate_id_keeps_the_first_record(self) -> None:
        path = write(
            "dup.jsonl",
            jsonl(cc("a", None, content="first"), cc("a", None, content="second")),
        )
        report = self.run_import(path)
        assert self.kinds(report, "skipped") == ["duplicate_id"]
        (conv,) = Conversation.objects.filter(pk__in=report.conversation_ids)
        assert [texts(m) for m in path_of(conv)] == ["first"]

    def test_nul_bytes_and_characters_are_removed_and_reported(self) -> None:
        raw = jsonl(
            cc("a", None, content="nul \u0000 here \ud800"), cc("b", "a", "assistant", "ok")
        )
        path = write("nul.jsonl", b"\x00\x00" + raw.encode())
        report = self.run_import(path)
        assert report.repaired.kinds() == {"nul_bytes"}  # the raw NUL bytes of the line
        assert report.conversations[0].repaired.kinds() == {"nul_bytes"}  # \u0000, \ud800
        (conv,) = Conversation.objects.filter(pk__in=report.conversation_ids)
        assert texts(path_of(conv)[0]) == "nul \ufffd here \ufffd"

    def test_a_type_that_is_an_object_or_a_list_is_read_as_an_unknown_type(self) -> None:
        # A block (or a record) whose "type" is not a string once crashed the whole file
        # with a TypeError (it was looked up in a dict of readers).
        blocks = [{"type": {"x": 1}, "text": "odd"}, {"type": "text", "text": "kept"}]
        path = write(
            "odd-types.jsonl",
            jsonl(
                {"type": ["user"], "note": "a record of no known type"},
                cc("a", None, content=blocks),
                cc("b", "a", "assistant", "ok"),
            ),
        )
        report = self.run_import(path, format="claude-code")
        (conv,) = Conversation.objects.filter(pk__in=report.conversation_ids)
        assert [texts(m) for m in path_of(conv)][-1] == "ok"
        assert "kept" in texts(path_of(conv)[0])
        # Detection too: the odd record is passed over, the next one names the format.
        report = self.run_import(
            write("odd-detect.jsonl", jsonl({"type": {"a": 1}}, cc("a", None), cc("b", "a")))
        )
        assert len(report.conversation_ids) == 1

    def test_a_corrupt_line_is_skipped_and_two_records_on_a_line_are_both_kept(self) -> None:
        lines = [
            json.dumps(cc("a", None, content="one")),
            '{"type": "user", "uuid": "broken", "parentUuid": "a", "message": {',
            json.dumps(cc("b", "a", "assistant", "two")) + json.dumps(cc("c", "b", content="3")),
        ]
        report = self.run_import(write("lines.jsonl", "\n".join(lines)))
        assert self.kinds(report, "skipped") == ["corrupt_entry"]
        assert self.kinds(report, "repaired") == ["two_records_on_one_line"]
        (conv,) = Conversation.objects.filter(pk__in=report.conversation_ids)
        assert [texts(m) for m in path_of(conv)] == ["one", "two", "3"]

    def test_a_truncated_array_keeps_the_whole_conversations_before_the_cut(self) -> None:
        docs = [
            json.loads(chatgpt({"a": gnode("a", None, text=f"c{i}")}, "a"))[0] for i in range(3)
        ]
        content = json.dumps(docs)
        cut = content.index("c2") - 10
        report = self.run_import(write("cut.json", content[:cut]))
        assert [c.messages for c in report.conversations] == [1, 1]
        assert "truncated" in self.kinds(report, "skipped")

    def test_a_corrupt_array_element_is_skipped_and_the_next_one_read(self) -> None:
        good = json.loads(chatgpt({"a": gnode("a", None, text="fine")}, "a"))[0]
        content = (
            "["
            + json.dumps(good)
            + ', {"title": "bad", "mapping": {"x": tru, "y": "}"}}, '
            + (json.dumps(good) + "]")
        )
        report = self.run_import(write("bad.json", content))
        assert len(report.conversations) == 2
        assert self.kinds(report, "skipped") == ["corrupt_entry"]

    def test_infinite_numbers_become_null(self) -> None:
        line = json.dumps(cc("a", None, "assistant", "ok")).replace(
            '"sessionId"', '"message_extra": 1, "sessionId"'
        )
        record = json.loads(line)
        record["message"]["usage"] = {"input_tokens": "@@"}
        path = write("inf.jsonl", json.dumps(record).replace('"@@"', "1e400") + "\n")
        report = self.run_import(path)
        (conv,) = Conversation.objects.filter(pk__in=report.conversation_ids)
        assert conv.tip is not None and conv.tip.metadata["usage"] == {"input_tokens": None}
        assert "infinite" in report.conversations[0].repaired.items[0].detail

    def test_an_orphan_tool_result_is_kept_and_flagged(self) -> None:
        result = [{"type": "tool_result", "tool_use_id": "nope", "content": "out"}]
        path = write(
            "orphan.jsonl",
            jsonl(cc("a", None, content="go"), cc("b", "a", content=result)),
        )
        report = self.run_import(path)
        assert self.kinds(report, "flagged") == ["unpaired_tool_result"]
        (conv,) = Conversation.objects.filter(pk__in=report.conversation_ids)
        assert conv.tip.role == "tool"

    def test_images_go_to_the_blob_store_and_bad_ones_become_placeholders(self) -> None:
        good = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                "data": base64.b64encode(png()).decode()}}  # fmt: skip
        bad = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
               "data": base64.b64encode(b"not a png").decode()}}  # fmt: skip
        path = write("img.jsonl", jsonl(cc("a", None, content=[good, bad])))
        report = self.run_import(path)
        assert report.conversations[0].images == 1
        assert self.kinds(report, "repaired") == ["image_not_imported"]
        (conv,) = Conversation.objects.filter(pk__in=report.conversation_ids)
        kinds = [p["type"] for p in conv.tip.parts]
        assert kinds == ["image", "text"]
        assert conv.tip.parts[0]["width"] == 2 and conv.tip.parts[0]["mime"] == "image/png"

    def test_pi_tree_sessions_keep_branches_labels_and_summaries(self) -> None:
        def entry(eid: str, parent: str | None, kind: str = "message", **extra: Any) -> Any:
            return {"type": kind, "id": eid, "parentId": parent,
                    "timestamp": f"2025-01-01T00:00:0{len(eid)}Z", **extra}  # fmt: skip

        def msg(role: str, content: Any) -> Any:
            return {"role": role, "content": content}

        path = write(
            "tree.jsonl",
            jsonl(
                {
                    "type": "session",
                    "version": 3,
                    "id": "sess",
                    "timestamp": "2025-01-01T00:00:00Z",
                },
                entry("u1", None, message=msg("user", "question")),
                entry("a1", "u1", message=msg("assistant", [{"type": "text", "text": "A"}])),
                entry("mc", "a1", "model_change", provider="x", modelId="y"),
                entry("u2", "mc", message=msg("user", "follow-up")),
                entry("bs", "a1", "branch_summary", fromId="u2", summary="tried follow-up"),
                entry("u3", "bs", message=msg("user", [{"type": "text", "text": "other"}])),
                entry("lb", "u3", "label", targetId="a1", label="good"),
                entry("si", "lb", "session_info", name="Named session"),
            ),
        )
        report = self.run_import(path)
        (conv,) = Conversation.objects.filter(pk__in=report.conversation_ids)
        assert conv.title == "Named session"
        assert [texts(m) for m in path_of(conv)] == [
            "question",
            "A",
            "[Summary of a branch left behind]\ntried follow-up",
            "other",
        ]
        assert report.conversations[0].leaves == 2
        checkpoint = Checkpoint.objects.get(conversation=conv)
        assert checkpoint.label == "good" and texts(checkpoint.message) == "A"

    def test_a_failing_write_leaves_no_partial_conversation(self) -> None:
        records = [cc(f"m{i}", f"m{i - 1}" if i else None, content=f"{i}") for i in range(5)]
        path = write("fail.jsonl", jsonl(*records))
        real = services._insert_messages
        calls = {"n": 0}

        def flaky(rows: list[Message]) -> None:
            calls["n"] += 1
            if calls["n"] == 2:
                raise DatabaseError("disk full")
            real(rows)

        with (
            mock.patch("conversations.importers.writer.INSERT_BATCH", 2),
            mock.patch("conversations.services._insert_messages", flaky),
        ):
            report = self.run_import(path)
        assert report.conversations == []
        assert "disk full" in report.as_dict()["skipped"][0]["detail"]
        assert not Message.objects.exists()


@override_settings(MEDIA_ROOT=MEDIA.name)
class LimitTests(InvariantMixin, TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user()

    def limits(self, **changes: Any) -> Limits:
        return replace(Limits.from_settings(), **changes)

    def test_a_file_over_the_size_limit_is_refused(self) -> None:
        path = DATA / "chatgpt/browsing.json"
        assert path.stat().st_size > 1000
        error = self.run_import(path, limits=self.limits(max_file_bytes=1000))
        assert isinstance(error, ImportTooLarge) and error.status == 413

    def test_a_conversation_over_the_message_limit_is_skipped_whole(self) -> None:
        report = self.run_import(
            write("two.json", chatgpt_export(2, 6)), limits=self.limits(max_messages=3)
        )
        assert [c.messages for c in report.conversations] == [2]
        assert any("limit is 3" in s["detail"] for s in report.as_dict()["skipped"])

    def test_the_conversation_limit_stops_the_file(self) -> None:
        report = self.run_import(
            write("four.json", chatgpt_export(2, 2, 2, 2)),
            limits=self.limits(max_conversations=2),
        )
        assert len(report.conversations) == 2
        assert report.as_dict()["skipped"][-1]["kind"] == "limit"

    def test_a_huge_string_is_cut_to_the_part_limit_and_reported(self) -> None:
        path = write("huge.jsonl", jsonl(cc("a", None, content="y" * 5000)))
        report = self.run_import(path, limits=self.limits(max_part_chars=1000))
        conv = Conversation.objects.get(pk=report.conversation_ids[0])
        assert conv.tip is not None and texts(conv.tip) == "y" * 1000
        assert report.conversations[0].repaired.kinds() == {"text_truncated"}

    def test_an_overlong_line_is_skipped(self) -> None:
        path = write(
            "long.jsonl", jsonl(cc("a", None, content="short"), cc("b", "a", content="z" * 5000))
        )
        report = self.run_import(path, limits=self.limits(max_line_bytes=2000))
        assert [s["kind"] for s in report.as_dict()["skipped"]] == ["line_too_long"]

    def test_unreadable_files_are_clear_errors(self) -> None:
        for name, content, code in [
            ("empty.json", b"", "empty_file"),
            ("blank.json", b"   \n", "empty_file"),
            ("text.txt", b"hello there", "unknown_format"),
            ("number.json", b"[1, 2, 3]", "unknown_format"),
            ("object.json", b'{"what": "ever"}', "unknown_format"),
            ("deep.json", b"[" * 200_000, "unknown_format"),
        ]:
            with self.subTest(name=name):
                error = self.run_import(write(name, content))
                assert isinstance(error, ImportRejected), error
                assert error.code == code, (name, error.code)

    def test_a_forced_format_that_does_not_fit_reports_instead_of_crashing(self) -> None:
        chatgpt_file = DATA / "chatgpt/browsing.json"
        for path, fmt in [
            (DATA / "sessions/pi-parallel.jsonl", "chatgpt"),
            (chatgpt_file, "pi"),
            (chatgpt_file, "arbor"),
        ]:
            outcome = self.run_import(path, format=fmt)
            assert isinstance(outcome, ArborError) or outcome.conversations == []
        report = self.run_import(chatgpt_file, format="openwebui")
        assert isinstance(report, ArborError) or report.conversations == []


class ArrayReaderTests(TestCase):
    def test_it_reads_elements_across_chunk_boundaries(self) -> None:
        docs = [{"n": i, "text": "é" * (i * 700_001 % 1_500_000)} for i in range(6)]
        path = write("chunks.json", json.dumps(docs, ensure_ascii=False))
        issues = Issues()
        reader = JsonReader(path, issues=issues, limits=Limits.from_settings())
        assert [value for _, value in reader.iter_array()] == docs
        assert not issues.items


# --- Hypothesis ----------------------------------------------------------------------

# The repository's own real and generated files: today's Claude Code, pi and Codex
# sessions, a claude.ai export and ChatGPT browsing (every importer is fuzzed).
SMALL_SAMPLES = [
    p.read_bytes()
    for p in sorted(DATA.rglob("*"))
    if p.suffix in (".json", ".jsonl") and p.stat().st_size < 40_000
]
# With the third-party samples beside the repository, theirs too (Open WebUI's and older
# ChatGPT shapes); the fuzz tests do not need them.
if samples_present():
    SMALL_SAMPLES += [
        p.read_bytes() for p in sorted(SAMPLES.rglob("*.json")) if p.stat().st_size < 30_000
    ]
    SMALL_SAMPLES += [
        b"\n".join((SAMPLES / name).read_bytes().split(b"\n")[:40])
        for name in (
            "claude-code/claude-code-viewer__fe5e1c67-53e7-4862-81ae-d0e013e3270b.jsonl",
            "claude-code/claude-code-log__dag_compact_after_rewind.jsonl",
            "pi/pi-mono__compact.jsonl",
        )
    ]

FUZZ = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

nasty_text = st.one_of(
    st.text(max_size=30),
    st.text(st.sampled_from(["\x00", "\ud800", "é", "한", "\n", '"', "\\"]), max_size=10),
    st.integers(0, 50_000).map(lambda n: "w" * n),
)
keys = st.sampled_from([f"k{i}" for i in range(8)])
roles = st.sampled_from(["user", "assistant", "system", "tool", "critic", None])


@override_settings(MEDIA_ROOT=MEDIA.name)
class FuzzTests(InvariantMixin, HypothesisTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.user = make_user(f"fuzz-{uuid.uuid4().hex}")

    @FUZZ
    @given(sample=st.sampled_from(SMALL_SAMPLES), cut=st.floats(0, 1))
    def test_truncated_files(self, sample: bytes, cut: float) -> None:
        self.run_import(write("t.json", sample[: int(len(sample) * cut)]))

    @FUZZ
    @given(
        sample=st.sampled_from(SMALL_SAMPLES),
        flips=st.lists(st.tuples(st.floats(0, 1), st.integers(0, 255)), min_size=1, max_size=8),
    )
    def test_random_byte_flips(self, sample: bytes, flips: list[tuple[float, int]]) -> None:
        data = bytearray(sample)
        for where, value in flips:
            data[min(int(where * len(data)), len(data) - 1)] = value
        self.run_import(write("f.json", bytes(data)))

    @FUZZ
    @given(
        nodes=st.lists(st.tuples(keys, st.one_of(st.none(), keys), roles, nasty_text), max_size=12),
        current=st.one_of(st.none(), keys),
    )
    def test_random_chatgpt_trees(self, nodes: list[Any], current: str | None) -> None:
        mapping = {}
        for key, parent, role, text in nodes:
            node = gnode(key, parent, role or "user", text)
            if role is None:
                node["message"] = None
            mapping[key] = node
        self.run_import(write("g.json", chatgpt(mapping, current)))

    @FUZZ
    @given(
        records=st.lists(
            st.tuples(
                keys,
                st.one_of(st.none(), keys),
                st.sampled_from(["user", "assistant", "system", "summary"]),
                nasty_text,
                st.booleans(),
                st.sampled_from(["m1", "m2", None]),
            ),
            max_size=12,
        )
    )
    def test_random_claude_code_sessions(self, records: list[Any]) -> None:
        lines = []
        for uid, parent, kind, text, side, mid in records:
            if kind == "system":
                lines.append(
                    {"type": "system", "subtype": "compact_boundary", "uuid": uid,
                     "parentUuid": None, "logicalParentUuid": parent, "isSidechain": side}
                )  # fmt: skip
            elif kind == "summary":
                lines.append({"type": "summary", "summary": text, "leafUuid": parent})
            else:
                content: Any = text
                if kind == "assistant" and mid == "m2":
                    content = [{"type": "tool_use", "id": text[:20] or "t", "name": "x",
                                "input": {"a": text}}]  # fmt: skip
                elif kind == "user" and mid == "m2":
                    content = [{"type": "tool_result", "tool_use_id": text[:20] or "t",
                                "content": [{"type": "text", "text": text}]}]  # fmt: skip
                lines.append(cc(uid, parent, kind, content, isSidechain=side, mid=mid or uid))
        self.run_import(write("c.jsonl", jsonl(*lines) if lines else "{}"))

    @FUZZ
    @given(
        depth=st.integers(1, 20_000),
        where=st.sampled_from(["text", "arguments", "metadata", "chatgpt"]),
    )
    def test_deep_nesting(self, depth: int, where: str) -> None:
        # Built as text: deeper than Python's json module can write (or read).
        nested = '{"x":[' * depth + '"bottom"' + "]}" * depth
        if where == "chatgpt":
            doc = chatgpt({"a": gnode("a", None)}, "a")
            body = doc[:-2] + ', "extra": ' + nested + "}]"
            self.run_import(write("d.json", body))
            return
        record = cc("a", None, "assistant", [{"type": "text", "text": "hi"}])
        if where == "arguments":
            record["message"]["content"] = [
                {"type": "tool_use", "id": "t", "name": "n", "input": "@@"}
            ]
        elif where == "metadata":
            record["message"]["usage"] = "@@"
        line = json.dumps(record).replace('"@@"', nested)
        self.run_import(write("d.jsonl", line + "\n"))


@pytest.fixture(autouse=True, scope="module")
def _cleanup() -> Any:
    yield
    MEDIA.cleanup()
    WORK.cleanup()
