"""Streaming under the ASGI server `make run` uses: deltas reach the client while the
model is still generating (Django would otherwise drain a sync iterator first)."""

from __future__ import annotations

import http.client
import json
import tempfile
import time
from pathlib import Path

from django.test import TransactionTestCase

from conversations import services
from conversations.providers.fake import FakeLLMServer, Step
from tests.builders import make_user, new_conversation
from tests.fake_models import child_env
from tests.live_server import ROOT, free_port, start_uvicorn, stop

__all__ = ["ROOT", "free_port"]  # other test modules import them from here

HANG = 8  # seconds the model goes silent after its first words


class AsgiStreamingTests(TransactionTestCase):
    def test_deltas_arrive_before_the_model_finishes(self) -> None:
        fake = FakeLLMServer().start()
        self.addCleanup(fake.stop)
        models = Path(tempfile.mkdtemp()) / "models.json"
        models.write_text(
            json.dumps({"models": {"openai/slow": {"base_url": fake.openai_base_url}}})
        )
        user = make_user("streamer")
        _, secret = services.api_token_create(user=user, name="t")
        conv, _ = new_conversation(user, "hi>hello")
        port = free_port()
        env = dict(
            child_env(),
            ALLOWED_HOSTS="127.0.0.1",
            ARBOR_MODELS=str(models),
            OPENAI_API_KEY="sk-test",
        )
        server = start_uvicorn(env, port)
        self.addCleanup(stop, server)

        # Three chunks, then the model hangs and the stream breaks.
        fake.push(Step.stall("alpha beta gamma delta epsilon", after=3, hang=HANG))
        client = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        body = {"parts": [{"type": "text", "text": "go"}], "model": "openai/slow", "stream": True}
        client.request(
            "POST",
            f"/api/conversations/{conv.pk}/messages",
            body=json.dumps(body),
            headers={"Authorization": f"Bearer {secret}", "Content-Type": "application/json"},
        )
        response = client.getresponse()
        assert response.status == 200
        assert response.getheader("Content-Type") == "text/event-stream"
        first_delta_at = None
        events = []
        buffer = b""
        while True:
            chunk = response.read1(4096)
            if not chunk:
                break
            buffer += chunk
            while b"\n\n" in buffer:
                block, buffer = buffer.split(b"\n\n", 1)
                fields = dict(line.split(": ", 1) for line in block.decode().splitlines())
                events.append(fields["event"])
                if fields["event"] == "delta" and first_delta_at is None:
                    first_delta_at = time.monotonic()
        assert "delta" in events and events[-1] == "error"
        assert first_delta_at is not None
        # The first words arrived while the model still hung, not after the stream ended:
        # measured from when the model got the request (the fake's own clock, the same
        # monotonic clock as this process's), not from when this test sent it, so a slow
        # server or a busy machine does not count against the stream.
        (asked,) = fake.requests
        assert first_delta_at - asked.received_at < HANG, (asked.received_at, first_delta_at)


class ServerPartsTests(TransactionTestCase):
    def test_make_runs_server_uses_the_c_parser_and_loop(self) -> None:
        # `make run` and the benches start uvicorn with its "auto" choices; they pick
        # httptools and uvloop only when installed (else pure-Python h11 and asyncio).
        import uvicorn
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        config = uvicorn.Config("arbor.asgi:application")
        config.load()
        self.assertIs(config.http_protocol_class, HttpToolsProtocol)
        loop_factory = config.get_loop_factory()
        self.assertIsNotNone(loop_factory)
        loop = loop_factory()  # type: ignore[misc]
        try:
            self.assertEqual(type(loop).__module__.split(".")[0], "uvloop")
        finally:
            loop.close()
