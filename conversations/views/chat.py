"""The chat screen (conversations/detail.html): a branch of the conversation, its history
loaded a chunk at a time, ``◀ n/m ▶`` between versions, the conversation's settings and
forking. Sending and regenerating are in ``chat_turns.py``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from django.contrib import messages as flash
from django.contrib.auth.decorators import login_required
from django.forms import BaseForm
from django.http import HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from conversations import forms, selectors, services
from conversations.models import Conversation, Message
from conversations.views.chat_presenter import CHAT_CHUNK, chat_context, chat_rows
from conversations.views.common import (
    HtmxHttpRequest,
    conversation_or_404,
    detail_url,
    form_error,
    is_fragment,
    message_or_404,
    render_page_or_fragment,
    signed_in_user,
    tip_move_or_notice,
)

DETAIL = "conversations/detail.html"


@login_required
@require_GET
def conversation_detail(request: HtmxHttpRequest, cid: str) -> HttpResponse:
    """The current branch; with ``?m=<message>`` (a search hit) the branch through that
    message, without moving the tip on a GET."""
    conv = conversation_or_404(request, cid)
    focus = message_or_404(conv, request.GET["m"]).pk if "m" in request.GET else None
    context = chat_context(
        conv, user=request.user, show_all=bool(request.GET.get("all")), focus=focus
    )
    return render_page_or_fragment(request, DETAIL, "chat", context)


@login_required
@require_GET
def conversation_history(request: HtmxHttpRequest, cid: str) -> HttpResponse:
    """The CHAT_CHUNK messages of the branch just above ``?before=<message>`` (the first
    one the chat shows), as chat rows, with the marker that loads the ones above them:
    the chat loads its history a chunk at a time as it is scrolled up."""
    conv = conversation_or_404(request, cid)
    before = message_or_404(conv, request.GET.get("before", ""))
    path = selectors.message_path_tail(
        conversation_id=conv.pk, tip_id=before.parent_id, limit=CHAT_CHUNK
    )
    rows, _ = chat_rows(conv, path)
    return render(
        request,
        f"{DETAIL}#history",
        {
            "conversation": conv,
            "rows": rows,
            "tip": conv.tip_id,
            "earlier": path[0].depth if path else 0,
            "first": path[0].id if path else None,
        },
    )


@login_required
@require_GET
def message_text(request: HtmxHttpRequest, cid: str, mid: str) -> HttpResponse:
    """All of a message's text as plain text: what "Show all" opens for a message too
    long (or with too many parts) to render in the chat."""
    message = message_or_404(conversation_or_404(request, cid), mid)
    response = HttpResponse(
        "\n\n".join(_part_texts(message.parts)), content_type="text/plain; charset=utf-8"
    )
    response["X-Content-Type-Options"] = "nosniff"
    return response


def _part_texts(parts: Any) -> Iterator[str]:
    """Each part's text, tool results' parts included, calls and images as one line."""
    for part in parts if isinstance(parts, list) else []:
        if not isinstance(part, dict):
            continue
        if part.get("type") in ("text", "thinking"):
            yield str(part.get("text", ""))
        elif part.get("type") == "tool_call":
            yield f"[tool call {part.get('name')}] {json.dumps(part.get('arguments'))}"
        elif part.get("type") == "tool_result":
            yield from _part_texts(part.get("parts"))
        elif part.get("type") == "image":
            yield f"[image {part.get('blob')}]"


@login_required
@require_POST
def message_select(request: HtmxHttpRequest, cid: str, mid: str) -> HttpResponse:
    """``◀ n/m ▶``: move the tip to the newest leaf below the chosen message, so a
    reload shows the same branch."""
    conv = conversation_or_404(request, cid)
    chosen = message_or_404(conv, mid)
    form = forms.VersionForm(request.POST)
    if not form.is_valid():
        return form_error(form)
    leaf = selectors.message_latest_leaf(conversation_id=conv.pk, message_id=chosen.pk)
    notice = tip_move_or_notice(
        conv,
        message_id=leaf or chosen.pk,
        expected_version=form.cleaned_data["version"],
        stale="The conversation changed in another window; this is its current branch.",
    )
    conv.refresh_from_db()
    if not is_fragment(request):
        if notice:
            flash.warning(request, notice)
        return redirect(detail_url(conv, chosen.pk))
    context = chat_context(
        conv, user=request.user, show_all=bool(request.GET.get("all")), notice=notice
    )
    response = render_page_or_fragment(request, DETAIL, "chat", context)
    response["HX-Trigger"] = json.dumps({"arbor:tip-moved": {"message": str(chosen.pk)}})
    return response


@login_required
@require_POST
def conversation_settings(request: HtmxHttpRequest, cid: str) -> HttpResponse:
    """Rename, choose the model (from the configured ones), edit the system prompt."""
    conv = conversation_or_404(request, cid)
    initial = {"title": conv.title, "model": conv.model, "system_prompt": conv.system_prompt}
    form = forms.ConversationForm(request.POST, initial=initial, current_model=conv.model)
    if not form.is_valid():
        return form_error(form)
    # Only what was changed: a rename never rewrites the system prompt.
    changes = {name: form.cleaned_data[name] for name in form.changed_data}
    if changes:
        services.conversation_update(conversation=conv, **changes)
    flash.success(request, "Settings saved.")
    return redirect(detail_url(conv))


ACTION = "conversations/message_action.html"


def message_action_form(
    request: HtmxHttpRequest,
    conv: Conversation,
    message: Message,
    action: str,
    form: BaseForm | None = None,
) -> HttpResponse:
    """A message's Edit or Fork form (``action``): the fragment the chat's
    ``<details>`` fetches when opened, or a page of its own without JavaScript. Given
    a ``form`` that was sent and refused, the page again with its errors (400); the
    chat's script, which streams the edit, is answered in plain text instead."""
    if form is not None and (
        is_fragment(request) or "text/event-stream" in request.headers.get("Accept", "")
    ):
        return form_error(form)
    context = {
        "conversation": conv,
        "message": message,
        "action": action,
        "inline": is_fragment(request),
        "errors": [str(e) for errors in form.errors.values() for e in errors] if form else [],
    }
    return render_page_or_fragment(
        request, ACTION, action, context, status=400 if form is not None else 200
    )


@login_required
@require_http_methods(["GET", "POST"])
def message_fork(request: HtmxHttpRequest, cid: str, mid: str) -> HttpResponse:
    """A new conversation from the path to this message (and, by ``scope``, more);
    GET is the form."""
    conv = conversation_or_404(request, cid)
    message = message_or_404(conv, mid)
    if request.method == "GET":
        return message_action_form(request, conv, message, "fork")
    form = forms.ForkForm(request.POST)
    if not form.is_valid():
        return message_action_form(request, conv, message, "fork", form)
    fork = services.conversation_fork(
        message=message,
        owner=signed_in_user(request),
        title=form.cleaned_data["title"],
        scope=form.cleaned_data["scope"],
    )
    flash.success(request, f"Forked from “{conv.title or 'Untitled'}”.")
    return redirect(detail_url(fork))
