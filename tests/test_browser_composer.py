"""Images from the composer in Chromium (#15): a pasted image shows as a thumbnail, can
be removed, and goes up with the message; one chosen with the paperclip too; the sent
message shows the image inline, served from the blob store. At 1280 and 390 px
(screenshots var/screenshots/composer-*.png)."""

from __future__ import annotations

import base64
import re
from typing import Any

from conversations.models import Blob
from conversations.providers.fake import Step
from tests.builders import make_user, new_conversation
from tests.test_api_bad_input import png_bytes
from tests.test_browser_phone import DESKTOP, PHONE
from tests.test_browser_ui import SCREENSHOTS, BrowserTestCase

# The images of the last user message in the chat.
LAST_ASKED = (
    "Array.from((Array.from(document.querySelectorAll('#path li.msg.user')).pop()"
    " || document).querySelectorAll('.parts img'))"
)
PASTE = """([name, data]) => {
  const bytes = Uint8Array.from(atob(data), c => c.charCodeAt(0));
  const transfer = new DataTransfer();
  transfer.items.add(new File([bytes], name, {type: 'image/png'}));
  const event = new ClipboardEvent(
    'paste', {clipboardData: transfer, bubbles: true, cancelable: true});
  document.querySelector('#composer textarea').dispatchEvent(event);
}"""


class ComposerImageTests(BrowserTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.user = make_user("painter")
        self.conv, _ = new_conversation(self.user, "Hello>Hi")
        self.conv.model = "anthropic/test"
        self.conv.save()

    def open(self, options: dict[str, Any]) -> None:
        self.use(options, "painter")
        self.page.goto(self.url(f"/c/{self.conv.pk}/"))

    def paste(self, name: str, width: int) -> None:
        data = base64.b64encode(png_bytes(width=width, height=20)).decode()
        self.page.evaluate(PASTE, [name, data])

    def sent_images(self) -> int:
        count: int = self.page.evaluate(
            f"() => {LAST_ASKED}.filter(i => i.complete && i.naturalWidth > 0).length"
        )
        return count

    def check(self, options: dict[str, Any], name: str) -> None:
        self.fake.push(Step.reply("I see two green rectangles."))
        self.open(options)
        self.paste("first.png", 30)
        self.paste("second.png", 60)
        self.paste("third.png", 90)
        thumbs = self.page.locator("#composer .attachments img")
        self.page.wait_for_function(
            "() => Array.from(document.querySelectorAll('#composer .attachments img'))"
            ".filter(i => i.src.startsWith('data:image/png')).length === 3"
        )
        # Remove the second one again.
        self.page.locator("#composer .attachments .remove").nth(1).click()
        assert thumbs.count() == 2
        assert [thumbs.nth(i).get_attribute("alt") for i in range(2)] == ["first.png", "third.png"]
        self.page.fill("#composer textarea", "What are these?")
        self.page.screenshot(path=str(SCREENSHOTS / f"composer-pasted-{name}.png"))
        self.page.click("#composer button.send")
        self.page.wait_for_selector(f"#path li.msg.assistant:has-text('{'I see two green'}')")
        self.page.wait_for_function(f"() => {LAST_ASKED}.length === 2")
        self.page.wait_for_function(
            f"() => {LAST_ASKED}.every(i => i.complete && i.naturalWidth > 0)"
        )
        assert self.sent_images() == 2
        assert not self.page.is_visible("#composer .attachments img")
        sent = self.fake.requests[-1].body["messages"][-1]["content"]
        assert [b["type"] for b in sent] == ["image", "image", "text"], sent
        # The removed one was never uploaded.
        assert sorted(b.width for b in Blob.objects.all()) == [30, 90]
        self.page.screenshot(path=str(SCREENSHOTS / f"composer-sent-{name}.png"), full_page=True)
        self.assert_clean()

    def test_paste_remove_and_send_images_at_1280(self) -> None:
        self.check(DESKTOP, "1280")

    def test_paste_remove_and_send_images_on_a_phone(self) -> None:
        self.check(PHONE, "390")

    def test_text_pasted_with_a_picture_of_it_is_not_attached(self) -> None:
        # Office apps put a picture of the selection beside its text.
        self.open(DESKTOP)
        data = base64.b64encode(png_bytes(width=30, height=20)).decode()
        self.page.evaluate(
            """([data]) => {
              const bytes = Uint8Array.from(atob(data), c => c.charCodeAt(0));
              const transfer = new DataTransfer();
              transfer.setData('text/plain', 'A1 B1 C1');
              transfer.items.add(new File([bytes], 'cells.png', {type: 'image/png'}));
              document.querySelector('#composer textarea').dispatchEvent(new ClipboardEvent(
                'paste', {clipboardData: transfer, bubbles: true, cancelable: true}));
            }""",
            [data],
        )
        assert self.page.locator("#composer .attachments img").count() == 0
        assert (
            self.page.evaluate(
                "document.querySelector('#composer input[name=images]').files.length"
            )
            == 0
        )

    def test_choose_an_image_with_the_paperclip(self) -> None:
        self.fake.push(Step.reply("A picture."))
        self.open(DESKTOP)
        self.page.set_input_files(
            "#composer input[name=images]",
            files=[{"name": "chosen.png", "mimeType": "image/png", "buffer": png_bytes(width=25)}],
        )
        self.page.wait_for_selector("#composer .attachments img[alt='chosen.png']")
        self.page.click("#composer button.send")
        self.page.wait_for_selector("#path li.msg.assistant:has-text('A picture.')")
        self.page.wait_for_function(f"() => {LAST_ASKED}.length === 1")

    def test_a_file_that_is_not_an_image_is_said_and_kept_in_the_composer(self) -> None:
        self.open(DESKTOP)
        self.page.set_input_files(
            "#composer input[name=images]",
            files=[{"name": "notes.png", "mimeType": "image/png", "buffer": b"not a picture"}],
        )
        self.page.fill("#composer textarea", "Look at this")
        self.page.click("#composer button.send")
        self.page.wait_for_selector("#live-answer.error")
        assert "notes.png" in self.page.locator("#live-answer").inner_text()
        assert self.page.input_value("#composer textarea") == "Look at this"
        assert self.page.locator("#composer .attachments img").count() == 1
        assert not Blob.objects.exists()

    def test_a_message_sent_after_the_session_ended_waits_for_signing_in_again(self) -> None:
        self.fake.push(Step.reply("Tomorrow looks dry."))
        self.open(DESKTOP)
        chat = self.url(f"/c/{self.conv.pk}/")
        self.page.wait_for_load_state("networkidle")
        self.page.set_input_files(
            "#composer input[name=images]",
            files=[{"name": "sky.png", "mimeType": "image/png", "buffer": png_bytes(width=25)}],
        )
        self.page.fill("#composer textarea", "And tomorrow?")
        # The session ends (expired, signed out elsewhere); the CSRF cookie outlives it.
        self.context.clear_cookies(name="sessionid")
        self.page.click("#composer button.send")
        link = self.page.wait_for_selector("#live-answer.error a:has-text('Sign in again')")
        assert link is not None
        # What was typed and attached is still there; nothing reached the model or the
        # transcript.
        assert "session has ended" in self.page.inner_text("#live-answer")
        assert self.page.input_value("#composer textarea") == "And tomorrow?"
        assert self.page.locator("#composer .attachments img").count() == 1
        assert self.fake.requests == [] and self.conv.messages.count() == 2
        self.page.screenshot(path=str(SCREENSHOTS / "composer-session-ended.png"))
        link.click()
        self.page.wait_for_url(re.compile(r"/login/\?next="))
        self.page.fill("input[name=username]", "painter")
        self.page.fill("input[name=password]", "pw")
        self.page.click("button:has-text('Sign in')")
        self.page.wait_for_url(chat)
        # Back at the chat, the message waits in the composer (its text: a picture is
        # not kept across pages) and goes this time.
        assert self.page.input_value("#composer textarea") == "And tomorrow?"
        self.page.click("#composer button.send")
        self.page.wait_for_selector("#path li.msg.assistant:has-text('Tomorrow looks dry.')")
        # The saved turn replaces the streamed one once it is written.
        self.page.wait_for_selector("#live-answer", state="detached")
        assert self.conv.messages.count() == 4
        # Sent once, the draft is not put back again.
        self.page.goto(chat)
        assert self.page.input_value("#composer textarea") == ""
        self.assert_clean()

    def test_a_page_older_than_the_last_sign_in_says_to_reload(self) -> None:
        self.open(DESKTOP)
        self.page.fill("#composer textarea", "Still there?")
        # Signed in again in another tab: the browser's CSRF secret is new, the token
        # this page was drawn with is not.
        cookies = [c for c in self.context.cookies() if c["name"] == "csrftoken"]
        self.context.add_cookies([{**cookies[0], "value": "y" * 32}])
        self.page.click("#composer button.send")
        self.page.wait_for_selector("#live-answer.error")
        said = self.page.inner_text("#live-answer")
        assert "older than your last sign-in" in said and "reload" in said and "<" not in said
        assert self.page.input_value("#composer textarea") == "Still there?"
        assert self.conv.messages.count() == 2
        # Reloading as it says loses nothing: the message is back in the composer.
        self.page.reload()
        assert self.page.input_value("#composer textarea") == "Still there?"

    def test_an_edit_refused_after_the_session_ended_is_not_put_in_the_composer(self) -> None:
        self.open(DESKTOP)
        first = "#path li.msg.user"
        self.page.click(f"{first} summary:has-text('Edit')")
        self.page.fill(f"{first} textarea[name=text]", "Hello again")
        self.context.clear_cookies(name="sessionid")
        self.page.click(f"{first} button:has-text('Send')")
        self.page.wait_for_selector("#live-answer.error a:has-text('Sign in again')")
        # Put back in the composer it would go below the tip, not in place of the
        # message it edits: only the composer's own message waits for the way back.
        kept = self.page.evaluate("Object.keys(window.sessionStorage)")
        assert [k for k in kept if k.startswith("arbor:draft:")] == []
        assert self.conv.messages.count() == 2
