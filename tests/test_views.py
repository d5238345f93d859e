"""The read-only pages: owner, stranger and anonymous."""

from __future__ import annotations

from django.test import TestCase

from conversations import services
from tests.builders import make_user, new_conversation, text


class PageTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.alice = make_user("alice")
        cls.bob = make_user("bob")
        cls.conv, cls.nodes = new_conversation(
            cls.alice, "hello>hi there>more, hi there>other", title="Alice's plans"
        )

    def test_it_lists_only_the_owners_conversations(self) -> None:
        new_conversation(self.bob, "x", title="Bob's secret")
        self.client.force_login(self.alice)
        body = self.client.get("/").content.decode()
        assert "Alice&#x27;s plans" in body
        assert "Bob" not in body

    def test_the_owner_sees_the_current_branch(self) -> None:
        self.client.force_login(self.alice)
        response = self.client.get(f"/c/{self.conv.id}/")
        body = response.content.decode()
        assert response.status_code == 200
        assert "hello" in body and "other" in body
        assert "more" not in body  # on the branch the tip left behind

    def test_a_stranger_gets_404(self) -> None:
        self.client.force_login(self.bob)
        assert self.client.get(f"/c/{self.conv.id}/").status_code == 404
        assert self.client.get("/c/not-a-uuid/").status_code == 404

    def test_anonymous_is_sent_to_sign_in(self) -> None:
        response = self.client.get(f"/c/{self.conv.id}/")
        assert response.status_code == 302
        assert "/login/" in response["Location"]

    def test_html_in_messages_is_escaped(self) -> None:
        conv, _ = new_conversation(self.alice, title="<b>t</b>")
        services.turn_append(
            conversation=conv,
            parent_id=None,
            expected_version=0,
            messages=[{"role": "user", "parts": text("<script>alert(1)</script>")}],
        )
        self.client.force_login(self.alice)
        body = self.client.get(f"/c/{conv.id}/").content.decode()
        assert "<script>alert(1)</script>" not in body
        assert "&lt;script&gt;" in body
