"""Happy paths through the real HTTP JSON API (DESIGN.md §3): every tree operation a
client performs, as a client performs it."""

from __future__ import annotations

import io
import itertools
import tempfile
from typing import Any

from django.conf import settings
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client, TestCase, override_settings
from PIL import Image

from conversations import services
from conversations.models import Blob, Checkpoint, Conversation, Message
from tests.builders import make_user, new_conversation, text

JSON = "application/json"


def png_bytes(
    width: int = 3, height: int = 2, color: tuple[int, int, int] = (200, 30, 30)
) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return buf.getvalue()


def bearer_client(user: Any, *, enforce_csrf_checks: bool = False) -> Client:
    _, secret = services.api_token_create(user=user, name="tests")
    return Client(enforce_csrf_checks=enforce_csrf_checks, HTTP_AUTHORIZATION=f"Bearer {secret}")


def tool_turn(call_id: str = "c1") -> list[dict[str, Any]]:
    return [
        {"role": "user", "parts": text("what time is it?")},
        {
            "role": "assistant",
            "parts": [
                {"type": "text", "text": "let me look"},
                {"type": "tool_call", "id": call_id, "name": "clock", "arguments": {"tz": "UTC"}},
            ],
        },
        {
            "role": "tool",
            "parts": [
                {
                    "type": "tool_result",
                    "call_id": call_id,
                    "is_error": False,
                    "parts": text("12:00"),
                }
            ],
        },
        {"role": "assistant", "parts": text("it is noon")},
    ]


class MediaRootMixin:
    """Blob files land in a throwaway MEDIA_ROOT, never in the developer's var/media."""

    @classmethod
    def setUpClass(cls) -> None:
        media = tempfile.TemporaryDirectory()
        cls.addClassCleanup(media.cleanup)
        cls.enterClassContext(override_settings(MEDIA_ROOT=media.name))
        super().setUpClass()  # type: ignore[misc]


class ConversationApiTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user("alice")
        cls.other = make_user("bob")

    def setUp(self) -> None:
        self.api = bearer_client(self.user)

    def test_it_creates_and_gets_a_conversation(self) -> None:
        response = self.api.post(
            "/api/conversations",
            {"title": "  Trip plans ", "system_prompt": "be brief", "model": "small"},
            content_type=JSON,
        )
        assert response.status_code == 201, response.content
        body = response.json()
        conv = Conversation.objects.get(pk=body["id"])
        assert conv.owner_id == self.user.pk
        assert body["title"] == "Trip plans"
        assert body["system_prompt"] == "be brief" and body["model"] == "small"
        assert body["tip"] is None and body["version"] == 0
        assert body["forked_from"] is None and body["forked_from_conversation"] is None
        assert body["message_count"] == 0 and body["forks"] == []

        got = self.api.get(f"/api/conversations/{conv.pk}")
        assert got.status_code == 200
        assert got.json() == body

    def test_it_lists_conversations_newest_first_in_cursor_pages(self) -> None:
        created = [
            self.api.post("/api/conversations", {"title": f"chat {i}"}, content_type=JSON).json()[
                "id"
            ]
            for i in range(5)
        ]
        new_conversation(self.other, "x", title="chat by bob")
        seen: list[str] = []
        cursor: str | None = None
        pages = 0
        while True:
            url = "/api/conversations?limit=2" + (f"&cursor={cursor}" if cursor else "")
            response = self.api.get(url)
            assert response.status_code == 200, response.content
            body = response.json()
            assert len(body["items"]) <= 2
            seen += [item["id"] for item in body["items"]]
            pages += 1
            cursor = body["next_cursor"]
            if cursor is None:
                break
            assert pages < 10
        assert pages == 3
        assert seen == list(reversed(created))

    def test_it_lists_message_counts_and_tips(self) -> None:
        conv, nodes = new_conversation(self.user, "a>b>c, b>d")
        body = self.api.get("/api/conversations").json()
        (item,) = body["items"]
        assert item["id"] == str(conv.pk)
        assert item["message_count"] == 4
        assert item["tip"] == str(nodes["d"].id)
        assert body["next_cursor"] is None

    def test_it_searches_titles_case_insensitively(self) -> None:
        for title in ("Rust lifetimes", "Django ORM tricks", "more RUST questions"):
            self.api.post("/api/conversations", {"title": title}, content_type=JSON)
        new_conversation(self.other, title="rust by bob")
        body = self.api.get("/api/conversations?q=rust").json()
        assert sorted(item["title"] for item in body["items"]) == [
            "Rust lifetimes",
            "more RUST questions",
        ]
        assert self.api.get("/api/conversations?q=nothing-like-it").json()["items"] == []

    def test_it_deletes_a_conversation_with_its_messages(self) -> None:
        conv, _ = new_conversation(self.user, "a>b>c")
        services.checkpoint_create(conversation=conv, label="x")
        keep, _ = new_conversation(self.user, "k")
        response = self.api.delete(f"/api/conversations/{conv.pk}")
        assert response.status_code == 204
        assert not Conversation.objects.filter(pk=conv.pk).exists()
        assert not Message.objects.filter(conversation_id=conv.pk).exists()
        assert not Checkpoint.objects.filter(conversation_id=conv.pk).exists()
        assert self.api.get(f"/api/conversations/{conv.pk}").status_code == 404
        assert Message.objects.filter(conversation=keep).count() == 1


class TurnAndPathApiTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user("alice")

    def setUp(self) -> None:
        self.api = bearer_client(self.user)

    def post_turn(self, cid: Any, parent: Any, version: int, messages: list[Any]) -> Any:
        response = self.api.post(
            f"/api/conversations/{cid}/turns",
            {
                "parent": str(parent) if parent else None,
                "expected_version": version,
                "messages": messages,
            },
            content_type=JSON,
        )
        assert response.status_code == 201, response.content
        return response.json()

    def test_it_appends_turns_and_reads_the_path(self) -> None:
        conv, _ = new_conversation(self.user)
        first = self.post_turn(
            conv.pk,
            None,
            0,
            [
                {"role": "user", "parts": text("hello")},
                {"role": "assistant", "parts": text("hi!")},
            ],
        )
        assert first["version"] == 1
        assert len(first["message_ids"]) == 2 and first["tip"] == first["message_ids"][-1]

        second = self.post_turn(conv.pk, first["tip"], 1, tool_turn())
        assert second["version"] == 2 and len(second["message_ids"]) == 4

        detail = self.api.get(f"/api/conversations/{conv.pk}").json()
        assert detail["tip"] == second["tip"] and detail["version"] == 2
        assert detail["message_count"] == 6

        path = self.api.get(f"/api/conversations/{conv.pk}/path").json()
        assert path["tip"] == second["tip"]
        messages = path["messages"]
        assert [m["id"] for m in messages] == first["message_ids"] + second["message_ids"]
        assert [m["role"] for m in messages] == [
            "user",
            "assistant",
            "user",
            "assistant",
            "tool",
            "assistant",
        ]
        assert [m["depth"] for m in messages] == [0, 1, 2, 3, 4, 5]
        assert messages[0]["parent"] is None
        assert all(m["parent"] == p["id"] for p, m in itertools.pairwise(messages))
        assert {m["origin"] for m in messages} == {"turn"}
        call = messages[3]["parts"][1]
        assert call == {
            "type": "tool_call",
            "id": "c1",
            "name": "clock",
            "arguments": {"tz": "UTC"},
        }
        assert messages[4]["parts"] == [
            {"type": "tool_result", "call_id": "c1", "is_error": False, "parts": text("12:00")}
        ]
        assert set(messages[0]) >= {
            "id",
            "parent",
            "role",
            "parts",
            "depth",
            "origin",
            "metadata",
            "created_at",
        }

    def test_it_reads_the_path_to_any_tip(self) -> None:
        conv, n = new_conversation(self.user, "a>b>c, b>d")
        default = self.api.get(f"/api/conversations/{conv.pk}/path").json()
        assert [m["parts"][0]["text"] for m in default["messages"]] == ["a", "b", "d"]
        other = self.api.get(f"/api/conversations/{conv.pk}/path?tip={n['c'].id}").json()
        assert other["tip"] == str(n["c"].id)
        assert [m["parts"][0]["text"] for m in other["messages"]] == ["a", "b", "c"]
        # Reading another branch moves nothing.
        conv.refresh_from_db()
        assert conv.tip_id == n["d"].id

    def test_an_empty_conversation_has_an_empty_path(self) -> None:
        conv, _ = new_conversation(self.user)
        body = self.api.get(f"/api/conversations/{conv.pk}/path").json()
        assert body == {"conversation": str(conv.pk), "tip": None, "messages": []}

    def test_it_pages_the_tree_with_child_counts(self) -> None:
        conv, n = new_conversation(self.user, "a>b>c, b>d, a>e, d>f", tip="c")
        nodes: list[dict[str, Any]] = []
        cursor: str | None = None
        pages = 0
        while True:
            url = f"/api/conversations/{conv.pk}/tree?limit=2"
            response = self.api.get(url + (f"&cursor={cursor}" if cursor else ""))
            assert response.status_code == 200, response.content
            body = response.json()
            assert body["tip"] == str(n["c"].id)
            assert len(body["nodes"]) <= 2
            nodes += body["nodes"]
            pages += 1
            cursor = body["next_cursor"]
            if cursor is None:
                break
            assert pages < 10
        assert pages == 3
        names = {str(m.id): name for name, m in n.items()}
        # Breadth first: by depth, then creation order.
        assert [names[node["id"]] for node in nodes] == ["a", "b", "e", "c", "d", "f"]
        by_name = {names[node["id"]]: node for node in nodes}
        assert {k: v["child_count"] for k, v in by_name.items()} == {
            "a": 2,
            "b": 2,
            "c": 0,
            "d": 1,
            "e": 0,
            "f": 0,
        }
        assert by_name["d"]["parent"] == str(n["b"].id) and by_name["a"]["parent"] is None
        assert by_name["f"]["depth"] == 3
        assert by_name["c"]["preview"] == "c" and by_name["b"]["role"] == "assistant"

    def test_edit_and_regenerate_show_up_as_siblings(self) -> None:
        conv, n = new_conversation(self.user, "a>b>c>d")
        edit = self.api.post(
            f"/api/messages/{n['c'].id}/edit",
            {"parts": text("c, reworded"), "expected_version": conv.version},
            content_type=JSON,
        )
        assert edit.status_code == 201, edit.content
        edited = edit.json()
        assert edited["version"] == conv.version + 1

        message = self.api.get(f"/api/messages/{edited['tip']}").json()
        assert message["parent"] == str(n["b"].id)
        assert message["origin"] == "edit" and message["role"] == "user"
        assert message["parts"] == text("c, reworded")
        assert message["conversation"] == str(conv.pk)
        assert message["siblings"] == {"ids": [str(n["c"].id), edited["tip"]], "index": 1}
        original = self.api.get(f"/api/messages/{n['c'].id}").json()
        assert original["siblings"] == {"ids": [str(n["c"].id), edited["tip"]], "index": 0}

        regen = self.api.post(
            f"/api/messages/{n['b'].id}/regenerate",
            {
                "messages": [{"role": "assistant", "parts": text("b, again")}],
                "expected_version": edited["version"],
            },
            content_type=JSON,
        )
        assert regen.status_code == 201, regen.content
        regenerated = regen.json()
        answer = self.api.get(f"/api/messages/{regenerated['tip']}").json()
        assert answer["origin"] == "regenerate" and answer["parent"] == str(n["a"].id)
        assert answer["siblings"] == {"ids": [str(n["b"].id), regenerated["tip"]], "index": 1}
        path = self.api.get(f"/api/conversations/{conv.pk}/path").json()
        assert [m["parts"][0]["text"] for m in path["messages"]] == ["a", "b, again"]
        # The first branch is whole.
        old = self.api.get(f"/api/conversations/{conv.pk}/path?tip={n['d'].id}").json()
        assert [m["parts"][0]["text"] for m in old["messages"]] == ["a", "b", "c", "d"]

    def test_a_root_message_lists_the_other_roots_as_siblings(self) -> None:
        _, n = new_conversation(self.user, "a>b, c")
        body = self.api.get(f"/api/messages/{n['c'].id}").json()
        assert body["siblings"] == {"ids": [str(n["a"].id), str(n["c"].id)], "index": 1}

    def test_it_moves_the_tip(self) -> None:
        conv, n = new_conversation(self.user, "a>b>c, b>d")
        count = Message.objects.count()
        response = self.api.post(
            f"/api/conversations/{conv.pk}/tip",
            {"message": str(n["c"].id), "expected_version": conv.version},
            content_type=JSON,
        )
        assert response.status_code == 200, response.content
        assert response.json() == {"tip": str(n["c"].id), "version": conv.version + 1}
        path = self.api.get(f"/api/conversations/{conv.pk}/path").json()
        assert [m["parts"][0]["text"] for m in path["messages"]] == ["a", "b", "c"]
        assert Message.objects.count() == count


class ForkApiTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user("alice")

    def setUp(self) -> None:
        self.api = bearer_client(self.user)

    def fork(self, mid: Any, **body: Any) -> dict[str, Any]:
        response = self.api.post(f"/api/messages/{mid}/fork", body, content_type=JSON)
        assert response.status_code == 201, response.content
        forked: dict[str, Any] = response.json()
        return forked

    def test_it_forks_the_path(self) -> None:
        conv, n = new_conversation(self.user, "a>b>c>d, b>e", title="source")
        fork = self.fork(n["c"].id, title="my fork", scope="path")
        assert fork["title"] == "my fork"
        assert fork["forked_from"] == str(n["c"].id)
        assert fork["forked_from_conversation"] == str(conv.pk)
        assert fork["message_count"] == 3 and fork["version"] == 0
        path = self.api.get(f"/api/conversations/{fork['id']}/path").json()
        assert [m["parts"][0]["text"] for m in path["messages"]] == ["a", "b", "c"]
        assert path["tip"] == path["messages"][-1]["id"]
        assert {m["id"] for m in path["messages"]}.isdisjoint(str(m.id) for m in n.values())
        assert {m["origin"] for m in path["messages"]} == {"fork"}

        source = self.api.get(f"/api/conversations/{conv.pk}").json()
        assert source["forks"] == [
            {"id": fork["id"], "title": "my fork", "forked_from": str(n["c"].id)}
        ]
        assert source["message_count"] == 5
        # GET of the fork says the same as the fork's creation answer.
        again = self.api.get(f"/api/conversations/{fork['id']}").json()
        assert again["forked_from"] == str(n["c"].id)
        assert again["forked_from_conversation"] == str(conv.pk)

    def test_it_forks_a_subtree(self) -> None:
        conv, n = new_conversation(self.user, "a>b>c, b>d>e, a>f", tip="e", title="t")
        fork = self.fork(n["b"].id, scope="subtree")
        assert fork["title"] == "Fork of t"
        assert fork["forked_from"] == str(n["b"].id)
        assert fork["forked_from_conversation"] == str(conv.pk)
        assert fork["message_count"] == 5
        tree = self.api.get(f"/api/conversations/{fork['id']}/tree").json()
        previews = sorted(node["preview"] for node in tree["nodes"])
        assert previews == ["a", "b", "c", "d", "e"]
        path = self.api.get(f"/api/conversations/{fork['id']}/path").json()
        assert [m["parts"][0]["text"] for m in path["messages"]] == ["a", "b", "d", "e"]
        forks = self.api.get(f"/api/conversations/{conv.pk}").json()["forks"]
        assert [f["id"] for f in forks] == [fork["id"]]

    def test_the_fork_and_the_source_grow_apart(self) -> None:
        conv, n = new_conversation(self.user, "a>b")
        fork = self.fork(n["b"].id)
        turn = self.api.post(
            f"/api/conversations/{fork['id']}/turns",
            {
                "parent": fork["tip"],
                "expected_version": 0,
                "messages": [{"role": "user", "parts": text("only in the fork")}],
            },
            content_type=JSON,
        )
        assert turn.status_code == 201, turn.content
        assert Message.objects.filter(conversation=conv).count() == 2
        conv.refresh_from_db()
        assert conv.tip_id == n["b"].id and conv.version == 2


class CheckpointApiTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user("alice")

    def setUp(self) -> None:
        self.api = bearer_client(self.user)

    def test_it_creates_and_lists_checkpoints(self) -> None:
        conv, n = new_conversation(self.user, "a>b")
        url = f"/api/conversations/{conv.pk}/checkpoints"
        assert self.api.get(url).json() == []
        response = self.api.post(url, {"label": " plan A "}, content_type=JSON)
        assert response.status_code == 201, response.content
        created = response.json()
        assert created["label"] == "plan A"
        assert created["message"] == str(n["b"].id)
        assert created["state"] == "live" and created["digest_message"] is None
        assert created["source"] == "user"
        listed = self.api.get(url).json()
        assert listed == [created]
        # Labelling does not move the tip.
        conv.refresh_from_db()
        assert conv.version == 2

    def test_it_rewinds_to_a_checkpoint_with_a_digest(self) -> None:
        conv, n = new_conversation(self.user, "a>b")
        cp = self.api.post(
            f"/api/conversations/{conv.pk}/checkpoints", {"label": "before"}, content_type=JSON
        ).json()
        turn = self.api.post(
            f"/api/conversations/{conv.pk}/turns",
            {"parent": str(n["b"].id), "expected_version": 2, "messages": tool_turn("t9")},
            content_type=JSON,
        ).json()
        abandoned = turn["tip"]
        response = self.api.post(
            f"/api/conversations/{conv.pk}/rewind",
            {"label": "before", "digest": "the clock tool said noon", "expected_version": 3},
            content_type=JSON,
        )
        assert response.status_code == 200, response.content
        body = response.json()
        assert body["tip"] == body["digest_message"]
        assert body["version"] == 4
        assert body["abandoned_tip"] == abandoned
        assert body["checkpoint"]["id"] == cp["id"]
        assert body["checkpoint"]["digest_message"] == body["digest_message"]

        detail = self.api.get(f"/api/conversations/{conv.pk}").json()
        assert detail["tip"] == body["digest_message"] and detail["version"] == 4
        digest = self.api.get(f"/api/messages/{body['digest_message']}").json()
        assert digest["parent"] == str(n["b"].id)
        assert digest["origin"] == "digest" and digest["role"] == "user"
        digest_text = digest["parts"][0]["text"]
        assert "the clock tool said noon" in digest_text
        assert abandoned in digest_text
        assert digest["metadata"]["abandoned_tip"] == abandoned
        path = self.api.get(f"/api/conversations/{conv.pk}/path").json()
        assert [m["id"] for m in path["messages"]] == [
            str(n["a"].id),
            str(n["b"].id),
            body["digest_message"],
        ]
        # The abandoned branch is still there to read.
        old = self.api.get(f"/api/conversations/{conv.pk}/path?tip={abandoned}").json()
        assert len(old["messages"]) == 6
        listed = self.api.get(f"/api/conversations/{conv.pk}/checkpoints").json()
        assert listed[0]["digest_message"] == body["digest_message"]

    def test_a_rewind_without_digest_text_summarises_the_branch(self) -> None:
        conv, n = new_conversation(self.user, "a>b")
        self.api.post(
            f"/api/conversations/{conv.pk}/checkpoints", {"label": "cp"}, content_type=JSON
        )
        turn = self.api.post(
            f"/api/conversations/{conv.pk}/turns",
            {"parent": str(n["b"].id), "expected_version": 2, "messages": tool_turn()},
            content_type=JSON,
        ).json()
        body = self.api.post(
            f"/api/conversations/{conv.pk}/rewind", {"label": "cp"}, content_type=JSON
        ).json()
        digest = Message.objects.get(pk=body["digest_message"])
        digest_text = digest.parts[0]["text"]
        assert turn["tip"] in digest_text
        assert "clock" in digest_text and "what time is it?" in digest_text


class BlobApiTests(MediaRootMixin, TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user("alice")

    def setUp(self) -> None:
        self.api = bearer_client(self.user)

    def upload(self, data: bytes, name: str = "pic.png", content_type: str = "image/png") -> Any:
        return self.api.post(
            "/api/blobs", {"file": SimpleUploadedFile(name, data, content_type=content_type)}
        )

    def test_it_uploads_an_image_and_uses_it_in_a_turn(self) -> None:
        data = png_bytes(7, 5)
        response = self.upload(data)
        assert response.status_code == 201, response.content
        blob = response.json()
        assert blob["mime"] == "image/png" and blob["size"] == len(data)
        assert (blob["width"], blob["height"]) == (7, 5)
        assert len(blob["sha256"]) == 64
        assert Blob.objects.get(pk=blob["sha256"]).owners.filter(pk=self.user.pk).exists()

        conv, _ = new_conversation(self.user)
        # The client names the blob; mime and size always come from the Blob row, even
        # when the client claims something else.
        turn = self.api.post(
            f"/api/conversations/{conv.pk}/turns",
            {
                "parent": None,
                "expected_version": 0,
                "messages": [
                    {
                        "role": "user",
                        "parts": [
                            {"type": "text", "text": "what is this?"},
                            {
                                "type": "image",
                                "blob": blob["sha256"],
                                "mime": "image/gif",
                                "width": 9999,
                                "height": 1,
                            },
                        ],
                    },
                    {"role": "assistant", "parts": text("a red rectangle")},
                ],
            },
            content_type=JSON,
        )
        assert turn.status_code == 201, turn.content
        first = self.api.get(f"/api/messages/{turn.json()['message_ids'][0]}").json()
        assert first["parts"][1] == {
            "type": "image",
            "blob": blob["sha256"],
            "mime": "image/png",
            "width": 7,
            "height": 5,
        }

        got = self.api.get(f"/api/blobs/{blob['sha256']}")
        assert got.status_code == 200
        assert got["Content-Type"] == "image/png"
        assert got["X-Content-Type-Options"] == "nosniff"
        # Reading the stream to its end closes the file (the test client wraps it); an
        # explicit close() here would fire request_finished and drop the DB connection.
        assert b"".join(got.streaming_content) == data

    def test_uploading_the_same_bytes_twice_gives_the_same_blob(self) -> None:
        data = png_bytes(4, 4, (1, 2, 3))
        first = self.upload(data).json()
        second = self.upload(data, name="copy.png").json()
        assert first == second
        assert Blob.objects.filter(pk=first["sha256"]).count() == 1

    def test_an_image_inside_a_tool_result_is_filled_in(self) -> None:
        sha = self.upload(png_bytes(2, 9)).json()["sha256"]
        conv, _ = new_conversation(self.user)
        messages = tool_turn()
        messages[2]["parts"][0]["parts"] = [{"type": "image", "blob": sha}]
        turn = self.api.post(
            f"/api/conversations/{conv.pk}/turns",
            {"parent": None, "expected_version": 0, "messages": messages},
            content_type=JSON,
        )
        assert turn.status_code == 201, turn.content
        result = Message.objects.get(pk=turn.json()["message_ids"][2])
        assert result.parts[0]["parts"] == [
            {"type": "image", "blob": sha, "mime": "image/png", "width": 2, "height": 9}
        ]


class SessionApiTests(MediaRootMixin, TestCase):
    """A signed-in browser: the session cookie plus the CSRF token on every write."""

    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user("alice")

    def setUp(self) -> None:
        self.browser = Client(enforce_csrf_checks=True)
        self.browser.force_login(self.user)
        # Any page that renders a form sets the CSRF cookie; the admin login page does
        # for a signed-in user without staff rights.
        page = self.browser.get("/admin/login/")
        assert page.status_code == 200
        self.csrf = self.browser.cookies[settings.CSRF_COOKIE_NAME].value
        assert self.csrf

    def test_it_drives_a_conversation_with_session_and_csrf(self) -> None:
        headers = {"X-CSRFToken": self.csrf}
        created = self.browser.post(
            "/api/conversations", {"title": "from the browser"}, content_type=JSON, headers=headers
        )
        assert created.status_code == 201, created.content
        cid = created.json()["id"]
        turn = self.browser.post(
            f"/api/conversations/{cid}/turns",
            {"parent": None, "expected_version": 0, "messages": tool_turn()},
            content_type=JSON,
            headers=headers,
        )
        assert turn.status_code == 201, turn.content
        tip = turn.json()["tip"]
        cp = self.browser.post(
            f"/api/conversations/{cid}/checkpoints",
            {"label": "s"},
            content_type=JSON,
            headers=headers,
        )
        assert cp.status_code == 201, cp.content
        listed = self.browser.get("/api/conversations").json()["items"]
        assert [(c["id"], c["tip"]) for c in listed] == [(cid, tip)]
        upload = self.browser.post(
            "/api/blobs",
            {"file": SimpleUploadedFile("p.png", png_bytes(), content_type="image/png")},
            headers=headers,
        )
        assert upload.status_code == 201, upload.content
        fork = self.browser.post(
            f"/api/messages/{tip}/fork", {}, content_type=JSON, headers=headers
        )
        assert fork.status_code == 201, fork.content
        deleted = self.browser.delete(f"/api/conversations/{cid}", headers=headers)
        assert deleted.status_code == 204
        assert not Conversation.objects.filter(pk=cid).exists()
        assert Conversation.objects.filter(pk=fork.json()["id"], forked_from=None).exists()
