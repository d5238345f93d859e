"""Arbor's upstream key goes only where the operator pointed it.

A hostile upstream answers every request with a 307 to a second loopback server, the
catcher, which records what it gets: neither the gateway nor a chat turn (both
protocols, through the official SDKs) follows the redirect, so the catcher never sees
the key, nor the request at all; the client gets an error that names the redirect.
And a catcher as the upstream itself: of a client's headers only the allow-list goes
with Arbor's key (never OpenAI-Organization / OpenAI-Project: the client would choose
who pays)."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from asgiref.sync import async_to_sync
from django.test import AsyncClient, Client

from conversations import services
from conversations.gateway import upstream
from tests.builders import make_user, text

ANTHROPIC_KEY = "sk-ant-OPERATOR-SECRET"
OPENAI_KEY = "sk-OPERATOR-SECRET"
PROTOCOLS = ["anthropic", "openai"]


class Recorder(ThreadingHTTPServer):
    """A loopback HTTP server on a free port, in a thread. Records each request's method,
    path and headers; answers with ``answer(path)`` → (status, headers, body)."""

    daemon_threads = True

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.seen: list[dict[str, Any]] = []
        super().__init__(("127.0.0.1", 0), _Handler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> Recorder:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: Recorder

    def _any(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        self.rfile.read(length)
        self.server.seen.append(
            {
                "method": self.command,
                "path": self.path,
                "headers": {k.lower(): v for k, v in self.headers.items()},
            }
        )
        status, headers, body = self.server.answer(self.path)
        self.send_response(status)
        for key, value in {**headers, "content-length": str(len(body))}.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _any

    def log_message(self, format: str, *args: Any) -> None:
        pass


def anthropic_answer() -> bytes:
    return json.dumps(
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "model": "hostile",
            "content": [{"type": "text", "text": "thanks for the key"}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 3, "output_tokens": 4},
        }
    ).encode()


def openai_answer() -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": "hostile",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "thanks for the key"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
        }
    ).encode()


def catcher_answer(path: str) -> tuple[int, dict[str, str], bytes]:
    """A plausible answer, so that a client that followed a redirect would succeed."""
    body = anthropic_answer() if "/messages" in path else openai_answer()
    return 200, {"content-type": "application/json"}, body


@contextmanager
def hostile_upstream() -> Iterator[tuple[Recorder, Recorder]]:
    """(redirector, catcher): the redirector answers everything with a 307 to the same
    path on the catcher (another port: another origin)."""
    with Recorder(catcher_answer) as catcher:

        def redirect(path: str) -> tuple[int, dict[str, str], bytes]:
            return 307, {"location": catcher.url + path}, b""

        with Recorder(redirect) as redirector:
            yield redirector, catcher


@contextmanager
def declared(models: dict[str, dict[str, Any]]) -> Iterator[None]:
    """An ARBOR_MODELS file declaring ``models``, and the operator's keys."""
    folder = Path(tempfile.mkdtemp())
    path = folder / "models.json"
    entries = {k: {"context_window": 8000, "max_output": 512, **v} for k, v in models.items()}
    path.write_text(json.dumps({"models": entries}))
    env = {"ARBOR_MODELS": str(path), "ANTHROPIC_API_KEY": ANTHROPIC_KEY}
    env["OPENAI_API_KEY"] = OPENAI_KEY
    with mock.patch.dict(os.environ, env):
        for name in ("OPENAI_BASE_URL", "ANTHROPIC_BASE_URL", "ANTHROPIC_AUTH_TOKEN"):
            os.environ.pop(name, None)
        yield


def base_urls(upstream: Recorder) -> dict[str, dict[str, Any]]:
    return {
        "anthropic/hostile": {"base_url": upstream.url},
        "openai/hostile": {"base_url": upstream.url + "/v1"},
    }


def no_key_in(seen: list[dict[str, Any]]) -> None:
    for request in seen:
        words = json.dumps(request["headers"])
        assert ANTHROPIC_KEY not in words and OPENAI_KEY not in words, request


def gateway_post(protocol: str, token: str, model: str = "hostile", **headers: str) -> Any:
    """One gateway request, in-process (the ASGI handler on this thread's database
    connection), its upstream connection pool closed in the request's own loop."""
    if protocol == "anthropic":
        path = "/gateway/anthropic/v1/messages"
        body: dict[str, Any] = {"model": model, "max_tokens": 50}
        headers = {"x-api-key": token, "anthropic-version": "2023-06-01", **headers}
    else:
        path = "/gateway/openai/v1/chat/completions"
        body = {"model": model}
        headers = {"authorization": f"Bearer {token}", **headers}
    body["messages"] = [{"role": "user", "content": "hi"}]

    async def send() -> Any:
        try:
            return await AsyncClient().post(
                path, data=json.dumps(body), content_type="application/json", headers=headers
            )
        finally:
            await upstream.close_sessions()

    return async_to_sync(send)()


def error_message(protocol: str, body: dict[str, Any]) -> str:
    if protocol == "anthropic":
        assert body["type"] == "error"
    return str(body["error"]["message"])


@pytest.mark.parametrize("protocol", PROTOCOLS)
class TestRedirects:
    @pytest.fixture(autouse=True)
    def _user(self, db: Any) -> None:
        self.user = make_user("victim-operator")
        _, self.token = services.api_token_create(user=self.user, name="t")

    def test_the_gateway_does_not_follow_an_upstreams_redirect_with_the_key(
        self, protocol: str
    ) -> None:
        with hostile_upstream() as (redirector, catcher):
            with declared(base_urls(redirector)):
                response = gateway_post(protocol, self.token)
            assert redirector.seen, "the request never reached the upstream"
            no_key_in(catcher.seen)
            assert catcher.seen == []  # nor the user's conversation
        assert response.status_code == 502, response.content
        message = error_message(protocol, response.json())
        assert "307" in message and "redirect" in message
        assert str(redirector.server_address[1]) not in message

    def test_a_chat_turn_does_not_follow_a_providers_redirect_with_the_key(
        self, protocol: str
    ) -> None:
        conversation = services.conversation_create(owner=self.user, title="t")
        api = Client(HTTP_AUTHORIZATION=f"Bearer {self.token}")
        with hostile_upstream() as (redirector, catcher):
            with declared(base_urls(redirector)):
                response = api.post(
                    f"/api/conversations/{conversation.pk}/messages",
                    {"parts": text("hi"), "model": f"{protocol}/hostile"},
                    content_type="application/json",
                )
            assert redirector.seen, "the request never reached the upstream"
            no_key_in(catcher.seen)
            assert catcher.seen == []
        assert response.status_code == 502, response.content
        body = response.json()
        assert body["error"] == "provider_redirect", body
        assert "307" in body["detail"] and "redirect" in body["detail"]


@pytest.mark.parametrize("protocol", PROTOCOLS)
class TestForwardedHeaders:
    """The upstream is a catcher that records headers and answers as a provider would."""

    @pytest.fixture(autouse=True)
    def _user(self, db: Any) -> None:
        self.user = make_user("header-sender")
        _, self.token = services.api_token_create(user=self.user, name="t")

    def send(self, protocol: str, **env: str) -> dict[str, str]:
        client_headers = {
            "OpenAI-Organization": "org-the-client-chose",
            "OpenAI-Project": "proj-the-client-chose",
            "ChatGPT-Account-Id": "acct-the-client-chose",
            "Cookie": "session=client",
            "X-Something-Else": "dropped",
            "Anthropic-Beta": "fine-grained-tool-streaming-2025-05-14",
            "OpenAI-Beta": "responses=experimental",
            "User-Agent": "some-harness/1.2",
            "X-Stainless-Lang": "python",
        }
        with Recorder(catcher_answer) as catcher:
            with declared(base_urls(catcher)), mock.patch.dict(os.environ, env):
                response = gateway_post(protocol, self.token, **client_headers)
            assert response.status_code == 200, response.content
            assert len(catcher.seen) == 1
            return dict(catcher.seen[0]["headers"])

    def test_only_the_allow_list_of_client_headers_goes_with_the_key(self, protocol: str) -> None:
        headers = self.send(protocol)
        for name in ("openai-organization", "openai-project", "chatgpt-account-id"):
            assert name not in headers, headers
        for name in ("cookie", "x-something-else"):
            assert name not in headers, headers
        assert headers["anthropic-beta"] == "fine-grained-tool-streaming-2025-05-14"
        assert headers["openai-beta"] == "responses=experimental"
        assert headers["user-agent"] == "some-harness/1.2"
        assert headers["x-stainless-lang"] == "python"
        if protocol == "anthropic":
            assert headers["x-api-key"] == ANTHROPIC_KEY
            assert headers["anthropic-version"] == "2023-06-01"
            assert "authorization" not in headers
        else:
            assert headers["authorization"] == f"Bearer {OPENAI_KEY}"
            assert "x-api-key" not in headers

    def test_the_operators_own_organisation_and_project_go_instead(self, protocol: str) -> None:
        headers = self.send(protocol, OPENAI_ORG_ID="org-operator", OPENAI_PROJECT_ID="proj-op")
        if protocol == "openai":
            assert headers["openai-organization"] == "org-operator"
            assert headers["openai-project"] == "proj-op"
        else:  # an OpenAI account means nothing to an Anthropic upstream
            assert "openai-organization" not in headers and "openai-project" not in headers
