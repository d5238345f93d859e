"""Celery app. Without CELERY_BROKER_URL, tasks run in-process (task_always_eager)."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "arbor.settings")

app = Celery("arbor")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
