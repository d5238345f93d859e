"""The operator's model policy: which models users may call on Arbor's keys, one check
(``registry.model_allowed``, through ``resolve_model``) for chat turns, the context API
and the gateway.

With DEBUG off the policy is ``declared``: only the ARBOR_MODELS file's models and the
one ARBOR_DEFAULT_MODEL names; the built-in table's costly models (``claude-opus-4-1``,
``claude-opus-4-<anything>``, ``o3-pro``, ``gpt-4.1``) are refused, and so is the offline
demo ``fake/*``. A refusal names the model and says it is not offered on this server;
no provider is called. A models file that is missing stops the server at start, and one
broken later never reaches a client with the server's path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from django.test import Client, TestCase, override_settings

from conversations import services
from conversations.providers import registry
from conversations.providers.registry import ModelNotOffered, ModelsFileError, resolve_model
from tests.builders import make_user, text
from tests.test_upstream_safety import (
    ANTHROPIC_KEY,
    OPENAI_KEY,
    Recorder,
    catcher_answer,
    gateway_post,
)

ROOT = Path(__file__).resolve().parent.parent
# The costly models a user could pick while nobody declared them (the list).
BUILTIN = [
    "anthropic/claude-opus-4-1",
    "anthropic/claude-opus-4-anything",
    "openai/o3-pro",
    "openai/o3-deep-research",
    "openai/gpt-4.1",
]
PRODUCTION = {"ARBOR_MODEL_POLICY": "declared", "ARBOR_FAKE_MODELS": False}


@contextmanager
def operator(upstream: Recorder, *, models_file: str | None = None) -> Iterator[None]:
    """Arbor's keys, the providers' base URLs pointing at ``upstream`` (a catcher) and
    an ARBOR_MODELS file declaring ``anthropic/house-claude`` and ``openai/house-gpt``."""
    if models_file is None:
        path = Path(tempfile.mkdtemp()) / "models.json"
        entry = {"context_window": 8000, "max_output": 512}
        path.write_text(
            json.dumps({"models": {"anthropic/house-claude": entry, "openai/house-gpt": entry}})
        )
        models_file = str(path)
    env = {
        "ARBOR_MODELS": models_file,
        "ANTHROPIC_API_KEY": ANTHROPIC_KEY,
        "OPENAI_API_KEY": OPENAI_KEY,
        "ANTHROPIC_BASE_URL": upstream.url,
        "OPENAI_BASE_URL": upstream.url + "/v1",
    }
    with mock.patch.dict(os.environ, env):
        yield


# --- the one check ------------------------------------------------------------------------


@override_settings(**PRODUCTION, ARBOR_DEFAULT_MODEL="")
class RegistryPolicyTests(TestCase):
    def test_with_the_declared_policy_only_declared_models_resolve(self) -> None:
        with Recorder(catcher_answer) as catcher, operator(catcher):
            for model_id in [*BUILTIN, "openai/nobody-knows-me", "fake/demo"]:
                assert not registry.model_allowed(model_id), model_id
                with pytest.raises(ModelNotOffered) as refused:
                    resolve_model(model_id)
                message = str(refused.value)
                assert repr(model_id) in message and "not offered on this server" in message
                assert "/tmp" not in message and tempfile.gettempdir() not in message
            assert resolve_model("anthropic/house-claude").context_window == 8000
            with override_settings(ARBOR_DEFAULT_MODEL="openai/gpt-4o-mini"):
                # What the operator's settings name is offered too.
                assert resolve_model("openai/gpt-4o-mini").max_output == 16_384

    def test_the_builtin_policy_adds_the_table_and_nothing_else(self) -> None:
        with (
            Recorder(catcher_answer) as catcher,
            operator(catcher),
            override_settings(ARBOR_MODEL_POLICY="builtin"),
        ):
            for model_id in BUILTIN:
                assert resolve_model(model_id).id == model_id
            for model_id in ("openai/nobody-knows-me", "fake/demo"):
                with pytest.raises(ModelNotOffered):
                    resolve_model(model_id)
            with override_settings(ARBOR_FAKE_MODELS=True):
                assert resolve_model("fake/demo").fake

    def test_the_demo_is_refused_even_as_the_default_model(self) -> None:
        with (
            override_settings(ARBOR_DEFAULT_MODEL="fake/demo"),
            pytest.raises(ModelNotOffered, match="offline demo"),
        ):
            resolve_model("fake/demo")


# --- the settings ---------------------------------------------------------------------


def _settings_of(*names: str, **env_vars: str) -> list[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"DEBUG", "ARBOR_MODEL_POLICY", "ARBOR_FAKE_MODELS", "ARBOR_MODELS"}
    }
    env.update(DJANGO_SETTINGS_MODULE="arbor.settings", SECRET_KEY="x", **env_vars)
    code = "import django; django.setup(); from django.conf import settings; " + "; ".join(
        f"print(repr(settings.{name}))" for name in names
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-len(names) :]


def test_production_offers_declared_models_only_and_development_the_table_and_demo() -> None:
    names = ("ARBOR_MODEL_POLICY", "ARBOR_FAKE_MODELS")
    assert _settings_of(*names) == ["'declared'", "False"]
    assert _settings_of(*names, DEBUG="1") == ["'builtin'", "True"]
    assert _settings_of(*names, ARBOR_MODEL_POLICY="builtin") == ["'builtin'", "False"]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"ARBOR_MODEL_POLICY": "everything"}, "ARBOR_MODEL_POLICY must be declared or builtin"),
        ({"ARBOR_MODELS": "/nowhere/models.toml"}, "/nowhere/models.toml' cannot be read"),
    ],
)
def test_a_bad_policy_or_a_missing_models_file_stops_the_server_at_start(
    env: dict[str, str], expected: str
) -> None:
    base = {k: v for k, v in os.environ.items() if k not in {"DEBUG", *env}}
    proc = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        env={**base, **env, "DJANGO_SETTINGS_MODULE": "arbor.settings", "SECRET_KEY": "x"},
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode != 0
    assert expected in proc.stderr


# --- each entry point ------------------------------------------------------------------------


@override_settings(**PRODUCTION, ARBOR_DEFAULT_MODEL="")
class EntryPointTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user("policy")
        _, cls.token = services.api_token_create(user=cls.user, name="t")

    def setUp(self) -> None:
        self.api = Client(HTTP_AUTHORIZATION=f"Bearer {self.token}")
        self.conversation = services.conversation_create(owner=self.user, title="t")
        self.catcher = Recorder(catcher_answer).__enter__()
        self.addCleanup(self.catcher.__exit__)

    def chat(self, model: str) -> Any:
        return self.api.post(
            f"/api/conversations/{self.conversation.pk}/messages",
            {"parts": text("hi"), "model": model},
            content_type="application/json",
        )

    def context(self, model: str) -> Any:
        return self.api.get(f"/api/conversations/{self.conversation.pk}/context?model={model}")

    def assert_refused(self, response: Any, model: str, detail: str) -> None:
        assert response.status_code in (400, 422), response.content
        assert repr(model) in detail and "not offered on this server" in detail, detail

    def test_a_chat_turn_refuses_an_undeclared_model_without_calling_it(self) -> None:
        with operator(self.catcher):
            for model in [*BUILTIN, "fake/demo"]:
                response = self.chat(model)
                self.assert_refused(response, model, response.json()["detail"])
                assert response.json()["error"] == "bad_model"
            assert self.catcher.seen == []
            # A declared model goes to the operator's endpoint with the operator's key
            # (the catcher answers a whole message, not the stream asked for: what
            # matters here is where the request went).
            self.chat("anthropic/house-claude")
        assert len(self.catcher.seen) == 1
        assert ANTHROPIC_KEY in json.dumps(self.catcher.seen[0]["headers"])

    def test_the_context_api_refuses_an_undeclared_model(self) -> None:
        with operator(self.catcher):
            for model in [*BUILTIN, "fake/demo"]:
                response = self.context(model)
                self.assert_refused(response, model, response.json()["detail"])
            assert self.context("openai/house-gpt").status_code == 200

    def test_the_gateway_refuses_an_undeclared_model_without_forwarding_it(self) -> None:
        with operator(self.catcher):
            for model in BUILTIN:
                protocol, name = model.split("/", 1)
                response = gateway_post(protocol, self.token, model=name)
                assert response.status_code == 400, response.content
                body = response.json()
                if protocol == "anthropic":
                    assert body["error"]["type"] == "invalid_request_error"
                self.assert_refused(response, model, body["error"]["message"])
            assert self.catcher.seen == []
            assert gateway_post("anthropic", self.token, model="house-claude").status_code == 200
        assert len(self.catcher.seen) == 1

    def test_a_models_file_broken_after_start_never_shows_its_path(self) -> None:
        folder = Path(tempfile.mkdtemp())
        missing = str(folder / "gone.toml")
        with (
            operator(self.catcher, models_file=missing),
            self.assertLogs("arbor.providers") as logs,
        ):
            answers = {
                "chat": self.chat("anthropic/house-claude"),
                "context": self.context("anthropic/house-claude"),
                "gateway": gateway_post("anthropic", self.token, model="house-claude"),
            }
        # The server's own misconfiguration: the gateway answers a 5xx in its protocol's
        # shape (the client's request was fine).
        assert answers["gateway"].status_code == 503
        assert answers["gateway"].json()["error"]["type"] == "api_error"
        for where, response in answers.items():
            raw = response.content.decode()
            assert str(folder) not in raw and "gone.toml" not in raw, (where, raw)
            assert "ARBOR_MODELS" in raw and "server" in raw, (where, raw)
        assert self.catcher.seen == []
        # The operator finds the details in the log.
        assert any(missing in line for line in logs.output)

    def test_a_broken_file_is_its_own_error_for_callers(self) -> None:
        folder = Path(tempfile.mkdtemp())
        broken = folder / "models.json"
        broken.write_text('{"models": {')
        with (
            operator(self.catcher, models_file=str(broken)),
            self.assertLogs("arbor.providers"),
            pytest.raises(ModelsFileError) as failed,
        ):
            resolve_model("anthropic/house-claude")
        assert str(folder) not in str(failed.value)
