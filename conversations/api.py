"""The tree's JSON API (DESIGN.md §3). Each endpoint: typed input, one lookup scoped to
the owner, one service or selector call."""

from __future__ import annotations

import uuid
from typing import Any

from django.http import FileResponse, HttpRequest
from ninja import Field as F
from ninja import File, Query, Router, Schema, Status, UploadedFile

from conversations import selectors, services, turns
from conversations.errors import NotFound
from conversations.models import Checkpoint, Conversation, Message
from conversations.schemas import (
    BlobOut,
    ChatIn,
    ChatOut,
    CheckpointIn,
    CheckpointOut,
    ConversationDetailOut,
    ConversationIn,
    ConversationPageOut,
    ConversationPatch,
    EditIn,
    ForkIn,
    MessageDetailOut,
    PathOut,
    RegenerateIn,
    RewindIn,
    RewindOut,
    StopOut,
    TipIn,
    TipOut,
    TreePageOut,
    TurnIn,
    TurnOut,
)
from conversations.streaming import event_stream_primed
from conversations.views.common import blob_response

router = Router(tags=["tree"])


def _user(request: HttpRequest) -> Any:
    """The user that ninja's authentication attached to the request."""
    return request.auth  # type: ignore[attr-defined]


def _conversation_out(conv: Conversation, message_count: int | None = None) -> dict[str, Any]:
    count = getattr(conv, "message_count", None) if message_count is None else message_count
    forked = conv.forked_from
    return {
        "id": conv.id,
        "title": conv.title,
        "tip": conv.tip_id,
        "version": conv.version,
        "forked_from": conv.forked_from_id,
        "forked_from_conversation": forked.conversation_id if forked else None,
        "spawned_by": conv.spawned_by_id,
        "spawned_call": conv.spawned_call,
        "model": conv.model,
        "system_prompt": conv.system_prompt,
        "checkpoint_tools": conv.checkpoint_tools,
        "harness": conv.harness,
        "message_count": count if count is not None else selectors.message_count(conversation=conv),
        "created_at": conv.created_at,
        "updated_at": conv.updated_at,
    }


def _message_out(m: Message) -> dict[str, Any]:
    return {
        "id": m.id,
        "parent": m.parent_id,
        "role": m.role,
        "parts": m.parts,
        "depth": m.depth,
        "origin": m.origin,
        "metadata": m.metadata,
        "created_at": m.created_at,
    }


def _checkpoint_out(cp: Checkpoint) -> dict[str, Any]:
    return {
        "id": cp.pk,
        "label": cp.label,
        "message": cp.message_id,
        "state": cp.state,
        "reason": cp.reason,
        "source": cp.source,
        "digest_message": cp.digest_message_id,
        "created_at": cp.created_at,
    }


def _detail(conv: Conversation) -> dict[str, Any]:
    forks, spawned = selectors.conversation_offspring(conversation=conv)
    return {
        **_conversation_out(conv),
        "forks": [{"id": f.id, "title": f.title, "forked_from": f.forked_from_id} for f in forks],
        "subagents": [
            {"id": s.id, "title": s.title, "spawned_by": s.spawned_by_id, "call": s.spawned_call}
            for s in spawned
        ],
    }


# --- conversations -------------------------------------------------------------------


@router.post("/conversations", response={201: ConversationDetailOut})
def create_conversation(request: HttpRequest, payload: ConversationIn) -> Status[Any]:
    conv = services.conversation_create(owner=_user(request), **payload.dict())
    return Status(201, {**_conversation_out(conv, 0), "forks": [], "subagents": []})


class ListQuery(Schema):
    q: str = F("", max_length=200)
    limit: int = F(20, ge=1, le=100)
    cursor: str | None = None


@router.get("/conversations", response=ConversationPageOut)
def list_conversations(request: HttpRequest, query: Query[ListQuery]) -> Any:
    page = selectors.conversation_page(
        user=_user(request),
        q=query.q.strip(),
        cursor=query.cursor,
        limit=query.limit,
    )
    return {"items": [_conversation_out(c) for c in page.items], "next_cursor": page.next_cursor}


@router.get("/conversations/{cid}", response=ConversationDetailOut)
def get_conversation(request: HttpRequest, cid: str) -> Any:
    conv = selectors.conversation_get(user=_user(request), conversation_id=cid)
    return _detail(conv)


@router.patch("/conversations/{cid}", response=ConversationDetailOut)
def update_conversation(request: HttpRequest, cid: str, payload: ConversationPatch) -> Any:
    conv = selectors.conversation_get(user=_user(request), conversation_id=cid)
    changes = {k: v for k, v in payload.dict(exclude_unset=True).items() if v is not None}
    services.conversation_update(conversation=conv, **changes)
    return _detail(conv)


@router.delete("/conversations/{cid}", response={204: None})
def delete_conversation(request: HttpRequest, cid: str) -> Status[None]:
    conv = selectors.conversation_get(user=_user(request), conversation_id=cid)
    services.conversation_delete(conversation=conv)
    return Status(204, None)


@router.get("/conversations/{cid}/path", response=PathOut)
def get_path(request: HttpRequest, cid: str, tip: str | None = None) -> Any:
    conv = selectors.conversation_get(user=_user(request), conversation_id=cid)
    tip_id = conv.tip_id
    if tip is not None:
        try:
            tip_id = uuid.UUID(tip)
        except ValueError:
            raise NotFound(f"no such message: {tip!r}") from None
    messages = selectors.message_path(conversation_id=conv.pk, tip_id=tip_id)
    if tip_id is not None and not messages:
        raise NotFound(f"no such message in this conversation: {tip_id}")
    return {"conversation": conv.pk, "tip": tip_id, "messages": [_message_out(m) for m in messages]}


class TreeQuery(Schema):
    limit: int = F(200, ge=1, le=1000)
    cursor: str | None = None


@router.get("/conversations/{cid}/tree", response=TreePageOut)
def get_tree(request: HttpRequest, cid: str, query: Query[TreeQuery]) -> Any:
    conv = selectors.conversation_get(user=_user(request), conversation_id=cid)
    page = selectors.tree_page(conversation=conv, cursor=query.cursor, limit=query.limit)
    nodes = [
        {
            "id": m.id,
            "parent": m.parent_id,
            "role": m.role,
            "origin": m.origin,
            "preview": selectors.preview(m.parts),
            "depth": m.depth,
            "child_count": m.child_count,
        }
        for m in page.items
    ]
    return {
        "conversation": conv.pk,
        "tip": conv.tip_id,
        "nodes": nodes,
        "next_cursor": page.next_cursor,
    }


# --- messages, turns and the tip -----------------------------------------------------


@router.get("/messages/{mid}", response=MessageDetailOut)
def get_message(request: HttpRequest, mid: str) -> Any:
    message = selectors.message_get(user=_user(request), message_id=mid)
    siblings = selectors.message_siblings(message=message)
    return {
        **_message_out(message),
        "conversation": message.conversation_id,
        "siblings": {"ids": siblings.ids, "index": siblings.index},
    }


def _turn_out(result: services.TurnResult) -> dict[str, Any]:
    return {"tip": result.tip, "version": result.version, "message_ids": result.message_ids}


@router.post("/conversations/{cid}/turns", response={201: TurnOut})
def append_turn(request: HttpRequest, cid: str, payload: TurnIn) -> Status[Any]:
    conv = selectors.conversation_get(user=_user(request), conversation_id=cid)
    result = services.turn_append(
        conversation=conv,
        parent_id=payload.parent,
        expected_version=payload.expected_version,
        messages=[m.dict() for m in payload.messages],
    )
    return Status(201, _turn_out(result))


@router.post("/conversations/{cid}/tip", response=TipOut)
def move_tip(request: HttpRequest, cid: str, payload: TipIn) -> Any:
    conv = selectors.conversation_get(user=_user(request), conversation_id=cid)
    state = services.tip_move(
        conversation=conv, message_id=payload.message, expected_version=payload.expected_version
    )
    return {"tip": state.tip, "version": state.version}


@router.post("/messages/{mid}/edit", response={201: TurnOut})
def edit_message(request: HttpRequest, mid: str, payload: EditIn) -> Status[Any]:
    message = selectors.message_get(user=_user(request), message_id=mid)
    result = services.message_edit(
        conversation=message.conversation,
        message_id=message.pk,
        parts=payload.parts,
        expected_version=payload.expected_version,
    )
    return Status(201, _turn_out(result))


@router.post("/messages/{mid}/regenerate", response={201: TurnOut})
def regenerate_message(request: HttpRequest, mid: str, payload: RegenerateIn) -> Status[Any]:
    message = selectors.message_get(user=_user(request), message_id=mid)
    result = services.message_regenerate(
        conversation=message.conversation,
        message_id=message.pk,
        messages=[m.dict() for m in payload.messages],
        expected_version=payload.expected_version,
    )
    return Status(201, _turn_out(result))


@router.post("/messages/{mid}/fork", response={201: ConversationDetailOut})
def fork_message(request: HttpRequest, mid: str, payload: ForkIn) -> Status[Any]:
    message = selectors.message_get(user=_user(request), message_id=mid)
    fork = services.conversation_fork(
        message=message,
        owner=_user(request),
        title=payload.title,
        scope=payload.scope,
    )
    fork.forked_from = message
    return Status(201, _detail(fork))


# --- chat with a model ----------------------------------------------------------------


# With ``stream`` the answer is a 200 event stream, not the 201 JSON of ``response=``:
# the schema says so too, for clients generated from it.
STREAMED = {
    "responses": {
        200: {
            "description": "With stream: Server-Sent Events (attempt, delta, tool_call, "
            "tool_result, then done or error)",
            "content": {
                "text/event-stream": {
                    # Each event: its name, and its fields as a JSON object.
                    "schema": {
                        "type": "object",
                        "required": ["event", "data"],
                        "properties": {
                            "event": {"type": "string"},
                            "data": {"type": "string", "contentMediaType": "application/json"},
                        },
                    }
                }
            },
        }
    }
}


@router.post(
    "/conversations/{cid}/messages", response={201: ChatOut}, tags=["chat"], openapi_extra=STREAMED
)
def chat(request: HttpRequest, cid: str, payload: ChatIn) -> Any:
    """Run a chat turn with the model: JSON when it is over, or Server-Sent Events
    (``delta``, ``tool_call``, ``tool_result``, then ``done`` or ``error``) with
    ``stream: true``."""
    conv = selectors.conversation_get(user=_user(request), conversation_id=cid)
    fields = payload.model_fields_set
    kwargs: dict[str, Any] = {"conversation": conv, "parts": payload.parts, "model": payload.model}
    if "parent" in fields:
        kwargs["parent_id"] = payload.parent
    if payload.stream:
        return event_stream_primed(request, turns.turn_events(**kwargs))
    return Status(201, _chat_out(turns.turn_run(**kwargs)))


def _chat_out(outcome: turns.TurnOutcome) -> dict[str, Any]:
    return {
        "attempt": outcome.attempt,
        "tip": outcome.tip,
        "version": outcome.version,
        "message_ids": outcome.message_ids,
        "stopped": outcome.stopped,
    }


@router.post(
    "/conversations/{cid}/retry", response={201: ChatOut}, tags=["chat"], openapi_extra=STREAMED
)
def retry(request: HttpRequest, cid: str, stream: bool = False) -> Any:
    """Run the last failed or interrupted turn again. 404 ``nothing_loaded`` when there
    is no such conversation or no transcript; 409 ``nothing_to_retry`` when the last
    turn completed."""
    events = turns.retry_events(user=_user(request), conversation_id=cid)
    if stream:
        return event_stream_primed(request, events)
    return Status(201, _chat_out(turns.turn_drain(events)))


@router.post("/conversations/{cid}/stop", response={202: StopOut}, tags=["chat"])
def stop(request: HttpRequest, cid: str, attempt: uuid.UUID | None = None) -> Any:
    """Stop the conversation's running turn (``attempt``, else every one running),
    whichever process runs it: the model's request is cut, and the turn is written with
    what streamed of its answer, marked ``metadata.stopped``; its own stream ends with
    ``done`` and ``stopped: true``. 409 ``nothing_running`` when no turn runs."""
    conv = selectors.conversation_get(user=_user(request), conversation_id=cid)
    return Status(202, {"stopping": turns.turn_stop(conversation=conv, attempt_id=attempt)})


# --- checkpoints and rewind ----------------------------------------------------------


@router.get("/conversations/{cid}/checkpoints", response=list[CheckpointOut])
def list_checkpoints(request: HttpRequest, cid: str) -> Any:
    conv = selectors.conversation_get(user=_user(request), conversation_id=cid)
    return [_checkpoint_out(cp) for cp in selectors.checkpoint_list(conversation=conv)]


@router.post("/conversations/{cid}/checkpoints", response={201: CheckpointOut})
def create_checkpoint(request: HttpRequest, cid: str, payload: CheckpointIn) -> Status[Any]:
    conv = selectors.conversation_get(user=_user(request), conversation_id=cid)
    checkpoint = services.checkpoint_create(conversation=conv, label=payload.label)
    return Status(201, _checkpoint_out(checkpoint))


@router.post("/conversations/{cid}/rewind", response=RewindOut)
def rewind(request: HttpRequest, cid: str, payload: RewindIn) -> Any:
    conv = selectors.conversation_get(user=_user(request), conversation_id=cid)
    result = services.checkpoint_rewind(
        conversation=conv,
        label=payload.label,
        digest=payload.digest,
        expected_version=payload.expected_version,
    )
    checkpoint = result.checkpoint
    checkpoint.digest_message_id = result.digest_message
    return {
        "tip": result.tip,
        "version": result.version,
        "digest_message": result.digest_message,
        "abandoned_tip": result.abandoned_tip,
        "checkpoint": _checkpoint_out(checkpoint),
    }


# --- blobs ---------------------------------------------------------------------------


@router.post("/blobs", response={201: BlobOut}, tags=["blobs"])
def upload_blob(request: HttpRequest, file: File[UploadedFile]) -> Status[Any]:
    blob = services.blob_store_upload(owner=_user(request), upload=file)
    return Status(
        201,
        {
            "sha256": blob.sha256,
            "mime": blob.mime,
            "size": blob.size,
            "width": blob.width,
            "height": blob.height,
        },
    )


@router.get("/blobs/{sha256}", tags=["blobs"], url_name="get_blob")
def get_blob(request: HttpRequest, sha256: str) -> FileResponse:
    return blob_response(selectors.blob_get(user=_user(request), sha256=sha256))
