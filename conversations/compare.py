"""Side-by-side comparison of sibling answers or whole branches (the compare page).

Given two to four messages of one conversation, each column is that message's branch
below the point where the chosen paths split: for siblings that is the message alone,
for two leaves it is everything each branch explored. Rows line up by position after
the split, and every cell is word-diffed against the first column's cell in its row.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from difflib import SequenceMatcher

from django.db.models import Exists, OuterRef
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

from conversations import selectors
from conversations.models import Conversation, Message
from conversations.parts import readable_text

MAX_CHOSEN = 4
MAX_ROWS = 200  # messages shown per branch below the split; the rest are counted


def word_diff(old: str, new: str) -> tuple[SafeString, SafeString]:
    """Word-level diff (difflib): the old text with deletions marked, the new with
    insertions marked. Every piece of text is escaped."""
    a, b = old.split(), new.split()
    left: list[str] = []
    right: list[str] = []
    for op, i1, i2, j1, j2 in SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        old_words, new_words = escape(" ".join(a[i1:i2])), escape(" ".join(b[j1:j2]))
        if op == "equal":
            left.append(old_words)
            right.append(new_words)
        else:
            if old_words:
                left.append(f"<del>{old_words}</del>")
            if new_words:
                right.append(f"<ins>{new_words}</ins>")
    return mark_safe(" ".join(left)), mark_safe(" ".join(right))  # escaped above


# Two texts sharing less than this share of their words are a rewrite, not an edit: a
# word diff of them would strike out one whole cell, so both are shown as they are
# (texts of a few words are always diffed: there a diff is short to read).
REWRITE_BELOW = 0.34
REWRITE_MIN_WORDS = 8
MODES = ("diff", "plain")


@dataclass
class Cell:
    message: Message
    text: SafeString  # escaped, with <del>/<ins> marks against the first column (diff)
    rewritten: bool = False  # too different from the first column's cell to diff


@dataclass
class Column:
    chosen: Message
    cells: list[Cell] = field(default_factory=list)
    more: int = 0  # messages of this branch past MAX_ROWS, not shown
    # Which alternative this is where the chosen paths part: (position, of how many).
    version: tuple[int, int] | None = None
    model: str = ""  # the model that wrote the branch's answer, when known
    current: bool = False  # the conversation's current path runs through this branch


@dataclass
class Comparison:
    split: Message | None  # the last message all chosen paths share (None: no common root)
    columns: list[Column]
    mode: str = "diff"

    @property
    def rows(self) -> int:
        return max((len(c.cells) for c in self.columns), default=0)


def compare(*, conversation: Conversation, chosen: list[Message], mode: str = "diff") -> Comparison:
    """Columns for ``chosen`` (2-4 distinct messages of ``conversation``), word-diffed
    against the first (``mode="diff"``) or as they are (``"plain"``): one path query per
    message, one for the current path and one for the versions."""
    paths = [
        selectors.message_path(conversation_id=conversation.pk, tip_id=m.pk)
        for m in chosen[:MAX_CHOSEN]
    ]
    shared = 0
    while all(len(p) > shared for p in paths) and len({p[shared].pk for p in paths}) == 1:
        shared += 1
    split = paths[0][shared - 1] if shared else None
    segments = []
    for path in paths:
        segment = path[shared:]
        if not segment:
            # One chosen message is an ancestor of another: show it as its own column.
            segment = path[-1:]
        segments.append(segment)
    columns = [Column(chosen=path[-1]) for path in paths]
    _fill_cells(columns, segments, diff=mode != "plain")
    _label(conversation, columns, segments)
    return Comparison(split=split, columns=columns, mode="plain" if mode == "plain" else "diff")


def _fill_cells(columns: list[Column], segments: list[list[Message]], *, diff: bool) -> None:
    """Each column's cells, row by row; with ``diff``, every cell against the first
    column's (and the first column marked with what the second removed)."""
    base = [readable_text(m.parts) for m in segments[0][:MAX_ROWS]]
    first_cells: list[SafeString] = [escape(text) for text in base]
    for index, (column, segment) in enumerate(zip(columns, segments, strict=True)):
        shown, column.more = segment[:MAX_ROWS], max(0, len(segment) - MAX_ROWS)
        for row, message in enumerate(shown):
            if index == 0:
                column.cells.append(Cell(message, first_cells[row]))
                continue
            text = readable_text(message.parts)
            if not diff or row >= len(base):
                column.cells.append(Cell(message, escape(text)))
                continue
            a, b = base[row].split(), text.split()
            if (
                max(len(a), len(b)) >= REWRITE_MIN_WORDS
                and SequenceMatcher(a=a, b=b, autojunk=False).ratio() < REWRITE_BELOW
            ):
                # Marked on the rewrite; the first column's cell stays as it is.
                column.cells.append(Cell(message, escape(text), rewritten=True))
                continue
            old, new = word_diff(base[row], text)
            if index == 1:
                first_cells[row] = old  # the first column shows what the second removed
            column.cells.append(Cell(message, new))
    for row, cell in enumerate(columns[0].cells):
        cell.text = first_cells[row]


def _label(
    conversation: Conversation, columns: list[Column], segments: list[list[Message]]
) -> None:
    """Version (n of m among the alternatives where the paths part), model and whether
    the current path runs through each column."""
    firsts = [segment[0] for segment in segments]
    versions = selectors.sibling_positions(conversation=conversation, messages=firsts)
    on_path: set[uuid.UUID] = set()
    if conversation.tip_id is not None:
        tip_path = selectors.message_path(
            conversation_id=conversation.pk, tip_id=conversation.tip_id
        )
        on_path = {m.pk for m in tip_path}
    for column, segment, first in zip(columns, segments, firsts, strict=True):
        found = versions.get(first.pk)
        column.version = (found.index + 1, len(found.ids)) if found else None
        column.current = first.pk in on_path
        column.model = next(
            (
                str(m.metadata.get("model"))
                for m in reversed(segment)
                if m.role == "assistant" and m.metadata.get("model")
            ),
            "",
        )


def recent_leaves(*, conversation: Conversation, limit: int = 30) -> list[Message]:
    """The newest leaves (messages nothing continues), to pick two branches from."""
    children = Message.objects.filter(parent_id=OuterRef("pk"))
    return list(
        Message.objects.filter(conversation=conversation)
        .filter(~Exists(children))
        .only("id", "role", "depth", "created_at", "parts", "conversation_id")
        .order_by("-created_at", "-id")[:limit]
    )


def parse_ids(values: list[str]) -> list[uuid.UUID] | None:
    """Distinct message ids in the order given, or None when one is not a UUID."""
    ids: list[uuid.UUID] = []
    for value in values:
        try:
            mid = uuid.UUID(value)
        except ValueError:
            return None
        if mid not in ids:
            ids.append(mid)
    return ids
