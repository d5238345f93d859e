"""A conversation can be changed in the browser: rename, model from the configured
ones (a typo is refused when it is chosen, not at every send), system prompt; and
exported in every format from its page."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

from django.test import TestCase, override_settings
from django.urls import reverse

from conversations.exporters import EXPORT_FORMATS
from conversations.models import Conversation
from tests.builders import make_user, new_conversation

DECLARED = "openai/local-llama"


def models_file() -> str:
    path = Path(tempfile.mkdtemp()) / "models.json"
    entry = {"base_url": "http://127.0.0.1:9/v1", "context_window": 8192}
    path.write_text(json.dumps({"models": {DECLARED: entry}}))
    return str(path)


@override_settings(ARBOR_DEFAULT_MODEL="fake/demo")
class ConversationSettingsTests(TestCase):
    def setUp(self) -> None:
        self.enterContext(mock.patch.dict(os.environ, {"ARBOR_MODELS": models_file()}))
        self.user = make_user("owner")
        self.client.force_login(self.user)
        self.conv, _ = new_conversation(self.user, "a>b", title="Old title")

    def page(self) -> str:
        return self.client.get(
            reverse("conversations:detail", args=[self.conv.pk])
        ).content.decode()

    def save(self, **fields: str) -> Any:
        url = reverse("conversations:conversation_settings", args=[self.conv.pk])
        return self.client.post(url, {"title": "", "model": "", "system_prompt": "", **fields})

    def test_the_model_is_chosen_from_the_configured_ones(self) -> None:
        html = self.page()
        self.assertIn('<option value="" selected>Default (fake/demo)</option>', html)
        self.assertIn(f'<option value="{DECLARED}">{DECLARED}</option>', html)

    def test_rename_model_and_system_prompt_are_saved(self) -> None:
        response = self.save(title="New title", model=DECLARED, system_prompt="Be brief.")
        self.assertEqual(response.status_code, 302)
        self.conv.refresh_from_db()
        self.assertEqual(
            (self.conv.title, self.conv.model, self.conv.system_prompt),
            ("New title", DECLARED, "Be brief."),
        )
        self.assertIn("<h1>New title</h1>", self.page())

    def test_a_rename_leaves_the_system_prompt_exactly_as_it_was(self) -> None:
        prompt = "  You are X.\n\nBe brief.\n\n"
        Conversation.objects.filter(pk=self.conv.pk).update(system_prompt=prompt)
        response = self.save(title="Renamed", system_prompt=prompt.replace("\n", "\r\n"))
        self.assertEqual(response.status_code, 302)
        self.conv.refresh_from_db()
        self.assertEqual((self.conv.title, self.conv.system_prompt), ("Renamed", prompt))

    def test_a_model_that_is_not_configured_is_refused(self) -> None:
        response = self.save(title="x", model="gpt4o")
        self.assertEqual(response.status_code, 400)
        self.conv.refresh_from_db()
        self.assertEqual((self.conv.title, self.conv.model), ("Old title", ""))
        created = self.client.post(reverse("conversations:new"), {"title": "t", "model": "gpt4o"})
        self.assertEqual(created.status_code, 400)
        self.assertFalse(Conversation.objects.filter(title="t").exists())

    def test_another_user_cannot_change_it(self) -> None:
        self.client.force_login(make_user("stranger"))
        self.assertEqual(self.save(title="mine now").status_code, 404)
        self.conv.refresh_from_db()
        self.assertEqual(self.conv.title, "Old title")

    def test_every_export_format_is_a_link_that_downloads(self) -> None:
        html = self.page()
        for fmt in EXPORT_FORMATS:
            url = f"/api/conversations/{self.conv.pk}/export?format={fmt}"
            with self.subTest(format=fmt):
                self.assertIn(f'href="{url}"', html)
                response = self.client.get(url)
                self.assertEqual(response.status_code, 200)
                self.assertIn("attachment", response["Content-Disposition"])
