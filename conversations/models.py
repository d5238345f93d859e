"""The conversation tree.

A message row is immutable once written: ordinary use never updates or deletes one (only
deleting the whole conversation does). Going back, branching and rewinding only move
``Conversation.tip`` — a compare-and-set on ``Conversation.version``.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from conversations.parts import searchable_text, without_lone_surrogates

# A surrogate escape in JSON text (a pair, as json.dumps writes an emoji, or a lone half).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def stored_text(data: Any, raw: Any) -> Any:
    """``data`` read from the JSON text ``raw`` of a TextJSONField, as text."""
    if isinstance(raw, str) and _SURROGATE_ESCAPE.search(raw):
        return without_lone_surrogates(data)  # a pair already reads as one character
    return data


def read_stored_json(raw: str) -> Any:
    """A TextJSONField's column read by hand (a raw query), as the field reads it."""
    return stored_text(json.loads(raw), raw)


class TextJSONField(models.JSONField):
    """A JSONField whose strings read back as text. SQLite keeps JSON as escaped text, so
    an older Arbor could store a lone surrogate (``"\\ud83d"``, half an emoji: the API
    took it before ``strict_json`` refused it, PostgreSQL's jsonb never did); it reads
    back as U+FFFD, so no page, export or model request fails on the stored message.
    The same column as a JSONField, and the same for migrations."""

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> Any:
        data = super().from_db_value(value, expression, connection)
        return stored_text(data, value)

    def deconstruct(self) -> Any:
        name, _, args, kwargs = super().deconstruct()
        return name, "django.db.models.JSONField", args, kwargs


class Role(models.TextChoices):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


class Origin(models.TextChoices):
    TURN = "turn"
    EDIT = "edit"
    REGENERATE = "regenerate"
    FORK = "fork"
    IMPORT = "import"
    DIGEST = "digest"


class Conversation(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="conversations"
    )
    title = models.CharField(max_length=200, blank=True)
    # The current branch tip: null only while the conversation is empty.
    tip = models.ForeignKey(
        "Message", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Bumped on every tip move; writers pass the version they saw (compare-and-set).
    version = models.PositiveIntegerField(default=0)
    forked_from = models.ForeignKey(
        "Message", null=True, blank=True, on_delete=models.SET_NULL, related_name="forks"
    )
    # A sub-agent's conversation (an imported Claude Code Task/Agent run): the message
    # of the parent conversation holding the call that started it, and that call's id.
    spawned_by = models.ForeignKey(
        "Message", null=True, blank=True, on_delete=models.SET_NULL, related_name="spawned"
    )
    spawned_call = models.CharField(max_length=200, blank=True, default="")
    model = models.CharField(max_length=200, blank=True)
    system_prompt = models.TextField(blank=True)
    # Offer the model the checkpoint/rewind tools (on for harness conversations created
    # through the API, off for browser chats; switchable in both).
    checkpoint_tools = models.BooleanField(default=False)
    # Conversations the gateway keeps for a harness (conversations/gateway): the
    # harness's own session id where it sends one, a fingerprint of its system prompt and
    # tool names (a sub-agent's or a side request's differs), and its User-Agent.
    gateway_session = models.CharField(max_length=200, blank=True, default="")
    gateway_fingerprint = models.CharField(max_length=64, blank=True, default="")
    harness = models.CharField(max_length=200, blank=True, default="")
    # Where an imported conversation came from, "<format>:<its id there>" (a ChatGPT
    # conversation id, a Claude Code session id…): importing the same one again is
    # noticed, and done only as a copy when asked.
    source_key = models.CharField(max_length=300, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        indexes = [
            models.Index(fields=["owner", "-updated_at"], name="conv_owner_updated"),
            models.Index(
                fields=["owner", "gateway_session"],
                condition=~Q(gateway_session=""),
                name="conv_gateway_session",
            ),
            models.Index(
                fields=["owner", "source_key"],
                condition=~Q(source_key=""),
                name="conv_source_key",
            ),
        ]

    def __str__(self) -> str:
        return self.title or str(self.id)


class Message(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    # No index of its own: msg_conv_parent and msg_conv_depth (Meta) both begin with it,
    # and serve every lookup by conversation (and the cascade's check) as well.
    conversation = models.ForeignKey(
        Conversation, on_delete=models.CASCADE, related_name="messages", db_index=False
    )
    # DO_NOTHING: messages are only ever deleted together with their whole conversation
    # (conversation_delete removes every row in one statement), so a per-row cascade
    # walk down a 10,000-deep chain is never needed.
    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.DO_NOTHING, related_name="children"
    )
    role = models.CharField(max_length=16, choices=Role.choices)
    parts = TextJSONField(default=list)
    depth = models.PositiveIntegerField(default=0)
    origin = models.CharField(max_length=16, choices=Origin.choices, default=Origin.TURN)
    metadata = TextJSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    # The plain text of ``parts`` for search (parts.searchable_text), written with the row
    # by every insert path: save() below, services._insert_messages, the fork's copy.
    # Derived data: exports leave it out and imports recompute it. On PostgreSQL a
    # trigram index (migration 0006) serves the search's case-insensitive LIKE.
    search_text = models.TextField(blank=True, default="", editable=False)
    # Written by the gateway on the last message of each request message it stored: the
    # hash of the request's messages up to and including that one (gateway/wire.py
    # chain_keys). A later request finds its longest stored prefix by these keys in one
    # indexed query. Empty elsewhere; never copied by a fork.
    gateway_key = models.CharField(
        max_length=64, blank=True, default="", db_default="", editable=False
    )

    class Meta:
        indexes = [
            models.Index(fields=["conversation", "parent"], name="msg_conv_parent"),
            models.Index(fields=["conversation", "depth", "created_at"], name="msg_conv_depth"),
            models.Index(
                fields=["gateway_key"], condition=~Q(gateway_key=""), name="msg_gateway_key"
            ),
        ]
        constraints = [
            models.CheckConstraint(
                condition=Q(parent__isnull=True, depth=0) | Q(parent__isnull=False, depth__gt=0),
                name="msg_depth_matches_parent",
            )
        ]

    def __str__(self) -> str:
        return f"{self.role} {self.id}"

    def save(self, *args: Any, **kwargs: Any) -> None:
        self.search_text = searchable_text(self.parts)
        super().save(*args, **kwargs)


class Blob(models.Model):
    """An immutable image, addressed by the sha256 of its bytes."""

    sha256 = models.CharField(max_length=64, primary_key=True)
    file = models.FileField(upload_to="blobs/")
    mime = models.CharField(max_length=64)
    size = models.PositiveIntegerField()
    width = models.PositiveIntegerField()
    height = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)
    # Who may reference the blob: a user proves they hold the bytes by uploading them.
    owners = models.ManyToManyField(settings.AUTH_USER_MODEL, related_name="blobs", blank=True)

    def __str__(self) -> str:
        return f"{self.sha256[:12]} {self.mime} {self.width}x{self.height}"


class CheckpointState(models.TextChoices):
    LIVE = "live"
    DROPPED = "dropped"


class CheckpointSource(models.TextChoices):
    USER = "user"
    MODEL = "model"


class Checkpoint(models.Model):
    conversation = models.ForeignKey(
        Conversation, on_delete=models.CASCADE, related_name="checkpoints"
    )
    label = models.CharField(max_length=100)
    # Never re-pointed: a checkpoint whose target is lost is marked dropped instead.
    message = models.ForeignKey(Message, on_delete=models.CASCADE, related_name="checkpoints")
    state = models.CharField(
        max_length=16, choices=CheckpointState.choices, default=CheckpointState.LIVE
    )
    reason = models.TextField(blank=True)
    source = models.CharField(
        max_length=16, choices=CheckpointSource.choices, default=CheckpointSource.USER
    )
    # The digest appended by the most recent rewind to this checkpoint.
    digest_message = models.ForeignKey(
        Message, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["conversation", "label"],
                condition=Q(state="live"),
                name="checkpoint_live_label_unique",
            )
        ]

    def __str__(self) -> str:
        return f"{self.label} ({self.state})"


class ApiToken(models.Model):
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    name = models.CharField(max_length=100)
    # sha256 of the secret; the secret itself is shown once and never stored.
    token_hash = models.CharField(max_length=64, unique=True)
    prefix = models.CharField(max_length=12)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    # Optional: after this moment the token is refused (401 token_expired). Null: never.
    expires_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"


class AttemptStatus(models.TextChoices):
    RUNNING = "running"
    FAILED = "failed"
    COMPLETED = "completed"


class TurnAttempt(models.Model):
    """One try at a chat turn, recorded apart from the transcript.

    The transcript only ever holds whole turns; this row remembers what was asked (so a
    failed or interrupted turn can be retried after a restart) and how it ended.
    """

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    conversation = models.ForeignKey(
        Conversation, on_delete=models.CASCADE, related_name="attempts"
    )
    # The message the user's input continues (null for a first message).
    parent = models.ForeignKey(
        Message, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    input_parts = TextJSONField(default=list)
    model = models.CharField(max_length=200, blank=True)
    status = models.CharField(
        max_length=16, choices=AttemptStatus.choices, default=AttemptStatus.RUNNING
    )
    error_code = models.CharField(max_length=64, blank=True)
    error_text = models.TextField(blank=True)
    result_tip = models.ForeignKey(
        Message, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # host:pid of the process running it, and when it last showed signs of life: a
    # "running" attempt whose process is gone is stale, and retry treats it as failed.
    worker = models.CharField(max_length=200, blank=True)
    heartbeat_at = models.DateTimeField(default=timezone.now)
    retry_of = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="retries"
    )
    created_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)
    # Someone asked the running turn to stop (from any process): its run sees this, cuts
    # the model's request and writes what streamed so far as a stopped answer.
    stop_requested_at = models.DateTimeField(null=True, blank=True)
    # What the running turn has streamed so far ({"text", "tools"}), written every
    # fraction of a second while it runs: a reloaded chat shows it and follows it. Not
    # the transcript: the turn's messages are written whole at its end.
    live = models.JSONField(default=dict, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["conversation", "-created_at"], name="attempt_conv_created")
        ]

    def __str__(self) -> str:
        return f"attempt {self.id} {self.status}"


class ImportState(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class ImportJob(models.Model):
    """An uploaded transcript file being imported by a background job (a Celery worker,
    or in-process without a broker); the upload page polls it for progress."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="import_jobs"
    )
    filename = models.CharField(max_length=255)
    upload = models.FileField(upload_to="imports/")
    format = models.CharField(max_length=32, default="auto")
    # Conversations imported before (same source key) are skipped ("skip"), or imported
    # again as copies ("copy"); ``only_keys`` limits a job to those source keys (the
    # "import again as copies" of an earlier job's skipped ones).
    on_duplicate = models.CharField(max_length=8, default="skip")
    only_keys = models.JSONField(default=list, blank=True)
    state = models.CharField(max_length=16, choices=ImportState.choices, default=ImportState.QUEUED)
    conversations_done = models.PositiveIntegerField(default=0)
    messages_done = models.PositiveIntegerField(default=0)
    report = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True)
    # The process importing it (arbor.procs.process_identity): a running import whose
    # process is gone is marked failed, with what it imported, instead of running forever.
    worker = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"import {self.filename} ({self.state})"
