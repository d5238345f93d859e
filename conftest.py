"""Root pytest configuration: test runs need a SECRET_KEY but never a real one, the
offline demo as their default model, and a var/ folder for the SQLite test database (a
fresh clone has none). Tests marked ``samples`` are skipped without the third-party
samples beside the repository (failed under CI=true; tests/sample_loaders.py), and the
run ends with its skips counted and named in one line."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("SECRET_KEY", "test-only-secret-key-not-for-production")
os.environ.setdefault("SECURE_COOKIES", "0")
# The tests talk to the offline demo model unless they choose another; a deployment
# with DEBUG off never falls back to it by itself (arbor/settings.py).
os.environ.setdefault("ARBOR_DEFAULT_MODEL", "fake/demo")
# The model policy as `make run` has it: the demo and the built-in table offered (the
# production defaults, declared models only and no demo, are tested explicitly in
# tests/test_model_policy.py). Servers the tests start inherit these.
os.environ.setdefault("ARBOR_FAKE_MODELS", "1")
os.environ.setdefault("ARBOR_MODEL_POLICY", "builtin")
(Path(__file__).resolve().parent / "var").mkdir(exist_ok=True)


def pytest_configure(config: object) -> None:
    # Background jobs without a broker run inside the call that queued them, so a test
    # sees them done; tests of the worker-thread default override the setting.
    from django.conf import settings

    from arbor.env import env_bool

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
    settings.ARBOR_FAKE_MODELS = env_bool("ARBOR_FAKE_MODELS")
    settings.ARBOR_MODEL_POLICY = os.environ["ARBOR_MODEL_POLICY"]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # Before any fixture or setUpClass/setUpTestData of the test runs: a test marked
    # `samples` (tests.sample_loaders.requires_samples) is skipped without the
    # third-party samples, or failed under CI=true.
    if item.get_closest_marker("samples") is not None:
        from tests.sample_loaders import require_samples

        require_samples()


def pytest_report_header(config: pytest.Config) -> str:
    from compaction.bench_samples import SAMPLES

    state = "present" if SAMPLES.is_dir() else "ABSENT: tests that read them are skipped"
    if not SAMPLES.is_dir() and os.environ.get("CI") == "true":
        state = "ABSENT: tests that read them fail (CI=true)"
    return f"third-party samples: {SAMPLES} ({state})"


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter: Any) -> Generator[None]:
    """Every skip of the run counted and named in one line, by reason, after pytest's
    own summary (a line per reason and place) and right above the final counts."""
    yield
    reasons: Counter[str] = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, (tuple, list)) else str(longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        named = "; ".join(f"{n} × {reason}" for reason, n in reasons.most_common())
        terminalreporter.write_line(f"SKIPPED {sum(reasons.values())}: {named}")
