"""The conversation list (conversations/list.html) with its search, and the pages that
add a conversation to it or delete one (conversations/delete.html)."""

from __future__ import annotations

from datetime import date
from typing import Any

from django.contrib import messages as flash
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpResponse
from django.shortcuts import redirect, render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from conversations import forms, selectors, services
from conversations.errors import ArborError
from conversations.views.common import (
    HtmxHttpRequest,
    conversation_or_404,
    detail_url,
    form_error,
    render_page_or_fragment,
    signed_in_user,
)

MESSAGE_HITS = 20  # message search hits a page of the conversation list shows
SIDEBAR_ITEMS = 60  # conversations the sidebar lists (the list page has them all)


def date_groups(conversations: list[Any], today: date) -> list[tuple[str, list[Any]]]:
    """Conversations (newest first) under the headings chat apps use: Today, Yesterday,
    Previous 7 days, Previous 30 days, then one per month ("November 2026")."""
    groups: list[tuple[str, list[Any]]] = []
    for conv in conversations:
        day = timezone.localdate(conv.updated_at)
        age = (today - day).days
        if age <= 0:
            heading = "Today"
        elif age == 1:
            heading = "Yesterday"
        elif age <= 7:
            heading = "Previous 7 days"
        elif age <= 30:
            heading = "Previous 30 days"
        else:
            heading = day.strftime("%B %Y")
        if not groups or groups[-1][0] != heading:
            groups.append((heading, []))
        groups[-1][1].append(conv)
    return groups


@login_required
@require_GET
def conversation_sidebar(request: HtmxHttpRequest) -> HttpResponse:
    """The sidebar beside every page: the user's latest conversations grouped by date
    (one query), the one open marked."""
    latest = list(selectors.conversation_recent(user=request.user, limit=SIDEBAR_ITEMS))
    context = {
        "groups": date_groups(latest, timezone.localdate()),
        "current": request.GET.get("current", ""),
        "more": len(latest) == SIDEBAR_ITEMS,
    }
    return render(request, "conversations/_sidebar.html", context)


@login_required
@require_GET
def conversation_list(request: HtmxHttpRequest) -> HttpResponse:
    """The user's conversations, newest first, with title and message search (each
    keyset-paged: ``cursor`` and ``mcursor``); HTMX gets the results fragment."""
    q = request.GET.get("q", "").strip()[:200]
    try:
        page = selectors.conversation_page(
            user=request.user, q=q, cursor=request.GET.get("cursor") or None, limit=50
        )
        hits = selectors.message_search(
            user=request.user, q=q, cursor=request.GET.get("mcursor") or None, limit=MESSAGE_HITS
        )
    except ArborError:
        raise Http404("bad cursor") from None
    origins = selectors.fork_origins(
        user=request.user,
        message_ids=[c.forked_from_id for c in page.items if c.forked_from_id],
    )
    context = {
        "items": [{"c": c, "origin": origins.get(c.forked_from_id)} for c in page.items],
        "next_cursor": page.next_cursor,
        "hits": hits.items,
        "hits_cursor": hits.next_cursor,
        "q": q,
        "form": forms.ConversationForm(),
        "new": "new" in request.GET,
    }
    return render_page_or_fragment(request, "conversations/list.html", "results", context)


@login_required
@require_POST
def conversation_new(request: HtmxHttpRequest) -> HttpResponse:
    form = forms.ConversationForm(request.POST)
    if not form.is_valid():
        return form_error(form)
    conv = services.conversation_create(owner=signed_in_user(request), **form.cleaned_data)
    return redirect(detail_url(conv))


@login_required
@require_http_methods(["GET", "POST"])
def conversation_delete(request: HtmxHttpRequest, cid: str) -> HttpResponse:
    """GET asks to confirm (saying how many messages go with it); POST deletes."""
    conv = conversation_or_404(request, cid)
    if request.method == "POST":
        services.conversation_delete(conversation=conv)
        flash.success(request, f"Deleted “{conv.title or 'Untitled'}”.")
        return redirect("conversations:list")
    return render(
        request,
        "conversations/delete.html",
        {"conversation": conv, "message_count": selectors.message_count(conversation=conv)},
    )
