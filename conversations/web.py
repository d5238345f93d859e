"""The helpers every HTML view shares (conversations/views.py, compaction/views.py).

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
from django.http import FileResponse, Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils.cache import patch_vary_headers

from conversations import selectors
from conversations.errors import NotFound
from conversations.models import Blob, Conversation, Message


def is_fragment(request: HttpRequest) -> bool:
    """An HTMX request that swaps part of a page (a history restore wants the page)."""
    htmx = getattr(request, "htmx", None)
    return bool(htmx) and not htmx.history_restore_request  # type: ignore[union-attr]


def render_page_or_fragment(
    request: HttpRequest,
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
        return Message.objects.defer("search_text").get(
            pk=uuid.UUID(str(mid)), conversation=conversation
        )
    except (ValueError, Message.DoesNotExist):
        raise Http404("no such message") from None


def signed_in_user(request: HttpRequest) -> User:
    """The signed-in user (every HTML view is behind login_required)."""
    assert isinstance(request.user, User)
    return request.user


def blob_response(blob: Blob) -> FileResponse:
    """A stored image, for someone already allowed to see it. Immutable by construction
    (its name is the hash of its bytes); private, so no shared cache keeps it."""
    response = FileResponse(blob.file.open("rb"), content_type=blob.mime)
    response["Cache-Control"] = "private, max-age=31536000, immutable"
    response["X-Content-Type-Options"] = "nosniff"
    return response
