"""The tree map's layout, from the contents-free skeleton of a conversation.

A 10,000-node tree cannot be drawn as 10,000 nested boxes, so the map is a set of
*branches*: a branch follows one line of descent (the current path where it passes, else
the newest child), and every other child along it is a collapsed stub that the browser
expands on demand. Long stretches with nothing to see (no fork in the road, no tip, no
checkpoint) fold into a "… n messages" run that also expands on demand. Pure Python.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from conversations.selectors import SkeletonNode

RUN_MIN = 6  # a quiet stretch this long or longer is folded
RUN_CHUNK = 500  # rows an expanded run shows at once


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

    def _row(self, mid: uuid.UUID, followed: uuid.UUID | None) -> Row:
        alternatives = [
            BranchStub(id=kid, size=self.size[kid], on_path=kid in self.path)
            for kid in self.children[mid]
            if kid != followed
        ]
        return Row(node=self.nodes[mid], alternatives=alternatives)

    def roots(self) -> tuple[uuid.UUID | None, list[BranchStub]]:
        """The root the main branch starts at, and the other roots as stubs."""
        kids = self.children[None]
        main = self._follow(kids)
        return main, [
            BranchStub(id=k, size=self.size[k], on_path=k in self.path) for k in kids if k != main
        ]

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


def shown_ids(items: Iterable[Item]) -> list[uuid.UUID]:
    return [item.node.id for item in items if isinstance(item, Row)]
