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


class CompareSiblingsTests(BrowserTestCase):
    def test_versions_are_labelled_and_the_view_switches_to_plain_text(self) -> None:
        alice = make_user("alice")
        conv, n = new_conversation(
            alice,
            "make it faster>Cache the parsed config between runs, "
            "make it faster>Cache the parsed config and the lock file between runs, "
            "make it faster>Rewrite the loader in Rust with a streaming parser",
            tip="Cache the parsed config and the lock file between runs",
            title="Speed",
        )
        first = n["Cache the parsed config between runs"]
        self.sign_in("alice")
        page = self.page
        page.set_viewport_size({"width": 1280, "height": 800})
        page.goto(f"{self.live_server_url}/c/{conv.pk}/")
        # "compare" next to the answer's ◀ 2/3 ▶ opens all three versions.
        page.click("#path .msg.tip a.compare")
        page.wait_for_selector(".compare-grid")
        heads = page.locator(".compare-head .version").all_inner_texts()
        assert sorted(heads) == ["Version 1/3", "Version 2/3", "Version 3/3"], heads
        current = page.locator(".compare-col:has(.badge.current) .compare-head .version")
        assert current.all_inner_texts() == ["Version 2/3"]
        # An edit is marked word by word; the rewrite is shown as it is, and said so.
        edit = "has-text('and the lock file')"
        marks = f".compare-col ins:{edit}, .compare-col del:{edit}"
        assert page.locator(marks).count() == 1
        rewrite = page.locator(".compare-cell:has-text('Rewrite the loader')")
        assert "rewritten" in rewrite.inner_text()
        assert rewrite.locator("ins, del").count() == 0
        # The grid takes the window's width, not the 52rem column of the other pages.
        width = page.evaluate("document.querySelector('.compare-grid').offsetWidth")
        assert width > 1100, width
        self.shot("compare-versions-1280")

        page.click(".compare-modes a:has-text('Plain text')")
        page.wait_for_selector(".compare-modes [aria-current]:has-text('Plain text')")
        assert page.locator(".compare-grid ins, .compare-grid del").count() == 0
        assert page.locator(".compare-col").count() == 3
        page.set_viewport_size({"width": 390, "height": 844})
        scroll, inner = page.evaluate(
            "() => [document.documentElement.scrollWidth, window.innerWidth]"
        )
        assert scroll <= inner, (scroll, inner)
        self.shot("compare-versions-390")

        page.click(f"#col-{first.pk} button:has-text('Continue from this one')")
        page.wait_for_url(re.compile(rf"/c/{conv.pk}/"))
        conv.refresh_from_db()
        assert conv.tip_id == first.pk
        self.assert_clean()
