"""The `make run` server (uvicorn) started by a benchmark on a free loopback port."""

from __future__ import annotations

import http.client
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

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


@contextmanager
def uvicorn(env: Mapping[str, str]) -> Iterator[int]:
    """Serve arbor.asgi on a free port with ``env``; yields the port."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "arbor.asgi:application", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning", "--no-access-log"],
        cwd=settings.BASE_DIR, env=dict(env),
    )  # fmt: skip
    try:
        wait_until_up(port)
        yield port
    finally:
        server.terminate()
        server.wait(20)
