"""The tree map drawn as a graph (conversations/treegraph.py and the tree view): the
layout of small hand-built trees (rows, lanes, edges), the current path and the tip, fold
labels, stubs opened through ``?open=``, marks, the tip moved from the graph, escaping,
permissions, and the bounds that hold at 10,000 messages: rows drawn, SVG bytes, queries,
and those of the whole page with its outline (tests/test_tree_outline.py has the rest of
the outline's)."""

from __future__ import annotations

import re
import uuid
from typing import Any

from django.db import connection
from django.test import TestCase
from django.test.utils import CaptureQueriesContext

from conversations import selectors, services
from conversations.models import (
    Checkpoint,
    CheckpointSource,
    CheckpointState,
    Conversation,
    Message,
)
from conversations.treegraph import MAX_ALTS, MAX_NODES, MIN_OPEN, Graph, graph_layout
from conversations.treemap import OUTLINE_MAX, STRETCH_CHUNK, TreeMap
from tests.builders import (
    build_tree,
    bulk_tree,
    bushy,
    comb,
    make_user,
    new_conversation,
    text,
)
from tests.test_tree_outline import node_ids, outline_of, outline_rows

HX = {"HX-Request": "true"}


def layout(conv: Conversation, opened: list[uuid.UUID] | None = None, **kw: Any) -> Graph:
    conv.refresh_from_db()
    tree = TreeMap(selectors.tree_skeleton(conversation=conv), conv.tip_id, set())
    return graph_layout(tree, opened or [], **kw)


def rows(graph: Graph, names: dict[uuid.UUID, str]) -> list[tuple[str, str, int]]:
    """(kind, name, lane) per row, top to bottom."""
    return [(n.kind, names.get(n.id, "?"), n.lane) for n in graph.nodes]


def svg_of(body: str) -> str:
    """The graph's drawing: the first tree-graph SVG of the page (the header has a logo)."""
    start = body.index('<svg class="tg"')
    return body[start : body.index("</svg>", start) + len("</svg>")]


class LayoutTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user("alice")
        # a─b─c─h (the path, h the tip), with a→g, b→e→f and c→d off it.
        cls.conv, cls.nodes = new_conversation(cls.user, "a>b>c>d, b>e>f, a>g, c>h", title="t")
        cls.names = {m.pk: name for name, m in cls.nodes.items()}

    def test_it_draws_the_path_in_lane_0_and_other_branches_as_stubs(self) -> None:
        graph = layout(self.conv)
        assert rows(graph, self.names) == [
            ("message", "a", 0), ("stub", "g", 1),
            ("message", "b", 0), ("stub", "e", 1),
            ("message", "c", 0), ("stub", "d", 1),
            ("message", "h", 0),
        ]  # fmt: skip
        by_name = {self.names[n.id]: n for n in graph.nodes}
        assert [n for n in graph.nodes if n.on_path] == [by_name[x] for x in "abch"]
        assert [n for n in graph.nodes if n.is_tip] == [by_name["h"]]
        assert by_name["e"].count == 2 and by_name["g"].count == 1  # messages behind a stub
        assert graph.lanes == 2
        # One edge along the path per step, one fork edge per stub; only the path's green.
        assert [(e.kind, e.on_path, e.fold) for e in graph.edges] == [
            ("fork", False, True), ("line", True, False),
            ("fork", False, True), ("line", True, False),
            ("fork", False, True), ("line", True, False),
        ]  # fmt: skip
        a, b = by_name["a"], by_name["b"]
        assert graph.edges[1].d == f"M{a.x} {a.y}V{b.y}"
        assert graph.edges[0].d.startswith(f"M{a.x} {a.y}C")  # a curve into lane 1

    def test_it_opens_a_stub_in_its_own_lane_and_reuses_lanes_below(self) -> None:
        graph = layout(self.conv, [self.nodes["e"].pk])
        assert rows(graph, self.names) == [
            ("message", "a", 0), ("stub", "g", 1),
            ("message", "b", 0), ("message", "e", 1), ("message", "f", 1),
            ("message", "c", 0), ("stub", "d", 1),
            ("message", "h", 0),
        ]  # fmt: skip
        assert graph.opened == [self.nodes["e"].pk]
        assert not any(n.on_path for n in graph.nodes if self.names[n.id] in "ef")

    def test_siblings_take_one_lane_each(self) -> None:
        conv, nodes = new_conversation(self.user, "r>x, r>y, r>z")
        names = {m.pk: k for k, m in nodes.items()}
        assert rows(layout(conv), names) == [
            ("message", "r", 0),
            ("stub", "x", 1),
            ("stub", "y", 2),
            ("message", "z", 0),
        ]
        # Opened, x's branch holds lane 1 down to its end and y still needs lane 2.
        assert rows(layout(conv, [nodes["x"].pk, nodes["y"].pk]), names) == [
            ("message", "r", 0),
            ("message", "x", 1),
            ("message", "y", 2),
            ("message", "z", 0),
        ]

    def test_a_tip_moved_up_the_path_keeps_the_newer_messages_below_it_unhighlighted(
        self,
    ) -> None:
        conv, _ = new_conversation(self.user, "p>q>r>s", tip="q")
        graph = layout(conv)
        assert [(n.on_path, n.is_tip) for n in graph.nodes] == [
            (True, False), (True, True), (False, False), (False, False)
        ]  # fmt: skip
        assert [e.on_path for e in graph.edges] == [True, False, False]

    def test_quiet_stretches_fold_into_one_labelled_edge_that_opens(self) -> None:
        conv = services.conversation_create(owner=self.user, title="long")
        services.turn_append(
            conversation=conv, parent_id=None, expected_version=0,
            messages=[{"role": "user" if i % 2 == 0 else "assistant", "parts": text(f"m{i}")}
                      for i in range(200)],
        )  # fmt: skip
        graph = layout(conv)
        assert [n.kind for n in graph.nodes] == ["message", "message", "run", "message", "message"]
        run = graph.nodes[2]
        assert run.count == 196
        assert [e.fold for e in graph.edges] == [False, True, True, False]
        # Opened, the stretch draws a chunk of messages and folds the rest again.
        opened = layout(conv, [run.id])
        kinds = [n.kind for n in opened.nodes]
        assert kinds.count("run") == 1 and kinds.count("message") == 4 + 60
        rest = next(n for n in opened.nodes if n.kind == "run")
        assert rest.count == 196 - 60
        again = layout(conv, [run.id, rest.id])
        assert [n.kind for n in again.nodes].count("message") == 4 + 120

    def test_a_message_draws_a_few_branches_and_counts_the_rest(self) -> None:
        spec = ", ".join(f"r>k{i}" for i in range(10))
        conv, nodes = new_conversation(self.user, spec)
        graph = layout(conv, [nodes["k8"].pk])
        kinds = [n.kind for n in graph.nodes]
        assert kinds.count("stub") + kinds.count("message") - 2 == MAX_ALTS  # r and k9 aside
        more = next(n for n in graph.nodes if n.kind == "more")
        assert more.count == 9 - MAX_ALTS and more.extra == 9 - MAX_ALTS
        assert any(n.id == nodes["k8"].pk and n.kind == "message" for n in graph.nodes)

    def test_a_branch_too_long_keeps_its_start_and_the_tip_and_says_what_it_left_out(
        self,
    ) -> None:
        # A path of 40 messages, 39 of them with a one-message branch: 79 rows wanted.
        conv = bulk_tree(self.user, comb(79), title="comb")
        graph = layout(conv, limit=30)
        assert len(graph.nodes) <= 30
        kinds = [n.kind for n in graph.nodes]
        assert kinds[0] == "message" and kinds[1] == "stub" and kinds[2] == "gap"
        gap = graph.nodes[2]
        assert gap.on_path and gap.count + kinds.count("message") == 40
        assert gap.extra + kinds.count("stub") == 39  # every branch drawn or counted
        assert graph.nodes[-1].is_tip and graph.nodes[-1].on_path

    def test_what_does_not_fit_is_not_opened_and_is_counted(self) -> None:
        spec = ", ".join(f"r>b{i}>" + ">".join(f"b{i}x{j}" for j in range(8)) for i in range(5))
        conv, nodes = new_conversation(self.user, spec, tip="r")
        wanted = [nodes[f"b{i}"].pk for i in range(5)]
        graph = layout(conv, wanted, limit=MIN_OPEN + 8)
        assert len(graph.nodes) <= MIN_OPEN + 8
        assert graph.skipped == 3
        assert graph.opened == wanted[:1]  # what was opened; the rest did not fit

    def test_other_roots_are_stubs_below_the_main_tree(self) -> None:
        conv, nodes = new_conversation(self.user, "one>two")
        nodes = build_tree(conv, "solo>after", nodes=nodes, tip="two")
        names = {m.pk: k for k, m in nodes.items()}
        graph = layout(conv)
        assert rows(graph, names) == [
            ("message", "one", 0), ("message", "two", 0), ("stub", "solo", 0)
        ]  # fmt: skip
        assert len(graph.edges) == 1  # a root has no edge into it


class PageTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.alice = make_user("alice")
        cls.bob = make_user("bob")
        cls.conv, cls.nodes = new_conversation(
            cls.alice, "hello>hi there>more, hi there>other>deeper", title="plans"
        )
        # The tip is `deeper`; `more` is the other branch.

    def setUp(self) -> None:
        self.client.force_login(self.alice)
        self.conv.refresh_from_db()

    def url(self, suffix: str = "") -> str:
        return f"/c/{self.conv.pk}/tree/{suffix}"

    def test_the_page_draws_the_graph_above_the_outline(self) -> None:
        body = self.client.get(self.url()).content.decode()
        assert body.index('<svg class="tg"') < body.index('<div class="tree" id="tree">')
        svg = svg_of(body)
        for name in ("hello", "hi there", "other", "deeper"):
            assert f'id="gn-{self.nodes[name].pk}" class="gnode' in svg, name
        assert svg.count('class="gnode') == 5  # four messages and a stub for `more`
        assert re.search(
            rf'id="gn-{self.nodes["deeper"].pk}" class="gnode \w+ on-path is-tip"', svg
        )
        assert svg.count("edge line on-path") == 3
        assert "+1 · another branch" in svg
        # Each message links to the chat view of its branch and posts to the tip endpoint.
        other = self.nodes["other"].pk
        assert f'href="/c/{self.conv.pk}/?m={other}#msg-{other}"' in svg
        assert f'hx-post="/c/{self.conv.pk}/tip/"' in svg
        assert f'hx-vals=\'{{"message": "{other}"}}\'' in svg
        assert 'style="' not in svg and "style=" not in body.replace('rel="stylesheet"', "")

    def test_open_is_a_plain_link_and_an_htmx_fragment(self) -> None:
        more = self.nodes["more"].pk
        body = self.client.get(self.url()).content.decode()
        assert f'href="{self.url()}?open={more}#tree-graph"' in body
        assert f'hx-get="{self.url()}?open={more}"' in body
        # Without JavaScript: the whole page, the branch drawn.
        page = self.client.get(self.url(f"?open={more}")).content.decode()
        assert f'id="gn-{more}"' in page and "<h1>" in page
        assert "Collapse all branches" in page
        # With htmx: only the graph, which keeps the state in its links and tip posts.
        fragment = self.client.get(self.url(f"?open={more}"), headers=HX)
        html = fragment.content.decode()
        assert html.lstrip().startswith('<section id="tree-graph"') and "<h1>" not in html
        assert f'id="gn-{more}"' in html and "HX-Request" in fragment["Vary"]
        assert f"&quot;open&quot;: [&quot;{more}&quot;]" in html
        # A malformed or foreign id changes nothing.
        for junk in ("not-a-uuid", str(uuid.uuid4())):
            assert self.client.get(self.url(f"?open={junk}"), headers=HX).status_code == 200

    def test_the_outline_fragments_are_unchanged(self) -> None:
        fragment = self.client.get(self.url(f"?from={self.nodes['more'].pk}"), headers=HX)
        assert fragment.content.decode().lstrip().startswith('<ol class="branch">')

    def test_a_click_in_the_graph_moves_the_tip_and_redraws_graph_and_outline(self) -> None:
        more = self.nodes["more"].pk
        response = self.client.post(
            f"/c/{self.conv.pk}/tip/",
            {"message": str(more), "version": self.conv.version, "open": [str(more)]},
            headers=HX,
        )
        assert response.status_code == 200 and "HX-Request" in response["Vary"]
        html = response.content.decode()
        assert html.lstrip().startswith('<div id="tree-view">') and "<h1>" not in html
        self.conv.refresh_from_db()
        assert self.conv.tip_id == more
        svg = svg_of(html)
        assert re.search(rf'id="gn-{more}" class="gnode \w+ on-path is-tip"', svg)
        assert not re.search(rf'id="gn-{self.nodes["deeper"].pk}" class="[^"]*on-path', svg)
        assert f'id="node-{more}" class="node user on-path is-tip"' in html  # the outline
        assert f"&quot;version&quot;: &quot;{self.conv.version}&quot;" in html

    def test_a_stale_click_moves_nothing_and_says_so(self) -> None:
        response = self.client.post(
            f"/c/{self.conv.pk}/tip/",
            {"message": str(self.nodes["more"].pk), "version": self.conv.version - 1},
            headers=HX,
        )
        assert "changed meanwhile" in response.content.decode()
        tip = self.conv.tip_id
        self.conv.refresh_from_db()
        assert self.conv.tip_id == tip

    def test_without_htmx_the_tip_endpoint_still_redirects_to_the_chat(self) -> None:
        response = self.client.post(
            f"/c/{self.conv.pk}/tip/",
            {"message": str(self.nodes["more"].pk), "version": self.conv.version},
        )
        assert response.status_code == 302
        assert response["Location"] == f"/c/{self.conv.pk}/#msg-{self.nodes['more'].pk}"

    def test_checkpoints_forks_and_rewinds_are_marked_like_the_outline(self) -> None:
        conv = services.conversation_create(owner=self.alice, title="marks")
        services.turn_append(
            conversation=conv, parent_id=None, expected_version=0,
            messages=[{"role": "user", "parts": text("task")},
                      {"role": "assistant", "parts": text("ok")}],
        )  # fmt: skip
        conv.refresh_from_db()
        base = services.checkpoint_create(conversation=conv, label="base", source="model")
        Checkpoint.objects.create(
            conversation=conv, label="old", message_id=base.message_id,
            state=CheckpointState.DROPPED, reason="superseded", source=CheckpointSource.USER,
        )  # fmt: skip
        fork = services.conversation_fork(
            message=Message.objects.get(pk=base.message_id), owner=self.alice, title="Side"
        )
        services.turn_append(
            conversation=conv, parent_id=conv.tip_id, expected_version=None,
            messages=[{"role": "user", "parts": text("explore")}],
        )  # fmt: skip
        conv.refresh_from_db()
        explored = conv.tip_id
        result = services.checkpoint_rewind(conversation=conv, label="base", digest="nothing there")
        svg = svg_of(self.client.get(f"/c/{conv.pk}/tree/").content.decode())
        marked = svg[svg.index(f'id="gn-{base.message_id}"') :]
        marked = marked[: marked.index("</g>")]
        assert '<path class="mark checkpoint"' in marked  # one live among them: not struck
        assert "⚑ base (model); ⚑ old · dropped: superseded" in marked
        assert f'<a class="mark-link" href="/c/{fork.pk}/">' in marked and "Fork: Side" in marked
        digest = svg[svg.index(f'id="gn-{result.digest_message}"') :]
        digest = digest[: digest.index("</g>")]
        assert "↶ rewind to ⚑ base" in digest
        assert f'href="/c/{conv.pk}/?m={explored}#msg-{explored}"' in digest

    def test_text_is_escaped_in_titles_and_labels(self) -> None:
        hostile = '</text></title><script>alert(1)</script>" onload="alert(1)'
        conv, _ = new_conversation(self.alice, "", title="xss")
        services.turn_append(
            conversation=conv, parent_id=None, expected_version=0,
            messages=[{"role": "user", "parts": text(hostile)}],
        )  # fmt: skip
        body = self.client.get(f"/c/{conv.pk}/tree/").content.decode()
        svg = svg_of(body)
        assert "<script>" not in body and "</title><script>" not in svg
        assert '" onload="' not in svg and "onload=" not in svg.replace("&quot; onload=", "")
        assert "&lt;/text&gt;&lt;/title&gt;&lt;script&gt;" in svg and "&quot; onload=&quot;" in svg

    def test_a_stranger_gets_404_and_anonymous_the_sign_in(self) -> None:
        more = self.nodes["more"].pk
        self.client.force_login(self.bob)
        assert self.client.get(self.url(f"?open={more}")).status_code == 404
        assert self.client.get(self.url(f"?open={more}"), headers=HX).status_code == 404
        response = self.client.post(
            f"/c/{self.conv.pk}/tip/",
            {"message": str(more), "version": self.conv.version},
            headers=HX,
        )
        assert response.status_code == 404
        # Nor does one of bob's own conversations draw alice's messages when asked.
        own, _ = new_conversation(self.bob, "mine")
        html = self.client.get(f"/c/{own.pk}/tree/?open={more}", headers=HX).content.decode()
        assert str(more) not in html
        self.client.logout()
        response = self.client.get(self.url(f"?open={more}"), headers=HX)
        # The page goes to sign in (arbor.middleware.htmx_sign_in), not the fragment.
        assert response.status_code == 200 and response["HX-Redirect"].startswith("/login/")
        self.conv.refresh_from_db()
        assert self.conv.tip_id == self.nodes["deeper"].pk


class BigTreeTests(TestCase):
    """10,000 messages as one chain, as a comb (a fork at every step of a 5,000 deep path)
    and as a bushy random tree: the graph stays small and costs the same queries as a
    tree of a few messages."""

    SIZE = 10_000
    MAX_SVG_BYTES = 220_000
    MAX_PAGE_BYTES = 400_000  # the graph, the outline and the rest of the page

    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user("big")
        cls.small, _ = new_conversation(cls.user, "a>b>c, b>d", title="small")
        cls.big = {
            "chain": bulk_tree(cls.user, [None, *range(cls.SIZE - 1)], title="chain"),
            "comb": bulk_tree(cls.user, comb(cls.SIZE), title="comb"),
            "bushy": bulk_tree(cls.user, bushy(cls.SIZE), title="bushy"),
        }

    def setUp(self) -> None:
        self.client.force_login(self.user)

    def measure(self, method: str, url: str, **kwargs: Any) -> tuple[int, str]:
        """Queries and body of one request (cost is asserted by queries and bytes, never
        by wall-clock time on a shared machine)."""
        with CaptureQueriesContext(connection) as ctx:
            response = getattr(self.client, method)(url, **kwargs)
        assert response.status_code == 200, (url, response.status_code)
        return len(ctx.captured_queries), response.content.decode()

    def test_the_graph_stays_small_and_its_queries_do_not_grow(self) -> None:
        small_page, _ = self.measure("get", f"/c/{self.small.pk}/tree/")
        small_graph, _ = self.measure("get", f"/c/{self.small.pk}/tree/", headers=HX)
        # The session, the user, the conversation, checkpoints, forks, rewinds, the
        # skeleton and one preview query for graph and outline together.
        assert small_page == small_graph == 8
        for shape, conv in self.big.items():
            assert Message.objects.filter(conversation=conv).count() == self.SIZE
            queries, html = self.measure("get", f"/c/{conv.pk}/tree/", headers=HX)
            assert queries == small_graph, shape
            svg = svg_of(html)
            drawn = svg.count('class="gnode')
            assert 3 <= drawn <= MAX_NODES, (shape, drawn)
            assert len(svg.encode()) < self.MAX_SVG_BYTES, (shape, len(svg.encode()))
            assert "is-tip" in svg, shape

    def test_opening_everything_in_sight_stays_within_the_bound(self) -> None:
        conv = self.big["bushy"]
        url = f"/c/{conv.pk}/tree/"
        opened: list[str] = []
        for _ in range(4):  # open every stub drawn, four times over
            html = self.client.get(url, {"open": opened}, headers=HX).content.decode()
            opened += re.findall(r'class="gnode stub"><a href="[^"?]*\?(?:open=[0-9a-f-]+&amp;)*'
                                 r'open=([0-9a-f-]+)#', html)  # fmt: skip
            opened = list(dict.fromkeys(opened))[:20]
        queries, html = self.measure("get", url + "?" + "&".join(f"open={o}" for o in opened),
                                        headers=HX)  # fmt: skip
        assert queries == 8
        svg = svg_of(html)
        assert svg.count('class="gnode') <= MAX_NODES
        assert len(svg.encode()) < self.MAX_SVG_BYTES + 60_000  # the links carry the state

    def test_the_full_page_and_a_tip_move_cost_the_same_as_for_a_small_tree(self) -> None:
        small_page, _ = self.measure("get", f"/c/{self.small.pk}/tree/")
        assert small_page == 8
        for shape, conv in self.big.items():
            queries, body = self.measure("get", f"/c/{conv.pk}/tree/")
            assert queries == small_page, shape
            assert len(body.encode()) < self.MAX_PAGE_BYTES, (shape, len(body.encode()))
            assert "10000 messages" in body, shape
            outline = outline_of(body)
            assert outline_rows(outline) <= OUTLINE_MAX, shape
            assert re.search(tip_row(conv.tip_id), outline), shape

        def move(conv: Conversation, depth: int) -> int:
            conv.refresh_from_db()
            target = Message.objects.filter(conversation=conv, depth=depth).order_by("id")[0]
            data = {"message": str(target.pk), "version": conv.version}
            count, html = self.measure("post", f"/c/{conv.pk}/tip/", data=data, headers=HX)
            conv.refresh_from_db()
            assert conv.tip_id == target.pk and "is-tip" in svg_of(html)
            assert re.search(tip_row(target.pk), outline_of(html))  # the outline's too
            assert outline_rows(outline_of(html)) <= OUTLINE_MAX
            return count

        # The tip move (a guarded UPDATE and its check) and the redrawn page.
        chain, comb_ = self.big["chain"], self.big["comb"]
        assert move(self.small, 1) == move(chain, 5_000) == move(comb_, 1_234)

    def test_the_middle_of_a_long_branch_opens_a_chunk_at_a_time(self) -> None:
        conv = self.big["comb"]
        path = [
            str(m.id) for m in selectors.message_path(conversation_id=conv.pk, tip_id=conv.tip_id)
        ]
        _, body = self.measure("get", f"/c/{conv.pk}/tree/")
        page = node_ids(outline_of(body))
        # The first rows and the stretch up to the tip; one gap for the 4,800 or so between.
        assert page[:15] == path[:15] and page[15:] == path[15 - len(page) :]
        gaps = re.findall(r'<li class="gap">.*?hx-get="([^"]+)"', body)
        assert len(gaps) == 1
        # Its first chunks (tests/test_tree_outline.py opens every chunk of a smaller tree).
        url, opened = gaps[0].replace("&amp;", "&"), 15
        for _ in range(2):
            queries, html = self.measure("get", url, headers=HX)
            assert queries == 8
            assert len(html.encode()) < self.MAX_PAGE_BYTES // 2
            rows = node_ids(html)
            assert rows == path[opened : opened + STRETCH_CHUNK // 2]  # each with its branch
            opened += len(rows)
            rest = len(path) - len(page) - (opened - 15)
            assert f"⋯ {rest} messages ({rest} branches) — show" in html
            url = re.findall(r'<li class="gap">.*?hx-get="([^"]+)"', html)[0].replace("&amp;", "&")

    def test_without_javascript_the_gap_opens_in_the_page_within_the_bound(self) -> None:
        conv = self.big["comb"]
        _, body = self.measure("get", f"/c/{conv.pk}/tree/")
        href = re.findall(r'<li class="gap"><a class="expand" href="([^"]+)"', body)[0]
        queries, page = self.measure("get", href.replace("&amp;", "&"))
        assert queries == 8 and len(page.encode()) < self.MAX_PAGE_BYTES
        first = re.search(r"\?gap=([0-9a-f-]+)", href)
        assert first is not None
        outline = outline_of(page)
        assert f'<li id="node-{first[1]}" class="node ' in outline
        assert outline_rows(outline) <= OUTLINE_MAX and re.search(tip_row(conv.tip_id), outline)
        # The rest of the stretch is a gap again, a link to this page with it open.
        assert outline.count('<li class="gap">') == 1
        assert f'href="/c/{conv.pk}/tree/?gap=' in outline


def tip_row(mid: uuid.UUID | None) -> str:
    return rf'<li id="node-{mid}" class="node \w+ on-path is-tip">'
