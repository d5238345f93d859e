"""The import routes take the largest bodies (512 MB): an anonymous request is refused from
its headers, before one byte of the body is read (Django's ASGI handler would spool all of
it to a temporary file before any view or login check; issue 31). Driven through the
ASGI application as uvicorn drives it, then through a real uvicorn."""

from __future__ import annotations

import contextlib
import json
import socket
from typing import Any

from asgiref.sync import async_to_sync
from django.conf import settings
from django.test import TestCase, TransactionTestCase

from arbor.asgi import application
from arbor.bodylimit import BodyLimit
from conversations import services
from tests.builders import make_user, openwebui_chat
from tests.fake_models import child_env
from tests.live_server import free_port, start_uvicorn, stop

HUGE = 500 * 1024 * 1024


class Upload:
    """One request to an ASGI app; counts what of its body the app read."""

    def __init__(self, path: str, headers: dict[str, str], body: bytes = b"x" * 65536) -> None:
        self.scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "server": ("testserver", 80),
            "client": ("127.0.0.1", 5000),
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        }
        self.body = body
        self.reads = 0
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        self.reads += 1
        if self.reads == 1:
            return {"type": "http.request", "body": self.body, "more_body": False}
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def run(self, app: Any = application) -> int:
        async_to_sync(app)(self.scope, self.receive, self.send)
        status: int = self.sent[0]["status"]
        return status


async def _answers_unread(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


class AnonymousImportTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user("alice")
        _, cls.secret = services.api_token_create(user=cls.user, name="t")

    def huge(self, **headers: str) -> dict[str, str]:
        return {"content-type": "application/json", "content-length": str(HUGE), **headers}

    def test_an_anonymous_upload_is_refused_before_its_body_is_read(self) -> None:
        session = settings.SESSION_COOKIE_NAME
        cases = [
            ("/api/imports", {}, 401),
            ("/api/imports", {"authorization": "Bearer arb_not_a_token"}, 401),
            ("/api/imports", {"cookie": f"{session}=no-such-session"}, 401),
            ("/import/", {}, 403),
            ("/import/", {"cookie": f"{session}=no-such-session"}, 403),
            ("/import/", {"authorization": f"Bearer {self.secret}"}, 403),  # the page: session
        ]
        for path, headers, status in cases:
            with self.subTest(path=path, headers=headers):
                upload = Upload(path, self.huge(**headers))
                assert upload.run() == status
                assert upload.reads == 0, "the body was read before the request was refused"

    def test_a_signed_in_upload_is_read(self) -> None:
        self.client.force_login(self.user)
        name = settings.SESSION_COOKIE_NAME
        cookie = f"{name}={self.client.cookies[name].value}"
        for path, headers in (
            ("/api/imports", {"authorization": f"Bearer {self.secret}"}),
            ("/api/imports", {"cookie": cookie}),
            ("/import/", {"cookie": cookie}),
        ):
            with self.subTest(path=path, headers=headers):
                upload = Upload(path, self.huge(**headers))
                assert upload.run(BodyLimit(_answers_unread)) == 204


class LiveServerTests(TransactionTestCase):
    """``make run``'s server: a 500 MB upload declared by an anonymous client is answered
    while the client has sent only its first megabyte (before, the server waited for
    all of it and spooled it to disk before answering)."""

    def setUp(self) -> None:
        self.user = make_user("alice")
        _, self.secret = services.api_token_create(user=self.user, name="t")
        self.port = free_port()
        self.server = start_uvicorn(dict(child_env(), ALLOWED_HOSTS="127.0.0.1"), self.port)
        self.addCleanup(stop, self.server)

    def post(self, path: str, headers: str, body: bytes, length: int) -> tuple[int, bytes]:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n{headers}\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", self.port), timeout=60) as sock:
            sock.sendall(head)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(body)  # (the server may have answered and closed already)
            data = b""
            while True:
                try:
                    piece = sock.recv(65536)
                except ConnectionResetError:
                    break
                if not piece:
                    break
                data += piece
                head_end = data.find(b"\r\n\r\n")
                if head_end >= 0 and b"content-length:" in data[:head_end].lower():
                    length_at = data.lower().index(b"content-length:") + 15
                    size = int(data[length_at : data.index(b"\r\n", length_at)])
                    if len(data) >= head_end + 4 + size:
                        break
        status = int(data.split(b" ", 2)[1])
        return status, data.partition(b"\r\n\r\n")[2]

    def test_an_anonymous_upload_is_answered_before_it_is_sent(self) -> None:
        for path, status in (("/api/imports", 401), ("/import/", 403)):
            with self.subTest(path=path):
                got, body = self.post(path, "", b"x" * 1024 * 1024, HUGE)
                assert got == status, (got, body[:200])
                assert json.loads(body)["error"] in ("unauthorized", "forbidden")

    def test_a_signed_in_import_is_read_and_imported(self) -> None:
        data = openwebui_chat()
        status, body = self.post(
            "/api/imports", f"Authorization: Bearer {self.secret}\r\n", data, len(data)
        )
        assert status == 201, body[:300]
