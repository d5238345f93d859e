"""``manage.py bench_storage``: how many bytes the database spends per byte of text.

Imports the real agent sessions of ``../shared/samples`` (pi and Claude Code, with
``ARBOR_SAMPLES`` as in bench_compaction) into a scratch database of the configured
kind (a temporary SQLite file, or a temporary PostgreSQL database on the configured
server), made with ``migrate`` and dropped afterwards, then prints one JSON object:

- ``text_bytes``: the UTF-8 bytes of what the messages say (text, thinking, tool call
  names and arguments, tool result text; images are blobs on disk, not counted);
- ``relations``: the bytes of the message table (with its TOAST table on PostgreSQL)
  and of each of its indexes, and their total over ``text_bytes`` (goal ≤ 3);
- on PostgreSQL, the search index once more after ``REINDEX``: the trigram index grows
  through its pending list as rows are inserted, and the difference is that growth.

The scratch database keeps the figures free of whatever else the configured one holds
(rows of other benches, free pages left by their deletes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection

from arbor.env import database_url_of
from compaction.bench_samples import CLAUDE_CODE_DIR, PI_SAMPLE
from conversations.models import Message

GOAL = 3.0
SCRATCH_PREFIX = "arbor_storage_bench_"
SEARCH_INDEX = "msg_search_text_trgm"
# Set by the parent for its child: the URL of the scratch database it made.
SCRATCH_ENV = "ARBOR_STORAGE_BENCH_SCRATCH"


def text_bytes(parts: list[dict[str, Any]]) -> int:
    """The UTF-8 bytes of what a message says."""
    size = 0
    for part in parts:
        kind = part.get("type")
        if kind in ("text", "thinking"):
            size += len((part.get("text") or "").encode())
        elif kind == "tool_call":
            size += len((part.get("name") or "").encode())
            if part.get("arguments"):
                size += len(json.dumps(part["arguments"], ensure_ascii=False).encode())
        elif kind == "tool_result":
            for inner in part.get("parts") or []:
                if inner.get("type") == "text":
                    size += len((inner.get("text") or "").encode())
    return size


def sample_files() -> list[Path]:
    """The real agent sessions measured: the pi session and every Claude Code one."""
    return [PI_SAMPLE, *sorted(CLAUDE_CODE_DIR.glob("*.jsonl"))]


def missing_samples() -> str | None:
    """What is missing of the samples (they are read in place, never copied), or None."""
    files = sample_files()
    missing = [str(f) for f in files if not f.is_file()]
    if not CLAUDE_CODE_DIR.is_dir() or len(files) < 2:
        missing.append(str(CLAUDE_CODE_DIR))
    return ", ".join(missing) or None


class Command(BaseCommand):
    help = "Import the real samples into a scratch database and print bytes stored per text byte."

    def add_arguments(self, parser: CommandParser) -> None:
        # Internal: run inside the scratch database (the child process does this).
        parser.add_argument("--in-scratch", action="store_true", help=argparse.SUPPRESS)

    def handle(self, *args: Any, **options: Any) -> None:
        if options["in_scratch"]:
            self.stdout.write(json.dumps(self._measure()))
            return
        missing = missing_samples()
        if missing:  # nothing to measure: say so, and let `make bench` go on
            self.stdout.write(json.dumps({"storage": f"skipped: no samples at {missing}"}))
            return
        figures = self._in_scratch_database()
        ratio = round(figures["total_bytes"] / figures["text_bytes"], 2)
        figures["bytes_per_text_byte"] = ratio
        targets = {
            "storage_at_most_3x_text": {
                "description": "message table and its indexes ≤ 3 × the text they hold",
                "value": ratio,
                "limit": GOAL,
                "met": ratio <= GOAL,
            }
        }
        self.stdout.write(json.dumps({"storage": figures, "targets": targets}, indent=2))

    # --- the parent: a scratch database, migrated, measured by a child, dropped --------

    def _in_scratch_database(self) -> dict[str, Any]:
        vendor = connection.vendor
        with tempfile.TemporaryDirectory() as tmp:
            media = Path(tmp) / "media"
            if vendor == "sqlite":
                url = f"sqlite:///{Path(tmp) / 'storage.sqlite3'}"
                return self._child(url, media)
            if vendor != "postgresql":  # pragma: no cover - other backends are not supported
                raise CommandError(f"no storage bench for {vendor}")
            name = f"{SCRATCH_PREFIX}{uuid.uuid4().hex[:12]}"
            with connection.cursor() as cursor:
                cursor.execute(f'CREATE DATABASE "{name}"')
            try:
                scratch = {**connection.settings_dict, "NAME": name}
                return self._child(database_url_of(scratch, vendor), media)
            finally:
                with connection.cursor() as cursor:
                    cursor.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def _child(self, url: str, media: Path) -> dict[str, Any]:
        # The child knows its scratch database by name, and writes the samples' images
        # under a scratch media folder: nothing of it outlives the bench.
        env = dict(os.environ, DATABASE_URL=url, MEDIA_ROOT=str(media), **{SCRATCH_ENV: url})
        password = connection.settings_dict.get("PASSWORD")
        if password:  # not part of the URL (arbor.env.database_url_of)
            env["PGPASSWORD"] = str(password)
        manage = [sys.executable, str(Path(settings.BASE_DIR) / "manage.py")]
        self.stderr.write("migrating a scratch database…")
        subprocess.run([*manage, "migrate", "--noinput", "-v0"], env=env, check=True)
        self.stderr.write("importing the real samples into it…")
        child = subprocess.run(
            [*manage, "bench_storage", "--in-scratch"],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if child.returncode != 0:
            self.stderr.write(child.stderr[-3000:])
            raise CommandError(f"the measurement failed (exit {child.returncode})")
        return dict(json.loads(child.stdout.strip().splitlines()[-1]))

    # --- the child, inside the scratch database --------------------------------------

    def _measure(self) -> dict[str, Any]:
        from conversations.importers.services import transcript_import

        made = os.environ.get(SCRATCH_ENV)
        here = database_url_of(connection.settings_dict, connection.vendor)
        if made != here:  # REINDEX and a bench user have no business in a real database
            raise CommandError("--in-scratch runs only in the scratch database it makes")
        user = get_user_model().objects.create_user(username="storage-bench")
        files = sample_files()
        for path in files:
            transcript_import(owner_id=user.pk, path=str(path), format="auto")
        messages = 0
        text = 0
        for parts in Message.objects.values_list("parts", flat=True).iterator(chunk_size=500):
            messages += 1
            text += text_bytes(parts)
        relations = self._relations()
        figures: dict[str, Any] = {
            "database": connection.vendor,
            "samples": [p.name for p in files],
            "messages": messages,
            "text_bytes": text,
            "relations": relations,
            "total_bytes": sum(relations.values()),
        }
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute(f"REINDEX INDEX {SEARCH_INDEX}")
                cursor.execute("SELECT pg_relation_size(%s)", [SEARCH_INDEX])
                rebuilt = cursor.fetchone()[0]
            figures["search_index_rebuilt_bytes"] = rebuilt
            figures["total_bytes_with_rebuilt_search_index"] = (
                figures["total_bytes"] - relations[SEARCH_INDEX] + rebuilt
            )
        return figures

    def _relations(self) -> dict[str, int]:
        """Bytes of the message table and of each of its indexes."""
        table = Message._meta.db_table
        with connection.cursor() as cursor:
            if connection.vendor == "postgresql":
                cursor.execute("VACUUM ANALYZE " + table)
                cursor.execute(
                    "SELECT %s, pg_table_size(%s::regclass) UNION ALL "
                    "SELECT indexrelid::regclass::text, pg_relation_size(indexrelid) "
                    "FROM pg_index WHERE indrelid = %s::regclass",
                    [table, table, table],
                )
            else:
                indexes = [row[1] for row in cursor.execute(f"PRAGMA index_list({table})")]
                names = [table, *indexes]
                marks = ", ".join(["%s"] * len(names))
                cursor.execute(
                    f"SELECT name, SUM(pgsize) FROM dbstat WHERE name IN ({marks}) GROUP BY name",
                    names,
                )
            return {name: int(size) for name, size in cursor.fetchall()}
