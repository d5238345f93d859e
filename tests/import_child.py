"""Run one import job in a separate process, for the crash test (tests/test_import_kill.py).

python tests/import_child.py JOB_ID
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "arbor.settings")

import django

django.setup()

from conversations.services import import_job_run  # noqa: E402

if __name__ == "__main__":
    import_job_run(job_id=sys.argv[1])
