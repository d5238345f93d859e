"""The tree's write and read services on hand-built trees."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test import TestCase

from conversations import selectors, services
from conversations.errors import Conflict, InvalidInput, NotFound, StaleVersion
from conversations.models import Checkpoint, Conversation, Message
from tests.builders import build_tree, make_user, new_conversation, text


def path_names(conv: Conversation) -> list[str]:
    conv.refresh_from_db()
    return [
        m.parts[0]["text"]
        for m in selectors.message_path(conversation_id=conv.pk, tip_id=conv.tip_id)
    ]


class TurnAppendTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user()

    def test_it_appends_a_whole_turn_and_moves_the_tip(self) -> None:
        conv, _ = new_conversation(self.user)
        result = services.turn_append(
            conversation=conv,
            parent_id=None,
            expected_version=0,
            messages=[
                {"role": "user", "parts": text("what time is it?")},
                {
                    "role": "assistant",
                    "parts": [{"type": "tool_call", "id": "c1", "name": "now", "arguments": {}}],
                },
                {
                    "role": "tool",
                    "parts": [{"type": "tool_result", "call_id": "c1", "parts": text("12:00")}],
                },
                {"role": "assistant", "parts": text("noon")},
            ],
        )
        conv.refresh_from_db()
        assert conv.tip_id == result.tip == result.message_ids[-1]
        assert conv.version == result.version == 1
        path = selectors.message_path(conversation_id=conv.pk, tip_id=conv.tip_id)
        assert [m.role for m in path] == ["user", "assistant", "tool", "assistant"]
        assert [m.depth for m in path] == [0, 1, 2, 3]
        assert path[2].parts[0]["is_error"] is False

    def test_it_rejects_an_unanswered_tool_call_and_writes_nothing(self) -> None:
        conv, _ = new_conversation(self.user, "a>b")
        before = Message.objects.count()
        with pytest.raises(InvalidInput) as err:
            services.turn_append(
                conversation=conv,
                parent_id=conv.tip_id,
                expected_version=conv.version,
                messages=[
                    {"role": "user", "parts": text("go")},
                    {
                        "role": "assistant",
                        "parts": [{"type": "tool_call", "id": "c1", "name": "x", "arguments": {}}],
                    },
                ],
            )
        assert err.value.code == "unpaired_tool_call"
        assert Message.objects.count() == before
        conv.refresh_from_db()
        assert conv.version == 2

    def test_it_rejects_a_result_without_its_call(self) -> None:
        conv, _ = new_conversation(self.user)
        with pytest.raises(InvalidInput):
            services.turn_append(
                conversation=conv,
                parent_id=None,
                expected_version=0,
                messages=[
                    {
                        "role": "tool",
                        "parts": [{"type": "tool_result", "call_id": "zz", "parts": []}],
                    },
                    {"role": "assistant", "parts": text("done")},
                ],
            )
        assert not Message.objects.exists()

    def test_a_stale_version_writes_nothing(self) -> None:
        conv, _ = new_conversation(self.user, "a>b")
        with pytest.raises(StaleVersion) as err:
            services.turn_append(
                conversation=conv,
                parent_id=None,
                expected_version=0,
                messages=[{"role": "user", "parts": text("late")}],
            )
        assert err.value.extra["version"] == 2
        assert Message.objects.filter(conversation=conv).count() == 2

    def test_a_parent_from_another_conversation_is_rejected(self) -> None:
        conv, _ = new_conversation(self.user, "a")
        _, nodes = new_conversation(self.user, "x")
        with pytest.raises(InvalidInput) as err:
            services.turn_append(
                conversation=conv,
                parent_id=nodes["x"].id,
                expected_version=conv.version,
                messages=[{"role": "user", "parts": text("hi")}],
            )
        assert err.value.code == "bad_parent"


class BranchTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user()

    def test_tip_move_switches_branch_without_writing_messages(self) -> None:
        conv, n = new_conversation(self.user, "a>b>c, b>d")
        assert path_names(conv) == ["a", "b", "d"]
        count = Message.objects.count()
        state = services.tip_move(
            conversation=conv, message_id=n["c"].id, expected_version=conv.version
        )
        assert state.version == conv.version + 1
        assert path_names(conv) == ["a", "b", "c"]
        assert Message.objects.count() == count

    def test_tip_move_with_stale_version_is_refused(self) -> None:
        conv, n = new_conversation(self.user, "a>b>c, b>d")
        with pytest.raises(StaleVersion):
            services.tip_move(conversation=conv, message_id=n["c"].id, expected_version=1)
        conv.refresh_from_db()
        assert conv.tip_id == n["d"].id

    def test_tip_move_racing_a_delete_is_not_found(self) -> None:
        # The conversation's row is gone while its messages still are (a delete
        # committing between tip_move's checks; the foreign keys are checked at commit).
        conv, n = new_conversation(self.user, "a>b>c, b>d")
        table = connection.ops.quote_name(Conversation._meta.db_table)
        key = conv.pk.hex if connection.vendor == "sqlite" else conv.pk
        with connection.cursor() as cursor:
            cursor.execute(f"DELETE FROM {table} WHERE id = %s", [key])
        assert not Conversation.objects.filter(pk=conv.pk).exists()
        with pytest.raises(NotFound):
            services.tip_move(conversation=conv, message_id=n["c"].id, expected_version=1)
        # The rest of the delete, so the test database's foreign keys hold again.
        messages = connection.ops.quote_name(Message._meta.db_table)
        with connection.cursor() as cursor:
            cursor.execute(f"DELETE FROM {messages} WHERE conversation_id = %s", [key])

    def test_tip_move_to_a_foreign_message_is_not_found(self) -> None:
        conv, _ = new_conversation(self.user, "a")
        _, other = new_conversation(self.user, "z")
        with pytest.raises(NotFound):
            services.tip_move(
                conversation=conv, message_id=other["z"].id, expected_version=conv.version
            )

    def test_edit_and_regenerate_make_siblings(self) -> None:
        conv, n = new_conversation(self.user, "a>b>c>d")
        edit = services.message_edit(
            conversation=conv, message_id=n["c"].id, parts=text("c2"), expected_version=conv.version
        )
        edited = Message.objects.get(pk=edit.tip)
        assert edited.parent_id == n["b"].id and edited.origin == "edit"
        siblings = selectors.message_siblings(message=edited)
        assert siblings.ids == [n["c"].id, edited.id] and siblings.index == 1
        conv.refresh_from_db()
        regen = services.message_regenerate(
            conversation=conv,
            message_id=n["b"].id,
            messages=[{"role": "assistant", "parts": text("b2")}],
            expected_version=conv.version,
        )
        assert Message.objects.get(pk=regen.tip).parent_id == n["a"].id
        # Nothing was hidden or removed: the old branch is still whole.
        assert path_names(conv) == ["a", "b2"]
        assert [
            m.parts[0]["text"]
            for m in selectors.message_path(conversation_id=conv.pk, tip_id=n["d"].id)
        ] == ["a", "b", "c", "d"]


class ForkTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user()

    def test_fork_copies_the_path_with_new_ids(self) -> None:
        conv, n = new_conversation(self.user, "a>b>c>d, b>e")
        fork = services.conversation_fork(message=n["c"], owner=self.user)
        fork_path = selectors.message_path(conversation_id=fork.pk, tip_id=fork.tip_id)
        assert [m.parts[0]["text"] for m in fork_path] == ["a", "b", "c"]
        assert {m.id for m in fork_path}.isdisjoint(n[k].id for k in n)
        assert fork.forked_from_id == n["c"].id
        assert all(m.conversation_id == fork.pk for m in fork_path)
        assert [m.depth for m in fork_path] == [0, 1, 2]
        assert fork_path[1].metadata["fork_of"] == str(n["b"].id)
        assert list(selectors.conversation_forks(conversation=conv)) == [fork]

    def test_later_messages_stay_on_their_own_side(self) -> None:
        conv, n = new_conversation(self.user, "a>b")
        fork = services.conversation_fork(message=n["b"], owner=self.user)
        build_tree(conv, "b>x", nodes=n)
        fork.refresh_from_db()
        services.turn_append(
            conversation=fork,
            parent_id=fork.tip_id,
            expected_version=fork.version,
            messages=[{"role": "user", "parts": text("y")}],
        )
        assert path_names(conv) == ["a", "b", "x"]
        assert path_names(fork) == ["a", "b", "y"]

    def test_subtree_scope_copies_everything_below(self) -> None:
        _, n = new_conversation(self.user, "a>b>c, b>d>e, a>f", tip="e")
        fork = services.conversation_fork(message=n["b"], owner=self.user, scope="subtree")
        names = sorted(m.parts[0]["text"] for m in Message.objects.filter(conversation=fork))
        assert names == ["a", "b", "c", "d", "e"]
        assert path_names(fork) == ["a", "b", "d", "e"]

    def test_fork_carries_live_checkpoints_on_the_path(self) -> None:
        conv, n = new_conversation(self.user, "a>b>c", tip="b")
        services.checkpoint_create(conversation=conv, label="start")
        fork = services.conversation_fork(message=n["c"], owner=self.user)
        cp = Checkpoint.objects.get(conversation=fork)
        assert cp.label == "start" and cp.message.parts[0]["text"] == "b"
        assert cp.message.conversation_id == fork.pk


class CheckpointTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user()

    def test_rewind_returns_and_leaves_a_digest(self) -> None:
        conv, n = new_conversation(self.user, "a>b")
        services.checkpoint_create(conversation=conv, label="before")
        n = build_tree(conv, "b>c>d", nodes=n)
        conv.refresh_from_db()
        result = services.checkpoint_rewind(
            conversation=conv, label="before", digest="tried c; no luck"
        )
        conv.refresh_from_db()
        assert conv.tip_id == result.digest_message
        digest = Message.objects.get(pk=result.digest_message)
        assert digest.parent_id == n["b"].id
        assert digest.origin == "digest"
        assert str(n["d"].id) in digest.parts[0]["text"]
        assert "tried c; no luck" in digest.parts[0]["text"]
        assert digest.metadata["explored_messages"] == 2
        # The exploration is still there.
        assert Message.objects.filter(conversation=conv).count() == 5

    def test_labels_are_unique_among_live_checkpoints(self) -> None:
        conv, _ = new_conversation(self.user, "a>b")
        services.checkpoint_create(conversation=conv, label="x")
        with pytest.raises(Conflict) as err:
            services.checkpoint_create(conversation=conv, label="x")
        assert err.value.code == "label_taken"

    def test_a_dropped_checkpoint_is_never_used(self) -> None:
        conv, n = new_conversation(self.user, "a>b")
        cp = services.checkpoint_create(conversation=conv, label="x")
        services.checkpoint_drop(checkpoint=cp, reason="trimmed on resume")
        conv.refresh_from_db()
        version = conv.version
        with pytest.raises(Conflict) as err:
            services.checkpoint_rewind(conversation=conv, label="x")
        assert err.value.code == "checkpoint_dropped"
        cp.refresh_from_db()
        assert cp.message_id == n["b"].id and cp.state == "dropped"
        conv.refresh_from_db()
        assert conv.version == version

    def test_checkpoint_refuses_a_tip_between_call_and_result(self) -> None:
        conv, _ = new_conversation(self.user)
        result = services.turn_append(
            conversation=conv,
            parent_id=None,
            expected_version=0,
            messages=[
                {"role": "user", "parts": text("go")},
                {
                    "role": "assistant",
                    "parts": [{"type": "tool_call", "id": "c", "name": "t", "arguments": {}}],
                },
                {
                    "role": "tool",
                    "parts": [{"type": "tool_result", "call_id": "c", "parts": text("ok")}],
                },
                {"role": "assistant", "parts": text("done")},
            ],
        )
        conv.refresh_from_db()
        services.tip_move(
            conversation=conv, message_id=result.message_ids[1], expected_version=conv.version
        )
        with pytest.raises(Conflict) as err:
            services.checkpoint_create(conversation=conv, label="mid")
        assert err.value.code == "not_at_boundary"

    def test_delete_removes_the_whole_conversation(self) -> None:
        conv, n = new_conversation(self.user, "a>b>c, b>d")
        services.checkpoint_create(conversation=conv, label="x")
        fork = services.conversation_fork(message=n["c"], owner=self.user)
        services.conversation_delete(conversation=conv)
        assert not Conversation.objects.filter(pk=conv.pk).exists()
        assert not Message.objects.filter(conversation_id=conv.pk).exists()
        fork.refresh_from_db()
        assert fork.forked_from_id is None
        assert Message.objects.filter(conversation=fork).count() == 3
