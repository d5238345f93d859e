"""``manage.py bench_import``: peak memory of importing a large Claude Code session.

Writes a synthetic Claude Code JSONL of ``--mb`` megabytes (a chain of user prompts,
tool calls and tool results shaped like the real files), imports it in a child process
for a throwaway user, and prints one JSON object: file size, messages, seconds and the
child's peak resident memory. The stated bound is --limit-mb (default 1,024 MB for the
default 200 MB file): the importer streams the file but holds one conversation's
messages at a time.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandParser
from django.db import connection

from arbor.env import database_url_of
from conversations import services
from conversations.models import Conversation

BENCH_USERNAME = "__arbor_bench_import__"

_CHILD = """
import json, os, sys, time, django
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "arbor.settings")
django.setup()
from conversations.importers import transcript_import
started = time.perf_counter()
report = transcript_import(owner_id=int(sys.argv[1]), path=sys.argv[2], format="claude-code")
print(json.dumps({"seconds": round(time.perf_counter() - started, 2),
                  "messages": sum(c.messages for c in report.conversations),
                  "conversations": len(report.conversation_ids)}))
"""


def write_session(path: Path, megabytes: int) -> int:
    """A linear session: prompt → tool call → tool result → answer, repeated."""
    target = megabytes * 1024 * 1024
    # Tool results dominate real agent sessions; ~1 kB a message on average keeps a
    # 200 MB file under the importer's 200,000-message limit for one conversation.
    filler = "The log says everything is fine on this line. " * 100
    written, i, parent = 0, 0, None
    with path.open("w") as out:
        while written < target:
            records: list[dict[str, Any]] = [
                {"type": "user", "message": {"role": "user", "content": [
                    {"type": "text", "text": f"Step {i}: read the next log chunk."}]}},
                {"type": "assistant", "message": {"id": f"msg_{i}_a", "role": "assistant",
                    "content": [{"type": "tool_use", "id": f"toolu_{i}", "name": "Read",
                                 "input": {"file_path": f"/var/log/app/{i}.log"}}]}},
                {"type": "user", "message": {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": filler}]}},
                {"type": "assistant", "message": {"id": f"msg_{i}_b", "role": "assistant",
                    "content": [{"type": "text", "text": f"Chunk {i} is clean."}]}},
            ]  # fmt: skip
            for n, record in enumerate(records):
                uuid = f"r{i}-{n}"
                record.update(
                    uuid=uuid,
                    parentUuid=parent,
                    sessionId="bench",
                    isSidechain=False,
                    timestamp=f"2025-01-01T00:00:{i % 60:02d}.000Z",
                )
                line = json.dumps(record) + "\n"
                out.write(line)
                written += len(line)
                parent = uuid
            i += 1
    return written


class Command(BaseCommand):
    help = "Import a generated large Claude Code JSONL and print its peak memory as JSON."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--mb", type=int, default=200)
        parser.add_argument("--limit-mb", type=int, default=1024)

    def handle(self, *args: Any, **options: Any) -> None:
        User = get_user_model()
        User.objects.filter(username=BENCH_USERNAME).delete()
        user = User.objects.create_user(username=BENCH_USERNAME)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "session.jsonl"
            self.stderr.write(f"writing a {options['mb']} MB session…")
            size = write_session(path, options["mb"])
            self.stderr.write("importing it in a child process…")
            earlier = resource.getrusage(resource.RUSAGE_CHILDREN)
            started = time.perf_counter()
            child = subprocess.run(
                [sys.executable, "-c", _CHILD, str(user.pk), str(path)],
                cwd=settings.BASE_DIR,
                # The child imports into this very database (the test one under tests).
                env=dict(
                    os.environ,
                    DATABASE_URL=database_url_of(connection.settings_dict, connection.vendor),
                ),
                capture_output=True,
                text=True,
                check=False,
            )
            wall = time.perf_counter() - started
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        peak_kb = children.ru_maxrss
        try:
            for conv in Conversation.objects.filter(owner=user):
                services.conversation_delete(conversation=conv)
        finally:
            user.delete()
        if child.returncode != 0:
            self.stderr.write(child.stderr[-2000:])
            raise SystemExit(f"the import failed (exit {child.returncode})")
        figures = json.loads(child.stdout.strip().splitlines()[-1])
        peak_mb = round(peak_kb / 1024, 1)
        self.stdout.write(
            json.dumps(
                {
                    "import": {
                        "database": settings.DATABASES["default"]["ENGINE"].rsplit(".", 1)[-1],
                        "file_mb": round(size / 1024 / 1024, 1),
                        **figures,
                        "wall_seconds": round(wall, 2),
                        # The importing child's CPU (children waited for before it
                        # are taken out; its peak memory is theirs and its own).
                        "cpu_seconds": round(
                            children.ru_utime
                            + children.ru_stime
                            - earlier.ru_utime
                            - earlier.ru_stime,
                            2,
                        ),
                        "peak_rss_mb": peak_mb,
                        "limit_mb": options["limit_mb"],
                        "within_limit": peak_mb <= options["limit_mb"],
                        "imported": figures["conversations"] == 1,
                    }
                }
            )
        )
