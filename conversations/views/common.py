"""The helpers every HTML view shares (these screens and compaction/views.py).

Each screen is one template with inline partials; a view renders ``template#partial``
for an HTMX request and the whole page otherwise (including htmx's history-restore
requests, which must get a full page), and says ``Vary: HX-Request`` so a cache never
hands one where the other was asked for. Lookups go through the owner-scoped selectors,
so another user's object is a 404 like a missing one.
"""

from __future__ import annotations

import uuid
from typing import Any

from django.contrib.auth.models import User
from django.forms import BaseForm
from django.http import FileResponse, Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.urls import reverse
from django.utils.cache import patch_vary_headers
from django_htmx.middleware import HtmxDetails

from conversations import selectors, services
from conversations.errors import NotFound, StaleVersion
from conversations.models import Blob, Conversation, Message


class HtmxHttpRequest(HttpRequest):
    """A request that went through django-htmx's middleware (every view's does), as
    django-htmx documents for typing views: ``request.htmx`` without a cast."""

    htmx: HtmxDetails


def is_fragment(request: HtmxHttpRequest) -> bool:
    """An HTMX request that swaps part of a page (a history restore wants the page)."""
    return bool(request.htmx) and not request.htmx.history_restore_request


def render_page_or_fragment(
    request: HtmxHttpRequest,
    template: str,
    partial: str | None,
    context: dict[str, Any],
    status: int = 200,
) -> HttpResponse:
    """``template#partial`` for an HTMX fragment request, else the whole ``template``;
    either way ``Vary: HX-Request``."""
    name = f"{template}#{partial}" if partial and is_fragment(request) else template
    response = render(request, name, context, status=status)
    patch_vary_headers(response, ["HX-Request"])
    return response


def conversation_or_404(request: HttpRequest, cid: str) -> Conversation:
    """The signed-in user's conversation ``cid``; anyone else's is a 404."""
    try:
        return selectors.conversation_get(user=request.user, conversation_id=cid)
    except NotFound:
        raise Http404("no such conversation") from None


def message_or_404(conversation: Conversation, mid: str | uuid.UUID) -> Message:
    """A message of ``conversation`` (already owner-checked); a malformed id or one from
    another conversation is a 404."""
    try:
        return selectors.conversation_message(conversation=conversation, message_id=mid)
    except NotFound:
        raise Http404("no such message") from None


def signed_in_user(request: HttpRequest) -> User:
    """The signed-in user (every HTML view is behind login_required)."""
    assert isinstance(request.user, User)
    return request.user


def detail_url(conversation: Conversation, anchor: Any = None) -> str:
    """The chat view of ``conversation``, scrolled to message ``anchor`` if given."""
    url = reverse("conversations:detail", args=[conversation.pk])
    return f"{url}#msg-{anchor}" if anchor else url


def form_error(form: BaseForm) -> HttpResponse:
    """A 400 naming each field's errors, as plain text."""
    errors = "; ".join(f"{k}: {' '.join(str(e) for e in v)}" for k, v in form.errors.items())
    return HttpResponse(errors or "bad input", status=400, content_type="text/plain")


def tip_move_or_notice(
    conversation: Conversation, *, message_id: uuid.UUID, expected_version: int, stale: str
) -> str:
    """Move the tip as a page asked; if the conversation changed since the page was
    drawn (another window), nothing moves and the answer is the ``stale`` notice to show
    (else "")."""
    try:
        services.tip_move(
            conversation=conversation, message_id=message_id, expected_version=expected_version
        )
    except StaleVersion:
        return stale
    return ""


def blob_response(blob: Blob) -> FileResponse:
    """A stored image, for someone already allowed to see it. Immutable by construction
    (its name is the hash of its bytes); private, so no shared cache keeps it."""
    response = FileResponse(blob.file.open("rb"), content_type=blob.mime)
    response["Cache-Control"] = "private, max-age=31536000, immutable"
    response["X-Content-Type-Options"] = "nosniff"
    return response
