"""Who may call what: one test per role, each driven over every route of the tree API.

Roles: the owner (bearer token, and a signed-in browser with its CSRF token), a stranger
(another user with a valid token, using the owner's ids), anonymous, a bad bearer token,
and a signed-in browser that forgot the CSRF token. A route added to
``conversations/api.py`` without a row in ROUTES fails ``test_the_table_covers_every_route``.
"""

from __future__ import annotations

import io
import itertools
import re
import secrets
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client, TestCase, override_settings
from django.utils import timezone
from PIL import Image

from arbor.procs import process_identity
from compaction.api import router as compaction_router
from conversations import services
from conversations.api import router
from conversations.api_imports import router as imports_router
from conversations.models import (
    ApiToken,
    Blob,
    Checkpoint,
    Conversation,
    Message,
    TurnAttempt,
)
from tests.builders import make_user, new_conversation, text

JSON = "application/json"

if TYPE_CHECKING:
    # What django.test.Client answers: an HttpResponse with .json() and friends.
    from django.test.client import _MonkeyPatchedWSGIResponse as Response
else:
    Response = Any


_seeds = itertools.count(1)


def png_bytes(seed: int | None = None) -> bytes:
    """A small PNG; each call without a seed gives different bytes (a different blob)."""
    seed = next(_seeds) if seed is None else seed
    buf = io.BytesIO()
    Image.new("RGB", (2, 3), (seed % 256, (seed // 256) % 256, 7)).save(buf, format="PNG")
    return buf.getvalue()


@dataclass(frozen=True)
class Ids:
    """The ids a request names: the owner's real ones, or random ones nobody has."""

    cid: str
    mids: dict[str, str]
    sha: str
    version: int

    @classmethod
    def random(cls, like: Ids) -> Ids:
        return cls(
            cid=str(uuid.uuid4()),
            mids={name: str(uuid.uuid4()) for name in like.mids},
            sha=secrets.token_hex(32),
            version=like.version,
        )

    def placeholders(self) -> dict[str, str]:
        out = {self.cid: "<cid>", self.sha: "<sha>"}
        out.update({mid: f"<mid {name}>" for name, mid in self.mids.items()})
        return out


Body = Callable[[Ids], dict[str, Any]]


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # as declared on the router, e.g. "/conversations/{cid}"
    ok: int
    body: Body | None = None
    mid: str = "c"  # which of the owner's messages {mid} names
    upload: bool = False
    # False for routes that name none of the owner's ids (create, list, upload).
    names_owned_ids: bool = True
    # The error code for an id that is missing (or another user's).
    missing: str = "not_found"
    # False for a POST that may rightly change nothing (compacting a short path).
    writes: bool = True
    safe: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "safe", self.method == "GET")

    def __str__(self) -> str:
        return f"{self.method} {self.path}"

    def url(self, ids: Ids) -> str:
        path = self.path.format(cid=ids.cid, mid=ids.mids[self.mid], sha256=ids.sha)
        return "/api" + path

    def call(self, client: Client, ids: Ids, **headers: str) -> Response:
        url = self.url(ids)
        if self.upload:
            upload = SimpleUploadedFile("p.png", png_bytes(), content_type="image/png")
            return client.post(url, {"file": upload}, headers=headers)
        if self.method == "GET":
            return client.get(url, headers=headers)
        if self.method == "DELETE":
            return client.delete(url, headers=headers)
        if self.method == "PATCH":
            body = self.body(ids) if self.body else {}
            return client.patch(url, body, content_type=JSON, headers=headers)
        body = self.body(ids) if self.body else {}
        return client.post(url, body, content_type=JSON, headers=headers)


# The owner's conversation is a (user) > b (assistant) > c (user), tip c, version 3, with
# a live checkpoint "cp" at c, plus one uploaded blob.
ROUTES = [
    Route("POST", "/conversations", 201, lambda ids: {"title": "new"}, names_owned_ids=False),
    Route("GET", "/conversations", 200, names_owned_ids=False),
    Route("GET", "/conversations/{cid}", 200),
    Route("PATCH", "/conversations/{cid}", 200, lambda ids: {"title": "renamed"}),
    Route("DELETE", "/conversations/{cid}", 204),
    Route("GET", "/conversations/{cid}/path", 200),
    Route("GET", "/conversations/{cid}/tree", 200),
    Route("GET", "/conversations/{cid}/context", 200),
    # The owner's three messages fit any budget: there is nothing to compact.
    Route("POST", "/conversations/{cid}/context", 200, writes=False),
    Route("GET", "/messages/{mid}", 200),
    Route(
        "POST",
        "/conversations/{cid}/turns",
        201,
        lambda ids: {
            "parent": ids.mids["c"],
            "expected_version": ids.version,
            "messages": [{"role": "assistant", "parts": text("d")}],
        },
    ),
    Route(
        "POST",
        "/conversations/{cid}/tip",
        200,
        lambda ids: {"message": ids.mids["a"], "expected_version": ids.version},
    ),
    Route(
        "POST",
        "/messages/{mid}/edit",
        201,
        lambda ids: {"parts": text("c2"), "expected_version": ids.version},
    ),
    Route(
        "POST",
        "/messages/{mid}/regenerate",
        201,
        lambda ids: {
            "messages": [{"role": "assistant", "parts": text("b2")}],
            "expected_version": ids.version,
        },
        mid="b",
    ),
    Route("POST", "/messages/{mid}/fork", 201, lambda ids: {"scope": "path"}),
    Route("GET", "/conversations/{cid}/checkpoints", 200),
    Route("POST", "/conversations/{cid}/checkpoints", 201, lambda ids: {"label": "fresh"}),
    Route("POST", "/conversations/{cid}/rewind", 200, lambda ids: {"label": "cp"}),
    Route(
        "POST",
        "/conversations/{cid}/messages",
        201,
        lambda ids: {"parts": [{"type": "text", "text": "hi"}], "model": "fake/demo"},
    ),
    # DESIGN.md invariant 7: retry on a missing conversation is "nothing_loaded".
    Route("POST", "/conversations/{cid}/retry", 201, missing="nothing_loaded"),
    Route("POST", "/conversations/{cid}/stop", 202),
    Route("POST", "/blobs", 201, upload=True, names_owned_ids=False),
    Route("GET", "/blobs/{sha256}", 200),
    # conversations/api_imports.py (its own router): an import sent as a raw JSON body,
    # an Open WebUI chat; the export answers Arbor JSON by default.
    Route(
        "POST",
        "/imports",
        201,
        lambda ids: {
            "title": "imported",
            "history": {
                "currentId": "m2",
                "messages": {
                    "m1": {"id": "m1", "parentId": None, "role": "user", "content": "hi"},
                    "m2": {"id": "m2", "parentId": "m1", "role": "assistant", "content": "yo"},
                },
            },
        },
        names_owned_ids=False,
    ),
    Route("GET", "/conversations/{cid}/export", 200),
]


def snapshot(cid: str) -> dict[str, Any]:
    """Everything a request could have written."""
    conv = Conversation.objects.filter(pk=cid).values(
        "version", "tip_id", "title", "updated_at", "forked_from_id"
    )
    return {
        "conversation": list(conv),
        "conversations": Conversation.objects.count(),
        "messages": Message.objects.count(),
        "checkpoints": list(
            Checkpoint.objects.order_by("id").values_list(
                "id", "label", "state", "digest_message_id", "updated_at"
            )
        ),
        "blobs": Blob.objects.count(),
        "stops": TurnAttempt.objects.filter(stop_requested_at__isnull=False).count(),
        "blob_owners": Blob.owners.through.objects.count(),
    }


def error_of(response: Response) -> dict[str, Any]:
    assert response["Content-Type"].startswith(JSON), response["Content-Type"]
    body: dict[str, Any] = response.json()
    assert isinstance(body.get("error"), str) and isinstance(body.get("detail"), str), body
    return body


def normalised(value: Any, ids: Ids) -> Any:
    """An error body with the ids it names replaced by placeholders, so that answers for
    different ids can be compared word for word."""
    if isinstance(value, dict):
        return {key: normalised(item, ids) for key, item in value.items()}
    if isinstance(value, list):
        return [normalised(item, ids) for item in value]
    if isinstance(value, str):
        for real, placeholder in ids.placeholders().items():
            # Some messages may print an id without its dashes: normalise those too.
            value = value.replace(real, placeholder).replace(real.replace("-", ""), placeholder)
    return value


class PermissionTestCase(TestCase):
    @classmethod
    def setUpClass(cls) -> None:
        media = tempfile.TemporaryDirectory()
        cls.addClassCleanup(media.cleanup)
        cls.enterClassContext(override_settings(MEDIA_ROOT=media.name))
        super().setUpClass()

    @classmethod
    def setUpTestData(cls) -> None:
        cls.alice = make_user("alice")
        cls.bob = make_user("bob")
        _, cls.alice_secret = services.api_token_create(user=cls.alice, name="a")
        _, cls.bob_secret = services.api_token_create(user=cls.bob, name="b")

    def world(self) -> Ids:
        """A fresh conversation of Alice's, so each route starts from the same state."""
        conv, nodes = new_conversation(self.alice, "a>b>c", title="alice's")
        services.checkpoint_create(conversation=conv, label="cp")
        # A turn running in this process (older than the failed one below, so retry
        # still finds that one last), so that stop has something to stop.
        TurnAttempt.objects.create(
            conversation=conv,
            parent=nodes["c"],
            input_parts=[{"type": "text", "text": "running"}],
            model="fake/demo",
            worker=process_identity(),
            created_at=timezone.now() - timedelta(seconds=5),
        )
        # A failed turn, so that retry has something to run.
        TurnAttempt.objects.create(
            conversation=conv,
            parent=nodes["c"],
            input_parts=[{"type": "text", "text": "again"}],
            model="fake/demo",
            status="failed",
            error_code="provider_unavailable",
        )
        blob = services.blob_store(owner=self.alice, data=png_bytes())
        conv.refresh_from_db()
        return Ids(
            cid=str(conv.pk),
            mids={name: str(m.id) for name, m in nodes.items()},
            sha=blob.sha256,
            version=conv.version,
        )

    def bearer(self, secret: str) -> Client:
        # CSRF checks on: a bearer request must not need them.
        return Client(enforce_csrf_checks=True, HTTP_AUTHORIZATION=f"Bearer {secret}")

    def browser(self) -> tuple[Client, str]:
        client = Client(enforce_csrf_checks=True)
        client.force_login(self.alice)
        assert client.get("/admin/login/").status_code == 200  # sets the CSRF cookie
        return client, client.cookies[settings.CSRF_COOKIE_NAME].value

    def assert_works(self, route: Route, response: Response, before: dict[str, Any]) -> None:
        assert response.status_code == route.ok, (str(route), response.content)
        if route.path == "/blobs/{sha256}":
            assert response["Content-Type"] == "image/png"
            assert b"".join(response.streaming_content)
        elif route.ok != 204:
            assert response["Content-Type"].startswith(JSON)
            assert "error" not in response.json()
        after = snapshot(before["cid"])
        del before["cid"]
        if route.safe or not route.writes:
            assert after == before, f"{route} wrote something"
        else:
            assert after != before, f"{route} wrote nothing"


class RouteTableTests(TestCase):
    def test_the_table_covers_every_route(self) -> None:
        declared = {
            (method, path)
            for each in (router, imports_router, compaction_router)
            for path, view in each.path_operations.items()
            for operation in view.operations
            for method in operation.methods
        }
        assert {(r.method, r.path) for r in ROUTES} == declared


class OwnerTests(PermissionTestCase):
    def test_it_lets_the_owner_use_every_route_with_a_bearer_token_and_no_csrf(self) -> None:
        client = self.bearer(self.alice_secret)
        for route in ROUTES:
            with self.subTest(route=str(route)):
                ids = self.world()
                before = {**snapshot(ids.cid), "cid": ids.cid}
                self.assert_works(route, route.call(client, ids), before)

    def test_it_lets_the_owner_use_every_route_from_a_session_with_csrf(self) -> None:
        client, csrf = self.browser()
        for route in ROUTES:
            with self.subTest(route=str(route)):
                ids = self.world()
                before = {**snapshot(ids.cid), "cid": ids.cid}
                response = route.call(client, ids, **{"X-CSRFToken": csrf})
                self.assert_works(route, response, before)

    def test_it_lets_a_session_read_without_a_csrf_token(self) -> None:
        client, _ = self.browser()
        ids = self.world()
        for route in ROUTES:
            if route.safe:
                with self.subTest(route=str(route)):
                    before = {**snapshot(ids.cid), "cid": ids.cid}
                    self.assert_works(route, route.call(client, ids), before)


class StrangerTests(PermissionTestCase):
    def test_it_answers_a_stranger_exactly_like_a_missing_id(self) -> None:
        ids = self.world()
        ghost = Ids.random(ids)
        client = self.bearer(self.bob_secret)
        for route in ROUTES:
            if not route.names_owned_ids:
                continue
            with self.subTest(route=str(route)):
                before = snapshot(ids.cid)
                theirs = route.call(client, ids)
                assert theirs.status_code == 404, (str(route), theirs.content)
                assert snapshot(ids.cid) == before, f"{route} wrote for a stranger"
                missing = route.call(client, ghost)
                assert missing.status_code == 404, (str(route), missing.content)
                assert snapshot(ids.cid) == before
                their_body, missing_body = error_of(theirs), error_of(missing)
                assert their_body["error"] == missing_body["error"] == route.missing
                assert normalised(their_body, ids) == normalised(missing_body, ghost)

    def test_it_never_lists_another_users_conversations(self) -> None:
        ids = self.world()
        new_conversation(self.bob, "x", title="bob's")
        client = self.bearer(self.bob_secret)
        items = client.get("/api/conversations").json()["items"]
        assert [item["title"] for item in items] == ["bob's"]
        assert ids.cid not in {item["id"] for item in items}
        assert client.get("/api/conversations?q=alice").json()["items"] == []

    def test_what_a_stranger_creates_is_their_own(self) -> None:
        ids = self.world()
        before = snapshot(ids.cid)
        client = self.bearer(self.bob_secret)
        created = client.post("/api/conversations", {"title": "mine"}, content_type=JSON)
        assert created.status_code == 201
        assert Conversation.objects.get(pk=created.json()["id"]).owner_id == self.bob.pk
        upload = client.post(
            "/api/blobs",
            {"file": SimpleUploadedFile("x.png", png_bytes(60_001), content_type="image/png")},
        )
        assert upload.status_code == 201
        blob = Blob.objects.get(pk=upload.json()["sha256"])
        assert list(blob.owners.all()) == [self.bob]
        after = snapshot(ids.cid)
        assert after["conversation"] == before["conversation"]
        assert after["checkpoints"] == before["checkpoints"]

    def test_the_owners_ids_inside_a_strangers_own_requests_are_unknown(self) -> None:
        """Bob names Alice's message or blob from his own conversation: the answer is the
        one a random id gets, and nothing is written."""
        ids = self.world()
        ghost = Ids.random(ids)
        bob_conv, bob_nodes = new_conversation(self.bob, "x>y")
        client = self.bearer(self.bob_secret)
        base = f"/api/conversations/{bob_conv.pk}"

        def probes(target: Ids) -> list[Response]:
            return [
                client.post(
                    f"{base}/tip",
                    {"message": target.mids["a"], "expected_version": bob_conv.version},
                    content_type=JSON,
                ),
                client.post(
                    f"{base}/turns",
                    {
                        "parent": target.mids["c"],
                        "expected_version": bob_conv.version,
                        "messages": [{"role": "user", "parts": text("hi")}],
                    },
                    content_type=JSON,
                ),
                client.post(
                    f"{base}/turns",
                    {
                        "parent": str(bob_nodes["y"].id),
                        "expected_version": bob_conv.version,
                        "messages": [
                            {"role": "user", "parts": [{"type": "image", "blob": target.sha}]}
                        ],
                    },
                    content_type=JSON,
                ),
                client.get(f"{base}/path?tip={target.mids['c']}"),
            ]

        before = snapshot(ids.cid)
        bob_before = snapshot(str(bob_conv.pk))
        for theirs, missing in zip(probes(ids), probes(ghost), strict=True):
            assert theirs.status_code == missing.status_code, (theirs.content, missing.content)
            assert 400 <= theirs.status_code < 500
            assert normalised(error_of(theirs), ids) == normalised(error_of(missing), ghost)
        assert snapshot(ids.cid) == before
        assert snapshot(str(bob_conv.pk)) == bob_before


class AnonymousTests(PermissionTestCase):
    def assert_unauthorised(self, client: Client, ids: Ids, route: Route) -> None:
        before = snapshot(ids.cid)
        response = route.call(client, ids)
        assert response.status_code == 401, (str(route), response.content)
        assert error_of(response)["error"] == "unauthorized"
        assert snapshot(ids.cid) == before, f"{route} wrote for an anonymous caller"

    def test_it_refuses_anonymous_callers_on_every_route(self) -> None:
        ids = self.world()
        ghost = Ids.random(ids)
        for route in ROUTES:
            with self.subTest(route=str(route)):
                self.assert_unauthorised(Client(), ids, route)
                # The same answer whether or not the id exists: no existence oracle.
                self.assert_unauthorised(Client(), ghost, route)

    def test_it_refuses_an_invalid_bearer_token_on_every_route(self) -> None:
        ids = self.world()
        inactive = make_user("carol")
        _, carol_secret = services.api_token_create(user=inactive, name="c")
        inactive.is_active = False
        inactive.save()
        revoked, revoked_secret = services.api_token_create(user=self.alice, name="old")
        revoked.delete()
        bad = {
            "unknown secret": Client(HTTP_AUTHORIZATION="Bearer arb_not-a-real-token"),
            "revoked token": Client(HTTP_AUTHORIZATION=f"Bearer {revoked_secret}"),
            "inactive user": Client(HTTP_AUTHORIZATION=f"Bearer {carol_secret}"),
            "not a bearer scheme": Client(HTTP_AUTHORIZATION=f"Token {self.alice_secret}"),
        }
        for route in ROUTES:
            for name, client in bad.items():
                with self.subTest(route=str(route), token=name):
                    self.assert_unauthorised(client, ids, route)
        assert ApiToken.objects.filter(last_used_at__isnull=False).count() == 0


class CsrfTests(PermissionTestCase):
    def test_it_refuses_session_writes_without_the_csrf_token(self) -> None:
        ids = self.world()
        client, csrf = self.browser()
        wrong = re.sub(r"[a-z]", "A", csrf) if re.search(r"[a-z]", csrf) else csrf[::-1]
        for route in ROUTES:
            if route.safe:
                continue
            for name, headers in {"no header": {}, "wrong token": {"X-CSRFToken": wrong}}.items():
                with self.subTest(route=str(route), csrf=name):
                    before = snapshot(ids.cid)
                    response = route.call(client, ids, **headers)
                    assert response.status_code == 403, (str(route), response.content)
                    assert error_of(response)["error"] == "forbidden"
                    assert snapshot(ids.cid) == before, f"{route} wrote without CSRF"

    def test_it_refuses_session_writes_without_the_csrf_cookie(self) -> None:
        ids = self.world()
        client = Client(enforce_csrf_checks=True)
        client.force_login(self.alice)
        for route in ROUTES:
            if route.safe:
                continue
            with self.subTest(route=str(route)):
                before = snapshot(ids.cid)
                response = route.call(client, ids, **{"X-CSRFToken": "x" * 32})
                assert response.status_code == 403, (str(route), response.content)
                assert error_of(response)["error"] == "forbidden"
                assert snapshot(ids.cid) == before
