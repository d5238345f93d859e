"""The tree map drawn as a graph: a git-graph layout of the skeleton the outline shows, as
coordinates the template turns into SVG. Pure Python.

Rows run top to bottom in depth-first order (a message, then the branches that leave it,
then its own continuation), so every branch is one unbroken stretch of rows and holds one
lane from the row below its fork to its last row. Lanes are handed out like an interval
colouring, so a finished branch's lane is reused further down; the current path is the
first branch: lane 0, from the root straight down to the tip.

What is drawn stays bounded whatever the tree: other branches are "+N" stubs until asked
for (``?open=<id>``), quiet stretches are one dashed edge with an "N messages" label, a
message draws at most MAX_ALTS of its branches, and a branch that would not fit keeps its
first message and the stretch around the tip, the rest folded into a "gap" row that links
to the chat view (the outline under the graph, bounded the same way with
``treemap.fit``, opens such a stretch a chunk at a time).
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from conversations.treemap import (
    BranchStub,
    Gap,
    Item,
    Row,
    RunStub,
    TreeMap,
    fit,
    gap_of,
    with_gaps,
)

MAX_NODES = 300  # rows drawn (messages, stubs, folds), whatever the size of the tree
MAX_ALTS = 6  # branches drawn off one message; the rest are one "+K more branches" row
RUN_OPEN = 60  # messages an opened quiet stretch draws at once
MIN_OPEN = 12  # room an opened branch needs (its first row and branches, and a gap)
MAX_OPEN = 20  # ?open= ids honoured

ROW_H = 34  # a row is a finger's height: the whole row is the node's link
LANE_W = 20
PAD = 12
MARK_W = 17  # three mark slots (checkpoint, fork, rewind) between lanes and labels
LABEL_W = 510  # room for LABEL_CHARS of bold text, "tip · " included
LABEL_CHARS = 56


# --- the plan: which rows are drawn -----------------------------------------------------


@dataclass
class _Alt:
    """A branch off a message: a stub, or drawn once opened."""

    stub: BranchStub
    plan: _Plan | None = None


@dataclass
class _More:
    """The branches of a message beyond MAX_ALTS, as one row."""

    first: uuid.UUID
    branches: int
    messages: int


@dataclass
class _Row:
    row: Row
    alts: list[_Alt | _More]


_PlanItem = _Row | RunStub | Gap


@dataclass
class _Plan:
    items: list[_PlanItem]


# --- the drawing ------------------------------------------------------------------------


@dataclass
class GraphNode:
    kind: str  # "message", "stub", "more", "run" or "gap"
    id: uuid.UUID  # the message; for a fold, gap or "more" row, the first one it hides
    row: int
    role: str = ""
    count: int = 0  # stub: messages in the branch; run, gap: messages; more: branches
    extra: int = 0  # gap: branches left out; more: their messages
    on_path: bool = False
    is_tip: bool = False
    lane: int = 0
    x: int = 0
    y: int = 0
    hit_x: int = 0
    hit_w: int = 0
    marks_x: int = 0
    shape: str = ""  # SVG path data of the node's symbol
    # Filled in by the view: the text and the marks, like the outline's.
    preview: str = ""
    checkpoints: list[Any] = field(default_factory=list)
    forks: list[Any] = field(default_factory=list)
    rewind: dict[str, Any] | None = None
    href: str = ""
    open_url: str = ""

    @property
    def top(self) -> int:
        return self.y - ROW_H // 2

    @property
    def text_y(self) -> int:
        return self.y + 5

    @property
    def label(self) -> str:
        text = self.preview or "…"
        room = LABEL_CHARS - (6 if self.is_tip else 0)  # "tip · " goes first
        return text if len(text) <= room else text[: room - 1] + "…"

    @property
    def tip_ring(self) -> str:
        return _circle(self.x, self.y, 10) if self.is_tip else ""

    # The marks, drawn (a font may lack ⚑ ⑂ ↶) in three slots: checkpoint, fork, rewind.
    @property
    def flag(self) -> str:
        return flag_path(self.marks_x + 4, self.y)

    @property
    def fork_x(self) -> int:
        return self.marks_x + MARK_W

    @property
    def fork(self) -> str:
        return fork_path(self.fork_x + 6, self.y)

    @property
    def rewind_sign(self) -> str:
        return rewind_path(self.marks_x + 2 * MARK_W + 2, self.y)

    @property
    def dropped(self) -> bool:
        """Every checkpoint on this message is dropped."""
        return bool(self.checkpoints) and all(
            getattr(cp, "state", "") == "dropped" for cp in self.checkpoints
        )


@dataclass
class GraphEdge:
    d: str  # SVG path data
    kind: str  # "line" (along a branch) or "fork" (into a branch)
    fold: bool  # drawn dashed: it passes a folded stretch or leads to a collapsed branch
    on_path: bool


@dataclass
class Graph:
    nodes: list[GraphNode]
    edges: list[GraphEdge]
    lanes: int
    width: int
    height: int
    marks_x: int
    text_x: int
    skipped: int  # branches asked for that did not fit
    opened: list[uuid.UUID]  # the ?open= ids drawn open: the state the graph's links keep

    @property
    def messages(self) -> list[GraphNode]:
        return [n for n in self.nodes if n.kind == "message"]

    @property
    def others(self) -> list[GraphNode]:
        return [n for n in self.nodes if n.kind != "message"]

    @property
    def row_h(self) -> int:
        return ROW_H

    def message_ids(self) -> list[uuid.UUID]:
        return [n.id for n in self.nodes if n.kind == "message"]


@dataclass
class _Segment:
    """The rows one lane is held for: from the row below the fork to the branch's end."""

    lo: int
    hi: int = 0
    nodes: list[GraphNode] = field(default_factory=list)


def flag_path(x: int, y: int) -> str:
    """A checkpoint's flag, its pole at ``x``."""
    return f"M{x} {y + 7}V{y - 7}M{x} {y - 7}l9 3.5-9 3.5z"


def fork_path(x: int, y: int) -> str:
    """A fork's Y, its stem at ``x``."""
    return f"M{x} {y + 7}V{y}M{x - 5} {y - 7}V{y - 4}L{x} {y}L{x + 5} {y - 4}V{y - 7}"


def rewind_path(x: int, y: int) -> str:
    """A rewind's hooked arrow, starting at ``x``."""
    return f"M{x} {y - 3}h6a4.5 4.5 0 0 1 0 9h-4M{x + 3} {y - 6}l-3 3 3 3"


@dataclass(frozen=True)
class LegendEntry:
    kind: str  # CSS classes of the group (as a node's or a mark's)
    path: str  # SVG path data in a 20 x 20 box
    text: str
    ring: str = ""  # the tip's ring, for the tip entry


def legend() -> list[LegendEntry]:
    """What the graph's symbols mean, drawn with the graph's own shapes and classes."""
    return [
        LegendEntry("user", _shape("message", "user", 10, 10), "user"),
        LegendEntry("assistant", _shape("message", "assistant", 10, 10), "assistant"),
        LegendEntry("tool", _shape("message", "tool", 10, 10), "tool result"),
        LegendEntry("system", _shape("message", "system", 10, 10), "system"),
        LegendEntry(
            "user on-path",
            _shape("message", "user", 10, 10),
            "the tip (green: the current path)",
            ring=_circle(10, 10, 9),
        ),
        LegendEntry("stub", _shape("stub", "", 10, 10), "a collapsed branch: open it"),
        LegendEntry("run", _shape("run", "", 10, 10), "a quiet stretch, folded"),
        LegendEntry("mark checkpoint", flag_path(6, 10), "checkpoint"),
        LegendEntry("mark fork", fork_path(10, 10), "forked from here"),
        LegendEntry("mark rewind", rewind_path(5, 10), "rewound here"),
    ]


def _circle(x: int, y: int, r: int) -> str:
    return f"M{x - r} {y}a{r} {r} 0 1 0 {2 * r} 0a{r} {r} 0 1 0 {-2 * r} 0"


def _shape(kind: str, role: str, x: int, y: int) -> str:
    """The node's symbol: the role by shape (user ●, assistant ■, tool ◆, system ▲); a
    collapsed branch a dashed ⊕; a fold a break mark across the edge."""
    if kind in ("stub", "more"):
        return f"{_circle(x, y, 7)}M{x - 4} {y}h8M{x} {y - 4}v8"
    if kind in ("run", "gap"):
        return f"M{x - 6} {y - 3}h12M{x - 6} {y + 3}h12"
    if role == "assistant":
        return f"M{x - 5} {y - 5}h10v10h-10z"
    if role == "tool":
        return f"M{x} {y - 7}l7 7-7 7-7-7z"
    if role == "system":
        return f"M{x} {y - 7}l7 12h-14z"
    return _circle(x, y, 6)


class _Layout:
    def __init__(self, tree: TreeMap, opened: Iterable[uuid.UUID], limit: int) -> None:
        self.tree = tree
        wanted = [mid for mid in dict.fromkeys(opened) if mid in tree][:MAX_OPEN]
        self.opened = set(wanted)
        self.limit = limit
        self.skipped = 0
        self.nodes: list[GraphNode] = []
        self.edges: list[tuple[GraphNode, GraphNode, str]] = []
        self.segments: list[_Segment] = []
        self.wanted = wanted
        self.used: set[uuid.UUID] = set()  # the ids asked for that opened something

    # -- planning --

    def _alts(self, stubs: list[BranchStub]) -> list[_Alt | _More]:
        if len(stubs) <= MAX_ALTS:
            return [_Alt(s) for s in stubs]
        # Branches asked for are drawn first; the oldest of the others fill the rest.
        chosen = {s.id for s in stubs if s.id in self.opened}
        for s in stubs:
            if len(chosen) >= MAX_ALTS:
                break
            chosen.add(s.id)
        drawn: list[_Alt | _More] = [_Alt(s) for s in stubs if s.id in chosen]
        rest = [s for s in stubs if s.id not in chosen]
        if rest:
            drawn.append(_More(rest[0].id, len(rest), sum(s.size for s in rest)))
        return drawn

    def _expand_runs(self, items: list[Item]) -> list[Item]:
        out: list[Item] = []
        for item in items:
            current: Item | None = item
            while isinstance(current, RunStub) and current.first in self.opened:
                self.used.add(current.first)
                shown = self.tree.run(current.first, current.count, chunk=RUN_OPEN)
                rest = shown[-1] if shown and isinstance(shown[-1], RunStub) else None
                out.extend(shown[:-1] if rest else shown)
                current = rest
            if current is not None:
                out.append(current)
        return out

    @staticmethod
    def _cost(item: _PlanItem) -> int:
        return 1 + len(item.alts) if isinstance(item, _Row) else 1

    @staticmethod
    def _gap(items: list[_PlanItem]) -> Gap:
        return gap_of([it.row if isinstance(it, _Row) else it for it in items])

    def _plan(self, start: uuid.UUID, limit: int, anchor: uuid.UUID | None) -> tuple[_Plan, int]:
        """The branch from ``start`` within ``limit`` rows: whole if it fits, else its first
        row and as much around ``anchor`` (the tip) as fits, the rest folded into gaps."""
        items: list[_PlanItem] = [
            _Row(it, self._alts(it.alternatives)) if isinstance(it, Row) else it
            for it in self._expand_runs(self.tree.branch(start))
        ]
        costs = [self._cost(it) for it in items]
        if sum(costs) <= limit:
            return _Plan(items), sum(costs)
        at = next(
            (i for i, it in enumerate(items) if isinstance(it, _Row) and it.row.node.id == anchor),
            0,
        )
        # Up to two gaps: before and after the window.
        kept = with_gaps(items, fit(costs, limit - 2, at, keep=[0]), self._gap)
        return _Plan(kept), sum(self._cost(it) for it in kept)

    def _asked(self, alts: Iterable[_Alt | _More]) -> list[_Alt]:
        return [a for a in alts if isinstance(a, _Alt) and a.stub.id in self.opened]

    def plan(self) -> tuple[_Plan | None, list[_Alt | _More]]:
        main, other_roots = self.tree.roots()
        roots = self._alts(other_roots)
        budget = self.limit - len(roots)
        plan = None
        queue: deque[_Alt] = deque(self._asked(roots))
        if main is not None:
            plan, cost = self._plan(main, budget, self.tree.tip_id)
            budget -= cost
            queue.extendleft(reversed(self._asked_in(plan)))
        # Open what was asked for, nearest the current path first, while there is room.
        while queue:
            alt = queue.popleft()
            if budget + 1 < MIN_OPEN:
                self.skipped += 1
                continue
            self.used.add(alt.stub.id)
            alt.plan, cost = self._plan(alt.stub.id, budget + 1, None)
            budget -= cost - 1
            queue.extend(self._asked_in(alt.plan))
        return plan, roots

    def _asked_in(self, plan: _Plan) -> list[_Alt]:
        return [a for it in plan.items if isinstance(it, _Row) for a in self._asked(it.alts)]

    # -- drawing --

    def _node(self, kind: str, mid: uuid.UUID, **kwargs: Any) -> GraphNode:
        node = GraphNode(kind=kind, id=mid, row=len(self.nodes), **kwargs)
        self.nodes.append(node)
        return node

    def _item_node(self, item: _PlanItem) -> GraphNode:
        path, tip = self.tree.path, self.tree.tip_id
        if isinstance(item, _Row):
            n = item.row.node
            return self._node(
                "message", n.id, role=n.role, on_path=n.id in path, is_tip=n.id == tip
            )
        if isinstance(item, RunStub):
            return self._node("run", item.first, count=item.count, on_path=item.first in path)
        return self._node(
            "gap", item.first, count=item.messages, extra=item.branches, on_path=item.first in path
        )

    def _draw_plan(self, plan: _Plan, parent: GraphNode | None) -> None:
        segment = _Segment(lo=parent.row + 1 if parent else len(self.nodes))
        self.segments.append(segment)
        previous = parent
        for i, item in enumerate(plan.items):
            node = self._item_node(item)
            segment.nodes.append(node)
            if previous is not None:
                self.edges.append((previous, node, "fork" if i == 0 else "line"))
            if isinstance(item, _Row):
                for alt in item.alts:
                    self._draw_alt(alt, node)
            previous = node
        segment.hi = segment.nodes[-1].row

    def _draw_alt(self, alt: _Alt | _More, parent: GraphNode | None) -> None:
        if isinstance(alt, _Alt) and alt.plan is not None:
            self._draw_plan(alt.plan, parent)
            return
        if isinstance(alt, _Alt):
            node = self._node("stub", alt.stub.id, count=alt.stub.size, on_path=alt.stub.on_path)
        else:
            node = self._node("more", alt.first, count=alt.branches, extra=alt.messages)
        self.segments.append(
            _Segment(lo=parent.row + 1 if parent else node.row, hi=node.row, nodes=[node])
        )
        if parent is not None:
            self.edges.append((parent, node, "fork"))

    def _assign_lanes(self) -> int:
        # Segments by first row (a parent's before its children's): each takes the lowest
        # lane free from that row on, so a finished branch's lane is reused below it.
        busy: list[int] = []  # per lane, the last row it is held to
        for segment in sorted(self.segments, key=lambda s: s.lo):
            lane = next((i for i, until in enumerate(busy) if until < segment.lo), len(busy))
            if lane == len(busy):
                busy.append(0)
            busy[lane] = segment.hi
            for node in segment.nodes:
                node.lane = lane
        return len(busy)

    def draw(self) -> Graph:
        plan, roots = self.plan()
        if plan is not None:
            self._draw_plan(plan, None)
        for alt in roots:
            self._draw_alt(alt, None)
        lanes = self._assign_lanes()
        marks_x = PAD + lanes * LANE_W + 4
        text_x = marks_x + 3 * MARK_W + 4
        width = text_x + LABEL_W + PAD
        for node in self.nodes:
            node.x = PAD + node.lane * LANE_W + LANE_W // 2
            node.y = PAD + node.row * ROW_H + ROW_H // 2
            node.hit_x = node.x - LANE_W // 2
            node.hit_w = width - PAD - node.hit_x
            node.marks_x = marks_x
            node.shape = _shape(node.kind, node.role, node.x, node.y)
        edges = []
        for a, b, kind in self.edges:
            if kind == "line":
                d = f"M{a.x} {a.y}V{b.y}"
            else:  # leave the parent's lane in the row below it, then run down to the child
                mid, below = a.y + ROW_H // 2, a.y + ROW_H
                d = f"M{a.x} {a.y}C{a.x} {mid} {b.x} {mid} {b.x} {below}"
                if b.y > below:
                    d += f"V{b.y}"
            folded = {"run", "gap", "stub", "more"}
            fold = a.kind in folded or b.kind in folded
            edges.append(GraphEdge(d, kind, fold, a.on_path and b.on_path))
        drawn = {n.id for n in self.nodes if n.kind == "message"} & self.used
        return Graph(
            nodes=self.nodes,
            edges=edges,
            lanes=lanes,
            width=width,
            height=2 * PAD + len(self.nodes) * ROW_H,
            marks_x=marks_x,
            text_x=text_x,
            skipped=self.skipped,
            opened=[mid for mid in self.wanted if mid in drawn],
        )


def graph_layout(
    tree: TreeMap, opened: Iterable[uuid.UUID] = (), *, limit: int = MAX_NODES
) -> Graph:
    """The drawing of ``tree`` with the branches and quiet stretches in ``opened`` open,
    at most ``limit`` rows (at least MIN_OPEN + 8: a first row, its branches, the tip's)."""
    return _Layout(tree, opened, max(limit, MIN_OPEN + 8)).draw()
