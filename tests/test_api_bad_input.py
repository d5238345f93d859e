"""Bad input through the HTTP API: every case answers a clear 4xx JSON body
``{"error": code, "detail": text}`` and writes nothing at all."""

from __future__ import annotations

import base64
import io
import json
import os
import secrets
import struct
import tempfile
import uuid
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.files.uploadedfile import SimpleUploadedFile
from django.db import DatabaseError, transaction
from django.test import Client, TestCase, override_settings
from PIL import Image

from conversations import services
from conversations.models import Blob, Checkpoint, Conversation, Message
from tests.builders import make_user, new_conversation, text

JSON = "application/json"

if TYPE_CHECKING:
    # What django.test.Client answers: an HttpResponse with .json() and friends.
    from django.test.client import _MonkeyPatchedWSGIResponse as Response
else:
    Response = Any


def png_bytes(width: int = 3, height: int = 2, *, noise: bool = False) -> bytes:
    if noise:
        image = Image.frombytes("RGB", (width, height), os.urandom(width * height * 3))
    else:
        image = Image.new("RGB", (width, height), (10, 200, 10))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims the given size: a decompression bomb's calling card."""
    data = bytearray(png_bytes(1, 1))
    # IHDR is the first chunk: length (4) and type (4) at byte 8, width and height at 16.
    struct.pack_into(">II", data, 16, width, height)
    struct.pack_into(">I", data, 29, zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def image_bytes(kind: str) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (0, 0, 255)).save(buf, format=kind)
    return buf.getvalue()


SVG = (
    b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg" width="10" height="10">'
    b"<script>alert(document.cookie)</script><rect width='10' height='10'/></svg>"
)


def forged_cursor(raw: str) -> str:
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


class BadInputTestCase(TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        cls.media = tempfile.TemporaryDirectory()
        cls.addClassCleanup(cls.media.cleanup)
        cls.enterClassContext(override_settings(MEDIA_ROOT=cls.media.name))
        super().setUpClass()

    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user("alice")
        cls.bob = make_user("bob")
        _, cls.secret = services.api_token_create(user=cls.user, name="t")
        # a (user) > b (assistant) > c (user); tip c, version 3.
        cls.conv, cls.n = new_conversation(cls.user, "a>b>c", title="main")

    def setUp(self) -> None:
        self.api = Client(HTTP_AUTHORIZATION=f"Bearer {self.secret}")
        self.conv.refresh_from_db()

    # --- helpers ----------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        media = Path(settings.MEDIA_ROOT)
        return {
            "messages": Message.objects.count(),
            "conversations": list(
                Conversation.objects.order_by("id").values_list(
                    "id", "version", "tip_id", "title", "updated_at"
                )
            ),
            "checkpoints": list(
                Checkpoint.objects.order_by("id").values_list(
                    "id", "label", "state", "digest_message_id"
                )
            ),
            "blobs": Blob.objects.count(),
            "blob_owners": Blob.owners.through.objects.count(),
            "files": sorted(str(p) for p in media.rglob("*") if p.is_file()),
        }

    @contextmanager
    def nothing_written(self) -> Iterator[None]:
        """Assert the block writes nothing; roll back whatever it did write anyway, so one
        failing case cannot disturb the next."""
        before = self.state()
        with transaction.atomic():
            yield
            after = self.state()
            transaction.set_rollback(True)
        self.conv.refresh_from_db()
        assert after == before, "a rejected request wrote something"

    def call(self, request: Callable[[], Response]) -> Response:
        """Run one request in a savepoint: a database error (a 500 in production) fails
        the test with its cause instead of poisoning the test's transaction."""
        try:
            with transaction.atomic():
                return request()
        except DatabaseError as exc:
            self.fail(f"the database refused the input, so the API would answer 500: {exc!r}")

    def post(self, url: str, body: Any) -> Response:
        return self.call(lambda: self.api.post(url, body, content_type=JSON))

    def get(self, url: str) -> Response:
        return self.call(lambda: self.api.get(url))

    def upload(self, data: bytes, name: str = "f.png", content_type: str = "image/png") -> Any:
        return self.call(
            lambda: self.api.post(
                "/api/blobs", {"file": SimpleUploadedFile(name, data, content_type=content_type)}
            )
        )

    def rejected(self, response: Response, status: int, code: str) -> dict[str, Any]:
        assert response.status_code == status, (response.status_code, response.content)
        assert response["Content-Type"].startswith(JSON), response["Content-Type"]
        body: dict[str, Any] = response.json()
        assert body["error"] == code, body
        assert isinstance(body["detail"], str) and body["detail"].strip(), body
        return body

    def turn(self, messages: Any, *, parent: Any = "tip", version: int | None = None) -> Any:
        return self.post(
            f"/api/conversations/{self.conv.pk}/turns",
            {
                "parent": str(self.conv.tip_id) if parent == "tip" else parent,
                "expected_version": self.conv.version if version is None else version,
                "messages": messages,
            },
        )

    def bad_turn(self, messages: Any, code: str = "invalid", **kwargs: Any) -> dict[str, Any]:
        with self.nothing_written():
            return self.rejected(self.turn(messages, **kwargs), 422, code)


def call(call_id: str = "c1", name: str = "lookup") -> dict[str, Any]:
    return {"type": "tool_call", "id": call_id, "name": name, "arguments": {}}


def result(call_id: str = "c1") -> dict[str, Any]:
    return {"type": "tool_result", "call_id": call_id, "is_error": False, "parts": text("ok")}


class UnknownIdTests(BadInputTestCase):
    def test_it_answers_404_for_unknown_and_malformed_ids(self) -> None:
        cid, mid = self.conv.pk, self.n["c"].id
        unknown, sha = uuid.uuid4(), secrets.token_hex(32)
        gets = [
            f"/api/conversations/{unknown}",
            "/api/conversations/not-a-uuid",
            f"/api/conversations/{unknown}/path",
            f"/api/conversations/{unknown}/tree",
            f"/api/conversations/{unknown}/checkpoints",
            f"/api/conversations/{cid}/path?tip={unknown}",
            f"/api/conversations/{cid}/path?tip=not-a-uuid",
            f"/api/messages/{unknown}",
            "/api/messages/12345",
            f"/api/blobs/{sha}",
            "/api/blobs/not-a-hash",
        ]
        posts = [
            (
                f"/api/conversations/{unknown}/turns",
                {
                    "parent": None,
                    "expected_version": 0,
                    "messages": [{"role": "user", "parts": text("x")}],
                },
            ),
            (f"/api/conversations/{unknown}/tip", {"message": str(mid), "expected_version": 3}),
            (f"/api/conversations/{cid}/tip", {"message": str(unknown), "expected_version": 3}),
            (f"/api/conversations/{unknown}/checkpoints", {"label": "x"}),
            (f"/api/conversations/{unknown}/rewind", {"label": "x"}),
            (f"/api/messages/{unknown}/fork", {}),
            ("/api/messages/nope/fork", {}),
            (f"/api/messages/{unknown}/edit", {"parts": text("x"), "expected_version": 3}),
            (
                f"/api/messages/{unknown}/regenerate",
                {"expected_version": 3, "messages": [{"role": "assistant", "parts": text("x")}]},
            ),
        ]
        for url in gets:
            with self.subTest(url=url), self.nothing_written():
                self.rejected(self.get(url), 404, "not_found")
        for url, body in posts:
            with self.subTest(url=url), self.nothing_written():
                self.rejected(self.post(url, body), 404, "not_found")
        for url in (f"/api/conversations/{unknown}", "/api/conversations/zzz"):
            with self.subTest(url=url), self.nothing_written():
                self.rejected(self.call(partial(self.api.delete, url)), 404, "not_found")

    def test_it_rejects_malformed_ids_in_the_body(self) -> None:
        with self.nothing_written():
            body = self.rejected(
                self.post(
                    f"/api/conversations/{self.conv.pk}/tip",
                    {"message": "not-a-uuid", "expected_version": self.conv.version},
                ),
                422,
                "invalid",
            )
        assert "message" in body["detail"]
        self.bad_turn([{"role": "user", "parts": text("x")}], parent="not-a-uuid")

    def test_it_rejects_a_parent_from_another_conversation(self) -> None:
        _, other = new_conversation(self.user, "x>y")
        body = self.bad_turn(
            [{"role": "user", "parts": text("hi")}], "bad_parent", parent=str(other["y"].id)
        )
        assert str(other["y"].id) in body["detail"]
        self.bad_turn(
            [{"role": "user", "parts": text("hi")}], "bad_parent", parent=str(uuid.uuid4())
        )

    def test_it_will_not_move_the_tip_to_another_conversations_message(self) -> None:
        _, other = new_conversation(self.user, "x")
        with self.nothing_written():
            self.rejected(
                self.post(
                    f"/api/conversations/{self.conv.pk}/tip",
                    {"message": str(other["x"].id), "expected_version": self.conv.version},
                ),
                404,
                "not_found",
            )

    def test_it_rejects_bad_cursors_and_limits(self) -> None:
        for base in ("/api/conversations", f"/api/conversations/{self.conv.pk}/tree"):
            for cursor in (
                "!!!",
                forged_cursor("x|y|z|w"),
                forged_cursor("1|yesterday|nope"),
                forged_cursor("yesterday|nope"),
            ):
                with self.subTest(url=base, cursor=cursor), self.nothing_written():
                    self.rejected(self.get(f"{base}?cursor={cursor}"), 422, "bad_cursor")
            for limit in ("0", "-1", "100000", "many"):
                with self.subTest(url=base, limit=limit), self.nothing_written():
                    self.rejected(self.get(f"{base}?limit={limit}"), 422, "invalid")


class StaleVersionTests(BadInputTestCase):
    def assert_stale(self, response: Response) -> None:
        body = self.rejected(response, 409, "stale_version")
        assert body["version"] == 3
        assert body["tip"] == str(self.n["c"].id)

    def test_a_stale_version_answers_409_with_the_current_tip(self) -> None:
        cid = self.conv.pk
        requests = {
            "turn": (
                f"/api/conversations/{cid}/turns",
                {
                    "parent": str(self.n["c"].id),
                    "expected_version": 2,
                    "messages": [{"role": "assistant", "parts": text("late")}],
                },
            ),
            "tip": (
                f"/api/conversations/{cid}/tip",
                {"message": str(self.n["a"].id), "expected_version": 2},
            ),
            "ahead": (
                f"/api/conversations/{cid}/tip",
                {"message": str(self.n["a"].id), "expected_version": 4},
            ),
            "edit": (
                f"/api/messages/{self.n['c'].id}/edit",
                {"parts": text("c2"), "expected_version": 0},
            ),
            "regenerate": (
                f"/api/messages/{self.n['b'].id}/regenerate",
                {"expected_version": 1, "messages": [{"role": "assistant", "parts": text("b2")}]},
            ),
        }
        for name, (url, body) in requests.items():
            with self.subTest(name), self.nothing_written():
                self.assert_stale(self.post(url, body))

    def test_a_stale_rewind_writes_no_digest(self) -> None:
        services.checkpoint_create(conversation=self.conv, label="cp")
        with self.nothing_written():
            self.assert_stale(
                self.post(
                    f"/api/conversations/{self.conv.pk}/rewind",
                    {"label": "cp", "expected_version": 1},
                )
            )


class MalformedPartsTests(BadInputTestCase):
    def test_it_rejects_malformed_parts_and_names_where(self) -> None:
        cases: dict[str, tuple[list[Any], str]] = {
            "unknown part type": (
                [{"role": "user", "parts": [{"type": "video", "url": "x"}]}],
                "messages[0].parts[0].type",
            ),
            "missing text": ([{"role": "user", "parts": [{"type": "text"}]}], "parts[0].text"),
            "text not a string": (
                [{"role": "user", "parts": [{"type": "text", "text": 42}]}],
                "parts[0].text",
            ),
            "a part that is not an object": ([{"role": "user", "parts": ["hi"]}], "parts[0]"),
            "empty parts": ([{"role": "user", "parts": []}], "messages[0].parts"),
            "NUL in text": ([{"role": "user", "parts": text("a\x00b")}], "parts[0].text"),
            "unexpected key": (
                [{"role": "user", "parts": [{"type": "text", "text": "x", "html": "<b>"}]}],
                "messages[0].parts[0]",
            ),
            "unknown role": ([{"role": "wizard", "parts": text("x")}], "messages[0].role"),
            "tool call in a user message": (
                [
                    {"role": "user", "parts": [call()]},
                    {"role": "tool", "parts": [result()]},
                    {"role": "assistant", "parts": text("done")},
                ],
                "messages[0].parts[0]",
            ),
            "tool result in an assistant message": (
                [
                    {"role": "assistant", "parts": [call()]},
                    {"role": "assistant", "parts": [result()]},
                ],
                "messages[1].parts[0]",
            ),
            "tool result in a user message": (
                [{"role": "assistant", "parts": [call()]}, {"role": "user", "parts": [result()]}],
                "messages[1].parts[0]",
            ),
            "text in a tool message": (
                [
                    {"role": "assistant", "parts": [call()]},
                    {"role": "tool", "parts": [result(), *text("aside")]},
                    {"role": "assistant", "parts": text("done")},
                ],
                "messages[1].parts",
            ),
            "image in a system message": (
                [{"role": "system", "parts": [{"type": "image", "blob": "a" * 64}]}],
                "messages[0].parts",
            ),
            "bad blob hash": (
                [{"role": "user", "parts": [{"type": "image", "blob": "../../etc/passwd"}]}],
                "parts[0].blob",
            ),
            "tool result nested in a tool result": (
                [
                    {"role": "assistant", "parts": [call()]},
                    {"role": "tool", "parts": [{**result(), "parts": [result()]}]},
                    {"role": "assistant", "parts": text("done")},
                ],
                "messages[1].parts[0].parts[0]",
            ),
            "thinking in a user message": (
                [{"role": "user", "parts": [{"type": "thinking", "text": "hmm"}]}],
                "messages[0].parts[0]",
            ),
            "empty tool call id": (
                [
                    {"role": "assistant", "parts": [call(call_id="")]},
                    {"role": "tool", "parts": [result(call_id="")]},
                    {"role": "assistant", "parts": text("done")},
                ],
                "parts[0].id",
            ),
            "arguments not an object": (
                [
                    {"role": "assistant", "parts": [{**call(), "arguments": "[1]"}]},
                    {"role": "tool", "parts": [result()]},
                    {"role": "assistant", "parts": text("done")},
                ],
                "parts[0].arguments",
            ),
            "is_error not a boolean": (
                [
                    {"role": "assistant", "parts": [call()]},
                    {"role": "tool", "parts": [{**result(), "is_error": "yes"}]},
                    {"role": "assistant", "parts": text("done")},
                ],
                "parts[0].is_error",
            ),
        }
        for name, (messages, loc) in cases.items():
            with self.subTest(name):
                body = self.bad_turn(messages)
                locs = [e["loc"] for e in body.get("errors", [])]
                assert any(loc in found for found in locs), (loc, body)

    def test_it_rejects_parts_that_are_not_a_list(self) -> None:
        for parts in ("hello", {"type": "text", "text": "x"}, None):
            with self.subTest(parts=parts):
                body = self.bad_turn([{"role": "user", "parts": parts}])
                assert "parts" in body["detail"]

    def test_it_reports_every_problem_at_once(self) -> None:
        body = self.bad_turn(
            [
                {"role": "user", "parts": [{"type": "text"}, {"type": "gif"}]},
                {"role": "assistant", "parts": text("a\x00")},
            ]
        )
        assert len(body["errors"]) == 3

    def test_it_rejects_nul_characters_wherever_they_hide(self) -> None:
        # PostgreSQL cannot store U+0000 in text or jsonb: accepting one is a 500 there
        # and a different answer on SQLite, so the API refuses it everywhere.
        cases = {
            "tool call name": [
                {"role": "assistant", "parts": [call(name="a\x00b")]},
                {"role": "tool", "parts": [result()]},
                {"role": "assistant", "parts": text("done")},
            ],
            "tool call arguments": [
                {"role": "assistant", "parts": [{**call(), "arguments": {"q": "a\x00b"}}]},
                {"role": "tool", "parts": [result()]},
                {"role": "assistant", "parts": text("done")},
            ],
            "message metadata": [
                {"role": "user", "parts": text("hi"), "metadata": {"note": "a\x00b"}},
            ],
            "thinking signature": [
                {"role": "user", "parts": text("hi")},
                {
                    "role": "assistant",
                    "parts": [{"type": "thinking", "text": "t", "signature": "s\x00"}, *text("ok")],
                },
            ],
        }
        for name, messages in cases.items():
            with self.subTest(name):
                self.bad_turn(messages)

    def test_it_rejects_text_longer_than_the_limit(self) -> None:
        with override_settings(ARBOR_MAX_PART_CHARS=10):
            body = self.bad_turn([{"role": "user", "parts": text("x" * 11)}])
        assert "10" in str(body["errors"])

    def test_it_rejects_a_turn_with_too_many_messages(self) -> None:
        with override_settings(ARBOR_MAX_TURN_MESSAGES=2):
            self.bad_turn([{"role": "user", "parts": text(str(i))} for i in range(3)])

    def test_it_rejects_an_empty_message_list(self) -> None:
        body = self.bad_turn([])
        assert "messages" in body["detail"]

    def test_it_rejects_bad_parts_in_an_edit(self) -> None:
        url = f"/api/messages/{self.n['c'].id}/edit"
        for parts in ([], [{"type": "video"}], [call()], "text"):
            with self.subTest(parts=parts), self.nothing_written():
                self.rejected(
                    self.post(url, {"parts": parts, "expected_version": self.conv.version}),
                    422,
                    "invalid",
                )


class PairingTests(BadInputTestCase):
    def test_it_rejects_a_tool_call_without_its_result(self) -> None:
        body = self.bad_turn(
            [
                {"role": "user", "parts": text("go")},
                {"role": "assistant", "parts": [call("c1"), call("c2")]},
                {"role": "tool", "parts": [result("c1")]},
                {"role": "assistant", "parts": text("done")},
            ],
            "unpaired_tool_call",
        )
        assert "c2" in str(body["errors"])

    def test_it_rejects_a_tool_result_without_its_call(self) -> None:
        body = self.bad_turn(
            [
                {"role": "user", "parts": text("go")},
                {"role": "tool", "parts": [result("ghost")]},
                {"role": "assistant", "parts": text("done")},
            ],
            "unpaired_tool_call",
        )
        assert "ghost" in str(body["errors"])

    def test_it_rejects_a_result_that_comes_before_its_call(self) -> None:
        self.bad_turn(
            [
                {"role": "user", "parts": text("go")},
                {"role": "tool", "parts": [result("c1")]},
                {"role": "assistant", "parts": [call("c1")]},
                {"role": "assistant", "parts": text("done")},
            ],
            "unpaired_tool_call",
        )

    def test_it_rejects_a_turn_ending_on_a_tool_call(self) -> None:
        self.bad_turn(
            [{"role": "user", "parts": text("go")}, {"role": "assistant", "parts": [call()]}],
            "unpaired_tool_call",
        )

    def test_it_rejects_a_turn_ending_on_a_tool_result(self) -> None:
        self.bad_turn(
            [
                {"role": "user", "parts": text("go")},
                {"role": "assistant", "parts": [call()]},
                {"role": "tool", "parts": [result()]},
            ],
            "unpaired_tool_call",
        )

    def test_it_rejects_a_tool_call_id_used_twice(self) -> None:
        self.bad_turn(
            [
                {"role": "user", "parts": text("go")},
                {"role": "assistant", "parts": [call("c1")]},
                {"role": "tool", "parts": [result("c1")]},
                {"role": "assistant", "parts": [call("c1")]},
                {"role": "tool", "parts": [result("c1")]},
                {"role": "assistant", "parts": text("done")},
            ],
            "unpaired_tool_call",
        )


class MalformedBodyTests(BadInputTestCase):
    def raw(self, url: str, payload: bytes, content_type: str = JSON) -> Response:
        return self.call(lambda: self.api.post(url, payload, content_type=content_type))

    def test_it_answers_400_for_a_body_that_is_not_json(self) -> None:
        urls = [
            "/api/conversations",
            f"/api/conversations/{self.conv.pk}/turns",
            f"/api/conversations/{self.conv.pk}/tip",
            f"/api/conversations/{self.conv.pk}/checkpoints",
            f"/api/messages/{self.n['c'].id}/fork",
        ]
        for url in urls:
            for payload in (b'{"title": "x"', b"\xff\xfe", b"title=x"):
                with self.subTest(url=url, payload=payload), self.nothing_written():
                    self.rejected(self.raw(url, payload), 400, "bad_request")

    def test_nan_and_infinity_are_not_json(self) -> None:
        """Python's json module reads NaN/Infinity; JSON (and PostgreSQL's jsonb) does
        not: a tool call's arguments holding one are refused, not a database error."""
        url = f"/api/conversations/{self.conv.pk}/turns"
        for constant in ("NaN", "Infinity", "-Infinity", "1e999"):
            call = {"type": "tool_call", "id": "c1", "name": "calc", "arguments": {"x": 0.5}}
            result = {"type": "tool_result", "call_id": "c1", "parts": text("1")}
            body = {
                "parent": str(self.n["c"].id),
                "expected_version": self.conv.version,
                "messages": [
                    {"role": "assistant", "parts": [call]},
                    {"role": "tool", "parts": [result]},
                    {"role": "assistant", "parts": text("done")},
                ],
            }
            payload = json.dumps(body).replace("0.5", constant).encode()
            with self.subTest(constant=constant), self.nothing_written():
                body = self.rejected(self.raw(url, payload), 400, "bad_request")
                assert constant in body["detail"], body

    def test_too_many_form_fields_or_files_are_400(self) -> None:
        fields = {f"f{i}": "x" for i in range(1200)}
        with self.nothing_written():
            response = self.call(lambda: self.api.post("/api/blobs", fields))
            self.rejected(response, 400, "bad_request")
        files = {f"f{i}": SimpleUploadedFile(f"{i}.png", b"x") for i in range(120)}
        with self.nothing_written():
            response = self.call(lambda: self.api.post("/api/imports", files))
            self.rejected(response, 400, "bad_request")

    def test_a_body_that_is_not_a_json_object_is_400(self) -> None:
        # Routes whose fields all have defaults read [] or 5 as "all defaults" (a 201).
        urls = [
            "/api/conversations",
            f"/api/conversations/{self.conv.pk}/turns",
            f"/api/messages/{self.n['c'].id}/fork",
        ]
        bodies = {b"[]": "an array", b'"a string"': "a string", b"5": "a number",
                  b"null": "null", b"true": "a boolean"}  # fmt: skip
        for url in urls:
            for payload, kind in bodies.items():
                with self.subTest(url=url, payload=payload), self.nothing_written():
                    body = self.rejected(self.raw(url, payload), 400, "bad_request")
                    assert f"must be a JSON object, not {kind}" in body["detail"], body

    def test_it_answers_422_for_json_of_the_wrong_shape(self) -> None:
        url = f"/api/conversations/{self.conv.pk}/turns"
        bodies = [
            b"{}",
            b'{"parent": null, "messages": []}',
            b'{"parent": null, "expected_version": "three", "messages": []}',
            b'{"parent": null, "expected_version": 3, "messages": "hello"}',
            b'{"parent": null, "expected_version": 3, "messages": [{"parts": []}]}',
        ]
        for payload in bodies:
            with self.subTest(payload=payload), self.nothing_written():
                body = self.rejected(self.raw(url, payload), 422, "invalid")
                assert body["errors"]

    def test_it_answers_json_for_a_body_over_the_request_size_limit(self) -> None:
        # Django refuses a body over DATA_UPLOAD_MAX_MEMORY_SIZE before the API sees it;
        # the client must still get the API's JSON error shape, not an HTML page.
        url = f"/api/conversations/{self.conv.pk}/turns"
        body = {
            "parent": str(self.n["c"].id),
            "expected_version": self.conv.version,
            "messages": [{"role": "assistant", "parts": text("x" * 5000)}],
        }
        with override_settings(DATA_UPLOAD_MAX_MEMORY_SIZE=2000), self.nothing_written():
            response = self.call(
                lambda: Client(
                    HTTP_AUTHORIZATION=f"Bearer {self.secret}", raise_request_exception=False
                ).post(url, body, content_type=JSON)
            )
            assert response.status_code in (400, 413), response.status_code
            assert response["Content-Type"].startswith(JSON), response.content[:200]
            assert {"error", "detail"} <= set(response.json())

    def test_it_answers_json_for_a_method_the_route_does_not_have(self) -> None:
        for method, url in (
            ("put", f"/api/conversations/{self.conv.pk}"),
            ("delete", f"/api/conversations/{self.conv.pk}/path"),
            ("get", f"/api/conversations/{self.conv.pk}/turns"),
        ):
            with self.subTest(method=method, url=url), self.nothing_written():
                response = self.call(partial(getattr(self.api, method), url))
                self.rejected(response, 405, "method_not_allowed")

    def test_it_answers_json_for_an_unknown_api_path(self) -> None:
        for url in ("/api/nothing-here", f"/api/conversations/{self.conv.pk}/nothing"):
            with self.subTest(url=url), self.nothing_written():
                self.rejected(self.get(url), 404, "not_found")

    def test_an_out_of_range_version_is_just_stale(self) -> None:
        for version in (-1, 2**31, 2**63, 2**70):
            with self.subTest(version=version), self.nothing_written():
                response = self.post(
                    f"/api/conversations/{self.conv.pk}/tip",
                    {"message": str(self.n["a"].id), "expected_version": version},
                )
                assert self.rejected(response, 409, "stale_version")["version"] == 3

    def test_it_rejects_an_overlong_title(self) -> None:
        with self.nothing_written():
            self.rejected(self.post("/api/conversations", {"title": "x" * 201}), 422, "invalid")

    def test_it_rejects_nul_characters_in_conversation_fields(self) -> None:
        # On PostgreSQL a NUL reaches the database as a DataError (a 500).
        for field in ("title", "system_prompt", "model"):
            with self.subTest(field), self.nothing_written():
                self.rejected(self.post("/api/conversations", {field: "a\x00b"}), 422, "invalid")


class BlobInputTests(BadInputTestCase):
    def test_it_rejects_an_oversized_upload(self) -> None:
        data = png_bytes(40, 40, noise=True)
        assert len(data) > 4000
        # Far over (refused before reading) and just over (refused after reading).
        for limit in (1000, len(data) - 1):
            with (
                self.subTest(limit=limit),
                override_settings(ARBOR_MAX_BLOB_BYTES=limit),
                self.nothing_written(),
            ):
                self.rejected(self.upload(data), 422, "blob_too_large")

    def test_it_rejects_uploads_that_are_not_images(self) -> None:
        cases = {
            "text": (b"hello, I am not a picture", "notes.txt", "text/plain"),
            "empty": (b"", "empty.png", "image/png"),
            "html named png": (b"<html><script>alert(1)</script></html>", "x.png", "image/png"),
            "truncated png": (png_bytes(64, 64, noise=True)[:200], "cut.png", "image/png"),
            "svg": (SVG, "evil.svg", "image/svg+xml"),
            "svg named png": (SVG, "evil.png", "image/png"),
        }
        for name, (data, filename, content_type) in cases.items():
            with self.subTest(name), self.nothing_written():
                self.rejected(self.upload(data, filename, content_type), 422, "not_an_image")

    def test_it_rejects_image_formats_outside_the_allowed_list(self) -> None:
        for kind in ("BMP", "TIFF"):
            with self.subTest(kind), self.nothing_written():
                body = self.rejected(self.upload(image_bytes(kind)), 422, "unsupported_image")
                assert kind in body["detail"]

    def test_it_rejects_an_image_over_the_pixel_limit(self) -> None:
        with override_settings(ARBOR_MAX_IMAGE_PIXELS=100), self.nothing_written():
            body = self.rejected(self.upload(png_bytes(20, 20)), 422, "image_too_large")
        assert "400" in body["detail"]
        with override_settings(ARBOR_MAX_IMAGE_PIXELS=400):
            assert self.upload(png_bytes(20, 20)).status_code == 201

    def test_it_rejects_a_decompression_bomb_as_too_large(self) -> None:
        # 50 Mpx is over Arbor's default limit (40 Mpx); 900 Mpx is over Pillow's own
        # bomb limit too. Either way the client should hear that the image is too large.
        for width, height in ((10_000, 5_000), (30_000, 30_000)):
            with self.subTest(pixels=width * height), self.nothing_written():
                self.rejected(self.upload(png_claiming(width, height)), 422, "image_too_large")

    def test_it_rejects_a_request_without_a_file(self) -> None:
        with self.nothing_written():
            self.rejected(self.call(lambda: self.api.post("/api/blobs", {})), 422, "invalid")
        with self.nothing_written():
            response = self.call(
                lambda: self.api.post(
                    "/api/blobs", {"other": SimpleUploadedFile("a.png", png_bytes())}
                )
            )
            self.rejected(response, 422, "invalid")

    def test_an_image_part_needs_a_blob_this_user_uploaded(self) -> None:
        bobs = services.blob_store(owner=self.bob, data=png_bytes(5, 5))
        never = secrets.token_hex(32)
        for name, sha in {"never uploaded": never, "uploaded by another user": bobs.sha256}.items():
            with self.subTest(name):
                body = self.bad_turn(
                    [
                        {"role": "user", "parts": [*text("look"), {"type": "image", "blob": sha}]},
                        {"role": "assistant", "parts": text("nice")},
                    ],
                    "unknown_blob",
                )
                assert body["blobs"] == [sha]

    def test_an_image_inside_a_tool_result_needs_an_uploaded_blob_too(self) -> None:
        sha = secrets.token_hex(32)
        body = self.bad_turn(
            [
                {"role": "user", "parts": text("draw")},
                {"role": "assistant", "parts": [call()]},
                {
                    "role": "tool",
                    "parts": [{**result(), "parts": [{"type": "image", "blob": sha}]}],
                },
                {"role": "assistant", "parts": text("done")},
            ],
            "unknown_blob",
        )
        assert body["blobs"] == [sha]


class ForkInputTests(BadInputTestCase):
    def test_it_rejects_an_unknown_scope(self) -> None:
        url = f"/api/messages/{self.n['b'].id}/fork"
        for scope in ("everything", "", "PATH"):
            with self.subTest(scope=scope), self.nothing_written():
                self.rejected(self.post(url, {"scope": scope}), 422, "bad_scope")
        with self.nothing_written():
            self.rejected(self.post(url, {"scope": ["path"]}), 422, "invalid")

    def test_it_rejects_a_nul_in_the_fork_title(self) -> None:
        with self.nothing_written():
            self.rejected(
                self.post(f"/api/messages/{self.n['b'].id}/fork", {"title": "a\x00b"}),
                422,
                "invalid",
            )


class EditRegenerateInputTests(BadInputTestCase):
    def test_only_user_messages_can_be_edited(self) -> None:
        with self.nothing_written():
            self.rejected(
                self.post(
                    f"/api/messages/{self.n['b'].id}/edit",
                    {"parts": text("x"), "expected_version": self.conv.version},
                ),
                422,
                "not_editable",
            )

    def test_only_assistant_answers_can_be_regenerated(self) -> None:
        with self.nothing_written():
            self.rejected(
                self.post(
                    f"/api/messages/{self.n['c'].id}/regenerate",
                    {
                        "messages": [{"role": "assistant", "parts": text("x")}],
                        "expected_version": self.conv.version,
                    },
                ),
                422,
                "not_regenerable",
            )

    def test_a_regenerated_answer_starts_with_an_assistant_message(self) -> None:
        url = f"/api/messages/{self.n['b'].id}/regenerate"
        for messages in ([], [{"role": "user", "parts": text("x")}]):
            with self.subTest(messages=messages), self.nothing_written():
                self.rejected(
                    self.post(url, {"messages": messages, "expected_version": self.conv.version}),
                    422,
                    "invalid",
                )


class CheckpointInputTests(BadInputTestCase):
    def checkpoint(self, label: Any, conv: Conversation | None = None) -> Response:
        conv = conv or self.conv
        return self.post(f"/api/conversations/{conv.pk}/checkpoints", {"label": label})

    def test_it_rejects_an_empty_or_overlong_label(self) -> None:
        for label in ("", "   ", "x" * 101):
            with self.subTest(label=label), self.nothing_written():
                self.rejected(self.checkpoint(label), 422, "bad_label")
        for body in ({}, {"label": None}, {"label": 7}):
            with self.subTest(body=body), self.nothing_written():
                url = f"/api/conversations/{self.conv.pk}/checkpoints"
                self.rejected(self.post(url, body), 422, "invalid")

    def test_it_rejects_a_nul_in_the_label(self) -> None:
        with self.nothing_written():
            self.rejected(self.checkpoint("a\x00b"), 422, "bad_label")

    def test_it_refuses_a_duplicate_live_label(self) -> None:
        services.checkpoint_create(conversation=self.conv, label="x")
        for label in ("x", "  x  "):
            with self.subTest(label=label), self.nothing_written():
                self.rejected(self.checkpoint(label), 409, "label_taken")

    def test_a_dropped_label_can_be_used_again(self) -> None:
        cp = services.checkpoint_create(conversation=self.conv, label="x")
        services.checkpoint_drop(checkpoint=cp, reason="trimmed")
        assert self.checkpoint("x").status_code == 201

    def test_it_refuses_a_checkpoint_on_an_empty_conversation(self) -> None:
        empty, _ = new_conversation(self.user)
        with self.nothing_written():
            self.rejected(self.checkpoint("x", empty), 409, "empty")

    def test_it_refuses_a_checkpoint_between_a_call_and_its_result(self) -> None:
        turn = services.turn_append(
            conversation=self.conv,
            parent_id=self.n["c"].id,
            expected_version=self.conv.version,
            messages=[
                {"role": "assistant", "parts": [call()]},
                {"role": "tool", "parts": [result()]},
                {"role": "assistant", "parts": text("done")},
            ],
        )
        for mid in turn.message_ids[:2]:
            self.conv.refresh_from_db()
            services.tip_move(
                conversation=self.conv, message_id=mid, expected_version=self.conv.version
            )
            with self.subTest(at=mid), self.nothing_written():
                self.rejected(self.checkpoint("mid"), 409, "not_at_boundary")


class RewindInputTests(BadInputTestCase):
    def rewind(self, body: dict[str, Any]) -> Response:
        return self.post(f"/api/conversations/{self.conv.pk}/rewind", body)

    def test_it_answers_404_for_an_unknown_label(self) -> None:
        services.checkpoint_create(conversation=self.conv, label="known")
        with self.nothing_written():
            body = self.rejected(self.rewind({"label": "unknown"}), 404, "unknown_checkpoint")
        assert "unknown" in body["detail"]

    def test_it_answers_409_for_a_dropped_label(self) -> None:
        cp = services.checkpoint_create(conversation=self.conv, label="gone")
        services.checkpoint_drop(checkpoint=cp, reason="its turn was trimmed on resume")
        with self.nothing_written():
            body = self.rejected(self.rewind({"label": "gone"}), 409, "checkpoint_dropped")
        assert body["reason"] == "its turn was trimmed on resume"
        cp.refresh_from_db()
        assert cp.message_id == self.n["c"].id

    def test_it_rejects_a_bad_label_or_digest(self) -> None:
        services.checkpoint_create(conversation=self.conv, label="cp")
        with self.nothing_written():
            self.rejected(self.rewind({"label": ""}), 422, "bad_label")
        with self.nothing_written():
            self.rejected(self.rewind({"label": "cp", "digest": 5}), 422, "invalid")
        with self.nothing_written():
            self.rejected(self.rewind({"label": "cp", "digest": "x" * 100_001}), 422, "invalid")

    def test_it_rejects_a_nul_in_the_digest(self) -> None:
        services.checkpoint_create(conversation=self.conv, label="cp")
        with self.nothing_written():
            self.rejected(self.rewind({"label": "cp", "digest": "a\x00b"}), 422, "invalid")
