"""Compaction for a conversation: build what the model sees, record it, reuse it.

The ladder itself (compaction.ladder) is pure; this module feeds it a path from the
tree, a renderer and a summariser, and keeps the results as records anchored at the last
message they cover. The tree is never rewritten (DESIGN.md invariant 8).
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta
from functools import cached_property, partial
from typing import Any, TypeVar

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.cache import cache
from django.db import transaction
from django.db.models import F, Q
from django.db.models.functions import Now
from django.utils import timezone

from arbor.heartbeat import Heartbeat, db_now
from arbor.procs import process_gone, process_identity
from compaction.estimate import (
    Calibration,
    Limits,
    as_message,
    iter_images,
    margin_tokens,
    message_tokens,
)
from compaction.ladder import (
    CompactionError,
    ContextView,
    LadderResult,
    ModelInfo,
    RungReport,
    SummaryTooLong,
    detach_pages,
    fit_images,
    reactive,
    run_ladder,
)
from compaction.models import (
    CalibrationEvent,
    CompactionJob,
    CompactionRecord,
    JobState,
    ModelCalibration,
    RecordStatus,
    SnapshotPage,
    Trigger,
)
from conversations import services as tree_services
from conversations.errors import ArborError, TooManyRequests
from conversations.models import Blob, Conversation, Message
from conversations.providers import ContextOverflow, ModelSpec, Request, ToolSpec, make_provider
from conversations.resume import ResumeReport
from conversations.tools import tools_for

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


log = logging.getLogger("arbor.compaction")

# Events kept per model (settings shows the newest).
CALIBRATION_HISTORY = 50


def _calibration_event(
    model_id: str, kind: str, raw: int, before: float, after: float, **numbers: Any
) -> None:
    CalibrationEvent.objects.create(
        model=model_id, kind=kind, raw_estimate=max(0, raw), factor_before=before,
        factor_after=after, **numbers,
    )  # fmt: skip
    stale = CalibrationEvent.objects.filter(model=model_id).order_by("-created_at", "-pk")
    old = list(stale.values_list("pk", flat=True)[CALIBRATION_HISTORY : CALIBRATION_HISTORY + 50])
    if old:
        CalibrationEvent.objects.filter(pk__in=old).delete()


def calibration_observe(
    *, model_id: str, raw_estimate: int, measured: int, known: Calibration | None = None
) -> Calibration:
    """Learn from the provider's measured input tokens for a request we estimated.

    Every turn and gateway request does this, so the common case is one UPDATE that
    applies only if nobody learned in between (factor and sample count still those the
    request was estimated with, ``known``; read first when not given); otherwise (a
    concurrent observation, or no row yet) it is read again under a lock and saved."""
    if known is None or not known.samples:
        row = ModelCalibration.objects.filter(model=model_id).values("factor", "samples").first()
        known = Calibration(factor=row["factor"], samples=row["samples"]) if row else None
    applied = 0
    if known is not None:
        before = known.factor
        calibration = known.observe(raw_estimate, measured)
        applied = ModelCalibration.objects.filter(
            model=model_id, samples=known.samples, factor=before
        ).update(factor=calibration.factor, samples=calibration.samples, updated_at=timezone.now())
    if not applied:
        with transaction.atomic():
            locked = ModelCalibration.objects.select_for_update().filter(model=model_id).first()
            current = (
                Calibration(factor=locked.factor, samples=locked.samples)
                if locked is not None
                else Calibration()
            )
            before = current.factor
            calibration = current.observe(raw_estimate, measured)
            _calibration_save(model_id, calibration)
    # The first few, and any that moved the factor by more than 1%.
    if abs(calibration.factor - before) > 0.01 * before or calibration.samples <= 3:
        _calibration_event(
            model_id, "measured", raw_estimate, before, calibration.factor, measured=measured
        )
    return calibration


def calibration_overflow(
    *, model_id: str, raw_estimate: int, measured: int | None, limit: int | None
) -> Calibration:
    """Learn from a ContextOverflow: the provider counted ``measured`` for a request we
    estimated at ``raw_estimate``, and its window is ``limit``. What is kept is one more
    (bounded) observation: the retry itself takes the rejected request's own ratio
    (ladder.reactive), but one odd overflow message must not pin the factor for every
    later request of the model."""
    calibration, reported = calibration_get(model_id)
    before = calibration.factor
    if measured:
        calibration = calibration.observe(raw_estimate, measured)
    _calibration_save(model_id, calibration, reported_limit=limit or reported)
    _calibration_event(
        model_id, "overflow", raw_estimate, before, calibration.factor, measured=measured,
        limit=limit,
    )  # fmt: skip
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


def window_ceiling(spec: ModelSpec, reported_limit: int | None = None) -> int:
    """The most a request may be estimated at: the window (or the smaller one a provider
    reported) less the reserved output and the estimator's margin. No request Arbor
    sends, a harness's included, is larger."""
    window = min(spec.context_window, reported_limit or spec.context_window)
    return max(1, window - spec.max_output - margin_tokens(window))


def budget_by_parts(spec: ModelSpec, reported_limit: int | None, fixed: int) -> int:
    """The threshold for a request whose fixed part (system prompt, tool definitions and
    the head every request repeats verbatim, a harness's injected context included) is
    ``fixed`` calibrated tokens: the fixed part plus THRESHOLD of the room the history
    has below the window (less the reserved output and the estimator's margin). A
    harness's fixed part can be most of the window; a threshold taken of the whole
    window would leave the history no room at all. Never below ``model_budget`` nor
    above the window's ceiling."""
    ceiling = window_ceiling(spec, reported_limit)
    by_parts = fixed + THRESHOLD * max(0, ceiling - fixed)
    return max(1, min(max(ceiling, 1), max(model_budget(spec, reported_limit), int(by_parts))))


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


_T = TypeVar("_T")


def pages_to_measure(pages: list[_T], limit: int) -> list[_T]:
    """At most ``limit`` of ``pages``, the first and the last among them, evenly spread."""
    if limit <= 0:
        return []
    if len(pages) <= limit:
        return pages
    if limit == 1:
        return pages[:1]
    step = (len(pages) - 1) / (limit - 1)
    return [pages[round(i * step)] for i in range(limit)]


def pages_measure_ocr(
    *, record: CompactionRecord, render: CapturingRenderer | None, progress: Progress = _quiet
) -> None:
    """Store tesseract's character error rate on pages of the record: at most
    ``ARBOR_OCR_MAX_PAGES``, spread evenly from the first to the last (slow: seconds a
    dense page, so jobs do it, not requests). Without tesseract nothing is stored."""
    if render is None:
        return
    from compaction.render import ocr_cer

    pages = pages_to_measure(list(record.pages.all()), settings.ARBOR_OCR_MAX_PAGES)
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
        # The ladder sized the prompt for this much output: asking for more (the model's
        # max_output) could push prompt + output over the window.
        max_output = next(
            (
                int(m["metadata"]["max_output"])
                for m in prompt
                if isinstance(m.get("metadata"), dict) and m["metadata"].get("max_output")
            ),
            None,
        )
        started = time.monotonic()
        try:
            with make_provider(self.spec) as provider:
                reply = provider.complete(
                    Request(messages=messages, system=system, max_output=max_output)
                )
        except ContextOverflow as exc:
            # The ladder packs the request again, smaller (its estimate undercounted).
            raise SummaryTooLong(exc.measured_tokens, exc.limit) from exc
        self.calls.append(
            {
                "seconds": round(time.monotonic() - started, 3),
                "usage": reply.usage.as_dict() if reply.usage else None,
                "system": system,
            }
        )
        return reply.text


# --- building a context: the one entry point --------------------------------------


class InputTooLarge(ArborError):
    """The new input alone (with the system prompt and tools) is over the budget: no
    compaction of the history can make room for it, so no model call is spent."""

    status = 413
    code = "context_overflow"


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
    # The view the estimate was taken of (calibration, system prompt, tools and all);
    # its ``source`` holds the originals, which overflow recovery starts from again.
    view: ContextView | None = None
    # A read-only build needs a summary to fit (and was not allowed to make one).
    needs_summary: bool = False
    # Image bytes not in the blob store (pages and recompressed images of a read-only
    # build), by sha256: ``load_blob`` serves them before the store.
    inline: dict[str, bytes] = field(default_factory=dict)

    def load_blob(self, sha256: str) -> bytes:
        if sha256 in self.inline:
            return self.inline[sha256]
        return tree_services.blob_read(sha256)

    @property
    def rungs(self) -> list[str]:
        return [r["rung"] for r in self.reports]


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
        "details": {k: v for k, v in report.details.items() if k != "summary"},
    }


def compacts(rungs: Sequence[str]) -> bool:
    """Whether any rung beyond rung 0 (fitting images to the provider) was applied:
    the request is then no longer the originals, and worth keeping as a record."""
    return bool(set(rungs) - {"image_limits"})


def _covers(messages: Sequence[dict[str, Any]]) -> set[str]:
    return {
        str(mid)
        for m in messages
        for mid in (m.get("metadata") or {}).get("compaction", {}).get("covers", ())
    }


def _reusable_record(
    conversation: Conversation, spec: ModelSpec, path_ids: Sequence[str], budget: int
) -> CompactionRecord | None:
    """The newest ready record that is what the ladder would answer for this path at
    this budget: its anchor lies on the path, everything it covers is on the path up to
    the anchor (a record that covered a turn still in memory is not), and it was made
    for a budget at least as large as this one (a record made to squeeze into a smaller
    budget compacted more than this request needs)."""
    position = {mid: i for i, mid in enumerate(path_ids)}
    # Anchors first (a record's view can be large), then the one record that matches.
    anchors = CompactionRecord.objects.filter(
        conversation=conversation,
        model=spec.id,
        status=RecordStatus.READY,
        budget_tokens__gte=budget,
    ).order_by("-created_at", "-pk")
    for pk, anchor_id in anchors.values_list("pk", "anchor_id"):
        at = position.get(str(anchor_id))
        if at is None:
            continue
        record = CompactionRecord.objects.get(pk=pk)
        if all(position.get(mid, at + 1) <= at for mid in _covers(record.view)):
            return record
    return None


def _limits(spec: ModelSpec) -> Limits:
    from compaction.render import REQUEST_LIMITS

    limits = REQUEST_LIMITS.get(spec.image_billing)
    if limits is None:
        return Limits()
    return Limits(
        max_images=limits.max_images,
        max_image_bytes=limits.max_image_bytes,
        max_request_bytes=limits.max_request_bytes,
    )


def _blob_sizes(messages: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Bytes of every stored image on the path (one query), for the per-image and
    per-request byte limits."""
    shas = {str(p["blob"]) for m in messages for p in iter_images(m["parts"]) if p.get("blob")}
    if not shas:
        return {}
    return dict(Blob.objects.filter(pk__in=shas).values_list("sha256", "size"))


def tool_dicts(tools: Sequence[Any]) -> tuple[dict[str, Any], ...]:
    """Tool definitions as the estimator counts them (what the provider is sent)."""
    return tuple(t if isinstance(t, dict) else asdict(ToolSpec.coerce(t)) for t in tools)


# The archived path to a tip as a model may receive it, and what resume trimming did.
Archived = tuple[list[dict[str, Any]], ResumeReport]


def _originals(
    conversation: Conversation,
    tip_id: uuid.UUID | None,
    pending: Sequence[dict[str, Any]],
    *,
    drop_checkpoints: bool,
    archived: Archived | None = None,
) -> tuple[list[dict[str, Any]], ResumeReport]:
    """The archived path to ``tip_id`` (trimmed to a valid boundary; ``archived`` when
    the caller loaded it already) followed by the turn still in memory, its messages
    named ``pending:<n>``."""
    if archived is None:
        archived = tree_services.transcript_resume(
            conversation=conversation, tip_id=tip_id, drop_checkpoints=drop_checkpoints
        )
    messages, resume = list(archived[0]), archived[1]
    messages += [
        {"id": f"{PENDING}{i}", "role": m["role"], "parts": m["parts"], "metadata": {}}
        for i, m in enumerate(pending)
    ]
    return messages, resume


def _context_view(
    conversation: Conversation,
    spec: ModelSpec,
    originals: list[dict[str, Any]],
    *,
    budget: int | None,
    system: str | None,
    tools: Sequence[Any],
    recall: bool = True,
) -> ContextView:
    """The view of the originals the ladder starts from: the model as the provider
    enforces it, the learned calibration, and everything else the request carries."""
    calibration, reported = calibration_get(spec.calibration_key)
    return ContextView.build(
        originals,
        budget_tokens=budget or model_budget(spec, reported),
        model=model_info(spec, reported),
        calibration=calibration,
        system=conversation.system_prompt if system is None else system,
        tools=tool_dicts(tools),
        limits=_limits(spec),
        blob_sizes=_blob_sizes(originals),
        recall=recall,
    )


@dataclass
class _ContextBuild:
    """One ``context_build``: its view of the originals and the ways it can answer."""

    conversation: Conversation
    spec: ModelSpec
    view: ContextView
    originals: list[dict[str, Any]]
    resume: ResumeReport
    compact: bool
    shrink: ImageShrinker

    @cached_property
    def ids(self) -> list[str]:
        return [m["id"] for m in self.originals]

    def answer(self, result: LadderResult, **extra: Any) -> ContextResult:
        """The result as a provider-ready request. A compacting build stores its new
        images (pages, recompressed images) as blobs; a read-only one serves them inline."""
        fitted, inline = detach_pages(result.view)
        if self.compact and inline:
            _store_images(self.conversation, inline)
            inline = {}
        return ContextResult(
            list(fitted.messages), self.view.budget_tokens, result.view.estimate(), result.fits,
            reports=[report_dict(r) for r in result.reports], resume=self.resume,
            view=result.view, inline=inline, **extra,
        )  # fmt: skip

    def reuse(
        self, free: LadderResult | None = None, *, made_for: int | None = None
    ) -> ContextResult | None:
        """The reusable record's view plus what follows its anchor, when there is a record
        and that still fits; None otherwise. A summary record never displaces free rungs
        that fit (``free``): a summary is the last rung. ``made_for``: the smallest budget
        the record may have been made for (default: this build's; a stepped compaction's
        target, since between steps any record that still fits is the answer, however
        the threshold moved with the calibration)."""
        least = self.view.budget_tokens if made_for is None else made_for
        record = _reusable_record(self.conversation, self.spec, self.ids, least)
        if record is None or (free is not None and free.fits and "summary" in record.rung_names):
            return None
        after = self.originals[self.ids.index(str(record.anchor_id)) + 1 :]
        reused = replace(self.view, messages=(*(as_message(m) for m in record.view), *after))
        reused, _ = fit_images(reused, shrink=self.shrink)
        if not reused.fits():
            return None
        result = LadderResult(replace(reused, source=self.view.source), (), True)
        return self.answer(result, record=record, reused=True)

    def preview(self, free: LadderResult, *, pages: bool) -> ContextResult:
        """A read-only build: the free rungs when they fit, else (with ``pages``) the
        snapshot drawn in memory, saying when only a summary would fit. Without pages,
        whether they would do is unknown."""
        if free.fits or not pages:
            return self.answer(free)
        preview = run_ladder(self.view, render=renderer_for(self.spec), shrink=self.shrink)
        return self.answer(preview, needs_summary=not preview.fits)


def context_build(
    *,
    conversation: Conversation,
    spec: ModelSpec,
    tip_id: uuid.UUID | None,
    pending: Sequence[dict[str, Any]] = (),
    archived: Archived | None = None,
    tools: Sequence[Any] = (),
    budget: int | None = None,
    target: int | None = None,
    system: str | None = None,
    trigger: str = Trigger.MANUAL,
    allow_summary: bool = True,
    compact: bool = True,
    preview_pages: bool = True,
    measure_ocr: bool = False,
    progress: Progress = _quiet,
    recall: bool = True,
) -> ContextResult:
    """What the model sees for the path to ``tip_id`` plus ``pending`` (a turn still in
    memory) at ``budget``: the one way the turn engine, the context API, the browser's
    panel and compaction jobs build a request.

    Always computed from the archived originals: the free rungs when they fit, else a
    reusable record (the cached answer for this path at this budget) plus what follows
    its anchor, else the whole ladder, recorded, with its pages in the blob store.

    ``compact=False`` only reads: no record, no blob, no dropped checkpoint, no model
    call. It answers with what the next request would be: the free rungs, a reusable
    record, or (with ``preview_pages``) the snapshot drawn in memory; when only a
    summary would fit, ``needs_summary`` says so.

    ``archived`` is the path to ``tip_id`` as ``tree_services.transcript_resume``
    gives it, when the caller has it: the rounds of one turn load it once.

    ``target`` (below ``budget``) is how far a compaction goes when one runs: the record
    still answers for ``budget``, so the requests that follow reuse it, their prefix
    byte-identical, until what they add no longer fits (compaction in steps, for the
    provider's prompt cache; the gateway's hysteresis). ``system`` is the system prompt
    the request carries, when not the conversation's own. ``recall=False``: the model has
    no tool to fetch originals (the gateway's harnesses), so no header says it can."""
    originals, resume = _originals(
        conversation, tip_id, pending, drop_checkpoints=compact, archived=archived
    )
    view = _context_view(
        conversation, spec, originals, budget=budget, system=system, tools=tools, recall=recall
    )
    if pending and pending[0]["role"] == "user":
        _refuse_oversized_input(view, len(originals) - len(pending))
    build = _ContextBuild(conversation, spec, view, originals, resume, compact, ImageShrinker())
    stepped = target is not None and target < view.budget_tokens
    if stepped:
        # Between the steps of a stepped compaction the step's record is what keeps the
        # prefix stable, summary or not: it is looked for before the free rungs run over
        # the whole path (each request of a long session would pay for them).
        hit = build.reuse(made_for=target)
        if hit is not None:
            return hit
    free = run_ladder(view, shrink=build.shrink)
    if free.fits and not compacts(free.rungs):
        return build.answer(free)  # the originals fit (their images fitted to the provider)
    if not stepped:
        hit = build.reuse(free)
        if hit is not None:
            return hit
    if not compact:
        return build.preview(free, pages=preview_pages)
    if tip_id is None:
        return build.answer(free)  # nothing archived yet to anchor a record on
    record, compacted = compaction_run(
        conversation=conversation,
        spec=spec,
        view=replace(view, budget_tokens=target) if stepped and target else view,
        anchor_id=tip_id,
        trigger=trigger,
        summarize=Summarizer(spec) if allow_summary else None,
        measure_ocr=measure_ocr,
        progress=progress,
        record_budget=view.budget_tokens,
    )
    return _from_record(record, compacted, resume)


def _from_record(
    record: CompactionRecord, compacted: ContextView, resume: ResumeReport
) -> ContextResult:
    """The result of a compaction that just ran. A failed one answers with the view it
    was given, marked as not fitting (the record says why)."""
    if record.status != RecordStatus.READY:
        return ContextResult(
            list(compacted.messages), compacted.budget_tokens, compacted.estimate(), False,
            reports=[], record=record, resume=resume, view=compacted,
        )  # fmt: skip
    return ContextResult(
        list(compacted.messages), compacted.budget_tokens, compacted.estimate(),
        compacted.fits(),
        reports=record.rungs, record=record, resume=resume, view=compacted,
    )  # fmt: skip


def context_after_overflow(
    *,
    conversation: Conversation,
    spec: ModelSpec,
    tip_id: uuid.UUID | None,
    sent: ContextResult,
    overflow: ContextOverflow,
) -> ContextResult:
    """Reactive compaction after the provider rejected the request ``sent`` as too
    large: the estimator learns the provider's numbers, and the ladder runs again from
    the originals (never from the rejected, maybe compacted, view) down to the limit the
    provider reported, less the margin. Raises ``overflow`` again when no smaller request
    can be made, so the rejected payload is never resent."""
    assert sent.view is not None
    calibration_overflow(
        model_id=spec.calibration_key,
        raw_estimate=sent.view.raw_tokens,
        measured=overflow.measured_tokens,
        limit=overflow.limit,
    )
    if tip_id is None:
        raise overflow  # nothing archived to compact: the new input alone is too big
    # The rejected request, with the originals it was built from as its source.
    rejected = replace(
        sent.view,
        budget_tokens=min(sent.view.budget_tokens, model_budget(spec, overflow.limit)),
        model=model_info(spec, overflow.limit),
    )
    record, compacted = compaction_run(
        conversation=conversation,
        spec=spec,
        view=rejected,
        anchor_id=tip_id,
        trigger=Trigger.REACTIVE,
        summarize=Summarizer(spec),
        overflow=(overflow.measured_tokens, overflow.limit),
    )
    if record.status != RecordStatus.READY:
        raise overflow
    return _from_record(record, compacted, sent.resume)


def _refuse_oversized_input(view: ContextView, at: int) -> None:
    """413 before any compaction when the system prompt, the tools and the new user
    message (``view.messages[at]``) are over the budget on their own: no rung shortens
    a user's words, so nothing can make room (the rest of a long agent turn can still
    be compacted)."""
    fixed = replace(view, messages=view.messages[at : at + 1], source=())
    if fixed.estimate() > view.budget_tokens:
        raise InputTooLarge(
            f"the new message alone is about {fixed.estimate()} tokens, over the "
            f"{view.budget_tokens}-token budget of {view.model.context_window}-token window",
            estimate=fixed.estimate(),
            budget=view.budget_tokens,
        )


class ImageShrinker:
    """Rung 0's recompression: an image over the provider's byte limit re-encoded as
    JPEG, downscaled until it fits. The bytes ride along in the part (``data``) until
    the request is kept: stored as a blob by a compacting build, served inline by a
    read-only one."""

    def __call__(self, part: dict[str, Any], cap: int) -> dict[str, Any] | None:
        import io

        from PIL import Image

        try:
            data = tree_services.blob_read(str(part.get("blob")))
            with Image.open(io.BytesIO(data)) as opened:
                image = opened.convert("RGB")
        except (Blob.DoesNotExist, OSError, ValueError):
            return None
        scale = 1.0
        for _ in range(8):
            size = (max(1, int(image.width * scale)), max(1, int(image.height * scale)))
            buffer = io.BytesIO()
            image.resize(size).save(buffer, format="JPEG", quality=85, optimize=True)
            out = buffer.getvalue()
            if len(out) <= cap:
                return {
                    "type": "image",
                    "blob": hashlib.sha256(out).hexdigest(),
                    "mime": "image/jpeg",
                    "width": size[0],
                    "height": size[1],
                    "data": out,
                    "recompressed_from": part.get("blob"),
                }
            scale *= 0.7
        return None


def _store_images(conversation: Conversation, inline: dict[str, bytes]) -> None:
    for data in inline.values():
        tree_services.blob_store(owner=conversation.owner, data=data)


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
    record_budget: int | None = None,
) -> tuple[CompactionRecord, ContextView]:
    """Run the ladder from the originals (``view.source``) and keep the result as a
    record; also return the compacted view (including any messages not yet persisted,
    named ``pending:…``, which the stored view leaves out: a record only ever stands for
    messages of the tree). A failed run returns ``view`` itself.

    The slow part (rendering, model calls) happens outside any transaction; the record,
    its pages and their blobs are written together at the end, so a failure leaves no
    record in use. ``record_budget`` is the budget the record answers for when the
    ladder ran to a lower target (see context_build)."""
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
                shrink=ImageShrinker(),
            )
        else:
            result = run_ladder(
                view,
                render=draw,
                summarize=ask,
                shrink=ImageShrinker(),
                ceiling=record_budget,
            )
        if not compacts([r.rung for r in result.reports]):
            # Nothing applied (no middle to page, nothing to elide): no record stands
            # for this step, or the audit would list a compaction that never happened.
            raise CompactionError(f"no rung applied at {view.budget_tokens} tokens")
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
        return failed, view
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
            budget_tokens=max(view.budget_tokens, record_budget or 0),
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
    return record, compacted


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


def usage_observe(*, spec: ModelSpec, context: ContextResult, usage: Any) -> None:
    """Learn from the provider's count of a request built by ``context_build``: the raw
    estimate of exactly what was sent (messages, system prompt, tool definitions,
    images) against the measured input tokens. The first request built from a record
    also tells the record (the audit shows it next to the estimate)."""
    if usage is None or not usage.input_tokens or context.view is None:
        return
    calibration_observe(
        model_id=spec.calibration_key,
        raw_estimate=context.view.raw_tokens,
        measured=usage.input_tokens,
        # What the request was estimated with: unchanged, the UPDATE needs no read first.
        known=context.view.calibration,
    )
    if context.record is not None:
        record_measured(record=context.record, input_tokens=usage.input_tokens)


def compaction_enqueue_if_due(
    *,
    conversation: Conversation,
    spec: ModelSpec,
    tip_id: uuid.UUID,
    tools: Sequence[Any] = (),
    last: ContextResult | None = None,
    appended: Sequence[dict[str, Any]] = (),
) -> CompactionJob | None:
    """Proactive compaction: when the next request from ``tip_id`` crosses the threshold
    (it fits only after a rung, or not at all) and no record is there to reuse, build
    it in a job (a Celery worker, or in-process without a broker). The record the job
    keeps is reused by the requests that follow, so their prefix stays the same.

    ``last`` (the turn's last request, sent as the originals) plus ``appended`` (what
    the turn added after it) answers the common case without reading the path again."""
    view = last.view if last is not None else None
    # The last request went out as the originals (no record, no rung beyond rung 0).
    as_is = last is not None and last.record is None and not compacts(last.rungs)
    if as_is and view is not None:
        upcoming_raw = view.raw_tokens + sum(message_tokens(m, rule=view.rule) for m in appended)
        if view.calibration.apply(upcoming_raw) <= view.budget_tokens:
            return None
    upcoming = context_build(
        conversation=conversation,
        spec=spec,
        tip_id=tip_id,
        tools=tools,
        compact=False,
        preview_pages=False,
    )
    if upcoming.reused or (upcoming.fits and not compacts(upcoming.rungs)):
        return None
    return job_enqueue(
        conversation=conversation, anchor_id=tip_id, model_id=spec.id, trigger=Trigger.PROACTIVE
    )


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
    anchor and model: a second call while one is queued or running does nothing, unless
    that job is stranded (its worker died with the lease expired, or it has waited in
    the queue past ARBOR_JOB_REQUEUE_SECONDS: a lost send, a server killed before its
    thread took the job); then it is sent again, and returned. The claim is a guarded
    UPDATE, so a job sent twice still runs once.

    The check and the INSERT run under a lock on the owner's row: two enqueues at the
    same moment (two tabs, a turn's proactive check beside "Compact now") neither pass
    the user's limit together nor both insert a job for one anchor."""
    with transaction.atomic():
        get_user_model().objects.select_for_update().filter(pk=conversation.owner_id).exists()
        return _job_enqueue_locked(
            conversation=conversation, anchor_id=anchor_id, model_id=model_id, trigger=trigger
        )


def _job_enqueue_locked(
    *, conversation: Conversation, anchor_id: uuid.UUID, model_id: str, trigger: str
) -> CompactionJob | None:
    from arbor.jobs import job_dispatch
    from compaction.tasks import run_compaction_job

    open_job = CompactionJob.objects.filter(
        conversation=conversation,
        anchor_id=anchor_id,
        model=model_id,
        state__in=[JobState.QUEUED, JobState.RUNNING],
    ).first()
    if open_job is not None:
        if not _stranded(open_job):
            return None
        stranded = str(open_job.pk)
        transaction.on_commit(lambda: job_dispatch(run_compaction_job, stranded), robust=True)
        return open_job
    busy = jobs_open_for_owner(conversation.owner_id)
    if busy >= settings.ARBOR_COMPACTION_MAX_OPEN:
        if trigger != Trigger.MANUAL:
            return None  # proactive: the next turn asks again; the turn is never refused
        raise TooManyRequests(
            f"you have {busy} compaction jobs waiting or running (the limit is "
            f"{settings.ARBOR_COMPACTION_MAX_OPEN}): wait for one to finish",
            code="too_many_jobs",
        )
    job = CompactionJob.objects.create(
        conversation=conversation, anchor_id=anchor_id, model=model_id, trigger=trigger
    )
    # Robust: a job that fails records it on its row (job_run), and the request that
    # queued it (it may run inside that request without a broker) must not fail with it.
    transaction.on_commit(lambda: job_dispatch(run_compaction_job, str(job.pk)), robust=True)
    return job


def jobs_open_for_owner(owner_id: Any) -> int:
    """The user's compaction jobs waiting or running, touched in the last hour (a job a
    dead process left behind stops counting then; the sweeper ends it anyway)."""
    return CompactionJob.objects.filter(
        conversation__owner_id=owner_id,
        state__in=[JobState.QUEUED, JobState.RUNNING],
        updated_at__gte=timezone.now() - timedelta(hours=1),
    ).count()


def job_stranded(job: CompactionJob) -> bool:
    """No worker has this job: queued past ARBOR_JOB_REQUEUE_SECONDS (no worker running,
    a lost send), or running with its worker dead (the lease passed, or the process is
    gone from this host)."""
    return job.state in (JobState.QUEUED, JobState.RUNNING) and _stranded(job)


def job_run_now(*, job: CompactionJob) -> CompactionRecord | None:
    """Run a stranded job here and now (the user asked, and waits). The claim is the same
    guarded UPDATE as a worker's, so a worker that takes it meanwhile wins and this does
    nothing."""
    claimed = job_claim(job_id=job.pk)
    if claimed is None:
        return None
    return job_run(job=claimed)


def _stranded(job: CompactionJob, now: datetime | None = None) -> bool:
    """Queued and not sent for a requeue time, or running with its worker dead. Leases
    are judged by the database's clock, the one they are written with (arbor.heartbeat);
    ``now`` is that clock's time when the caller has read it already."""
    if job.state == JobState.RUNNING:
        now = now or db_now()
        expired = job.lease_until is not None and job.lease_until < now
        return expired or (bool(job.worker) and process_gone(job.worker))
    # Queued: its updated_at is the time it was last sent, by the clock of the host that
    # sent it (a send again is harmless, the claim is guarded).
    return timezone.now() - job.updated_at > timedelta(seconds=settings.ARBOR_JOB_REQUEUE_SECONDS)


class JobBusy(Exception):
    """The job runs elsewhere, its lease held by a live worker: try again after
    ``retry_in`` seconds (it is done by then, or its worker has died)."""

    def __init__(self, retry_in: float) -> None:
        super().__init__(f"the job is running elsewhere; retry in {retry_in:.0f} s")
        self.retry_in = retry_in


def job_claim(*, job_id: Any, lease_seconds: int | None = None) -> CompactionJob | None:
    """Take the job for this process if it is queued, or running with its worker dead
    (lease passed, or the process gone from this host): one guarded UPDATE, so two
    deliveries of the same task never both run it. None when there is nothing to run
    (done, failed, gone, or taken by another delivery just now). Raises JobBusy while a
    live worker holds it. A job whose workers died ARBOR_JOB_MAX_ATTEMPTS times is
    failed with that reason instead of being run again."""
    lease = lease_seconds if lease_seconds is not None else settings.ARBOR_JOB_LEASE_SECONDS
    job = CompactionJob.objects.filter(pk=job_id).first()
    if job is None or job.state not in (JobState.QUEUED, JobState.RUNNING):
        return None
    now = db_now()
    guard = Q(state=JobState.QUEUED)
    if job.state == JobState.RUNNING:
        if not _stranded(job, now):
            assert job.lease_until is not None
            raise JobBusy(max(1.0, (job.lease_until - now).total_seconds() + 1))
        # Taken again only from the dead worker it names, and only if its lease has not
        # moved since it was read (another delivery may have taken it a moment ago; a
        # live worker's renewal in between means it is not dead).
        guard = Q(
            state=JobState.RUNNING,
            worker=job.worker,
            attempts=job.attempts,
            lease_until=job.lease_until,
        )
        if job.attempts >= settings.ARBOR_JOB_MAX_ATTEMPTS:
            CompactionJob.objects.filter(guard, pk=job_id).update(
                state=JobState.FAILED,
                error=f"the worker running this job stopped {job.attempts} times (killed, "
                "out of memory, or restarted); it is not tried again: see the worker logs",
                lease_until=None,
            )
            return None
    claimed = CompactionJob.objects.filter(guard, pk=job_id).update(
        state=JobState.RUNNING,
        attempts=F("attempts") + 1,
        lease_until=now + timedelta(seconds=lease),
        worker=process_identity(),
    )
    if not claimed:
        return None
    return CompactionJob.objects.select_related("conversation", "conversation__owner").get(
        pk=job_id
    )


def _job_lease(job: CompactionJob) -> Heartbeat:
    """Renews a running job's lease on a timer while its work goes on (a long OCR, a
    slow summary call): the lease stays short, so a worker that dies is noticed within
    one lease, while a live one is never taken for dead."""
    lease = timedelta(seconds=settings.ARBOR_JOB_LEASE_SECONDS)
    mine = CompactionJob.objects.filter(pk=job.pk, state=JobState.RUNNING, worker=job.worker)
    return Heartbeat(
        lambda: mine.update(lease_until=Now() + lease),  # the database's clock
        lease.total_seconds() / 4,
        name="arbor-job-lease",
    )


def jobs_sweep() -> dict[str, int]:
    """Send again every job no worker has (queued past the requeue time: a lost send, a
    broker restarted without persistence; running with its worker dead), and end an
    import whose process died. Run by each Celery worker as it starts and then on beat's
    schedule (``manage.py sweep_jobs`` for cron). Sending twice is harmless: the claim
    is guarded, so a job still runs once."""
    from arbor.jobs import job_dispatch
    from compaction.tasks import run_compaction_job
    from conversations.models import ImportJob, ImportState
    from conversations.tasks import run_import_job

    now = timezone.now()
    requeue = now - timedelta(seconds=settings.ARBOR_JOB_REQUEUE_SECONDS)
    sent = 0
    leases_now = db_now()  # once for the sweep, not a query per job
    for job in CompactionJob.objects.filter(state__in=[JobState.QUEUED, JobState.RUNNING]):
        if not _stranded(job, leases_now):
            continue
        # Touched (the next sweep waits a whole requeue time for this send) and sent,
        # only if nobody took it since it was read.
        if CompactionJob.objects.filter(
            pk=job.pk, state=job.state, updated_at=job.updated_at
        ).update(updated_at=now):
            job_dispatch(run_compaction_job, str(job.pk))
            sent += 1
    imports_sent = imports_ended = 0
    for item in ImportJob.objects.filter(state=ImportState.QUEUED, updated_at__lt=requeue):
        if ImportJob.objects.filter(
            pk=item.pk, state=ImportState.QUEUED, updated_at=item.updated_at
        ).update(updated_at=now):
            job_dispatch(run_import_job, str(item.pk))
            imports_sent += 1
    for item in ImportJob.objects.filter(state=ImportState.RUNNING):
        ended = tree_services.import_job_sweep(item, leases_now).state == ImportState.FAILED
        imports_ended += ended
    # Files kept for "import again as copies" go after IMPORT_KEEP_SECONDS.
    kept_until = now - timedelta(seconds=tree_services.IMPORT_KEEP_SECONDS)
    for item in ImportJob.objects.filter(state=ImportState.DONE, updated_at__lt=kept_until).exclude(
        upload=""
    ):
        tree_services.import_job_sweep(item)
    return {"compaction_sent": sent, "imports_sent": imports_sent, "imports_ended": imports_ended}


def job_run(*, job: CompactionJob) -> CompactionRecord | None:
    """Build the context for the job's anchor, writing each stage to ``job.progress`` as
    it starts (the browser polls it) and the outcome at the end."""
    from conversations.providers import resolve_model

    # Every write names this run (its worker and attempt): a run taken for dead and
    # taken over must not overwrite what its successor writes.
    mine = CompactionJob.objects.filter(pk=job.pk, worker=job.worker, attempts=job.attempts)

    def progress(stage: dict[str, Any]) -> None:
        mine.update(progress=stage, updated_at=timezone.now())

    try:
        spec = resolve_model(job.model)
        with _job_lease(job):
            result = context_build(
                conversation=job.conversation,
                spec=spec,
                tip_id=job.anchor_id,
                tools=tools_for(job.conversation),
                trigger=job.trigger,
                measure_ocr=True,
                progress=progress,
            )
    except Exception as exc:
        mine.update(state=JobState.FAILED, error=f"{type(exc).__name__}: {exc}")
        raise
    record = result.record
    failed = record is not None and record.status == RecordStatus.FAILED
    mine.update(
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
