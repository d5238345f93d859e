"""Compaction records: what the model saw instead of the originals, and the jobs that
build it (DESIGN.md §2, §5).

A record never rewrites the tree. It is anchored at the last message it covers and
holds the compacted view of the path up to that anchor; any branch whose path passes
through the anchor reuses it (the path to a message is unique in a tree), a branch that
leaves the path above it does not.
"""

from __future__ import annotations

import uuid

from django.db import models
from django.db.models import Q
from django.utils import timezone

from conversations.models import Blob, Conversation, Message


class Trigger(models.TextChoices):
    PROACTIVE = "proactive"  # the estimate crossed the threshold after a turn
    REACTIVE = "reactive"  # the provider rejected a request as too large
    MANUAL = "manual"


class RecordStatus(models.TextChoices):
    BUILDING = "building"
    READY = "ready"
    FAILED = "failed"


class CompactionRecord(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    conversation = models.ForeignKey(
        Conversation, on_delete=models.CASCADE, related_name="compactions"
    )
    # The last message the record covers.
    anchor = models.ForeignKey(Message, on_delete=models.CASCADE, related_name="compactions")
    # The last message kept verbatim at the head (system prompt and first user turn).
    head_end = models.ForeignKey(
        Message, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    model = models.CharField(max_length=200)
    trigger = models.CharField(max_length=16, choices=Trigger.choices)
    status = models.CharField(
        max_length=16, choices=RecordStatus.choices, default=RecordStatus.BUILDING
    )
    budget_tokens = models.PositiveIntegerField(default=0)
    tokens_before = models.PositiveIntegerField(default=0)
    tokens_after = models.PositiveIntegerField(default=0)
    # Measured by the provider on the next real request built from this record.
    measured_next_tokens = models.PositiveIntegerField(null=True, blank=True)
    rungs = models.JSONField(default=list)  # one report per rung applied, in order
    view = models.JSONField(default=list)  # the compacted messages up to the anchor
    model_calls = models.PositiveIntegerField(default=0)
    summary = models.TextField(blank=True)
    summary_model = models.CharField(max_length=200, blank=True)
    summary_prompt = models.TextField(blank=True)
    error = models.TextField(blank=True)
    timings = models.JSONField(default=dict)
    created_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        indexes = [
            models.Index(fields=["conversation", "status", "-created_at"], name="compaction_conv")
        ]

    def __str__(self) -> str:
        return f"compaction {self.id} ({self.status})"

    @property
    def rung_names(self) -> list[str]:
        return [str(r.get("rung")) for r in self.rungs]


class SnapshotPage(models.Model):
    record = models.ForeignKey(CompactionRecord, on_delete=models.CASCADE, related_name="pages")
    index = models.PositiveIntegerField()
    # The PNG lives in the content-addressed blob store: same text and settings, same
    # bytes, same blob.
    blob = models.ForeignKey(Blob, on_delete=models.PROTECT, related_name="+")
    width = models.PositiveIntegerField()
    height = models.PositiveIntegerField()
    billed_tokens = models.PositiveIntegerField()
    chars = models.PositiveIntegerField()
    text_hash = models.CharField(max_length=64)
    first_message_id = models.CharField(max_length=64)
    last_message_id = models.CharField(max_length=64)
    ocr_cer = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["record", "index"]
        constraints = [
            models.UniqueConstraint(fields=["record", "index"], name="snapshot_page_index")
        ]

    def __str__(self) -> str:
        return f"page {self.index} of {self.record_id}"


class ModelCalibration(models.Model):
    """How much the provider's measured count exceeds Arbor's estimate, per model."""

    model = models.CharField(max_length=200, unique=True)
    factor = models.FloatField(default=1.0)
    samples = models.PositiveIntegerField(default=0)
    # The window the provider reported in its last overflow error, if any.
    reported_limit = models.PositiveIntegerField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"{self.model} ×{self.factor:.2f}"


class CalibrationEvent(models.Model):
    """One thing the estimator learnt about a model: a measured request or an overflow
    error, and how the factor moved (settings shows the newest; a bounded history)."""

    class Kind(models.TextChoices):
        MEASURED = "measured"
        OVERFLOW = "overflow"

    model = models.CharField(max_length=200)
    kind = models.CharField(max_length=16, choices=Kind.choices)
    raw_estimate = models.PositiveIntegerField()
    measured = models.PositiveIntegerField(null=True, blank=True)
    limit = models.PositiveIntegerField(null=True, blank=True)
    factor_before = models.FloatField()
    factor_after = models.FloatField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["model", "-created_at"], name="calib_event_model")]

    def __str__(self) -> str:
        return f"{self.model} {self.kind} ×{self.factor_before:.2f}→×{self.factor_after:.2f}"


class JobState(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class CompactionJob(models.Model):
    """The row a Celery task claims, so that a job runs once however often it is
    delivered (acks_late redelivers after a worker dies)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    conversation = models.ForeignKey(
        Conversation, on_delete=models.CASCADE, related_name="compaction_jobs"
    )
    anchor = models.ForeignKey(Message, on_delete=models.CASCADE, related_name="+")
    model = models.CharField(max_length=200)
    trigger = models.CharField(max_length=16, choices=Trigger.choices)
    state = models.CharField(max_length=16, choices=JobState.choices, default=JobState.QUEUED)
    attempts = models.PositiveIntegerField(default=0)
    # Renewed on a timer while the job runs (services.job_run); a worker that dies stops
    # renewing it, and the job can be taken again once it has passed.
    lease_until = models.DateTimeField(null=True, blank=True)
    # The process running it (arbor.procs.process_identity): on the same host a dead
    # worker is seen at once, without waiting for the lease.
    worker = models.CharField(max_length=200, blank=True)
    record = models.ForeignKey(
        CompactionRecord, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    progress = models.JSONField(default=dict)
    error = models.TextField(blank=True)
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            # One open job per anchor and model: enqueueing twice is harmless.
            models.UniqueConstraint(
                fields=["conversation", "anchor", "model"],
                condition=Q(state__in=["queued", "running"]),
                name="compaction_job_open_unique",
            )
        ]

    def __str__(self) -> str:
        return f"job {self.id} ({self.state})"
