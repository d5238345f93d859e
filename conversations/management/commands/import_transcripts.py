"""``manage.py import_transcripts FILE… --user NAME [--format …]``: import transcripts.

A FILE may be a zip archive or a folder (a Claude Code project folder with its
sub-agent runs, a ChatGPT export): see conversations.importers.archive.

Each file is read as a stream and each conversation in it is written in its own
transaction; progress goes to stderr, a summary per file to stdout (``--json`` prints
the full reports instead). Importing a file twice creates its conversations twice: an
import never merges into existing conversations.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from conversations.errors import ArborError
from conversations.importers import FORMATS, ConversationReport, ImportReport, transcript_import


class Command(BaseCommand):
    help = (
        "Import ChatGPT conversations.json, Claude Code or pi sessions (.jsonl), Open WebUI "
        "chats and Arbor JSON exports for a user. Prints what was imported and every item "
        "skipped, repaired or flagged."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "files", nargs="+", help="transcript files, zip archives or folders to import"
        )
        parser.add_argument("--user", required=True, help="the username that will own them")
        parser.add_argument(
            "--format",
            default="auto",
            choices=["auto", *FORMATS],
            help="the files' format (default: detect it from each file)",
        )
        parser.add_argument("--json", action="store_true", help="print the reports as JSON")

    def handle(self, *args: Any, **options: Any) -> None:
        user_model = get_user_model()
        try:
            user = user_model._default_manager.get_by_natural_key(options["user"])
        except user_model.DoesNotExist:
            raise CommandError(f"no user named {options['user']!r}") from None
        paths = [Path(f) for f in options["files"]]
        missing = [str(p) for p in paths if not (p.is_file() or p.is_dir())]
        if missing:
            raise CommandError(f"no such file: {', '.join(missing)}")
        reports: list[dict[str, Any]] = []
        failed = 0
        for number, path in enumerate(paths, start=1):
            self.stderr.write(f"[{number}/{len(paths)}] {path}")

            def progress(conv: ConversationReport) -> None:
                self.stderr.write(f"  imported {conv.title!r}: {conv.messages} messages")

            try:
                report = transcript_import(
                    owner_id=user.pk, path=path, format=options["format"], progress=progress
                )
            except ArborError as exc:
                failed += 1
                self.stderr.write(f"  not imported: {exc.detail}")
                reports.append({"file": str(path), "error": exc.code, "detail": exc.detail})
                continue
            reports.append(report.as_dict())
            if not options["json"]:
                self._summary(path, report)
        if options["json"]:
            self.stdout.write(json.dumps(reports, indent=2, ensure_ascii=False))
        if failed == len(paths):
            raise CommandError("no file could be imported")

    def _summary(self, path: Path, report: ImportReport) -> None:
        self.stdout.write(
            f"{path}: {report.format}, {len(report.conversations)} conversation(s) imported"
        )
        for conv in report.conversations:
            self.stdout.write(
                f"  {conv.id}  {conv.title!r}: {conv.messages} messages, {conv.leaves} leaves, "
                f"{conv.tool_pairs} tool pairs on the path "
                f"({conv.tool_pairs_elsewhere} elsewhere), {conv.images} images, "
                f"{conv.compaction_markers} compaction markers; tip by {conv.tip_rule}"
            )
            for bucket in ("skipped", "repaired", "flagged"):
                issues = getattr(conv, bucket)
                if len(issues):
                    kinds = ", ".join(f"{k} ×{n}" for k, n in sorted(issues.by_kind.items()))
                    self.stdout.write(f"    {bucket}: {kinds}")
        for bucket in ("skipped", "repaired"):
            for issue in getattr(report, bucket).items:
                self.stdout.write(f"  {bucket} {issue.kind} at {issue.where}: {issue.detail}")
