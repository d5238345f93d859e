"""Where a queued background job runs.

With a broker (``CELERY_BROKER_URL``), on Celery workers. Without one, in this process:
on a worker thread (``ARBOR_INPROCESS_JOBS=thread``, the default), so the request that
queued the job is answered at once, as it would be with a real worker; or inside the
call that queued it (``inline``, the test suite's choice, where a job is done when the
call returns). Tasks take ids and claim their job row, so either way a job runs once.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from django.conf import settings
from django.db import connection

log = logging.getLogger("arbor.jobs")

# One thread: jobs are CPU-bound (rendering, OCR, parsing) and share the machine with
# the web requests.
_executor: ThreadPoolExecutor | None = None


def _in_thread(task: Any, args: tuple[Any, ...]) -> None:
    try:
        task(*args)
    except Exception:  # the task has recorded the failure on its job row
        log.exception("background job %s%r failed", getattr(task, "name", task), args)
    finally:
        connection.close()  # this thread's own connection


def job_dispatch(task: Any, *args: Any) -> None:
    """Run Celery ``task`` with ``args`` wherever jobs run here (call after commit)."""
    global _executor
    if settings.CELERY_BROKER_URL or settings.ARBOR_INPROCESS_JOBS == "inline":
        task.delay(*args)  # eager (inline) when there is no broker
        return
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="arbor-job")
    _executor.submit(_in_thread, task, args)
