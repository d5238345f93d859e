"""The compaction screens (DESIGN.md §5, §7): the staff audit of every record, and each
owner's "what the model saw" panel with its records and compaction jobs.

The same conventions as the conversation screens, through the helpers both share
(conversations/views/common.py): a fragment for an HTMX request and the whole page otherwise
(history restores included), ``Vary: HX-Request``, lookups through owner-scoped selectors
(another user's object is a 404 like a missing one), and the audit for staff only (403
for everyone else).
"""

from __future__ import annotations

import contextlib
from typing import Any

from django.conf import settings
from django.contrib import messages as flash
from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.http import FileResponse, Http404, HttpRequest, HttpResponse, HttpResponseBase
from django.shortcuts import redirect, render
from django.utils.html import format_html
from django.views.decorators.http import require_GET, require_POST

from compaction import selectors, services
from compaction.forms import AuditFilterForm
from compaction.models import CompactionJob, CompactionRecord, JobState, Trigger
from conversations import selectors as tree_selectors
from conversations.errors import NotFound, TooManyRequests
from conversations.models import Blob, Conversation
from conversations.views.common import (
    HtmxHttpRequest,
    blob_response,
    conversation_or_404,
    is_fragment,
    render_page_or_fragment,
)

# --- helpers -------------------------------------------------------------------------


def _require_staff(request: HttpRequest) -> None:
    if not request.user.is_staff:
        raise PermissionDenied("staff only")


def _audit_record(request: HttpRequest, rid: str) -> CompactionRecord:
    _require_staff(request)
    try:
        return selectors.record_get(record_id=rid)
    except NotFound:
        raise Http404("no such record") from None


def _own_record(request: HttpRequest, cid: str, rid: str) -> CompactionRecord:
    conversation = conversation_or_404(request, cid)
    try:
        return selectors.record_get(record_id=rid, conversation=conversation)
    except NotFound:
        raise Http404("no such record") from None


def _blob_response(blob: Blob | None) -> FileResponse:
    if blob is None:
        raise Http404("no such page")
    return blob_response(blob)


def _record_page(request: HttpRequest, record: CompactionRecord, scope: str) -> HttpResponse:
    """One record, originals next to what the model saw: for staff (``scope="audit"``)
    or for the conversation's owner (``scope="owner"``), with image URLs to match."""
    return render(
        request,
        "compaction/audit_detail.html",
        {
            "scope": scope,
            "record": record,
            "conversation": record.conversation,
            "here": "context",
            "originals": selectors.record_originals(record=record),
            "view": record.view if isinstance(record.view, list) else [],
            "pages": selectors.record_pages(record=record),
            "rungs": record.rungs if isinstance(record.rungs, list) else [],
        },
    )


# --- the audit (staff) ---------------------------------------------------------------


@login_required
@require_GET
def audit_list(request: HtmxHttpRequest) -> HttpResponse:
    """Records across users. Bad filter values answer 400 with the form's errors and no
    records, as the other forms do."""
    _require_staff(request)
    form = AuditFilterForm(request.GET or None)
    page = None
    status = 200
    if form.is_bound and not form.is_valid():
        status = 400
    else:
        records = selectors.audit_records(**(form.cleaned_data if form.is_bound else {}))
        page = Paginator(records, 50).get_page(request.GET.get("page"))
    return render_page_or_fragment(
        request, "compaction/audit_list.html", "records", {"form": form, "page": page}, status
    )


@login_required
@require_GET
def audit_detail(request: HtmxHttpRequest, rid: str) -> HttpResponse:
    return _record_page(request, _audit_record(request, rid), "audit")


@login_required
@require_GET
def audit_blob(request: HtmxHttpRequest, rid: str, sha256: str) -> FileResponse:
    """A page image (or another image the record shows), for staff: the blob API only
    serves a blob to the users who uploaded it."""
    record = _audit_record(request, rid)
    return _blob_response(selectors.record_blob(record=record, sha256=sha256))


# --- the owner's context panel, records and jobs ---------------------------------------


@login_required
@require_GET
def context_panel(request: HtmxHttpRequest, cid: str) -> HttpResponse:
    """What the next request would contain, with a token budget gauge, the records on
    the path and the conversation's open compaction jobs. A GET never compacts."""
    conversation = conversation_or_404(request, cid)
    panel = selectors.context_panel(conversation=conversation)
    return render_page_or_fragment(
        request,
        "compaction/context.html",
        "overview",
        {
            "conversation": conversation,
            "here": "context",
            "panel": panel,
            "jobs": selectors.jobs_open(conversation=conversation),
        },
    )


@login_required
@require_POST
def compact(request: HtmxHttpRequest, cid: str) -> HttpResponseBase:
    """Compact now: queue a job for the current tip and answer at once (a worker, or
    without a broker a worker thread, runs it). HTMX gets the job's fragment, which
    polls until the job is done."""
    conversation = conversation_or_404(request, cid)
    if conversation.tip_id is None:
        return HttpResponse("nothing to compact yet", status=400, content_type="text/plain")
    model_id = tree_selectors.model_id_for(conversation)
    try:
        services.job_enqueue(
            conversation=conversation,
            anchor_id=conversation.tip_id,
            model_id=model_id,
            trigger=Trigger.MANUAL,
        )
    except TooManyRequests as exc:
        return _too_many_jobs(request, conversation, exc)
    # The job just queued, or the one already open for this tip and model.
    job = selectors.job_latest(
        conversation=conversation, anchor_id=conversation.tip_id, model_id=model_id
    )
    if not is_fragment(request):
        return redirect("compaction:context", cid=conversation.pk)
    return _job_fragment(request, conversation, job)


def _too_many_jobs(
    request: HtmxHttpRequest, conversation: Conversation, exc: TooManyRequests
) -> HttpResponseBase:
    """The user has as many jobs open as allowed: say so on the panel (a 429 alert for
    HTMX, a flash message on the page otherwise)."""
    if not is_fragment(request):
        flash.error(request, exc.detail)
        return redirect("compaction:context", cid=conversation.pk)
    return HttpResponse(format_html('<p class="error" role="alert">{}</p>', exc.detail), status=429)


@login_required
@require_GET
def job_progress(request: HtmxHttpRequest, cid: str, job_id: str) -> HttpResponse:
    conversation, job = _job_or_404(request, cid, job_id)
    return _job_fragment(request, conversation, job)


def _job_or_404(request: HttpRequest, cid: str, job_id: str) -> tuple[Conversation, CompactionJob]:
    conversation = conversation_or_404(request, cid)
    try:
        return conversation, selectors.job_get(conversation=conversation, job_id=job_id)
    except NotFound:
        raise Http404("no such job") from None


@login_required
@require_POST
def job_run_now(request: HtmxHttpRequest, cid: str, job_id: str) -> HttpResponseBase:
    """Run a job no worker has taken, inside this request."""
    conversation, job = _job_or_404(request, cid, job_id)
    if services.job_stranded(job):
        # A worker may take it between the look and the claim: then it is its job.
        with contextlib.suppress(services.JobBusy):
            services.job_run_now(job=job)
        job.refresh_from_db()
    if not is_fragment(request):
        return redirect("compaction:job", cid=conversation.pk, job_id=job.pk)
    return _job_fragment(request, conversation, job)


def _job_fragment(
    request: HtmxHttpRequest, conversation: Conversation, job: CompactionJob
) -> HttpResponse:
    context: dict[str, Any] = {
        "conversation": conversation,
        "here": "context",
        "job": job,
        "stranded": services.job_stranded(job),
        "broker": bool(settings.CELERY_BROKER_URL),
    }
    response = render_page_or_fragment(request, "compaction/job.html", "job", context)
    if job.state in (JobState.DONE, JobState.FAILED) and is_fragment(request):
        # The panel's gauge and record list refresh themselves on this event.
        response["HX-Trigger"] = "arbor:compacted"
    return response


@login_required
@require_GET
def record_detail(request: HtmxHttpRequest, cid: str, rid: str) -> HttpResponse:
    return _record_page(request, _own_record(request, cid, rid), "owner")


@login_required
@require_GET
def record_blob(request: HtmxHttpRequest, cid: str, rid: str, sha256: str) -> FileResponse:
    """A page image of the owner's own record (the same named-blob check as the audit)."""
    record = _own_record(request, cid, rid)
    return _blob_response(selectors.record_blob(record=record, sha256=sha256))
