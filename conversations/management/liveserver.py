"""The `make run` server (uvicorn) started by a benchmark on a free loopback port."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from django.conf import settings


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def wait_until_up(port: int, path: str = "/login/", seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", path)
            conn.getresponse().read()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("uvicorn did not start")


def process_cpu_seconds(pid: int) -> float:
    """User and system CPU time a process (not its children) has used so far, from
    /proc (ticks of 1/SC_CLK_TCK s: add up many requests before dividing)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        # The name field may hold spaces: the numbers start after its closing parenthesis.
        fields = stat.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (fields 14, 15)


@contextmanager
def uvicorn_process(env: Mapping[str, str]) -> Iterator[tuple[int, int]]:
    """Serve arbor.asgi on a free port with ``env``; yields the port and the server's
    pid (for its CPU time)."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "arbor.asgi:application", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning", "--no-access-log"],
        cwd=settings.BASE_DIR, env=dict(env),
    )  # fmt: skip
    try:
        wait_until_up(port)
        yield port, server.pid
    finally:
        server.terminate()
        server.wait(20)


@contextmanager
def uvicorn(env: Mapping[str, str]) -> Iterator[int]:
    """Serve arbor.asgi on a free port with ``env``; yields the port."""
    with uvicorn_process(env) as (port, _):
        yield port


def gateway_env(models: Mapping[str, Any]) -> dict[str, str]:
    """The environment of a `make run` server whose ARBOR_MODELS file declares
    ``models`` (written to a temporary file), with Arbor's own upstream key."""
    path = Path(tempfile.mkdtemp()) / "models.json"
    path.write_text(json.dumps({"models": dict(models)}))
    return dict(
        os.environ,
        ARBOR_MODELS=str(path),
        ANTHROPIC_API_KEY="sk-ant-bench",
        ALLOWED_HOSTS="127.0.0.1",
        ARBOR_INPROCESS_JOBS="thread",
    )
