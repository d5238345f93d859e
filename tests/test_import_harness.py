"""Session files the real harnesses write today, imported: Claude Code 2.1 writes one
answer with parallel tool calls as several records, hangs each result below its own
call's record and puts hook records in between; pi 0.73 writes one entry per message.
Either way the import is one line of history with every call answered on it, what a
model is sent on resume holds every call and result (checked by the loopback
provider's own pairing rule), and the report's counts are those of the path.

The committed files are in tests/data/sessions (see its README); the live tests run
the CLIs again (installed by `make test`; CI never skips them).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from django.test import TestCase

from conversations import selectors
from conversations.importers import ImportReport, transcript_import
from conversations.models import Conversation, Message
from conversations.providers.convert import to_anthropic
from conversations.providers.fake import FakeLLMServer, anthropic_pairing_error
from conversations.services import transcript_resume
from tests import harness_sessions
from tests.builders import calls_and_answers, make_user

DATA = Path(__file__).parent / "data" / "sessions"
CLAUDE_FILE = DATA / "claude-code-2.1-parallel.jsonl"
PI_FILE = DATA / "pi-parallel.jsonl"
CALLS = sum(len(r) for r in harness_sessions.ROUNDS)


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_records(rows: list[dict[str, Any]]) -> Path:
    path = Path(tempfile.mkdtemp()) / "session.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


class ImportChecks(TestCase):
    def imported(self, path: Path, fmt: str = "auto") -> tuple[ImportReport, Conversation]:
        user = make_user(f"importer{Conversation.objects.count()}")
        report = transcript_import(owner_id=user.pk, path=path, format=fmt)
        (conversation,) = Conversation.objects.filter(pk__in=report.conversation_ids)
        return report, conversation

    def assert_one_line(self, report: ImportReport, conversation: Conversation) -> None:
        rows = list(Message.objects.filter(conversation=conversation))
        parents = {m.parent_id for m in rows}
        leaves = [m for m in rows if m.id not in parents]
        self.assertEqual([m.id for m in leaves], [conversation.tip_id], "not one line")
        path = selectors.message_path(conversation_id=conversation.pk, tip_id=conversation.tip_id)
        self.assertEqual(len(path), len(rows))
        calls = [p["id"] for m in path for p in m.parts if p["type"] == "tool_call"]
        results = [p["call_id"] for m in path for p in m.parts if p["type"] == "tool_result"]
        self.assertEqual(len(calls), CALLS)
        self.assertEqual(sorted(results), sorted(calls))
        # Each answer's results follow it, before the next answer.
        answers = calls_and_answers(path)
        self.assertEqual(len(answers), len(harness_sessions.ROUNDS))
        for made, run in answers:
            self.assertEqual(run, made)
        (summary,) = report.conversations
        self.assertEqual((summary.roots, summary.leaves), (1, 1))
        self.assertEqual((summary.tool_pairs, summary.tool_pairs_elsewhere), (CALLS, 0))
        self.assertEqual(summary.flagged.as_list(), [])
        # What a model is sent on resume: every call and result, paired.
        messages, resume = transcript_resume(conversation=conversation, tip_id=conversation.tip_id)
        self.assertEqual(resume.trimmed, [])
        wire = to_anthropic(messages).messages
        self.assertIsNone(anthropic_pairing_error(wire))
        uses = [b for m in wire for b in m["content"] if b["type"] == "tool_use"]
        self.assertEqual(len(uses), CALLS)


class ClaudeCodeParallelTests(ImportChecks):
    def test_the_committed_session_is_one_line(self) -> None:
        rows = records(CLAUDE_FILE)
        # The file is the layout in question: one answer in several records, results
        # below their own call's record, hook records in between.
        answers = [r for r in rows if r["type"] == "assistant"]
        ids = [r["message"]["id"] for r in answers]
        self.assertLess(len(set(ids)), len(ids))
        result_parents = {
            r["parentUuid"]
            for r in rows
            if r["type"] == "user" and isinstance(r["message"]["content"], list)
        }
        self.assertGreater(len(result_parents), len(harness_sessions.ROUNDS))
        self.assertTrue(any(r["type"] == "attachment" for r in rows))
        report, conversation = self.imported(CLAUDE_FILE)
        self.assertEqual(report.format, "claude-code")
        self.assert_one_line(report, conversation)
        path = selectors.message_path(conversation_id=conversation.pk, tip_id=conversation.tip_id)
        self.assertEqual([m.role for m in path][:2], ["user", "assistant"])
        self.assertIn(harness_sessions.FINAL, path[-1].parts[0]["text"])

    def test_hook_progress_records_between_the_records_of_one_answer(self) -> None:
        """The layout 2.1 also writes: a hook's ``progress`` record between two blocks of
        one answer (the second block's parent is the progress record)."""
        rows = records(CLAUDE_FILE)
        out: list[dict[str, Any]] = []
        for row in rows:
            if row["type"] == "assistant" and row["message"]["content"][0]["type"] == "tool_use":
                progress = {
                    "type": "progress",
                    "uuid": f"progress-{row['uuid']}",
                    "parentUuid": row["parentUuid"],
                    "isSidechain": False,
                    "sessionId": row["sessionId"],
                    "timestamp": row["timestamp"],
                    "data": {"type": "hook_progress", "hookEvent": "PreToolUse"},
                }
                out.append(progress)
                row = dict(row, parentUuid=progress["uuid"])
            out.append(row)
        self.assert_one_line(*self.imported(write_records(out)))

    def test_results_written_in_another_order_keep_the_file_order(self) -> None:
        rows = records(CLAUDE_FILE)
        results = [
            i
            for i, r in enumerate(rows)
            if r["type"] == "user" and isinstance(r["message"]["content"], list)
        ]
        first, second = results[0], results[1]
        rows[first], rows[second] = rows[second], rows[first]
        report, conversation = self.imported(write_records(rows))
        self.assert_one_line(report, conversation)
        path = selectors.message_path(conversation_id=conversation.pk, tip_id=conversation.tip_id)
        order = [m.parts[0]["call_id"] for m in path if m.role == "tool"]
        wanted = [
            rows[i]["message"]["content"][0]["tool_use_id"]
            for i in sorted(results)
            if rows[i]["message"]["content"][0]["tool_use_id"] in order
        ]
        self.assertEqual(order, wanted)

    def test_a_result_run_again_is_a_branch_not_a_second_answer(self) -> None:
        """A second result for a call already answered on the line (a re-run) stays a
        sibling: the report counts the pairs on the path and the one elsewhere."""
        rows = records(CLAUDE_FILE)
        index = next(
            i
            for i, r in enumerate(rows)
            if r["type"] == "user" and isinstance(r["message"]["content"], list)
        )
        again = json.loads(json.dumps(rows[index]))
        again["uuid"] = "re-run-" + again["uuid"]
        rows.append(again)
        report = transcript_import(owner_id=make_user().pk, path=write_records(rows))
        (summary,) = report.conversations
        self.assertEqual(summary.leaves, 2)
        self.assertEqual(summary.tool_pairs + summary.tool_pairs_elsewhere, CALLS + 1)
        conversation = Conversation.objects.get(pk=report.conversation_ids[0])
        path = selectors.message_path(conversation_id=conversation.pk, tip_id=conversation.tip_id)
        on_path = sum(1 for m in path for p in m.parts if p["type"] == "tool_result")
        self.assertEqual(summary.tool_pairs, on_path)

    def test_records_without_parent_ids_are_read_in_file_order(self) -> None:
        rows = [r for r in records(CLAUDE_FILE) if r["type"] in ("user", "assistant")]
        missing = [{k: v for k, v in r.items() if k != "parentUuid"} for r in rows]
        self.assert_one_line(*self.imported(write_records(missing), "claude-code"))
        nulls = [dict(r, parentUuid=None) for r in rows]
        report = transcript_import(
            owner_id=make_user("second").pk, path=write_records(nulls), format="claude-code"
        )
        (summary,) = report.conversations
        self.assertEqual((summary.roots, summary.leaves), (1, 1))
        self.assertIn("file_order", [item["kind"] for item in report.repaired.as_list()])


class PiParallelTests(ImportChecks):
    def test_the_committed_session_is_one_line(self) -> None:
        report, conversation = self.imported(PI_FILE)
        self.assertEqual(report.format, "pi")
        self.assert_one_line(report, conversation)

    def test_results_on_sibling_branches_are_counted_honestly(self) -> None:
        """A tree where the second result hangs beside the first instead of below it:
        only one is on the path, and the report says so (it once counted both)."""
        rows = records(PI_FILE)
        results = [r for r in rows if (r.get("message") or {}).get("role") == "toolResult"]
        results[1]["parentId"] = results[0]["parentId"]
        report = transcript_import(owner_id=make_user().pk, path=write_records(rows))
        (summary,) = report.conversations
        self.assertEqual(summary.leaves, 2)
        self.assertEqual(summary.tool_pairs + summary.tool_pairs_elsewhere, CALLS)
        conversation = Conversation.objects.get(pk=report.conversation_ids[0])
        path = selectors.message_path(conversation_id=conversation.pk, tip_id=conversation.tip_id)
        on_path = sum(1 for m in path for p in m.parts if p["type"] == "tool_result")
        self.assertEqual(summary.tool_pairs, on_path)
        self.assertLess(summary.tool_pairs, CALLS)
        flagged = [i for i in summary.flagged.as_list() if i["kind"] == "unpaired_tool_call"]
        self.assertTrue(flagged)


@pytest.mark.slow  # the real CLIs (make harness)
class LiveHarnessTests(ImportChecks):
    """Today's CLIs write the session files afresh; the importer reads them whole."""

    def setUp(self) -> None:
        for name in ("claude", "pi"):
            if not harness_sessions.binary(name).exists():
                if os.environ.get("CI") == "true":
                    self.fail(f"{name} is missing: `make harness` installs it (CI never skips)")
                self.skipTest(f"{name} is not installed (run `make harness`)")
        self.fake = FakeLLMServer(
            context_window=200_000, responder=harness_sessions.parallel_responder()
        ).start()
        self.addCleanup(self.fake.stop)
        self.home = Path(tempfile.mkdtemp(prefix="harness-home-"))
        self.addCleanup(shutil.rmtree, self.home, True)

    def test_claude_code(self) -> None:
        path = harness_sessions.claude_session(self.home, self.fake.anthropic_base_url)
        self.assert_one_line(*self.imported(path))

    def test_pi(self) -> None:
        path = harness_sessions.pi_session(self.home, self.fake.anthropic_base_url)
        self.assert_one_line(*self.imported(path))
