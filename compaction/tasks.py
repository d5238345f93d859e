"""Celery tasks: thin. They take ids, claim the job row, and call one service."""

from __future__ import annotations

from typing import Any

from celery import shared_task
from celery.signals import worker_ready
from django.conf import settings

from compaction import services


@shared_task(
    bind=True,
    acks_late=True,
    # Redelivered at once when the pool process running it dies; the job row's claim
    # (services.job_claim) keeps a job from running twice however often it is delivered.
    reject_on_worker_lost=True,
    # While a live worker holds the job, a second delivery waits for it to end (a lease
    # at a time; more than enough tries to outlast the time limit).
    max_retries=settings.CELERY_TASK_TIME_LIMIT // max(1, settings.ARBOR_JOB_LEASE_SECONDS) + 5,
    time_limit=settings.CELERY_TASK_TIME_LIMIT,
    soft_time_limit=settings.CELERY_TASK_SOFT_TIME_LIMIT,
)
def run_compaction_job(self: Any, job_id: str) -> str | None:
    try:
        job = services.job_claim(job_id=job_id)
    except services.JobBusy as busy:
        raise self.retry(countdown=busy.retry_in) from None
    if job is None:
        return None  # done, failed, or taken by another delivery
    record = services.job_run(job=job)
    return str(record.pk) if record else None


@shared_task
def sweep_jobs() -> dict[str, int]:
    """Send again the jobs no worker has (services.jobs_sweep); on beat's schedule."""
    return services.jobs_sweep()


@worker_ready.connect
def _sweep_on_start(sender: Any = None, **kwargs: Any) -> None:
    # A worker starting after a crash, a deploy or a broker restart picks up what the
    # old one left: the sweep runs as a task, on this worker's pool.
    sweep_jobs.delay()
