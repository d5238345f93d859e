"""Import and export routes (DESIGN.md §3): ``POST /imports`` and
``GET /conversations/{cid}/export``.

Imports run synchronously for now; the work is one call to
``importers.transcript_import`` with the owner's id and a file path, so a Celery task can
take it over unchanged.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from django.http import HttpRequest, HttpResponse
from ninja import Router, Schema, Status

from conversations import exporters, selectors
from conversations.errors import Conflict
from conversations.importers import ImportTooLarge, Limits, transcript_import
from conversations.importers.base import ImportRejected

router = Router(tags=["imports"])


def _user(request: HttpRequest) -> Any:
    """The user that ninja's authentication attached to the request."""
    return request.auth  # type: ignore[attr-defined]


class IssueOut(Schema):
    kind: str
    where: str
    detail: str


class ConversationImportOut(Schema):
    id: str | None
    source_id: str | None
    title: str
    messages: int
    roots: int
    leaves: int
    tool_calls: int
    tool_results: int
    tool_pairs: int
    tool_pairs_elsewhere: int
    images: int
    compaction_markers: int
    checkpoints: int
    tip: str | None
    tip_rule: str
    sidechain_of: str | None
    spawned_by: str | None
    skipped: list[IssueOut]
    repaired: list[IssueOut]
    flagged: list[IssueOut]


class DuplicateOut(Schema):
    source_key: str
    title: str
    existing: str | None
    existing_title: str


class ImportOut(Schema):
    file: str
    format: str
    conversation_ids: list[str]
    conversations: list[ConversationImportOut]
    truncated: str
    duplicates: list[DuplicateOut]
    skipped: list[IssueOut]
    repaired: list[IssueOut]


def _spool(request: HttpRequest, limit: int) -> tuple[str, str]:
    """Copy the upload to a temporary file: a multipart ``file`` field, or else the raw
    request body (``curl --data-binary @conversations.json``). Returns (path, name)."""
    handle, path = tempfile.mkstemp(prefix="arbor-import-")
    try:
        with os.fdopen(handle, "wb") as out:
            content_type = request.content_type or ""
            if content_type.startswith("multipart/"):
                upload = request.FILES.get("file")
                if upload is None:
                    raise ImportRejected("send the transcript as the multipart field 'file'")
                if upload.size is not None and upload.size > limit:
                    raise ImportTooLarge(f"the file is {upload.size} bytes; the limit is {limit}")
                for chunk in upload.chunks():
                    out.write(chunk)
                return path, upload.name or "upload"
            # Read the body as a stream: the in-memory body limit does not apply, ours does.
            copied = 0
            while chunk := request.read(1 << 20):
                copied += len(chunk)
                if copied > limit:
                    raise ImportTooLarge(f"the upload is larger than the limit of {limit} bytes")
                out.write(chunk)
            return path, "upload"
    except BaseException:
        os.unlink(path)
        raise


@router.post("/imports", response={201: ImportOut})
def import_transcript(
    request: HttpRequest, format: str = "auto", duplicates: str = "skip"
) -> Status[Any]:
    """Import a transcript file: ChatGPT or claude.ai conversations.json, a Claude Code or pi
    session or a Codex CLI rollout (.jsonl), an Open WebUI chat or export, or Arbor JSON.
    Send it as the multipart field ``file`` or as the raw request body; a ``format`` form
    field or ``?format=`` skips detection. Answers 201 with the report and the new
    conversation ids; 422 when the file cannot be read or nothing in it could be imported
    (the report says why).

    A conversation imported before (the same source id: a ChatGPT conversation id, a
    session id) is skipped and listed in the report's ``duplicates`` with the
    conversation it already is; ``?duplicates=copy`` imports it again as a copy. When
    every conversation was skipped so: 409 ``already_imported``."""
    limits = Limits.from_settings()
    fmt = request.POST.get("format") or format
    path, name = _spool(request, limits.max_file_bytes)
    try:
        report = transcript_import(
            owner_id=_user(request).pk,
            path=path,
            format=fmt,
            filename=name,
            limits=limits,
            duplicates=request.POST.get("duplicates") or duplicates,
        )
    finally:
        os.unlink(path)
    if not report.conversations and report.duplicates:
        raise Conflict(
            f"every conversation in the file was imported before "
            f"({len(report.duplicates)}): send ?duplicates=copy to import them again as copies",
            code="already_imported",
            report=report.as_dict(),
        )
    if not report.conversations:
        raise ImportRejected(
            "nothing in the file could be imported",
            code="nothing_imported",
            report=report.as_dict(),
        )
    return Status(201, report.as_dict())


@router.get("/conversations/{cid}/export")
def export_conversation(
    request: HttpRequest,
    cid: str,
    format: str = "arbor",
    tip: str | None = None,
    cwd: str | None = None,
) -> HttpResponse:
    """Download a conversation: ``arbor`` (lossless JSON, re-importable), ``chatgpt``
    (conversations.json with the whole tree), ``markdown`` (the current branch), or a
    session file to resume in a harness: ``claude-code`` (save it as
    ``~/.claude/projects/<cwd, each non-alphanumeric as ->/<session-id>.jsonl``, then
    ``claude --resume <session-id>``) or ``pi`` (``pi --session <file>``). ``tip`` picks
    the branch (default: the conversation's tip); ``cwd`` is the directory the harness
    runs in (default ``/``)."""
    conversation = selectors.conversation_get(user=_user(request), conversation_id=cid)
    export = exporters.conversation_export(
        conversation=conversation, format=format, tip=tip, cwd=cwd
    )
    response = HttpResponse(export.content, content_type=export.content_type)
    response["Content-Disposition"] = f'attachment; filename="{export.filename}"'
    return response
