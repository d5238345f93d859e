"""Which conversation a gateway request continues (issue 38, items 6 and 7): a session id
is the harness's word (a new one is a new conversation, whatever its first message
says); content decides only for requests without one, and only within a short window of
the same client; a harness that compacted its own history continues below the message
where it compacted, not as a new root."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.test import TestCase
from django.utils import timezone

from conversations.gateway import services
from conversations.models import Conversation, Message
from tests.builders import make_user

TASK = "Refactor the parser. Constraint: keep the public API."


def _exchange(
    messages: list[dict[str, Any]], session: str = "", agent: str = "claude-cli/2.1.332"
) -> services.Exchange:
    body: dict[str, Any] = {"model": "claude-sonnet-4-5", "max_tokens": 10, "messages": messages}
    if session:
        body["metadata"] = {"user_id": f"user_1_account__session_{session}"}
    return services.exchange_read(
        protocol="anthropic",
        body=body,
        wire_messages=messages,
        system="You are Claude Code.",
        tools=[],
        headers={"user-agent": agent},
    )


class SessionTests(TestCase):
    def setUp(self) -> None:
        self.user = make_user("sessions")

    def store(self, messages: list[dict[str, Any]], session: str = "", **kw: Any) -> Any:
        exchange = _exchange(messages, session, **kw)
        placement = services.placement_find(user=self.user, exchange=exchange, conversation_id=None)
        services.exchange_store(
            placement=placement, exchange=exchange, answer={"role": "assistant", "content": "OK."}
        )
        return placement

    def test_two_session_ids_with_the_same_first_message_are_two_conversations(self) -> None:
        first = self.store(
            [{"role": "user", "content": TASK}], "0f0e0d0c-0000-4000-8000-000000000001"
        )
        second = self.store(
            [{"role": "user", "content": TASK}], "0f0e0d0c-0000-4000-8000-000000000002"
        )
        assert first.conversation.pk != second.conversation.pk
        assert Conversation.objects.filter(owner=self.user).count() == 2
        # Each is a root of its own: nothing was branched into the other.
        assert Message.objects.filter(conversation=first.conversation).count() == 2
        assert Message.objects.filter(conversation=second.conversation).count() == 2

    def test_without_a_session_id_content_continues_only_a_recent_conversation_of_the_same_client(
        self,
    ) -> None:
        messages = [{"role": "user", "content": TASK}]
        first = self.store(messages)
        more = [
            *messages,
            {"role": "assistant", "content": "OK."},
            {"role": "user", "content": "Next."},
        ]
        again = services.placement_find(
            user=self.user, exchange=_exchange(more), conversation_id=None
        )
        assert again.conversation.pk == first.conversation.pk and again.matched == 2
        # Another client (User-Agent) with the same words starts its own conversation.
        other = services.placement_find(
            user=self.user, exchange=_exchange(more, agent="pi/0.73.1"), conversation_id=None
        )
        assert other.created
        # An hour later the same words are a new session too.
        Conversation.objects.filter(pk=first.conversation.pk).update(
            updated_at=timezone.now() - services.CONTENT_MATCH_WINDOW - timedelta(minutes=1)
        )
        late = services.placement_find(
            user=self.user, exchange=_exchange(more), conversation_id=None
        )
        assert late.created

    def test_a_harness_self_compaction_continues_below_the_message_where_it_compacted(self) -> None:
        session = "0f0e0d0c-0000-4000-8000-0000000000aa"
        messages: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
        for i in range(3):
            placement = self.store(messages, session)
            messages += [
                {"role": "assistant", "content": "OK."},
                {"role": "user", "content": f"Step {i}."},
            ]
        conversation = Conversation.objects.get(pk=placement.conversation.pk)
        tip = conversation.tip_id
        summary = (
            "This session is being continued from a previous conversation that ran out of "
            "context. The summary below covers the earlier portion of the conversation.\n"
            "Summary: the parser was refactored in three steps."
        )
        compacted = [{"role": "user", "content": summary}]
        placed = self.store(compacted, session)
        assert placed.conversation.pk == conversation.pk
        first_new = Message.objects.get(conversation=conversation, parent_id=tip)
        assert first_new.role == "user" and "continued from a previous" in str(first_new.parts)
        # One root only: the compacted session hangs below where it compacted.
        assert Message.objects.filter(conversation=conversation, parent=None).count() == 1
        # Its next request continues the compacted path, not the old one.
        after = [
            *compacted,
            {"role": "assistant", "content": "OK."},
            {"role": "user", "content": "Go on."},
        ]
        nxt = services.placement_find(
            user=self.user, exchange=_exchange(after, session), conversation_id=None
        )
        assert nxt.conversation.pk == conversation.pk and nxt.matched == 2

    def test_a_rewind_to_the_start_without_a_summary_is_a_new_root(self) -> None:
        session = "0f0e0d0c-0000-4000-8000-0000000000bb"
        self.store([{"role": "user", "content": TASK}], session)
        placed = self.store([{"role": "user", "content": "A different first prompt."}], session)
        roots = Message.objects.filter(conversation=placed.conversation, parent=None).count()
        assert roots == 2  # a new branch from the start: nothing hidden or deleted
