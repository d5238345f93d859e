"""Reads over the tree. Each function is a fixed, small number of queries."""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.db import connection
from django.db.models import Count, F, OuterRef, Q, QuerySet, Subquery, TextField, Value
from django.db.models.functions import Coalesce, Greatest, StrIndex, Substr, Upper

from conversations.errors import InvalidInput, NotFound
from conversations.models import (
    ApiToken,
    Blob,
    Checkpoint,
    Conversation,
    ImportJob,
    Message,
    TurnAttempt,
    read_stored_json,
)
from conversations.parts import readable_text
from conversations.treemap import SkeletonNode

User = AbstractBaseUser | AnonymousUser


def _db_uuid(value: uuid.UUID) -> Any:
    """A UUID as the backend stores it (32 hex chars on SQLite, native uuid on PostgreSQL),
    for raw SQL parameters."""
    return Message._meta.pk.get_db_prep_value(value, connection)


def _parse_uuid(value: str | uuid.UUID, what: str) -> uuid.UUID:
    if isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(str(value))
    except ValueError:
        raise NotFound(f"no such {what}: {value!r}") from None


def conversation_get(*, user: User, conversation_id: str | uuid.UUID) -> Conversation:
    """The user's conversation, or NotFound: another user's id answers exactly like a
    missing one."""
    cid = _parse_uuid(conversation_id, "conversation")
    try:
        return Conversation.objects.get(pk=cid, owner_id=user.pk)
    except Conversation.DoesNotExist:
        raise NotFound(f"no such conversation: {cid}") from None


def message_get(*, user: User, message_id: str | uuid.UUID) -> Message:
    mid = _parse_uuid(message_id, "message")
    try:
        return Message.objects.select_related("conversation").get(
            pk=mid, conversation__owner_id=user.pk
        )
    except Message.DoesNotExist:
        raise NotFound(f"no such message: {mid}") from None


def conversation_message(*, conversation: Conversation, message_id: str | uuid.UUID) -> Message:
    """A message of ``conversation`` (already owner-checked), or NotFound for a malformed
    id or one of another conversation. Its search text stays deferred."""
    mid = _parse_uuid(message_id, "message")
    try:
        return Message.objects.defer("search_text").get(pk=mid, conversation=conversation)
    except Message.DoesNotExist:
        raise NotFound(f"no such message in this conversation: {mid}") from None


_PATH_SQL = """
WITH RECURSIVE path(id, parent_id) AS (
    SELECT id, parent_id FROM {table} WHERE id = %s AND conversation_id = %s
    UNION ALL
    SELECT m.id, m.parent_id FROM {table} m JOIN path p ON m.id = p.parent_id
)
SELECT {columns} FROM {table} JOIN path ON {table}.id = path.id
ORDER BY {table}.depth
"""


def _message_columns(table: str) -> str:
    """The columns the path and subtree reads load: all but the search text, a copy of
    the parts' words that nothing reading a branch needs (it stays deferred)."""
    return ", ".join(
        f"{table}.{f.column}" for f in Message._meta.concrete_fields if f.name != "search_text"
    )


def message_path(*, conversation_id: uuid.UUID, tip_id: uuid.UUID | None) -> list[Message]:
    """The messages root→tip, in one recursive query (SQLite and PostgreSQL alike)."""
    if tip_id is None:
        return []
    table = Message._meta.db_table
    sql = _PATH_SQL.format(table=table, columns=_message_columns(table))
    return list(Message.objects.raw(sql, [_db_uuid(tip_id), _db_uuid(conversation_id)]))


class PathRow(NamedTuple):
    """A message of a path as the turn engine reads it: no model instance (building one
    per message costs more than the query on a long path)."""

    id: uuid.UUID
    role: str
    parts: list[dict[str, Any]]
    metadata: dict[str, Any]


def message_path_rows(*, conversation_id: uuid.UUID, tip_id: uuid.UUID | None) -> list[PathRow]:
    """The path root→tip like ``message_path``, in the same query, as plain rows of what
    a model is sent (id, role, parts, metadata)."""
    if tip_id is None:
        return []
    table = Message._meta.db_table
    columns = f"{table}.id, {table}.role, {table}.parts, {table}.metadata"
    with connection.cursor() as cursor:
        cursor.execute(
            _PATH_SQL.format(table=table, columns=columns),
            [_db_uuid(tip_id), _db_uuid(conversation_id)],
        )
        rows = cursor.fetchall()
    # Both backends hand the JSON columns back as text (Django reads jsonb as text so
    # that JSONField decodes it); SQLite hands ids back as 32 hex characters.
    loads = read_stored_json
    return [
        PathRow(mid if isinstance(mid, uuid.UUID) else uuid.UUID(mid), role, loads(parts),
                loads(metadata))
        for mid, role, parts, metadata in rows
    ]  # fmt: skip


# The last ``limit`` messages of a path: the walk up from the tip stops after ``limit``
# rows, so its cost does not grow with the path's depth.
_PATH_TAIL_SQL = """
WITH RECURSIVE path(id, parent_id, n) AS (
    SELECT id, parent_id, 1 FROM {table} WHERE id = %s AND conversation_id = %s
    UNION ALL
    SELECT m.id, m.parent_id, p.n + 1 FROM {table} m JOIN path p ON m.id = p.parent_id
    WHERE p.n < %s
)
SELECT {columns} FROM {table} JOIN path ON {table}.id = path.id
ORDER BY {table}.depth
"""


def message_path_tail(
    *, conversation_id: uuid.UUID, tip_id: uuid.UUID | None, limit: int
) -> list[Message]:
    """The last ``limit`` messages of the path root→tip (all of it when shorter), in one
    query whose cost is the same at depth 100 and at depth 100,000. The first one's
    ``depth`` is how many messages come before them."""
    if tip_id is None or limit < 1:
        return []
    table = Message._meta.db_table
    sql = _PATH_TAIL_SQL.format(table=table, columns=_message_columns(table))
    params = [_db_uuid(tip_id), _db_uuid(conversation_id), limit]
    return list(Message.objects.raw(sql, params))


_SUBTREE_SQL = """
WITH RECURSIVE sub(id) AS (
    SELECT id FROM {table} WHERE id = %s AND conversation_id = %s
    UNION ALL
    SELECT m.id FROM {table} m JOIN sub s ON m.parent_id = s.id
)
SELECT {columns} FROM {table} JOIN sub ON {table}.id = sub.id
ORDER BY {table}.depth, {table}.created_at, {table}.id
"""


def message_subtree(*, conversation_id: uuid.UUID, root_id: uuid.UUID) -> list[Message]:
    """A message and every descendant, parents before children, in one query."""
    table = Message._meta.db_table
    sql = _SUBTREE_SQL.format(table=table, columns=_message_columns(table))
    return list(Message.objects.raw(sql, [_db_uuid(root_id), _db_uuid(conversation_id)]))


Link = tuple[uuid.UUID, uuid.UUID | None]


def _links(sql: str, params: list[Any]) -> list[Link]:
    """Run a path or subtree query selecting (id, parent_id) only: no parts decoded."""
    table = Message._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(sql.format(table=table, columns=f"{table}.id, {table}.parent_id"), params)
        # SQLite hands back 32-hex strings, PostgreSQL UUID objects: normalise both.
        return [
            (uuid.UUID(str(mid)), uuid.UUID(str(pid)) if pid else None)
            for mid, pid in cursor.fetchall()
        ]


def message_path_links(*, conversation_id: uuid.UUID, tip_id: uuid.UUID) -> list[Link]:
    """(id, parent_id) root→tip: the same query as message_path, without the contents."""
    return _links(_PATH_SQL, [_db_uuid(tip_id), _db_uuid(conversation_id)])


def message_subtree_links(*, conversation_id: uuid.UUID, root_id: uuid.UUID) -> list[Link]:
    """(id, parent_id) of a message and its descendants, parents first."""
    return _links(_SUBTREE_SQL, [_db_uuid(root_id), _db_uuid(conversation_id)])


@dataclass(frozen=True)
class Siblings:
    ids: list[uuid.UUID]
    index: int


def message_siblings(*, message: Message) -> Siblings:
    """The message's siblings (itself included) in creation order, with its index."""
    ids = list(
        Message.objects.filter(conversation_id=message.conversation_id, parent_id=message.parent_id)
        .order_by("created_at", "id")
        .values_list("id", flat=True)
    )
    return Siblings(ids=ids, index=ids.index(message.id))


def model_id_for(conversation: Conversation, override: str | None = None) -> str:
    """The model a request for this conversation goes to: the one asked for, else the
    conversation's, else ARBOR_DEFAULT_MODEL (turns, the context API and panel alike)."""
    return override or conversation.model or str(settings.ARBOR_DEFAULT_MODEL)


def message_children(*, message: Message) -> QuerySet[Message]:
    return Message.objects.filter(
        conversation_id=message.conversation_id, parent_id=message.pk
    ).order_by("created_at", "id")


def preview(parts: list[dict[str, Any]], limit: int = 80) -> str:
    """A one-line text preview of a message's parts."""
    text = " ".join(readable_text(parts, results=False).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _after_cursor(qs: QuerySet[Any], cursor: str, field: str) -> QuerySet[Any]:
    """The rows after a keyset cursor of (``field``, id), in (``-field``, ``-id``) order."""
    when_s, id_s = _decode_cursor(cursor, 2)
    try:
        when, pk = datetime.fromisoformat(when_s), uuid.UUID(id_s)
    except ValueError:
        raise InvalidInput("the cursor is not valid", code="bad_cursor") from None
    if when.tzinfo is None:
        raise InvalidInput("the cursor is not valid", code="bad_cursor")
    return qs.filter(Q(**{f"{field}__lt": when}) | Q(**{field: when, "id__lt": pk}))


def _encode_cursor(*values: Any) -> str:
    raw = "|".join(v.isoformat() if isinstance(v, datetime) else str(v) for v in values)
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _decode_cursor(cursor: str, count: int) -> list[str]:
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        values = base64.urlsafe_b64decode(padded.encode()).decode().split("|")
    except (ValueError, UnicodeDecodeError):
        raise InvalidInput("the cursor is not valid", code="bad_cursor") from None
    if len(values) != count:
        raise InvalidInput("the cursor is not valid", code="bad_cursor")
    return values


@dataclass
class Page:
    items: list[Any]
    next_cursor: str | None


def tree_page(*, conversation: Conversation, cursor: str | None, limit: int) -> Page:
    """Nodes of the whole tree, breadth-first (depth, created_at, id), keyset-paged, each
    with its child count — one query per page."""
    child_count = (
        Message.objects.filter(parent_id=OuterRef("pk"))
        .order_by()
        .values("parent_id")
        .annotate(n=Count("id"))
        .values("n")
    )
    qs = (
        Message.objects.filter(conversation=conversation)
        .annotate(child_count=Coalesce(Subquery(child_count), 0))
        .order_by("depth", "created_at", "id")
    )
    if cursor:
        depth_s, created_s, id_s = _decode_cursor(cursor, 3)
        try:
            depth, created, mid = int(depth_s), datetime.fromisoformat(created_s), uuid.UUID(id_s)
        except ValueError:
            raise InvalidInput("the cursor is not valid", code="bad_cursor") from None
        if created.tzinfo is None:
            raise InvalidInput("the cursor is not valid", code="bad_cursor")
        qs = qs.filter(
            Q(depth__gt=depth)
            | Q(depth=depth, created_at__gt=created)
            | Q(depth=depth, created_at=created, id__gt=mid)
        )
    rows = list(qs[: limit + 1])
    next_cursor = None
    if len(rows) > limit:
        rows = rows[:limit]
        last = rows[-1]
        next_cursor = _encode_cursor(last.depth, last.created_at, last.id)
    return Page(items=rows, next_cursor=next_cursor)


def conversation_page(*, user: User, q: str, cursor: str | None, limit: int) -> Page:
    """The user's conversations, most recently updated first, keyset-paged."""
    qs = Conversation.objects.filter(owner_id=user.pk).annotate(message_count=Count("messages"))
    if q:
        qs = qs.filter(title__icontains=q)
    qs = qs.order_by("-updated_at", "-id")
    if cursor:
        qs = _after_cursor(qs, cursor, "updated_at")
    rows = list(qs[: limit + 1])
    next_cursor = None
    if len(rows) > limit:
        rows = rows[:limit]
        next_cursor = _encode_cursor(rows[-1].updated_at, rows[-1].id)
    return Page(items=rows, next_cursor=next_cursor)


# A hit's snippet: this many characters of the message's search text, starting this many
# before the match (cut in the database, so a long message never travels whole).
SNIPPET_CHARS = 200
SNIPPET_BEFORE = 70


@dataclass(frozen=True)
class MessageHit:
    conversation_id: uuid.UUID
    conversation_title: str
    message_id: uuid.UUID
    role: str
    created_at: datetime
    snippet: str  # plain text around the first match; "…" marks a cut end


def _snippet(raw: str, *, start: int, at: int, length: int) -> str:
    """Trim a cut-out of the search text to whole words (never into the match at offset
    ``at``) and mark the cut ends."""
    text = raw
    if start > 1:
        space = text.find(" ", 0, at)
        text = "…" + (text[space + 1 :] if space >= 0 else text)
        at += 1 - (space + 1 if space >= 0 else 0)
    if len(raw) >= SNIPPET_CHARS:  # the message may go on past the cut
        space = text.rfind(" ", at + length)
        text = (text[:space] if space >= 0 else text) + "…"
    return text


def message_search(*, user: User, q: str, limit: int, cursor: str | None = None) -> Page:
    """The user's messages whose text contains ``q`` (case-insensitive; runs of whitespace
    count as one space), newest first, keyset-paged, each with a snippet around its first
    match. One query per page, however many conversations or how long the messages."""
    q = " ".join(q.split())
    if not q:
        return Page(items=[], next_cursor=None)
    # UPPER(search_text) on both sides of the match, like the icontains filter, so the
    # position found is where LIKE matched (and on PostgreSQL the trigram index applies).
    at = StrIndex(Upper("search_text"), Upper(Value(q, output_field=TextField())))
    start = Greatest(F("at") - SNIPPET_BEFORE, Value(1))
    qs = (
        Message.objects.filter(conversation__owner_id=user.pk, search_text__icontains=q)
        .annotate(at=at)
        .annotate(start=start, snippet=Substr("search_text", start, SNIPPET_CHARS))
        .order_by("-created_at", "-id")
    )
    if cursor:
        qs = _after_cursor(qs, cursor, "created_at")
    rows = list(
        qs.values_list(
            "conversation_id", "conversation__title", "id", "role", "created_at",
            "snippet", "start", "at",
        )[: limit + 1]
    )  # fmt: skip
    hits = [
        MessageHit(
            conversation_id=cid,
            conversation_title=title,
            message_id=mid,
            role=role,
            created_at=created_at,
            snippet=_snippet(snippet or "", start=start, at=max(pos - start, 0), length=len(q)),
        )
        for cid, title, mid, role, created_at, snippet, start, pos in rows[:limit]
    ]
    next_cursor = None
    if len(rows) > limit:
        next_cursor = _encode_cursor(hits[-1].created_at, hits[-1].message_id)
    return Page(items=hits, next_cursor=next_cursor)


def conversation_forks(*, conversation: Conversation) -> QuerySet[Conversation]:
    """Conversations forked from any message of this one."""
    return Conversation.objects.filter(
        forked_from__conversation=conversation, owner_id=conversation.owner_id
    ).order_by("created_at")


def conversation_offspring(
    *, conversation: Conversation
) -> tuple[list[Conversation], list[Conversation]]:
    """In one query: the conversations forked from a message of this one, and the
    sub-agent conversations started by a call in one of its messages (imported Task
    runs, ``Conversation.spawned_by``)."""
    rows = Conversation.objects.filter(
        Q(forked_from__conversation=conversation) | Q(spawned_by__conversation=conversation),
        owner_id=conversation.owner_id,
    ).order_by("created_at", "id")
    forks: list[Conversation] = []
    spawned: list[Conversation] = []
    for row in rows:
        (spawned if row.spawned_by_id and not row.forked_from_id else forks).append(row)
    return forks, spawned


def message_count(*, conversation: Conversation) -> int:
    return Message.objects.filter(conversation=conversation).count()


def checkpoint_list(
    *, conversation: Conversation, with_messages: bool = False
) -> QuerySet[Checkpoint]:
    """The conversation's checkpoints, oldest first; ``with_messages`` loads each one's
    message in the same query."""
    checkpoints = Checkpoint.objects.filter(conversation=conversation)
    if with_messages:
        checkpoints = checkpoints.select_related("message")
    return checkpoints.order_by("created_at", "id")


# --- browser UI reads ----------------------------------------------------------------

_LATEST_LEAF_SQL = """
WITH RECURSIVE sub(id) AS (
    SELECT id FROM {table} WHERE id = %s AND conversation_id = %s
    UNION ALL
    SELECT m.id FROM {table} m JOIN sub s ON m.parent_id = s.id
)
SELECT m.id FROM {table} m JOIN sub ON m.id = sub.id
WHERE NOT EXISTS (
    SELECT 1 FROM {table} c WHERE c.conversation_id = m.conversation_id AND c.parent_id = m.id
)
ORDER BY m.created_at DESC, m.id DESC
LIMIT 1
"""


def message_latest_leaf(*, conversation_id: uuid.UUID, message_id: uuid.UUID) -> uuid.UUID | None:
    """The most recently created leaf in the subtree below (and including) a message, in
    one query: where ``◀ n/m ▶`` lands, so choosing a sibling resumes its newest branch."""
    sql = _LATEST_LEAF_SQL.format(table=Message._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(sql, [_db_uuid(message_id), _db_uuid(conversation_id)])
        row = cursor.fetchone()
    return uuid.UUID(str(row[0])) if row else None


def message_branch_leaf(*, conversation: Conversation, message_id: uuid.UUID) -> uuid.UUID:
    """Where the branch to show through a message ends: the tip when the message is on
    the current branch, else the newest leaf below it (where ``◀ n/m ▶`` would land).
    Reading only: the tip does not move."""
    if conversation.tip_id is not None:
        links = message_path_links(conversation_id=conversation.pk, tip_id=conversation.tip_id)
        if any(mid == message_id for mid, _ in links):
            return conversation.tip_id
    leaf = message_latest_leaf(conversation_id=conversation.pk, message_id=message_id)
    return leaf or message_id


def tree_skeleton(*, conversation: Conversation) -> list[SkeletonNode]:
    """Every message of the conversation without its contents, in creation order (so a
    parent's children come out oldest first): one query, cheap even at 10,000 nodes."""
    rows = (
        Message.objects.filter(conversation=conversation)
        .order_by("created_at", "id")
        .values_list("id", "parent_id", "role", "origin", "depth")
    )
    return [SkeletonNode(*row) for row in rows]


def message_previews(
    *, conversation: Conversation, ids: list[uuid.UUID], limit: int = 80
) -> dict[uuid.UUID, str]:
    """One-line previews of some messages of a conversation, in one query."""
    rows = Message.objects.filter(conversation=conversation, pk__in=ids).values_list("id", "parts")
    return {mid: preview(parts, limit) for mid, parts in rows}


def fork_origins(*, user: User, message_ids: list[uuid.UUID]) -> dict[uuid.UUID, Conversation]:
    """For fork provenance: the conversation each of these (forked-from) messages belongs
    to, limited to the user's own conversations."""
    messages = Message.objects.filter(
        pk__in=message_ids, conversation__owner_id=user.pk
    ).select_related("conversation")
    return {m.pk: m.conversation for m in messages}


def sibling_positions(
    *, conversation: Conversation, messages: list[Message]
) -> dict[uuid.UUID, Siblings]:
    """``message_siblings`` for many messages of one path, in one query (the chat view's
    ``◀ n/m ▶``); only messages that have siblings are in the answer."""
    parents = {m.parent_id for m in messages if m.parent_id is not None}
    rows = (
        Message.objects.filter(conversation=conversation)
        .filter(Q(parent_id__in=parents) | Q(parent__isnull=True))
        .order_by("created_at", "id")
        .values_list("id", "parent_id")
    )
    by_parent: dict[uuid.UUID | None, list[uuid.UUID]] = {}
    for mid, pid in rows:
        by_parent.setdefault(pid, []).append(mid)
    out: dict[uuid.UUID, Siblings] = {}
    for m in messages:
        ids = by_parent.get(m.parent_id, [])
        if len(ids) > 1 and m.id in ids:
            out[m.id] = Siblings(ids=ids, index=ids.index(m.id))
    return out


def rewind_digests(*, conversation: Conversation) -> dict[uuid.UUID, dict[str, Any]]:
    """Each rewind's digest message: the checkpoint label and the abandoned branch's tip
    (as a UUID when it is a message of this conversation), in one query."""
    out: dict[uuid.UUID, dict[str, Any]] = {}
    rows = Message.objects.filter(conversation=conversation, origin="digest").values_list(
        "id", "metadata"
    )
    for mid, metadata in rows:
        abandoned = metadata.get("abandoned_tip")
        try:
            abandoned_id = uuid.UUID(abandoned) if abandoned else None
        except ValueError:
            abandoned_id = None
        out[mid] = {"label": metadata.get("checkpoint", ""), "abandoned_tip": abandoned_id}
    return out


def conversation_recent(*, user: Any, limit: int) -> Any:
    """The user's ``limit`` most recently active conversations, newest first, with only
    what a list of titles needs."""
    return (
        Conversation.objects.filter(owner=user)
        .order_by("-updated_at", "-id")
        .only("id", "title", "updated_at")[:limit]
    )


# --- blobs, turn attempts, imports and tokens ------------------------------------------


def blob_get(*, user: AbstractBaseUser, sha256: str) -> Blob:
    """A blob the user uploaded (or imported), or NotFound: the store is shared between
    users, so someone else's blob answers like a missing one."""
    blob = Blob.objects.filter(sha256=sha256, owners__id=user.pk).first()
    if blob is None:
        raise NotFound(f"no such blob: {sha256}")
    return blob


def turn_attempt_last(*, conversation: Conversation) -> TurnAttempt | None:
    """The conversation's newest turn attempt (what the chat offers to run again)."""
    return TurnAttempt.objects.filter(conversation=conversation).order_by("-created_at").first()


def import_job_list(*, owner: AbstractBaseUser, limit: int = 20) -> list[ImportJob]:
    """The user's newest import jobs."""
    return list(ImportJob.objects.filter(owner_id=owner.pk).order_by("-created_at")[:limit])


def import_job_get(*, owner: AbstractBaseUser, job_id: str | uuid.UUID) -> ImportJob:
    """The user's import job, or NotFound (another user's job answers like a missing one)."""
    jid = _parse_uuid(job_id, "import")
    try:
        return ImportJob.objects.get(pk=jid, owner_id=owner.pk)
    except ImportJob.DoesNotExist:
        raise NotFound(f"no such import: {jid}") from None


def api_token_list(*, user: AbstractBaseUser) -> QuerySet[ApiToken]:
    """The user's API tokens, newest first."""
    return ApiToken.objects.filter(user_id=user.pk).order_by("-created_at")
