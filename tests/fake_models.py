"""A loopback fake provider declared as real models, for tests that run chat turns.

``serve_fake_models(server)`` starts the server and points ``openai/test`` and
``anthropic/test`` at it through an ARBOR_MODELS file, as an operator would declare a
self-hosted endpoint.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection

from arbor.env import database_url_of
from conversations.providers.fake import FakeLLMServer

PROTOCOLS = ["openai/test", "anthropic/test"]


@contextmanager
def serve_fake_models(
    server: FakeLLMServer, *, window: int = 4000, extra: dict[str, dict[str, object]] | None = None
) -> Iterator[FakeLLMServer]:
    """``extra`` declares more models (``base_url`` defaults to the fake's OpenAI URL)."""
    server.start()
    entry = {"context_window": window, "max_output": 256}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(
            {
                "models": {
                    "openai/test": {"base_url": server.openai_base_url, **entry},
                    "anthropic/test": {"base_url": server.anthropic_base_url, **entry},
                    **{
                        name: {"base_url": server.openai_base_url, **entry, **spec}
                        for name, spec in (extra or {}).items()
                    },
                    # A model that cannot read images: the snapshot rung is skipped.
                    "openai/textonly": {
                        "base_url": server.openai_base_url,
                        **entry,
                        "vision": False,
                    },
                }
            },
            handle,
        )
    names = ("ARBOR_MODELS", "OPENAI_API_KEY", "ANTHROPIC_API_KEY")
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update(
        ARBOR_MODELS=handle.name, OPENAI_API_KEY="sk-test", ANTHROPIC_API_KEY="sk-ant-test"
    )
    try:
        yield server
    finally:
        server.stop()
        os.unlink(handle.name)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def child_env() -> dict[str, str]:
    """The environment for a subprocess that must use this test's database (only what a
    TransactionTestCase committed is visible to it)."""
    env = dict(os.environ)
    env["DATABASE_URL"] = database_url_of(connection.settings_dict, connection.vendor)
    env["SECRET_KEY"] = "test-only"
    return env
