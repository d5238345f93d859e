"""The tree map's outline (conversations/treemap.py and the tree view): a long branch keeps
its first rows and the stretch around the tip, the rest folded into gaps that open a chunk
at a time (an HTMX fragment, or without JavaScript the page with that stretch open); a
message lists a few of its branches and the rest on demand. The bounds at 10,000 messages
are tested with the graph's, in tests/test_tree_graph.py (BigTreeTests)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence

from django.test import TestCase

from conversations import selectors
from conversations.models import Conversation, Message
from conversations.treemap import (
    ALTS_CHUNK,
    ALTS_SHOWN,
    OUTLINE_MAX,
    STRETCH_CHUNK,
    Gap,
    OutlineItem,
    Row,
    TreeMap,
    outline_cost,
)
from tests.builders import bulk_tree, comb, make_user, new_conversation

HX = {"HX-Request": "true"}


def tree_of(conv: Conversation) -> TreeMap:
    conv.refresh_from_db()
    return TreeMap(selectors.tree_skeleton(conversation=conv), conv.tip_id, set())


def created(conv: Conversation) -> list[uuid.UUID]:
    """The ids of the messages in the order ``bulk_tree`` wrote them."""
    rows = Message.objects.filter(conversation=conv).order_by("created_at")
    return list(rows.values_list("id", flat=True))


def row_ids(items: Sequence[OutlineItem]) -> list[uuid.UUID]:
    return [it.node.id for it in items if isinstance(it, Row)]


def outline_of(body: str) -> str:
    return body[body.index('<div class="tree" id="tree">') :]


def node_ids(html: str) -> list[str]:
    return re.findall(r'<li id="node-([0-9a-f-]+)" class="node ', html)


def outline_rows(html: str) -> int:
    """The rows an outline shows: messages, branch stubs, quiet runs and gaps."""
    return len(re.findall(r'<li (?:id="[^"]*" )?class="(?:node|stub|run|gap)[ "]', html))


def link(html: str, cls: str) -> tuple[str, str]:
    """The href and hx-get of the (last) ``li.<cls>`` link."""
    found = re.findall(
        rf'<li class="{cls}"><a class="expand" href="([^"]+)" hx-get="([^"]+)"', html
    )
    assert found, cls
    href, get = found[-1]
    return href.replace("&amp;", "&"), get.replace("&amp;", "&")


class OutlineLayoutTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user("alice")
        # A path of 40 messages, the tip at its end, and a one-message branch beside each
        # of the first 39: 79 rows wanted.
        cls.comb = bulk_tree(cls.user, comb(79), title="comb")
        ids = created(cls.comb)
        cls.spine, cls.sides = ids[0::2], ids[1::2]

    def test_a_branch_that_fits_is_shown_whole(self) -> None:
        conv, _ = new_conversation(self.user, "a>b>c>d, b>e")
        tree = tree_of(conv)
        main, _ = tree.roots()
        assert main is not None
        assert tree.outline(main) == tree.branch(main)

    def test_a_long_branch_keeps_its_start_and_the_tip_and_counts_what_it_left_out(
        self,
    ) -> None:
        tree = tree_of(self.comb)
        items = tree.outline(self.spine[0], limit=40)
        assert sum(outline_cost(it) for it in items) <= 40
        # The first 15 messages (two rows each with their branch), a gap, the tip's stretch.
        assert [type(it).__name__ for it in items] == ["Row"] * 15 + ["Gap"] + ["Row"] * 4
        assert row_ids(items) == self.spine[:15] + self.spine[-4:]
        gap = items[15]
        assert isinstance(gap, Gap)
        assert (gap.first, gap.messages, gap.branches) == (self.spine[15], 21, 21)
        assert row_ids(items)[-1] == self.comb.tip_id

    def test_a_gap_opens_a_chunk_at_a_time_until_all_of_it_is_shown(self) -> None:
        tree = tree_of(self.comb)
        first = tree.outline(self.spine[0], limit=40)[15]
        assert isinstance(first, Gap)
        gap: Gap | None = first
        shown: list[uuid.UUID] = []
        chunks = 0
        while gap is not None:
            chunk = tree.stretch(gap.first, gap.messages, chunk=10)
            chunks += 1
            rows = [it for it in chunk if isinstance(it, Row)]
            assert sum(outline_cost(it) for it in rows) <= 10  # five messages and branches
            shown += row_ids(rows)
            rest = chunk[-1]
            if isinstance(rest, Gap):
                assert chunk[:-1] == rows and rest.messages == gap.messages - len(rows)
                gap = rest
            else:
                assert chunk == rows
                gap = None
        assert shown == self.spine[15:36] and chunks == 5

    def test_a_stretch_asked_for_is_shown_open_and_the_tip_still_is(self) -> None:
        tree = tree_of(self.comb)
        items = tree.outline(self.spine[0], opened=(self.spine[15], 21), limit=40)
        assert row_ids(items) == self.spine[:36] + self.spine[-1:]
        gap = items[-2]
        assert isinstance(gap, Gap) and (gap.first, gap.messages) == (self.spine[36], 3)
        # From the middle of the stretch, the rest of it; and only on this branch.
        middle = tree.outline(self.spine[0], opened=(self.spine[20], 16), limit=40)
        assert row_ids(middle) == self.spine[:15] + self.spine[20:36] + self.spine[-1:]
        plain = tree.outline(self.spine[0], limit=40)
        assert tree.outline(self.spine[0], opened=(self.sides[20], 5), limit=40) == plain

    def test_a_branch_off_the_path_keeps_its_start_and_folds_the_rest(self) -> None:
        conv = bulk_tree(self.user, comb(79), title="elsewhere", tip=1)
        spine = created(conv)[0::2]
        tree = tree_of(conv)
        # The tip is on the first side branch, so the long line below the root is a stub.
        assert [s.id for s in tree.alternatives(spine[0])] == [spine[1]]
        assert tree.line_start(spine[30]) == spine[1] and tree.line_start(spine[0]) == spine[0]
        items = tree.outline(spine[1], limit=40)
        assert row_ids(items) == spine[1 : 1 + len(row_ids(items))]
        assert isinstance(items[-1], Gap) and items[-1].messages == 39 - len(row_ids(items))
        assert sum(outline_cost(it) for it in items) <= 40


class OutlinePageTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.alice = make_user("alice")
        cls.bob = make_user("bob")
        # 500 messages along the path, a branch beside each but the tip: 999 rows wanted.
        cls.conv = bulk_tree(cls.alice, comb(999), title="comb")
        cls.spine = created(cls.conv)[0::2]
        cls.tip_row = rf'<li id="node-{cls.conv.tip_id}" class="node \w+ on-path is-tip">'

    def setUp(self) -> None:
        self.client.force_login(self.alice)

    def url(self, conv: Conversation, suffix: str = "") -> str:
        return f"/c/{conv.pk}/tree/{suffix}"

    def page(self, suffix: str = "") -> str:
        with self.assertNumQueries(8):  # as many as for any tree: see test_tree_graph.py
            response = self.client.get(self.url(self.conv, suffix))
        assert response.status_code == 200
        return outline_of(response.content.decode())

    def test_the_outline_shows_its_start_and_the_tip_and_a_gap_between(self) -> None:
        outline = self.page()
        assert outline_rows(outline) <= OUTLINE_MAX and re.search(self.tip_row, outline)
        shown = node_ids(outline)
        assert shown == [str(m) for m in self.spine[:15] + self.spine[15 - len(shown) :]]
        left_out = len(self.spine) - len(shown)
        assert f"⋯ {left_out} messages ({left_out} branches) — show" in outline
        href, get = link(outline, "gap")
        first = self.spine[15]
        assert get == self.url(self.conv, f"?gap={first}&n={left_out}")
        assert href == f"{get}#node-{first}"

    def test_a_gap_opens_in_place_a_chunk_at_a_time(self) -> None:
        page = node_ids(self.page())
        _, get = link(self.page(), "gap")
        left_out = len(self.spine) - len(page)
        opened: list[str] = []
        while get:
            with self.assertNumQueries(8):
                response = self.client.get(get, headers=HX)
            assert "HX-Request" in response["Vary"]
            html = response.content.decode()
            assert "<h1>" not in html
            first = self.spine[15 + len(opened)]
            assert html.lstrip().startswith(f'<li id="node-{first}" class="node ')
            rows = node_ids(html)
            assert len(rows) <= STRETCH_CHUNK // 2  # each with its branch
            opened += rows
            rest = left_out - len(opened)
            if rest:
                assert f"⋯ {rest} messages ({rest} branches) — show" in html
            get = link(html, "gap")[1] if rest else ""
        # Every message of the path once, in order, each chunk where the gap was.
        assert page[:15] + opened + page[15:] == [str(m) for m in self.spine]

    def test_without_javascript_a_gap_is_the_page_with_that_stretch_open(self) -> None:
        outline = self.page()
        left_out = len(self.spine) - len(node_ids(outline))
        href, _ = link(outline, "gap")
        opened = self.page(href.removeprefix(self.url(self.conv)))
        assert outline_rows(opened) <= OUTLINE_MAX and re.search(self.tip_row, opened)
        # The first rows, a chunk of the stretch, then the rest of it (the stretch around
        # the tip is shorter, to make room): one gap, a link to this page again.
        chunk = STRETCH_CHUNK // 2
        shown = node_ids(opened)
        assert shown[: 15 + chunk] == [str(m) for m in self.spine[: 15 + chunk]]
        assert shown[-1] == str(self.conv.tip_id)
        assert opened.count('<li class="gap">') == 1
        rest = len(self.spine) - len(shown)
        assert rest > left_out - chunk
        gap = self.spine[15 + chunk]
        assert link(opened, "gap")[0] == self.url(self.conv, f"?gap={gap}&n={rest}#node-{gap}")

    def test_a_message_lists_a_few_branches_and_the_rest_on_demand(self) -> None:
        star = bulk_tree(self.alice, [None] + [0] * 249, title="star")
        ids = created(star)
        body = self.client.get(self.url(star)).content.decode()
        outline = outline_of(body)
        assert outline.count("▸ another branch · 1 message") == ALTS_SHOWN
        assert "▸ 238 more branches · 238 messages" in outline
        href, get = link(outline, "stub more")
        hidden = ids[1 + ALTS_SHOWN]
        assert href == f"/c/{star.pk}/?m={hidden}#msg-{hidden}"  # the chat view, without JS
        assert get == self.url(star, f"?alts={ids[0]}&skip={ALTS_SHOWN}")
        listed = re.findall(r"\?from=([0-9a-f-]+)", outline)
        pages = 0
        while get:
            with self.assertNumQueries(7):  # no previews: a stub shows a count
                html = self.client.get(get, headers=HX).content.decode()
            pages += 1
            found = re.findall(r"\?from=([0-9a-f-]+)", html)
            assert len(found) <= ALTS_CHUNK
            listed += found
            get = link(html, "stub more")[1] if 'class="stub more"' in html else ""
        # Every branch but the followed one (the tip), once each, in order.
        assert listed == [str(m) for m in ids[1:-1]] and pages == 3

    def test_other_roots_are_listed_a_few_at_a_time_too(self) -> None:
        roots = bulk_tree(self.alice, [None] * 30, title="roots")
        ids = created(roots)
        outline = outline_of(self.client.get(self.url(roots)).content.decode())
        assert outline.count("▸ another root · 1 message") == ALTS_SHOWN
        assert "▸ 19 more roots · 19 messages" in outline
        _, get = link(outline, "stub more")
        assert get == self.url(roots, f"?alts=roots&skip={ALTS_SHOWN}")
        html = self.client.get(get, headers=HX).content.decode()
        assert html.count("▸ another root · 1 message") == 19 and "more roots" not in html
        assert re.findall(r"\?from=([0-9a-f-]+)", html) == [str(m) for m in ids[10:-1]]

    def test_bad_or_foreign_ids_are_404_and_a_stale_stretch_is_ignored(self) -> None:
        _, nodes = new_conversation(self.alice, "q>a", title="other")
        foreign = nodes["q"].pk
        for query in (f"?gap={foreign}&n=3", "?gap=not-a-uuid", f"?gap={self.spine[3]}&n=x",
                      f"?alts={foreign}", "?alts=nope", f"?alts={self.spine[3]}&skip=x",
                      f"?run={foreign}&n=3"):  # fmt: skip
            assert self.client.get(self.url(self.conv, query), headers=HX).status_code == 404
        assert self.client.get(self.url(self.conv, "?gap=not-a-uuid")).status_code == 404
        # The page with a stretch that is not on its branch (any more) is the plain page.
        plain = node_ids(self.client.get(self.url(self.conv)).content.decode())
        page = self.client.get(self.url(self.conv, f"?gap={foreign}&n=3")).content.decode()
        assert node_ids(page) == plain

    def test_a_stranger_gets_404_and_anonymous_the_sign_in(self) -> None:
        queries = [f"?gap={self.spine[15]}&n=20", f"?alts={self.spine[3]}&skip=0"]
        self.client.force_login(self.bob)
        for query in queries:
            assert self.client.get(self.url(self.conv, query)).status_code == 404
            assert self.client.get(self.url(self.conv, query), headers=HX).status_code == 404
        self.client.logout()
        for query in queries:
            response = self.client.get(self.url(self.conv, query), headers=HX)
            # The page goes to sign in (arbor.middleware.htmx_sign_in), not the fragment.
            assert response.status_code == 200
            assert response["HX-Redirect"].startswith("/login/")
