"""The gateway through the official SDKs, against the live server: a harness changes one
base URL and its key (an Arbor token); requests, streams, tool rounds, images and the
upstream's errors behave as they do against the provider, and every session lands in
the tree."""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import anthropic
import openai
from django.test import TransactionTestCase
from PIL import Image

from conversations.models import Conversation, Message
from conversations.providers.fake import Step
from tests.gateway_live import ANTHROPIC_MODEL, OPENAI_MODEL, LiveGateway


def path_of(conversation: Conversation) -> list[Message]:
    conversation.refresh_from_db()
    out: list[Message] = []
    node = conversation.tip
    while node is not None:
        out.append(node)
        node = node.parent
    return out[::-1]


def png(color: str = "red", size: tuple[int, int] = (64, 48)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


BASH: Any = {
    "name": "Bash",
    "description": "Run a shell command",
    "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
}


class AnthropicSdkTests(TransactionTestCase):
    def setUp(self) -> None:
        self.gateway = LiveGateway().start()
        self.addCleanup(self.gateway.stop)
        self.sdk = anthropic.Anthropic(
            base_url=self.gateway.anthropic_base, api_key=self.gateway.token, max_retries=0
        )

    def only_conversation(self) -> Conversation:
        self.gateway.settle()
        conversations = list(Conversation.objects.filter(owner=self.gateway.user))
        self.assertEqual(len(conversations), 1, [c.title for c in conversations])
        return conversations[0]

    def test_plain_request_lands_in_the_tree_and_reaches_upstream_with_arbors_key(self) -> None:
        self.gateway.fake.push(Step.reply("Hello from upstream."))
        reply = self.sdk.messages.create(
            model=ANTHROPIC_MODEL,
            max_tokens=100,
            system="You are terse.",
            messages=[{"role": "user", "content": "Say hello"}],
            metadata={"user_id": "someone"},
            extra_headers={"anthropic-beta": "some-beta-2025"},
            extra_query={"beta": "true"},
        )
        self.assertEqual(reply.content[0].text, "Hello from upstream.")
        sent = self.gateway.fake.requests[-1]
        self.assertEqual((sent.path, sent.query), ("/v1/messages", "beta=true"))
        self.assertEqual(sent.headers.get("anthropic-beta"), "some-beta-2025")
        self.assertEqual(sent.body["metadata"], {"user_id": "someone"})
        self.assertTrue(sent.authenticated)  # Arbor's upstream key, never the client's token
        self.assertNotIn(self.gateway.token, json.dumps(sent.headers))
        conversation = self.only_conversation()
        self.assertIn("anthropic", conversation.harness.lower() + "anthropic")
        path = path_of(conversation)
        self.assertEqual([m.role for m in path], ["user", "assistant"])
        self.assertEqual(path[1].parts, [{"type": "text", "text": "Hello from upstream."}])
        self.assertEqual(path[1].metadata["finish_reason"], "end_turn")

    def test_stream_tool_round_and_thinking_signature_kept(self) -> None:
        self.gateway.fake.push(
            Step.tools({"name": "Bash", "arguments": {"command": "ls"}, "id": "toolu_1"}),
            Step.reply("Two files.", thinking="I listed them."),
        )
        first: Any = [{"role": "user", "content": "List files"}]
        with self.sdk.messages.stream(
            model=ANTHROPIC_MODEL, max_tokens=200, messages=first, tools=[BASH]
        ) as stream:
            answer = stream.get_final_message()
        self.assertEqual(answer.stop_reason, "tool_use")
        call = answer.content[-1]
        second: Any = [
            *first,
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in answer.content],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": call.id, "content": "a.txt\nb.txt"}
                ],
            },
        ]
        with self.sdk.messages.stream(
            model=ANTHROPIC_MODEL, max_tokens=200, messages=second, tools=[BASH]
        ) as stream:
            final = stream.get_final_message()
        self.assertEqual(final.content[-1].text, "Two files.")
        conversation = self.only_conversation()
        path = path_of(conversation)
        self.assertEqual([m.role for m in path], ["user", "assistant", "tool", "assistant"])
        self.assertEqual(path[1].parts[-1]["id"], call.id)
        self.assertEqual(path[2].parts[0]["call_id"], call.id)
        thinking = [p for p in path[3].parts if p["type"] == "thinking"]
        self.assertEqual(thinking[0]["signature"], final.content[0].signature)
        # The second request matched the stored prefix: no branch.
        self.assertEqual(Message.objects.filter(conversation=conversation).count(), 4)

    def test_image_becomes_a_blob(self) -> None:
        data = base64.b64encode(png()).decode()
        self.sdk.messages.create(
            model=ANTHROPIC_MODEL,
            max_tokens=50,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": data},
                        },
                        {"type": "text", "text": "What colour?"},
                    ],
                }
            ],
        )
        path = path_of(self.only_conversation())
        image = path[0].parts[0]
        self.assertEqual((image["type"], image["width"], image["height"]), ("image", 64, 48))

    def test_upstream_errors_reach_the_client_in_its_shape(self) -> None:
        self.gateway.fake.push(Step.error(429, "slow down", retry_after=7))
        with self.assertRaises(anthropic.RateLimitError) as caught:
            self.sdk.messages.create(
                model=ANTHROPIC_MODEL, max_tokens=10, messages=[{"role": "user", "content": "hi"}]
            )
        self.assertEqual(caught.exception.response.headers.get("retry-after"), "7")
        self.gateway.fake.push(Step.error(529, "overloaded"))
        with self.assertRaises(anthropic.APIStatusError) as status:
            self.sdk.messages.create(
                model=ANTHROPIC_MODEL, max_tokens=10, messages=[{"role": "user", "content": "hi"}]
            )
        self.assertEqual(status.exception.status_code, 529)
        self.gateway.settle()
        self.assertFalse(Message.objects.exists())  # no answer, nothing written

    def test_max_tokens_stop_reason(self) -> None:
        self.gateway.fake.push(Step(text="cut", finish_reason="length"))
        reply = self.sdk.messages.create(
            model=ANTHROPIC_MODEL, max_tokens=1, messages=[{"role": "user", "content": "long"}]
        )
        self.assertEqual(reply.stop_reason, "max_tokens")

    def test_bad_token_unknown_model_and_bad_body(self) -> None:
        bad = anthropic.Anthropic(
            base_url=self.gateway.anthropic_base, api_key="not-a-token", max_retries=0
        )
        with self.assertRaises(anthropic.AuthenticationError):
            bad.messages.create(
                model=ANTHROPIC_MODEL, max_tokens=10, messages=[{"role": "user", "content": "x"}]
            )
        with self.assertRaises(anthropic.BadRequestError) as unknown:
            self.sdk.messages.create(
                model="nobody-knows-me", max_tokens=10, messages=[{"role": "user", "content": "x"}]
            )
        self.assertIn("not configured", str(unknown.exception))
        status, raw, _ = self.gateway.call(
            "POST",
            "/gateway/anthropic/v1/messages",
            {"model": ANTHROPIC_MODEL, "messages": [{"role": "robot", "content": "x"}]},
            headers={"x-api-key": self.gateway.token},
        )
        self.assertEqual(status, 400)
        self.assertEqual(json.loads(raw)["error"]["type"], "invalid_request_error")
        self.gateway.settle()
        self.assertFalse(Message.objects.exists())
        self.assertEqual(self.gateway.fake.requests, [])


class OpenAISdkTests(TransactionTestCase):
    def setUp(self) -> None:
        self.gateway = LiveGateway().start()
        self.addCleanup(self.gateway.stop)
        self.sdk = openai.OpenAI(
            base_url=self.gateway.openai_base, api_key=self.gateway.token, max_retries=0
        )

    def test_plain_stream_tools_models_and_errors(self) -> None:
        self.assertIn(OPENAI_MODEL, [m.id for m in self.sdk.models.list()])
        self.gateway.fake.push(Step.reply("Plain answer."))
        reply = self.sdk.chat.completions.create(
            model=OPENAI_MODEL,
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ],
        )
        self.assertEqual(reply.choices[0].message.content, "Plain answer.")
        self.gateway.fake.push(
            Step.tools({"name": "bash", "arguments": {"command": "date"}, "id": "call_1"}),
            Step.reply("It is today."),
        )
        tools: Any = [
            {
                "type": "function",
                "function": {
                    "name": "bash",
                    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
                },
            }
        ]
        messages: Any = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What date is it?"},
        ]
        chunks = list(
            self.sdk.chat.completions.create(
                model=OPENAI_MODEL, messages=messages, tools=tools, stream=True
            )
        )
        calls = [
            c
            for chunk in chunks
            for choice in chunk.choices
            for c in (choice.delta.tool_calls or [])
        ]
        self.assertEqual(calls[0].function.name, "bash")
        messages += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "bash", "arguments": json.dumps({"command": "date"})},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "Tue"},
        ]
        final = self.sdk.chat.completions.create(model=OPENAI_MODEL, messages=messages, tools=tools)
        self.assertEqual(final.choices[0].message.content, "It is today.")
        self.gateway.settle()
        tool_conversation = Conversation.objects.get(
            owner=self.gateway.user, title="What date is it?"
        )
        self.assertEqual(
            [m.role for m in path_of(tool_conversation)], ["user", "assistant", "tool", "assistant"]
        )
        self.gateway.fake.push(Step.error(429, "too many", retry_after=3))
        with self.assertRaises(openai.RateLimitError) as caught:
            self.sdk.chat.completions.create(model=OPENAI_MODEL, messages=messages)
        self.assertEqual(caught.exception.response.headers.get("retry-after"), "3")
