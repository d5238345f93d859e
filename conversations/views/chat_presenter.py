"""What the chat screen shows: which stretch of a branch, and beside each message its
versions (``◀ n/m ▶``), checkpoints, forks and sub-agent runs. Reads go through the
selectors; the views in ``chat.py`` only pick what to ask for.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from conversations import forms, selectors, turns
from conversations.exporters import EXPORT_FORMATS
from conversations.models import AttemptStatus, Checkpoint, Conversation, Message
from conversations.selectors import Siblings, User

CHAT_WINDOW = 300  # messages a chat view around a search hit (or ?all=1 past it) shows
# The chat opens with the last CHAT_FIRST messages of the branch; scrolling up loads
# CHAT_CHUNK more at a time (HTMX "revealed"), each read without the rest of the path.
CHAT_FIRST = 50
CHAT_CHUNK = 50
FOCUS_CONTEXT = 20  # messages shown above a search hit that lies before the window


@dataclass(frozen=True)
class ChatMarks:
    """The marks the chat puts beside a message, by message id."""

    checkpoints: dict[uuid.UUID, list[Checkpoint]]
    forks: dict[uuid.UUID, list[Conversation]]
    spawned: dict[uuid.UUID, list[Conversation]]


def _marks(conv: Conversation) -> tuple[ChatMarks, list[Conversation]]:
    """The conversation's checkpoints, forks and sub-agent runs by the message they hang
    from (two queries), and its forks as a list."""
    checkpoints: dict[uuid.UUID, list[Checkpoint]] = defaultdict(list)
    for cp in selectors.checkpoint_list(conversation=conv):
        checkpoints[cp.message_id].append(cp)
    forks: dict[uuid.UUID, list[Conversation]] = defaultdict(list)
    spawned: dict[uuid.UUID, list[Conversation]] = defaultdict(list)
    fork_list, spawned_list = selectors.conversation_offspring(conversation=conv)
    for f in fork_list:
        if f.forked_from_id:
            forks[f.forked_from_id].append(f)
    for s in spawned_list:
        if s.spawned_by_id:
            spawned[s.spawned_by_id].append(s)
    return ChatMarks(checkpoints, forks, spawned), fork_list


# The first line of a rewind's digest as the model reads it (services.checkpoint_rewind):
# the chat shows it as a badge with a link instead of the raw message id.
_DIGEST_HEADER = "[Rewound to checkpoint "


def _rewind(m: Message) -> tuple[dict[str, Any] | None, list[dict[str, Any]] | None]:
    """For a rewind's digest: its checkpoint and the explored branch's tip (the badge),
    and its parts without the header line; (None, None) for any other message."""
    if m.origin != "digest":
        return None, None
    abandoned = m.metadata.get("abandoned_tip")
    try:
        tip = uuid.UUID(abandoned) if isinstance(abandoned, str) else None
    except ValueError:
        tip = None
    mark = {"label": m.metadata.get("checkpoint", ""), "abandoned_tip": tip}
    parts = list(m.parts)
    first = parts[0] if parts else {}
    text = first.get("text") if first.get("type") == "text" else None
    if isinstance(text, str) and text.startswith(_DIGEST_HEADER):
        parts[0] = {**first, "text": text.partition("\n")[2]}
    return mark, parts


def _row(m: Message, sib: Siblings | None, marks: ChatMarks) -> dict[str, Any]:
    """One message of the chat with its neighbours among its versions and its marks."""
    index = sib.index if sib else 0
    ids = sib.ids if sib else []
    rewind, parts = _rewind(m)
    return {
        "rewind": rewind,
        "parts": parts,  # what to show when not the message's own parts (a digest's)
        "m": m,
        "sib": sib,
        "sib_n": index + 1 if sib else 0,
        "prev": ids[index - 1] if sib and index > 0 else None,
        "next": ids[index + 1] if sib and index + 1 < len(ids) else None,
        "others": [i for i in ids if i != m.id][:3],
        "checkpoints": marks.checkpoints.get(m.id, []),
        "forks": marks.forks.get(m.id, []),
        "spawned": marks.spawned.get(m.id, []),
    }


def chat_rows(
    conv: Conversation, path: list[Message]
) -> tuple[list[dict[str, Any]], list[Conversation]]:
    """What the chat shows beside each message of ``path`` (its versions, checkpoints,
    forks and sub-agent runs), and the conversation's forks."""
    siblings = selectors.sibling_positions(conversation=conv, messages=path)
    marks, fork_list = _marks(conv)
    return [_row(m, siblings.get(m.id), marks) for m in path], fork_list


@dataclass(frozen=True)
class ChatWindow:
    """The stretch of a branch the chat shows: ``path``, with ``earlier`` messages above
    it and ``later`` below it left out; ``leaf`` is where the branch ends."""

    path: list[Message]
    leaf: uuid.UUID | None
    earlier: int = 0
    later: int = 0


def chat_window(conv: Conversation, *, focus: uuid.UUID | None, show_all: bool) -> ChatWindow:
    """The current branch or, given a ``focus`` message off it, the branch through that
    message (shown only: the tip stays where it is)."""
    if focus is None and not show_all:
        # The common case: the last messages of the branch, read without the rest of it.
        path = selectors.message_path_tail(
            conversation_id=conv.pk, tip_id=conv.tip_id, limit=CHAT_FIRST
        )
        return ChatWindow(path, conv.tip_id, earlier=path[0].depth if path else 0)
    leaf = conv.tip_id
    if focus is not None:
        leaf = selectors.message_branch_leaf(conversation=conv, message_id=focus)
    path = selectors.message_path(conversation_id=conv.pk, tip_id=leaf)
    if len(path) <= CHAT_WINDOW or show_all:
        return ChatWindow(path, leaf)
    earlier, later = len(path) - CHAT_WINDOW, 0
    if focus is not None:
        # The window moves back to the message asked for, with some context above it;
        # the messages below the window are counted, not shown.
        at = next(i for i, m in enumerate(path) if m.id == focus)
        earlier = min(earlier, max(0, at - FOCUS_CONTEXT))
        later = len(path) - earlier - CHAT_WINDOW
    return ChatWindow(path[earlier : earlier + CHAT_WINDOW], leaf, earlier, later)


def _provenance(conv: Conversation, user: User) -> tuple[Conversation | None, Conversation | None]:
    """The conversations this one was forked from and spawned by (one query, none for
    a conversation that is neither)."""
    if not (conv.forked_from_id or conv.spawned_by_id):
        return None, None
    above = [i for i in (conv.forked_from_id, conv.spawned_by_id) if i]
    found = selectors.fork_origins(user=user, message_ids=above)
    origin = found.get(conv.forked_from_id) if conv.forked_from_id else None
    spawner = found.get(conv.spawned_by_id) if conv.spawned_by_id else None
    return origin, spawner


def last_turn(conv: Conversation, leaf: uuid.UUID | None) -> dict[str, Any]:
    """The conversation's last turn, when it failed (or its process died) or is running
    now: what was asked, and why it failed (the page offers to run it again) or what it
    has streamed so far (the page shows it and follows it, with Stop). Survives a
    reload and a restart: attempts are rows."""
    last = selectors.turn_attempt_last(conversation=conv)
    if last is None or last.status == AttemptStatus.COMPLETED:
        return {"failed": None, "running": None}
    prompt = " ".join(p.get("text", "") for p in last.input_parts if p.get("type") == "text")
    if last.status == AttemptStatus.FAILED or turns.attempt_is_stale(last):
        error = last.error_text or last.error_code or "the turn was interrupted"
        return {"failed": {"prompt": prompt, "error": error}, "running": None}
    running = {
        "attempt": last.pk,
        "prompt": prompt,
        "text": (last.live or {}).get("text", ""),
        "tools": (last.live or {}).get("tools", []),
        # It continues the branch shown: its question and answer show below it.
        "here": last.parent_id == leaf,
        "stopping": last.stop_requested_at is not None,
    }
    return {"failed": None, "running": running}


def chat_context(
    conv: Conversation,
    *,
    user: User,
    show_all: bool,
    notice: str = "",
    focus: uuid.UUID | None = None,
) -> dict[str, Any]:
    """The chat screen's context: the window of the branch (see ``chat_window``), its
    rows, where the conversation came from, and the forms the page offers."""
    window = chat_window(conv, focus=focus, show_all=show_all)
    rows, fork_list = chat_rows(conv, window.path)
    origin, spawner = _provenance(conv, user)
    return {
        "conversation": conv,
        "rows": rows,
        "earlier": window.earlier,
        "first": window.path[0].id if window.path else None,
        "later": window.later,
        "tip": conv.tip_id,
        "leaf": window.leaf,
        "focus": focus,
        "elsewhere": window.leaf != conv.tip_id,
        "origin": origin,
        "spawner": spawner,
        "forks": fork_list,
        "notice": notice,
        "message_form": forms.MessageForm(),
        "settings_form": forms.ConversationForm(
            initial={"title": conv.title, "model": conv.model, "system_prompt": conv.system_prompt},
            current_model=conv.model,
        ),
        "export_formats": EXPORT_FORMATS,
        "fork_form": forms.ForkForm(),
        **last_turn(conv, window.leaf),
    }
