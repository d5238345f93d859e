"""What a resumed transcript may send to a model. Pure: no database here.

A stored path can end mid-turn (an import of an aborted session, a tip moved onto a tool
call) or hold unpaired tool traffic in the middle (an aborted agent step that the user
continued after). Providers reject both. ``resume_view`` trims the end back to the most
recent valid boundary and, in the middle, leaves out the unpaired parts; the tree itself
is never changed, and everything left out is reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class MessageLike(Protocol):
    @property
    def id(self) -> Any: ...
    @property
    def role(self) -> str: ...
    @property
    def parts(self) -> list[dict[str, Any]]: ...


@dataclass
class ViewMessage:
    """A message as the model will see it (parts possibly reduced)."""

    id: Any
    role: str
    parts: list[dict[str, Any]]
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class ResumeReport:
    trimmed: list[str] = field(default_factory=list)  # trailing message ids cut off
    repaired: list[dict[str, str]] = field(default_factory=list)  # middle parts left out

    @property
    def changed(self) -> bool:
        return bool(self.trimmed or self.repaired)


def _metadata(message: MessageLike) -> dict[str, Any]:
    return dict(getattr(message, "metadata", None) or {})


def _calls(message: MessageLike) -> list[str]:
    return [p["id"] for p in message.parts if p.get("type") == "tool_call"]


def _results(message: MessageLike) -> list[str]:
    return [p["call_id"] for p in message.parts if p.get("type") == "tool_result"]


def _pairing(path: Sequence[MessageLike]) -> tuple[dict[int, set[str]], dict[int, set[str]]]:
    """For each index: the call ids with no result right after, and the result ids with
    no call right before. A call's results live in the tool messages that directly follow
    its assistant message."""
    unanswered: dict[int, set[str]] = {}
    orphaned: dict[int, set[str]] = {}
    i = 0
    while i < len(path):
        message = path[i]
        if message.role == "tool":
            orphaned[i] = set(_results(message))
            i += 1
            continue
        calls = set(_calls(message)) if message.role == "assistant" else set()
        j = i + 1
        answered: set[str] = set()
        while j < len(path) and path[j].role == "tool":
            bad = {cid for cid in _results(path[j]) if cid not in calls or cid in answered}
            answered.update(set(_results(path[j])) & calls)
            if bad:
                orphaned[j] = bad
            j += 1
        if calls - answered:
            unanswered[i] = calls - answered
        i = j
    return unanswered, orphaned


def resume_view(path: Sequence[MessageLike]) -> tuple[list[ViewMessage], ResumeReport]:
    report = ResumeReport()
    unanswered, orphaned = _pairing(path)
    # 1. Trim from the end to the most recent valid boundary: drop a trailing unanswered
    # call, a trailing orphaned result, and a trailing group of results whose assistant
    # message still has a call without its result.
    end = len(path)
    while end > 0:
        last = end - 1
        if last in unanswered or last in orphaned:
            end = last
            continue
        if path[last].role == "tool":
            owner = last
            while owner >= 0 and path[owner].role == "tool":
                owner -= 1
            if owner >= 0 and owner in unanswered:
                end = owner
                continue
        break
    report.trimmed = [str(m.id) for m in path[end:]]
    # 2. In the middle, leave out unpaired parts (and messages left with none).
    view: list[ViewMessage] = []
    for i, message in enumerate(path[:end]):
        drop_calls = unanswered.get(i, set())
        drop_results = orphaned.get(i, set())
        if not drop_calls and not drop_results:
            view.append(
                ViewMessage(message.id, message.role, list(message.parts), _metadata(message))
            )
            continue
        parts = [
            p
            for p in message.parts
            if not (p.get("type") == "tool_call" and p["id"] in drop_calls)
            and not (p.get("type") == "tool_result" and p["call_id"] in drop_results)
        ]
        for cid in sorted(drop_calls):
            report.repaired.append({"message": str(message.id), "left_out": f"tool call {cid}"})
        for cid in sorted(drop_results):
            report.repaired.append({"message": str(message.id), "left_out": f"tool result {cid}"})
        if parts:
            view.append(ViewMessage(message.id, message.role, parts, _metadata(message)))
    return view, report
