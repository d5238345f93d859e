"""A rewind's digest in the chat: a badge naming the checkpoint and linking to the
explored branch, and the digest's text without the raw message id the model reads."""

from __future__ import annotations

from django.test import TestCase

from conversations import services
from conversations.models import Message
from tests.builders import make_user, new_conversation


class ChatDigestTests(TestCase):
    def test_the_digest_shows_a_badge_and_a_link_not_a_raw_id(self) -> None:
        alice = make_user("alice")
        conv, n = new_conversation(alice, "plan>try a cache>cache misses")
        services.checkpoint_create(conversation=conv, label="planned", message_id=n["plan"].pk)
        conv.refresh_from_db()
        services.checkpoint_rewind(
            conversation=conv, label="planned", digest="Caching did not help."
        )
        digest = Message.objects.get(conversation=conv, origin="digest")
        explored = n["cache misses"].pk
        # What the model reads keeps the id (its recall tool takes it).
        assert str(explored) in digest.parts[0]["text"]

        self.client.force_login(alice)
        body = self.client.get(f"/c/{conv.pk}/").content.decode()
        row = body.split(f'id="msg-{digest.pk}"', 1)[1].split("</li>", 1)[0]
        assert "↶ rewind to ⚑ planned" in row
        assert f'href="/c/{conv.pk}/?m={explored}#msg-{explored}">explored branch</a>' in row
        shown = row.split('<div class="parts">', 1)[1].split("</div>", 1)[0]
        assert "Caching did not help." in shown and str(explored) not in shown
        # (Its Edit box holds the text as stored, header included: editing keeps it.)
        # The tree's outline shows the same badge.
        tree = self.client.get(f"/c/{conv.pk}/tree/").content.decode()
        assert f'href="/c/{conv.pk}/?m={explored}#msg-{explored}">explored branch</a>' in tree
