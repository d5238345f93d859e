"""A failed turn stays on the page after a reload (attempts are rows) with its prompt
and the reason, and a Retry button that runs it again; retrying when nothing failed is
refused with the reason."""

from __future__ import annotations

from django.test import TestCase

from conversations.models import AttemptStatus, Message, TurnAttempt
from tests.builders import make_user, new_conversation, text


class RetryButtonTests(TestCase):
    def setUp(self) -> None:
        self.user = make_user()
        self.client.force_login(self.user)
        self.conv, self.nodes = new_conversation(self.user, "a>b")
        self.conv.model = "fake/demo"
        self.conv.save()

    def failed_turn(self, prompt: str) -> None:
        TurnAttempt.objects.create(
            conversation=self.conv,
            parent=self.nodes["b"],
            input_parts=text(prompt),
            model="fake/demo",
            status=AttemptStatus.FAILED,
            error_code="provider_unavailable",
            error_text="the provider did not answer (timeout)",
        )

    def test_the_failed_prompt_is_shown_and_retried(self) -> None:
        self.failed_turn("What is the capital of Peru?")
        page = self.client.get(f"/c/{self.conv.pk}/").content.decode()
        self.assertIn("The last turn failed", page)
        self.assertIn("What is the capital of Peru?", page)
        self.assertIn("the provider did not answer (timeout)", page)
        self.assertIn(f'action="/c/{self.conv.pk}/retry/"', page)
        before = Message.objects.filter(conversation=self.conv).count()
        response = self.client.post(f"/c/{self.conv.pk}/retry/")
        self.assertEqual(response.status_code, 302)
        self.assertEqual(Message.objects.filter(conversation=self.conv).count(), before + 2)
        self.conv.refresh_from_db()
        self.assertEqual(self.conv.tip.parent.parts, text("What is the capital of Peru?"))
        page = self.client.get(f"/c/{self.conv.pk}/").content.decode()
        self.assertNotIn("The last turn failed", page)

    def test_nothing_to_retry_is_said(self) -> None:
        response = self.client.post(f"/c/{self.conv.pk}/retry/", HTTP_ACCEPT="text/event-stream")
        # Messages but no attempt: nothing to retry (DESIGN.md's order).
        self.assertEqual(response.status_code, 409)
        self.assertIn("nothing to retry", response.content.decode())
