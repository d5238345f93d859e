"""Root pytest configuration: test runs need a SECRET_KEY but never a real one, the
offline demo as their default model, and a var/ folder for the SQLite test database (a
fresh clone has none)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("SECRET_KEY", "test-only-secret-key-not-for-production")
os.environ.setdefault("SECURE_COOKIES", "0")
# The tests talk to the offline demo model unless they choose another; a deployment
# with DEBUG off never falls back to it by itself (arbor/settings.py).
os.environ.setdefault("ARBOR_DEFAULT_MODEL", "fake/demo")
(Path(__file__).resolve().parent / "var").mkdir(exist_ok=True)


def pytest_configure(config: object) -> None:
    # Background jobs without a broker run inside the call that queued them, so a test
    # sees them done; tests of the worker-thread default override the setting.
    from django.conf import settings

    settings.ARBOR_INPROCESS_JOBS = "inline"
    # A TestCase's rows are uncommitted on the test's own connection: the gateway's
    # views, called in-process by Django's test client, use it too (live servers the
    # tests start keep their own database threads).
    settings.ARBOR_GATEWAY_DB_THREADS = 0
    # Tests create hundreds of users: a deliberately slow password hash (PBKDF2's
    # hundreds of thousands of rounds) would be most of some tests' time. Servers the
    # tests start in subprocesses keep the real hashers; they sign users in by session.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    # Django's settings may be read before this module sets the variable above.
    settings.ARBOR_DEFAULT_MODEL = os.environ["ARBOR_DEFAULT_MODEL"]
