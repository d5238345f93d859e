"""Resume trimming: a transcript sent to a model never holds unpaired tool traffic."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from conversations.resume import resume_view


@dataclass
class M:
    id: str
    role: str
    parts: list[dict[str, Any]] = field(default_factory=list)


def u(i: str) -> M:
    return M(i, "user", [{"type": "text", "text": i}])


def a(i: str, *calls: str) -> M:
    parts: list[dict[str, Any]] = [{"type": "text", "text": i}]
    parts += [{"type": "tool_call", "id": c, "name": "t", "arguments": {}} for c in calls]
    return M(i, "assistant", parts)


def t(i: str, *call_ids: str) -> M:
    return M(i, "tool", [{"type": "tool_result", "call_id": c, "parts": []} for c in call_ids])


def ids(view: list[Any]) -> list[str]:
    return [m.id for m in view]


def test_a_complete_transcript_is_untouched() -> None:
    path = [u("u1"), a("a1", "c1"), t("t1", "c1"), a("a2")]
    view, report = resume_view(path)
    assert ids(view) == ["u1", "a1", "t1", "a2"]
    assert not report.changed


def test_ending_on_paired_results_is_a_valid_boundary() -> None:
    view, report = resume_view([u("u1"), a("a1", "c1"), t("t1", "c1")])
    assert ids(view) == ["u1", "a1", "t1"] and not report.changed


@pytest.mark.parametrize(
    ("path", "kept", "trimmed"),
    [
        ([u("u1"), a("a1", "c1")], ["u1"], ["a1"]),  # call without result
        ([u("u1"), t("t1", "zz")], ["u1"], ["t1"]),  # result without call
        ([u("u1"), a("a1", "c1", "c2"), t("t1", "c1")], ["u1"], ["a1", "t1"]),  # half answered
        ([u("u1"), a("a1", "c1"), t("t1", "c1"), t("t2", "zz")], ["u1", "a1", "t1"], ["t2"]),
        ([t("t0", "x")], [], ["t0"]),
        ([u("u1"), a("a1", "c1"), t("t1", "c1"), a("a2", "c2")], ["u1", "a1", "t1"], ["a2"]),
    ],
)
def test_it_trims_the_end_to_the_last_valid_boundary(
    path: list[M], kept: list[str], trimmed: list[str]
) -> None:
    view, report = resume_view(path)
    assert ids(view) == kept
    assert report.trimmed == trimmed
    assert report.repaired == []


def test_unpaired_traffic_in_the_middle_is_left_out_not_trimmed() -> None:
    # An aborted step (call c1 never answered) that the user continued after.
    path = [u("u1"), a("a1", "c1"), u("u2"), a("a2", "c2"), t("t2", "c2", "ghost"), a("a3")]
    view, report = resume_view(path)
    assert ids(view) == ["u1", "a1", "u2", "a2", "t2", "a3"]
    assert view[1].parts == [{"type": "text", "text": "a1"}]
    assert [p["call_id"] for p in view[4].parts] == ["c2"]
    assert report.trimmed == []
    assert {r["left_out"] for r in report.repaired} == {"tool call c1", "tool result ghost"}
    # The input is not modified.
    assert len(path[1].parts) == 2
