"""Typed helpers that read settings from the environment and fail loudly on bad values."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit


class ImproperlyConfiguredEnv(ValueError):
    """A setting in the environment is missing or malformed."""


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str | None = None) -> str:
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise ImproperlyConfiguredEnv(f"{name} must be set")
        return default
    return value


def env_bool(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ImproperlyConfiguredEnv(f"{name} must be a boolean (1/0, true/false), got {value!r}")


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ImproperlyConfiguredEnv(f"{name} must be an integer, got {value!r}") from None


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        number = float(value)
    except ValueError:
        raise ImproperlyConfiguredEnv(f"{name} must be a number, got {value!r}") from None
    if not number > 0 or number == float("inf"):
        raise ImproperlyConfiguredEnv(f"{name} must be a positive number, got {value!r}")
    return number


def env_list(name: str, default: list[str]) -> list[str]:
    value = os.environ.get(name)
    if value is None:
        return default
    return [item.strip() for item in value.split(",") if item.strip()]


def database_from_url(url: str, *, base_dir: Path) -> dict[str, Any]:
    """Turn a DATABASE_URL into a Django DATABASES entry.

    Supported: ``sqlite:///relative/path``, ``sqlite:////absolute/path`` and
    ``postgres://user:password@host:port/name?sslmode=…`` (also ``postgresql://``).
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "sqlite":
        raw = unquote(parts.path)
        if not raw or raw == "/":
            raise ImproperlyConfiguredEnv(f"DATABASE_URL {url!r} names no SQLite file")
        if raw == "/:memory:":
            name: str | Path = ":memory:"
        else:
            # sqlite:///var/x.db → relative to the project; sqlite:////tmp/x.db → absolute.
            name = Path(raw[1:])
            if not name.is_absolute():
                name = base_dir / name
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": str(name),
            # A file, not Django's default in-memory test database, so that tests can run
            # a turn in a real subprocess (and kill it) against the same database; one
            # per test process, so two runs side by side never share it.
            "TEST": {"NAME": str(base_dir / "var" / f"test-arbor-{os.getpid()}.sqlite3")},
            # Wait for a writer instead of failing at once with "database is locked".
            # WAL: readers never wait for the writer, and a commit appends to the log
            # instead of rewriting pages. synchronous=NORMAL syncs at checkpoints, not
            # at every commit: a killed process loses nothing it committed (the log is
            # in the OS's hands); a power cut may lose the last commits, never corrupt.
            "OPTIONS": {
                "timeout": 20,
                "transaction_mode": "IMMEDIATE",
                "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            },
        }
    if scheme in {"postgres", "postgresql", "pgsql"}:
        dbname = unquote(parts.path.lstrip("/"))
        if not dbname:
            raise ImproperlyConfiguredEnv(f"DATABASE_URL {url!r} names no database")
        options = dict(parse_qsl(parts.query))
        return {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": dbname,
            "USER": unquote(parts.username or ""),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname or "",
            "PORT": str(parts.port or ""),
            "OPTIONS": options,
            # Under ASGI every sync_to_async thread holds its own connection: persistent
            # ones pile up until PostgreSQL refuses clients ("too many clients"), so they
            # close after each request unless ARBOR_DB_CONN_MAX_AGE says otherwise.
            "CONN_MAX_AGE": int(os.environ.get("ARBOR_DB_CONN_MAX_AGE", "0") or 0),
            "CONN_HEALTH_CHECKS": True,
        }
    raise ImproperlyConfiguredEnv(
        f"DATABASE_URL scheme {scheme!r} is not supported (use sqlite:/// or postgres://)"
    )


def database_url_of(db: dict[str, Any], vendor: str) -> str:
    """The DATABASE_URL naming a connection's database (the test database during tests),
    for a child process that must use the same one."""
    if vendor == "sqlite":
        return f"sqlite:///{db['NAME']}"
    host = db.get("HOST") or "127.0.0.1"
    return f"postgres://{db.get('USER') or ''}@{host}:{db.get('PORT') or 5432}/{db['NAME']}"
