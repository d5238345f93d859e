"""The `make run` server (uvicorn) started by a test, and the one way tests wait for it.

A server is ready when it answers, not after a fixed sleep: ``wait_ready`` polls the
port and gives up only after ``READY_SECONDS`` (generous: on a machine under heavy load a
server can take tens of seconds to import Django and open its port, and a test that fails
because the machine is busy teaches people to ignore failures). A server that exits
while it is waited for fails the test at once, with its exit status.
"""

from __future__ import annotations

import http.client
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from conversations.management.liveserver import free_port

ROOT = Path(__file__).resolve().parent.parent
# The ceiling on waiting for a server, a worker or a child process to come up.
READY_SECONDS = 120.0
# The ceiling on waiting for a job that reads its pages back with tesseract (OCR): tens
# of seconds on a quiet machine, several minutes on a loaded one.
OCR_SECONDS = 600


def http_answers(port: int, path: str = "/login/") -> Callable[[], bool]:
    """A probe: whether the server on ``port`` answers a GET of ``path`` (any status)."""

    def probe() -> bool:
        client = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            client.request("GET", path)
            client.getresponse().read()
            return True
        except OSError:
            return False
        finally:
            client.close()

    return probe


def wait_ready(
    process: subprocess.Popen[bytes] | None,
    ready: Callable[[], bool],
    what: str,
    seconds: float = READY_SECONDS,
) -> None:
    """Poll ``ready`` until it is true; fail if ``process`` exits first or after
    ``seconds``."""
    deadline = time.monotonic() + seconds
    while not ready():
        if process is not None and process.poll() is not None:
            raise AssertionError(f"{what} exited ({process.returncode}) before it was ready")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} was not ready after {seconds:.0f} s")
        time.sleep(0.2)


def start_uvicorn(
    env: Mapping[str, str], port: int, *, path: str = "/login/"
) -> subprocess.Popen[bytes]:
    """Serve arbor.asgi on ``port`` with ``env``; return once it answers ``path``."""
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "arbor.asgi:application",
         "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        cwd=ROOT, env=dict(env),
    )  # fmt: skip
    try:
        wait_ready(server, http_answers(port, path), f"uvicorn on port {port}")
    except BaseException:
        stop(server)
        raise
    return server


def stop(server: subprocess.Popen[bytes]) -> None:
    server.terminate()
    try:
        server.wait(20)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


@contextmanager
def uvicorn_server(env: Mapping[str, str], *, path: str = "/login/") -> Iterator[int]:
    """Serve arbor.asgi on a free port with ``env``; yields the port once it answers."""
    port = free_port()
    server = start_uvicorn(env, port, path=path)
    try:
        yield port
    finally:
        stop(server)
