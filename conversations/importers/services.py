"""Importing a transcript file into the database: ``transcript_import``, the one entry
point (see the package docstring). This module and ``importers.writer`` are the Django
side of the package; the parsers and the tree builder they call are pure.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.contrib.auth import get_user_model
from django.db import DatabaseError, transaction

from conversations.errors import ArborError, InvalidInput
from conversations.importers.archive import is_archive, open_archive
from conversations.importers.base import (
    FORMATS,
    ConversationReport,
    ImportRejected,
    ImportReport,
    ImportTooLarge,
    Limits,
)
from conversations.importers.chatgpt import Media
from conversations.importers.parsers import PARSERS
from conversations.importers.reading import detect_format
from conversations.importers.tree import SkipConversation, build
from conversations.importers.writer import Calls, conversation_write

Progress = Callable[[ConversationReport], Any]
DUPLICATES = ("skip", "copy")


def check_duplicates(value: str) -> None:
    """InvalidInput unless ``value`` says what to do with conversations imported before."""
    if value not in DUPLICATES:
        raise InvalidInput(
            f"duplicates must be one of {list(DUPLICATES)}, not {value!r}", code="bad_duplicates"
        )


def source_key(fmt: str, source_id: str | None) -> str:
    """Where a conversation came from, as ``Conversation.source_key`` keeps it."""
    return f"{fmt}:{source_id}"[:300] if source_id else ""


@dataclass
class _Import:
    """One import's settings and what its files share."""

    owner: Any
    progress: Progress | None
    limits: Limits
    # "skip": a conversation whose source key the owner already has is not imported
    # again (the report lists it); "copy": it is imported as another conversation.
    duplicates: str
    # Only these source keys (None: every conversation of the file).
    only: Collection[str] | None
    # The owner's imported conversations (source key → id, title) before this import
    # began: conversations of one file that share a key are all imported (they are not
    # copies of an earlier import).
    known: dict[str, tuple[str, str]] = field(default_factory=dict)
    calls: Calls = field(default_factory=dict)


def transcript_import(
    *,
    owner_id: Any,
    path: str | Path,
    format: str = "auto",
    filename: str | None = None,
    progress: Progress | None = None,
    limits: Limits | None = None,
    duplicates: str = "skip",
    only: Collection[str] | None = None,
) -> ImportReport:
    """Import every conversation of one file for one user and report on it.

    A conversation imported before (the same source id in the same format) is skipped
    and listed in ``report.duplicates`` with the conversation it already is; with
    ``duplicates="copy"`` it is imported again as a copy. ``only`` limits the import to
    those source keys (to copy just the ones an earlier import skipped).

    Raises ImportRejected (422) when the file cannot be read at all (unknown format, not
    JSON) and ImportTooLarge (413) when it is over the size limit; everything else —
    corrupt entries, a conversation over the message limit, repairs — is in the report.
    """
    limits = limits or Limits.from_settings()
    path = Path(path)
    user_model = get_user_model()
    try:
        owner = user_model._default_manager.get(pk=owner_id)
    except user_model.DoesNotExist:
        raise InvalidInput(f"no such user: {owner_id}", code="unknown_user") from None
    if format != "auto" and format not in FORMATS:
        raise InvalidInput(
            f"format must be auto or one of {list(FORMATS)}, not {format!r}", code="bad_format"
        )
    check_duplicates(duplicates)
    run = _Import(owner, progress, limits, duplicates, only, known=_imported(owner))
    if path.is_dir():  # a project folder (the command line): read like an archive
        return _import_archive(run, path, filename or path.name, format)
    size = path.stat().st_size
    if size > limits.max_file_bytes:
        raise ImportTooLarge(
            f"the file is {size} bytes; the import limit is {limits.max_file_bytes}"
        )
    if size == 0:
        raise ImportRejected("the file is empty", code="empty_file")
    if is_archive(path):
        return _import_archive(run, path, filename or path.name, format)
    fmt = detect_format(path, limits=limits) if format == "auto" else format
    report = ImportReport(file=filename or path.name, format=fmt)
    _import_file(run, path, fmt, report)
    return report


def _imported(owner: Any) -> dict[str, tuple[str, str]]:
    """The owner's imported conversations by source key: (id, title) of the newest."""
    from conversations.models import Conversation

    found: dict[str, tuple[str, str]] = {}
    rows = (
        Conversation.objects.filter(owner=owner)
        .exclude(source_key="")
        .order_by("created_at")
        .values_list("source_key", "id", "title")
    )
    for key, pk, title in rows.iterator():
        found[key] = (str(pk), title)
    return found


def _import_file(
    run: _Import,
    path: Path,
    fmt: str,
    report: ImportReport,
    *,
    spawned_by_call: str | None = None,
    spawned_title: str = "",
    media: Media | None = None,
) -> None:
    """Parse, build and write the conversations of one transcript file into ``report``;
    ``run.calls`` links sub-agents to their calls across the files of one import."""
    limits = run.limits
    parse = PARSERS[fmt]
    sources = (
        parse(path, report=report, limits=limits, media=media)
        if media
        else parse(path, report=report, limits=limits)
    )
    for source in sources:
        label = f"conversation {source.source_id or source.title or len(report.conversations)}"
        if len(report.conversations) >= limits.max_conversations:
            report.skipped.add(
                "limit",
                label,
                f"a file may hold at most {limits.max_conversations} conversations: "
                "this one and the rest were not imported",
            )
            break
        key = source_key(fmt, source.source_id)
        if run.only is not None and key not in run.only:
            continue
        if key in run.known and run.duplicates == "skip":
            existing, existing_title = run.known[key]
            report.duplicates.append(
                {
                    "source_key": key,
                    "title": source.title,
                    "existing": existing,
                    "existing_title": existing_title,
                }
            )
            continue
        if spawned_by_call and source.report.sidechain_of is not None:
            source.spawned_by_call = spawned_by_call
            if spawned_title:
                source.title = f"Sub-agent: {spawned_title}"
        try:
            built = build(source, limits)
            # The progress line commits with the conversation: a process killed between
            # the two never leaves a conversation its job does not report.
            with transaction.atomic():
                conversation_write(owner=run.owner, built=built, calls=run.calls, source_key=key)
                if run.progress is not None:
                    run.progress(source.report)
        except SkipConversation as exc:
            report.skipped.add("conversation", label, f"not imported: {exc}")
            continue
        except (ArborError, DatabaseError) as exc:
            # The conversation's transaction rolled back: nothing of it was written.
            report.skipped.add("conversation", label, f"not imported: {exc}")
            continue
        report.conversations.append(source.report)


def _import_archive(run: _Import, path: Path, filename: str, format: str) -> ImportReport:
    """Every transcript of a zip archive (see importers.archive), in one report: the
    format names what the archive held; a member that cannot be read is skipped with
    its reason, the others are imported."""
    limits = run.limits
    found = open_archive(path, limits)
    report = ImportReport(file=filename, format="zip")
    formats: list[str] = []
    try:
        media = found.media if found.is_chatgpt else None
        for member in found.transcripts():
            if member.path is None:
                report.skipped.add("file", member.name, f"not imported: {member.error}")
                continue
            try:
                fmt = detect_format(member.path, limits=limits) if format == "auto" else format
            except ImportRejected as exc:
                report.skipped.add("file", member.name, f"not imported: {exc.detail}")
                continue
            if fmt not in formats:
                formats.append(fmt)
            before = len(report.conversations) + len(report.duplicates)
            try:
                _import_file(
                    run,
                    member.path,
                    fmt,
                    report,
                    spawned_by_call=member.spawned_by_call,
                    spawned_title=member.description,
                    media=media if fmt == "chatgpt" else None,
                )
            except (ImportRejected, ImportTooLarge) as exc:
                # One unreadable member (cut, too large) does not stop the others; what
                # it wrote before the error is kept and counted.
                report.skipped.add("file", member.name, f"not imported: {exc.detail}")
                continue
            if len(report.conversations) + len(report.duplicates) == before:
                report.skipped.add("file", member.name, "no conversation in it was imported")
    finally:
        found.close()
    if not formats:
        raise ImportRejected(
            "the archive holds no transcript this importer reads", code="unknown_format"
        )
    report.format = "zip: " + ", ".join(formats)
    return report
