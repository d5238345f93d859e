"""What the gateway forwards once a session outgrows the window: the harness's system
prompt, tools, head and tail go out as it sent them, the compacted prefix carries a
cache breakpoint within the provider's limit of four, and after an overflow the
upstream reports (the estimate undercounted) the request is rebuilt from the originals
and retried once, never resent as it was."""

from __future__ import annotations

import json
from typing import Any

from django.test import TransactionTestCase

from compaction.models import CompactionRecord, RecordStatus, Trigger
from conversations.models import Conversation, Message
from conversations.providers.fake import Step, anthropic_overflow
from tests.gateway_live import ANTHROPIC_MODEL, LiveGateway, agent_responder

SYSTEM = [
    {"type": "text", "text": "You are a build agent."},
    {
        "type": "text",
        "text": "Follow the user's constraints exactly.",
        "cache_control": {"type": "ephemeral"},
    },
]
TOOLS = [
    {
        "name": "Bash",
        "description": "Run a command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
        "cache_control": {"type": "ephemeral"},
    }
]
TASK = "Build the project. Constraint: never touch the vendor/ directory."


def output(n: int) -> str:
    return "\n".join(f"round {n} line {i}: compiling module_{i}.c ... ok" for i in range(40))


def breakpoints(value: Any) -> int:
    if isinstance(value, dict):
        own = 1 if "cache_control" in value else 0
        return own + sum(breakpoints(v) for k, v in value.items() if k != "cache_control")
    if isinstance(value, list):
        return sum(breakpoints(v) for v in value)
    return 0


class GatewayCompactionTests(TransactionTestCase):
    rounds = 30

    def start(self, *, window: int, declared: int | None = None) -> None:
        self.gateway = LiveGateway(
            window=window,
            declared_window=declared,
            max_output=1024,
            responder=agent_responder(self.rounds),
        ).start()
        self.addCleanup(self.gateway.stop)

    def run_session(self) -> list[dict[str, Any]]:
        """An agent loop as a harness runs it; returns what it sent, request by request."""
        messages: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
        sent: list[dict[str, Any]] = []
        for _ in range(self.rounds + 1):
            last = messages[-1]
            content = (
                last["content"]
                if isinstance(last["content"], list)
                else [{"type": "text", "text": last["content"]}]
            )
            marked = [
                *messages[:-1],
                {
                    **last,
                    "content": [
                        *content[:-1],
                        {**content[-1], "cache_control": {"type": "ephemeral"}},
                    ],
                },
            ]
            body = {
                "model": ANTHROPIC_MODEL,
                "max_tokens": 1024,
                "system": SYSTEM,
                "tools": TOOLS,
                "messages": marked,
            }
            sent.append(body)
            status, raw, _ = self.gateway.call(
                "POST",
                "/gateway/anthropic/v1/messages",
                body,
                headers={
                    "x-api-key": self.gateway.token,
                    "anthropic-version": "2023-06-01",
                    "user-agent": "build-agent/1.0",
                },
            )
            self.assertEqual(status, 200, raw[:500])
            answer = json.loads(raw)
            messages.append({"role": "assistant", "content": answer["content"]})
            calls = [b for b in answer["content"] if b["type"] == "tool_use"]
            if not calls:
                break
            n = int(calls[0]["input"]["command"].split("ROUND-")[1].split(";")[0])
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": calls[0]["id"],
                            "content": f"ROUND-{n}\n" + output(n),
                        }
                    ],
                }
            )
        self.assertIn("FINISHED", json.dumps(messages[-1]))
        self.gateway.settle()
        return sent

    def test_system_tools_head_and_tail_go_out_as_sent(self) -> None:
        self.start(window=12_000)
        sent = self.run_session()
        # (the rest are the summary rung's own requests, which carry no tools)
        forwarded = [
            r for r in self.gateway.fake.requests if r.status == 200 and r.body.get("tools")
        ]
        self.assertEqual(len(forwarded), len(sent))
        compacted = with_pages = 0
        for client, upstream in zip(sent, forwarded, strict=True):
            body = upstream.body
            self.assertLessEqual(upstream.prompt_tokens or 0, 12_000)
            self.assertEqual(body["system"], client["system"])
            self.assertEqual(body["tools"], client["tools"])
            self.assertEqual(body["messages"][0], client["messages"][0])  # the task
            self.assertEqual(body["messages"][-1], client["messages"][-1])
            self.assertLessEqual(breakpoints(body), 4)
            if body["messages"] != client["messages"]:
                compacted += 1
                text = json.dumps(body["messages"])
                pages = '"type": "image"' in text
                with_pages += pages
                self.assertTrue(pages or "[elided tool result" in text, "compacted how?")
                marked = [i for i, m in enumerate(body["messages"][:-1]) if breakpoints(m)]
                self.assertTrue(marked, "no breakpoint on the compacted prefix")
        self.assertGreater(compacted, 5)
        self.assertGreater(with_pages, 3)
        conversation = Conversation.objects.get(owner=self.gateway.user)
        self.counted = Message.objects.filter(conversation=conversation).count()
        records = CompactionRecord.objects.filter(
            conversation=conversation, status=RecordStatus.READY
        )
        self.assertGreaterEqual(records.count(), 2)
        # Every message of the session is in the tree, on one path.
        self.assertEqual(
            Message.objects.filter(conversation=conversation, role="tool").count(), self.rounds
        )
        self.check_browser_and_fork(conversation)

    def check_browser_and_fork(self, conversation: Conversation) -> None:
        """A gateway conversation is an ordinary one: listed with its harness, its
        context panel shows what went upstream last (with the pages), and a fork of it
        continues as a chat."""
        self.client.force_login(self.gateway.user)
        listing = self.client.get("/").content.decode()
        self.assertIn("via build-agent/1.0", listing)
        panel = self.client.get(f"/c/{conversation.pk}/context/").content.decode()
        self.assertIn("Last request through the gateway", panel)
        self.assertIn('id="gateway-pages"', panel)
        self.assertIn("snapshot page 0", panel)
        bearer = {"authorization": f"Bearer {self.gateway.token}"}
        status, raw, _ = self.gateway.call(
            "POST",
            f"/api/messages/{conversation.tip_id}/fork",
            {"title": "continued"},
            headers=bearer,
        )
        self.assertEqual(status, 201, raw)
        fork = json.loads(raw)["id"]
        status, raw, _ = self.gateway.call(
            "POST",
            f"/api/conversations/{fork}/messages",
            {"parts": [{"type": "text", "text": "Summarise what you built."}]},
            headers=bearer,
        )
        self.assertEqual(status, 201, raw)
        self.gateway.settle()
        self.assertEqual(Message.objects.filter(conversation=conversation).count(), self.counted)

    def test_an_overflow_the_estimate_missed_is_recovered_from_the_originals(self) -> None:
        # Arbor is told of a window twice the one the upstream enforces.
        self.start(window=6_000, declared=12_000)
        self.run_session()
        requests = self.gateway.fake.requests
        rejected = [i for i, r in enumerate(requests) if r.status == 400]
        self.assertTrue(rejected)
        for i in rejected:
            retry = requests[i + 1]
            self.assertEqual(retry.status, 200)
            self.assertNotEqual(retry.body, requests[i].body)
            self.assertLessEqual(retry.prompt_tokens or 0, 6_000)
        bodies = [json.dumps(requests[i].body, sort_keys=True) for i in rejected]
        self.assertEqual(len(bodies), len(set(bodies)))
        self.assertTrue(
            CompactionRecord.objects.filter(
                trigger=Trigger.REACTIVE, status=RecordStatus.READY
            ).exists()
        )


class GatewayRetryOverflowTests(TransactionTestCase):
    def test_a_retry_that_overflows_again_reaches_the_client_as_the_upstreams_error(
        self,
    ) -> None:
        # The upstream rejects the request and then the compacted retry as well (its
        # reported limit was not the one it enforces): one retry only, and the client
        # sees the upstream's own error, never an answer made of a rejected response.
        gateway = LiveGateway(window=200_000).start()
        self.addCleanup(gateway.stop)
        # The second rejection reports a lower limit, so a third, smaller request could be
        # made: it must not be.
        first, rejection = anthropic_overflow(23_306, 16_000), anthropic_overflow(15_000, 10_000)
        gateway.fake.push(Step.error(400, body=first), Step.error(400, body=rejection))
        messages: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
        for n in range(30):
            call = {"type": "tool_use", "id": f"toolu_{n}", "name": "Bash", "input": {}}
            messages.append({"role": "assistant", "content": [call]})
            result = {"type": "tool_result", "tool_use_id": f"toolu_{n}", "content": output(n)}
            messages.append({"role": "user", "content": [result]})
        status, raw, _ = gateway.call(
            "POST",
            "/gateway/anthropic/v1/messages",
            {"model": ANTHROPIC_MODEL, "max_tokens": 256, "tools": TOOLS, "messages": messages},
            headers={"x-api-key": gateway.token, "anthropic-version": "2023-06-01"},
        )
        self.assertEqual(status, 400, raw[:300])
        self.assertEqual(json.loads(raw), rejection)
        requests = gateway.fake.requests
        self.assertEqual(len(requests), 2)  # the request and one compacted retry
        self.assertNotEqual(requests[0].body, requests[1].body)
        gateway.settle()
        # No answer was stored: at most the 30 assistant messages the request carried.
        self.assertLessEqual(Message.objects.filter(role="assistant").count(), 30)
