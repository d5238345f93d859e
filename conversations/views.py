"""Server-rendered pages: a read-only look at the user's conversations and their current
branch. Links are real hrefs, so the pages work without JavaScript."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from conversations import selectors
from conversations.errors import NotFound


@login_required
def conversation_list(request: HttpRequest) -> HttpResponse:
    q = request.GET.get("q", "").strip()[:200]
    page = selectors.conversation_page(
        user=request.user, q=q, cursor=request.GET.get("cursor") or None, limit=50
    )
    return render(
        request,
        "conversations/list.html",
        {"conversations": page.items, "next_cursor": page.next_cursor, "q": q},
    )


@login_required
def conversation_detail(request: HttpRequest, cid: str) -> HttpResponse:
    try:
        conv = selectors.conversation_get(user=request.user, conversation_id=cid)
    except NotFound:
        return render(request, "404.html", status=404)
    path = selectors.message_path(conversation_id=conv.pk, tip_id=conv.tip_id)
    return render(
        request,
        "conversations/detail.html",
        {
            "conversation": conv,
            "path": path,
            "forks": selectors.conversation_forks(conversation=conv),
            "checkpoints": selectors.checkpoint_list(conversation=conv),
        },
    )
