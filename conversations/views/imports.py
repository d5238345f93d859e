"""The import screens: upload a transcript (conversations/import.html) and follow the
background job that imports it (conversations/import_job.html)."""

from __future__ import annotations

from django.contrib import messages as flash
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpResponse, HttpResponseBase
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from arbor.heartbeat import db_now
from conversations import forms, selectors, services
from conversations.errors import ArborError, NotFound
from conversations.models import ImportState
from conversations.views.common import (
    HtmxHttpRequest,
    render_page_or_fragment,
    signed_in_user,
)

IMPORT = "conversations/import.html"
RECENT_JOBS = 20  # import jobs the upload page lists


def _import_start(request: HtmxHttpRequest, form: forms.ImportForm) -> HttpResponseBase:
    """Queue the import of the uploaded file and go to its job's page, or show the form
    again with what was wrong."""
    if not form.is_valid():
        return render(request, IMPORT, {"form": form}, status=400)
    try:
        job = services.import_job_create(
            owner=signed_in_user(request),
            upload=form.cleaned_data["file"],
            format=form.cleaned_data["format"],
            on_duplicate="copy" if form.cleaned_data["copies"] else "skip",
        )
    except ArborError as exc:  # the media store is full or read-only
        form.add_error("file", exc.detail)
        return render(request, IMPORT, {"form": form}, status=exc.status)
    return redirect("conversations:import_job", job_id=job.pk)


@login_required
@require_http_methods(["GET", "POST"])
def import_page(request: HtmxHttpRequest) -> HttpResponseBase:
    """Upload a transcript; the import runs as a background job whose page shows its
    progress until it is done."""
    form = forms.ImportForm(request.POST or None, request.FILES or None)
    if request.method == "POST":
        return _import_start(request, form)
    recent = selectors.import_job_list(owner=signed_in_user(request), limit=RECENT_JOBS)
    # A job whose process died is ended here, so the list never shows it running forever
    # (judged by the database's clock, read once for the list).
    now = db_now() if any(job.state == ImportState.RUNNING for job in recent) else None
    jobs = [services.import_job_sweep(job, now) for job in recent]
    return render(request, IMPORT, {"form": form, "jobs": jobs})


@login_required
@require_GET
def import_job(request: HtmxHttpRequest, job_id: str) -> HttpResponse:
    try:
        job = selectors.import_job_get(owner=signed_in_user(request), job_id=job_id)
    except NotFound:
        raise Http404("no such import") from None
    job = services.import_job_sweep(job)
    return render_page_or_fragment(
        request, "conversations/import_job.html", "progress", {"job": job}
    )


@login_required
@require_POST
def import_again(request: HtmxHttpRequest, job_id: str) -> HttpResponseBase:
    """Import the conversations this import skipped (imported before) again, as copies:
    a new job on the same file, which it kept for this."""
    try:
        job = services.import_job_again(owner=signed_in_user(request), job_id=job_id)
    except NotFound:
        raise Http404("no such import") from None
    except ArborError as exc:  # the file is gone, nothing was skipped, too many imports
        flash.error(request, exc.detail)
        return redirect("conversations:import_job", job_id=job_id)
    return redirect("conversations:import_job", job_id=job.pk)
