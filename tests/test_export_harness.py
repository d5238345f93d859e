"""Claude Code and pi session exports: a conversation (any branch of it) written as the
session file each harness writes, so it goes on in the tool.

- Round trips: the real session files the CLIs wrote (tests/data/sessions), the shared
  samples when they are beside the repository (one with a Claude Code compaction after a
  rewind, pi's v1 file with two compactions) and a tree made in Arbor (parallel tool
  calls, an error result, images, signed thinking, an edited prompt, a fork) are exported
  and imported again: the same tree (roles, parts, parents) and the same tip, in their
  own format and across.
- The file itself: the tip's line is the last message line, compaction markers are the
  tool's own records, an inner tip is named so the tool resumes there.
- Real resume: the exported file is handed to the real `claude --resume` and
  `pi --session` against the loopback provider, and the request the tool then sends
  holds the exported branch (texts in order, every tool_use answered by its result in
  the next message, the image bytes) and nothing of the branches beside it.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from django.test import Client
from PIL import Image

from conversations import selectors, services
from conversations.exporters import conversation_export, ordered_messages
from conversations.importers import transcript_import
from conversations.models import Conversation, Message
from conversations.providers.fake import FakeLLMServer, Step, anthropic_pairing_error
from conversations.session_export import claude_project_dir
from tests import harness_sessions
from tests.builders import text
from tests.sample_loaders import SAMPLES, requires_samples
from tests.test_export import ExportSetup

DATA = Path(__file__).parent / "data" / "sessions"
CLAUDE_FILE = DATA / "claude-code-2.1-parallel.jsonl"
PI_FILE = DATA / "pi-parallel.jsonl"
# The third-party samples (tests marked requires_samples read them).
CLAUDE_SAMPLES = [
    SAMPLES / "claude-code/claude-code-log__dag_compact_after_rewind.jsonl",
    SAMPLES / "claude-code/claude-code-viewer__fe5e1c67-53e7-4862-81ae-d0e013e3270b.jsonl",
]
PI_SAMPLES = [SAMPLES / "pi/pi-mono__compact.jsonl"]
FORMATS = ("claude-code", "pi")


def png(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 3), (seed, 90, 40)).save(buf, format="PNG")
    return buf.getvalue()


def rows(content: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in content.decode().splitlines()]


def bash(call_id: str, word: str) -> dict[str, Any]:
    return {
        "type": "tool_call",
        "id": call_id,
        "name": "Bash",
        "arguments": {"command": f"echo letter {word}", "description": f"print {word}"},
    }


def result(call_id: str, value: str, *, error: bool = False, image: str = "") -> dict[str, Any]:
    parts = text(value) + ([{"type": "image", "blob": image}] if image else [])
    return {"type": "tool_result", "call_id": call_id, "is_error": error, "parts": parts}


def agent_tree(owner: Any) -> tuple[Conversation, dict[str, Message]]:
    """An agent conversation made in Arbor: a turn with two parallel Bash calls (one tool
    message holding both results, one of them an error), a call whose result carries an
    image, a second turn, an edited second prompt beside it, the tip moved back to the older
    branch (so it is not the newest leaf)."""
    conv = services.conversation_create(owner=owner, title="Greek letters")
    blob = services.blob_store(owner=owner, data=png(3))
    first = services.turn_append(
        conversation=conv,
        parent_id=None,
        expected_version=0,
        messages=[
            {
                "role": "user",
                "parts": [
                    *text("Check the greek letters."),
                    {"type": "image", "blob": blob.sha256},
                ],
            },
            {
                "role": "assistant",
                "parts": [
                    {"type": "thinking", "text": "Two at once.", "signature": "sig-1"},
                    *text("I'll run these at once."),
                    bash("toolu_alpha", "alpha"),
                    bash("toolu_beta", "beta"),
                ],
                "metadata": {"model": "claude-sonnet-4-5", "finish_reason": "tool_calls"},
            },
            {
                "role": "tool",
                "parts": [
                    result("toolu_alpha", "letter alpha"),
                    result("toolu_beta", "beta failed", error=True),
                ],
            },
            {"role": "assistant", "parts": [bash("toolu_gamma", "gamma")]},
            {
                "role": "tool",
                "parts": [result("toolu_gamma", "letter gamma", image=blob.sha256)],
            },
            {
                "role": "assistant",
                "parts": text("Beta failed; gamma sent a picture."),
                "metadata": {"usage": {"input_tokens": 120, "output_tokens": 9}},
            },
        ],
    )
    answer = Message.objects.get(pk=first.tip)
    second = services.turn_append(
        conversation=conv,
        parent_id=answer.id,
        expected_version=first.version,
        messages=[
            {"role": "user", "parts": text("Now the next letter.")},
            {"role": "assistant", "parts": text("Delta is next.")},
        ],
    )
    prompt, reply = (Message.objects.get(pk=i) for i in second.message_ids)
    edited = services.message_edit(
        conversation=conv,
        message_id=prompt.id,
        parts=text("Skip ahead to omega."),
        expected_version=second.version,
    )
    later = services.turn_append(
        conversation=conv,
        parent_id=edited.tip,
        expected_version=edited.version,
        messages=[{"role": "assistant", "parts": text("Omega is last.")}],
    )
    services.tip_move(conversation=conv, message_id=reply.id, expected_version=later.version)
    conv.refresh_from_db()
    nodes = {
        "answer": answer,
        "prompt": prompt,
        "reply": reply,
        "edited": Message.objects.get(pk=edited.tip),
        "omega": Message.objects.get(pk=later.tip),
    }
    return conv, nodes


class SessionExportCase(ExportSetup):
    """Exports to harness session files."""

    def imported(self, path: Path) -> list[Conversation]:
        report = transcript_import(owner_id=self.user.pk, path=path)
        assert report.conversation_ids, path
        return [Conversation.objects.get(pk=i) for i in report.conversation_ids]

    def reimport(self, content: bytes, fmt: str) -> Conversation:
        path = Path(self.tmp.name) / f"{hashlib.sha256(content).hexdigest()[:12]}.jsonl"
        path.write_bytes(content)
        report = transcript_import(owner_id=self.user.pk, path=path)
        assert report.format == fmt  # detected as the tool's own file
        (cid,) = report.conversation_ids
        return Conversation.objects.get(pk=cid)

    def tree(self, conv: Conversation, tip: Any = None, *, split: bool = False) -> dict[str, Any]:
        """The tree without ids or sibling order: each message as a hash of its role, its
        parts and the hashes of its children; the roots; the path to the tip. ``split``
        reads a tool message of several results as one message per result (pi's)."""

        def units(m: Message) -> list[tuple[str, list[Any]]]:
            if split and m.role == "tool":
                return [("tool", [p]) for p in m.parts]
            return [(m.role, m.parts)]

        messages = ordered_messages(conv)
        children: dict[Any, list[Message]] = {}
        for m in messages:
            children.setdefault(m.parent_id, []).append(m)
        digest: dict[Any, str] = {}
        for m in reversed(messages):  # children before parents
            below = sorted(digest[c.id] for c in children.get(m.id, []))
            for role, parts in reversed(units(m)):
                own = json.dumps([role, parts, below], sort_keys=True)
                below = [hashlib.sha256(own.encode()).hexdigest()]
            digest[m.id] = below[0]
        path = selectors.message_path(conversation_id=conv.pk, tip_id=tip or conv.tip_id)
        return {
            "messages": sum(len(units(m)) for m in messages),
            "path": [u for m in path for u in units(m)],
            "roots": sorted(digest[m.id] for m in children.get(None, [])),
        }

    def assert_round_trip(self, conv: Conversation, fmt: str, tip: Any = None) -> bytes:
        content = conversation_export(conversation=conv, format=fmt, tip=tip).content
        copy = self.reimport(content, fmt)
        split = fmt == "pi"
        self.assertEqual(self.tree(copy, split=split), self.tree(conv, tip, split=split))
        return content


class RoundTripTests(SessionExportCase):
    def check_claude_code(self, files: list[Path]) -> None:
        for sample in files:
            for conv in self.imported(sample):
                with self.subTest(sample=sample.name, conversation=conv.title):
                    self.assert_round_trip(conv, "claude-code")

    def check_pi(self, files: list[Path]) -> None:
        for sample in files:
            (conv,) = self.imported(sample)
            with self.subTest(sample=sample.name):
                self.assert_round_trip(conv, "pi")

    def test_claude_code_sessions_come_back_as_the_same_tree(self) -> None:
        self.check_claude_code([CLAUDE_FILE])

    def test_pi_sessions_come_back_as_the_same_tree(self) -> None:
        self.check_pi([PI_FILE])

    @requires_samples
    def test_the_claude_code_samples_come_back_as_the_same_tree(self) -> None:
        self.check_claude_code(CLAUDE_SAMPLES)

    @requires_samples
    def test_the_pi_sample_comes_back_as_the_same_tree(self) -> None:
        self.check_pi(PI_SAMPLES)

    def test_the_harness_files_cross_over(self) -> None:
        for sample, fmt in ((CLAUDE_FILE, "pi"), (PI_FILE, "claude-code")):
            (conv,) = self.imported(sample)
            with self.subTest(sample=sample.name, into=fmt):
                self.assert_round_trip(conv, fmt)

    def test_a_branched_arbor_conversation_round_trips_at_either_tip(self) -> None:
        conv, nodes = agent_tree(self.user)
        for fmt in FORMATS:
            for tip in (None, nodes["omega"].id):
                with self.subTest(format=fmt, tip=str(tip)):
                    self.assert_round_trip(conv, fmt, tip)

    def test_a_fork_round_trips(self) -> None:
        _, nodes = agent_tree(self.user)
        fork = services.conversation_fork(message=nodes["omega"], owner=self.user)
        for fmt in FORMATS:
            with self.subTest(format=fmt):
                content = self.assert_round_trip(fork, fmt)
                assert b"Delta is next." not in content  # the path only was forked

    def test_what_neither_tool_has_is_said_in_its_nearest_words(self) -> None:
        """A system message is context the model reads in place (a meta user record, a pi
        custom message); unsigned thinking is text to Claude Code (its API refuses
        unsigned thinking). Nothing else of the tree changes."""
        conv = services.conversation_create(owner=self.user, title="System")
        services.turn_append(
            conversation=conv,
            parent_id=None,
            expected_version=0,
            messages=[
                {"role": "system", "parts": text("Answer in French.")},
                {"role": "user", "parts": text("Hello")},
                {
                    "role": "assistant",
                    "parts": [{"type": "thinking", "text": "Be polite."}, *text("Bonjour")],
                },
            ],
        )
        conv.refresh_from_db()
        for fmt in FORMATS:
            with self.subTest(format=fmt):
                content = conversation_export(conversation=conv, format=fmt).content
                copy = self.reimport(content, fmt)
                path = selectors.message_path(conversation_id=copy.pk, tip_id=copy.tip_id)
                assert [(m.role, m.parts) for m in path] == [
                    ("user", text("Answer in French.")),
                    ("user", text("Hello")),
                    (
                        "assistant",
                        [
                            text("Be polite.")[0]
                            if fmt == "claude-code"
                            else {"type": "thinking", "text": "Be polite."},
                            *text("Bonjour"),
                        ],
                    ),
                ]
                meta = path[0].metadata
                assert meta.get("meta") if fmt == "claude-code" else meta["custom_type"]

    def test_exporting_twice_gives_the_same_file(self) -> None:
        conv, nodes = agent_tree(self.user)
        for fmt in FORMATS:
            first = conversation_export(conversation=conv, format=fmt)
            again = conversation_export(conversation=conv, format=fmt)
            other = conversation_export(conversation=conv, format=fmt, tip=nodes["omega"].id)
            assert first == again
            assert first.filename != other.filename  # another branch, another session
            assert re.fullmatch(r"[0-9a-f-]{36}\.jsonl", first.filename)


class FileShapeTests(SessionExportCase):
    def test_claude_code_records_are_what_claude_code_writes(self) -> None:
        conv, _ = agent_tree(self.user)
        export = conversation_export(conversation=conv, format="claude-code", cwd="/work/x")
        lines = rows(export.content)
        session = export.filename.removesuffix(".jsonl")
        records = [r for r in lines if r["type"] in ("user", "assistant")]
        for r in records:
            assert r["sessionId"] == session and r["cwd"] == "/work/x"
            assert r["isSidechain"] is False and r["userType"] == "external"
            assert r["version"] and r["timestamp"].endswith("Z")
        uuids = {r["uuid"] for r in records}
        assert all(r["parentUuid"] in uuids for r in records if r["parentUuid"])
        # One record per block of an answer, sharing the message id.
        first_answer = [r for r in records if r["type"] == "assistant"][:4]
        assert [b["type"] for r in first_answer for b in r["message"]["content"]] == [
            "thinking",
            "text",
            "tool_use",
            "tool_use",
        ]
        assert len({r["message"]["id"] for r in first_answer}) == 1
        assert first_answer[0]["message"]["stop_reason"] == "tool_use"
        assert first_answer[0]["message"]["model"] == "claude-sonnet-4-5"
        # The tool message is one record of its results, chained below the calls.
        (both,) = (r for r in records if "toolUseResult" in r and "letter alpha" in json.dumps(r))
        assert both["parentUuid"] == first_answer[-1]["uuid"]
        assert [b["tool_use_id"] for b in both["message"]["content"]] == [
            "toolu_alpha",
            "toolu_beta",
        ]
        assert both["message"]["content"][0]["content"] == "letter alpha"
        assert both["sourceToolAssistantUUID"] == first_answer[2]["uuid"]
        assert both["toolUseResult"] == "letter alpha\n\nbeta failed"
        assert both["message"]["content"][1]["is_error"] is True
        (gamma,) = (r for r in records if "toolUseResult" in r and "gamma" in json.dumps(r))
        block = gamma["message"]["content"][0]
        assert block["is_error"] is False and gamma["toolUseResult"]["stdout"] == "letter gamma"
        assert [b["type"] for b in block["content"]] == ["text", "image"]
        assert base64.b64decode(block["content"][1]["source"]["data"]) == png(3)
        # The tip's line is the last message line; the pointer after it names it.
        assert records[-1]["message"]["content"][0]["text"] == "Delta is next."
        assert lines[-1] == {
            "type": "last-prompt",
            "lastPrompt": "Now the next letter.",
            "leafUuid": records[-1]["uuid"],
            "sessionId": session,
        }
        assert lines[0] == {
            "type": "summary",
            "summary": "Greek letters",
            "leafUuid": records[-1]["uuid"],
        }

    def test_an_inner_tip_is_named_explicitly(self) -> None:
        conv, nodes = agent_tree(self.user)
        tip = nodes["answer"]
        lines = rows(
            conversation_export(conversation=conv, format="claude-code", tip=tip.id).content
        )
        pointer = lines[-1]
        assert pointer["explicit"] is True
        (named,) = (r for r in lines if r.get("uuid") == pointer["leafUuid"])
        assert named["message"]["content"][0]["text"] == "Beta failed; gamma sent a picture."
        assert lines.index(named) < len(lines) - 2  # its branches follow it
        pi = rows(conversation_export(conversation=conv, format="pi", tip=tip.id).content)
        assert pi[-1]["type"] == "session_info" and pi[-1]["name"] == "Greek letters"
        (entry,) = (e for e in pi if e.get("id") == pi[-1]["parentId"])
        assert entry["message"]["content"][0]["text"] == "Beta failed; gamma sent a picture."

    def test_pi_entries_are_what_pi_writes(self) -> None:
        conv, _ = agent_tree(self.user)
        services.checkpoint_create(conversation=conv, label="letters")
        conv.refresh_from_db()
        export = conversation_export(conversation=conv, format="pi", cwd="/work/x")
        lines = rows(export.content)
        assert lines[0] == {
            "type": "session",
            "version": 3,
            "id": export.filename.removesuffix(".jsonl"),
            "timestamp": lines[0]["timestamp"],
            "cwd": "/work/x",
        }
        entries = {e["id"]: e for e in lines[1:]}
        assert all(e["parentId"] in entries for e in lines[1:] if e["parentId"])
        messages = [e for e in lines if e["type"] == "message"]
        answer = messages[1]["message"]
        assert [b["type"] for b in answer["content"]] == [
            "thinking",
            "text",
            "toolCall",
            "toolCall",
        ]
        assert answer["content"][0]["thinkingSignature"] == "sig-1"
        assert answer["stopReason"] == "toolUse" and answer["model"] == "claude-sonnet-4-5"
        alpha, beta = messages[2], messages[3]
        assert alpha["message"]["role"] == "toolResult" and alpha["message"]["toolName"] == "Bash"
        assert beta["parentId"] == alpha["id"]
        image = messages[0]["message"]["content"][1]
        assert image["type"] == "image" and base64.b64decode(image["data"]) == png(3)
        # The tip last, then the checkpoint as a label, then the title.
        assert messages[-1]["message"]["content"][0]["text"] == "Delta is next."
        label, info = lines[-2:]
        assert label["type"] == "label" and label["label"] == "letters"
        assert label["targetId"] == messages[-1]["id"]
        assert label["parentId"] == messages[-1]["id"] and info["parentId"] == label["id"]
        (copy,) = [self.reimport(export.content, "pi")]
        assert copy.title == "Greek letters"
        assert list(copy.checkpoints.values_list("label", flat=True)) == ["letters"]

    @requires_samples
    def test_compaction_markers_are_the_tools_own_records(self) -> None:
        (conv,) = self.imported(SAMPLES / "pi/pi-mono__compact.jsonl")
        lines = rows(conversation_export(conversation=conv, format="pi").content)
        ids = {e["id"]: e for e in lines[1:]}
        compactions = [e for e in lines if e["type"] == "compaction"]
        assert len(compactions) == 2
        for entry in compactions:
            assert entry["summary"].startswith("# ") and entry["tokensBefore"] > 0
            # pi's own reading of firstKeptEntryIndex: the entry at that position (the
            # second compaction names itself: nothing before it is kept).
            kept = ids[entry["firstKeptEntryId"]]
            assert lines.index(kept) <= lines.index(entry)
        assert ids[compactions[0]["firstKeptEntryId"]]["type"] == "message"
        assert compactions[1]["firstKeptEntryId"] == compactions[1]["id"]

        (conv,) = self.imported(
            SAMPLES / "claude-code/claude-code-log__dag_compact_after_rewind.jsonl"
        )
        lines = rows(conversation_export(conversation=conv, format="claude-code").content)
        (boundary,) = (r for r in lines if r.get("subtype") == "compact_boundary")
        assert boundary["parentUuid"] is None and boundary["logicalParentUuid"]
        (summary,) = (r for r in lines if r.get("parentUuid") == boundary["uuid"])
        assert summary["isCompactSummary"] is True
        # The other tool's markers are read in place, not cut.
        pi_lines = rows(conversation_export(conversation=conv, format="pi").content)
        assert not [e for e in pi_lines if e["type"] == "compaction"]
        (custom,) = (e for e in pi_lines if e["type"] == "custom_message")
        assert "Conversation compacted here" in custom["content"][0]["text"]

    def test_the_project_dir_is_claude_codes(self) -> None:
        assert claude_project_dir("/home/me/my.project_x") == "-home-me-my-project-x"
        long = claude_project_dir("/" + "a" * 300)
        assert long.startswith("-" + "a" * 199 + "-") and len(long) < 215


class ApiExportTests(SessionExportCase):
    def test_the_endpoint_serves_both_sessions(self) -> None:
        conv, nodes = agent_tree(self.user)
        client = Client()
        client.force_login(self.user)
        url = f"/api/conversations/{conv.pk}/export"
        for fmt in FORMATS:
            response = client.get(url, {"format": fmt, "tip": str(nodes["omega"].id), "cwd": "/w"})
            assert response.status_code == 200, response.content
            assert response["Content-Type"] == "application/x-ndjson"
            name = re.search(r'filename="(.+)"', response["Content-Disposition"])
            assert name and name.group(1).endswith(".jsonl")
            lines = rows(response.content)
            messages = [r for r in lines if r["type"] in ("user", "assistant", "message")]
            assert "Omega is last." in json.dumps(messages[-1])  # the chosen tip, last
            assert all(r.get("cwd", "/w") == "/w" for r in lines)
        bad = client.get(url, {"format": "pi", "cwd": "relative/dir"})
        assert bad.status_code == 422 and bad.json()["error"] == "bad_cwd"
        other, _ = agent_tree(self.user)
        stranger_tip = client.get(url, {"format": "pi", "tip": str(other.tip_id)})
        assert stranger_tip.status_code == 404
        assert client.get(url, {"format": "pi", "tip": "nope"}).status_code == 404


# --- the real CLIs ---------------------------------------------------------------------


RESUMED = "Resumed where the export left off."


def flat_texts(message: Mapping[str, Any]) -> list[str]:
    content = message.get("content")
    if isinstance(content, str):
        return [content]
    out: list[str] = []
    for block in content or []:
        if block.get("type") == "text":
            out.append(block["text"])
        elif block.get("type") == "tool_result":
            inner = block.get("content")
            out += [inner] if isinstance(inner, str) else [b.get("text", "") for b in inner or []]
    return out


class HarnessResumeCase(SessionExportCase):
    cli = ""

    def setUp(self) -> None:
        if not harness_sessions.binary(self.cli).exists():
            if os.environ.get("CI") == "true":
                self.fail(f"{self.cli} is missing: `make harness` installs it (CI never skips)")
            self.skipTest(f"{self.cli} is not installed (run `make harness`)")
        self.fake = FakeLLMServer(
            context_window=1_000_000, responder=lambda protocol, body: Step.reply(RESUMED)
        ).start()
        self.addCleanup(self.fake.stop)
        self.home = Path(tempfile.mkdtemp(prefix="resume-home-"))
        self.addCleanup(shutil.rmtree, self.home, True)
        self.work = Path(os.path.realpath(self.home)) / "project"
        self.work.mkdir()

    def run_cli(self, command: list[str], env: Mapping[str, str]) -> None:
        done = subprocess.run(
            [str(harness_sessions.binary(self.cli)), *command],
            env={**os.environ, "HOME": str(self.home), **env},
            cwd=self.work,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0 and RESUMED in done.stdout, (
            f"{self.cli} failed ({done.returncode}): {done.stdout[-800:]} {done.stderr[-2000:]}"
        )

    def sent(self) -> list[dict[str, Any]]:
        """The messages of the tool's main request (the one that offers tools)."""
        main = [r for r in self.fake.requests if r.status == 200 and r.body.get("tools")]
        assert main, [r.path for r in self.fake.requests]
        messages = main[-1].body["messages"]
        assert anthropic_pairing_error(messages) is None
        return list(messages)

    def assert_holds(self, messages: list[dict[str, Any]], conv: Conversation, tip: Any) -> None:
        """The request holds the exported path, in order, and the final prompt."""
        path = selectors.message_path(conversation_id=conv.pk, tip_id=tip)
        expected = [
            t
            for m in path
            for p in m.parts
            for t in (
                [p["text"]]
                if p["type"] == "text"
                else [q["text"] for q in p["parts"] if q["type"] == "text"]
                if p["type"] == "tool_result"
                else []
            )
        ]
        sent = [t for m in messages for t in flat_texts(m)]
        position = 0
        for wanted in expected:
            found = next((i for i in range(position, len(sent)) if wanted in sent[i]), None)
            assert found is not None, f"{wanted!r} missing or out of order in {sent}"
            position = found
        assert "continue" in sent[-1]
        # Every call of the path is in the request, each answered in the next message.
        calls = [p["id"] for m in path for p in m.parts if p["type"] == "tool_call"]
        uses = [
            b["id"]
            for m in messages
            if m["role"] == "assistant" and isinstance(m["content"], list)
            for b in m["content"]
            if b["type"] == "tool_use"
        ]
        assert uses == calls
        images = [
            b
            for m in messages
            if isinstance(m["content"], list)
            for b in m["content"]
            for b in ([b] + (b.get("content") if isinstance(b.get("content"), list) else []))
            if b.get("type") == "image"
        ]
        assert [base64.b64decode(b["source"]["data"]) for b in images] == [png(3), png(3)]


class ClaudeCodeResumeTests(HarnessResumeCase):
    cli = "claude"

    def resume(self, conv: Conversation, tip: Any = None) -> tuple[list[dict[str, Any]], Path]:
        export = conversation_export(
            conversation=conv, format="claude-code", tip=tip, cwd=str(self.work)
        )
        project = self.home / ".claude" / "projects" / claude_project_dir(str(self.work))
        project.mkdir(parents=True)
        path = project / export.filename
        path.write_bytes(export.content)
        session = export.filename.removesuffix(".jsonl")
        self.run_cli(
            [
                *("--resume", session, "-p", "continue"),
                *("--model", harness_sessions.MODEL, "--allowedTools", "Bash"),
            ],
            {
                "ANTHROPIC_BASE_URL": self.fake.anthropic_base_url,
                "ANTHROPIC_API_KEY": "x",
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            },
        )
        return self.sent(), path

    def test_it_resumes_at_the_exported_tip(self) -> None:
        conv, _ = agent_tree(self.user)
        messages, path = self.resume(conv)
        self.assert_holds(messages, conv, conv.tip_id)
        sent = json.dumps(messages)
        assert "Omega" not in sent and "Skip ahead" not in sent  # the branch beside it
        # Claude Code went on in the same file (so the project dir was its own).
        assert RESUMED in path.read_text()

    def test_it_resumes_at_an_inner_tip(self) -> None:
        conv, nodes = agent_tree(self.user)
        messages, _ = self.resume(conv, nodes["answer"].id)
        self.assert_holds(messages, conv, nodes["answer"].id)
        assert "Delta is next." not in json.dumps(messages)

    @requires_samples
    def test_it_starts_again_at_its_own_compaction(self) -> None:
        (conv,) = self.imported(
            SAMPLES / "claude-code/claude-code-log__dag_compact_after_rewind.jsonl"
        )
        messages, _ = self.resume(conv)
        sent = json.dumps(messages)
        assert "This session is being continued" in sent and "After compaction" in sent
        texts = [t for m in messages for t in flat_texts(m)]
        assert "Keep going" not in texts and "Start" not in texts  # before the boundary


class PiResumeTests(HarnessResumeCase):
    cli = "pi"

    def resume(self, conv: Conversation, tip: Any = None) -> tuple[list[dict[str, Any]], Path]:
        export = conversation_export(conversation=conv, format="pi", tip=tip, cwd=str(self.work))
        agent = self.home / ".pi" / "agent"
        sessions = agent / "sessions"
        sessions.mkdir(parents=True)
        provider = {
            "baseUrl": self.fake.anthropic_base_url,
            "api": "anthropic-messages",
            "apiKey": "x",
            "models": [
                {
                    "id": harness_sessions.MODEL,
                    # Wide enough that pi does not compact the long sample again.
                    "contextWindow": 1_000_000,
                    "maxTokens": 4096,
                    "reasoning": False,
                    "input": ["text", "image"],
                }
            ],
        }
        (agent / "models.json").write_text(json.dumps({"providers": {"loopback": provider}}))
        path = sessions / export.filename
        path.write_bytes(export.content)
        self.run_cli(
            [
                *("--session", str(path), "-p", "continue"),
                *("--provider", "loopback", "--model", harness_sessions.MODEL),
            ],
            {"PI_OFFLINE": "1"},
        )
        return self.sent(), path

    def test_it_resumes_at_the_exported_tip(self) -> None:
        conv, _ = agent_tree(self.user)
        messages, path = self.resume(conv)
        self.assert_holds(messages, conv, conv.tip_id)
        sent = json.dumps(messages)
        assert "Omega" not in sent and "Skip ahead" not in sent
        assert RESUMED in path.read_text()  # pi went on in the exported file

    def test_it_resumes_at_an_inner_tip(self) -> None:
        conv, nodes = agent_tree(self.user)
        messages, _ = self.resume(conv, nodes["answer"].id)
        self.assert_holds(messages, conv, nodes["answer"].id)
        assert "Delta is next." not in json.dumps(messages)

    @requires_samples
    def test_it_keeps_what_its_own_compaction_kept(self) -> None:
        (conv,) = self.imported(SAMPLES / "pi/pi-mono__compact.jsonl")
        assert conv.tip is not None and conv.tip.parent_id is not None
        # Below the first compaction, before the second: pi sends the first summary, the
        # entries from the one it kept (its 573rd) on, and what came after.
        messages, _ = self.resume(conv, conv.tip.parent_id)
        sent = json.dumps(messages)
        assert "Context Checkpoint Summary" in sent
        assert "toolu_01LQqA2C3y1MhtM81dWvgtcR" in sent  # the first entry kept
        assert "toolu_01KPK1STCChrYnRWRxVY4cWY" not in sent  # the one before it
        assert "Done. Removed the" in json.dumps(messages[-3:])
