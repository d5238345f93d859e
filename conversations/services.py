"""Writes to the tree. Every function here either commits all of its work or none of it.

Tip moves are compare-and-set on ``Conversation.version``: the caller passes the version
it saw, and a stale one raises StaleVersion (HTTP 409) with nothing written.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import secrets
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.core.files.base import ContentFile
from django.core.files.storage import FileSystemStorage, default_storage
from django.db import IntegrityError, connection, models, transaction
from django.db.models import Exists, F, OuterRef, Subquery
from django.db.models.functions import Now
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from PIL import Image, UnidentifiedImageError

from arbor.heartbeat import Heartbeat, db_now
from arbor.procs import process_gone, process_identity
from conversations import selectors
from conversations.errors import (
    ArborError,
    Conflict,
    InvalidInput,
    NotFound,
    StaleVersion,
    TokenExpired,
    TooManyRequests,
    storage_error,
)
from conversations.models import (
    ApiToken,
    AttemptStatus,
    Blob,
    Checkpoint,
    CheckpointSource,
    CheckpointState,
    Conversation,
    Message,
    Origin,
    Role,
    TurnAttempt,
)
from conversations.parts import (
    DraftMessage,
    check_turn_pairing,
    clean_messages,
    image_blobs,
    searchable_text,
    tool_calls,
)
from conversations.resume import ResumeReport, resume_view


@dataclass(frozen=True)
class TipState:
    tip: uuid.UUID | None
    version: int


@dataclass(frozen=True)
class TurnResult:
    tip: uuid.UUID
    version: int
    message_ids: list[uuid.UUID]


# --- conversations -------------------------------------------------------------------


def conversation_create(
    *,
    owner: User,
    title: str = "",
    system_prompt: str = "",
    model: str = "",
    checkpoint_tools: bool = False,
) -> Conversation:
    return Conversation.objects.create(
        owner=owner,
        title=title.strip(),
        system_prompt=system_prompt,
        model=model,
        checkpoint_tools=checkpoint_tools,
    )


def conversation_update(*, conversation: Conversation, **changes: Any) -> Conversation:
    """Change a conversation's settings (title, system prompt, model, tools). The tree and
    its tip are not settings: they move only through turns, tip moves and rewinds."""
    allowed = {"title", "system_prompt", "model", "checkpoint_tools"}
    unknown = set(changes) - allowed
    if unknown:
        raise InvalidInput(f"cannot change {sorted(unknown)}")
    if "title" in changes:
        changes["title"] = changes["title"].strip()
    for name, value in changes.items():
        setattr(conversation, name, value)
    conversation.save(update_fields=[*changes, "updated_at"])
    return conversation


def conversation_delete(*, conversation: Conversation) -> None:
    """Delete a conversation and all of its messages.

    Messages go in one statement rather than Django's per-level cascade walk, which
    would cost a query per depth level on a long chain. Forks made from it keep their
    own copies and only lose the ``forked_from`` link; sub-agent runs it started lose
    their ``spawned_by`` link.
    """
    with transaction.atomic():
        # Locked first: a fork or a turn writing into it finishes before, or finds it gone.
        if not Conversation.objects.select_for_update().filter(pk=conversation.pk).exists():
            return  # deleted meanwhile: nothing left to do
        Conversation.objects.filter(forked_from__conversation=conversation).update(forked_from=None)
        Conversation.objects.filter(spawned_by__conversation=conversation).update(spawned_by=None)
        Conversation.objects.filter(pk=conversation.pk).update(tip=None)
        Checkpoint.objects.filter(conversation=conversation).delete()
        Message.objects.filter(conversation=conversation)._raw_delete(connection.alias)
        Conversation.objects.filter(pk=conversation.pk).delete()


# --- turns and tip moves -------------------------------------------------------------


def _resolve_images(drafts: list[DraftMessage], *, owner_id: Any) -> None:
    """Fill image parts from their Blob rows; an unknown blob, or one the user never
    uploaded, is rejected."""
    wanted = {sha for d in drafts for sha in image_blobs(d.parts)}
    if not wanted:
        return
    blobs = {b.sha256: b for b in Blob.objects.filter(sha256__in=wanted, owners__id=owner_id)}
    missing = sorted(wanted - blobs.keys())
    if missing:
        raise InvalidInput(
            "image parts name blobs that were not uploaded by this user",
            code="unknown_blob",
            blobs=missing,
        )

    def fill(parts: list[dict[str, Any]]) -> None:
        for part in parts:
            if part["type"] == "image":
                blob = blobs[part["blob"]]
                part.update(mime=blob.mime, width=blob.width, height=blob.height)
            elif part["type"] == "tool_result":
                fill(part["parts"])

    for draft in drafts:
        fill(draft.parts)


def _lock_conversation(
    conversation: Conversation, expected_version: int | None, *, parent: uuid.UUID | None = None
) -> Conversation:
    """Lock the conversation row for the rest of the transaction and check the version.
    With ``parent``, the same query reads that message's depth (``conv.parent_depth``:
    None when it is not a message of this conversation)."""
    rows = Conversation.objects.select_for_update().only("id", "owner_id", "tip_id", "version")
    if parent is not None:
        rows = rows.annotate(
            parent_depth=Subquery(
                Message.objects.filter(pk=parent, conversation_id=OuterRef("pk")).values("depth")
            )
        )
    try:
        conv = rows.get(pk=conversation.pk)
    except Conversation.DoesNotExist:  # deleted while this writer waited for the lock
        raise NotFound(f"no such conversation: {conversation.pk}") from None
    if expected_version is not None and conv.version != expected_version:
        raise StaleVersion(tip=str(conv.tip_id) if conv.tip_id else None, version=conv.version)
    return conv


def turn_append(
    *,
    conversation: Conversation,
    parent_id: uuid.UUID | str | None,
    expected_version: int | None,
    messages: list[Any] | list[DraftMessage],
    origin: str = Origin.TURN,
    ends_in_rewind: bool = False,
    also: Callable[[uuid.UUID], object] | None = None,
) -> TurnResult:
    """Append one whole turn below ``parent_id`` and move the tip to its last message, in
    one transaction. A turn whose tool calls and results do not pair up is rejected with
    nothing written. ``expected_version=None`` appends whatever the version is now (the
    chat engine, whose turn belongs below its parent even if the tip moved meanwhile).
    ``also`` is called with the new tip inside that transaction, to commit something
    with the turn (the engine: its attempt's end) without a second, nested one."""
    if messages and all(isinstance(m, DraftMessage) for m in messages):
        drafts = [m for m in messages if isinstance(m, DraftMessage)]
    else:
        drafts = clean_messages(
            messages,
            max_messages=settings.ARBOR_MAX_TURN_MESSAGES,
            max_chars=settings.ARBOR_MAX_PART_CHARS,
        )
    check_turn_pairing(drafts, ends_in_rewind=ends_in_rewind)

    pid: uuid.UUID | None = None
    if parent_id is not None:
        try:
            pid = uuid.UUID(str(parent_id))
        except ValueError:
            raise InvalidInput(
                f"parent {parent_id!r} is not a message id", code="bad_parent"
            ) from None

    with transaction.atomic():
        # The lock and the parent's depth in one query: a message is never moved to
        # another conversation, so reading it before the lock is granted is as good.
        conv = _lock_conversation(conversation, expected_version, parent=pid)
        depth = 0
        previous: uuid.UUID | None = None
        if pid is not None:
            if conv.parent_depth is None:  # type: ignore[attr-defined]
                raise InvalidInput(
                    f"parent {pid} is not a message of this conversation", code="bad_parent"
                )
            depth = conv.parent_depth + 1  # type: ignore[attr-defined]
            previous = pid
        _resolve_images(drafts, owner_id=conv.owner_id)

        now = timezone.now()
        rows: list[Message] = []
        for i, draft in enumerate(drafts):
            row = Message(
                id=uuid.uuid4(),
                conversation_id=conv.pk,
                parent_id=previous,
                role=draft.role,
                parts=draft.parts,
                depth=depth + i,
                origin=origin if i == 0 else Origin.TURN,
                metadata=draft.metadata,
                # Distinct timestamps keep creation order stable for sibling listings.
                created_at=now + timedelta(microseconds=i),
            )
            rows.append(row)
            previous = row.id
        _insert_messages(rows)
        tip = rows[-1].id
        updated = Conversation.objects.filter(pk=conv.pk, version=conv.version).update(
            tip_id=tip, version=F("version") + 1, updated_at=now
        )
        if updated != 1:  # pragma: no cover - the row lock above makes this unreachable
            raise StaleVersion(tip=str(conv.tip_id), version=conv.version)
        if also is not None:
            also(tip)
    return TurnResult(tip=tip, version=conv.version + 1, message_ids=[r.id for r in rows])


def tip_move(
    *, conversation: Conversation, message_id: uuid.UUID | str, expected_version: int
) -> TipState:
    """Move the tip to any message of the conversation: one guarded UPDATE. Nothing else
    is written; the branch left behind stays as it is."""
    try:
        mid = uuid.UUID(str(message_id))
    except ValueError:
        raise NotFound(f"no such message: {message_id!r}") from None
    in_conversation = Message.objects.filter(pk=mid, conversation_id=conversation.pk)
    updated = (
        Conversation.objects.filter(pk=conversation.pk, version=expected_version)
        .filter(Exists(in_conversation))
        .update(tip_id=mid, version=F("version") + 1, updated_at=timezone.now())
    )
    if updated == 1:
        return TipState(tip=mid, version=expected_version + 1)
    # The update matched nothing: say why, without writing anything.
    if not in_conversation.exists():
        raise NotFound(f"no such message in this conversation: {mid}")
    current = Conversation.objects.values("tip_id", "version").filter(pk=conversation.pk).first()
    if current is None:  # deleted meanwhile, its messages with it
        raise NotFound(f"no such conversation: {conversation.pk}")
    raise StaleVersion(
        tip=str(current["tip_id"]) if current["tip_id"] else None, version=current["version"]
    )


def message_edit(
    *,
    conversation: Conversation,
    message_id: uuid.UUID | str,
    parts: list[Any],
    expected_version: int,
) -> TurnResult:
    """Edit a user prompt: append the new text as a sibling of the original (same parent)
    and move the tip to it. The original and everything below it stay."""
    original = _message_in(conversation, message_id)
    return turn_append(
        conversation=conversation,
        parent_id=message_edit_parent(message=original),
        expected_version=expected_version,
        messages=[{"role": Role.USER, "parts": parts}],
        origin=Origin.EDIT,
    )


def message_regenerate(
    *,
    conversation: Conversation,
    message_id: uuid.UUID | str,
    messages: list[Any],
    expected_version: int,
) -> TurnResult:
    """Append a new answer as a sibling of an assistant message (same parent)."""
    parent_id = message_regenerate_parent(message=_message_in(conversation, message_id))
    if not messages or not isinstance(messages[0], dict) or messages[0].get("role") != "assistant":
        raise InvalidInput("a regenerated answer starts with an assistant message")
    return turn_append(
        conversation=conversation,
        parent_id=parent_id,
        expected_version=expected_version,
        messages=messages,
        origin=Origin.REGENERATE,
    )


def message_edit_parent(*, message: Message) -> uuid.UUID | None:
    """Where an edit of ``message`` goes: beside it, under its parent. Only a user's
    prompt can be edited (the API's edit and the browser's both ask here)."""
    if message.role != Role.USER:
        raise InvalidInput("only user messages can be edited", code="not_editable")
    return message.parent_id


def message_regenerate_parent(*, message: Message) -> uuid.UUID | None:
    """Where a new answer in place of ``message`` goes: beside it. Only an assistant's
    answer can be regenerated."""
    if message.role != Role.ASSISTANT:
        raise InvalidInput("only assistant answers can be regenerated", code="not_regenerable")
    return message.parent_id


def _message_in(conversation: Conversation, message_id: uuid.UUID | str) -> Message:
    try:
        mid = uuid.UUID(str(message_id))
        return Message.objects.get(pk=mid, conversation_id=conversation.pk)
    except (ValueError, Message.DoesNotExist):
        raise NotFound(f"no such message in this conversation: {message_id}") from None


# --- turn attempts -------------------------------------------------------------------
# An attempt records a chat turn apart from the transcript (DESIGN.md invariant 7): what
# was asked, committed before the model is called, so a failed or interrupted turn can be
# retried after a restart; then how it ended. The turn engine (conversations.turns and
# conversations.turn_engine) records them only through these functions.


def turn_attempt_start(
    *,
    conversation: Conversation,
    parent_id: uuid.UUID | str | None,
    input_parts: list[dict[str, Any]],
    model: str,
    retry_of: TurnAttempt | None = None,
) -> TurnAttempt:
    """Record a turn about to run in this process, committed on its own (or with the
    caller's transaction: a retry claims its attempt under the conversation's lock)."""
    # On its own, one INSERT committed as it runs (no BEGIN and COMMIT around it): the
    # foreign key of a conversation deleted a moment ago is checked at that commit and
    # fails here, as NotFound. Inside a caller's transaction, a savepoint, so that the
    # failure leaves the caller's transaction usable.
    inside = transaction.get_connection().in_atomic_block
    try:
        with transaction.atomic() if inside else contextlib.nullcontext():
            attempt = TurnAttempt.objects.create(
                conversation=conversation,
                parent_id=parent_id,
                input_parts=input_parts,
                model=model,
                worker=process_identity(),
                retry_of=retry_of,
                heartbeat_at=Now(),  # its first sign of life, in the database's time
            )
    except IntegrityError:  # the conversation was deleted a moment ago
        raise NotFound(f"no such conversation: {conversation.pk}") from None
    # This host's time of that beat, which only spaces the next ones out
    # (turn_attempt_heartbeat); the row holds the database's.
    attempt.heartbeat_at = timezone.now()
    return attempt


def turn_attempt_lease(*, attempt: TurnAttempt, on_stop: Callable[[], object]) -> Heartbeat:
    """One thread (and one connection) per running turn, for as long as it runs (use it
    as ``with``). Every ARBOR_TURN_STOP_POLL_SECONDS it looks whether someone asked the
    turn to stop, from any process, and calls ``on_stop`` once when they did: the run
    may be blocked reading a silent model, so it cannot look itself. Every
    ARBOR_ATTEMPT_STALE_SECONDS / 4 it renews the attempt's heartbeat, whatever the model
    is doing: a model silent for minutes is still a turn in progress (retry refuses it),
    and a process that died stops renewing, so its attempt goes stale."""
    running = TurnAttempt.objects.filter(pk=attempt.pk, status=AttemptStatus.RUNNING)
    asked = TurnAttempt.objects.filter(pk=attempt.pk, stop_requested_at__isnull=False)
    every = settings.ARBOR_ATTEMPT_STALE_SECONDS / 4
    state = {"renewed": time.monotonic(), "stopped": False}

    def beat() -> None:
        now = time.monotonic()
        if now - state["renewed"] >= every:
            state["renewed"] = now
            running.update(heartbeat_at=Now())  # the database's clock: see arbor.heartbeat
        if not state["stopped"] and asked.exists():
            state["stopped"] = True
            on_stop()

    interval = min(settings.ARBOR_TURN_STOP_POLL_SECONDS, every)
    return Heartbeat(beat, interval, name="arbor-turn-lease")


def turn_attempt_heartbeat(*, attempt: TurnAttempt) -> None:
    """The attempt showed a sign of life (a streamed event). At most one write every few
    seconds, however fast the tokens arrive: ``attempt`` keeps this host's time of the
    last one for that; the row gets the database's (see arbor.heartbeat)."""
    now = timezone.now()
    if now - attempt.heartbeat_at > timedelta(seconds=5):
        attempt.heartbeat_at = now
        TurnAttempt.objects.filter(pk=attempt.pk).update(heartbeat_at=Now())


def turn_attempt_live(*, attempt: TurnAttempt, live: dict[str, Any]) -> None:
    """Record what the running turn has streamed so far: a chat reloaded mid-answer shows
    it and follows it (``TurnAttempt.live``). The transcript is not touched."""
    TurnAttempt.objects.filter(pk=attempt.pk, status=AttemptStatus.RUNNING).update(live=live)


def turn_attempt_rebase(*, attempt: TurnAttempt, parent_id: uuid.UUID) -> None:
    """The model rewound mid-turn and its digest is committed: a retry of a failure after
    this point continues from ``parent_id`` (the digest), not from scratch."""
    TurnAttempt.objects.filter(pk=attempt.pk).update(parent_id=parent_id, input_parts=[])


def turn_attempt_finish(
    *,
    attempt: TurnAttempt,
    status: str,
    code: str = "",
    text: str = "",
    tip: uuid.UUID | None = None,
) -> None:
    """Record how an attempt ended: ``completed`` with the tip its turn wrote (in the
    turn's own transaction), or ``failed`` with an error code and text."""
    TurnAttempt.objects.filter(pk=attempt.pk).update(
        status=status,
        error_code=code[:64],
        error_text=text,
        result_tip_id=tip,
        finished_at=timezone.now(),
        live={},  # what streamed is in the transcript now, or was let go with the turn
    )


# --- fork ----------------------------------------------------------------------------


class ForkScope:
    PATH = "path"
    SUBTREE = "subtree"
    CHOICES = (PATH, SUBTREE)


def _insert_messages(rows: list[Message]) -> None:
    """Insert many messages in a single statement whatever their number.

    ``bulk_create`` splits into batches of ~100 rows on SQLite (999 parameters a query),
    so a 10,000-message fork would cost 100 queries. Instead the rows travel as one
    JSON parameter that the database unpacks itself (json_each / jsonb_to_recordset).
    The search text is computed here from the parts, whatever the row object holds.
    """
    if not rows:
        return
    table = connection.ops.quote_name(Message._meta.db_table)
    if connection.vendor == "postgresql":
        payload = [
            {
                "id": str(r.id),
                "conversation_id": str(r.conversation_id),
                "parent_id": str(r.parent_id) if r.parent_id else None,
                "role": r.role,
                "parts": r.parts,
                "depth": r.depth,
                "origin": r.origin,
                "metadata": r.metadata,
                "created_at": r.created_at.isoformat(),
                "search_text": searchable_text(r.parts),
                "gateway_key": r.gateway_key,
            }
            for r in rows
        ]
        sql = f"""
            INSERT INTO {table}
                (id, conversation_id, parent_id, role, parts, depth, origin, metadata, created_at,
                 search_text, gateway_key)
            SELECT id, conversation_id, parent_id, role, parts, depth, origin, metadata, created_at,
                   search_text, gateway_key
            FROM jsonb_to_recordset(%s::jsonb) AS x(
                id uuid, conversation_id uuid, parent_id uuid, role varchar, parts jsonb,
                depth integer, origin varchar, metadata jsonb, created_at timestamptz,
                search_text text, gateway_key varchar)
        """
    elif connection.vendor == "sqlite":
        adapt = connection.ops.adapt_datetimefield_value
        payload = [
            {
                "id": r.id.hex,
                "conversation_id": r.conversation_id.hex,
                "parent_id": r.parent_id.hex if r.parent_id else None,
                "role": r.role,
                # Stored exactly as Django's JSONField would store them.
                "parts": json.dumps(r.parts),
                "depth": r.depth,
                "origin": r.origin,
                "metadata": json.dumps(r.metadata),
                "created_at": adapt(r.created_at),
                "search_text": searchable_text(r.parts),
                "gateway_key": r.gateway_key,
            }
            for r in rows
        ]
        cols = ("id", "conversation_id", "parent_id", "role", "parts", "depth", "origin",
                "metadata", "created_at", "search_text", "gateway_key")  # fmt: skip
        select = ", ".join(f"json_extract(value, '$.{c}')" for c in cols)
        sql = f"INSERT INTO {table} ({', '.join(cols)}) SELECT {select} FROM json_each(%s)"
    else:  # pragma: no cover - other backends are not supported
        for r in rows:
            r.search_text = searchable_text(r.parts)
        Message.objects.bulk_create(rows)
        return
    with connection.cursor() as cursor:
        cursor.execute(sql, [json.dumps(payload)])


def _copy_messages(
    mapping: list[tuple[uuid.UUID, uuid.UUID, uuid.UUID | None]], *, conversation_id: uuid.UUID
) -> None:
    """Copy messages (old id → new id, new parent id) into a conversation in one
    INSERT … SELECT: parts and metadata never leave the database, so a 10,000-message
    fork does not decode and re-encode every message's JSON in Python."""
    table = connection.ops.quote_name(Message._meta.db_table)
    cols = (
        "id, conversation_id, parent_id, role, parts, depth, origin, metadata, created_at, "
        "search_text"
    )
    if connection.vendor == "postgresql":
        payload = [{"o": str(o), "n": str(n), "p": str(p) if p else None} for o, n, p in mapping]
        sql = f"""
            INSERT INTO {table} ({cols})
            SELECT map.n, %s, map.p, m.role, m.parts, m.depth, %s,
                   m.metadata || jsonb_build_object('fork_of', m.id::text, 'fork_origin', m.origin),
                   m.created_at, m.search_text
            FROM jsonb_to_recordset(%s::jsonb) AS map(o uuid, n uuid, p uuid)
            JOIN {table} m ON m.id = map.o
        """
        params: list[Any] = [str(conversation_id), Origin.FORK, json.dumps(payload)]
    elif connection.vendor == "sqlite":
        payload = [
            {"o": o.hex, "n": n.hex, "p": p.hex if p else None, "f": str(o)} for o, n, p in mapping
        ]
        sql = f"""
            INSERT INTO {table} ({cols})
            SELECT json_extract(map.value, '$.n'), %s, json_extract(map.value, '$.p'),
                   m.role, m.parts, m.depth, %s,
                   json_set(m.metadata, '$.fork_of', json_extract(map.value, '$.f'),
                            '$.fork_origin', m.origin),
                   m.created_at, m.search_text
            FROM json_each(%s) AS map
            JOIN {table} m ON m.id = json_extract(map.value, '$.o')
        """
        params = [conversation_id.hex, Origin.FORK, json.dumps(payload)]
    else:  # pragma: no cover - other backends are not supported
        raise NotImplementedError(connection.vendor)
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


def conversation_fork(
    *, message: Message, owner: User, title: str = "", scope: str = ForkScope.PATH
) -> Conversation:
    """Copy the root→message path (and with scope=subtree, everything below the message)
    into a new conversation with new ids. No row is shared with the source, so neither
    sees the other's later messages. Live checkpoints on the copied messages come along.
    A constant number of queries, whatever the path length."""
    if scope not in ForkScope.CHOICES:
        raise InvalidInput(f"scope must be one of {list(ForkScope.CHOICES)}", code="bad_scope")
    source = message.conversation
    with transaction.atomic():
        # The source is locked while it is read and copied: a delete waits for the fork
        # (and then unlinks it), or the fork finds the conversation gone (404).
        locked = Conversation.objects.select_for_update().filter(pk=source.pk).first()
        if locked is None or not Message.objects.filter(pk=message.pk).exists():
            raise NotFound(f"no such message: {message.pk}")
        source = locked
        links = selectors.message_path_links(conversation_id=source.pk, tip_id=message.pk)
        if scope == ForkScope.SUBTREE:
            links += selectors.message_subtree_links(conversation_id=source.pk, root_id=message.pk)[
                1:
            ]
        live = list(
            Checkpoint.objects.filter(conversation=source, state=CheckpointState.LIVE).order_by(
                "created_at", "id"
            )
        )
        id_map = {mid: uuid.uuid4() for mid, _ in links}
        if scope == ForkScope.SUBTREE and source.tip_id in id_map:
            new_tip = id_map[source.tip_id]
        else:
            new_tip = id_map[message.pk]
        # The tip may name a message inserted just below: both foreign keys are checked
        # at commit (Django creates them DEFERRABLE INITIALLY DEFERRED).
        fork = Conversation.objects.create(
            owner=owner,
            title=(title.strip() or f"Fork of {source.title or 'conversation'}")[:200],
            tip_id=new_tip,
            forked_from=message,
            model=source.model,
            system_prompt=source.system_prompt,
        )
        _copy_messages(
            [(old, id_map[old], id_map[parent] if parent else None) for old, parent in links],
            conversation_id=fork.pk,
        )
        checkpoint_copies = [
            Checkpoint(
                conversation=fork,
                label=cp.label,
                message_id=id_map[cp.message_id],
                source=cp.source,
                digest_message_id=id_map.get(cp.digest_message_id)
                if cp.digest_message_id
                else None,
            )
            for cp in live
            if cp.message_id in id_map
        ]
        if checkpoint_copies:
            Checkpoint.objects.bulk_create(checkpoint_copies)
    return fork


# --- checkpoints and rewind ----------------------------------------------------------


def _is_boundary(message: Message) -> bool:
    """A clean turn boundary: nothing is waiting on a tool."""
    if message.role == Role.TOOL:
        return False
    return not (message.role == Role.ASSISTANT and any(tool_calls(message.parts)))


def _clean_label(label: Any) -> str:
    if not isinstance(label, str) or not label.strip():
        raise InvalidInput("label must be a non-empty string", code="bad_label")
    # A name of its own: ``label`` reassigned would stay typed Any.
    cleaned = label.strip()
    if "\x00" in cleaned:
        raise InvalidInput("label must not contain NUL characters", code="bad_label")
    if len(cleaned) > 100:
        raise InvalidInput("label must be at most 100 characters", code="bad_label")
    return cleaned


def checkpoint_create(
    *,
    conversation: Conversation,
    label: str,
    message_id: uuid.UUID | None = None,
    source: str = CheckpointSource.USER,
) -> Checkpoint:
    """Label a clean turn boundary (by default the current tip)."""
    label = _clean_label(label)
    with transaction.atomic():
        conv = _lock_conversation(conversation, None)
        target_id = message_id or conv.tip_id
        if target_id is None:
            raise Conflict("the conversation is empty: nothing to label", code="empty")
        target = _message_in(conv, target_id)
        if not _is_boundary(target):
            raise Conflict(
                "a checkpoint must sit at a clean turn boundary, not between a tool call "
                "and its result",
                code="not_at_boundary",
            )
        if Checkpoint.objects.filter(
            conversation=conv, label=label, state=CheckpointState.LIVE
        ).exists():
            raise Conflict(f"a live checkpoint is already labelled {label!r}", code="label_taken")
        try:
            with transaction.atomic():
                return Checkpoint.objects.create(
                    conversation=conv, label=label, message=target, source=source
                )
        except IntegrityError:  # a concurrent writer took the label first
            raise Conflict(
                f"a live checkpoint is already labelled {label!r}", code="label_taken"
            ) from None


def checkpoint_drop(*, checkpoint: Checkpoint, reason: str) -> None:
    """Mark a checkpoint dropped. Its message is never changed: a checkpoint is either at
    the message it was created with, or dropped."""
    Checkpoint.objects.filter(pk=checkpoint.pk, state=CheckpointState.LIVE).update(
        state=CheckpointState.DROPPED, reason=reason, updated_at=timezone.now()
    )


@dataclass(frozen=True)
class RewindResult:
    tip: uuid.UUID
    version: int
    digest_message: uuid.UUID
    abandoned_tip: uuid.UUID | None
    checkpoint: Checkpoint


class CheckpointDropped(Conflict):
    code = "checkpoint_dropped"


def _auto_digest(explored: list[Message]) -> str:
    """A digest built from the abandoned messages when the caller gives none."""
    if not explored:
        return "Nothing was explored past this checkpoint."
    prompts = [selectors.preview(m.parts, 120) for m in explored if m.role == Role.USER]
    tools = sorted({c["name"] for m in explored for c in tool_calls(m.parts)})
    answers = [m for m in explored if m.role == Role.ASSISTANT and not any(tool_calls(m.parts))]
    lines = [f"Explored {len(explored)} messages past this checkpoint."]
    if prompts:
        lines.append("Prompts: " + " | ".join(prompts[:5]))
    if tools:
        lines.append("Tools used: " + ", ".join(tools))
    if answers:
        lines.append("Last answer: " + selectors.preview(answers[-1].parts, 200))
    return "\n".join(lines)


def checkpoint_rewind(
    *,
    conversation: Conversation,
    label: str,
    digest: str | None = None,
    expected_version: int | None = None,
) -> RewindResult:
    """Return to a checkpoint: append a digest of the abandoned branch as a new child of
    the checkpoint's message and move the tip onto it. The abandoned branch stays in the
    tree; the digest names its tip."""
    label = _clean_label(label)
    if digest is not None and (
        not isinstance(digest, str) or len(digest) > 100_000 or "\x00" in digest
    ):
        raise InvalidInput("digest must be a string of at most 100,000 characters, no NUL")
    with transaction.atomic():
        conv = _lock_conversation(conversation, expected_version)
        checkpoints = list(
            Checkpoint.objects.filter(conversation=conv, label=label)
            .select_related("message")
            .order_by("-created_at", "-id")
        )
        live = [cp for cp in checkpoints if cp.state == CheckpointState.LIVE]
        if not live:
            if checkpoints:
                raise CheckpointDropped(
                    f"checkpoint {label!r} was dropped: {checkpoints[0].reason}",
                    reason=checkpoints[0].reason,
                )
            raise NotFound(f"no checkpoint labelled {label!r}", code="unknown_checkpoint")
        checkpoint = live[0]
        target = checkpoint.message
        abandoned = conv.tip_id
        abandoned_path = selectors.message_path(conversation_id=conv.pk, tip_id=abandoned)
        target_path = {
            m.id for m in selectors.message_path(conversation_id=conv.pk, tip_id=target.id)
        }
        explored = [m for m in abandoned_path if m.id not in target_path]
        text = digest if digest is not None and digest.strip() else _auto_digest(explored)
        header = f"[Rewound to checkpoint '{label}'. The abandoned branch ends at {abandoned}.]"
        now = timezone.now()
        digest_message = Message.objects.create(
            conversation_id=conv.pk,
            parent=target,
            role=Role.USER,
            parts=[{"type": "text", "text": f"{header}\n{text}"}],
            depth=target.depth + 1,
            origin=Origin.DIGEST,
            metadata={
                "checkpoint": label,
                "abandoned_tip": str(abandoned) if abandoned else None,
                "explored_messages": len(explored),
                "digest_given": digest is not None and bool(digest.strip()),
            },
            created_at=now,
        )
        Conversation.objects.filter(pk=conv.pk).update(
            tip_id=digest_message.id, version=F("version") + 1, updated_at=now
        )
        Checkpoint.objects.filter(pk=checkpoint.pk).update(
            digest_message=digest_message, updated_at=now
        )
    return RewindResult(
        tip=digest_message.id,
        version=conv.version + 1,
        digest_message=digest_message.id,
        abandoned_tip=abandoned,
        checkpoint=checkpoint,
    )


# --- blobs and tokens ----------------------------------------------------------------

_ALLOWED_IMAGE_FORMATS = {"PNG": "png", "JPEG": "jpg", "WEBP": "webp", "GIF": "gif"}


def blob_read(sha256: str) -> bytes:
    """The bytes of a stored image (Blob.DoesNotExist when there is none)."""
    blob = Blob.objects.get(pk=sha256)
    with blob.file.open("rb") as handle:
        data: bytes = handle.read()
    return data


def _stored_intact(name: str, data: bytes, sha: str) -> bool:
    try:
        if default_storage.size(name) != len(data):
            return False
        with default_storage.open(name, "rb") as handle:
            return hashlib.sha256(handle.read()).hexdigest() == sha
    except OSError:  # missing (or unreadable: written anew)
        return False


def _write_atomically(name: str, data: bytes | Iterable[bytes]) -> None:
    """Write a media file so that it is whole or absent: to a temporary name in the same
    directory, flushed to disk, then renamed over the final name. A full disk or a crash
    leaves no truncated file under the real name (and the temporary one is removed)."""
    chunks = [data] if isinstance(data, bytes) else data
    if not isinstance(default_storage, FileSystemStorage):
        if default_storage.exists(name):
            default_storage.delete(name)
        default_storage.save(name, ContentFile(b"".join(chunks)))
        return
    path = Path(default_storage.path(name))
    temporary = path.with_name(f".{path.name}.{uuid.uuid4().hex}.part")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(temporary, "wb") as handle:
            for chunk in chunks:
                handle.write(chunk)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, settings.FILE_UPLOAD_PERMISSIONS or 0o644)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def blob_store_upload(*, owner: User, upload: Any) -> Blob:
    """``blob_store`` of an uploaded file, refused by its size before it is read."""
    return blob_store(owner=owner, data=_upload_bytes(upload))


def blob_store_uploads(*, owner: User, uploads: list[Any]) -> list[Blob]:
    """Store several uploaded images, all or none: each is checked before any is stored,
    and a refusal names the file."""
    checked = []
    for upload in uploads:
        try:
            data = _upload_bytes(upload)
            blob_check(data)
        except ArborError as exc:
            exc.detail = f"{upload.name}: {exc.detail}"
            raise
        checked.append(data)
    return [blob_store(owner=owner, data=data) for data in checked]


def _upload_bytes(upload: Any) -> bytes:
    if upload.size is not None and upload.size > settings.ARBOR_MAX_BLOB_BYTES:
        raise InvalidInput(
            f"the image is {upload.size} bytes; the limit is {settings.ARBOR_MAX_BLOB_BYTES}",
            code="blob_too_large",
        )
    data: bytes = upload.read()
    return data


def blob_check(data: bytes) -> tuple[str, int, int]:
    """The image's (format, width, height) if it may be stored, else InvalidInput: only
    PNG, JPEG, WebP and GIF within the byte and pixel limits (never SVG: it can carry
    script)."""
    if len(data) > settings.ARBOR_MAX_BLOB_BYTES:
        raise InvalidInput(
            f"the image is {len(data)} bytes; the limit is {settings.ARBOR_MAX_BLOB_BYTES}",
            code="blob_too_large",
        )
    if not data:
        raise InvalidInput("the upload is empty", code="not_an_image")
    try:
        with Image.open(io.BytesIO(data)) as image:
            kind, (width, height) = image.format, image.size
            if width * height > settings.ARBOR_MAX_IMAGE_PIXELS:
                raise InvalidInput(
                    f"the image has {width * height} pixels; the limit is "
                    f"{settings.ARBOR_MAX_IMAGE_PIXELS}",
                    code="image_too_large",
                )
            # An animation is decoded frame by frame (by browsers, by vision models):
            # its frames together are held to the same pixel limit.
            frames = int(getattr(image, "n_frames", 1) or 1)
            if frames > 1 and frames * width * height > settings.ARBOR_MAX_IMAGE_PIXELS:
                raise InvalidInput(
                    f"the animation has {frames} frames of {width}x{height} "
                    f"({frames * width * height} pixels in all); the limit is "
                    f"{settings.ARBOR_MAX_IMAGE_PIXELS}",
                    code="image_too_large",
                )
            image.verify()
    except ArborError:
        raise
    except Image.DecompressionBombError:
        raise InvalidInput(
            "the image has too many pixels to be decoded safely", code="image_too_large"
        ) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        raise InvalidInput(
            "the upload is not a readable PNG, JPEG, WebP or GIF image", code="not_an_image"
        ) from None
    if kind not in _ALLOWED_IMAGE_FORMATS:
        raise InvalidInput(
            f"{kind} images are not accepted; use PNG, JPEG, WebP or GIF", code="unsupported_image"
        )
    return kind, width, height


def blob_store(*, owner: User, data: bytes) -> Blob:
    """Store an image by the sha256 of its bytes (``blob_check`` says which are
    accepted)."""
    kind, width, height = blob_check(data)
    sha = hashlib.sha256(data).hexdigest()
    name = f"blobs/{sha[:2]}/{sha}.{_ALLOWED_IMAGE_FORMATS[kind]}"
    # Content-addressed: the same bytes always land at the same name, so writing the file
    # before the row is safe even if the transaction below fails. A file already there is
    # trusted only if it holds exactly these bytes (a write cut short by a full disk, from
    # before writes were atomic, is replaced).
    if not _stored_intact(name, data, sha):
        try:
            _write_atomically(name, data)
        except OSError as exc:
            raise storage_error(exc, "the image") from None
    with transaction.atomic():
        blob, _ = Blob.objects.get_or_create(
            sha256=sha,
            defaults={
                "file": name,
                "mime": Image.MIME[kind],
                "size": len(data),
                "width": width,
                "height": height,
            },
        )
        blob.owners.add(owner)
    return blob


def api_token_create(
    *, user: User, name: str, expires_in: timedelta | None = None
) -> tuple[ApiToken, str]:
    """Create a token; the secret is returned once and only its hash is stored. With
    ``expires_in`` the token is refused from that long after now on."""
    if expires_in is not None and expires_in <= timedelta(0):
        raise InvalidInput("expires_in must be a positive duration (or none: never expires)")
    secret = "arb_" + secrets.token_urlsafe(32)
    token = ApiToken.objects.create(
        user=user,
        name=name.strip()[:100] or "token",
        token_hash=hashlib.sha256(secret.encode()).hexdigest(),
        prefix=secret[:10],
        expires_at=timezone.now() + expires_in if expires_in is not None else None,
    )
    return token, secret


@functools.cache
def _token_user_sql() -> str:
    """The active user of a token hash, with the token's id, prefix and dates, in one
    statement. Written out (from the models' own table and column names) because every
    API and gateway request runs it: the ORM spent ~0.35 ms building the same query each
    time, 25 times what running it costs."""
    q = connection.ops.quote_name

    def column(model: type[models.Model], name: str) -> str:
        field = model._meta.get_field(name)
        assert isinstance(field, models.Field) and field.column
        return q(field.column)

    t = {
        f: column(ApiToken, f)
        for f in ("id", "user", "token_hash", "prefix", "expires_at", "last_used_at")
    }
    return (
        f"SELECT u.*, t.{t['id']} AS arbor_token_id, t.{t['prefix']} AS arbor_token_prefix,"
        f" t.{t['expires_at']} AS arbor_token_expires,"
        f" t.{t['last_used_at']} AS arbor_token_used"
        f" FROM {q(User._meta.db_table)} u JOIN {q(ApiToken._meta.db_table)} t"
        f" ON t.{t['user']} = u.{column(User, 'id')}"
        f" WHERE t.{t['token_hash']} = %s AND u.{column(User, 'is_active')}"
    )


def _aware(value: Any) -> datetime | None:
    """A date column read outside the ORM: SQLite gives text (UTC), PostgreSQL an aware
    datetime."""
    if value is None or isinstance(value, datetime):
        return (
            value if value is None or timezone.is_aware(value) else timezone.make_aware(value, UTC)
        )
    parsed = parse_datetime(str(value))
    if parsed is None:  # pragma: no cover - a date column always parses
        raise ValueError(f"not a date: {value!r}")
    return parsed if timezone.is_aware(parsed) else timezone.make_aware(parsed, UTC)


def api_token_authenticate(*, secret: str) -> User | None:
    """The active user a bearer secret stands for, or None for an unknown secret (or an
    inactive user). A known token past its expiry raises TokenExpired, so the client
    learns that a new token is needed rather than that the secret is wrong."""
    digest = hashlib.sha256(secret.encode()).hexdigest()
    user = next(iter(User.objects.raw(_token_user_sql(), [digest])), None)
    if user is None:
        return None
    token = vars(user)  # the token's columns ride on the user row (arbor_token_*)
    now = timezone.now()
    expires, used = _aware(token["arbor_token_expires"]), _aware(token["arbor_token_used"])
    if expires is not None and expires <= now:
        raise TokenExpired(
            f"the API token {token['arbor_token_prefix']}… expired at"
            f" {expires:%Y-%m-%d %H:%M} UTC; create a new one in Settings"
        )
    # Record use at minute precision: a write on every request would double the cost of
    # each authenticated read.
    if used is None or now - used > timedelta(minutes=1):
        ApiToken.objects.filter(pk=token["arbor_token_id"]).update(last_used_at=now)
    return user


def api_token_revoke(*, user: User, token_id: int) -> None:
    """Delete one of the user's tokens; another user's id is NotFound."""
    deleted, _ = ApiToken.objects.filter(pk=token_id, user=user).delete()
    if not deleted:
        raise NotFound(f"no such token: {token_id}")


# --- background imports --------------------------------------------------------------


def import_job_create(
    *, owner: User, upload: Any, format: str = "auto", on_duplicate: str = "skip"
) -> Any:
    """Keep the uploaded file and queue its import after the transaction commits.
    Conversations imported before are skipped, or copied with ``on_duplicate="copy"``."""
    from conversations.importers.services import check_duplicates
    from conversations.models import ImportJob

    check_duplicates(on_duplicate)
    _import_jobs_limit(owner)
    job = ImportJob(
        owner=owner, filename=str(upload.name)[:255], format=format, on_duplicate=on_duplicate
    )
    name = f"imports/{uuid.uuid4()}.upload"
    try:
        _write_atomically(name, upload.chunks())
    except OSError as exc:
        raise storage_error(exc, "the upload") from None
    job.upload.name = name
    job.save()
    _import_job_queue(job)
    return job


def import_job_again(*, owner: User, job_id: Any) -> Any:
    """Import the conversations an earlier import skipped as imported before, this time
    as copies: a new job on the same kept file, limited to their source keys. The file
    moves to the new job (one job holds it at a time)."""
    from conversations.models import ImportJob, ImportState

    job_id = selectors.import_job_get(owner=owner, job_id=job_id).pk  # NotFound otherwise
    with transaction.atomic():
        earlier = (
            ImportJob.objects.select_for_update()
            .filter(owner=owner, pk=job_id, state=ImportState.DONE)
            .first()
        )
        if earlier is None:
            raise NotFound(f"no finished import {job_id}")
        keys = [d["source_key"] for d in (earlier.report or {}).get("duplicates", [])]
        if not keys:
            raise Conflict("this import skipped no conversation", code="no_duplicates")
        if not earlier.upload:
            raise Conflict(
                "the file of this import is no longer kept: upload it again, with "
                "“import conversations imported before as copies” ticked",
                code="upload_gone",
            )
        _import_jobs_limit(owner)
        job = ImportJob.objects.create(
            owner=owner,
            filename=earlier.filename,
            format=earlier.format,
            on_duplicate="copy",
            only_keys=keys,
            upload=earlier.upload.name,
        )
        ImportJob.objects.filter(pk=earlier.pk).update(upload="")
    _import_job_queue(job)
    return job


def _import_jobs_limit(owner: User) -> None:
    from conversations.models import ImportJob, ImportState

    # Jobs touched in the last hour: one queued by a process that died before running it
    # does not hold a place for ever.
    open_jobs = ImportJob.objects.filter(
        owner=owner,
        state__in=(ImportState.QUEUED, ImportState.RUNNING),
        updated_at__gte=timezone.now() - timedelta(hours=1),
    ).count()
    if open_jobs >= settings.ARBOR_IMPORT_MAX_OPEN:
        raise TooManyRequests(
            f"you have {open_jobs} imports waiting or running (the limit is "
            f"{settings.ARBOR_IMPORT_MAX_OPEN}): wait for one to finish",
            code="too_many_imports",
        )


def _import_job_queue(job: Any) -> None:
    from arbor.jobs import job_dispatch
    from conversations.tasks import run_import_job

    # Robust: the job records its own failure, and when it runs inside the upload's
    # request (no broker, inline jobs) that request must still answer with the job page.
    transaction.on_commit(lambda: job_dispatch(run_import_job, str(job.pk)), robust=True)


def import_job_run(*, job_id: Any) -> None:
    """Claim the job (once, however often the task is delivered), import the file with
    progress written to the row as each conversation lands, and keep the report."""
    from conversations.importers import transcript_import
    from conversations.models import ImportJob, ImportState

    claimed = ImportJob.objects.filter(pk=job_id, state=ImportState.QUEUED).update(
        state=ImportState.RUNNING, worker=process_identity(), updated_at=Now()
    )
    if not claimed:
        # A redelivery after the process running it died (a killed pool process): say
        # so now, with what it imported, rather than when someone next looks.
        running = ImportJob.objects.filter(pk=job_id, state=ImportState.RUNNING).first()
        if running is not None:
            import_job_sweep(running)
        return
    job = ImportJob.objects.get(pk=job_id)
    imported: list[str] = []

    def progress(report: Any) -> None:
        # What landed so far is on the row: an import interrupted midway says what it
        # imported (import_job_sweep). This runs inside the conversation's transaction:
        # the id is kept only once the row's update went through with it.
        ids = [*imported, str(report.id)]
        ImportJob.objects.filter(pk=job.pk).update(
            conversations_done=F("conversations_done") + 1,
            messages_done=F("messages_done") + (report.messages or 0),
            report={"conversation_ids": ids},
            updated_at=Now(),
        )
        imported.append(str(report.id))

    # Alive, said on a timer: a worker on another host that dies stops saying it, and
    # import_job_sweep ends the job (a dead process on this host is seen at once).
    alive = ImportJob.objects.filter(pk=job.pk, state=ImportState.RUNNING)
    beat = Heartbeat(
        lambda: alive.update(updated_at=Now()),  # the database's clock, as it is judged by
        IMPORT_STALE_SECONDS / 6,
        name="arbor-import-lease",
    )
    try:
        with beat:
            report = transcript_import(
                owner_id=job.owner_id,
                path=job.upload.path,
                format=job.format,
                filename=job.filename,
                progress=progress,
                duplicates=job.on_duplicate,
                only=job.only_keys or None,
            )
    except ArborError as exc:
        _import_upload_drop(job)
        ImportJob.objects.filter(pk=job.pk).update(
            state=ImportState.FAILED, error=exc.detail, upload=""
        )
        return
    except Exception as exc:
        _import_upload_drop(job)
        ImportJob.objects.filter(pk=job.pk).update(
            state=ImportState.FAILED, error=f"the import failed: {type(exc).__name__}", upload=""
        )
        raise
    if report.duplicates:
        # Kept (for IMPORT_KEEP_SECONDS) so the skipped ones can be imported again as
        # copies without uploading the file again (import_job_again).
        ImportJob.objects.filter(pk=job.pk).update(state=ImportState.DONE, report=report.as_dict())
        return
    # The conversations hold everything now: the kept upload goes.
    _import_upload_drop(job)
    ImportJob.objects.filter(pk=job.pk).update(
        state=ImportState.DONE, report=report.as_dict(), upload=""
    )


def _import_upload_drop(job: Any) -> None:
    """The kept upload goes once its import has ended, however it ended."""
    if job.upload:
        # A read-only store keeps the file; the job's outcome stands either way.
        with contextlib.suppress(OSError):
            job.upload.delete(save=False)


# A running import says it is alive every IMPORT_STALE_SECONDS / 6 (import_job_run);
# silent this long, its worker is taken for dead, wherever it ran.
IMPORT_STALE_SECONDS = 180
# A finished import that skipped conversations imported before keeps its file this long,
# for "import again as copies".
IMPORT_KEEP_SECONDS = 24 * 3600


def import_job_sweep(job: Any, now: datetime | None = None) -> Any:
    """A running import whose process is gone (killed, restarted) is marked failed, with
    the conversations it imported before it stopped; returns the job as it now is.
    ``now``: the database's time (arbor.heartbeat), when the caller has read it."""
    from conversations.models import ImportState

    if job.state == ImportState.DONE and job.upload:
        if timezone.now() - job.updated_at > timedelta(seconds=IMPORT_KEEP_SECONDS):
            # Claimed first: an "import again" that took the file over meanwhile keeps it.
            claimed = (
                type(job)
                .objects.filter(pk=job.pk, state=ImportState.DONE, upload=job.upload.name)
                .update(upload="")
            )
            if claimed:
                _import_upload_drop(job)
            job.upload = ""
        return job
    if job.state != ImportState.RUNNING or not job.worker:
        return job
    now = now or db_now()
    stale = now - job.updated_at > timedelta(seconds=IMPORT_STALE_SECONDS)
    if not (process_gone(job.worker) or stale):
        return job
    done = job.conversations_done
    job.error = (
        f"interrupted: the process importing this file ({job.worker}) stopped after "
        f"{done} conversation{'s' if done != 1 else ''}; they are kept. Upload the file "
        "again to import the rest (the ones already imported are skipped)."
    )
    job.state = ImportState.FAILED
    swept = (
        type(job)
        .objects.filter(pk=job.pk, state=ImportState.RUNNING)
        .update(state=ImportState.FAILED, error=job.error, upload="")
    )
    if swept:
        _import_upload_drop(job)
    return job


# --- the transcript a model sees -----------------------------------------------------


def transcript_resume(
    *, conversation: Conversation, tip_id: uuid.UUID | None, drop_checkpoints: bool = True
) -> tuple[list[dict[str, Any]], ResumeReport]:
    """The path to ``tip_id`` as a model may receive it: trimmed back to the last valid
    boundary (see conversations.resume). A live checkpoint whose message was trimmed is
    marked dropped — never moved to another message — unless ``drop_checkpoints`` is
    False (a read-only look, such as the browser's context panel)."""
    path = selectors.message_path_rows(conversation_id=conversation.pk, tip_id=tip_id)
    view, report = resume_view(path)
    if report.trimmed and drop_checkpoints:
        trimmed = {uuid.UUID(mid) for mid in report.trimmed}
        for checkpoint in Checkpoint.objects.filter(
            conversation=conversation, state=CheckpointState.LIVE, message_id__in=trimmed
        ):
            checkpoint_drop(
                checkpoint=checkpoint,
                reason=f"its message {checkpoint.message_id} was trimmed on resume: the "
                "transcript ended between a tool call and its result",
            )
    return [
        {"id": str(m.id), "role": m.role, "parts": m.parts, "metadata": m.metadata} for m in view
    ], report
