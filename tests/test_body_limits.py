"""Oversized request bodies are refused with 413 before anything is stored, on any URL
(a login form, a 404, the API, the gateway), whether the size is declared up front or
only discovered while a chunked body streams in."""

from __future__ import annotations

import json
import socket

from django.test import TransactionTestCase

from tests.gateway_live import LiveGateway


class BodyLimitTests(TransactionTestCase):
    def setUp(self) -> None:
        self.gateway = LiveGateway().start()
        self.addCleanup(self.gateway.stop)

    def raw(self, request: bytes, body_chunks: list[bytes] = ()) -> tuple[int, bytes]:  # type: ignore[assignment]
        with socket.create_connection(("127.0.0.1", self.gateway.port), timeout=30) as sock:
            sock.sendall(request)
            try:
                for chunk in body_chunks:
                    sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server stopped reading: it answered already
            data = b""
            while b"\r\n\r\n" not in data:
                piece = sock.recv(65536)
                if not piece:
                    break
                data += piece
            head, _, rest = data.partition(b"\r\n\r\n")
            status = int(head.split(b" ")[1])
            while True:
                try:
                    piece = sock.recv(65536)
                except (ConnectionResetError, TimeoutError):
                    break
                if not piece:
                    break
                rest += piece
        return status, rest

    def test_a_declared_size_over_the_limit_is_refused_unread(self) -> None:
        for path in ("/login/", "/no/such/page/", "/api/blobs"):
            request = (
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                "Content-Type: application/octet-stream\r\nContent-Length: 300000000\r\n\r\n"
            ).encode()
            status, body = self.raw(request)  # the 300 MB are never sent
            self.assertEqual(status, 413, (path, body[:200]))
            self.assertEqual(json.loads(body)["error"], "request_too_large")

    def test_a_chunked_body_is_cut_at_the_limit(self) -> None:
        request = (
            b"POST /login/ HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/x-www-form-urlencoded\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        chunk = b"x" * 65536
        chunks = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * 40 + [b"0\r\n\r\n"]  # 2.5 MB
        status, body = self.raw(request, chunks)
        self.assertEqual(status, 413, body[:200])

    def test_the_gateway_answers_in_the_providers_shape(self) -> None:
        request = (
            b"POST /gateway/anthropic/v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 40000000\r\n\r\n"
        )
        status, body = self.raw(request)
        self.assertEqual(status, 413)
        self.assertEqual(json.loads(body)["error"]["type"], "request_too_large")

    def test_a_body_within_the_limit_goes_through(self) -> None:
        status, _, _ = self.gateway.call("POST", "/login/", {"x": "y" * 1000})
        self.assertNotEqual(status, 413)

    def test_the_gateways_lean_handler_checks_the_host_and_sends_nosniff(self) -> None:
        # The gateway skips the site's middleware (arbor/gateway_asgi.py) but not these.
        def head(host: str) -> bytes:
            request = (
                f"GET /gateway/openai/v1/models HTTP/1.1\r\nHost: {host}\r\n"
                "Connection: close\r\n\r\n"
            ).encode()
            with socket.create_connection(("127.0.0.1", self.gateway.port), timeout=30) as sock:
                sock.sendall(request)
                data = b""
                while piece := sock.recv(65536):
                    data += piece
            return data.partition(b"\r\n\r\n")[0].lower()

        assert head("evil.example").startswith(b"http/1.1 400")
        answer = head("127.0.0.1")
        assert answer.startswith(b"http/1.1 401")  # no token: the provider-shaped 401
        assert b"x-content-type-options: nosniff" in answer
        assert b"permissions-policy:" in answer
