"""The compare screen (conversations/compare.html): siblings or branches side by side."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET

from conversations import compare as comparing
from conversations.views.common import HtmxHttpRequest, conversation_or_404, message_or_404


@login_required
@require_GET
def compare(request: HtmxHttpRequest, cid: str) -> HttpResponse:
    """Two to four siblings, or two branches, side by side with a word diff (``?view=
    plain``: without); with fewer than two chosen, a list of recent leaves to pick
    branches from."""
    conv = conversation_or_404(request, cid)
    ids = comparing.parse_ids(request.GET.getlist("m")[: comparing.MAX_CHOSEN])
    if ids is None:
        raise Http404("no such message")
    chosen = [message_or_404(conv, mid) for mid in ids]
    mode = request.GET.get("view", "diff")
    if mode not in comparing.MODES:
        mode = "diff"
    comparison = (
        comparing.compare(conversation=conv, chosen=chosen, mode=mode) if len(chosen) >= 2 else None
    )
    return render(
        request,
        "conversations/compare.html",
        {
            "conversation": conv,
            "comparison": comparison,
            "chosen": {m.pk for m in chosen},
            "leaves": comparing.recent_leaves(conversation=conv),
            "version": conv.version,
            "chosen_ids": [str(m.pk) for m in chosen],
            "compare_modes": [("diff", "Differences"), ("plain", "Plain text")],
        },
    )
