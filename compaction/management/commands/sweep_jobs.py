"""``manage.py sweep_jobs``: send again the background jobs no worker has.

Each Celery worker sweeps as it starts, and beat repeats it (CELERY_BEAT_SCHEDULE); this
command is the same sweep for cron or by hand. It prints what it did as JSON. Safe to
run at any time: a job sent twice still runs once.
"""

from __future__ import annotations

import json
from typing import Any

from django.core.management.base import BaseCommand

from compaction import services


class Command(BaseCommand):
    help = (
        "Send again compaction jobs and imports that no worker has (queued past "
        "ARBOR_JOB_REQUEUE_SECONDS, or running with their worker dead), and end imports "
        "whose process died. Prints counts as JSON."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        self.stdout.write(json.dumps(services.jobs_sweep()))
