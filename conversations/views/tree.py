"""The tree screen (conversations/tree.html): the whole tree as a graph above an outline,
the fragments that open what they left closed, and moving the tip from the graph. What
is shown is arranged by ``tree_presenter``; these views only read the request."""

from __future__ import annotations

import uuid
from typing import Any

from django.contrib import messages as flash
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import redirect
from django.views.decorators.http import require_GET, require_POST

from conversations import forms
from conversations.models import Conversation
from conversations.treemap import ALTS_CHUNK, OutlineItem, TreeMap, stub_chunk
from conversations.views.common import (
    HtmxHttpRequest,
    conversation_or_404,
    detail_url,
    form_error,
    is_fragment,
    message_or_404,
    render_page_or_fragment,
    tip_move_or_notice,
)
from conversations.views.tree_presenter import (
    TREE,
    outline_rows_load,
    tree_context,
    tree_load,
)

FRAGMENT_KEYS = ("from", "run", "gap", "alts")  # what asks for a piece of the outline


@login_required
@require_GET
def tree(request: HtmxHttpRequest, cid: str) -> HttpResponse:
    """The whole tree: a drawn graph above an outline, both bounded whatever the size of
    the tree. ``?open=<id>`` (repeatable) opens a collapsed branch or a quiet stretch in the
    graph; for HTMX that is the graph fragment. The outline's fragments open what it left
    closed: ``?from=<id>`` a branch, ``?run=<id>&n=<count>`` a run of quiet messages,
    ``?gap=<id>&n=<count>`` a stretch of a long branch (without HTMX: the page, with that
    stretch open) and ``?alts=<id>&skip=<k>`` more of a message's branches (``roots``: of
    the other roots)."""
    conv = conversation_or_404(request, cid)
    fragment = is_fragment(request)
    if fragment and any(key in request.GET for key in FRAGMENT_KEYS):
        return _outline_fragment(request, conv)
    stretch = None
    if "gap" in request.GET and not fragment:
        stretch = (_parse_id(request.GET["gap"]), _parse_count(request, "n", 1))
    context = tree_context(conv, request.GET.getlist("open"), outline=not fragment, stretch=stretch)
    return render_page_or_fragment(request, TREE, "graph" if fragment else None, context)


def _outline_fragment(request: HtmxHttpRequest, conv: Conversation) -> HttpResponse:
    """The rows (or, for ``alts``, the branch stubs) that replace the outline's link."""
    tree_map, marks = tree_load(conv)
    if "alts" in request.GET:
        return _stubs_fragment(request, conv, tree_map)
    partial, items = _outline_items(request, tree_map)
    context = {"conversation": conv, "items": outline_rows_load(conv, tree_map, marks, items)}
    return render_page_or_fragment(request, TREE, partial, context)


def _stubs_fragment(
    request: HtmxHttpRequest, conv: Conversation, tree_map: TreeMap
) -> HttpResponse:
    """The next chunk of a message's branches (``roots``: of the other roots)."""
    value = request.GET["alts"]
    parent = None if value == "roots" else _parse_node(value, tree_map)
    stubs, more = stub_chunk(
        tree_map.alternatives(parent),
        parent=parent,
        skip=_parse_count(request, "skip", 0),
        size=ALTS_CHUNK,
    )
    context: dict[str, Any] = {
        "conversation": conv,
        "stubs": stubs,
        "more": more,
        "kind": "root" if parent is None else "branch",
    }
    return render_page_or_fragment(request, TREE, "stubs", context)


def _outline_items(request: HttpRequest, tree_map: TreeMap) -> tuple[str, list[OutlineItem]]:
    """The partial and the items it shows for ``from`` (a branch), ``run`` (a quiet
    run) or ``gap`` (a stretch of a long branch)."""
    if "from" in request.GET:
        return "branch", tree_map.outline(_parse_node(request.GET["from"], tree_map))
    if "run" in request.GET:
        start = _parse_node(request.GET["run"], tree_map)
        count = min(_parse_count(request, "n", 1), len(tree_map.nodes))
        return "rows", list(tree_map.run(start, count))
    start = _parse_node(request.GET["gap"], tree_map)
    return "rows", tree_map.stretch(start, _parse_count(request, "n", 1))


def _parse_id(value: str | None) -> uuid.UUID:
    try:
        return uuid.UUID(str(value))
    except ValueError:
        raise Http404("no such message") from None


def _parse_node(value: str | None, tree_map: TreeMap) -> uuid.UUID:
    mid = _parse_id(value)
    if mid not in tree_map:
        raise Http404("no such message")
    return mid


def _parse_count(request: HttpRequest, name: str, low: int) -> int:
    try:
        return max(low, int(request.GET.get(name, str(low))))
    except ValueError:
        raise Http404(f"bad {name}") from None


@login_required
@require_POST
def tip_set(request: HtmxHttpRequest, cid: str) -> HttpResponse:
    """Move the tip to exactly this message (the tree map): the next message branches
    there."""
    conv = conversation_or_404(request, cid)
    form = forms.TipForm(request.POST)
    if not form.is_valid():
        return form_error(form)
    target = message_or_404(conv, form.cleaned_data["message"])
    notice = tip_move_or_notice(
        conv,
        message_id=target.pk,
        expected_version=form.cleaned_data["version"],
        stale="The conversation changed meanwhile; the tip did not move.",
    )
    if not is_fragment(request):
        if notice:
            flash.warning(request, notice)
            return redirect("conversations:tree", cid=conv.pk)
        return redirect(detail_url(conv, target.pk))
    # From the tree graph: redraw the graph and the outline around the new path, keeping
    # the branches the graph had open.
    conv.refresh_from_db()
    context = tree_context(conv, request.POST.getlist("open"), notice=notice)
    return render_page_or_fragment(request, TREE, "view", context)
