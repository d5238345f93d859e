"""The OpenAI Responses API through the gateway (issue 37), with the official openai
SDK's ``responses.create`` against the live server and a Chat Completions upstream:
plain and streamed answers, a function-call round, images, errors in the Responses
shape, and the session in the tree like any other."""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import openai
from django.test import TransactionTestCase
from PIL import Image

from conversations.models import Conversation, Message
from conversations.providers.fake import Step, scripted_agent
from tests.gateway_live import OPENAI_MODEL, LiveGateway

SHELL: Any = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
}


def png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), "blue").save(buffer, format="PNG")
    return buffer.getvalue()


class ResponsesSdkTests(TransactionTestCase):
    def setUp(self) -> None:
        self.gateway = LiveGateway().start()
        self.addCleanup(self.gateway.stop)
        self.sdk = openai.OpenAI(
            base_url=self.gateway.openai_base, api_key=self.gateway.token, max_retries=0
        )

    def test_plain_and_streamed_answers_land_in_the_tree(self) -> None:
        self.gateway.fake.push(Step.reply("Hello from upstream."), Step.reply("Streamed hello."))
        answer = self.sdk.responses.create(
            model=OPENAI_MODEL, instructions="Be brief.", input="Say hello."
        )
        assert answer.output_text == "Hello from upstream."
        assert answer.usage is not None and answer.usage.input_tokens > 0
        upstream = self.gateway.fake.requests[-1]
        assert upstream.path.endswith("/chat/completions")
        assert upstream.body["messages"][0] == {"role": "system", "content": "Be brief."}
        assert upstream.authenticated  # with Arbor's key (the fake keeps no credential)
        stream = self.sdk.responses.create(
            model=OPENAI_MODEL,
            instructions="Be brief.",
            input=[
                {"role": "user", "content": "Say hello."},
                {"role": "assistant", "content": "Hello from upstream."},
                {"role": "user", "content": "Again, streamed."},
            ],
            stream=True,
        )
        events = list(stream)
        kinds = [e.type for e in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == "Streamed hello."
        self.gateway.settle()
        [conversation] = Conversation.objects.filter(owner=self.gateway.user)
        texts = [json.dumps(m.parts) for m in Message.objects.filter(conversation=conversation)]
        assert any("Streamed hello." in t for t in texts)
        assert Message.objects.filter(conversation=conversation, parent=None).count() == 1

    def test_a_function_call_round_and_an_image(self) -> None:
        self.gateway.fake.push(
            Step.tools({"name": "exec_command", "arguments": {"cmd": "echo hi"}}),
            Step.reply("It printed hi."),
        )
        image = "data:image/png;base64," + base64.b64encode(png()).decode()
        shown: Any = [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Run it; here is the screen."},
                    {"type": "input_image", "image_url": image, "detail": "auto"},
                ],
            }
        ]
        first = self.sdk.responses.create(
            model=OPENAI_MODEL,
            input=shown,
            tools=[SHELL],
        )
        [call] = [item for item in first.output if item.type == "function_call"]
        assert call.name == "exec_command" and json.loads(call.arguments) == {"cmd": "echo hi"}
        second = self.sdk.responses.create(
            model=OPENAI_MODEL,
            input=[
                {"role": "user", "content": "Run it."},
                {
                    "type": "function_call",
                    "call_id": call.call_id,
                    "name": call.name,
                    "arguments": call.arguments,
                },
                {"type": "function_call_output", "call_id": call.call_id, "output": "hi\n"},
            ],
            tools=[SHELL],
        )
        assert second.output_text == "It printed hi."
        sent = self.gateway.fake.requests[-1].body["messages"]
        assert sent[-2]["tool_calls"][0]["id"] == call.call_id
        assert sent[-1] == {"role": "tool", "tool_call_id": call.call_id, "content": "hi\n"}
        image_part = self.gateway.fake.requests[0].body["messages"][0]["content"][1]
        assert image_part["type"] == "image_url"

    def test_errors_come_back_in_the_responses_shape(self) -> None:
        with self.assertRaises(openai.BadRequestError) as bad:
            robot: Any = [{"type": "message", "role": "robot"}]
            self.sdk.responses.create(model=OPENAI_MODEL, input=robot)
        assert "input.0.role" in str(bad.exception)
        with self.assertRaises(openai.AuthenticationError):
            openai.OpenAI(
                base_url=self.gateway.openai_base, api_key="nope", max_retries=0
            ).responses.create(model=OPENAI_MODEL, input="hi")
        self.gateway.fake.push(Step.error(429, "slow down"))
        with self.assertRaises(openai.RateLimitError):
            self.sdk.responses.create(model=OPENAI_MODEL, input="hi")


class CodexThroughArborTests(TransactionTestCase):
    """Real Codex (from npm, ``make harness``), unmodified, through the gateway: its
    provider's base URL is Arbor's, its key an Arbor token; the upstream speaks Chat
    Completions, counts bytes / 3 and rejects what is over its window."""

    window = 24_000
    rounds = 40

    def test_codex_runs_its_rounds_through_arbor(self) -> None:
        from tests.codex_server import binary

        codex = binary()
        if not codex.exists():
            if os.environ.get("CI") == "true":
                self.fail(f"{codex} is missing: `make harness` installs it (CI never skips)")
            self.skipTest("codex is not installed (run `make harness`)")
        gateway = LiveGateway(
            window=self.window, responder=scripted_agent(self.rounds), tokenizer="bytes"
        ).start()
        self.addCleanup(gateway.stop)
        home = Path(tempfile.mkdtemp(prefix="codex-home-"))
        (home / "work").mkdir()
        (home / ".codex").mkdir()
        (home / ".codex" / "config.toml").write_text(
            "\n".join(
                [
                    f'model = "{OPENAI_MODEL}"',
                    'model_provider = "arbor"',
                    "check_for_update_on_startup = false",
                    "[analytics]",
                    "enabled = false",
                    "[features]",
                    "plugins = false",
                    "remote_plugin = false",
                    "apps = false",
                    "[model_providers.arbor]",
                    'name = "arbor"',
                    f'base_url = "{gateway.openai_base}"',
                    'wire_api = "responses"',
                    'env_key = "ARBOR_TOKEN"',
                    "",
                ]
            )
        )
        done = subprocess.run(
            [str(codex), "exec", "--skip-git-repo-check",
             "--dangerously-bypass-approvals-and-sandbox", "Run the rounds the tool asks for."],
            env={**os.environ, "HOME": str(home), "ARBOR_TOKEN": gateway.token},
            cwd=home / "work", stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=900,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"FINISHED {self.rounds} rounds" in done.stdout, done.stdout[-2000:]
        requests = gateway.fake.requests
        assert all((r.prompt_tokens or 0) <= self.window for r in requests)
        assert all(r.status == 200 for r in requests), [r.status for r in requests]
        gateway.settle()
        conversations = [
            c
            for c in Conversation.objects.filter(owner=gateway.user)
            if Message.objects.filter(conversation=c, role="tool").exists()
        ]
        assert len(conversations) == 1
        tools = Message.objects.filter(conversation=conversations[0], role="tool").count()
        assert tools >= self.rounds
