"""A conversation's settings and imports in Chromium (#15):

- Settings: rename, a model from the declared list (nothing else can be chosen), a
  system prompt; the next turn uses them.
- Import with jobs in a thread of the server (no broker): the page follows the job to
  its end without a reload; the same file again is noticed, and its conversations are
  imported again as copies only when asked.
"""

from __future__ import annotations

from pathlib import Path

from django.test import override_settings

from conversations.models import Conversation
from conversations.providers.fake import Step
from tests.builders import make_user, new_conversation
from tests.test_browser_ui import SCREENSHOTS, BrowserTestCase

SAMPLE = Path(__file__).resolve().parent / "data" / "chatgpt" / "browsing.json"


class SettingsTests(BrowserTestCase):
    def test_rename_choose_a_model_and_a_system_prompt_then_chat(self) -> None:
        user = make_user("tuner")
        conv, _ = new_conversation(user, "Hello>Hi", title="Draft")
        self.sign_in("tuner")
        page = self.page
        page.goto(self.url(f"/c/{conv.pk}/"))
        page.click(".conv-settings summary")
        options = page.locator(".conv-settings select[name=model] option").evaluate_all(
            "os => os.map(o => o.value)"
        )
        assert "openai/test" in options and "gpt4o" not in options, options
        page.fill(".conv-settings input[name=title]", "Trip planning")
        page.select_option(".conv-settings select[name=model]", "openai/test")
        page.fill(".conv-settings textarea[name=system_prompt]", "Answer in one sentence.")
        page.click(".conv-settings button:has-text('Save')")
        page.wait_for_selector("h1:has-text('Trip planning')")
        conv.refresh_from_db()
        assert (conv.title, conv.model, conv.system_prompt) == (
            "Trip planning", "openai/test", "Answer in one sentence."
        )  # fmt: skip
        page.wait_for_selector("#sidebar a[aria-current=page]:has-text('Trip planning')")
        self.fake.push(Step.reply("Go to Jeju in May."))
        page.fill("#composer textarea", "Where should I go?")
        page.click("#composer button.send")
        page.wait_for_selector("#path li.msg.assistant:has-text('Go to Jeju in May.')")
        sent = self.fake.requests[-1].body
        assert sent["messages"][0] == {"role": "system", "content": "Answer in one sentence."}
        assert sent["model"] == "test"
        page.screenshot(path=str(SCREENSHOTS / "settings-1280.png"), full_page=True)
        self.assert_clean()


@override_settings(ARBOR_INPROCESS_JOBS="thread")
class ImportTests(BrowserTestCase):
    def upload(self) -> None:
        page = self.page
        page.goto(self.url("/import/"))
        page.set_input_files("input[name=file]", str(SAMPLE))
        page.click("button:has-text('Import')")
        page.wait_for_selector(".state.done")

    def test_progress_to_the_end_then_a_second_upload_is_noticed_and_copied_on_request(
        self,
    ) -> None:
        user = make_user("importer")
        self.sign_in("importer")
        self.upload()
        assert "Imported 2 conversations" in self.page.locator("#import-progress").inner_text()
        assert Conversation.objects.filter(owner=user).count() == 2
        self.upload()
        notice = self.page.locator("#duplicates")
        assert "2 conversations of this file were imported before" in notice.inner_text()
        assert Conversation.objects.filter(owner=user).count() == 2
        self.page.screenshot(path=str(SCREENSHOTS / "import-duplicates-1280.png"), full_page=True)
        self.page.click("button.import-again")
        self.page.wait_for_selector(".state.done")
        assert "Imported 2 conversations" in self.page.locator("#import-progress").inner_text()
        assert Conversation.objects.filter(owner=user).count() == 4
        self.assert_clean()
