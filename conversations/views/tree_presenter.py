"""What the tree screen shows: the graph (conversations/treegraph.py) and the outline
(conversations/treemap.py) of a conversation, with each message's preview, marks
(checkpoints, forks, rewinds) and links.

Two halves: ``tree_load`` and ``tree_context`` read (through the selectors, a fixed
number of queries whatever the size of the tree); ``outline_rows``, ``graph_decorate``
and ``gap_href`` only arrange what was read, given the page's two URLs (``TreeLinks``),
so they can be exercised without a database.
"""

from __future__ import annotations

import json
import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from django.urls import reverse

from conversations import selectors
from conversations.models import Checkpoint, Conversation
from conversations.treegraph import Graph, graph_layout, legend
from conversations.treemap import (
    ALTS_SHOWN,
    Gap,
    OutlineItem,
    RunStub,
    TreeMap,
    shown_ids,
    stub_chunk,
)

TREE = "conversations/tree.html"
OPEN_MAX = 100  # ``open`` ids read from a request; more only shape nothing further


@dataclass(frozen=True)
class TreeMarks:
    """What the tree marks beside a message, by message id: its checkpoints, the
    conversations forked from it, and (for a rewind's digest message) the rewind."""

    checkpoints: dict[uuid.UUID, list[Checkpoint]]
    forks: dict[uuid.UUID, list[Conversation]]
    digests: dict[uuid.UUID, dict[str, Any]]

    def marked(self) -> set[uuid.UUID]:
        """Messages never folded into a quiet run: checkpoints, forks, rewinds and the
        ends of the branches that rewinds abandoned."""
        abandoned = {d["abandoned_tip"] for d in self.digests.values() if d.get("abandoned_tip")}
        return set(self.checkpoints) | set(self.forks) | set(self.digests) | abandoned


@dataclass(frozen=True)
class TreeLinks:
    """The two pages a tree's links lead to: the chat view and the tree page itself."""

    detail: str
    page: str

    @classmethod
    def of(cls, conv: Conversation) -> TreeLinks:
        return cls(
            detail=reverse("conversations:detail", args=[conv.pk]),
            page=reverse("conversations:tree", args=[conv.pk]),
        )


# --- reads ---------------------------------------------------------------------------


def tree_marks(conv: Conversation) -> TreeMarks:
    """The conversation's checkpoints, forks and rewinds by message (three queries)."""
    checkpoints: dict[uuid.UUID, list[Checkpoint]] = defaultdict(list)
    for cp in selectors.checkpoint_list(conversation=conv):
        checkpoints[cp.message_id].append(cp)
    forks: dict[uuid.UUID, list[Conversation]] = defaultdict(list)
    for f in selectors.conversation_forks(conversation=conv):
        if f.forked_from_id:
            forks[f.forked_from_id].append(f)
    return TreeMarks(checkpoints, forks, selectors.rewind_digests(conversation=conv))


def tree_load(conv: Conversation) -> tuple[TreeMap, TreeMarks]:
    """The conversation's tree map (from its contents-free skeleton) and marks."""
    marks = tree_marks(conv)
    tree_map = TreeMap(selectors.tree_skeleton(conversation=conv), conv.tip_id, marks.marked())
    return tree_map, marks


def outline_rows_load(
    conv: Conversation, tree_map: TreeMap, marks: TreeMarks, items: list[OutlineItem]
) -> list[dict[str, Any]]:
    """``outline_rows`` for an outline fragment, with the previews it shows read."""
    previews = selectors.message_previews(conversation=conv, ids=shown_ids(items))
    return outline_rows(TreeLinks.of(conv), tree_map, items, marks, previews)


def tree_context(
    conv: Conversation,
    opened: list[str],
    *,
    outline: bool = True,
    notice: str = "",
    stretch: tuple[uuid.UUID, int] | None = None,
) -> dict[str, Any]:
    """The tree page: the graph and (unless only the graph is redrawn) the outline, with
    one preview query for both; ``stretch`` is a gap of the outline to show open."""
    tree_map, marks = tree_load(conv)
    graph = graph_layout(tree_map, opened_ids(opened))
    main, other_roots = tree_map.roots()
    items = tree_map.outline(main, opened=stretch) if main and outline else []
    previews = selectors.message_previews(
        conversation=conv, ids=list({*shown_ids(items), *graph.message_ids()})
    )
    links = TreeLinks.of(conv)
    graph_decorate(links, graph, previews, marks)
    roots, more_roots = stub_chunk(other_roots, parent=None, skip=0, size=ALTS_SHOWN)
    return {
        "conversation": conv,
        "graph": graph,
        "graph_legend": legend(),
        "graph_vals": json.dumps(
            {"version": str(conv.version), "open": [str(m) for m in graph.opened]}
        ),
        "items": outline_rows(links, tree_map, items, marks, previews),
        "other_roots": roots,
        "more_roots": more_roots,
        "node_count": len(tree_map.nodes),
        "notice": notice,
    }


# --- arranging what was read ----------------------------------------------------------


def opened_ids(values: list[str]) -> list[uuid.UUID]:
    """The ``open`` ids asked for. They only shape the drawing, so a malformed one is
    ignored (and one not in this tree is dropped by the layout) rather than an error."""
    out: list[uuid.UUID] = []
    for value in values[:OPEN_MAX]:
        try:
            out.append(uuid.UUID(value))
        except ValueError:
            continue
    return out


def gap_href(links: TreeLinks, tree: TreeMap, gap: Gap) -> str:
    """Without JavaScript a gap is a link: on the main branch, to this page with that
    stretch open (the page shows no other branch open); elsewhere, to the chat view."""
    if tree.line_start(gap.first) != tree.roots()[0]:
        return f"{links.detail}?m={gap.first}#msg-{gap.first}"
    anchor = f"{'run' if gap.folded else 'node'}-{gap.first}"
    return f"{links.page}?gap={gap.first}&n={gap.messages}#{anchor}"


def outline_rows(
    links: TreeLinks,
    tree: TreeMap,
    items: list[OutlineItem],
    marks: TreeMarks,
    previews: dict[uuid.UUID, str],
) -> list[dict[str, Any]]:
    """The outline's rows as the template draws them: a quiet run, a gap with its link,
    or a message with its preview, marks and first few branches."""
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, RunStub):
            out.append({"run": item})
            continue
        if isinstance(item, Gap):
            out.append({"gap": item, "href": gap_href(links, tree, item)})
            continue
        mid = item.node.id
        alts, more = stub_chunk(item.alternatives, parent=mid, skip=0, size=ALTS_SHOWN)
        out.append(
            {
                "row": item,
                "id": mid,
                "preview": previews.get(mid, ""),
                "on_path": mid in tree.path,
                "is_tip": mid == tree.tip_id,
                "checkpoints": marks.checkpoints.get(mid, []),
                "forks": marks.forks.get(mid, []),
                "rewind": marks.digests.get(mid),
                "alts": alts,
                "more": more,
            }
        )
    return out


def graph_decorate(
    links: TreeLinks, graph: Graph, previews: dict[uuid.UUID, str], marks: TreeMarks
) -> None:
    """Give the graph's rows their text, marks and links (the same marks as the outline).
    A message links to the chat view of its branch (where, without JavaScript, "Continue
    from this branch" moves the tip); a stub or a fold links to this page with it open."""
    keep = "".join(f"open={mid}&" for mid in graph.opened)
    for node in graph.nodes:
        node.href = f"{links.detail}?m={node.id}#msg-{node.id}"
        if node.kind == "message":
            node.preview = previews.get(node.id, "")
            node.checkpoints = marks.checkpoints.get(node.id, [])
            node.forks = marks.forks.get(node.id, [])
            node.rewind = marks.digests.get(node.id)
        elif node.kind in ("stub", "run"):
            node.open_url = f"{links.page}?{keep}open={node.id}"
            node.href = f"{node.open_url}#tree-graph"
