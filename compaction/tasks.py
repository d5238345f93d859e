"""Celery tasks: thin. They take ids, claim the job row, and call one service."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from compaction import services


@shared_task(
    acks_late=True,
    # Redelivered after a worker dies; the job row's lease keeps it from running twice.
    reject_on_worker_lost=True,
    time_limit=settings.CELERY_TASK_TIME_LIMIT,
    soft_time_limit=settings.CELERY_TASK_SOFT_TIME_LIMIT,
)
def run_compaction_job(job_id: str) -> str | None:
    job = services.job_claim(job_id=job_id, lease_seconds=settings.CELERY_TASK_TIME_LIMIT)
    if job is None:
        return None  # already done, or running elsewhere
    record = services.job_run(job=job)
    return str(record.pk) if record else None
