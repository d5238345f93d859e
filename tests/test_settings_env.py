"""Settings helpers fail loudly on bad values instead of guessing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.test import SimpleTestCase, TestCase

from arbor.env import ImproperlyConfiguredEnv, database_from_url, env_bool, env_int, env_list

BASE = Path("/srv/arbor")


def test_it_reads_a_relative_sqlite_url_under_the_project() -> None:
    db = database_from_url("sqlite:///var/arbor.sqlite3", base_dir=BASE)
    assert db["ENGINE"] == "django.db.backends.sqlite3"
    assert db["NAME"] == "/srv/arbor/var/arbor.sqlite3"


def test_it_reads_an_absolute_sqlite_url() -> None:
    assert database_from_url("sqlite:////tmp/x.db", base_dir=BASE)["NAME"] == "/tmp/x.db"


def test_it_reads_a_postgres_url() -> None:
    db = database_from_url(
        "postgres://bob:p%40ss@db.local:5433/arbor?sslmode=require", base_dir=BASE
    )
    assert db["ENGINE"] == "django.db.backends.postgresql"
    assert (db["USER"], db["PASSWORD"], db["HOST"], db["PORT"], db["NAME"]) == (
        "bob",
        "p@ss",
        "db.local",
        "5433",
        "arbor",
    )
    assert db["OPTIONS"] == {"sslmode": "require"}


@pytest.mark.parametrize("url", ["mysql://x/y", "postgres://host/", "sqlite://", "nonsense"])
def test_it_rejects_unsupported_or_incomplete_urls(url: str) -> None:
    with pytest.raises(ImproperlyConfiguredEnv):
        database_from_url(url, base_dir=BASE)


def test_booleans_ints_and_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("X_BOOL", "yes")
    monkeypatch.setenv("X_INT", "42")
    monkeypatch.setenv("X_LIST", "a.example, b.example,")
    assert env_bool("X_BOOL") is True
    assert env_int("X_INT", 1) == 42
    assert env_list("X_LIST", []) == ["a.example", "b.example"]
    monkeypatch.setenv("X_BOOL", "maybe")
    monkeypatch.setenv("X_INT", "4 2")
    with pytest.raises(ImproperlyConfiguredEnv):
        env_bool("X_BOOL")
    with pytest.raises(ImproperlyConfiguredEnv):
        env_int("X_INT", 1)


def test_settings_refuse_to_start_without_a_secret_key() -> None:
    env = {k: v for k, v in os.environ.items() if k not in {"SECRET_KEY", "DEBUG"}}
    env["DJANGO_SETTINGS_MODULE"] = "arbor.settings"
    proc = subprocess.run(
        [sys.executable, "-c", "import django; django.setup()"],
        env=env,
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert proc.returncode != 0
    assert "SECRET_KEY must be set unless DEBUG=1" in proc.stderr


@pytest.mark.django_db
def test_the_sqlite_database_runs_in_wal_mode_with_normal_sync() -> None:
    from django.db import connection

    options = database_from_url("sqlite:///var/arbor.sqlite3", base_dir=BASE)["OPTIONS"]
    assert "journal_mode=WAL" in options["init_command"]
    assert "synchronous=NORMAL" in options["init_command"]
    if connection.vendor == "sqlite":  # and the test database really runs that way
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA journal_mode")
            assert cursor.fetchone()[0] == "wal"
            cursor.execute("PRAGMA synchronous")
            assert cursor.fetchone()[0] == 1  # NORMAL


class DeploymentChecksTests(SimpleTestCase):
    def test_check_deploy_with_the_production_environment_has_no_warnings(self) -> None:
        """The environment README's "Deploying" names passes `check --deploy` clean."""
        import secrets

        # As a deployment has it: not the test run's own switches (the browser tests set
        # DJANGO_ALLOW_ASYNC_UNSAFE for Playwright, which a deployment must not).
        test_only = {"DJANGO_ALLOW_ASYNC_UNSAFE", "SECURE_COOKIES"}
        env = {
            **{k: v for k, v in os.environ.items() if k not in test_only},
            "DEBUG": "0",
            "SECRET_KEY": secrets.token_urlsafe(60),
            "ALLOWED_HOSTS": "arbor.example.com",
            "SECURE_SSL_REDIRECT": "1",
            "SECURE_HSTS_SECONDS": "31536000",
            "SECURE_HSTS_INCLUDE_SUBDOMAINS": "1",
            "SECURE_HSTS_PRELOAD": "1",
            "SECURE_COOKIES": "1",
            "ARBOR_PROXY_SSL_HEADER": "HTTP_X_FORWARDED_PROTO",
        }
        done = subprocess.run(
            [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
            cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True,
        )  # fmt: skip
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)


class PrivatePagesTests(TestCase):
    def test_signed_in_pages_are_not_cached_and_features_are_off(self) -> None:
        from tests.builders import make_user

        anonymous = self.client.get("/login/")
        self.assertIn("camera=()", anonymous["Permissions-Policy"])
        self.client.force_login(make_user())
        page = self.client.get("/")
        self.assertEqual(page["Cache-Control"], "no-store")
        self.assertIn("camera=()", page["Permissions-Policy"])


def _default_model(**env_vars: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in {"DEBUG", "ARBOR_DEFAULT_MODEL"}}
    env.update(DJANGO_SETTINGS_MODULE="arbor.settings", SECRET_KEY="x", **env_vars)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import django; django.setup(); from django.conf import settings; "
            "print(repr(settings.ARBOR_DEFAULT_MODEL))",
        ],
        env=env,
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert proc.returncode == 0, proc.stderr
    return str(proc.stdout.strip().splitlines()[-1])


def test_with_debug_off_the_demo_is_never_the_default_model() -> None:
    assert _default_model() == "''"
    assert _default_model(DEBUG="1") == "'fake/demo'"
    assert _default_model(ARBOR_DEFAULT_MODEL="openai/gpt-4o-mini") == "'openai/gpt-4o-mini'"


@pytest.mark.django_db
def test_a_chat_turn_without_any_model_is_a_clear_422() -> None:
    from django.test import Client, override_settings

    from conversations import services
    from conversations.models import Message
    from tests.builders import make_user

    user = make_user()
    _, secret = services.api_token_create(user=user, name="t")
    conversation = services.conversation_create(owner=user, title="no model")
    client = Client(HTTP_AUTHORIZATION=f"Bearer {secret}")
    with override_settings(ARBOR_DEFAULT_MODEL=""):
        response = client.post(
            f"/api/conversations/{conversation.pk}/messages",
            {"parts": [{"type": "text", "text": "hello"}]},
            content_type="application/json",
        )
    assert response.status_code == 422, response.content
    assert response.json()["error"] == "no_model"
    assert "ARBOR_DEFAULT_MODEL" in response.json()["detail"]
    assert not Message.objects.filter(conversation=conversation).exists()
