"""The browser UI (DESIGN.md §7): server-rendered pages with HTMX fragments, one module
per screen.

- ``listing``: the conversation list and search, new and delete
- ``chat`` (with ``chat_presenter``): a branch of the conversation, its versions,
  settings and forks; ``chat_turns``: sending, editing, regenerating, retrying
- ``tree`` (with ``tree_presenter``): the tree as a graph and an outline
- ``compare``, ``checkpoints``, ``imports``, ``account`` (settings and API tokens)
- ``common``: what they share (also compaction/views.py): rendering a page or its
  fragment, the owner-scoped lookups that make another user's object a 404

Each screen is one template with inline partials. Views stay thin: look up through
``common`` (another user's object is a 404 like a missing one), validate with a form,
call one service; what a page shows is put together by its presenter, through the
selectors. conversations/urls.py imports the screen modules directly.
"""

from __future__ import annotations

# The chat's paging sizes, which tests measure the chat against.
from conversations.views.chat_presenter import CHAT_CHUNK, CHAT_FIRST

__all__ = ["CHAT_CHUNK", "CHAT_FIRST"]
