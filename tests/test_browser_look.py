"""The designed look in Chromium (#15): one stylesheet of tokens with a dark mode that
follows the system, styled controls, a sidebar of conversations grouped by date, message
headers with role, model and time, and code blocks with a Copy button. Screenshots at
1280 and 390 px, light and dark, go to var/screenshots/look-*.png."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.test import TestCase
from django.utils import timezone

from conversations import services
from conversations.markdown import pygments_css
from conversations.models import Conversation
from conversations.views.listing import date_groups
from tests.builders import make_user, text
from tests.test_browser_phone import DESKTOP, PHONE
from tests.test_browser_ui import SCREENSHOTS, BrowserTestCase

CODE = "def greet(name):\n    return f'hello {name}'\n"


def luminance(rgb: str) -> float:
    """The relative luminance of a computed ``rgb(r, g, b)`` colour, 0 (black) to 1."""
    r, g, b = (int(v) / 255 for v in rgb[rgb.index("(") + 1 : rgb.index(")")].split(",")[:3])
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def aged(conv: Conversation, days: int) -> None:
    Conversation.objects.filter(pk=conv.pk).update(updated_at=timezone.now() - timedelta(days=days))


class LookTests(BrowserTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.user = make_user("designer")
        for title, days in [
            ("Old plan", 100),
            ("Last month", 20),
            ("This week", 3),
            ("Yesterday's", 1),
        ]:
            aged(services.conversation_create(owner=self.user, title=title), days)
        self.conv = services.conversation_create(owner=self.user, title="Today's code")
        services.turn_append(
            conversation=self.conv,
            parent_id=None,
            expected_version=None,
            messages=[
                {"role": "user", "parts": text("Write a greeting function")},
                {
                    "role": "assistant",
                    "parts": text(f"Here it is:\n\n```python\n{CODE}```\n"),
                    "metadata": {"model": "gpt-4o-mini"},
                },
            ],
        )

    def open_chat(self, options: Mapping[str, Any], scheme: str) -> None:
        self.use({**options, "color_scheme": scheme}, "designer")
        self.page.goto(self.url(f"/c/{self.conv.pk}/"))
        self.page.wait_for_load_state("load")

    def test_light_and_dark_follow_the_system(self) -> None:
        shades = {}
        for scheme in ("light", "dark"):
            self.open_chat(DESKTOP, scheme)
            body = self.page.evaluate("getComputedStyle(document.body).backgroundColor")
            ink = self.page.evaluate("getComputedStyle(document.body).color")
            card = self.page.locator(".msg.assistant").evaluate(
                "e => getComputedStyle(e).backgroundColor"
            )
            shades[scheme] = (luminance(body), luminance(ink), luminance(card))
            self.page.wait_for_selector("#sidebar h2")
            self.page.screenshot(path=str(SCREENSHOTS / f"look-chat-{scheme}-1280.png"))
            self.open_chat(PHONE, scheme)
            self.page.screenshot(path=str(SCREENSHOTS / f"look-chat-{scheme}-390.png"))
        light, dark = shades["light"], shades["dark"]
        assert light[0] > 0.85 and light[1] < 0.2, light  # dark ink on a light page
        assert dark[0] < 0.15 and dark[1] > 0.75, dark  # and the other way round
        assert dark[2] < 0.25, "a message card stayed white in dark mode"
        self.assert_clean()

    def test_controls_are_styled_not_browser_defaults(self) -> None:
        self.open_chat(DESKTOP, "light")
        send = self.page.locator("#composer button")
        style = send.evaluate(
            "e => { const s = getComputedStyle(e); return [s.borderTopLeftRadius,"
            " s.backgroundColor, s.color, s.fontWeight]; }"
        )
        radius, background, color, weight = style
        assert float(radius.rstrip("px")) >= 4, style
        assert luminance(background) < 0.5 < luminance(color), "Send is not a filled button"
        assert int(weight) >= 600, style
        regenerate = self.page.locator("button.regenerate").evaluate(
            "e => getComputedStyle(e).backgroundColor"
        )
        assert regenerate != "rgb(239, 239, 239)", "Chromium's default button face"

    def test_the_sidebar_groups_conversations_by_date_and_marks_the_open_one(self) -> None:
        self.open_chat(DESKTOP, "light")
        self.page.wait_for_selector("#sidebar h2")
        headings = self.page.locator("#sidebar h2").all_inner_texts()
        month = (timezone.localdate() - timedelta(days=100)).strftime("%B %Y")
        assert [h.lower() for h in headings] == [
            "today", "yesterday", "previous 7 days", "previous 30 days", month.lower()
        ], headings  # fmt: skip
        current = self.page.locator("#sidebar a[aria-current=page]")
        assert current.all_inner_texts() == ["Today's code"]
        self.page.locator("#sidebar a", has_text="This week").click()
        self.page.wait_for_load_state("load")
        assert self.page.locator("h1").inner_text() == "This week"
        # On a phone the sidebar is not shown, and not even fetched.
        requests: list[str] = []
        self.use(PHONE, "designer")
        self.page.on("request", lambda r: requests.append(r.url))
        self.page.goto(self.url(f"/c/{self.conv.pk}/"))
        self.page.wait_for_load_state("load")
        assert not self.page.is_visible("#sidebar")
        assert not [u for u in requests if "/sidebar/" in u], requests

    def test_messages_show_role_model_and_time_and_code_has_a_copy_button(self) -> None:
        self.open_chat(DESKTOP, "light")
        self.context.grant_permissions(["clipboard-read", "clipboard-write"])
        answer = self.page.locator(".msg.assistant")
        assert answer.locator(".role").inner_text().lower() == "assistant"
        assert answer.locator(".msg-model").inner_text() == "gpt-4o-mini"
        stamp = answer.locator("time").get_attribute("datetime")
        assert stamp and stamp.startswith(str(timezone.localdate().year))
        copy = answer.locator(".codeblock button.copy")
        copy.click()
        self.page.wait_for_function(
            "() => document.querySelector('.codeblock .copy').textContent === 'Copied'"
        )
        copied = self.page.evaluate("navigator.clipboard.readText()")
        assert copied.strip() == CODE.strip()
        self.assert_clean()


class LookPiecesTests(TestCase):
    def test_date_groups(self) -> None:
        today = timezone.localdate()
        user = make_user()
        convs = []
        for days in (0, 0, 1, 2, 7, 8, 30, 31, 62):
            conv = services.conversation_create(owner=user, title=f"{days}")
            aged(conv, days)
            conv.refresh_from_db()
            convs.append(conv)
        groups = date_groups(convs, today)
        names = [(heading, [c.title for c in items]) for heading, items in groups]

        def month(days: int) -> str:
            return (today - timedelta(days=days)).strftime("%B %Y")

        expected = [
            ("Today", ["0", "0"]),
            ("Yesterday", ["1"]),
            ("Previous 7 days", ["2", "7"]),
            ("Previous 30 days", ["8", "30"]),
        ]
        assert names[:4] == expected, names
        older: list[str] = []
        for days in (31, 62):
            if month(days) not in older:
                older.append(month(days))
        assert [h for h, _ in names[4:]] == older, names

    def test_the_sidebar_is_one_query(self) -> None:
        user = make_user()
        for i in range(70):
            services.conversation_create(owner=user, title=f"c{i}")
        self.client.force_login(user)
        self.client.get("/sidebar/")  # the session and user, cached for the next
        with self.assertNumQueries(3):  # session, user, the conversations
            page = self.client.get("/sidebar/").content.decode()
        assert page.count("<li>") == 60 and "All conversations" in page

    def test_the_sidebar_lists_only_ones_own(self) -> None:
        mine, theirs = make_user("me"), make_user("them")
        services.conversation_create(owner=theirs, title="Their secret")
        services.conversation_create(owner=mine, title="Mine")
        self.client.force_login(mine)
        page = self.client.get("/sidebar/").content.decode()
        assert "Mine" in page and "Their secret" not in page

    def test_the_highlighting_stylesheet_is_what_the_generator_writes(self) -> None:
        path = Path(settings.BASE_DIR) / "static" / "pygments.css"
        assert path.read_text() == pygments_css(), "regenerate static/pygments.css"
