"""Imported conversations keep their own dates: created when they began in the tool they
came from, last active when their newest message was written there, not at the import.
The list shows (and sorts by) that last activity."""

from __future__ import annotations

import tempfile
from datetime import UTC, datetime
from pathlib import Path

from django.test import TestCase

from conversations.importers import transcript_import
from conversations.models import Conversation
from tests.builders import make_user
from tests.test_import_robust import cc, jsonl


class ImportedDatesTests(TestCase):
    def test_an_imported_session_keeps_its_own_first_and_last_dates(self) -> None:
        user = make_user("alice")
        records = [
            cc("u1", None, "user", "Plan the migration", timestamp="2024-03-01T09:00:00Z"),
            cc("a1", "u1", "assistant", "Here is a plan.", timestamp="2024-03-01T09:00:05Z"),
            cc("u2", "a1", "user", "Go on", timestamp="2024-03-04T17:30:00Z"),
            cc("a2", "u2", "assistant", "Done.", timestamp="2024-03-04T17:31:00Z"),
        ]
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "session.jsonl"
            path.write_text(jsonl(*records))
            report = transcript_import(owner_id=user.pk, path=path)
        conversation = Conversation.objects.get(pk=report.conversation_ids[0])
        assert conversation.created_at == datetime(2024, 3, 1, 9, 0, tzinfo=UTC)
        assert conversation.updated_at == datetime(2024, 3, 4, 17, 31, tzinfo=UTC)

        # A conversation of today lists above it; the import shows its own date.
        Conversation.objects.create(owner=user, title="Today's chat")
        self.client.force_login(user)
        page = self.client.get("/").content.decode()
        assert page.index("Today&#x27;s chat") < page.index("2024-03-04 17:31")
