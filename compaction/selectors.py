"""Reads for the compaction screens: the staff audit across users, and each owner's view
of what the model will see next (DESIGN.md §5, §7). Nothing here runs the ladder or
calls a model."""

from __future__ import annotations

import datetime
import uuid
from dataclasses import dataclass, field
from typing import Any

from django.db.models import QuerySet

from compaction import services
from compaction.ladder import SECTIONS, breakdown
from compaction.models import (
    CalibrationEvent,
    CompactionJob,
    CompactionRecord,
    JobState,
    ModelCalibration,
    SnapshotPage,
)
from conversations import selectors as tree_selectors
from conversations.errors import NotFound
from conversations.models import Blob, Conversation, Message
from conversations.parts import image_blobs
from conversations.providers import ModelSpec, resolve_model
from conversations.tools import tools_for

# --- the audit -----------------------------------------------------------------------


def audit_records(
    *,
    user: str = "",
    conversation: uuid.UUID | None = None,
    status: str = "",
    trigger: str = "",
    rung: str = "",
    model: str = "",
    date_from: datetime.date | None = None,
    date_to: datetime.date | None = None,
) -> QuerySet[CompactionRecord]:
    """Records across users, newest first, each with its conversation and owner (one
    query a page: the list shows both). The views and summaries stay unloaded."""
    records = (
        CompactionRecord.objects.select_related("conversation__owner")
        .defer("view", "summary", "summary_prompt")
        .order_by("-created_at", "-pk")
    )
    if user:
        records = records.filter(conversation__owner__username=user)
    if conversation:
        records = records.filter(conversation_id=conversation)
    for name, value in (("status", status), ("trigger", trigger), ("model", model)):
        if value:
            records = records.filter(**{name: value})
    if rung:
        # ``rungs`` is a JSON list of reports. jsonb containment (``rungs__contains``) is
        # PostgreSQL-only, so match the stored JSON's text, which reads the same on both:
        # json.dumps on SQLite and jsonb's canonical text on PostgreSQL both write the key
        # as ``"rung": "<name>"``, and a quote inside any string value is escaped, so the
        # pattern cannot match inside a summary or a placeholder.
        records = records.filter(rungs__icontains=f'"rung": "{rung}"')
    if date_from:
        records = records.filter(created_at__date__gte=date_from)
    if date_to:
        records = records.filter(created_at__date__lte=date_to)
    return records


def record_get(*, record_id: str, conversation: Conversation | None = None) -> CompactionRecord:
    """A record by id; with ``conversation``, only one of that conversation (the
    owner's screens: another user's record is a NotFound like a missing one)."""
    try:
        rid = uuid.UUID(str(record_id))
    except ValueError:
        raise NotFound(f"no such record: {record_id!r}") from None
    records = CompactionRecord.objects.select_related("conversation", "conversation__owner")
    if conversation is not None:
        records = records.filter(conversation=conversation)
    try:
        return records.get(pk=rid)
    except CompactionRecord.DoesNotExist:
        raise NotFound(f"no such record: {rid}") from None


def record_blob(*, record: CompactionRecord, sha256: str) -> Blob | None:
    """A blob the record's page shows: one of its snapshot pages, an image its view
    names, or an image of the original messages it covers; otherwise None, whatever
    blobs exist (the blob store is shared between users)."""
    named = set(SnapshotPage.objects.filter(record=record).values_list("blob_id", flat=True))
    for message in record.view if isinstance(record.view, list) else []:
        if isinstance(message, dict):
            named.update(image_blobs(message.get("parts") or []))
    if sha256 not in named:
        # Only then read the originals (a path query): pages are the common request.
        for original in record_originals(record=record):
            named.update(image_blobs(original.parts))
    return Blob.objects.filter(sha256=sha256).first() if sha256 in named else None


def record_originals(*, record: CompactionRecord) -> list[Any]:
    """The original messages on the path to the record's anchor."""
    return tree_selectors.message_path(
        conversation_id=record.conversation_id, tip_id=record.anchor_id
    )


def record_pages(*, record: CompactionRecord) -> list[SnapshotPage]:
    return list(SnapshotPage.objects.filter(record=record).order_by("index"))


# --- the owner's context panel --------------------------------------------------------


def records_on_path(
    *, conversation: Conversation, tip_id: uuid.UUID | None
) -> list[CompactionRecord]:
    """The conversation's records anchored on the path to ``tip_id``, newest first.
    (A conversation has few records; its path can be long, so filter in Python rather
    than send every path id to the database.)"""
    if tip_id is None:
        return []
    on_path = {
        mid
        for mid, _ in tree_selectors.message_path_links(
            conversation_id=conversation.pk, tip_id=tip_id
        )
    }
    records = (
        CompactionRecord.objects.filter(conversation=conversation)
        .defer("view", "summary", "summary_prompt")
        .order_by("-created_at", "-pk")
    )
    return [r for r in records if r.anchor_id in on_path]


def jobs_open(*, conversation: Conversation) -> QuerySet[CompactionJob]:
    """Queued and running jobs, oldest first (proactive ones come from turns)."""
    return (
        CompactionJob.objects.filter(
            conversation=conversation, state__in=[JobState.QUEUED, JobState.RUNNING]
        )
        .select_related("record")
        .order_by("created_at")
    )


def job_get(*, conversation: Conversation, job_id: str | uuid.UUID) -> CompactionJob:
    try:
        jid = uuid.UUID(str(job_id))
        return CompactionJob.objects.select_related("record").get(pk=jid, conversation=conversation)
    except (ValueError, CompactionJob.DoesNotExist):
        raise NotFound(f"no such job: {job_id!r}") from None


def job_latest(*, conversation: Conversation, anchor_id: uuid.UUID, model_id: str) -> CompactionJob:
    """The newest job for this anchor and model: the one just queued, or the one already
    open for them (``services.job_enqueue`` queues at most one)."""
    return (
        CompactionJob.objects.filter(conversation=conversation, anchor_id=anchor_id, model=model_id)
        .select_related("record")
        .latest("created_at")
    )


# --- calibration ----------------------------------------------------------------------


@dataclass(frozen=True)
class CalibrationHistory:
    row: ModelCalibration
    events: list[CalibrationEvent]  # the newest first


def calibration_list(
    *, events_per_model: int = 8, events_read: int = 500
) -> list[CalibrationHistory]:
    """How far each model's provider counts from Arbor's estimate, and the newest events
    that taught it (at most ``events_per_model`` each, from the newest ``events_read``:
    two queries, however many events were recorded)."""
    rows = list(ModelCalibration.objects.order_by("model"))
    events: dict[str, list[CalibrationEvent]] = {r.model: [] for r in rows}
    recent = CalibrationEvent.objects.filter(model__in=list(events)).order_by("-created_at", "-pk")
    for event in recent[:events_read]:
        if len(events[event.model]) < events_per_model:
            events[event.model].append(event)
    return [CalibrationHistory(row=r, events=events[r.model]) for r in rows]


# The gauge is drawn in an SVG this many units wide.
GAUGE_WIDTH = 1000
LABELS = {
    "head": "Head (system prompt, first turn)",
    "summary": "Summary",
    "pages": "Snapshot pages",
    "tail": "Tail (recent turns)",
    "images": "Images",
}


@dataclass(frozen=True)
class Section:
    name: str
    label: str
    tokens: int
    x: int  # where its bar starts and how wide it is, in gauge units
    width: int


@dataclass(frozen=True)
class Gauge:
    estimate: int
    budget: int
    window: int
    max_output: int
    fits: bool
    sections: list[Section]
    budget_x: int  # where the budget line is drawn, in gauge units

    @property
    def percent(self) -> int:
        return round(100 * self.estimate / max(1, self.budget))


def gauge_of(context: services.ContextResult, spec: ModelSpec) -> Gauge:
    """The token budget gauge for a built context: its estimate split by section, drawn
    against the budget (or against the estimate, when that is larger)."""
    assert context.view is not None
    tokens = breakdown(context.view)
    scale = max(context.budget, context.estimate, 1)
    sections: list[Section] = []
    x = 0
    for name in SECTIONS:
        width = round(GAUGE_WIDTH * tokens[name] / scale)
        sections.append(Section(name, LABELS[name], tokens[name], x, width))
        x += width
    return Gauge(
        estimate=context.estimate,
        budget=context.budget,
        window=context.view.model.context_window,
        max_output=spec.max_output,
        fits=context.fits,
        sections=sections,
        budget_x=round(GAUGE_WIDTH * context.budget / scale),
    )


@dataclass
class ContextPanel:
    model_id: str
    tip_id: uuid.UUID | None
    spec: ModelSpec | None = None
    context: services.ContextResult | None = None
    gauge: Gauge | None = None
    records: list[CompactionRecord] = field(default_factory=list)
    error: str = ""
    # Gateway conversations: what went upstream for the last request (the answer's
    # metadata), and the record it was built from, with its pages.
    forwarded: dict[str, Any] | None = None
    forwarded_record: CompactionRecord | None = None


def _forwarded(panel: ContextPanel, conversation: Conversation) -> None:
    if not conversation.harness or conversation.tip_id is None:
        return
    tip = Message.objects.filter(pk=conversation.tip_id).only("metadata").first()
    forwarded = (tip.metadata if tip else {}).get("gateway_forwarded")
    if not isinstance(forwarded, dict):
        return
    panel.forwarded = forwarded
    if forwarded.get("record"):
        panel.forwarded_record = (
            CompactionRecord.objects.filter(pk=forwarded["record"], conversation=conversation)
            .prefetch_related("pages")
            .first()
        )


def context_panel(*, conversation: Conversation) -> ContextPanel:
    """What the next request for the conversation's tip would contain, built by the
    same service as the context API but read-only (``compact=False``): a record is
    reused, never made, and no model is called on a GET."""
    panel = ContextPanel(
        model_id=tree_selectors.model_id_for(conversation), tip_id=conversation.tip_id
    )
    panel.records = records_on_path(conversation=conversation, tip_id=conversation.tip_id)
    _forwarded(panel, conversation)
    try:
        panel.spec = resolve_model(panel.model_id)
    except ValueError as exc:
        panel.error = str(exc)
        return panel
    panel.context = services.context_build(
        conversation=conversation,
        spec=panel.spec,
        tip_id=conversation.tip_id,
        tools=tools_for(conversation),
        compact=False,
        # The panel is drawn on every visit: it shows whether the next request needs a
        # new compaction ("Compact now"), not a preview of its pages.
        preview_pages=False,
    )
    panel.gauge = gauge_of(panel.context, panel.spec)
    return panel
