"""Compaction for a conversation: build what the model sees, record it, reuse it.

The ladder itself (compaction.ladder) is pure; this module feeds it a path from the
tree, a renderer and a summariser, and keeps the results as records anchored at the last
message they cover. The tree is never rewritten (DESIGN.md invariant 8).
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from functools import partial
from typing import Any

from django.core.cache import cache
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from compaction.estimate import Calibration
from compaction.ladder import (
    CompactionError,
    ContextView,
    LadderResult,
    ModelInfo,
    RungReport,
    detach_pages,
    reactive,
    run_ladder,
)
from compaction.models import (
    CompactionJob,
    CompactionRecord,
    JobState,
    ModelCalibration,
    RecordStatus,
    SnapshotPage,
    Trigger,
)
from conversations import services as tree_services
from conversations.models import Conversation, Message
from conversations.providers import ModelSpec, Request, make_provider
from conversations.resume import ResumeReport

# Compact when the next request's estimate crosses this share of the room for input.
THRESHOLD = 0.8
# Ids of messages that exist only in memory (a turn not yet persisted).
PENDING = "pending:"
# Told what a compaction is doing, e.g. {"stage": "OCR", "done": 2, "total": 5}.
Progress = Callable[[dict[str, Any]], None]


def _quiet(progress: dict[str, Any]) -> None:
    pass


# --- calibration ---------------------------------------------------------------------


def calibration_get(model_id: str) -> tuple[Calibration, int | None]:
    row = ModelCalibration.objects.filter(model=model_id).first()
    if row is None:
        return Calibration(), None
    return Calibration(factor=row.factor, samples=row.samples), row.reported_limit


def _calibration_save(model_id: str, calibration: Calibration, **extra: Any) -> None:
    ModelCalibration.objects.update_or_create(
        model=model_id,
        defaults={"factor": calibration.factor, "samples": calibration.samples, **extra},
    )


def calibration_observe(*, model_id: str, raw_estimate: int, measured: int) -> Calibration:
    """Learn from the provider's measured input tokens for a request we estimated."""
    calibration, _ = calibration_get(model_id)
    calibration = calibration.observe(raw_estimate, measured)
    _calibration_save(model_id, calibration)
    return calibration


def calibration_overflow(
    *, model_id: str, raw_estimate: int, measured: int | None, limit: int | None
) -> Calibration:
    """Learn from a ContextOverflow: the provider counted ``measured`` for a request we
    estimated at ``raw_estimate``, and its window is ``limit``."""
    calibration, reported = calibration_get(model_id)
    if measured:
        calibration = calibration.after_overflow(raw_estimate, measured)
    _calibration_save(model_id, calibration, reported_limit=limit or reported)
    return calibration


def model_info(spec: ModelSpec, reported_limit: int | None = None) -> ModelInfo:
    """What the ladder is told about the model. A window the provider reported in an
    overflow error beats the declared one: every request, summaries included, must fit
    the window the provider actually enforces."""
    info = ModelInfo.from_spec(spec)
    if reported_limit and reported_limit < info.context_window:
        info = replace(info, context_window=reported_limit)
    return info


def model_budget(spec: ModelSpec, reported_limit: int | None = None) -> int:
    """The default budget: 80% of the window (or of the smaller window a provider
    reported in an overflow error) less the output reserved for the answer."""
    window = min(spec.context_window, reported_limit or spec.context_window)
    return max(1, int(THRESHOLD * (window - spec.max_output)))


# --- renderer and summariser ---------------------------------------------------------


class CapturingRenderer:
    """The renderer for a model's billing rule, keeping the pages it drew (by PNG hash)
    so legibility can be measured on the very pages the model will see."""

    def __init__(self, rule: str) -> None:
        from compaction.render import render_pages

        self.rule = rule
        self.render = partial(render_pages, rule=rule)
        self.pages: dict[str, Any] = {}

    def __call__(self, segments: Any, **options: Any) -> Any:
        from compaction.render import cache_key

        # Pages are cached by the hash of their text and settings (same key, same
        # pixels): the ladder retries the snapshot with smaller tails, and branches
        # below one point share a middle.
        density = options.get("density", "default")
        key = "render:" + cache_key(segments, rule=self.rule, density=density)
        key += f":{options.get('max_pages')}"
        result = cache.get(key)
        if result is None:
            result = self.render(segments, **options)
            cache.set(key, result, timeout=3600)
        for page in result.pages:
            self.pages[hashlib.sha256(page.png).hexdigest()] = page
        return result


def renderer_for(spec: ModelSpec) -> CapturingRenderer | None:
    return CapturingRenderer(spec.image_billing) if spec.vision else None


def pages_measure_ocr(
    *, record: CompactionRecord, render: CapturingRenderer | None, progress: Progress = _quiet
) -> None:
    """Store tesseract's character error rate on each page of the record (slow: about a
    second a page, so jobs do it, not requests). Without tesseract nothing is stored."""
    if render is None:
        return
    from compaction.render import ocr_cer

    pages = list(record.pages.all())
    for done, page in enumerate(pages):
        progress({"stage": "OCR", "done": done, "total": len(pages)})
        drawn = render.pages.get(page.blob_id)
        if drawn is not None:
            value = ocr_cer(drawn)
            if value is not None:
                SnapshotPage.objects.filter(pk=page.pk).update(ocr_cer=value)


@dataclass
class Summarizer:
    """One model call per ladder request, through the conversation's own provider."""

    spec: ModelSpec
    calls: list[dict[str, Any]] = field(default_factory=list)

    def __call__(self, prompt: list[dict[str, Any]]) -> str:
        system = "\n".join(p["text"] for m in prompt if m["role"] == "system" for p in m["parts"])
        messages = [m for m in prompt if m["role"] != "system"]
        started = time.monotonic()
        with make_provider(self.spec) as provider:
            reply = provider.complete(Request(messages=messages, system=system))
        self.calls.append(
            {
                "seconds": round(time.monotonic() - started, 3),
                "usage": reply.usage.as_dict() if reply.usage else None,
                "system": system,
            }
        )
        return reply.text


# --- building a context --------------------------------------------------------------


@dataclass
class ContextResult:
    messages: list[dict[str, Any]]
    budget: int
    estimate: int
    fits: bool
    reports: list[dict[str, Any]] = field(default_factory=list)
    record: CompactionRecord | None = None
    reused: bool = False
    resume: ResumeReport = field(default_factory=ResumeReport)
    # The view the estimate was taken of (calibration, system prompt and all).
    view: ContextView | None = None


def report_dict(report: RungReport) -> dict[str, Any]:
    return {
        "rung": report.rung,
        "tokens_before": report.tokens_before,
        "tokens_after": report.tokens_after,
        "saved": report.saved,
        "model_calls": report.model_calls,
        "replaced": [
            {"message": r.message_id, "kind": r.kind, "with": r.replaced_with}
            for r in report.replaced
        ],
        "details": dict(report.details),
    }


def _reusable_record(
    conversation: Conversation, spec: ModelSpec, path_ids: Sequence[str]
) -> CompactionRecord | None:
    """The newest ready record whose anchor lies on this path (so its view stands for
    the path up to the anchor); a branch that leaves the path above it does not match."""
    on_path = set(path_ids)
    # Anchors first (a record's view can be large), then the one record that matches.
    anchors = CompactionRecord.objects.filter(
        conversation=conversation, model=spec.id, status=RecordStatus.READY
    ).order_by("-created_at", "-pk")
    for pk, anchor_id in anchors.values_list("pk", "anchor_id"):
        if str(anchor_id) in on_path:
            return CompactionRecord.objects.get(pk=pk)
    return None


def context_build(
    *,
    conversation: Conversation,
    spec: ModelSpec,
    tip_id: uuid.UUID | None,
    budget: int | None = None,
    trigger: str = Trigger.MANUAL,
    allow_summary: bool = True,
    measure_ocr: bool = False,
    compact: bool = True,
    progress: Progress = _quiet,
) -> ContextResult:
    """What the model sees for the path to ``tip_id``: the path itself when it fits,
    else a reusable record's view plus what follows it, else the ladder's result
    (recorded, with its pages in the blob store).

    ``compact=False`` only reads: it never runs the ladder (no record, no rendering, no
    model call) and answers with what the next request would start from (a reusable
    record's view, else the path) and whether that fits. The browser's context panel
    shows this on a GET."""
    from conversations.turns import transcript_for_model

    # A read-only look (compact=False) writes nothing, not even a dropped checkpoint.
    messages, resume = transcript_for_model(
        conversation=conversation, tip_id=tip_id, drop_checkpoints=compact
    )
    calibration, reported = calibration_get(spec.id)
    budget = budget or model_budget(spec, reported)
    model = model_info(spec, reported)

    def view_of(items: Sequence[dict[str, Any]]) -> ContextView:
        return ContextView.build(
            items,
            budget_tokens=budget,
            model=model,
            calibration=calibration,
            system=conversation.system_prompt,
        )

    view = view_of(messages)
    if view.fits():
        return ContextResult(messages, budget, view.estimate(), True, resume=resume, view=view)
    ids = [m["id"] for m in messages]
    record = _reusable_record(conversation, spec, ids)
    if record is not None:
        after = messages[ids.index(str(record.anchor_id)) + 1 :]
        reused = view_of([*record.view, *after])
        if reused.fits() or not compact:
            return ContextResult(
                list(reused.messages), budget, reused.estimate(), reused.fits(),
                record=record, reused=True, resume=resume, view=reused,
            )  # fmt: skip
    if not compact:
        return ContextResult(messages, budget, view.estimate(), False, resume=resume, view=view)
    # Compact from the originals: pages are always drawn from the archived text.
    assert tip_id is not None  # an empty path always fits
    record, compacted = compaction_run(
        conversation=conversation,
        spec=spec,
        view=view,
        anchor_id=tip_id,
        trigger=trigger,
        summarize=Summarizer(spec) if allow_summary else None,
        measure_ocr=measure_ocr,
        progress=progress,
    )
    ready = record.status == RecordStatus.READY
    return ContextResult(
        compacted if ready else messages,
        budget,
        record.tokens_after,
        ready and record.tokens_after <= budget,
        reports=record.rungs,
        record=record,
        resume=resume,
        view=view_of(compacted) if ready else view,
    )


def compaction_run(
    *,
    conversation: Conversation,
    spec: ModelSpec,
    view: ContextView,
    anchor_id: uuid.UUID,
    trigger: str,
    summarize: Summarizer | None,
    overflow: tuple[int | None, int | None] | None = None,
    measure_ocr: bool = False,
    progress: Progress = _quiet,
) -> tuple[CompactionRecord, list[dict[str, Any]]]:
    """Run the ladder and keep the result as a record; also return the compacted
    messages (including any not yet persisted, named ``pending:…``, which the stored
    view leaves out: a record only ever stands for messages of the tree).

    The slow part (rendering, model calls) happens outside any transaction; the record,
    its pages and their blobs are written together at the end, so a failure leaves no
    record in use."""
    started = time.monotonic()
    render = renderer_for(spec)
    draw, ask = _reporting(render, summarize, progress)
    progress({"stage": "ladder"})
    try:
        if overflow is not None:
            result: LadderResult = reactive(
                view,
                measured_tokens=overflow[0],
                limit=overflow[1],
                render=draw,
                summarize=ask,
            )
        else:
            result = run_ladder(view, render=draw, summarize=ask)
    except (CompactionError, Exception) as exc:
        failed = CompactionRecord.objects.create(
            conversation=conversation,
            anchor_id=anchor_id,
            model=spec.id,
            trigger=trigger,
            status=RecordStatus.FAILED,
            budget_tokens=view.budget_tokens,
            tokens_before=view.estimate(),
            error=f"{type(exc).__name__}: {exc}",
            model_calls=len(summarize.calls) if summarize else 0,
            finished_at=timezone.now(),
        )
        return failed, list(view.messages)
    compacted, pngs = detach_pages(result.view)
    stored = [m for m in compacted.messages if not str(m["id"]).startswith(PENDING)]
    reports = [report_dict(r) for r in result.reports]
    summary_report = next((r for r in result.reports if r.rung == "summary"), None)
    progress({"stage": "saving", "pages": len(pngs)})
    with transaction.atomic():
        blobs = {
            sha: tree_services.blob_store(owner=conversation.owner, data=png)
            for sha, png in pngs.items()
        }
        record = CompactionRecord.objects.create(
            conversation=conversation,
            anchor_id=anchor_id,
            head_end_id=_head_end(result, conversation),
            model=spec.id,
            trigger=trigger,
            status=RecordStatus.READY,
            budget_tokens=view.budget_tokens,
            tokens_before=view.estimate(),
            tokens_after=result.view.estimate(),
            rungs=reports,
            view=stored,
            model_calls=result.model_calls,
            summary=str(summary_report.details.get("summary", "")) if summary_report else "",
            summary_model=spec.id if summary_report else "",
            summary_prompt=(summarize.calls[0]["system"] if summarize and summarize.calls else ""),
            timings={"seconds": round(time.monotonic() - started, 3)},
            finished_at=timezone.now(),
        )
        pages = [
            SnapshotPage(
                record=record,
                index=part["snapshot_page"]["index"],
                blob=blobs[part["blob"]],
                width=part["width"],
                height=part["height"],
                billed_tokens=part["snapshot_page"]["billed_tokens"],
                chars=part["snapshot_page"]["chars"],
                text_hash=part["blob"],
                first_message_id=part["snapshot_page"]["first_message_id"],
                last_message_id=part["snapshot_page"]["last_message_id"],
            )
            for message in compacted.messages
            for part in message["parts"]
            if part.get("type") == "image" and "snapshot_page" in part
        ]
        SnapshotPage.objects.bulk_create(pages)
    if measure_ocr:
        pages_measure_ocr(record=record, render=render, progress=progress)
    return record, list(compacted.messages)


def _reporting(
    render: CapturingRenderer | None, summarize: Summarizer | None, progress: Progress
) -> tuple[Any, Any]:
    """The renderer and summariser as the ladder calls them, telling ``progress`` what
    they are doing. A renderer draws all of a middle's pages in one call, so rendering
    reports how many pages each attempt drew, not a page at a time."""
    attempts: list[int] = []

    def draw(segments: Any, **options: Any) -> Any:
        assert render is not None
        progress({"stage": "rendering pages", "attempt": len(attempts) + 1, "pages": sum(attempts)})
        result = render(segments, **options)
        attempts.append(len(result.pages))
        progress({"stage": "rendering pages", "attempt": len(attempts), "pages": sum(attempts)})
        return result

    def ask(prompt: list[dict[str, Any]]) -> str:
        assert summarize is not None
        progress({"stage": "summary", "calls": len(summarize.calls) + 1})
        return summarize(prompt)

    return (draw if render else None), (ask if summarize else None)


def _head_end(result: LadderResult, conversation: Conversation) -> Any:
    """The last head message of the rung that split the view (snapshot or summary), when
    it is a stored message of this conversation (not an earlier record's synthetic one)."""
    for report in result.reports:
        head_last = report.details.get("head_last_id")
        if head_last:
            try:
                pk = uuid.UUID(str(head_last))
            except ValueError:
                return None
            found = Message.objects.filter(pk=pk, conversation=conversation).exists()
            return pk if found else None
    return None


def estimate_request(
    *, conversation: Conversation, spec: ModelSpec, messages: Sequence[Any]
) -> tuple[int, int, int]:
    """(raw estimate, calibrated estimate, budget) of a request of these messages."""
    calibration, reported = calibration_get(spec.id)
    budget = model_budget(spec, reported)
    view = ContextView.build(
        messages,
        budget_tokens=budget,
        model=model_info(spec, reported),
        calibration=calibration,
        system=conversation.system_prompt,
    )
    return view.raw_tokens, view.estimate(), budget


def record_measured(*, record: CompactionRecord, input_tokens: int) -> None:
    """The provider's count for the first real request built from this record."""
    CompactionRecord.objects.filter(pk=record.pk, measured_next_tokens__isnull=True).update(
        measured_next_tokens=input_tokens
    )


# --- jobs ----------------------------------------------------------------------------


def job_enqueue(
    *, conversation: Conversation, anchor_id: uuid.UUID, model_id: str, trigger: str
) -> CompactionJob | None:
    """Queue a compaction after the current transaction commits. One open job per
    anchor and model: a second call while one is queued or running does nothing."""
    from compaction.tasks import run_compaction_job

    open_job = CompactionJob.objects.filter(
        conversation=conversation,
        anchor_id=anchor_id,
        model=model_id,
        state__in=[JobState.QUEUED, JobState.RUNNING],
    ).first()
    if open_job is not None:
        return None
    job = CompactionJob.objects.create(
        conversation=conversation, anchor_id=anchor_id, model=model_id, trigger=trigger
    )
    # Robust: a job that fails records it on its row (job_run), and the request that
    # queued it (it runs inside that request without a broker) must not fail with it.
    transaction.on_commit(lambda: run_compaction_job.delay(str(job.pk)), robust=True)
    return job


def job_claim(*, job_id: Any, lease_seconds: int) -> CompactionJob | None:
    """Take the job if it is queued, or running with an expired lease (its worker died):
    one guarded UPDATE, so two deliveries of the same task never both run it."""
    now = timezone.now()
    claimable = Q(state=JobState.QUEUED) | Q(state=JobState.RUNNING, lease_until__lt=now)
    claimed = CompactionJob.objects.filter(claimable, pk=job_id).update(
        state=JobState.RUNNING,
        attempts=F("attempts") + 1,
        lease_until=now + timedelta(seconds=lease_seconds),
    )
    if not claimed:
        return None
    return CompactionJob.objects.select_related("conversation", "conversation__owner").get(
        pk=job_id
    )


def job_run(*, job: CompactionJob) -> CompactionRecord | None:
    """Build the context for the job's anchor, writing each stage to ``job.progress`` as
    it starts (the browser polls it) and the outcome at the end."""
    from conversations.providers import resolve_model

    def progress(stage: dict[str, Any]) -> None:
        CompactionJob.objects.filter(pk=job.pk).update(progress=stage, updated_at=timezone.now())

    try:
        spec = resolve_model(job.model)
        result = context_build(
            conversation=job.conversation,
            spec=spec,
            tip_id=job.anchor_id,
            trigger=job.trigger,
            measure_ocr=True,
            progress=progress,
        )
    except Exception as exc:
        CompactionJob.objects.filter(pk=job.pk).update(
            state=JobState.FAILED, error=f"{type(exc).__name__}: {exc}"
        )
        raise
    record = result.record
    failed = record is not None and record.status == RecordStatus.FAILED
    CompactionJob.objects.filter(pk=job.pk).update(
        state=JobState.FAILED if failed else JobState.DONE,
        record=record,
        error=record.error if failed and record else "",
        progress={
            "stage": "done",
            "fits": result.fits,
            "estimate": result.estimate,
            "budget": result.budget,
        },
    )
    return record
