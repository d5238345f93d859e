"""Codex CLI rollouts imported: the files Codex 0.171 writes when it runs against the
loopback Responses API server of tests/codex_server.py (committed under tests/data/codex,
see its README, and made afresh by the live tests), and variants of them for the items
a scripted run does not produce.

Each import is one line of history with every call answered right below the answer
that made it; what a model is sent on resume holds every call and result (checked by the
loopback provider's own pairing rules); the compaction is a marker; what is left out is
in the report.
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client, TestCase, override_settings
from PIL import Image

from conversations import selectors, services
from conversations.forms import ImportForm
from conversations.importers import ImportReport, Limits, transcript_import
from conversations.importers.base import FORMATS, parse_time
from conversations.importers.reading import detect_format, record_format
from conversations.models import Conversation, Message
from conversations.providers.convert import to_anthropic, to_openai
from conversations.providers.fake import anthropic_pairing_error, openai_pairing_error
from conversations.services import transcript_resume
from tests import codex_server
from tests.builders import calls_and_answers, make_user
from tests.sample_loaders import SAMPLES, requires_samples

DATA = Path(__file__).parent / "data" / "codex"
PARALLEL = DATA / "codex-parallel.jsonl"
COMPACTED = DATA / "codex-compacted.jsonl"
SESSIONS = Path(__file__).parent / "data" / "sessions"


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_records(rows: list[dict[str, Any]]) -> Path:
    path = Path(tempfile.mkdtemp()) / "rollout.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def items(rows: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [
        r["payload"] for r in rows if r["type"] == "response_item" and r["payload"]["type"] == kind
    ]


def item(kind: str, **payload: Any) -> dict[str, Any]:
    return {
        "timestamp": "2026-12-02T07:00:00.000Z",
        "type": "response_item",
        "payload": {"type": kind, **payload},
    }


def text_of(message: Message) -> str:
    return "\n".join(p["text"] for p in message.parts if p["type"] == "text")


def png_data_url() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (4, 3), (200, 10, 10)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


class CodexChecks(TestCase):
    def imported(self, path: Path, fmt: str = "auto") -> tuple[ImportReport, Conversation]:
        user = make_user(f"codex{Conversation.objects.count()}")
        report = transcript_import(owner_id=user.pk, path=path, format=fmt)
        (conversation,) = Conversation.objects.filter(pk__in=report.conversation_ids)
        return report, conversation

    def path(self, conversation: Conversation) -> list[Message]:
        return selectors.message_path(conversation_id=conversation.pk, tip_id=conversation.tip_id)

    def assert_one_line(
        self, report: ImportReport, conversation: Conversation, rows: list[dict[str, Any]]
    ) -> list[Message]:
        """One line of history; every call of the file on it, answered by the tool
        messages right below its answer; the report's counts are the path's; the resume
        view sends every call and result, paired by both providers' rules."""
        calls = [c["call_id"] for c in items(rows, "function_call")]
        self.assertTrue(calls)
        messages = list(Message.objects.filter(conversation=conversation))
        parents = {m.parent_id for m in messages}
        leaves = [m for m in messages if m.id not in parents]
        self.assertEqual([m.id for m in leaves], [conversation.tip_id], "not one line")
        path = self.path(conversation)
        self.assertEqual(len(path), len(messages))
        made = [p["id"] for m in path for p in m.parts if p["type"] == "tool_call"]
        self.assertEqual(made, calls)
        answers = calls_and_answers(path)
        self.assertTrue(answers)
        for ids, run in answers:
            self.assertEqual(run, ids)
        (summary,) = report.conversations
        self.assertEqual((summary.roots, summary.leaves), (1, 1))
        self.assertEqual(summary.tool_calls, len(calls))
        self.assertEqual((summary.tool_pairs, summary.tool_pairs_elsewhere), (len(calls), 0))
        self.assertEqual(summary.flagged.as_list(), [])
        wire, resume = transcript_resume(conversation=conversation, tip_id=conversation.tip_id)
        self.assertEqual((resume.trimmed, resume.repaired), ([], []))
        self.assertEqual(len(wire), len(path))
        anthropic = to_anthropic(wire).messages
        self.assertIsNone(anthropic_pairing_error(anthropic))
        uses = [b["id"] for m in anthropic for b in m["content"] if b["type"] == "tool_use"]
        answers = [
            b["tool_use_id"] for m in anthropic for b in m["content"] if b["type"] == "tool_result"
        ]
        self.assertEqual((uses, sorted(answers)), (calls, sorted(calls)))
        openai = to_openai(wire).messages
        self.assertIsNone(openai_pairing_error(openai))
        self.assertEqual(sum(1 for m in openai if m["role"] == "tool"), len(calls))
        return path

    def skipped(self, report: ImportReport) -> list[dict[str, str]]:
        (summary,) = report.conversations
        return summary.skipped.as_list()

    def check_parallel(self, path_to_file: Path) -> None:
        rows = records(path_to_file)
        # The file is the layout in question: two calls made at once (before any output),
        # a second turn appended by `codex exec resume`.
        kinds = [r["payload"]["type"] for r in rows if r["type"] == "response_item"]
        first_output = kinds.index("function_call_output")
        self.assertEqual(kinds[:first_output].count("function_call"), 2)
        self.assertEqual(sum(1 for r in rows if r["type"] == "turn_context"), 2)
        report, conversation = self.imported(path_to_file)
        self.assertEqual(report.format, "codex")
        path = self.assert_one_line(report, conversation, rows)
        self.assertEqual(
            [m.role for m in path],
            [
                "system",
                "user",
                "user",
                "assistant",
                "tool",
                "tool",
                "assistant",
                "user",
                "assistant",
            ],
        )
        developer, environment, prompt, answer = path[:4]
        # Injected context is kept where the model saw it, marked.
        self.assertEqual(developer.metadata["codex_role"], "developer")
        self.assertEqual(developer.metadata["codex_context"], "skills_instructions")
        self.assertEqual(environment.metadata["codex_context"], "environment_context")
        self.assertTrue(environment.metadata["meta"])
        self.assertNotIn("codex_context", prompt.metadata)
        self.assertEqual(text_of(prompt), codex_server.PROMPT)
        self.assertEqual(conversation.title, codex_server.PROMPT)
        # The session: its id, its instructions as the system prompt, when it began.
        meta = rows[0]["payload"]
        self.assertEqual(report.conversations[0].source_id, meta["id"])
        self.assertEqual(conversation.system_prompt, meta["base_instructions"]["text"])
        self.assertEqual(developer.metadata["codex_session"]["cli_version"], meta["cli_version"])
        record = next(
            r
            for r in rows
            if r["type"] == "response_item"
            and r["payload"].get("id") == (prompt.metadata["source"]["id"])
        )
        self.assertEqual(prompt.created_at, parse_time(record["timestamp"]))
        # One response, one message: reasoning summary, then both calls; model and usage.
        self.assertEqual([p["type"] for p in answer.parts], ["thinking", "tool_call", "tool_call"])
        self.assertEqual(answer.parts[0]["text"], codex_server.REASONING)
        self.assertEqual(answer.parts[1]["arguments"], {"cmd": "echo letter alpha"})
        self.assertEqual(answer.metadata["model"], codex_server.MODEL)
        self.assertEqual(answer.metadata["usage"]["input_tokens"], 1000)
        results = [m.parts[0] for m in path if m.role == "tool"]
        self.assertIn("letter alpha", results[0]["parts"][0]["text"])
        self.assertIn("letter beta", results[1]["parts"][0]["text"])
        self.assertEqual(text_of(path[6]), codex_server.FINAL)
        self.assertEqual(text_of(path[7]), codex_server.RESUME_PROMPT)
        self.assertEqual(text_of(path[8]), codex_server.RESUMED)
        # What was left out is in the report.
        skipped = self.skipped(report)
        kinds_skipped = {i["kind"] for i in skipped}
        self.assertIn("encrypted_reasoning", kinds_skipped)
        listed = next(i["detail"] for i in skipped if i["kind"] == "not_a_message")
        self.assertIn("event_msg/task_complete ×2", listed)
        self.assertIn("world_state", listed)

    def check_compacted(self, path_to_file: Path) -> None:
        rows = records(path_to_file)
        (compacted,) = [r["payload"] for r in rows if r["type"] == "compacted"]
        answers = [
            r
            for r in rows
            if r["type"] == "response_item" and (r.get("metadata") or {}).get("compaction_output")
        ]
        self.assertEqual(len(answers), 1)
        report, conversation = self.imported(path_to_file)
        path = self.assert_one_line(report, conversation, rows)
        self.assertEqual(
            [m.role for m in path],
            ["system", "user", "user", "assistant", "tool", "tool", "system", "assistant"],
        )
        marker = path[6]
        self.assertEqual(
            marker.metadata["compaction_marker"],
            {
                "format": "codex",
                "summary_included": True,
                "replacement_history": len(compacted["replacement_history"]),
                "summary_usage": marker.metadata["compaction_marker"]["summary_usage"],
            },
        )
        self.assertIn(codex_server.SUMMARY, text_of(marker))
        self.assertIn(compacted["message"], text_of(marker))
        self.assertEqual(report.conversations[0].compaction_markers, 1)
        # The summariser's answer is said once, in the marker, and the report says so.
        self.assertFalse(any(text_of(m) == codex_server.SUMMARY for m in path))
        self.assertEqual(text_of(path[7]), codex_server.FINAL)
        skipped = self.skipped(report)
        self.assertTrue(any("summariser" in i["detail"] for i in skipped))
        self.assertIn("replacement_history", {i["kind"] for i in skipped})
        wire, _ = transcript_resume(conversation=conversation, tip_id=conversation.tip_id)
        self.assertIn("compaction_marker", wire[6]["metadata"])


class CommittedRolloutTests(CodexChecks):
    def test_the_parallel_rollout_is_one_line(self) -> None:
        self.check_parallel(PARALLEL)

    def test_the_compacted_rollout_has_its_marker(self) -> None:
        self.check_compacted(COMPACTED)

    def test_the_format_is_detected_and_others_are_not_taken(self) -> None:
        limits = Limits.from_settings()
        for path in (PARALLEL, COMPACTED):
            self.assertEqual(detect_format(path, limits=limits), "codex")
        expected = {
            SESSIONS / "pi-parallel.jsonl": "pi",
            SESSIONS / "claude-code-2.1-parallel.jsonl": "claude-code",
        }
        for path, fmt in expected.items():
            self.assertEqual(detect_format(path, limits=limits), fmt, path.name)
        # The envelope alone decides: a typed record without a payload is not Codex's.
        self.assertIsNone(record_format([{"type": "event_msg"}]))
        self.assertEqual(record_format([{"type": "event_msg", "payload": {}}]), "codex")

    @requires_samples
    def test_the_third_party_pi_and_claude_code_samples_are_not_taken(self) -> None:
        limits = Limits.from_settings()
        expected = {
            **{p: "pi" for p in (SAMPLES / "pi").glob("*.jsonl")},
            **{p: "claude-code" for p in (SAMPLES / "claude-code").glob("*.jsonl")},
        }
        self.assertGreaterEqual(len(expected), 2)
        for path, fmt in expected.items():
            self.assertEqual(detect_format(path, limits=limits), fmt, path.name)

    def test_the_format_is_offered_by_the_form_and_the_api(self) -> None:
        self.assertIn("codex", FORMATS)
        self.assertIn(("codex", "codex"), ImportForm().fields["format"].choices)
        user = make_user("api")
        _, secret = services.api_token_create(user=user, name="t")
        client = Client(enforce_csrf_checks=True, HTTP_AUTHORIZATION=f"Bearer {secret}")
        upload = SimpleUploadedFile("rollout.jsonl", PARALLEL.read_bytes())
        with override_settings(ROOT_URLCONF="tests.test_import_api"):
            response = client.post("/api/imports", {"file": upload})
            forced = client.post(
                "/api/imports",
                {"file": SimpleUploadedFile("r.jsonl", COMPACTED.read_bytes()), "format": "codex"},
            )
        self.assertEqual(response.status_code, 201, response.content)
        self.assertEqual(response.json()["format"], "codex")
        self.assertEqual(forced.status_code, 201, forced.content)
        self.assertEqual(forced.json()["conversations"][0]["compaction_markers"], 1)


class VariantTests(CodexChecks):
    """The real file with the items a scripted run does not make added to it."""

    def test_other_tools_images_and_context(self) -> None:
        rows = records(PARALLEL)
        at = next(i for i, r in enumerate(rows) if r["type"] == "turn_context")
        added = [
            item(
                "message",
                role="user",
                content=[
                    {"type": "input_text", "text": "# AGENTS.md instructions for /w\n\nBe terse."}
                ],
            ),
            item(
                "message",
                role="user",
                content=[
                    {"type": "input_text", "text": "What is in this picture?"},
                    {"type": "input_image", "image_url": png_data_url()},
                ],
            ),
            item("custom_tool_call", call_id="call_patch", name="apply_patch", input="*** Begin"),
            item(
                "local_shell_call",
                call_id="call_ls",
                status="completed",
                action={"type": "exec", "command": ["ls"]},
            ),
            item("web_search_call", status="completed", action={"type": "search", "query": "q"}),
            item("custom_tool_call_output", call_id="call_patch", output="Done!"),
            item(
                "function_call_output",
                call_id="call_ls",
                output={"content": "ls: denied", "success": False},
            ),
            item("image_generation_call", id="ig_1"),
            {
                "timestamp": "2026-12-02T07:00:01Z",
                "type": "event_msg",
                "payload": {"type": "error", "message": "stream disconnected"},
            },
            {
                "timestamp": "2026-12-02T07:00:01Z",
                "type": "event_msg",
                "payload": {"type": "turn_aborted", "reason": "interrupted"},
            },
        ]
        rows[at + 1 : at + 1] = added
        report, conversation = self.imported(write_records(rows))
        path = self.path(conversation)
        agents = next(m for m in path if "AGENTS.md" in text_of(m))
        self.assertEqual((agents.role, agents.metadata["codex_context"]), ("user", "agents_md"))
        picture = next(m for m in path if "picture" in text_of(m))
        self.assertEqual([p["type"] for p in picture.parts], ["text", "image"])
        self.assertEqual((picture.parts[1]["width"], picture.parts[1]["height"]), (4, 3))
        tools = next(m for m in path if any(p.get("id") == "call_patch" for p in m.parts))
        self.assertEqual(
            [(p["type"], p.get("name")) for p in tools.parts],
            [("tool_call", "apply_patch"), ("tool_call", "local_shell"), ("text", None)],
        )
        self.assertEqual(tools.parts[0]["arguments"], {"input": "*** Begin"})
        self.assertEqual(tools.parts[1]["arguments"]["command"], ["ls"])
        self.assertEqual(tools.parts[2]["text"], "[web search: q]")
        results = {m.parts[0]["call_id"]: m.parts[0] for m in path if m.role == "tool"}
        self.assertFalse(results["call_patch"]["is_error"])
        self.assertTrue(results["call_ls"]["is_error"])
        self.assertEqual(results["call_ls"]["parts"][0]["text"], "ls: denied")
        (summary,) = report.conversations
        self.assertEqual((summary.tool_pairs, summary.images, summary.flagged.total), (4, 1, 0))
        skipped = summary.skipped.as_list()
        self.assertIn("a image_generation_call item: not supported", [i["detail"] for i in skipped])
        events = [i["detail"] for i in skipped if i["kind"] == "event"]
        self.assertEqual(
            events,
            [
                "a error event (not a message): stream disconnected",
                "a turn_aborted event (not a message): interrupted",
            ],
        )
        self.assertIn("web_search_call", {i["kind"] for i in summary.repaired.as_list()})

    def test_an_unanswered_call_is_flagged_and_trimmed_on_resume(self) -> None:
        rows = records(PARALLEL)
        rows = [
            r
            for r in rows
            if not (
                r["type"] == "response_item"
                and r["payload"].get("call_id") == "call_beta"
                and r["payload"]["type"] == "function_call_output"
            )
        ]
        report, conversation = self.imported(write_records(rows))
        (summary,) = report.conversations
        self.assertEqual((summary.tool_calls, summary.tool_pairs), (2, 1))
        flagged = summary.flagged.as_list()
        self.assertEqual([i["kind"] for i in flagged], ["unpaired_tool_call"])
        self.assertIn("call_beta", flagged[0]["detail"])
        wire, resume = transcript_resume(conversation=conversation, tip_id=conversation.tip_id)
        self.assertTrue(resume.changed)
        sent = [p["id"] for m in wire for p in m["parts"] if p["type"] == "tool_call"]
        self.assertNotIn("call_beta", sent)

    def test_an_older_compacted_record_without_the_summariser_answer(self) -> None:
        """Older CLIs write only ``{"message": summary}``: still a marker, nothing folded."""
        rows = records(PARALLEL)
        at = max(
            i for i, r in enumerate(rows) if r["payload"].get("type") == "function_call_output"
        )
        rows.insert(
            at + 1,
            {
                "timestamp": "2026-12-02T07:00:00Z",
                "type": "compacted",
                "payload": {"message": "Earlier: two echoes ran."},
            },
        )
        report, conversation = self.imported(write_records(rows))
        path = self.assert_one_line(report, conversation, rows)
        marker = path[6]
        self.assertEqual(marker.role, "system")
        self.assertIn("Earlier: two echoes ran.", text_of(marker))
        self.assertEqual(marker.metadata["compaction_marker"]["replacement_history"], None)
        self.assertNotIn("replacement_history", {i["kind"] for i in self.skipped(report)})
        self.assertEqual(text_of(path[7]), codex_server.FINAL)

    def test_a_file_without_response_items_is_reported(self) -> None:
        rows = [r for r in records(PARALLEL) if r["type"] != "response_item"]
        report = transcript_import(owner_id=make_user().pk, path=write_records(rows))
        self.assertEqual(report.conversations, [])
        self.assertEqual([i["kind"] for i in report.skipped.as_list()], ["empty"])


@pytest.mark.slow  # the real Codex CLI (make harness)
class LiveCodexTests(CodexChecks):
    """Today's Codex CLI (pinned in the Makefile's harness target) writes the rollouts
    afresh against the loopback Responses server; the importer reads them whole."""

    def setUp(self) -> None:
        if not codex_server.binary().exists():
            if os.environ.get("CI") == "true":
                self.fail("codex is missing: `make harness` installs it (CI never skips)")
            self.skipTest("codex is not installed (run `make harness`)")
        self.home = Path(tempfile.mkdtemp(prefix="codex-home-"))
        self.addCleanup(shutil.rmtree, self.home, True)

    def test_parallel_calls_and_a_resumed_turn(self) -> None:
        with codex_server.CodexServer() as server:
            path = codex_server.codex_session(self.home, server.base_url, resume=True)
        first = server.requests[0]["body"]
        self.assertTrue(first["parallel_tool_calls"])
        self.assertEqual(len(server.requests), 3)
        self.check_parallel(path)

    def test_a_compaction(self) -> None:
        with codex_server.CodexServer(call_tokens=50_000) as server:
            path = codex_server.codex_session(self.home, server.base_url, compact_limit=20_000)
        prompts = [codex_server.COMPACT_HINT in json.dumps(r["body"]) for r in server.requests]
        self.assertEqual(prompts, [False, True, False])
        self.check_compacted(path)
