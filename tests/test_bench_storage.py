"""bench_storage measures the real samples in a scratch database of the configured kind
and leaves nothing behind; on PostgreSQL the search index's pending list is bounded.
The test hands it the sessions the real CLIs wrote for this repository (tests/data) in
the samples' layout, so it runs without ../shared/samples."""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
import unittest
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import TransactionTestCase

from compaction.bench_samples import read_conversations
from conversations.importers import claude_code, pi
from conversations.management.commands import bench_storage
from conversations.management.commands.bench_storage import SCRATCH_PREFIX, text_bytes
from conversations.models import Message

SESSIONS = Path(__file__).parent / "data" / "sessions"
CLAUDE_NAME = "claude-code-2.1-parallel.jsonl"


class TextBytesTests(unittest.TestCase):
    def test_it_counts_what_a_message_says_in_utf8_and_never_image_data(self) -> None:
        parts: list[dict[str, Any]] = [
            {"type": "text", "text": "héllo"},  # 6 bytes
            {"type": "thinking", "text": "hm"},  # 2
            {"type": "tool_call", "id": "c1", "name": "ls", "arguments": {"p": "/"}},  # 2 + 10
            {
                "type": "tool_result",
                "call_id": "c1",
                "parts": [{"type": "text", "text": "a b"}, {"type": "image", "blob": "x" * 64}],
            },  # 3
            {"type": "image", "blob": "y" * 64},
        ]
        assert text_bytes(parts) == 6 + 2 + 2 + len('{"p": "/"}') + 3


def own_samples(folder: Path) -> tuple[Path, Path, int, int]:
    """The repository's pi and Claude Code sessions laid out as the samples are (pi's
    file under its name, a claude-code folder): their paths, and the messages and text
    bytes an import of them writes."""
    pi_file = folder / "pi" / "pi-mono__compact.jsonl"
    claude_dir = folder / "claude-code"
    pi_file.parent.mkdir(parents=True)
    claude_dir.mkdir()
    shutil.copy(SESSIONS / "pi-parallel.jsonl", pi_file)
    shutil.copy(SESSIONS / CLAUDE_NAME, claude_dir)
    built = [b for b, _ in read_conversations(pi_file, pi.parse)]
    built += [b for b, _ in read_conversations(claude_dir / CLAUDE_NAME, claude_code.parse)]
    nodes = [m.node for b in built for m in b.messages]
    return pi_file, claude_dir, len(nodes), sum(text_bytes(n.parts) for n in nodes)


@pytest.mark.slow  # a bench run in a scratch database
class BenchStorageTests(TransactionTestCase):
    def test_it_prints_the_ratio_of_bytes_to_text_and_leaves_nothing_behind(self) -> None:
        out = io.StringIO()
        with tempfile.TemporaryDirectory() as inherited, tempfile.TemporaryDirectory() as tmp:
            samples = Path(tmp) / "samples"
            pi_file, claude_dir, messages, text = own_samples(samples)
            # The child inherits this environment: it reads the samples named by
            # ARBOR_SAMPLES, and writes their images to its own scratch media folder,
            # not to the MEDIA_ROOT it inherits.
            with (
                mock.patch.dict(
                    os.environ, {"MEDIA_ROOT": inherited, "ARBOR_SAMPLES": str(samples)}
                ),
                mock.patch.object(bench_storage, "PI_SAMPLE", pi_file),
                mock.patch.object(bench_storage, "CLAUDE_CODE_DIR", claude_dir),
            ):
                call_command("bench_storage", stdout=out, stderr=io.StringIO())
            assert list(Path(inherited).iterdir()) == []
        figures = json.loads(out.getvalue())
        storage = figures["storage"]
        assert storage["database"] == connection.vendor
        assert storage["samples"] == [pi_file.name, CLAUDE_NAME]
        assert storage["messages"] == messages > 10  # the pi and Claude Code sessions
        assert storage["text_bytes"] == text > 500
        relations = storage["relations"]
        assert Message._meta.db_table in relations
        assert len(relations) >= 4  # the table and its indexes
        assert storage["total_bytes"] == sum(relations.values())
        assert storage["bytes_per_text_byte"] == round(
            storage["total_bytes"] / storage["text_bytes"], 2
        )
        target = figures["targets"]["storage_at_most_3x_text"]
        assert target["met"] == (target["value"] <= 3.0)
        # Imported into the scratch database, not this one.
        assert not Message.objects.exists()
        if connection.vendor == "postgresql":
            assert storage["search_index_rebuilt_bytes"] > 0
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT count(*) FROM pg_database WHERE datname LIKE %s",
                    [SCRATCH_PREFIX + "%"],
                )
                assert cursor.fetchone()[0] == 0

    def test_the_measuring_half_refuses_a_database_it_did_not_make(self) -> None:
        with pytest.raises(Exception, match="only in the scratch database"):
            call_command("bench_storage", "--in-scratch", stdout=io.StringIO())
        assert not Message.objects.exists()


@pytest.mark.postgres
@unittest.skipUnless(connection.vendor == "postgresql", "needs PostgreSQL")
class SearchIndexPendingListTests(TransactionTestCase):
    def test_the_trigram_index_keeps_a_1_mb_pending_list(self) -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT reloptions FROM pg_class WHERE relname = 'msg_search_text_trgm'")
            (options,) = cursor.fetchone()
        assert "gin_pending_list_limit=1024" in (options or [])


class MissingSamplesTests(unittest.TestCase):
    def test_without_the_samples_it_says_so_and_measures_nothing(self) -> None:
        with tempfile.TemporaryDirectory() as empty:
            nowhere = Path(empty) / "samples"
            with (
                mock.patch.object(bench_storage, "PI_SAMPLE", nowhere / "pi.jsonl"),
                mock.patch.object(bench_storage, "CLAUDE_CODE_DIR", nowhere / "claude-code"),
            ):
                out = io.StringIO()
                call_command("bench_storage", stdout=out, stderr=io.StringIO())
        assert json.loads(out.getvalue())["storage"].startswith("skipped: no samples at ")


class MessageIndexTests(TransactionTestCase):
    def test_no_index_of_the_message_table_is_the_prefix_of_another(self) -> None:
        """An index whose columns begin another index's is written on every insert (a
        fork writes thousands) and stored, for lookups the longer one serves."""
        with connection.cursor() as cursor:
            found = connection.introspection.get_constraints(cursor, Message._meta.db_table)
        plain = {
            name: tuple(c["columns"])
            for name, c in found.items()
            if c["index"] and not c["unique"] and not c["primary_key"] and c["columns"]
        }
        assert ("conversation_id", "parent_id") in plain.values()  # the introspection works
        for name, columns in plain.items():
            longer = [
                other
                for other, cols in plain.items()
                if other != name and len(cols) > len(columns) and cols[: len(columns)] == columns
            ]
            assert not longer, f"{name} {columns} is a prefix of {longer}"
