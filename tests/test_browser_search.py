"""The conversation list's search in a real browser: live search by typing, a message hit
opens the branch holding the message (the tip stays), and "Continue from this branch"
moves the tip there. Same browser set-up as tests/test_browser_ui.py (skips locally
without Chromium, fails on CI)."""

from __future__ import annotations

import re

from tests.builders import make_user, new_conversation
from tests.test_browser_ui import BrowserTestCase


class SearchTests(BrowserTestCase):
    def test_type_a_search_and_open_a_message_hit_on_another_branch(self) -> None:
        alice = make_user("alice")
        bob = make_user("bob")
        conv, nodes = new_conversation(
            alice,
            "pack for the trip>bring the walrus costume & <hat>then what?>sail north, "
            "pack for the trip>stay home",
            title="Holiday",
        )
        new_conversation(bob, "bob's walrus", title="Bob")
        conv.refresh_from_db()
        tip, version = conv.tip_id, conv.version
        hit = nodes["bring the walrus costume & <hat"]
        self.sign_in("alice")
        page = self.page

        page.fill("input[name=q]", "walrus cos")  # htmx swaps #results as one types
        page.wait_for_selector(f"#hit-{hit.pk}")
        assert page.inner_text(f"#hit-{hit.pk} mark") == "walrus cos"
        assert "& <hat" in page.inner_text(f"#hit-{hit.pk} .snippet")  # shown, never parsed
        assert page.locator(".hits li[id^=hit-]").count() == 1  # not Bob's
        assert re.search(r"q=walrus(\+|%20)cos", page.url)  # hx-push-url keeps the search
        self.shot("search")

        page.click(f"#hit-{hit.pk} a.hit")
        page.wait_for_url(re.compile(rf"/c/{conv.pk}/\?m={hit.pk}#msg-{hit.pk}$"))
        found = page.locator(f"#msg-{hit.pk}")
        assert "found" in (found.get_attribute("class") or "")
        assert found.is_visible()
        path = page.inner_text("#path")
        assert "sail north" in path and "stay home" not in path
        assert "You are viewing another branch" in page.inner_text(".branch-notice")
        self.shot("search-branch")
        conv.refresh_from_db()
        assert (conv.tip_id, conv.version) == (tip, version)  # a GET moves nothing

        page.click("button:has-text('Continue from this branch')")
        page.wait_for_url(re.compile(rf"/c/{conv.pk}/#msg-{hit.pk}$"))
        assert page.locator(".branch-notice").count() == 0
        conv.refresh_from_db()
        assert conv.tip_id == nodes["sail north"].pk
        self.assert_clean()
