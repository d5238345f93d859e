"""The gateway under pressure, shaped like Claude Code: a fixed part (system prompt, tool
definitions, the first message's injected context) that takes most of the window, and
an upstream that counts pessimistically (UTF-8 bytes / 3, tool definitions included)
and rejects what does not fit with the provider's real error body.

What must hold (issue 38): every round answered, no request Arbor sends over the
window, pages before any summary, and the forwarded prefix byte-identical between
compaction steps."""

from __future__ import annotations

import itertools
import json
import uuid
from typing import Any

from django.test import TransactionTestCase

from compaction.models import CompactionRecord, RecordStatus
from conversations.models import Conversation
from conversations.providers.fake import Step
from tests.gateway_live import ANTHROPIC_MODEL, LiveGateway, agent_responder

# Claude Code's own system prompt and tool descriptions are tens of kilobytes; these are
# sized like them (bytes / 3 is what the upstream counts).
INSTRUCTIONS = " ".join(
    f"Rule {i}: when you run a command, read its whole output before the next step, "
    "keep the user's constraints, and report what changed."
    for i in range(150)
)
SYSTEM = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332; cc_entrypoint=sdk"},
    {"type": "text", "text": "You are Claude Code, an interactive CLI for software tasks."},
    {"type": "text", "text": INSTRUCTIONS, "cache_control": {"type": "ephemeral"}},
]
BASH = {
    "name": "Bash",
    "description": "Executes a bash command. "
    + " ".join(
        f"Guideline {i}: quote paths with spaces, prefer absolute paths, never use "
        "interactive flags."
        for i in range(60)
    ),
    "input_schema": {
        "type": "object",
        "properties": {"command": {"type": "string"}, "description": {"type": "string"}},
        "required": ["command"],
    },
}
REMINDER = (
    "<system-reminder>\nContents of CLAUDE.md (project instructions):\n"
    + "\n".join(
        f"- convention {i}: tests live in tests/, run them with make test before committing."
        for i in range(80)
    )
    + "\n</system-reminder>"
)
TASK = "Run each round's command and report. Constraint: never touch the vendor/ directory."


def fixed_tokens() -> int:
    """The fixed part as the upstream counts it (bytes / 3)."""
    raw = json.dumps(SYSTEM) + json.dumps([BASH]) + REMINDER + TASK
    return len(raw.encode()) // 3


class ClaudeCodeShapedSession:
    """A Claude Code-like agent loop through the gateway; what it sent and saw."""

    def __init__(self, gateway: LiveGateway, rounds: int) -> None:
        self.gateway = gateway
        self.rounds = rounds
        self.session = str(uuid.uuid4())
        self.errors: list[tuple[int, bytes]] = []
        self.sent: list[dict[str, Any]] = []

    def body(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        last = messages[-1]
        content = last["content"]
        marked = [
            *messages[:-1],
            {
                **last,
                "content": [*content[:-1], {**content[-1], "cache_control": {"type": "ephemeral"}}],
            },
        ]
        return {
            "model": ANTHROPIC_MODEL,
            "max_tokens": 2048,
            "system": SYSTEM,
            "tools": [BASH],
            "metadata": {"user_id": f"user_abc_account__session_{self.session}"},
            "messages": marked,
        }

    def run(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = [
            {
                "role": "user",
                "content": [{"type": "text", "text": REMINDER}, {"type": "text", "text": TASK}],
            }
        ]
        for _ in range(self.rounds + 1):
            body = self.body(messages)
            self.sent.append(body)
            status, raw, _ = self.gateway.call(
                "POST",
                "/gateway/anthropic/v1/messages?beta=true",
                body,
                headers={"x-api-key": self.gateway.token, "anthropic-version": "2023-06-01"},
            )
            if status != 200:
                self.errors.append((status, raw))
                break
            answer = json.loads(raw)
            messages.append({"role": "assistant", "content": answer["content"]})
            calls = [b for b in answer["content"] if b["type"] == "tool_use"]
            if not calls:
                break
            n = int(calls[0]["input"]["command"].split("ROUND-")[1].split(";")[0])
            output = f"ROUND-{n}\n" + "\n".join(
                f"round {n} line {i}: the quick brown fox jumps over the lazy dog 0123456789"
                for i in range(1, 49)
            )
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": calls[0]["id"], "content": output}
                    ],
                }
            )
        self.gateway.settle()
        return messages


def prefix_stable(bodies: list[dict[str, Any]]) -> float:
    """Share of consecutive forwarded requests whose earlier request is a byte-identical
    prefix of the later one, up to its last cache breakpoint (what a provider's prompt
    cache reuses)."""
    if len(bodies) < 2:
        return 1.0
    same = 0
    for before, after in itertools.pairwise(bodies):
        head = before["messages"][:-1]
        if after["messages"][: len(head)] == head and after.get("system") == before.get("system"):
            same += 1
    return same / (len(bodies) - 1)


class ClaudeCodeUnderPressureTests(TransactionTestCase):
    window = 24_000
    rounds = 40

    def setUp(self) -> None:
        self.gateway = LiveGateway(
            window=self.window,
            max_output=4096,
            responder=agent_responder(self.rounds),
            tokenizer="bytes",
        ).start()
        self.addCleanup(self.gateway.stop)

    def test_a_large_fixed_part_compacts_to_pages_not_summaries(self) -> None:
        assert fixed_tokens() > 0.5 * self.window * 0.8 - 4096  # most of the budget
        session = ClaudeCodeShapedSession(self.gateway, self.rounds)
        messages = session.run()
        assert session.errors == [], session.errors[:1]
        assert "FINISHED" in json.dumps(messages[-1])
        requests = self.gateway.fake.requests
        forwarded = [r for r in requests if r.body.get("tools")]
        summaries = [r for r in requests if not r.body.get("tools")]
        # No request Arbor made went over the window, nor was rejected.
        assert all(r.status == 200 for r in requests), [
            (r.status, r.prompt_tokens) for r in requests if r.status != 200
        ]
        assert max(r.prompt_tokens or 0 for r in requests) <= self.window
        assert len(summaries) <= 1, f"{len(summaries)} summary calls in {self.rounds} rounds"
        with_pages = [r for r in forwarded if '"type": "image"' in json.dumps(r.body)]
        assert with_pages, "no request carried snapshot pages"
        # The fixed part went out as sent, every time.
        for r in forwarded:
            assert r.body["system"] == SYSTEM
            assert r.body["tools"] == [BASH]
            head = [
                {k: v for k, v in b.items() if k != "cache_control"}
                for b in r.body["messages"][0]["content"]
            ]
            assert head == [{"type": "text", "text": REMINDER}, {"type": "text", "text": TASK}]
        stable = prefix_stable([r.body for r in forwarded])
        assert stable >= 0.7, stable
        conversation = Conversation.objects.get(owner=self.gateway.user)
        records = CompactionRecord.objects.filter(conversation=conversation)
        assert records.exists()
        # A record is a step that compacted: never one with no rung applied.
        for record in records.filter(status=RecordStatus.READY):
            assert set(record.rung_names) - {"image_limits"}, record.rung_names


class NothingFitsTests(TransactionTestCase):
    def test_a_failed_compaction_never_forwards_the_raw_request(self) -> None:
        """Errors are eventful (never elided), their pages alone are over the window, and
        the summary requests fail: the harness gets the provider's own overflow error,
        naming Arbor's reason, and the upstream never receives the over-window request."""
        gateway = LiveGateway(window=6_000, max_output=1024, tokenizer="bytes").start()
        self.addCleanup(gateway.stop)
        gateway.fake.push(*(Step.error(400, "summaries are switched off") for _ in range(6)))
        messages: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
        for n in range(30):
            call = {"type": "tool_use", "id": f"toolu_{n}", "name": "Bash", "input": {"n": n}}
            failure = "\n".join(
                f"error {n}.{i}: build step {i} failed with code {n * i}" for i in range(60)
            )
            result = {
                "type": "tool_result",
                "tool_use_id": f"toolu_{n}",
                "content": failure,
                "is_error": True,
            }
            messages += [
                {"role": "assistant", "content": [call]},
                {"role": "user", "content": [result]},
            ]
        status, raw, _ = gateway.call(
            "POST",
            "/gateway/anthropic/v1/messages",
            {"model": ANTHROPIC_MODEL, "max_tokens": 256, "tools": [BASH], "messages": messages},
            headers={"x-api-key": gateway.token, "anthropic-version": "2023-06-01"},
        )
        assert status == 400, raw[:300]
        error = json.loads(raw)
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert error["error"]["message"].startswith("prompt is too long: ")
        assert "Arbor could not compact" in error["error"]["message"]
        # Only Arbor's own (summary) requests reached the upstream, none over the window.
        assert gateway.fake.requests, "the summary was never tried"
        assert all(not r.body.get("tools") for r in gateway.fake.requests)
        assert all((r.prompt_tokens or 0) <= 6_000 for r in gateway.fake.requests)


class CountTokensTests(TransactionTestCase):
    def test_count_tokens_counts_what_arbor_would_forward(self) -> None:
        """Claude Code sizes its own compaction from count_tokens: a request Arbor will
        compact is counted at most at the threshold it is compacted below, never at its
        raw size (which would make the harness compact what Arbor handles)."""
        gateway = LiveGateway(window=24_000, max_output=4096, tokenizer="bytes").start()
        self.addCleanup(gateway.stop)
        headers = {"x-api-key": gateway.token, "anthropic-version": "2023-06-01"}
        small = {"model": ANTHROPIC_MODEL, "messages": [{"role": "user", "content": TASK}]}
        status, raw, _ = gateway.call(
            "POST", "/gateway/anthropic/v1/messages/count_tokens", small, headers=headers
        )
        assert status == 200, raw
        assert 0 < json.loads(raw)["input_tokens"] < 100
        messages: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
        for n in range(60):
            call = {"type": "tool_use", "id": f"toolu_{n}", "name": "Bash", "input": {"n": n}}
            output = "\n".join(f"line {i} of round {n}: all good" for i in range(100))
            result = {"type": "tool_result", "tool_use_id": f"toolu_{n}", "content": output}
            messages += [
                {"role": "assistant", "content": [call]},
                {"role": "user", "content": [result]},
            ]
        large = {"model": ANTHROPIC_MODEL, "tools": [BASH], "messages": messages}
        status, raw, _ = gateway.call(
            "POST", "/gateway/anthropic/v1/messages/count_tokens", large, headers=headers
        )
        assert status == 200, raw
        counted = json.loads(raw)["input_tokens"]
        assert len(json.dumps(messages)) // 4 > 24_000  # far over the window as sent
        assert counted < 24_000 - 4096  # what goes upstream fits, with room for the answer
