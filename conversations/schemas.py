"""API shapes. Message parts are checked in depth by conversations.parts, which names
every problem at once; the schemas here only fix the outer shape."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any

from ninja import Field, Schema
from pydantic import AfterValidator


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    return value


# A string PostgreSQL can store: text columns refuse NUL.
Text = Annotated[str, AfterValidator(_no_nul)]


class ErrorOut(Schema):
    error: str
    detail: str


class ConversationIn(Schema):
    title: Text = Field("", max_length=200)
    system_prompt: Text = Field("", max_length=200_000)
    model: Text = Field("", max_length=200)
    # The model's checkpoint/rewind tools: on by default for harnesses using the API.
    checkpoint_tools: bool = True


class ConversationPatch(Schema):
    title: Text | None = Field(None, max_length=200)
    system_prompt: Text | None = Field(None, max_length=200_000)
    model: Text | None = Field(None, max_length=200)
    checkpoint_tools: bool | None = None


class ForkLink(Schema):
    id: uuid.UUID
    title: str
    forked_from: uuid.UUID | None


class ConversationOut(Schema):
    id: uuid.UUID
    title: str
    tip: uuid.UUID | None
    version: int
    forked_from: uuid.UUID | None
    forked_from_conversation: uuid.UUID | None
    # A sub-agent run: the message whose tool call started it, and that call's id.
    spawned_by: uuid.UUID | None
    spawned_call: str
    model: str
    system_prompt: str
    checkpoint_tools: bool
    # The User-Agent of the harness whose gateway session this is ("" otherwise).
    harness: str
    message_count: int
    created_at: datetime
    updated_at: datetime


class SubAgentLink(Schema):
    id: uuid.UUID
    title: str
    spawned_by: uuid.UUID | None
    call: str


class ConversationDetailOut(ConversationOut):
    forks: list[ForkLink]
    # Sub-agent runs started by tool calls in this conversation (imported Task runs).
    subagents: list[SubAgentLink]


class ConversationPageOut(Schema):
    items: list[ConversationOut]
    next_cursor: str | None


class MessageIn(Schema):
    role: str
    parts: list[Any]
    metadata: dict[str, Any] = {}


class MessageOut(Schema):
    id: uuid.UUID
    parent: uuid.UUID | None
    role: str
    parts: list[dict[str, Any]]
    depth: int
    origin: str
    metadata: dict[str, Any]
    created_at: datetime


class SiblingsOut(Schema):
    ids: list[uuid.UUID]
    index: int


class MessageDetailOut(MessageOut):
    conversation: uuid.UUID
    siblings: SiblingsOut


class PathOut(Schema):
    conversation: uuid.UUID
    tip: uuid.UUID | None
    messages: list[MessageOut]


class TreeNodeOut(Schema):
    id: uuid.UUID
    parent: uuid.UUID | None
    role: str
    origin: str
    preview: str
    depth: int
    child_count: int


class TreePageOut(Schema):
    conversation: uuid.UUID
    tip: uuid.UUID | None
    nodes: list[TreeNodeOut]
    next_cursor: str | None


class TurnIn(Schema):
    parent: uuid.UUID | None
    expected_version: int
    messages: list[MessageIn]


class TurnOut(Schema):
    tip: uuid.UUID
    version: int
    message_ids: list[uuid.UUID]


class TipIn(Schema):
    message: uuid.UUID
    expected_version: int


class TipOut(Schema):
    tip: uuid.UUID | None
    version: int


class EditIn(Schema):
    parts: list[Any]
    expected_version: int


class RegenerateIn(Schema):
    messages: list[MessageIn]
    expected_version: int


class ForkIn(Schema):
    title: Text = Field("", max_length=200)
    scope: str = "path"


class CheckpointIn(Schema):
    label: str


class CheckpointOut(Schema):
    id: int
    label: str
    message: uuid.UUID
    state: str
    reason: str
    source: str
    digest_message: uuid.UUID | None
    created_at: datetime


class RewindIn(Schema):
    label: str
    digest: str | None = None
    expected_version: int | None = None


class RewindOut(Schema):
    tip: uuid.UUID
    version: int
    digest_message: uuid.UUID
    abandoned_tip: uuid.UUID | None
    checkpoint: CheckpointOut


class BlobOut(Schema):
    sha256: str
    mime: str
    size: int
    width: int
    height: int


class ChatIn(Schema):
    parts: list[Any]
    parent: uuid.UUID | None = None
    # Omit ``parent`` to continue from the current tip; send null to start a new root.
    model: Text = Field("", max_length=200)
    stream: bool = False


class ChatOut(Schema):
    attempt: uuid.UUID
    tip: uuid.UUID
    version: int
    message_ids: list[uuid.UUID]
    # Stop was asked while it ran: the last answer is what streamed until then.
    stopped: bool = False


class StopOut(Schema):
    stopping: list[uuid.UUID]
