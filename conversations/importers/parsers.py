"""The parser of each format, by the name ``FORMATS`` lists. Pure: no database.

Each parser reads one file as a stream and yields ``SourceConversation`` objects
(``importers.base``); ``parse(path, report=, limits=)``, and the ChatGPT parser also
takes ``media=`` (the images of an export zip, see ``importers.archive``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from conversations.importers import arbor, chatgpt, claude_code, claudeai, codex, openwebui, pi
from conversations.importers.base import SourceConversation

Parser = Callable[..., Iterator[SourceConversation]]
PARSERS: dict[str, Parser] = {
    "chatgpt": chatgpt.parse,
    "claude-code": claude_code.parse,
    "pi": pi.parse,
    "openwebui": openwebui.parse,
    "arbor": arbor.parse,
    "claudeai": claudeai.parse,
    "codex": codex.parse,
}
