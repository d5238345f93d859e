"""Import transcripts from other tools (and Arbor's own lossless JSON).

``transcript_import`` is the one entry point: it takes ids and a path (so a Celery task
can wrap it as it is), reads the file as a stream, and writes each conversation in its
own transaction: a conversation is imported whole or not at all, and the report lists
what was imported and every item skipped, repaired or flagged, with the reason.

The rooms: ``base`` (the report, limits, node shape, part constructors), ``reading``
(streaming JSON and format detection), one module per format (``chatgpt``,
``claude_code``, ``pi``, ``openwebui``, ``arbor``, ``claudeai``, ``codex``) listed in
``parsers``, ``archive`` (zips and folders), ``tree`` (repairs and ordering), then the
Django side: ``writer`` (the rows) and ``services`` (``transcript_import``). Everything
before the Django side is pure, so a script or a test can parse a file without Django.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from conversations.lazy import lazy_getattr

if TYPE_CHECKING:
    from conversations.importers.base import (
        FORMATS,
        ConversationReport,
        ImportRejected,
        ImportReport,
        ImportTooLarge,
        Limits,
    )
    from conversations.importers.parsers import PARSERS
    from conversations.importers.services import transcript_import

# Loaded on first use (PEP 562): importing one parser (``conversations.importers.pi``)
# runs this file first, and it must not pull in the writer and with it Django.
_LAZY = {
    "FORMATS": "conversations.importers.base",
    "ConversationReport": "conversations.importers.base",
    "ImportRejected": "conversations.importers.base",
    "ImportReport": "conversations.importers.base",
    "ImportTooLarge": "conversations.importers.base",
    "Limits": "conversations.importers.base",
    "PARSERS": "conversations.importers.parsers",
    "transcript_import": "conversations.importers.services",
}


__getattr__ = lazy_getattr(__name__, globals(), _LAZY)


__all__ = [
    "FORMATS",
    "PARSERS",
    "ConversationReport",
    "ImportRejected",
    "ImportReport",
    "ImportTooLarge",
    "Limits",
    "transcript_import",
]
