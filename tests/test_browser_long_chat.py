"""A 1,000-message chat in Chromium: it opens at the latest message with the composer in
view (sticky), the page carries only the last CHAT_FIRST messages, and scrolling up
loads the history a chunk at a time, in order, without duplicates, keeping the
messages in view where they were. At 1280 and 390 px; screenshots go to
var/screenshots/long-chat-*.png, and the page weight and timings are printed.

Same browser set-up as tests/test_browser_ui.py (skips locally without Chromium, fails
on CI)."""

from __future__ import annotations

import json
from typing import Any

from conversations.management.commands.bench_page import chat_chain
from conversations.views import CHAT_CHUNK, CHAT_FIRST
from tests.builders import make_user
from tests.test_browser_phone import DESKTOP, PHONE
from tests.test_browser_ui import SCREENSHOTS, BrowserTestCase

MESSAGES = 1000
# The page a 1,000-message chat opens with (#15's goal is 150 KB).
MAX_PAGE_BYTES = 150_000


def long_chat(owner: Any) -> Any:
    return chat_chain(owner, MESSAGES)


class LongChatTests(BrowserTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.user = make_user("reader")
        self.conv = long_chat(self.user)
        self.sign_in("reader")

    def shown(self) -> list[str]:
        ids: list[str] = self.page.eval_on_selector_all(
            "#path li.msg", "els => els.map(e => e.dataset.id)"
        )
        return ids

    def in_view(self, selector: str) -> bool:
        return bool(
            self.page.eval_on_selector(
                selector,
                "e => { const r = e.getBoundingClientRect();"
                " return r.bottom > 0 && r.top < window.innerHeight; }",
            )
        )

    def latest_above_composer(self) -> bool:
        """The last message is in view, whole, and not behind the sticky composer."""
        return bool(
            self.page.evaluate(
                "() => { const m = document.querySelector('#path li.msg:last-of-type')"
                ".getBoundingClientRect();"
                " const c = document.getElementById('composer').getBoundingClientRect();"
                " return m.top >= 0 && m.bottom <= c.top + 1 && c.bottom <= window.innerHeight; }"
            )
        )

    def open_chat(self) -> Any:
        response = self.page.goto(self.url(f"/c/{self.conv.pk}/"))
        self.page.wait_for_load_state("load")
        return response

    def test_it_opens_at_the_latest_message_and_loads_history_as_you_scroll_up(self) -> None:
        self.use(DESKTOP, "reader")
        response = self.open_chat()
        weight = len(response.body())
        timing = self.page.evaluate(
            "() => { const n = performance.getEntriesByType('navigation')[0];"
            " return {interactive_ms: Math.round(n.domInteractive),"
            " load_ms: Math.round(n.loadEventEnd),"
            " elements: document.getElementsByTagName('*').length}; }"
        )
        print(json.dumps({"long_chat_page": {"messages": MESSAGES, "bytes": weight, **timing}}))
        assert weight <= MAX_PAGE_BYTES, weight
        ids = self.shown()
        assert len(ids) == CHAT_FIRST
        assert self.latest_above_composer(), "the chat did not open at its latest message"
        self.page.screenshot(path=str(SCREENSHOTS / "long-chat-desktop.png"))

        # Scroll to the top: the chunk above arrives, and the message that was first
        # stays where the reader left it.
        first = ids[0]
        self.page.evaluate("window.scrollTo(0, 0)")
        self.page.wait_for_function(
            "n => document.querySelectorAll('#path li.msg').length >= n",
            arg=CHAT_FIRST + CHAT_CHUNK,
        )
        after = self.shown()
        assert after[CHAT_CHUNK:][: len(ids)] == ids  # the new ones are above, in order
        assert len(set(after)) == len(after)
        assert self.in_view(f"#msg-{first}"), "the view jumped when history arrived"
        # Keep going: every chunk up to the root, then nothing more to load.
        for _ in range(40):
            if self.page.query_selector("#path li.earlier") is None:
                break
            count = len(self.shown())
            self.page.evaluate("window.scrollTo(0, 0)")
            self.page.wait_for_function(
                "n => document.querySelectorAll('#path li.msg').length > n"
                " || !document.querySelector('#path li.earlier')",
                arg=count,
            )
        everything = self.shown()
        assert len(everything) == MESSAGES and len(set(everything)) == MESSAGES
        texts = self.page.eval_on_selector_all(
            "#path li.msg .parts", "els => els.map(e => e.textContent.trim().split(':')[0])"
        )
        assert texts == [f"Message {i}" for i in range(MESSAGES)]
        assert not self.csp_errors, self.csp_errors

    def test_on_a_phone_it_opens_at_the_latest_message_without_sideways_scroll(self) -> None:
        self.use(PHONE, "reader")
        self.open_chat()
        assert self.latest_above_composer()
        wide = self.page.evaluate("document.documentElement.scrollWidth > window.innerWidth")
        assert not wide
        self.page.screenshot(path=str(SCREENSHOTS / "long-chat-phone.png"))

    def test_without_javascript_the_earlier_messages_are_a_link(self) -> None:
        self.use({**DESKTOP, "java_script_enabled": False}, "reader")
        self.open_chat()
        assert len(self.shown()) == CHAT_FIRST
        link = self.page.query_selector("#path li.earlier a")
        assert link is not None
        assert f"Show the {MESSAGES - CHAT_FIRST} earlier messages" in link.inner_text()
        link.click()
        self.page.wait_for_load_state("load")
        assert len(self.shown()) == MESSAGES
        first_id = self.shown()[0]
        # Without JavaScript, an opened Edit is a link to the form's own page, and the
        # edit sent from there runs its turn and shows the new branch.
        first = self.page.locator("#path li.msg.user").first
        first.locator("details.edit > summary").click()
        first.get_by_role("link", name="Open the edit form").click()
        self.page.wait_for_load_state("load")
        self.page.fill("textarea[name=text]", "Message 0, edited")
        self.page.screenshot(path=str(SCREENSHOTS / "edit-page-no-js.png"))
        self.page.click("button:has-text('Send edit')")
        self.page.wait_for_load_state("load")
        assert self.shown()[0] != first_id
        assert (
            self.page.locator("#path li.msg.user .parts")
            .first.inner_text()
            .startswith("Message 0, edited")
        )
