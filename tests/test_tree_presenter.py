"""The tree screen's presenter without a database: the tree map and graph modules load no
Django (a bench or a script can lay out a skeleton alone), and the presenter arranges
rows and links from what was read, given the page's two URLs. Also the one "prime the
turn, then stream" helper the chat views and the JSON API share."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from conversations.errors import InvalidInput
from conversations.streaming import events_primed
from conversations.treemap import Gap, Row, SkeletonNode, TreeMap
from conversations.views.tree_presenter import TreeLinks, TreeMarks, gap_href, outline_rows
from tests.test_import_boundaries import loaded_after_importing

LINKS = TreeLinks(detail="/c/x/", page="/c/x/tree/")


def chain(n: int) -> list[SkeletonNode]:
    """``n`` messages, each the child of the one before."""
    ids = [uuid.UUID(int=i + 1) for i in range(n)]
    return [
        SkeletonNode(mid, ids[i - 1] if i else None, "user", "turn", i) for i, mid in enumerate(ids)
    ]


def comb(n: int) -> list[SkeletonNode]:
    """A chain of ``n`` messages with a one-message branch off each: nothing is quiet,
    so a long one is cut into gaps rather than folded into runs."""
    main = chain(n)
    sides = [
        SkeletonNode(uuid.UUID(int=10_000 + i), node.id, "assistant", "turn", node.depth + 1)
        for i, node in enumerate(main)
    ]
    return main + sides


def test_the_tree_layout_modules_load_no_django():
    loaded = loaded_after_importing(["conversations.treemap", "conversations.treegraph"])
    assert not {name for name in loaded if name.split(".")[0] == "django"}


def test_it_links_a_gap_on_the_main_branch_to_the_page_with_that_stretch_open():
    nodes = comb(1000)
    tree = TreeMap(nodes, nodes[999].id, set())
    items = tree.outline(nodes[0].id)
    gaps = [item for item in items if isinstance(item, Gap)]
    assert gaps
    gap = gaps[0]
    anchor = f"{'run' if gap.folded else 'node'}-{gap.first}"
    assert gap_href(LINKS, tree, gap) == (f"/c/x/tree/?gap={gap.first}&n={gap.messages}#{anchor}")


def test_it_gives_each_row_its_preview_and_marks_without_a_database():
    nodes = chain(3)
    first = nodes[0].id
    digest = {"label": "start", "abandoned_tip": None}
    marks = TreeMarks(checkpoints={first: []}, forks={}, digests={nodes[1].id: digest})
    tree = TreeMap(nodes, nodes[-1].id, marks.marked())
    rows = outline_rows(LINKS, tree, tree.outline(first), marks, {first: "hello"})
    assert [row["id"] for row in rows] == [n.id for n in nodes]
    assert all(isinstance(row["row"], Row) for row in rows)
    assert rows[0]["preview"] == "hello" and rows[1]["preview"] == ""
    assert rows[1]["rewind"] == digest
    assert rows[2]["is_tip"] and all(row["on_path"] for row in rows)


def test_priming_a_turn_raises_bad_input_before_any_stream_and_keeps_every_event():
    def refused() -> Iterator[dict[str, Any]]:
        raise InvalidInput("no")
        yield {}  # a generator, like the turn engine

    with pytest.raises(InvalidInput):
        events_primed(refused())
    started: list[str] = []

    def turn() -> Iterator[dict[str, Any]]:
        started.append("attempt")
        yield {"event": "attempt"}
        yield {"event": "done"}

    primed = events_primed(turn())
    assert started == ["attempt"]  # the engine ran up to its first event already
    assert [e["event"] for e in primed] == ["attempt", "done"]
