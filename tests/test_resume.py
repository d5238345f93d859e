"""Resume trimming: a transcript sent to a model never holds unpaired tool traffic."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from django.test import TestCase

from conversations.importers import transcript_import
from conversations.models import Conversation, Message
from conversations.resume import resume_view
from conversations.services import transcript_resume
from tests.builders import make_user
from tests.sample_loaders import SAMPLES, requires_samples


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


@requires_samples
class PiSampleResumeTests(TestCase):
    """The real pi session: aborted assistant messages hold tool calls that never got a
    result. A model request built from it must hold none of them."""

    def test_the_aborted_calls_are_left_out_of_what_a_model_is_sent(self) -> None:
        user = make_user()
        report = transcript_import(
            owner_id=user.pk, path=SAMPLES / "pi" / "pi-mono__compact.jsonl", format="pi"
        )
        conversation = Conversation.objects.get(pk=report.conversation_ids[0])
        flagged = [
            m for m in Message.objects.filter(conversation=conversation)
            if m.metadata.get("unpaired_tool_calls")
        ]  # fmt: skip
        assert len(flagged) == 3  # SOURCES.md: 3 tool calls have no result
        messages, resume = transcript_resume(conversation=conversation, tip_id=conversation.tip_id)
        left_out = {r["left_out"] for r in resume.repaired}
        assert len(left_out) == 3 and all(x.startswith("tool call ") for x in left_out)
        calls = {p["id"] for m in messages for p in m["parts"] if p["type"] == "tool_call"}
        results = {p["call_id"] for m in messages for p in m["parts"] if p["type"] == "tool_result"}
        assert calls == results  # every call answered, every result called
        # Nothing was removed from the tree itself.
        assert all(len(m.parts) == len(Message.objects.get(pk=m.pk).parts) for m in flagged)
