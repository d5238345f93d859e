"""The tree map's layout, from the contents-free skeleton of a conversation.

A 10,000-node tree cannot be drawn as 10,000 nested boxes, so the map is a set of
*branches*: a branch follows one line of descent (the current path where it passes, else
the newest child), and every other child along it is a collapsed stub that the browser
expands on demand. Long stretches with nothing to see (no fork in the road, no tip, no
checkpoint) fold into a "… n messages" run that also expands on demand.

That alone does not bound what is shown: a branch with a fork at every step has nothing
quiet to fold. So the outline shows at most OUTLINE_MAX rows of a branch, like the graph
(conversations/treegraph.py, which shares ``fit`` and ``with_gaps``): its first rows and
the stretch around the tip, the rest folded into gaps that open a chunk at a time; and a
message lists ALTS_SHOWN of its branches, the rest behind one "more" row. Pure Python.
"""

from __future__ import annotations

import bisect
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TypeVar

RUN_MIN = 6  # a quiet stretch this long or longer is folded
RUN_CHUNK = 500  # rows an expanded run shows at once
OUTLINE_MAX = 300  # rows the outline shows of a branch (messages, branch stubs, folds)
OUTLINE_HEAD = 30  # of which the start of a long branch keeps up to this many
STRETCH_CHUNK = 200  # rows an opened gap shows at once
ALTS_SHOWN = 10  # branches listed under a message; the rest are one "more" row
ALTS_CHUNK = 100  # branches that row lists at once when opened

T = TypeVar("T")
G = TypeVar("G")


@dataclass(frozen=True)
class SkeletonNode:
    """A message without its contents: all the map needs to lay a tree out. Defined here,
    not beside the query that reads it (``selectors.tree_skeleton``), so this module
    stays free of Django."""

    id: uuid.UUID
    parent_id: uuid.UUID | None
    role: str
    origin: str
    depth: int


@dataclass
class BranchStub:
    id: uuid.UUID
    size: int
    on_path: bool


@dataclass
class Row:
    node: SkeletonNode
    alternatives: list[BranchStub] = field(default_factory=list)


@dataclass
class RunStub:
    first: uuid.UUID
    count: int


Item = Row | RunStub


@dataclass
class Gap:
    """A stretch of a branch left out to stay within a bound: ``messages`` messages along
    its line from ``first``, with ``branches`` branches leaving them."""

    first: uuid.UUID
    messages: int
    branches: int
    folded: bool = False  # it starts with a quiet run, not a message's row


@dataclass
class MoreStub:
    """The branches under ``parent`` (None: the other roots) past the first ``skip``."""

    parent: uuid.UUID | None
    skip: int
    first: uuid.UUID
    branches: int
    messages: int


OutlineItem = Row | RunStub | Gap


def gap_of(items: Sequence[Row | RunStub | Gap]) -> Gap:
    """The gap that stands for ``items`` (a stretch of one branch, in order)."""
    messages = branches = 0
    for item in items:
        if isinstance(item, Row):
            messages += 1
            branches += len(item.alternatives)
        elif isinstance(item, RunStub):
            messages += item.count
        else:
            messages += item.messages
            branches += item.branches
    first = items[0]
    if isinstance(first, Row):
        return Gap(first.node.id, messages, branches)
    return Gap(first.first, messages, branches, folded=True)


def fit(costs: Sequence[int], room: int, at: int, keep: Iterable[int] = ()) -> set[int]:
    """Which of a branch's items to show: ``keep`` and ``at`` whatever they cost, and a
    window around ``at`` widened a step at a time below and above while the total stays
    within ``room`` (items kept already are passed over for free)."""
    kept = {*keep, at}
    used = sum(costs[i] for i in kept)
    lo = hi = at
    growing = True
    while growing:
        growing = False
        while hi + 1 in kept:
            hi += 1
        if hi + 1 < len(costs) and used + costs[hi + 1] <= room:
            hi += 1
            used += costs[hi]
            kept.add(hi)
            growing = True
        while lo - 1 in kept:
            lo -= 1
        if lo > 0 and used + costs[lo - 1] <= room:
            lo -= 1
            used += costs[lo]
            kept.add(lo)
            growing = True
    return kept


def with_gaps(items: Sequence[T], kept: set[int], gap: Callable[[list[T]], G]) -> list[T | G]:
    """``items`` with each stretch of those not ``kept`` replaced by ``gap(stretch)``."""
    out: list[T | G] = []
    left_out: list[T] = []
    for i, item in enumerate(items):
        if i in kept:
            if left_out:
                out.append(gap(left_out))
                left_out = []
            out.append(item)
        else:
            left_out.append(item)
    if left_out:
        out.append(gap(left_out))
    return out


def _chunk_end(costs: list[int], i: int, j: int, chunk: int) -> int:
    """Where a chunk of at most ``chunk`` rows (one item at least) from item ``i`` ends,
    ``j`` at the latest."""
    end, used = i + 1, costs[i]
    while end < j and used + costs[end] <= chunk:
        used += costs[end]
        end += 1
    return end


def outline_cost(item: OutlineItem) -> int:
    """The rows an item takes in the outline: a message's with its listed branches."""
    if isinstance(item, Row):
        n = len(item.alternatives)
        return 1 + min(n, ALTS_SHOWN) + int(n > ALTS_SHOWN)
    return 1


def stub_chunk(
    stubs: list[BranchStub], *, parent: uuid.UUID | None, skip: int, size: int
) -> tuple[list[BranchStub], MoreStub | None]:
    """``size`` of the ``stubs`` past the first ``skip``, and a row for the rest."""
    shown, rest = stubs[skip : skip + size], stubs[skip + size :]
    if not rest:
        return shown, None
    more = MoreStub(parent, skip + len(shown), rest[0].id, len(rest), sum(s.size for s in rest))
    return shown, more


class TreeMap:
    def __init__(
        self, nodes: Iterable[SkeletonNode], tip_id: uuid.UUID | None, marked: set[uuid.UUID]
    ) -> None:
        self.nodes = {n.id: n for n in nodes}
        self.children: dict[uuid.UUID | None, list[uuid.UUID]] = defaultdict(list)
        for n in self.nodes.values():  # creation order: oldest child first
            self.children[n.parent_id].append(n.id)
        self.tip_id = tip_id
        self.marked = marked
        self.path: set[uuid.UUID] = set()
        current = tip_id
        while current is not None and current in self.nodes:
            self.path.add(current)
            current = self.nodes[current].parent_id
        self.size = dict.fromkeys(self.nodes, 1)
        for n in sorted(self.nodes.values(), key=lambda n: n.depth, reverse=True):
            if n.parent_id is not None and n.parent_id in self.size:
                self.size[n.parent_id] += self.size[n.id]

    def __contains__(self, mid: uuid.UUID) -> bool:
        return mid in self.nodes

    def _follow(self, kids: list[uuid.UUID]) -> uuid.UUID | None:
        if not kids:
            return None
        for kid in kids:
            if kid in self.path:
                return kid
        return kids[-1]

    def _stubs(self, kids: list[uuid.UUID], followed: uuid.UUID | None) -> list[BranchStub]:
        return [
            BranchStub(id=kid, size=self.size[kid], on_path=kid in self.path)
            for kid in kids
            if kid != followed
        ]

    def _row(self, mid: uuid.UUID, followed: uuid.UUID | None) -> Row:
        return Row(node=self.nodes[mid], alternatives=self._stubs(self.children[mid], followed))

    def roots(self) -> tuple[uuid.UUID | None, list[BranchStub]]:
        """The root the main branch starts at, and the other roots as stubs."""
        kids = self.children[None]
        main = self._follow(kids)
        return main, self._stubs(kids, main)

    def alternatives(self, parent: uuid.UUID | None) -> list[BranchStub]:
        """The branches listed under ``parent`` (None: the roots beside the main one)."""
        kids = self.children[parent]
        return self._stubs(kids, self._follow(kids))

    def line_start(self, mid: uuid.UUID) -> uuid.UUID:
        """The first message of the branch ``mid`` is shown in (its line of descent)."""
        current = mid
        while (parent := self.nodes[current].parent_id) is not None and parent in self.nodes:
            if self._follow(self.children[parent]) != current:
                break
            current = parent
        return current

    def branch(self, start: uuid.UUID) -> list[Item]:
        """The line of descent from ``start``, quiet stretches folded."""
        rows: list[Row] = []
        current: uuid.UUID | None = start
        while current is not None:
            followed = self._follow(self.children[current])
            rows.append(self._row(current, followed))
            current = followed
        keep: set[int] = set()
        last = len(rows) - 1
        for i, row in enumerate(rows):
            mid = row.node.id
            if i in (0, last) or row.alternatives or mid == self.tip_id or mid in self.marked:
                keep.update((i - 1, i, i + 1))
        items: list[Item] = []
        i = 0
        while i < len(rows):
            if i in keep:
                items.append(rows[i])
                i += 1
                continue
            j = i
            while j < len(rows) and j not in keep:
                j += 1
            if j - i >= RUN_MIN:
                items.append(RunStub(first=rows[i].node.id, count=j - i))
            else:
                items.extend(rows[i:j])
            i = j
        return items

    def run(self, first: uuid.UUID, count: int, chunk: int = RUN_CHUNK) -> list[Item]:
        """An expanded run: up to ``chunk`` rows, then a stub for the rest."""
        items: list[Item] = []
        current: uuid.UUID | None = first
        shown = 0
        while current is not None and shown < min(count, chunk):
            followed = self._follow(self.children[current])
            items.append(self._row(current, followed))
            current = followed
            shown += 1
        if current is not None and count > shown:
            items.append(RunStub(first=current, count=count - shown))
        return items

    def _span(
        self, items: list[Item], start: uuid.UUID, first: uuid.UUID, count: int
    ) -> tuple[int, int]:
        """The items of the branch from ``start`` that hold the ``count`` messages from
        ``first`` on, as a slice; empty if ``first`` is not on that branch."""
        if first not in self.nodes or self.line_start(first) != start:
            return 0, 0
        offset = self.nodes[first].depth - self.nodes[start].depth
        sizes = [item.count if isinstance(item, RunStub) else 1 for item in items]
        begins = [0, *accumulate(sizes)][:-1]  # each item's offset along the branch
        i = bisect.bisect_right(begins, offset) - 1
        j = bisect.bisect_left(begins, offset + max(count, 1), lo=i + 1)
        return i, j

    def outline(
        self,
        start: uuid.UUID,
        *,
        opened: tuple[uuid.UUID, int] | None = None,
        limit: int = OUTLINE_MAX,
    ) -> list[OutlineItem]:
        """The branch from ``start`` within about ``limit`` rows: whole if it fits, else
        its first rows, the stretch around the tip and, if ``opened`` names a stretch (its
        first message and length), a chunk of that, the rest folded into gaps."""
        items = self.branch(start)
        costs = [outline_cost(item) for item in items]
        if sum(costs) <= limit:
            return list(items)
        head = max(1, bisect.bisect_right(list(accumulate(costs)), OUTLINE_HEAD))
        keep = set(range(head))
        if opened is not None:
            i, j = self._span(items, start, *opened)
            if i < j:
                keep.update(range(i, _chunk_end(costs, i, j, STRETCH_CHUNK)))
        at = next(
            (i for i, it in enumerate(items) if isinstance(it, Row) and it.node.id == self.tip_id),
            0,
        )
        # Up to three gaps: after the head, around the opened chunk, after the window.
        kept = fit(costs, limit - 3, at, keep)
        return with_gaps(items, kept, gap_of)

    def stretch(
        self, first: uuid.UUID, count: int, chunk: int = STRETCH_CHUNK
    ) -> list[OutlineItem]:
        """An opened gap: the ``count`` messages from ``first`` along its branch, up to
        ``chunk`` rows of them, then a gap for the rest."""
        start = self.line_start(first)
        items = self.branch(start)
        i, j = self._span(items, start, first, count)
        if i == j:
            return []
        end = _chunk_end([outline_cost(item) for item in items], i, j, chunk)
        shown: list[OutlineItem] = list(items[i:end])
        if end < j:
            shown.append(gap_of(items[end:j]))
        return shown


def shown_ids(items: Iterable[OutlineItem]) -> list[uuid.UUID]:
    return [item.node.id for item in items if isinstance(item, Row)]
