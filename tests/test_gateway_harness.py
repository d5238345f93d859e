"""Real harnesses, unmodified, through the gateway: Claude Code and pi from the npm
registry (installed by `make test` into var/harness), in print mode, their real Bash
tool running a scripted upstream agent's 40 rounds of ~3.4 KB output each. The upstream
enforces a window counted its own way (more than Arbor's estimate); talking to it
directly, both harnesses fail before round 40 (Claude Code: "Prompt is too long"; pi:
exit 0 and no answer). Through Arbor they finish, the upstream never sees a request
over its window, and the tree holds every message the harness's own session file does.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest
from django.test import TransactionTestCase

from compaction.models import CompactionRecord, RecordStatus
from conversations.importers import transcript_import
from conversations.models import Conversation, Message
from tests import harness_sessions
from tests.gateway_live import ANTHROPIC_MODEL, OPENAI_MODEL, LiveGateway, agent_responder
from tests.test_asgi_streaming import ROOT

# The real agent CLIs through a live gateway, tens of rounds each.
pytestmark = pytest.mark.slow

HARNESS_DIR = Path(os.environ.get("ARBOR_HARNESS_DIR", ROOT / "var" / "harness"))
ROUNDS = 40
# Claude Code's system prompt and 24 tool definitions are ~40,000 tokens by the fake's
# count on their own: the window leaves room for ~25 rounds of history.
CLAUDE_WINDOW = 70_000
PI_WINDOW = 20_000
PROMPT = "Run the rounds the tool asks for."


def harness(test: TransactionTestCase, name: str) -> str:
    path = HARNESS_DIR / "node_modules" / ".bin" / name
    if not path.exists():
        if os.environ.get("CI") == "true":
            test.fail(f"{path} is missing: `make harness` installs it (CI never skips)")
        test.skipTest(f"{name} is not installed (run `make harness`)")
    return str(path)


def path_of(conversation: Conversation, tip: Any = None) -> list[Message]:
    conversation.refresh_from_db()
    node = tip or conversation.tip
    out: list[Message] = []
    while node is not None:
        out.append(node)
        node = node.parent
    return out[::-1]


# Claude Code adds <system-reminder> notes to what it sends the model (inside tool
# results too) and leaves them out of its session file; the gateway keeps what was sent.
REMINDER = re.compile(r"\s*<system-reminder>.*?</system-reminder>\s*", re.S)


def said(text: str) -> str:
    return REMINDER.sub("\n", text).strip()


def moves(path: list[Message]) -> list[tuple[Any, ...]]:
    """What an agent session did, message by message: assistant text and tool calls
    (id, name, arguments), tool results (id and text)."""
    out: list[tuple[Any, ...]] = []
    for m in path:
        if m.role == "assistant":
            texts = said("".join(p["text"] for p in m.parts if p["type"] == "text"))
            calls = tuple(
                (p["id"], p["name"], json.dumps(p["arguments"], sort_keys=True))
                for p in m.parts
                if p["type"] == "tool_call"
            )
            if texts or calls:
                out.append(("assistant", texts, calls))
        elif m.role == "tool":
            for p in m.parts:
                text = said("".join(q.get("text", "") for q in p["parts"]))
                out.append(("tool", p["call_id"], text))
    return out


def user_texts(path: list[Message]) -> list[str]:
    return [
        "".join(p.get("text", "") for p in m.parts if p["type"] == "text")
        for m in path
        if m.role == "user"
    ]


class HarnessChecks(TransactionTestCase):
    gateway: LiveGateway

    def check_upstream(self, window: int) -> None:
        requests = self.gateway.fake.requests
        self.assertTrue(requests)
        over = [r.prompt_tokens for r in requests if (r.prompt_tokens or 0) > window]
        self.assertEqual(over, [], "the upstream received requests over its window")
        rejected = [json.dumps(r.body, sort_keys=True) for r in requests if (r.status or 0) >= 400]
        self.assertEqual(len(rejected), len(set(rejected)), "a rejected payload was resent")

    def check_steps(self, conversation: Conversation) -> None:
        """Compaction ran in steps, each a record, and between steps the forwarded
        prefix was byte-identical, with a cache breakpoint at its end."""
        records = CompactionRecord.objects.filter(
            conversation=conversation, status=RecordStatus.READY
        )
        self.assertGreaterEqual(records.count(), 2)
        self.assertTrue(all("snapshot" in r.rung_names for r in records))
        bodies = [
            r.body["messages"]
            for r in self.gateway.fake.requests
            if r.status == 200 and r.body.get("tools")
        ]
        anthropic = self.gateway.fake.requests[0].protocol == "anthropic"
        stable = 0
        for a, b in itertools.pairwise(bodies):
            common = 0
            while common < min(len(a), len(b)) and a[common] == b[common]:
                common += 1
            prefix = a[:common]
            if any(_has_image(m) for m in prefix) and json.dumps(prefix) == json.dumps(b[:common]):
                self.assertTrue(not anthropic or any(_has_breakpoint(m) for m in prefix))
                stable += 1
        self.assertGreater(stable, records.count(), "no request reused the previous prefix")


def _has_breakpoint(message: dict[str, Any]) -> bool:
    content = message.get("content")
    return isinstance(content, list) and any(
        isinstance(b, dict) and "cache_control" in b for b in content
    )


def _has_image(message: dict[str, Any]) -> bool:
    content = message.get("content")
    return isinstance(content, list) and any(
        isinstance(b, dict) and b.get("type") in ("image", "image_url") for b in content
    )


class ClaudeCodeTests(HarnessChecks):
    def setUp(self) -> None:
        self.claude = harness(self, "claude")
        self.gateway = LiveGateway(window=CLAUDE_WINDOW, responder=agent_responder(ROUNDS)).start()
        self.addCleanup(self.gateway.stop)
        self.home = tempfile.mkdtemp(prefix="claude-home-")

    def run_claude(self, prompt: str, *extra: str) -> subprocess.CompletedProcess[str]:
        env = dict(
            os.environ,
            HOME=self.home,
            ANTHROPIC_BASE_URL=self.gateway.anthropic_base,
            ANTHROPIC_API_KEY=self.gateway.token,
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        )
        return subprocess.run(
            [
                self.claude,
                *extra,
                "-p",
                prompt,
                "--allowedTools",
                "Bash",
                "--model",
                ANTHROPIC_MODEL,
            ],
            env=env,
            cwd=self.home,
            capture_output=True,
            text=True,
            timeout=600,
        )

    def main_conversation(self) -> Conversation:
        self.gateway.settle()
        found = [
            c
            for c in Conversation.objects.filter(owner=self.gateway.user)
            if c.harness.startswith("claude-cli/")
            and Message.objects.filter(conversation=c, role="tool").exists()
        ]
        self.assertEqual(len(found), 1, [(c.title, c.harness) for c in found])
        return found[0]

    def test_forty_rounds_finish_and_the_tree_matches_its_own_session_file(self) -> None:
        done = self.run_claude(PROMPT)
        self.assertEqual(done.returncode, 0, done.stderr[-2000:])
        self.assertIn(f"FINISHED {ROUNDS} rounds", done.stdout)
        self.assertNotIn("prompt is too long", (done.stdout + done.stderr).lower())
        self.check_upstream(CLAUDE_WINDOW)
        conversation = self.main_conversation()
        self.check_steps(conversation)
        ours = path_of(conversation)
        self.assertEqual(sum(1 for m in ours if m.role == "tool"), ROUNDS)

        # Claude Code's own session file, imported, says the same thing.
        files = list(Path(self.home, ".claude", "projects").rglob("*.jsonl"))
        self.assertEqual(len(files), 1, files)
        report = transcript_import(owner_id=self.gateway.user.pk, path=files[0])
        imported = Conversation.objects.get(pk=report.conversation_ids[0])
        theirs = path_of(imported)
        self.assertEqual(moves(ours), moves(theirs))
        self.assertTrue(any(PROMPT in text for text in user_texts(ours)))

        # --continue appends to the same conversation.
        before = Message.objects.filter(conversation=conversation).count()
        more = self.run_claude("Now say you are done.", "--continue")
        self.assertEqual(more.returncode, 0, more.stderr[-2000:])
        self.assertEqual(self.main_conversation().pk, conversation.pk)
        after = path_of(conversation)
        self.assertGreater(len(after), len(ours))
        self.assertEqual([m.pk for m in after[: len(ours)]], [m.pk for m in ours])
        self.assertTrue(any("Now say you are done." in t for t in user_texts(after)))
        self.assertGreater(Message.objects.filter(conversation=conversation).count(), before)

    def test_an_edited_replay_branches_and_both_branches_stay(self) -> None:
        self.gateway.fake.responder = agent_responder(2)
        self.assertEqual(self.run_claude("First task.").returncode, 0)
        self.assertEqual(self.run_claude("Second task.", "--continue").returncode, 0)
        conversation = self.main_conversation()
        tip_before = path_of(conversation)[-1]
        # Replay Claude Code's last request with the second task edited, as a rewind
        # and edit in the harness sends it.
        last = [r.body for r in self.gateway.fake.requests if r.body.get("tools")][-1]
        edited = json.loads(json.dumps(last).replace("Second task.", "Second task, edited."))
        status, raw, _ = self.gateway.call(
            "POST",
            "/gateway/anthropic/v1/messages",
            edited,
            headers={"x-api-key": self.gateway.token, "anthropic-version": "2023-06-01"},
        )
        self.assertEqual(status, 200, raw[:500])
        self.assertEqual(self.main_conversation().pk, conversation.pk)
        new_path = path_of(conversation)
        self.assertTrue(any("Second task, edited." in t for t in user_texts(new_path)))
        # The old branch is still there, whole.
        old_path = path_of(conversation, tip_before)
        self.assertTrue(any("Second task." in t for t in user_texts(old_path)))
        common = [a.pk for a, b in zip(old_path, new_path, strict=False) if a.pk == b.pk]
        self.assertGreater(len(common), 0)
        self.assertLess(len(common), len(old_path))


class ClaudeCodeSubAgentTests(TransactionTestCase):
    """A sub-agent (Claude Code's Agent tool) sends its own system prompt and tools
    under the parent's session id: it lands as its own conversation, linked to the
    parent's message holding the call that started it."""

    def test_the_sub_agent_s_conversation_is_linked_to_its_call(self) -> None:
        claude = harness(self, "claude")
        gateway = LiveGateway(responder=harness_sessions.subagent_responder()).start()
        self.addCleanup(gateway.stop)
        home = Path(tempfile.mkdtemp(prefix="claude-sub-"))
        project = harness_sessions.claude_subagent_project(
            home, gateway.anthropic_base, gateway.token
        )
        assert claude and project.is_dir()
        gateway.settle()
        mine = Conversation.objects.filter(owner=gateway.user)
        (sub,) = [c for c in mine if c.spawned_by_id]
        assert sub.spawned_by_id is not None
        parent_message = Message.objects.get(pk=sub.spawned_by_id)
        (call,) = [p for p in parent_message.parts if p["type"] == "tool_call"]
        self.assertEqual(call["name"], "Agent")
        self.assertEqual(sub.spawned_call, call["id"])
        self.assertEqual(sub.title, "Sub-agent: print a letter")
        first = Message.objects.get(conversation=sub, parent=None)
        said = [p["text"] for p in first.parts if p["type"] == "text"]
        self.assertIn(harness_sessions.SUBAGENT_PROMPT, [t.strip() for t in said])
        # The parent went on below the call: its result, then the final answer.
        parent = parent_message.conversation
        path = path_of(parent)
        self.assertIn(parent_message, path)
        self.assertIn(harness_sessions.FINAL, json.dumps(path[-1].parts))
        # The API's detail of the parent lists the sub-agent.
        detail = gateway.call(
            "GET",
            f"/api/conversations/{parent.pk}",
            headers={"Authorization": f"Bearer {gateway.token}"},
        )
        self.assertEqual(detail[0], 200, detail[1][:500])
        body = json.loads(detail[1])
        self.assertEqual([a["id"] for a in body["subagents"]], [str(sub.pk)])


class PiTests(HarnessChecks):
    def setUp(self) -> None:
        self.pi = harness(self, "pi")
        self.gateway = LiveGateway(window=PI_WINDOW, responder=agent_responder(ROUNDS)).start()
        self.addCleanup(self.gateway.stop)

    def run_pi(self, home: str, prompt: str, *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.pi, "--provider", "arbor", "--model", self.model, *extra, "-p", prompt],
            env=dict(os.environ, HOME=home, PI_OFFLINE="1"),
            cwd=home,
            capture_output=True,
            text=True,
            timeout=600,
        )

    def home_for(self, api: str) -> str:
        home = tempfile.mkdtemp(prefix="pi-home-")
        base, self.model = (
            (self.gateway.anthropic_base, ANTHROPIC_MODEL)
            if api == "anthropic-messages"
            else (self.gateway.openai_base, OPENAI_MODEL)
        )
        agent = Path(home, ".pi", "agent")
        agent.mkdir(parents=True)
        provider = {
            "baseUrl": base,
            "api": api,
            "apiKey": self.gateway.token,
            "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False},
            # pi is told of a large window: it never compacts on its own here.
            "models": [
                {
                    "id": self.model,
                    "contextWindow": 1_000_000,
                    "maxTokens": 4096,
                    "reasoning": False,
                    "input": ["text", "image"],
                }
            ],
        }
        (agent / "models.json").write_text(json.dumps({"providers": {"arbor": provider}}))
        return home

    def session(self, api: str) -> None:
        home = self.home_for(api)
        done = self.run_pi(home, PROMPT)
        self.assertEqual(done.returncode, 0, done.stderr[-2000:])
        self.assertIn(f"FINISHED {ROUNDS} rounds", done.stdout)
        self.check_upstream(PI_WINDOW)
        self.gateway.settle()
        conversations = [
            c
            for c in Conversation.objects.filter(owner=self.gateway.user)
            if Message.objects.filter(conversation=c, role="tool").exists()
        ]
        self.assertEqual(len(conversations), 1)
        conversation = conversations[0]
        self.check_steps(conversation)
        ours = path_of(conversation)
        files = list(Path(home, ".pi", "agent", "sessions").rglob("*.jsonl"))
        self.assertEqual(len(files), 1, files)
        report = transcript_import(owner_id=self.gateway.user.pk, path=files[0])
        theirs = path_of(Conversation.objects.get(pk=report.conversation_ids[0]))
        self.assertEqual(moves(ours), moves(theirs))
        self.assertEqual(user_texts(ours), user_texts(theirs))

        more = self.run_pi(home, "Now say you are done.", "--continue")
        self.assertEqual(more.returncode, 0, more.stderr[-2000:])
        self.gateway.settle()
        after = path_of(conversation)
        self.assertEqual([m.pk for m in after[: len(ours)]], [m.pk for m in ours])
        self.assertEqual(user_texts(after)[-1], "Now say you are done.")

    def test_forty_rounds_over_anthropic_messages(self) -> None:
        self.session("anthropic-messages")

    def test_forty_rounds_over_openai_completions(self) -> None:
        self.session("openai-completions")
