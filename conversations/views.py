"""The browser UI (DESIGN.md §7): server-rendered pages with HTMX fragments.

Each screen is one template with inline partials, rendered whole or as a fragment by
``conversations.web`` (which also holds the owner-scoped lookups). Views stay thin: look
up through those (another user's object is a 404 like a missing one), validate with a
form, call one service.
"""

from __future__ import annotations

import json
import uuid
from collections import defaultdict
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib import messages as flash
from django.contrib.auth.decorators import login_required
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    HttpResponseRedirect,
)
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.cache import add_never_cache_headers
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from conversations import compare as comparing
from conversations import forms, selectors, services, turns
from conversations.errors import ArborError, NotFound, StaleVersion
from conversations.exporters import EXPORT_FORMATS
from conversations.models import (
    ApiToken,
    AttemptStatus,
    Checkpoint,
    CheckpointState,
    Conversation,
    ImportJob,
    Message,
    Origin,
    Role,
    TurnAttempt,
)
from conversations.providers import registry
from conversations.providers.registry import ModelSpec
from conversations.streaming import event_stream
from conversations.treegraph import Graph, graph_layout
from conversations.treemap import (
    ALTS_CHUNK,
    ALTS_SHOWN,
    Gap,
    OutlineItem,
    RunStub,
    TreeMap,
    shown_ids,
    stub_chunk,
)
from conversations.web import (
    conversation_or_404,
    is_fragment,
    message_or_404,
    render_page_or_fragment,
    signed_in_user,
)

CHAT_WINDOW = 300  # messages a chat view around a search hit (or ?all=1 past it) shows
# The chat opens with the last CHAT_FIRST messages of the branch; scrolling up loads
# CHAT_CHUNK more at a time (HTMX "revealed"), each read without the rest of the path.
CHAT_FIRST = 50
CHAT_CHUNK = 50
FOCUS_CONTEXT = 20  # messages shown above a search hit that lies before the window
MESSAGE_HITS = 20  # message search hits a page of the conversation list shows

# --- helpers -------------------------------------------------------------------------


def _detail_url(conversation: Conversation, anchor: Any = None) -> str:
    url = reverse("conversations:detail", args=[conversation.pk])
    return f"{url}#msg-{anchor}" if anchor else url


def _form_error(form: Any) -> HttpResponse:
    errors = "; ".join(f"{k}: {' '.join(v)}" for k, v in form.errors.items())
    return HttpResponse(errors or "bad input", status=400, content_type="text/plain")


# --- conversation list ---------------------------------------------------------------


@login_required
@require_GET
def conversation_list(request: HttpRequest) -> HttpResponse:
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
    items = [{"c": c, "origin": origins.get(c.forked_from_id)} for c in page.items]
    return render_page_or_fragment(
        request,
        "conversations/list.html",
        "results",
        {
            "items": items,
            "next_cursor": page.next_cursor,
            "hits": hits.items,
            "hits_cursor": hits.next_cursor,
            "q": q,
            "form": forms.ConversationForm(),
        },
    )


@login_required
@require_POST
def conversation_new(request: HttpRequest) -> HttpResponse:
    form = forms.ConversationForm(request.POST)
    if not form.is_valid():
        return _form_error(form)
    conv = services.conversation_create(owner=signed_in_user(request), **form.cleaned_data)
    return redirect(_detail_url(conv))


@login_required
@require_POST
def conversation_settings(request: HttpRequest, cid: str) -> HttpResponse:
    """Rename, choose the model (from the configured ones), edit the system prompt."""
    conv = conversation_or_404(request, cid)
    initial = {"title": conv.title, "model": conv.model, "system_prompt": conv.system_prompt}
    form = forms.ConversationForm(request.POST, initial=initial, current_model=conv.model)
    if not form.is_valid():
        return _form_error(form)
    # Only what was changed: a rename never rewrites the system prompt.
    changes = {name: form.cleaned_data[name] for name in form.changed_data}
    if changes:
        services.conversation_update(conversation=conv, **changes)
    flash.success(request, "Settings saved.")
    return redirect(_detail_url(conv))


@login_required
@require_http_methods(["GET", "POST"])
def conversation_delete(request: HttpRequest, cid: str) -> HttpResponse:
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


# --- chat ----------------------------------------------------------------------------


def _chat_rows(
    conv: Conversation, path: list[Message]
) -> tuple[list[dict[str, Any]], list[Conversation]]:
    """What the chat shows beside each message of ``path`` (its versions, checkpoints,
    forks and sub-agent runs), and the conversation's forks."""
    siblings = selectors.sibling_positions(conversation=conv, messages=path)
    checkpoints: dict[uuid.UUID, list[Checkpoint]] = defaultdict(list)
    for cp in selectors.checkpoint_list(conversation=conv):
        checkpoints[cp.message_id].append(cp)
    forks: dict[uuid.UUID, list[Conversation]] = defaultdict(list)
    spawned: dict[uuid.UUID, list[Conversation]] = defaultdict(list)
    fork_list, spawned_list = selectors.conversation_offspring(conversation=conv)
    for f in fork_list:
        if f.forked_from_id:
            forks[f.forked_from_id].append(f)
    for s in spawned_list:
        if s.spawned_by_id:
            spawned[s.spawned_by_id].append(s)
    rows = []
    for m in path:
        sib = siblings.get(m.id)
        rows.append(
            {
                "m": m,
                "sib": sib,
                "sib_n": sib.index + 1 if sib else 0,
                "prev": sib.ids[sib.index - 1] if sib and sib.index > 0 else None,
                "next": sib.ids[sib.index + 1] if sib and sib.index + 1 < len(sib.ids) else None,
                "others": [i for i in sib.ids if i != m.id][:3] if sib else [],
                "checkpoints": checkpoints.get(m.id, []),
                "forks": forks.get(m.id, []),
                "spawned": spawned.get(m.id, []),
            }
        )
    return rows, fork_list


def _chat_context(
    request: HttpRequest, conv: Conversation, notice: str = "", focus: uuid.UUID | None = None
) -> dict[str, Any]:
    """The chat view of the current branch or, given a ``focus`` message off it, of the
    branch through that message (shown only: the tip stays where it is)."""
    leaf = conv.tip_id
    if focus is not None:
        leaf = selectors.message_branch_leaf(conversation=conv, message_id=focus)
    earlier = later = 0
    if focus is None and not request.GET.get("all"):
        # The common case: the last messages of the branch, read without the rest of it.
        path = selectors.message_path_tail(conversation_id=conv.pk, tip_id=leaf, limit=CHAT_FIRST)
        earlier = path[0].depth if path else 0
    else:
        path = selectors.message_path(conversation_id=conv.pk, tip_id=leaf)
    if len(path) > CHAT_WINDOW and not request.GET.get("all"):
        earlier = len(path) - CHAT_WINDOW
        if focus is not None:
            # The window moves back to the message asked for, with some context above
            # it; the messages below the window are counted, not shown.
            at = next(i for i, m in enumerate(path) if m.id == focus)
            earlier = min(earlier, max(0, at - FOCUS_CONTEXT))
            later = len(path) - earlier - CHAT_WINDOW
        path = path[earlier : earlier + CHAT_WINDOW]
    rows, fork_list = _chat_rows(conv, path)
    origin = spawner = None
    if conv.forked_from_id or conv.spawned_by_id:
        above = [i for i in (conv.forked_from_id, conv.spawned_by_id) if i]
        found = selectors.fork_origins(user=request.user, message_ids=above)
        origin = found.get(conv.forked_from_id) if conv.forked_from_id else None
        spawner = found.get(conv.spawned_by_id) if conv.spawned_by_id else None
    return {
        "conversation": conv,
        "rows": rows,
        "earlier": earlier,
        "first": path[0].id if path else None,
        "later": later,
        "tip": conv.tip_id,
        "leaf": leaf,
        "focus": focus,
        "elsewhere": leaf != conv.tip_id,
        "origin": origin,
        "spawner": spawner,
        "forks": fork_list,
        "notice": notice,
        "message_form": forms.MessageForm(),
        "settings_form": forms.ConversationForm(
            initial={"title": conv.title, "model": conv.model, "system_prompt": conv.system_prompt},
            current_model=conv.model,
        ),
        "export_formats": EXPORT_FORMATS,
        "fork_form": forms.ForkForm(),
        "failed": _failed_turn(conv),
    }


def _failed_turn(conv: Conversation) -> dict[str, Any] | None:
    """The conversation's last turn, when it failed (or its process died): what was
    asked and why it failed, so the page can offer to run it again. Survives a restart:
    attempts are rows."""
    last = TurnAttempt.objects.filter(conversation=conv).order_by("-created_at").first()
    if last is None:
        return None
    if last.status != AttemptStatus.FAILED and not turns.attempt_is_stale(last):
        return None
    prompt = " ".join(p.get("text", "") for p in last.input_parts if p.get("type") == "text")
    return {
        "prompt": prompt,
        "error": last.error_text or last.error_code or "the turn was interrupted",
    }


@login_required
@require_GET
def conversation_detail(request: HttpRequest, cid: str) -> HttpResponse:
    """The current branch; with ``?m=<message>`` (a search hit) the branch through that
    message, without moving the tip on a GET."""
    conv = conversation_or_404(request, cid)
    focus = message_or_404(conv, request.GET["m"]).pk if "m" in request.GET else None
    return render_page_or_fragment(
        request, "conversations/detail.html", "chat", _chat_context(request, conv, focus=focus)
    )


@login_required
@require_GET
def conversation_history(request: HttpRequest, cid: str) -> HttpResponse:
    """The CHAT_CHUNK messages of the branch just above ``?before=<message>`` (the first
    one the chat shows), as chat rows, with the marker that loads the ones above them:
    the chat loads its history a chunk at a time as it is scrolled up."""
    conv = conversation_or_404(request, cid)
    before = message_or_404(conv, request.GET.get("before", ""))
    path = selectors.message_path_tail(
        conversation_id=conv.pk, tip_id=before.parent_id, limit=CHAT_CHUNK
    )
    rows, _ = _chat_rows(conv, path)
    return render(
        request,
        "conversations/detail.html#history",
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
def message_text(request: HttpRequest, cid: str, mid: str) -> HttpResponse:
    """All of a message's text as plain text: what "Show all" opens for a message too
    long (or with too many parts) to render in the chat."""
    conv = conversation_or_404(request, cid)
    message = message_or_404(conv, mid)
    response = HttpResponse(
        "\n\n".join(_part_texts(message.parts)), content_type="text/plain; charset=utf-8"
    )
    response["X-Content-Type-Options"] = "nosniff"
    return response


def _part_texts(parts: Any) -> Iterator[str]:
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


def _wants_stream(request: HttpRequest) -> bool:
    return "text/event-stream" in request.headers.get("Accept", "")


def _turn(
    request: HttpRequest,
    conv: Conversation,
    *,
    parts: Any,
    parent_id: Any,
    origin: str = Origin.TURN,
) -> HttpResponseBase:
    """Run a chat turn: Server-Sent Events for static/arbor.js, or (without JavaScript)
    run it to the end and show the conversation."""
    events = turns.turn_events(conversation=conv, parts=parts, parent_id=parent_id, origin=origin)
    return _run_turn(request, conv, events)


def _run_turn(
    request: HttpRequest, conv: Conversation, events: Iterator[dict[str, Any]]
) -> HttpResponseBase:
    try:
        first = next(events)  # bad input raises here, before any stream starts
    except ArborError as exc:
        return HttpResponse(exc.detail, status=exc.status, content_type="text/plain")
    if _wants_stream(request):

        def produce() -> Any:
            yield first
            yield from events

        return event_stream(request, produce)
    for event in events:
        if event["event"] == "error":
            flash.error(request, f"The model failed: {event.get('detail', event['error'])}")
    return redirect(_detail_url(conv))


@login_required
@require_POST
def turn_retry(request: HttpRequest, cid: str) -> HttpResponseBase:
    """Run the last failed turn again (DESIGN.md's retry: 409 when nothing failed or a
    turn is running)."""
    conv = conversation_or_404(request, cid)
    try:
        events = turns.retry_events(user=signed_in_user(request), conversation_id=conv.pk)
    except ArborError as exc:
        if _wants_stream(request):
            return HttpResponse(exc.detail, status=exc.status, content_type="text/plain")
        flash.error(request, exc.detail)
        return redirect(_detail_url(conv))
    return _run_turn(request, conv, events)


@login_required
@require_POST
def message_send(request: HttpRequest, cid: str) -> HttpResponseBase:
    conv = conversation_or_404(request, cid)
    form = forms.MessageForm(request.POST)
    if not form.is_valid():
        return _form_error(form)
    parent = form.cleaned_data["parent"] or conv.tip_id
    if parent is not None:
        parent = message_or_404(conv, parent).pk
    parts = [{"type": "text", "text": form.cleaned_data["text"]}]
    return _turn(request, conv, parts=parts, parent_id=parent)


@login_required
@require_POST
def message_edit(request: HttpRequest, cid: str, mid: str) -> HttpResponseBase:
    """Edit a prompt: the new text becomes a sibling of the original, with a new answer."""
    conv = conversation_or_404(request, cid)
    original = message_or_404(conv, mid)
    form = forms.EditForm(request.POST)
    if not form.is_valid():
        return _form_error(form)
    if original.role != Role.USER:
        return HttpResponse("only your own messages can be edited", status=400)
    parts = [{"type": "text", "text": form.cleaned_data["text"]}]
    return _turn(request, conv, parts=parts, parent_id=original.parent_id, origin=Origin.EDIT)


@login_required
@require_POST
def message_regenerate(request: HttpRequest, cid: str, mid: str) -> HttpResponseBase:
    """A new answer from the same point: a sibling of the original answer."""
    conv = conversation_or_404(request, cid)
    original = message_or_404(conv, mid)
    if original.role != Role.ASSISTANT or original.parent_id is None:
        return HttpResponse("only answers can be regenerated", status=400)
    return _turn(request, conv, parts=None, parent_id=original.parent_id, origin=Origin.REGENERATE)


@login_required
@require_POST
def message_select(request: HttpRequest, cid: str, mid: str) -> HttpResponse:
    """``◀ n/m ▶``: move the tip to the newest leaf below the chosen message, so a
    reload shows the same branch."""
    conv = conversation_or_404(request, cid)
    chosen = message_or_404(conv, mid)
    form = forms.VersionForm(request.POST)
    if not form.is_valid():
        return _form_error(form)
    leaf = selectors.message_latest_leaf(conversation_id=conv.pk, message_id=chosen.pk)
    notice = ""
    try:
        services.tip_move(
            conversation=conv,
            message_id=leaf or chosen.pk,
            expected_version=form.cleaned_data["version"],
        )
    except StaleVersion:
        notice = "The conversation changed in another window; this is its current branch."
    conv.refresh_from_db()
    if not is_fragment(request):
        if notice:
            flash.warning(request, notice)
        return redirect(_detail_url(conv, chosen.pk))
    response = render_page_or_fragment(
        request, "conversations/detail.html", "chat", _chat_context(request, conv, notice)
    )
    response["HX-Trigger"] = json.dumps({"arbor:tip-moved": {"message": str(chosen.pk)}})
    return response


@login_required
@require_POST
def tip_set(request: HttpRequest, cid: str) -> HttpResponse:
    """Move the tip to exactly this message (the tree map): the next message branches
    there."""
    conv = conversation_or_404(request, cid)
    form = forms.TipForm(request.POST)
    if not form.is_valid():
        return _form_error(form)
    target = message_or_404(conv, form.cleaned_data["message"])
    notice = ""
    try:
        services.tip_move(
            conversation=conv, message_id=target.pk, expected_version=form.cleaned_data["version"]
        )
    except StaleVersion:
        notice = "The conversation changed meanwhile; the tip did not move."
    if not is_fragment(request):
        if notice:
            flash.warning(request, notice)
            return redirect("conversations:tree", cid=conv.pk)
        return redirect(_detail_url(conv, target.pk))
    # From the tree graph: redraw the graph and the outline around the new path, keeping
    # the branches the graph had open.
    conv.refresh_from_db()
    context = _tree_context(conv, request.POST.getlist("open"), notice=notice)
    return render_page_or_fragment(request, "conversations/tree.html", "view", context)


@login_required
@require_POST
def message_fork(request: HttpRequest, cid: str, mid: str) -> HttpResponse:
    conv = conversation_or_404(request, cid)
    message = message_or_404(conv, mid)
    form = forms.ForkForm(request.POST)
    if not form.is_valid():
        return _form_error(form)
    fork = services.conversation_fork(
        message=message,
        owner=signed_in_user(request),
        title=form.cleaned_data["title"],
        scope=form.cleaned_data["scope"],
    )
    flash.success(request, f"Forked from “{conv.title or 'Untitled'}”.")
    return redirect(_detail_url(fork))


# --- checkpoints ---------------------------------------------------------------------


@login_required
@require_http_methods(["GET", "POST"])
def checkpoints(request: HttpRequest, cid: str) -> HttpResponse:
    conv = conversation_or_404(request, cid)
    form = forms.CheckpointForm(request.POST or None)
    status = 200
    if request.method == "POST":
        if form.is_valid():
            try:
                services.checkpoint_create(conversation=conv, label=form.cleaned_data["label"])
            except ArborError as exc:
                form.add_error("label", exc.detail)
                status = 409 if exc.status == 409 else 400
            else:
                return redirect("conversations:checkpoints", cid=conv.pk)
        else:
            status = 400
    conv.refresh_from_db()
    items = list(selectors.checkpoint_list(conversation=conv).select_related("message"))
    previews = selectors.message_previews(conversation=conv, ids=[cp.message_id for cp in items])
    return render(
        request,
        "conversations/checkpoints.html",
        {
            "conversation": conv,
            "form": form,
            "live": [
                (cp, previews.get(cp.message_id, ""))
                for cp in items
                if cp.state == CheckpointState.LIVE
            ],
            "dropped": [
                (cp, previews.get(cp.message_id, ""))
                for cp in items
                if cp.state != CheckpointState.LIVE
            ],
            "rewind_form": forms.RewindForm(initial={"version": conv.version}),
        },
        status=status,
    )


@login_required
@require_POST
def rewind(request: HttpRequest, cid: str) -> HttpResponse:
    conv = conversation_or_404(request, cid)
    form = forms.RewindForm(request.POST)
    if not form.is_valid():
        return _form_error(form)
    try:
        result = services.rewind(
            conversation=conv,
            label=form.cleaned_data["label"],
            digest=form.cleaned_data["digest"] or None,
            expected_version=form.cleaned_data["version"],
        )
    except ArborError as exc:
        flash.error(request, exc.detail)
        return redirect("conversations:checkpoints", cid=conv.pk)
    flash.success(request, f"Rewound to “{form.cleaned_data['label']}”.")
    return redirect(_detail_url(conv, result.digest_message))


# --- tree map ------------------------------------------------------------------------

TREE = "conversations/tree.html"


def _tree_annotations(
    conv: Conversation,
) -> tuple[
    dict[uuid.UUID, list[Checkpoint]],
    dict[uuid.UUID, list[Conversation]],
    dict[uuid.UUID, dict[str, Any]],
]:
    cps: dict[uuid.UUID, list[Checkpoint]] = defaultdict(list)
    for cp in selectors.checkpoint_list(conversation=conv):
        cps[cp.message_id].append(cp)
    forks: dict[uuid.UUID, list[Conversation]] = defaultdict(list)
    for f in selectors.conversation_forks(conversation=conv):
        if f.forked_from_id:
            forks[f.forked_from_id].append(f)
    return cps, forks, selectors.rewind_digests(conversation=conv)


def _gap_href(conv: Conversation, tree: TreeMap, gap: Gap) -> str:
    """Without JavaScript a gap is a link: on the main branch, to this page with that
    stretch open (the page shows no other branch open); elsewhere, to the chat view."""
    if tree.line_start(gap.first) != tree.roots()[0]:
        return reverse("conversations:detail", args=[conv.pk]) + f"?m={gap.first}#msg-{gap.first}"
    page = reverse("conversations:tree", args=[conv.pk])
    anchor = f"{'run' if gap.folded else 'node'}-{gap.first}"
    return f"{page}?gap={gap.first}&n={gap.messages}#{anchor}"


def _decorate(
    conv: Conversation,
    tree: TreeMap,
    items: list[OutlineItem],
    cps: dict[uuid.UUID, list[Checkpoint]],
    forks: dict[uuid.UUID, list[Conversation]],
    digests: dict[uuid.UUID, dict[str, Any]],
    previews: dict[uuid.UUID, str] | None = None,
) -> list[dict[str, Any]]:
    if previews is None:
        previews = selectors.message_previews(conversation=conv, ids=shown_ids(items))
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, RunStub):
            out.append({"run": item})
            continue
        if isinstance(item, Gap):
            out.append({"gap": item, "href": _gap_href(conv, tree, item)})
            continue
        mid = item.node.id
        alts, more = stub_chunk(item.alternatives, parent=mid, skip=0, size=ALTS_SHOWN)
        out.append(
            {
                "row": item,
                "id": mid,
                "preview": previews.get(mid, ""),
                "on_path": mid in tree.path,
                "is_tip": mid == tree.tip_id,
                "checkpoints": cps.get(mid, []),
                "forks": forks.get(mid, []),
                "rewind": digests.get(mid),
                "alts": alts,
                "more": more,
            }
        )
    return out


def _decorate_graph(
    conv: Conversation,
    graph: Graph,
    previews: dict[uuid.UUID, str],
    cps: dict[uuid.UUID, list[Checkpoint]],
    forks: dict[uuid.UUID, list[Conversation]],
    digests: dict[uuid.UUID, dict[str, Any]],
) -> None:
    """Give the graph's rows their text, marks and links (the same marks as the outline).
    A message links to the chat view of its branch (where, without JavaScript, "Continue
    from this branch" moves the tip); a stub or a fold links to this page with it open."""
    detail = reverse("conversations:detail", args=[conv.pk])
    page = reverse("conversations:tree", args=[conv.pk])
    keep = "".join(f"open={mid}&" for mid in graph.opened)
    for node in graph.nodes:
        node.href = f"{detail}?m={node.id}#msg-{node.id}"
        if node.kind == "message":
            node.preview = previews.get(node.id, "")
            node.checkpoints = cps.get(node.id, [])
            node.forks = forks.get(node.id, [])
            node.rewind = digests.get(node.id)
        elif node.kind in ("stub", "run"):
            node.open_url = f"{page}?{keep}open={node.id}"
            node.href = f"{node.open_url}#tree-graph"


def _tree_map(
    conv: Conversation,
) -> tuple[
    TreeMap,
    dict[uuid.UUID, list[Checkpoint]],
    dict[uuid.UUID, list[Conversation]],
    dict[uuid.UUID, dict[str, Any]],
]:
    cps, forks, digests = _tree_annotations(conv)
    # Marked nodes are never folded into a quiet run: checkpoints, forks, rewinds and
    # the ends of the branches that rewinds abandoned.
    abandoned = {d["abandoned_tip"] for d in digests.values() if d.get("abandoned_tip")}
    tree_map = TreeMap(
        selectors.tree_skeleton(conversation=conv),
        conv.tip_id,
        set(cps) | set(forks) | set(digests) | abandoned,
    )
    return tree_map, cps, forks, digests


def _opened(values: list[str]) -> list[uuid.UUID]:
    """The ``open`` ids asked for. They only shape the drawing, so a malformed one is
    ignored (and one not in this tree is dropped by the layout) rather than an error."""
    out: list[uuid.UUID] = []
    for value in values[:100]:
        try:
            out.append(uuid.UUID(value))
        except ValueError:
            continue
    return out


def _tree_context(
    conv: Conversation,
    opened: list[str],
    *,
    outline: bool = True,
    notice: str = "",
    stretch: tuple[uuid.UUID, int] | None = None,
) -> dict[str, Any]:
    """The tree page: the graph and (unless only the graph is redrawn) the outline, with
    one preview query for both; ``stretch`` is a gap of the outline to show open."""
    tree_map, cps, forks, digests = _tree_map(conv)
    graph = graph_layout(tree_map, _opened(opened))
    main, other_roots = tree_map.roots()
    items = tree_map.outline(main, opened=stretch) if main and outline else []
    previews = selectors.message_previews(
        conversation=conv, ids=list({*shown_ids(items), *graph.message_ids()})
    )
    _decorate_graph(conv, graph, previews, cps, forks, digests)
    roots, more_roots = stub_chunk(other_roots, parent=None, skip=0, size=ALTS_SHOWN)
    return {
        "conversation": conv,
        "graph": graph,
        "graph_vals": json.dumps(
            {"version": str(conv.version), "open": [str(m) for m in graph.opened]}
        ),
        "items": _decorate(conv, tree_map, items, cps, forks, digests, previews),
        "other_roots": roots,
        "more_roots": more_roots,
        "node_count": len(tree_map.nodes),
        "notice": notice,
    }


@login_required
@require_GET
def tree(request: HttpRequest, cid: str) -> HttpResponse:
    """The whole tree: a drawn graph above an outline, both bounded whatever the size of
    the tree. ``?open=<id>`` (repeatable) opens a collapsed branch or a quiet stretch in the
    graph; for HTMX that is the graph fragment. The outline's fragments open what it left
    closed: ``?from=<id>`` a branch, ``?run=<id>&n=<count>`` a run of quiet messages,
    ``?gap=<id>&n=<count>`` a stretch of a long branch (without HTMX: the page, with that
    stretch open) and ``?alts=<id>&skip=<k>`` more of a message's branches (``roots``: of
    the other roots)."""
    conv = conversation_or_404(request, cid)
    fragment = is_fragment(request)
    if fragment and any(key in request.GET for key in ("from", "run", "gap", "alts")):
        return _outline_fragment(request, conv)
    stretch = None
    if "gap" in request.GET and not fragment:
        stretch = (_parse_id(request.GET["gap"]), _parse_count(request, "n", 1))
    context = _tree_context(
        conv, request.GET.getlist("open"), outline=not fragment, stretch=stretch
    )
    return render_page_or_fragment(request, TREE, "graph" if fragment else None, context)


def _outline_fragment(request: HttpRequest, conv: Conversation) -> HttpResponse:
    """The rows (or, for ``alts``, the branch stubs) that replace the outline's link."""
    tree_map, cps, forks, digests = _tree_map(conv)
    context: dict[str, Any] = {"conversation": conv}
    if "alts" in request.GET:
        value = request.GET["alts"]
        parent = None if value == "roots" else _parse_node(value, tree_map)
        context["stubs"], context["more"] = stub_chunk(
            tree_map.alternatives(parent),
            parent=parent,
            skip=_parse_count(request, "skip", 0),
            size=ALTS_CHUNK,
        )
        context["kind"] = "root" if parent is None else "branch"
        return render_page_or_fragment(request, TREE, "stubs", context)
    partial = "rows"
    items: list[OutlineItem]
    if "from" in request.GET:
        items = tree_map.outline(_parse_node(request.GET["from"], tree_map))
        partial = "branch"
    elif "run" in request.GET:
        start = _parse_node(request.GET["run"], tree_map)
        count = min(_parse_count(request, "n", 1), len(tree_map.nodes))
        items = list(tree_map.run(start, count))
    else:
        start = _parse_node(request.GET["gap"], tree_map)
        items = tree_map.stretch(start, _parse_count(request, "n", 1))
    context["items"] = _decorate(conv, tree_map, items, cps, forks, digests)
    return render_page_or_fragment(request, TREE, partial, context)


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


# --- compare -------------------------------------------------------------------------


@login_required
@require_GET
def compare(request: HttpRequest, cid: str) -> HttpResponse:
    """Two to four siblings, or two branches, side by side with a word diff; with fewer
    than two chosen, a list of recent leaves to pick branches from."""
    conv = conversation_or_404(request, cid)
    ids = comparing.parse_ids(request.GET.getlist("m")[: comparing.MAX_CHOSEN])
    if ids is None:
        raise Http404("no such message")
    chosen = [message_or_404(conv, mid) for mid in ids]
    comparison = comparing.compare(conversation=conv, chosen=chosen) if len(chosen) >= 2 else None
    return render(
        request,
        "conversations/compare.html",
        {
            "conversation": conv,
            "comparison": comparison,
            "chosen": {m.pk for m in chosen},
            "leaves": comparing.recent_leaves(conversation=conv),
            "version": conv.version,
        },
    )


# --- import and settings -------------------------------------------------------------


@login_required
@require_http_methods(["GET", "POST"])
def import_page(request: HttpRequest) -> HttpResponseBase:
    """Upload a transcript; the import runs as a background job whose page shows its
    progress until it is done."""
    form = forms.ImportForm(request.POST or None, request.FILES or None)
    if request.method == "POST":
        if form.is_valid():
            try:
                job = services.import_job_create(
                    owner=signed_in_user(request),
                    upload=form.cleaned_data["file"],
                    format=form.cleaned_data["format"],
                )
            except ArborError as exc:  # the media store is full or read-only
                form.add_error("file", exc.detail)
                return render(
                    request, "conversations/import.html", {"form": form}, status=exc.status
                )
            return redirect("conversations:import_job", job_id=job.pk)
        return render(request, "conversations/import.html", {"form": form}, status=400)
    recent = ImportJob.objects.filter(owner=signed_in_user(request)).order_by("-created_at")[:20]
    jobs = [services.import_job_sweep(job) for job in recent]
    return render(request, "conversations/import.html", {"form": form, "jobs": jobs})


@login_required
@require_GET
def import_job(request: HttpRequest, job_id: str) -> HttpResponse:
    try:
        job = ImportJob.objects.get(pk=uuid.UUID(job_id), owner=signed_in_user(request))
    except (ValueError, ImportJob.DoesNotExist):
        raise Http404("no such import") from None
    job = services.import_job_sweep(job)
    return render_page_or_fragment(
        request, "conversations/import_job.html", "progress", {"job": job}
    )


def _configured_models(*, staff: bool) -> tuple[list[ModelSpec], str]:
    """The default model and those the operator declared (the ARBOR_MODELS file), with
    the limits Arbor budgets for. A bad file is an error on the page, not a 500; only
    staff see its details (they name paths on the server)."""
    default = settings.ARBOR_DEFAULT_MODEL
    try:
        declared = registry.declared_models()
    except ValueError as exc:
        declared, error = {}, str(exc)
    else:
        error = ""
    models: list[ModelSpec] = []
    for model_id in [default, *sorted(set(declared) - {default})]:
        try:
            models.append(registry.resolve_model(model_id))
        except ValueError as exc:
            error = f"{error} {exc}".strip()
    if error and not staff:
        error = f"The {registry.MODELS_ENV} file has a problem: ask an operator to check it."
    return models, error


def _calibrations() -> list[dict[str, Any]]:
    """How far each model's provider counts from Arbor's estimate, and what taught it."""
    from compaction.models import CalibrationEvent, ModelCalibration

    rows = list(ModelCalibration.objects.order_by("model"))
    events: dict[str, list[CalibrationEvent]] = defaultdict(list)
    for event in CalibrationEvent.objects.filter(model__in=[r.model for r in rows]).order_by(
        "-created_at", "-pk"
    )[:500]:
        if len(events[event.model]) < 8:
            events[event.model].append(event)
    return [{"row": r, "events": events[r.model]} for r in rows]


@login_required
@require_http_methods(["GET", "POST"])
def settings_page(request: HttpRequest) -> HttpResponse:
    form = forms.TokenForm(request.POST or None)
    models, models_error = _configured_models(staff=request.user.is_staff)
    secret = ""
    status = 200
    if request.method == "POST":
        if form.is_valid():
            days = form.cleaned_data["expires"]
            _, secret = services.api_token_create(
                user=signed_in_user(request),
                name=form.cleaned_data["name"],
                expires_in=timedelta(days=days) if days else None,
            )
            form = forms.TokenForm()
        else:
            status = 400
    response = render(
        request,
        "conversations/settings.html",
        {
            "form": form,
            "secret": secret,
            "tokens": ApiToken.objects.filter(user=signed_in_user(request)).order_by("-created_at"),
            "models": models,
            "models_error": models_error,
            "default_model": settings.ARBOR_DEFAULT_MODEL,
            "calibrations": _calibrations(),
            "now": timezone.now(),
        },
        status=status,
    )
    add_never_cache_headers(response)  # the secret is shown once: never from a cache
    return response


@login_required
@require_POST
def token_revoke(request: HttpRequest, token_id: int) -> HttpResponseRedirect:
    try:
        services.api_token_revoke(user=signed_in_user(request), token_id=token_id)
    except NotFound:
        raise Http404("no such token") from None
    flash.success(request, "Token revoked.")
    return redirect("conversations:settings")
