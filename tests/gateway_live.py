"""A live gateway for tests: the `make run` server (uvicorn, ASGI) on a free port, a
loopback upstream declared as real Anthropic and OpenAI models through an ARBOR_MODELS
file, and a user with an API token, as a harness's operator would set it up.

``agent_responder`` is the scripted upstream agent the harness tests use: every request
that offers a Bash tool gets the next round's command (the round number is read back
from the transcript, so it survives compaction: the newest round is always in the
verbatim tail), and after the last round a final answer.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from conversations import services
from conversations.providers.fake import FakeLLMServer, scripted_agent
from tests.builders import make_user
from tests.fake_models import child_env
from tests.live_server import free_port, start_uvicorn

ANTHROPIC_MODEL = "claude-sonnet-4-5"
OPENAI_MODEL = "gpt-4o-mini"


# The scripted upstream agent lives beside the fake (the benches use it too).
agent_responder = scripted_agent


class LiveGateway:
    """Start with ``LiveGateway(window=…).start()``; stop with ``stop()``."""

    def __init__(
        self,
        *,
        window: int = 200_000,
        max_output: int = 4096,
        declared_window: int | None = None,
        responder: Any = None,
        extra_env: Mapping[str, str] | None = None,
        tokenizer: str = "words",
    ) -> None:
        self.fake = FakeLLMServer(context_window=window, responder=responder, tokenizer=tokenizer)
        self.window = window
        self.declared_window = declared_window or window
        self.max_output = max_output
        self.extra_env = dict(extra_env or {})
        self.server: subprocess.Popen[bytes] | None = None

    def start(self) -> LiveGateway:
        self.fake.start()
        entry = {"context_window": self.declared_window, "max_output": self.max_output}
        models = {
            f"anthropic/{ANTHROPIC_MODEL}": {"base_url": self.fake.anthropic_base_url, **entry},
            "anthropic/claude-haiku-4-5": {"base_url": self.fake.anthropic_base_url, **entry},
            f"openai/{OPENAI_MODEL}": {"base_url": self.fake.openai_base_url, **entry},
        }
        self.models_file = Path(tempfile.mkdtemp()) / "models.json"
        self.models_file.write_text(json.dumps({"models": models}))
        self.port = free_port()
        self.serve()
        self.user = make_user(f"harness{self.port}")
        _, self.token = services.api_token_create(user=self.user, name="gateway")
        return self

    def serve(self) -> None:
        """Start (or restart, after ``kill``) the server process on the same port."""
        env = dict(
            child_env(),
            ALLOWED_HOSTS="127.0.0.1,localhost",
            ARBOR_MODELS=str(self.models_file),
            ANTHROPIC_API_KEY="sk-ant-upstream-key",
            OPENAI_API_KEY="sk-upstream-key",
            ARBOR_INPROCESS_JOBS="thread",
            **self.extra_env,
        )
        # Up once it answers (READY_SECONDS at most: a busy machine starts it late).
        self.server = start_uvicorn(env, self.port, path="/gateway/anthropic")

    def kill(self) -> None:
        """kill -9 the server process."""
        assert self.server is not None
        self.server.kill()
        self.server.wait(20)
        self.server = None

    def stop(self) -> None:
        if self.server is not None:
            self.server.terminate()
            self.server.wait(20)
            self.server = None
        self.fake.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def anthropic_base(self) -> str:
        return f"{self.url}/gateway/anthropic"

    @property
    def openai_base(self) -> str:
        return f"{self.url}/gateway/openai/v1"

    def settle(self, token: str | None = None) -> None:
        """Wait until the token's exchanges are written: the gateway writes each one
        behind its answer (conversations/gateway/pending.py), so a test that reads the
        tree right after an answer asks first, as any reader that must see it would."""
        status, raw, _ = self.call(
            "GET", "/gateway/status?wait=20", headers={"x-api-key": token or self.token}
        )
        assert status == 200, raw
        assert json.loads(raw) == {"pending_writes": 0}, raw

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, bytes, dict[str, str]]:
        client = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        client.request(
            method,
            path,
            body=json.dumps(body) if body is not None else None,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        response = client.getresponse()
        raw = response.read()
        client.close()
        return response.status, raw, {k.lower(): v for k, v in response.getheaders()}
