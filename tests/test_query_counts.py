"""Query counts that must not grow with the size of the tree (DESIGN.md §2).

Reading the path is one recursive query, a tip move is one guarded UPDATE, and a fork or
a turn costs the same whether the path holds 10 messages or 5,000. Long chains are built
directly with ``bulk_create`` in the setup; only the code under measurement goes through
the services.
"""

from __future__ import annotations

import re
import uuid
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client, TestCase
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from conversations import selectors, services
from conversations.errors import StaleVersion
from conversations.models import Checkpoint, Conversation, Message
from tests.builders import make_user, text

SHALLOW = 10
DEEP = 5_000

# Inside a TestCase every ``transaction.atomic`` is a SAVEPOINT … RELEASE pair, which the
# counts include (outside tests they are BEGIN/COMMIT and are not counted as queries).
# conversation_fork, scope=path: SAVEPOINT, the source conversation locked (a delete waits),
# the message still there, the path read, the live checkpoints, INSERT of the
# conversation, one INSERT of all the copies, RELEASE.
FORK_PATH_QUERIES = 8
# scope=subtree: the same plus the one recursive read of the subtree.
FORK_SUBTREE_QUERIES = 9
# turn_append: SAVEPOINT, the conversation row locked and the parent's depth read (one
# query), one INSERT of the whole turn, the guarded tip UPDATE, RELEASE.
TURN_QUERIES = 5


def build_chain(owner: User, length: int, *, title: str = "chain") -> Conversation:
    """A conversation holding one chain of ``length`` messages (user/assistant alternating),
    its tip on the last one. Written straight to the table: this is setup, not the code
    under test."""
    conv = Conversation.objects.create(owner=owner, title=title)
    start = timezone.now() - timedelta(days=1)
    rows: list[Message] = []
    parent: uuid.UUID | None = None
    for i in range(length):
        row = Message(
            id=uuid.uuid4(),
            conversation=conv,
            parent_id=parent,
            role="user" if i % 2 == 0 else "assistant",
            parts=text(f"message {i}"),
            depth=i,
            metadata={"n": i},
            created_at=start + timedelta(microseconds=i),
        )
        rows.append(row)
        parent = row.id
    Message.objects.bulk_create(rows, batch_size=500)
    Conversation.objects.filter(pk=conv.pk).update(tip_id=parent, version=1)
    conv.refresh_from_db()
    return conv


def tip_of(conv: Conversation) -> uuid.UUID:
    assert conv.tip_id is not None
    return conv.tip_id


def chain_ids(conv: Conversation) -> list[uuid.UUID]:
    return list(
        Message.objects.filter(conversation=conv).order_by("depth").values_list("id", flat=True)
    )


def count_queries(func: Any, *args: Any, **kwargs: Any) -> tuple[int, list[str], Any]:
    """Run ``func`` and return (number of queries, their SQL, its result)."""
    with CaptureQueriesContext(connection) as ctx:
        result = func(*args, **kwargs)
    return len(ctx.captured_queries), [q["sql"] for q in ctx.captured_queries], result


def writes(sqls: list[str]) -> list[str]:
    return [
        s
        for s in sqls
        if s.lstrip().upper().startswith(("INSERT", "UPDATE", "DELETE", "REPLACE"))
        or " INSERT INTO " in s.upper()
    ]


def tool_round(n: int) -> list[dict[str, Any]]:
    """An assistant tool call and its result."""
    return [
        {
            "role": "assistant",
            "parts": [{"type": "tool_call", "id": f"c{n}", "name": "lookup", "arguments": {}}],
        },
        {
            "role": "tool",
            "parts": [{"type": "tool_result", "call_id": f"c{n}", "parts": text(f"r{n}")}],
        },
    ]


class ChainTestCase(TestCase):
    shallow: Conversation
    deep: Conversation

    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user()
        cls.shallow = build_chain(cls.user, SHALLOW, title="shallow")
        cls.deep = build_chain(cls.user, DEEP, title="deep")

    def conversations(self) -> list[Conversation]:
        return [self.shallow, self.deep]


class MessagePathQueryTests(ChainTestCase):
    def test_it_reads_the_path_in_one_query_at_depth_10(self) -> None:
        with self.assertNumQueries(1):
            path = selectors.message_path(
                conversation_id=self.shallow.pk, tip_id=self.shallow.tip_id
            )
        assert [m.id for m in path] == chain_ids(self.shallow)
        assert [m.depth for m in path] == list(range(SHALLOW))

    def test_it_reads_the_path_in_one_query_at_depth_5000(self) -> None:
        with self.assertNumQueries(1):
            path = selectors.message_path(conversation_id=self.deep.pk, tip_id=self.deep.tip_id)
        assert len(path) == DEEP
        assert [m.id for m in path] == chain_ids(self.deep)
        assert path[-1].parts == text(f"message {DEEP - 1}")

    def test_it_reads_a_path_to_a_message_in_the_middle_in_one_query(self) -> None:
        middle = Message.objects.get(conversation=self.deep, depth=DEEP // 2)
        with self.assertNumQueries(1):
            path = selectors.message_path(conversation_id=self.deep.pk, tip_id=middle.id)
        assert len(path) == DEEP // 2 + 1
        assert path[-1].id == middle.id

    def test_it_does_not_read_a_path_through_another_conversation(self) -> None:
        with self.assertNumQueries(1):
            path = selectors.message_path(conversation_id=self.shallow.pk, tip_id=self.deep.tip_id)
        assert path == []


class PathRowsQueryTests(ChainTestCase):
    """The turn engine's read of a path: the same query, plain rows instead of models."""

    def test_it_reads_what_message_path_reads_in_one_query(self) -> None:
        for conv in self.conversations():
            with self.assertNumQueries(1):
                rows = selectors.message_path_rows(conversation_id=conv.pk, tip_id=conv.tip_id)
            models = selectors.message_path(conversation_id=conv.pk, tip_id=conv.tip_id)
            assert [tuple(r) for r in rows] == [(m.id, m.role, m.parts, m.metadata) for m in models]
            assert all(isinstance(r.id, uuid.UUID) for r in rows)
        assert rows[-1].metadata == {"n": DEEP - 1}

    def test_it_does_not_read_a_path_through_another_conversation(self) -> None:
        assert (
            selectors.message_path_rows(conversation_id=self.shallow.pk, tip_id=self.deep.tip_id)
            == []
        )
        assert selectors.message_path_rows(conversation_id=self.shallow.pk, tip_id=None) == []


class ChatWindowQueryTests(ChainTestCase):
    """The chat page shows the last CHAT_FIRST messages of a branch and reads only
    those: the same queries, and the same rows, at depth 10 and at depth 5,000."""

    def test_the_tail_of_a_path_in_one_query(self) -> None:
        with self.assertNumQueries(1):
            tail = selectors.message_path_tail(
                conversation_id=self.deep.pk, tip_id=self.deep.tip_id, limit=300
            )
        assert [m.id for m in tail] == chain_ids(self.deep)[-300:]
        assert tail[0].depth == DEEP - 300  # how many come before the window
        whole = selectors.message_path_tail(
            conversation_id=self.shallow.pk, tip_id=self.shallow.tip_id, limit=300
        )
        assert [m.id for m in whole] == chain_ids(self.shallow)
        assert (
            selectors.message_path_tail(
                conversation_id=self.shallow.pk, tip_id=self.deep.tip_id, limit=300
            )
            == []
        )

    def test_the_chat_page_reads_only_its_window(self) -> None:
        from conversations.views import CHAT_CHUNK, CHAT_FIRST

        self.client.force_login(self.user)
        counts = []
        for conv in self.conversations():
            with CaptureQueriesContext(connection) as queries:
                response = self.client.get(f"/c/{conv.pk}/")
            assert response.status_code == 200
            counts.append(len(queries))
            body = response.content.decode()
            shown = min(CHAT_FIRST, SHALLOW if conv is self.shallow else DEEP)
            assert body.count('class="msg ') == shown, body.count('class="msg ')
            # The path read is bounded by the window, whatever the depth.
            path_reads = [q["sql"] for q in queries if "WITH RECURSIVE" in q["sql"]]
            assert path_reads and all(f"p.n < {CHAT_FIRST}" in sql for sql in path_reads)
        assert counts[0] == counts[1], counts
        deep = self.client.get(f"/c/{self.deep.pk}/").content.decode()
        assert f"Show the {DEEP - CHAT_FIRST} earlier messages" in deep
        # Scrolling up asks for the chunk above the first message shown, and so on up
        # to the root; each chunk costs the same queries.
        ids = chain_ids(self.deep)
        first = ids[-CHAT_FIRST]
        assert f"/c/{self.deep.pk}/history/?before={first}" in deep
        chunk_counts = []
        for _ in range(2):
            with CaptureQueriesContext(connection) as queries:
                chunk = self.client.get(f"/c/{self.deep.pk}/history/?before={first}")
            chunk_counts.append(len(queries))
            html = chunk.content.decode()
            at = ids.index(first)
            expected = ids[at - CHAT_CHUNK : at]
            assert re.findall(r'<li id="msg-([0-9a-f-]+)"', html) == [str(i) for i in expected]
            assert f"Show the {at - CHAT_CHUNK} earlier messages" in html
            first = expected[0]
        assert chunk_counts[0] == chunk_counts[1]
        top = self.client.get(f"/c/{self.shallow.pk}/history/?before={chain_ids(self.shallow)[3]}")
        html = top.content.decode()
        assert re.findall(r'<li id="msg-([0-9a-f-]+)"', html) == [
            str(i) for i in chain_ids(self.shallow)[:3]
        ]
        assert "earlier messages" not in html  # the root is shown: nothing above it
        # Another user's conversation, or a message of another conversation: 404.
        assert (
            self.client.get(
                f"/c/{self.shallow.pk}/history/?before={chain_ids(self.deep)[5]}"
            ).status_code
            == 404
        )
        assert self.client.get(f"/c/{self.shallow.pk}/history/?before=nope").status_code == 404
        self.client.force_login(make_user("stranger"))
        assert self.client.get(f"/c/{self.deep.pk}/history/?before={ids[100]}").status_code == 404


class TipMoveQueryTests(ChainTestCase):
    def test_it_moves_the_tip_in_one_query_whatever_the_depth(self) -> None:
        for conv in self.conversations():
            before = Message.objects.count()
            root = Message.objects.get(conversation=conv, depth=0)
            with self.assertNumQueries(1):
                state = services.tip_move(
                    conversation=conv, message_id=root.id, expected_version=conv.version
                )
            assert state == services.TipState(tip=root.id, version=conv.version + 1)
            conv.refresh_from_db()
            assert conv.tip_id == root.id and conv.version == 2
            # Going back writes no message and removes none.
            assert Message.objects.count() == before

    def test_a_stale_tip_move_costs_the_same_at_both_depths_and_writes_nothing(self) -> None:
        counts = []
        for conv in self.conversations():
            root = Message.objects.get(conversation=conv, depth=0)
            n, sqls, _ = count_queries(self._stale_move, conv, root.id)
            # Only the guarded UPDATE is attempted (and matches nothing, as the unchanged
            # version below shows); no message is inserted or deleted.
            assert [s.split()[0].upper() for s in writes(sqls)] == ["UPDATE"]
            counts.append(n)
            conv.refresh_from_db()
            assert conv.version == 1 and conv.tip_id != root.id
        assert counts[0] == counts[1]

    @staticmethod
    def _stale_move(conv: Conversation, message_id: uuid.UUID) -> None:
        try:
            services.tip_move(conversation=conv, message_id=message_id, expected_version=0)
        except StaleVersion as err:
            assert err.extra["version"] == 1
            assert err.extra["tip"] == str(conv.tip_id)
        else:  # pragma: no cover - the assertion below reports it
            raise AssertionError("a stale tip move was accepted")


class ForkQueryTests(ChainTestCase):
    def _fork(self, conv: Conversation, scope: str) -> tuple[int, Conversation]:
        message = selectors.message_get(user=self.user, message_id=tip_of(conv))
        n, _, fork = count_queries(
            services.conversation_fork, message=message, owner=self.user, scope=scope
        )
        return n, fork

    def assert_complete_copy(
        self, source: Conversation, fork: Conversation, *, forked_from: uuid.UUID
    ) -> None:
        originals = {m.id: m for m in Message.objects.filter(conversation=source)}
        copies = list(Message.objects.filter(conversation=fork).order_by("depth"))
        assert len(copies) == len(originals)
        id_map = {uuid.UUID(c.metadata["fork_of"]): c.id for c in copies}
        assert set(id_map) == set(originals)
        assert set(id_map.values()).isdisjoint(originals)
        for copy in copies:
            original = originals[uuid.UUID(copy.metadata["fork_of"])]
            assert copy.conversation_id == fork.pk
            assert copy.role == original.role
            assert copy.parts == original.parts
            assert copy.depth == original.depth
            assert copy.origin == "fork"
            assert copy.metadata["n"] == original.metadata["n"]
            expected_parent = id_map[original.parent_id] if original.parent_id else None
            assert copy.parent_id == expected_parent
        fork.refresh_from_db()
        assert fork.tip_id == id_map[tip_of(source)]
        assert fork.forked_from_id == forked_from
        assert fork.version == 0
        path = selectors.message_path(conversation_id=fork.pk, tip_id=fork.tip_id)
        assert [m.id for m in path] == [c.id for c in copies]
        # The source is untouched.
        assert Message.objects.filter(conversation=source).count() == len(originals)

    def test_it_forks_a_path_in_the_same_number_of_queries_at_10_and_5000(self) -> None:
        shallow_n, shallow_fork = self._fork(self.shallow, "path")
        deep_n, deep_fork = self._fork(self.deep, "path")
        assert shallow_n == deep_n == FORK_PATH_QUERIES
        self.assert_complete_copy(self.shallow, shallow_fork, forked_from=tip_of(self.shallow))
        self.assert_complete_copy(self.deep, deep_fork, forked_from=tip_of(self.deep))

    def test_it_forks_a_subtree_in_the_same_number_of_queries_at_10_and_5000(self) -> None:
        counts = []
        for conv in self.conversations():
            root = selectors.message_get(
                user=self.user, message_id=Message.objects.get(conversation=conv, depth=0).id
            )
            n, _, fork = count_queries(
                services.conversation_fork, message=root, owner=self.user, scope="subtree"
            )
            counts.append(n)
            # The subtree below the root is the whole chain; the fork's tip follows the
            # source's tip.
            self.assert_complete_copy(conv, fork, forked_from=root.id)
        assert counts == [FORK_SUBTREE_QUERIES, FORK_SUBTREE_QUERIES]

    def test_it_forks_with_checkpoints_in_a_constant_number_of_queries(self) -> None:
        counts = []
        for conv in self.conversations():
            for label, depth in (("early", 2), ("late", conv.messages.count() - 1)):
                services.checkpoint_create(
                    conversation=conv,
                    label=label,
                    message_id=Message.objects.get(conversation=conv, depth=depth).id,
                )
            n, fork = self._fork(conv, "path")
            counts.append(n)
            copied = dict(
                Checkpoint.objects.filter(conversation=fork).values_list("label", "message__depth")
            )
            assert copied == {"early": 2, "late": conv.messages.count() - 1}
        # One more INSERT carries all the checkpoint copies.
        assert counts == [FORK_PATH_QUERIES + 1, FORK_PATH_QUERIES + 1]


class TurnAppendQueryTests(ChainTestCase):
    def _append(self, conv: Conversation, messages: list[dict[str, Any]]) -> int:
        conv.refresh_from_db()
        before = Message.objects.filter(conversation=conv).count()
        n, _, result = count_queries(
            services.turn_append,
            conversation=conv,
            parent_id=conv.tip_id,
            expected_version=conv.version,
            messages=messages,
        )
        assert len(result.message_ids) == len(messages)
        assert Message.objects.filter(conversation=conv).count() == before + len(messages)
        conv.refresh_from_db()
        assert conv.tip_id == result.tip == result.message_ids[-1]
        path = selectors.message_path(conversation_id=conv.pk, tip_id=conv.tip_id)
        assert [m.id for m in path[-len(messages) :]] == result.message_ids
        assert [m.role for m in path[-len(messages) :]] == [m["role"] for m in messages]
        return n

    def test_it_appends_a_turn_in_the_same_number_of_queries_at_10_and_5000(self) -> None:
        turn = [
            {"role": "user", "parts": text("q")},
            *tool_round(1),
            {"role": "assistant", "parts": text("a")},
        ]
        assert self._append(self.shallow, turn) == self._append(self.deep, turn) == TURN_QUERIES

    def test_a_one_message_turn_costs_the_same_as_a_four_message_turn(self) -> None:
        short = [{"role": "user", "parts": text("q")}]
        longer = [
            {"role": "user", "parts": text("q")},
            *tool_round(1),
            {"role": "assistant", "parts": text("a")},
        ]
        assert self._append(self.shallow, short) == self._append(self.deep, longer) == TURN_QUERIES

    def test_the_largest_allowed_turn_costs_the_same_as_a_one_message_turn(self) -> None:
        # A long agent turn of tool rounds, as large as ARBOR_MAX_TURN_MESSAGES allows (200
        # by default), must still be one INSERT, not one per backend batch (SQLite's
        # bulk_create batches hold 999 // 9 columns = 111 rows).
        rounds = (settings.ARBOR_MAX_TURN_MESSAGES - 2) // 2
        largest = [
            {"role": "user", "parts": text("q")},
            *[m for i in range(rounds) for m in tool_round(i)],
            {"role": "assistant", "parts": text("done")},
        ]
        assert len(largest) > 111
        short = [{"role": "user", "parts": text("q")}]
        assert self._append(self.shallow, short) == TURN_QUERIES
        assert self._append(self.deep, largest) == TURN_QUERIES


class TreeReadQueryTests(ChainTestCase):
    def test_a_tree_page_is_one_query(self) -> None:
        for conv, expected in ((self.shallow, SHALLOW), (self.deep, 50)):
            with self.assertNumQueries(1):
                page = selectors.tree_page(conversation=conv, cursor=None, limit=50)
            assert [m.depth for m in page.items] == list(range(expected))
            assert [m.child_count for m in page.items] == [1] * (expected - 1) + [
                0 if conv is self.shallow else 1
            ]
        deep_page = selectors.tree_page(conversation=self.deep, cursor=None, limit=50)
        assert deep_page.next_cursor is not None
        with self.assertNumQueries(1):
            second = selectors.tree_page(
                conversation=self.deep, cursor=deep_page.next_cursor, limit=50
            )
        assert [m.depth for m in second.items] == list(range(50, 100))

    def test_siblings_are_one_query(self) -> None:
        for conv in self.conversations():
            parent = Message.objects.get(conversation=conv, depth=3)
            original = Message.objects.get(conversation=conv, depth=4)
            result = services.turn_append(
                conversation=conv,
                parent_id=parent.id,
                expected_version=conv.version,
                messages=[{"role": "user", "parts": text("another")}],
            )
            added = Message.objects.get(pk=result.tip)
            with self.assertNumQueries(1):
                siblings = selectors.message_siblings(message=added)
            assert siblings == selectors.Siblings(ids=[original.id, added.id], index=1)


class PathEndpointQueryTests(ChainTestCase):
    def setUp(self) -> None:
        _, secret = services.api_token_create(user=self.user, name="counts")
        self.client = Client(HTTP_AUTHORIZATION=f"Bearer {secret}")

    def _get_path(self, conv: Conversation) -> tuple[int, int, list[dict[str, Any]]]:
        with CaptureQueriesContext(connection) as ctx:
            response = self.client.get(f"/api/conversations/{conv.pk}/path")
        assert response.status_code == 200, response.content
        auth = [q for q in ctx.captured_queries if "apitoken" in q["sql"].lower()]
        return len(ctx.captured_queries), len(auth), response.json()["messages"]

    def test_the_path_endpoint_is_a_constant_number_of_queries(self) -> None:
        # The first use of a token stamps last_used_at (one more query); later requests
        # within the minute only look the token up.
        first_total, first_auth, _ = self._get_path(self.shallow)
        assert first_auth == 2 and first_total == 4
        shallow_total, shallow_auth, shallow_messages = self._get_path(self.shallow)
        deep_total, deep_auth, deep_messages = self._get_path(self.deep)
        # Then the endpoint itself: the owner-scoped conversation lookup and the one
        # recursive path query.
        assert shallow_auth == deep_auth == 1
        assert shallow_total - shallow_auth == deep_total - deep_auth == 2
        assert shallow_total == deep_total == 3
        assert [m["id"] for m in shallow_messages] == [str(i) for i in chain_ids(self.shallow)]
        assert len(deep_messages) == DEEP
        assert deep_messages[-1]["id"] == str(self.deep.tip_id)
        assert deep_messages[-1]["depth"] == DEEP - 1
