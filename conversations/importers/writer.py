"""Store one built conversation: the conversation row, every message, the tip and the
checkpoints in one transaction, so a conversation is imported whole or not at all.

Messages are inserted directly (``services._insert_messages``), never through
``turn_append``: an import may hold unpaired tool traffic (an aborted agent step), which
turn_append rightly refuses for new turns; ``conversations.resume`` trims it when the
conversation is next sent to a model.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from typing import Any

from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from conversations import services
from conversations.errors import ArborError
from conversations.importers.base import Part, text_part
from conversations.importers.tree import BuiltConversation
from conversations.models import Blob, Checkpoint, Conversation, Message

INSERT_BATCH = 1000


def ordered_ids(count: int) -> list[uuid.UUID]:
    """New message ids that sort in the order given (a random 64-bit prefix shared by the
    conversation, then the position, then random bits; UUID version 8). The selectors
    order siblings by (created_at, id), so siblings with equal timestamps keep the order
    the file gave them, and an Arbor export lists them the same way after a re-import."""
    prefix = secrets.randbits(64)
    ids = []
    for position in range(count):
        value = (prefix << 64) | (position << 32) | secrets.randbits(32)
        value &= ~(0xF000 << 64)
        value |= 0x8000 << 64  # version 8
        value &= ~(0xC000 << 48)
        value |= 0x8000 << 48  # RFC 4122 variant
        ids.append(uuid.UUID(int=value))
    return ids


class _Images:
    """Turns image parts into blob references: bytes from the file go to the blob store
    (inside the conversation's transaction); a named blob must be in the file or already
    be the user's. An image that cannot be stored becomes a short text part."""

    def __init__(self, owner: User, built: BuiltConversation) -> None:
        self.owner = owner
        self.source = built.source
        self.report = built.source.report
        self.stored: dict[str, Blob | str] = {}  # key → blob, or the reason it failed

    def parts(self, parts: list[Part]) -> list[Part]:
        out = []
        for part in parts:
            if part.get("type") == "image":
                out.append(self._image(part))
            elif part.get("type") == "tool_result":
                out.append({**part, "parts": self.parts(part.get("parts", []))})
            else:
                out.append(part)
        return out

    def _store(self, key: str, data: bytes) -> Blob | str:
        if key not in self.stored:
            try:
                self.stored[key] = services.blob_store(owner=self.owner, data=data)
            except ArborError as exc:
                self.stored[key] = exc.detail
        return self.stored[key]

    def _image(self, part: Part) -> Part:
        where = str(part.get("where", "image"))
        result: Blob | str
        if "data" in part:
            data = part["data"]
            result = self._store(hashlib.sha256(data).hexdigest(), data)
        else:
            sha = str(part.get("blob", ""))
            if sha in self.source.blob_data:
                result = self._store(sha, self.source.blob_data[sha])
                if isinstance(result, Blob) and result.sha256 != sha:
                    self.report.repaired.add(
                        "blob_mismatch", where, f"the bytes given for {sha} hash differently"
                    )
            else:
                found = Blob.objects.filter(sha256=sha, owners=self.owner).first()
                result = found if found is not None else f"blob {sha[:12]}… is not in the file"
        if isinstance(result, Blob):
            return {
                "type": "image",
                "blob": result.sha256,
                "mime": result.mime,
                "width": result.width,
                "height": result.height,
            }
        self.report.images -= 1
        self.report.repaired.add("image_not_imported", where, result)
        return text_part(f"[image not imported: {result}]")


Calls = dict[str, tuple[uuid.UUID, str]]


def conversation_write(
    *, owner: User, built: BuiltConversation, calls: Calls | None = None, source_key: str = ""
) -> Conversation:
    """``calls`` (a tool call id, or ``agent:<id>`` for the sub-agent a call's result
    names → the message holding the call and its id) spans one import: a sub-agent's
    conversation is linked to the call that started it when that call was written
    before it, and this conversation's calls are added for the ones after."""
    calls = {} if calls is None else calls
    source = built.source
    report = source.report
    title = " ".join(source.title.split())[:200] if not source.verbatim else source.title[:200]
    with transaction.atomic():
        images = _Images(owner, built)
        for message in built.messages:
            message.node.parts = images.parts(message.node.parts)
        spawned_by, spawned_call = calls.get(source.spawned_by_call or "", (None, ""))
        conversation = Conversation.objects.create(
            owner=owner,
            title=title,
            model=source.model[:200],
            system_prompt=source.system_prompt,
            spawned_by_id=spawned_by,
            spawned_call=spawned_call[:200],
            source_key=source_key,
        )
        ids = ordered_ids(len(built.messages))
        id_of = {m.key: ids[i] for i, m in enumerate(built.messages)}
        rows: list[Message] = []
        for message in built.messages:
            node = message.node
            rows.append(
                Message(
                    id=id_of[message.key],
                    conversation_id=conversation.pk,
                    parent_id=id_of[message.parent] if message.parent is not None else None,
                    role=node.role,
                    parts=node.parts,
                    depth=message.depth,
                    origin=node.origin,
                    metadata=node.metadata,
                    created_at=node.created_at or timezone.now(),
                )
            )
            if len(rows) >= INSERT_BATCH:
                services._insert_messages(rows)
                rows = []
        services._insert_messages(rows)
        tip = id_of.get(built.tip) if built.tip is not None else None
        fields: dict[str, Any] = {"tip_id": tip, "version": 1 if tip else 0}
        if built.created_at is not None:
            fields["created_at"] = built.created_at
        # Its own last activity, not the moment of the import: the list shows (and sorts
        # by) the date the conversation last moved in the tool it came from.
        last = max((m.node.created_at for m in built.messages if m.node.created_at), default=None)
        if last is not None:
            fields["updated_at"] = max(last, built.created_at or last)
        Conversation.objects.filter(pk=conversation.pk).update(**fields)
        Checkpoint.objects.bulk_create(
            [
                Checkpoint(
                    conversation=conversation,
                    label=cp.label,
                    message_id=id_of[cp.message],
                    state=cp.state,
                    reason=cp.reason,
                    source=cp.source,
                    digest_message_id=id_of.get(cp.digest_message) if cp.digest_message else None,
                )
                for cp in built.checkpoints
            ]
        )
    for message in built.messages:
        node = message.node
        for part in node.parts:
            if part.get("type") == "tool_call" and isinstance(part.get("id"), str):
                calls.setdefault(part["id"], (id_of[message.key], part["id"]))
            agent = node.metadata.get("agent_id")
            if part.get("type") == "tool_result" and agent and part.get("call_id") in calls:
                calls.setdefault(f"agent:{agent}", calls[part["call_id"]])
    report.id = conversation.pk
    report.tip = tip
    report.title = title
    report.spawned_by = spawned_by
    return conversation
