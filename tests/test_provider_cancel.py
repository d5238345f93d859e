"""Stop cuts a model call that has gone silent (``Provider.cancel``), over plain HTTP and
over TLS as the real providers speak it: closing an HTTP client does not wake a thread
blocked reading, so the transport shuts the call's sockets down, and a TLS stream takes
its socket over from the TCP one it wraps."""

from __future__ import annotations

import socket
import ssl
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx2
import pytest

from conversations.providers.client import CallCancelled, DeadlineTransport

HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
    b"transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n"
)


def self_signed() -> tuple[str, str]:
    folder = Path(tempfile.mkdtemp())
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1"],
        check=True, capture_output=True,
    )  # fmt: skip
    return str(cert), str(key)


def silent_server(tls: bool) -> tuple[int, threading.Event]:
    """A server that answers with headers and one chunk, then says nothing for 30 s."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    context = None
    if tls:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*self_signed())
    done = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        if context is not None:
            conn = context.wrap_socket(conn, server_side=True)
        conn.recv(65536)
        conn.sendall(HEAD)
        done.wait(30)
        conn.close()
        listener.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1], done


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_cancel_cuts_a_silent_stream(tls: bool) -> None:
    port, done = silent_server(tls)
    transport = DeadlineTransport(verify=False)
    client = httpx2.Client(transport=transport, timeout=60)
    scheme = "https" if tls else "http"
    outcome: dict[str, object] = {}

    def read() -> None:
        try:
            with client.stream("GET", f"{scheme}://127.0.0.1:{port}/") as response:
                for chunk in response.iter_raw():
                    outcome.setdefault("first", chunk)
        except httpx2.HTTPError as exc:
            outcome["error"] = exc
        outcome["ended"] = time.monotonic()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 10
    while "first" not in outcome:
        assert time.monotonic() < deadline, "the server's first chunk never came"
        time.sleep(0.01)
    transport.cancel()
    reader.join(10)
    done.set()
    assert not reader.is_alive(), "the read was still blocked after cancel()"
    assert isinstance(outcome.get("error"), httpx2.HTTPError), outcome
    # A later request (an SDK's retry) ends before anything is sent, with an error an
    # SDK does not retry.
    with pytest.raises(CallCancelled):
        client.get(f"{scheme}://127.0.0.1:{port}/")
