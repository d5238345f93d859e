"""The chat screen's turns with the model: send a message, edit a prompt, regenerate an
answer, run a failed turn again. Each answers with Server-Sent Events for
static/arbor.js, or (without JavaScript) runs the turn to its end and shows the
conversation."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from django.contrib import messages as flash
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBase, JsonResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from conversations import forms, services, turns
from conversations.errors import ArborError, InvalidInput
from conversations.models import Conversation, Origin, TurnAttempt
from conversations.streaming import TurnEvent, event_stream, events_primed
from conversations.views.chat import message_action_form
from conversations.views.common import (
    HtmxHttpRequest,
    conversation_or_404,
    detail_url,
    form_error,
    message_or_404,
    signed_in_user,
)


def _wants_stream(request: HttpRequest) -> bool:
    return "text/event-stream" in request.headers.get("Accept", "")


def _refused(exc: ArborError) -> HttpResponse:
    """Bad input, said in plain text before any turn ran."""
    return HttpResponse(exc.detail, status=exc.status, content_type="text/plain")


def _run_turn(
    request: HttpRequest, conv: Conversation, events: Iterator[TurnEvent]
) -> HttpResponseBase:
    """Stream a turn's events, or run it to its end and show the conversation (an
    ``error`` event becomes a flash message)."""
    try:
        primed = events_primed(events)
    except ArborError as exc:
        return _refused(exc)
    if _wants_stream(request):
        return event_stream(request, lambda: primed)
    for event in primed:
        if event["event"] == "error":
            flash.error(request, f"The model failed: {event.get('detail', event['error'])}")
    return redirect(detail_url(conv))


def _turn(
    request: HttpRequest,
    conv: Conversation,
    *,
    parts: Any,
    parent_id: Any,
    origin: str = Origin.TURN,
) -> HttpResponseBase:
    """Run a chat turn from ``parent_id`` with the user's ``parts`` (None: a new answer
    without a new prompt)."""
    events = turns.turn_events(conversation=conv, parts=parts, parent_id=parent_id, origin=origin)
    return _run_turn(request, conv, events)


@login_required
@require_POST
def message_send(request: HtmxHttpRequest, cid: str) -> HttpResponseBase:
    """The composer's message: its text and the images pasted or chosen with it (each
    stored as a blob first, so a file that is not an image is refused before any turn
    runs, naming the file)."""
    conv = conversation_or_404(request, cid)
    form = forms.ComposerForm(request.POST, request.FILES)
    if not form.is_valid():
        return form_error(form)
    parent = form.cleaned_data["parent"] or conv.tip_id
    if parent is not None:
        parent = message_or_404(conv, parent).pk
    try:
        blobs = services.blob_store_uploads(
            owner=signed_in_user(request), uploads=form.cleaned_data["images"]
        )
    except ArborError as exc:  # names the file; none was stored
        return _refused(exc)
    parts: list[dict[str, Any]] = [{"type": "image", "blob": b.sha256} for b in blobs]
    if form.cleaned_data["text"].strip():
        parts.append({"type": "text", "text": form.cleaned_data["text"]})
    return _turn(request, conv, parts=parts, parent_id=parent)


@login_required
@require_http_methods(["GET", "POST"])
def message_edit(request: HtmxHttpRequest, cid: str, mid: str) -> HttpResponseBase:
    """Edit a prompt: the new text becomes a sibling of the original, with a new answer.
    GET is the form, for a user's message only."""
    conv = conversation_or_404(request, cid)
    original = message_or_404(conv, mid)
    if request.method == "GET":
        try:
            services.message_edit_parent(message=original)
        except InvalidInput as exc:
            return HttpResponse(exc.detail, status=400, content_type="text/plain")
        return message_action_form(request, conv, original, "edit")
    form = forms.EditForm(request.POST)
    if not form.is_valid():
        return message_action_form(request, conv, original, "edit", form)
    try:
        parent = services.message_edit_parent(message=original)
    except InvalidInput as exc:
        return HttpResponse(exc.detail, status=400, content_type="text/plain")
    parts = [{"type": "text", "text": form.cleaned_data["text"]}]
    return _turn(request, conv, parts=parts, parent_id=parent, origin=Origin.EDIT)


@login_required
@require_POST
def message_regenerate(request: HtmxHttpRequest, cid: str, mid: str) -> HttpResponseBase:
    """A new answer from the same point: a sibling of the original answer."""
    conv = conversation_or_404(request, cid)
    original = message_or_404(conv, mid)
    try:
        parent = services.message_regenerate_parent(message=original)
    except InvalidInput as exc:
        return HttpResponse(exc.detail, status=400, content_type="text/plain")
    if parent is None:  # a model turn needs something before it to answer
        return HttpResponse("an answer with nothing before it cannot be regenerated", status=400)
    return _turn(request, conv, parts=None, parent_id=parent, origin=Origin.REGENERATE)


@login_required
@require_POST
def turn_retry(request: HtmxHttpRequest, cid: str) -> HttpResponseBase:
    """Run the last failed turn again (DESIGN.md's retry: 409 when nothing failed or a
    turn is running)."""
    # Looked up here although retry_events looks again: a stranger's id is the 404 page
    # (retry_events would say nothing_loaded), and a refusal returns to this chat.
    conv = conversation_or_404(request, cid)
    try:
        events = turns.retry_events(user=signed_in_user(request), conversation_id=conv.pk)
    except ArborError as exc:
        if _wants_stream(request):
            return _refused(exc)
        flash.error(request, exc.detail)
        return redirect(detail_url(conv))
    return _run_turn(request, conv, events)


@login_required
@require_POST
def turn_stop(request: HtmxHttpRequest, cid: str) -> HttpResponseBase:
    """Stop the running turn (the form's ``attempt``, else every one running here): what
    streamed stays as a partial answer marked stopped. The chat's script asks for JSON
    (202, or 409 ``nothing_running``); without it, back to the chat."""
    conv = conversation_or_404(request, cid)
    wants_json = "application/json" in request.headers.get("Accept", "")
    try:
        asked = turns.turn_stop(conversation=conv, attempt_id=request.POST.get("attempt") or None)
    except ArborError as exc:
        if wants_json:
            return JsonResponse(exc.as_dict(), status=exc.status)
        flash.error(request, exc.detail)
        return redirect(detail_url(conv))
    if wants_json:
        return JsonResponse({"stopping": [str(a) for a in asked]}, status=202)
    return redirect(detail_url(conv))


@login_required
@require_GET
def turn_live(request: HtmxHttpRequest, cid: str, aid: str) -> HttpResponseBase:
    """Server-Sent Events following a turn of this conversation that runs in another
    request (the chat was reloaded mid-answer): what streamed so far, as it grows, then
    how it ended."""
    conv = conversation_or_404(request, cid)
    try:
        attempt = TurnAttempt.objects.only("pk").get(conversation=conv, pk=aid)
    except (TurnAttempt.DoesNotExist, ValueError, ValidationError):
        raise Http404("no such turn") from None
    return event_stream(
        request, lambda: turns.turn_follow(attempt_id=attempt.pk), ends_with_client=True
    )
