"""Reading without JavaScript: the list, chat, checkpoints, tree and compare pages load
with scripts off, and real links lead from one to the next, including from a collapsed
branch of the tree map to that branch in the chat view. The version switch is a plain
form, so it works too. Same browser set-up as tests/test_browser_ui.py."""

from __future__ import annotations

import re

from tests.test_browser_phone import DESKTOP, LayoutTestCase


class NoJavaScriptTests(LayoutTestCase):
    def assert_links_are_real(self) -> None:
        """Every link on the page goes somewhere: no empty, ``#`` or script hrefs."""
        hrefs = self.page.eval_on_selector_all("a", "els => els.map(e => e.getAttribute('href'))")
        bad = [h for h in hrefs if not h or h == "#" or h.lower().startswith("javascript")]
        assert hrefs and not bad, bad

    def test_read_list_chat_checkpoints_tree_and_compare_by_following_links(self) -> None:
        self.use({**DESKTOP, "java_script_enabled": False}, "root")
        page, c = self.page, self.conv.pk

        # The list (sign-in left us there): a conversation's title is a link.
        assert "Quarterly report loader" in page.inner_text("#results")
        self.assert_links_are_real()
        page.click("#results a.title:has-text('Quarterly report loader')")
        page.wait_for_url(f"**/c/{c}/")

        # The chat: rendered markdown, highlighted code, a collapsible tool call, an image.
        assert page.locator(f"#msg-{self.answer} .md pre span").count() > 3  # Pygments
        assert page.locator(f"#msg-{self.answer} .md table th").count() == 10
        assert page.locator("details.tool-call summary:has-text('read_file')").count() == 1
        assert page.locator(f"#msg-{self.prompt} img").count() == 1
        self.assert_links_are_real()

        page.click(".conv-nav a:has-text('Checkpoints')")
        page.wait_for_url(f"**/c/{c}/checkpoints/")
        checkpoint = page.locator("li.checkpoint:has-text('loader-ready')")
        assert checkpoint.count() == 1
        self.assert_links_are_real()
        checkpoint.locator("a").first.click()
        # The chat around that message, however far up the branch it is.
        page.wait_for_url(f"**/c/{c}/?m={self.answer}#msg-{self.answer}")

        # The tree: collapsed branches are links to that branch in the chat view.
        page.click(".conv-nav a:has-text('Tree')")
        page.wait_for_url(f"**/c/{c}/tree/")
        assert page.locator(".tree .node").count() == 4  # the current branch; the rest folded
        assert page.locator(".tree .node.is-tip").count() == 1
        self.assert_links_are_real()
        branch = page.locator(".tree a.expand:has-text('another branch')")
        assert re.fullmatch(
            rf"/c/{c}/\?m=[0-9a-f-]+#msg-[0-9a-f-]+", branch.get_attribute("href") or ""
        )
        branch.click()
        page.wait_for_url(re.compile(rf"/c/{c}/\?m="))
        shorter = page.locator("#path .msg.found")
        assert "A shorter loader." in shorter.inner_text()
        assert "load_quarterly_report" not in page.inner_text("#path")  # that branch only
        assert "another branch" in page.inner_text(".branch-notice")

        # Compare the two answers from the ◀ n/m ▶ of the one on screen.
        shorter.locator("a.compare").click()
        page.wait_for_url(re.compile(rf"/c/{c}/compare/\?m="))
        columns = page.locator(".compare-grid .compare-col")
        assert columns.count() == 2
        assert "A shorter loader." in columns.nth(0).inner_text()
        # The two answers share few words: shown as they are, the second marked rewritten.
        assert "rewritten" in columns.nth(1).inner_text()
        assert page.locator(".compare-col:has(.badge.current) .version").count() == 1
        self.assert_links_are_real()
        page.click(".compare-modes a:has-text('Plain text')")
        page.wait_for_url(re.compile(rf"/c/{c}/compare/\?m=.*view=plain"))
        assert page.locator(".compare-grid .compare-col").count() == 2
        assert page.locator(".compare-grid ins, .compare-grid del, .rewritten").count() == 0

        # The version switch is a plain form: ◀ moves the tip and shows the chat.
        page.goto(self.url(f"/c/{c}/"))
        page.click(f"#msg-{self.prompt} .sib-next")
        page.wait_for_url(f"**/c/{c}/#msg-{self.other_prompt}")
        assert "Here it is in Rust." in page.inner_text("#path")
        assert self.outside == [], self.outside
