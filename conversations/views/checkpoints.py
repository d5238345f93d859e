"""The checkpoints screen (conversations/checkpoints.html): label the current tip, list
the live and dropped checkpoints, rewind to one."""

from __future__ import annotations

from typing import Any

from django.contrib import messages as flash
from django.contrib.auth.decorators import login_required
from django.http import HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods, require_POST

from conversations import forms, selectors, services
from conversations.errors import ArborError
from conversations.models import CheckpointState, Conversation
from conversations.views.common import (
    HtmxHttpRequest,
    conversation_or_404,
    detail_url,
    form_error,
)


def _checkpoint_create(conv: Conversation, form: forms.CheckpointForm) -> int | None:
    """Make the checkpoint the form names: None when it was made, else the status to
    show the form again with (its errors on it: 409 for a label in use)."""
    if not form.is_valid():
        return 400
    try:
        services.checkpoint_create(conversation=conv, label=form.cleaned_data["label"])
    except ArborError as exc:
        form.add_error("label", exc.detail)
        return 409 if exc.status == 409 else 400
    return None


def _checkpoints_context(conv: Conversation, form: forms.CheckpointForm) -> dict[str, Any]:
    items = list(selectors.checkpoint_list(conversation=conv, with_messages=True))
    previews = selectors.message_previews(conversation=conv, ids=[cp.message_id for cp in items])
    rows = [(cp, previews.get(cp.message_id, "")) for cp in items]
    return {
        "conversation": conv,
        "form": form,
        "live": [row for row in rows if row[0].state == CheckpointState.LIVE],
        "dropped": [row for row in rows if row[0].state != CheckpointState.LIVE],
        "rewind_form": forms.RewindForm(initial={"version": conv.version}),
    }


@login_required
@require_http_methods(["GET", "POST"])
def checkpoints(request: HtmxHttpRequest, cid: str) -> HttpResponse:
    conv = conversation_or_404(request, cid)
    form = forms.CheckpointForm(request.POST or None)
    status = 200
    if request.method == "POST":
        refused = _checkpoint_create(conv, form)
        if refused is None:
            return redirect("conversations:checkpoints", cid=conv.pk)
        status = refused
    conv.refresh_from_db()
    return render(
        request, "conversations/checkpoints.html", _checkpoints_context(conv, form), status=status
    )


@login_required
@require_POST
def rewind(request: HtmxHttpRequest, cid: str) -> HttpResponse:
    conv = conversation_or_404(request, cid)
    form = forms.RewindForm(request.POST)
    if not form.is_valid():
        return form_error(form)
    try:
        result = services.checkpoint_rewind(
            conversation=conv,
            label=form.cleaned_data["label"],
            digest=form.cleaned_data["digest"] or None,
            expected_version=form.cleaned_data["version"],
        )
    except ArborError as exc:
        flash.error(request, exc.detail)
        return redirect("conversations:checkpoints", cid=conv.pk)
    flash.success(request, f"Rewound to “{form.cleaned_data['label']}”.")
    return redirect(detail_url(conv, result.digest_message))
