"""The tree graph in a real browser (the set-up of tests/test_browser_ui.py): htmx acts on
the SVG's links, so a click on a node moves the tip on the server and redraws the graph and
the outline without a page load, and a "+N" stub opens in place; without JavaScript the
same links are plain page loads; on a phone the drawing scrolls in its own box."""

from __future__ import annotations

import re

from conversations import services
from conversations.models import Conversation, Message
from conversations.treegraph import LABEL_CHARS
from conversations.treemap import ALTS_SHOWN, STRETCH_CHUNK
from tests.builders import bulk_tree, comb, make_user, new_conversation, text
from tests.test_browser_phone import PHONE
from tests.test_browser_ui import SCREENSHOTS, BrowserTestCase


class TreeGraphTests(BrowserTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.user = make_user("alice")
        self.conv, self.nodes = new_conversation(
            self.user,
            "plan>the quick brown fox>more>and more, the quick brown fox>a detour,"
            " plan>the slow brown fox>other",
            title="Branchy",
        )  # the tip: `other`
        services.checkpoint_create(
            conversation=self.conv, label="after-plan", message_id=self.nodes["plan"].pk
        )
        services.conversation_fork(
            message=self.nodes["the slow brown fox"], owner=self.user, title="A fork"
        )
        self.conv.refresh_from_db()
        self.sign_in("alice")

    def node(self, name: str) -> str:
        return f"#gn-{self.nodes[name].pk}"

    def assert_no_sideways_scroll(self, width: int) -> None:
        scroll, inner = self.page.evaluate(
            "() => [document.documentElement.scrollWidth, window.innerWidth]"
        )
        assert inner == width and scroll <= inner, (scroll, inner)

    def test_click_a_node_to_move_the_tip_and_open_a_stub_in_place(self) -> None:
        page = self.page
        page.goto(self.url(f"/c/{self.conv.pk}/tree/"))
        page.evaluate("window.__samePage = true")  # gone if anything loads a new page
        assert page.locator("svg.tg .gnode.is-tip").count() == 1
        assert "on-path" in (page.get_attribute(self.node("other"), "class") or "")
        assert page.locator("svg.tg .edge.on-path").count() == 2
        # Marks: the checkpoint on `plan`, the fork on `the slow brown fox`.
        assert page.locator(f"{self.node('plan')} .mark.checkpoint").count() == 1
        assert page.locator(f"{self.node('the slow brown fox')} .mark.fork").count() == 1

        # Open the collapsed branch: the graph alone is redrawn, the URL keeps the state.
        stub = page.locator("svg.tg .gnode.stub a").first
        assert "+4" in (stub.text_content() or "")
        stub.click()
        page.wait_for_selector(self.node("the quick brown fox"))
        assert re.search(r"/tree/\?open=[0-9a-f-]+$", page.url), page.url
        assert page.evaluate("window.__samePage") is True
        self.shot("tree-graph-opened")

        # Click a node off the path: the server moves the tip; the path redraws through it.
        page.click(f"{self.node('a detour')} a")
        page.wait_for_selector(f"{self.node('a detour')}.is-tip")
        self.conv.refresh_from_db()
        assert self.conv.tip_id == self.nodes["a detour"].pk
        assert page.evaluate("window.__samePage") is True
        for name in ("plan", "the quick brown fox", "a detour"):
            assert "on-path" in (page.get_attribute(self.node(name), "class") or ""), name
        assert page.locator(self.node("other")).count() == 0  # its branch is a stub now
        assert page.locator("svg.tg .gnode.stub").count() == 2  # `more` and the slow fox
        # The outline follows the new path too.
        assert page.locator(f"#node-{self.nodes['a detour'].pk}.is-tip").count() == 1
        # A second move straight after the first carries the new version: up the path.
        page.click(f"{self.node('the quick brown fox')} a")
        page.wait_for_selector(f"{self.node('the quick brown fox')}.is-tip")
        self.conv.refresh_from_db()
        assert self.conv.tip_id == self.nodes["the quick brown fox"].pk
        assert "on-path" not in (page.get_attribute(self.node("a detour"), "class") or "")
        assert page.locator(".notice").count() == 0
        self.shot("tree-graph")
        self.assert_clean()

    def test_without_javascript_the_graph_links_load_pages(self) -> None:
        self.use(
            {"viewport": {"width": 1200, "height": 900}, "java_script_enabled": False}, "alice"
        )
        page = self.page
        page.goto(self.url(f"/c/{self.conv.pk}/tree/"))
        hrefs = page.eval_on_selector_all("svg a", "els => els.map(e => e.getAttribute('href'))")
        assert hrefs and all(h and h.startswith("/c/") for h in hrefs), hrefs
        page.click("svg.tg .gnode.stub a")
        page.wait_for_url(re.compile(r"/tree/\?open=[0-9a-f-]+#tree-graph$"))
        page.click(f"{self.node('a detour')} a")
        mid = self.nodes["a detour"].pk
        page.wait_for_url(f"**/c/{self.conv.pk}/?m={mid}#msg-{mid}")
        assert "a detour" in page.inner_text("#path")
        page.click("button.continue-branch")
        page.wait_for_url(f"**/c/{self.conv.pk}/#msg-{mid}")
        self.conv.refresh_from_db()
        assert self.conv.tip_id == mid
        assert self.outside == [], self.outside

    def long_branch(self) -> tuple[Conversation, list[str]]:
        """500 messages along the path, a one-message branch beside each but the tip."""
        conv = bulk_tree(self.user, comb(999), title="Long")
        ids = Message.objects.filter(conversation=conv).order_by("created_at")
        return conv, [f"node-{m}" for m in ids.values_list("id", flat=True)[::2]]

    def test_the_outline_opens_a_long_branch_in_place_a_chunk_at_a_time(self) -> None:
        conv, spine = self.long_branch()
        page = self.page
        page.goto(self.url(f"/c/{conv.pk}/tree/"))
        page.evaluate("window.__samePage = true")
        rows = ".tree > ol.branch > li.node"
        shown = page.eval_on_selector_all(rows, "els => els.map(e => e.id)")
        assert shown == spine[:15] + spine[15 - len(shown) :]
        assert page.locator(f"#{spine[-1]}.is-tip").count() == 1
        page.locator(".tree li.gap").scroll_into_view_if_needed()
        page.screenshot(path=str(SCREENSHOTS / "tree-outline-gap.png"))
        clicks = 0
        while page.locator(".tree li.gap a").count():
            count = page.locator(rows).count()
            page.locator(".tree li.gap a").click()
            page.wait_for_function(
                "([sel, n]) => document.querySelectorAll(sel).length > n", arg=[rows, count]
            )
            clicks += 1
            assert page.locator(rows).count() - count <= STRETCH_CHUNK // 2
        # Every message of the path, in order, each chunk where the gap was; no page load.
        assert page.eval_on_selector_all(rows, "els => els.map(e => e.id)") == spine
        assert clicks > 1 and page.evaluate("window.__samePage") is True
        assert page.locator(".tree .node.is-tip").count() == 1
        self.assert_clean()

    def test_the_outline_lists_a_few_branches_and_the_rest_on_demand(self) -> None:
        star = bulk_tree(self.user, [None] + [0] * 30, title="Star")
        page = self.page
        page.goto(self.url(f"/c/{star.pk}/tree/"))
        stubs = ".tree .alternatives > li.stub:not(.more)"
        assert page.locator(stubs).count() == ALTS_SHOWN
        page.click(".tree li.stub.more a:has-text('19 more branches')")
        page.wait_for_function(
            "n => document.querySelectorAll('.tree .alternatives > li.stub').length === n",
            arg=29,
        )
        assert page.locator(".tree li.stub.more").count() == 0
        # A listed branch opens in place as before.
        page.locator(stubs).last.locator("a").click()
        page.wait_for_selector(".tree .alternatives .branch .node")
        self.assert_clean()

    def test_without_javascript_a_gap_opens_in_the_page(self) -> None:
        conv, spine = self.long_branch()
        self.use(
            {"viewport": {"width": 1200, "height": 900}, "java_script_enabled": False}, "alice"
        )
        page = self.page
        page.goto(self.url(f"/c/{conv.pk}/tree/"))
        page.click(".tree li.gap a")
        page.wait_for_url(re.compile(rf"/tree/\?gap=[0-9a-f-]+&n=\d+#{spine[15]}$"))
        assert page.locator(f"#{spine[15]}").count() == 1
        assert page.locator(f"#{spine[15 + STRETCH_CHUNK // 2 - 1]}").count() == 1
        assert page.locator(f"#{spine[-1]}.is-tip").count() == 1
        assert self.outside == [], self.outside

    def test_on_a_phone_the_graph_scrolls_in_its_own_box(self) -> None:
        self.use(PHONE, "alice")
        page = self.page
        page.goto(self.url(f"/c/{self.conv.pk}/tree/"))
        self.assert_no_sideways_scroll(390)
        box = page.locator("#tree-graph .graph-box").bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= 390
        page.locator("svg.tg .gnode.stub a").first.tap()
        page.wait_for_selector(self.node("the quick brown fox"))
        self.assert_no_sideways_scroll(390)
        row = page.locator(f"{self.node('a detour')} .hit").bounding_box()
        assert row is not None and row["height"] >= 32  # a finger's height
        page.screenshot(path=str(SCREENSHOTS / "phone-tree-graph.png"), full_page=True)
        page.locator(f"{self.node('a detour')} a").tap()
        page.wait_for_selector(f"{self.node('a detour')}.is-tip")
        self.conv.refresh_from_db()
        assert self.conv.tip_id == self.nodes["a detour"].pk
        self.assert_no_sideways_scroll(390)
        self.assert_clean()

    def test_hostile_text_stays_text_in_the_graph(self) -> None:
        hostile = '</text></title><script>alert(1)</script>" onload="alert(1)'
        conv = services.conversation_create(owner=self.user, title="<svg onload=alert(1)>")
        services.turn_append(
            conversation=conv, parent_id=None, expected_version=0,
            messages=[{"role": "user", "parts": text(hostile)},
                      {"role": "assistant", "parts": text("<img src=x onerror=alert(1)>")}],
        )  # fmt: skip
        conv.refresh_from_db()
        services.checkpoint_create(conversation=conv, label="<img src=x onerror=alert(1)>")
        first = Message.objects.get(conversation=conv, depth=0)
        services.conversation_fork(message=first, owner=self.user, title='"><script>x</script>')
        page = self.page
        page.goto(self.url(f"/c/{conv.pk}/tree/"))
        page.wait_for_timeout(300)
        assert page.evaluate("window.__xss") == 0
        assert page.locator("svg.tg script, #tree-graph img").count() == 0
        assert (
            page.locator(f"#gn-{first.pk} > a[hx-post] > title").text_content()
            == f"user: {hostile}"
        )
        label = page.locator(f"#gn-{first.pk} text.label").text_content()
        assert label == hostile[: LABEL_CHARS - 1] + "…"
        assert Conversation.objects.filter(owner=self.user).count() == 4
        self.assert_clean()


class ReadableMarksTests(BrowserTestCase):
    """The graph explains its symbols, keeps longer labels, and the chat's fork badge and
    Edit box are usable: an icon any font shows, a box the message's width."""

    def test_legend_labels_fork_icon_and_a_wide_edit_box(self) -> None:
        user = make_user("alice")
        long_prompt = "Rename the quarterly loader and keep its old name as an alias"
        conv, nodes = new_conversation(user, f"{long_prompt}>Done and both names work", title="T")
        services.conversation_fork(message=nodes[long_prompt], owner=user, title="Side")
        self.sign_in("alice")
        page = self.page
        page.set_viewport_size({"width": 1280, "height": 800})
        page.goto(self.url(f"/c/{conv.pk}/tree/"))
        legend = page.inner_text(".tg-legend")
        for meaning in ("user", "assistant", "tool result", "the tip", "checkpoint", "forked"):
            assert meaning in legend, legend
        # Each entry draws its symbol with the graph's own classes.
        fork_mark = page.locator(f"#gn-{nodes[long_prompt].pk} path.mark.fork")
        legend_fork = page.locator(".tg-legend path.mark.fork")
        assert fork_mark.get_attribute("d") and legend_fork.count() == 1
        stroke = "el => getComputedStyle(el).stroke"
        assert fork_mark.evaluate(stroke) == legend_fork.evaluate(stroke)
        # A 56-character label is drawn whole.
        label = page.locator(f"#gn-{nodes[long_prompt].pk} text.label").text_content() or ""
        assert label.startswith("Rename the quarterly loader and keep its old name as"), label
        self.shot("tree-legend")

        page.goto(self.url(f"/c/{conv.pk}/"))
        badge = page.locator("a.badge.fork").first
        box = badge.locator("svg.icon").bounding_box()
        assert box is not None and box["width"] >= 8 and box["height"] >= 8
        assert "⑂" not in badge.inner_text() and "Side" in badge.inner_text()
        message = page.locator(f"#msg-{nodes[long_prompt].pk}")
        message.locator("details.edit > summary").click()
        area = message.locator("details.edit textarea").bounding_box()
        card = message.bounding_box()
        assert area is not None and card is not None
        assert area["width"] >= 0.8 * card["width"], (area["width"], card["width"])
        page.screenshot(path=str(SCREENSHOTS / "chat-edit-open.png"), full_page=True)
        self.assert_clean()
