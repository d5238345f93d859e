"""Celery tasks for the conversations app: thin, they take ids and call one service."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from conversations import services


@shared_task(
    acks_late=True,
    reject_on_worker_lost=True,
    time_limit=settings.CELERY_TASK_TIME_LIMIT,
    soft_time_limit=settings.CELERY_TASK_SOFT_TIME_LIMIT,
)
def run_import_job(job_id: str) -> None:
    services.import_job_run(job_id=job_id)
