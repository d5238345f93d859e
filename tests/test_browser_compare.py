"""Comparing two branches in a real browser: pick their last messages on the compare page,
read them side by side with a word diff, continue from one. Same browser set-up as
tests/test_browser_ui.py (skips locally without Chromium, fails on CI)."""

from __future__ import annotations

import re

from tests.builders import make_user, new_conversation
from tests.test_browser_ui import BrowserTestCase


class CompareBranchesTests(BrowserTestCase):
    def test_pick_two_branches_compare_them_and_continue_from_one(self) -> None:
        alice = make_user("alice")
        conv, n = new_conversation(
            alice,
            "speed up the build>plan>try a cache>the cache misses>drop the cache, "
            "plan>try parallel jobs>parallel jobs halve it",
            title="Build",
        )
        cache, jobs = n["drop the cache"], n["parallel jobs halve it"]
        self.sign_in("alice")
        page = self.page
        page.goto(f"{self.live_server_url}/c/{conv.pk}/compare/")
        page.check(f".leaf-picker input[value='{cache.pk}']")
        page.check(f".leaf-picker input[value='{jobs.pk}']")
        page.click("button:has-text('Compare the checked branches')")
        page.wait_for_selector(".compare-grid")
        # The newest leaf is listed (and so compared) first.
        first, second = f"#col-{jobs.pk}", f"#col-{cache.pk}"
        assert page.locator(f"{first} .compare-cell").count() == 2
        assert page.locator(f"{second} .compare-cell").count() == 3
        assert "plan" in page.inner_text(".hint")
        assert page.inner_text(f"{second} .compare-cell >> nth=0 >> ins") == "a cache"
        self.shot("compare-branches")

        page.click(f"{second} button:has-text('Continue from this one')")
        page.wait_for_url(re.compile(rf"/c/{conv.pk}/"))
        conv.refresh_from_db()
        assert conv.tip_id == cache.pk
        assert "drop the cache" in page.inner_text("#path")
        self.assert_clean()
