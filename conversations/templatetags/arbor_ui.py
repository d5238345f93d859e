"""Template filters for the browser UI."""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

from django import template
from django.urls import reverse
from django.utils.html import escape, format_html
from django.utils.safestring import SafeString, mark_safe

from conversations import markdown, selectors

register = template.Library()


# The chat renders at most this many characters of one text part and this many parts
# of one message; the rest is behind "Show all" (the message as plain text).
RENDER_MAX_CHARS = 60_000
RENDER_MAX_PARTS = 200


@register.filter
def render_markdown(text: Any) -> SafeString:
    """Markdown → HTML that went through nh3 (conversations.markdown); a text over
    RENDER_MAX_CHARS is rendered up to there (see ``is_long``)."""
    text = str(text or "")
    return mark_safe(markdown.render(text[:RENDER_MAX_CHARS]))  # sanitised by nh3


@register.filter
def head(text: Any) -> str:
    """The part of a long text the chat shows (a tool result's output, as-is)."""
    return str(text or "")[:RENDER_MAX_CHARS]


@register.filter
def is_long(text: Any) -> bool:
    return len(str(text or "")) > RENDER_MAX_CHARS


@register.filter
def first_parts(parts: Any, whole: Any = False) -> Any:
    """The parts the chat shows (the rest is behind "Show all"); every part when
    ``whole`` (the compaction record shows what the model saw in full)."""
    if whole or not isinstance(parts, list):
        return parts
    return parts[:RENDER_MAX_PARTS]


@register.filter
def parts_left_out(parts: Any) -> int:
    return max(0, len(parts) - RENDER_MAX_PARTS) if isinstance(parts, list) else 0


@register.filter
def rung_names(rungs: Any) -> str:
    """The rungs a compaction record applied, by name, in order ("elision, snapshot")."""
    if not isinstance(rungs, list):
        return ""
    return ", ".join(str(r.get("rung", "")) for r in rungs if isinstance(r, dict))


class _Record(Protocol):
    """What blob_url needs of a compaction record (conversations does not import the
    compaction app: it depends on this one)."""

    pk: Any
    conversation_id: Any


@register.simple_tag
def blob_url(sha256: str, record: _Record | None = None, scope: str = "owner") -> str:
    """Where a page loads image ``sha256`` from. In a conversation, the blob API (it
    serves a blob to the users who uploaded it); on a compaction ``record``'s page, the
    record's own blob view, which serves only the images that record shows: the
    owner's, or staff's with ``scope="audit"``."""
    if not record:
        return reverse("api:get_blob", args=[sha256])
    if scope == "audit":
        return reverse("compaction:audit_blob", args=[record.pk, sha256])
    return reverse("compaction:record_blob", args=[record.conversation_id, record.pk, sha256])


@register.simple_tag
def message_url(conversation_id: Any, message_id: Any) -> str:
    """The chat view of the branch through a message, scrolled to it: the link every
    page uses to show one message (the chat selects ``?m=`` and marks it found)."""
    url = reverse("conversations:detail", args=[conversation_id])
    return f"{url}?m={message_id}#msg-{message_id}"


@register.filter
def pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)


@register.filter
def preview(parts: Any, limit: int = 80) -> str:
    """A one-line preview of a message's parts (selectors.preview)."""
    return selectors.preview(parts if isinstance(parts, list) else [], int(limit))


@register.filter
def prompt_text(parts: Any) -> str:
    """The text parts of a message, joined (what an edit starts from)."""
    if not isinstance(parts, list):
        return ""
    return "\n".join(
        p.get("text", "") for p in parts if isinstance(p, dict) and p.get("type") == "text"
    )


@register.filter
def match_pieces(text: Any, query: Any) -> list[tuple[str, bool]]:
    """Split plain text around the case-insensitive occurrences of a search query, as
    (piece, is_match) pairs: the template escapes each piece and wraps matches in
    <mark>, so no HTML is ever built from the user's text here. Whitespace in the query
    matches any run of whitespace, as the search does."""
    text, words = str(text or ""), str(query or "").split()
    if not words:
        return [(text, False)] if text else []
    pattern = re.compile(r"\s+".join(re.escape(w) for w in words), re.IGNORECASE)
    pieces: list[tuple[str, bool]] = []
    end = 0
    for found in pattern.finditer(text):
        if found.start() > end:
            pieces.append((text[end : found.start()], False))
        pieces.append((found.group(), True))
        end = found.end()
    if end < len(text):
        pieces.append((text[end:], False))
    return pieces


def web_url(value: Any) -> str:
    """``value`` when it is an http(s) URL, else "" (imported links never run scripts)."""
    url = str(value or "").strip()
    return url if re.match(r"https?://[^\s\"'<>]+$", url, re.IGNORECASE) else ""


register.filter("web_url", web_url)


# What a citation marker looks like: ChatGPT's 【6†source】 or the private-use
# \ue200…\ue201 form. Anything else is not treated as a marker.
_MARKER = re.compile(r"^(【[^【】<>]{1,80}】|\ue200[^\ue200\ue201<>]{1,80}\ue201)$")
_TAG = re.compile(r"(<[^>]*>)")


@register.filter
def cite_links(html: Any, citations: Any) -> SafeString:
    """Citation markers an imported answer holds (``【6†source】``) become numbered links
    to the page each cites (``metadata.citations``, see importers.chatgpt). ``html`` is
    already sanitised: markers are replaced in its text only (never inside a tag or an
    existing link), only strings shaped like markers count, and only http(s) URLs are
    linked."""
    links: dict[str, str] = {}
    numbers: dict[str, int] = {}
    for citation in citations if isinstance(citations, list) else []:
        if not isinstance(citation, dict):
            continue
        marker, url = str(citation.get("marker") or ""), web_url(citation.get("url"))
        if not url or not _MARKER.match(marker) or escape(marker) in links:
            continue
        number = numbers.setdefault(url, len(numbers) + 1)
        links[escape(marker)] = format_html(
            '<a class="cite" href="{}" title="{}" rel="noopener noreferrer nofollow">[{}]</a>',
            url,
            citation.get("title") or url,
            number,
        )
    if not links:
        return mark_safe(str(html))
    out: list[str] = []
    in_link = 0
    for piece in _TAG.split(str(html)):
        if piece.startswith("<"):
            if re.match(r"<a[\s>]", piece):
                in_link += 1
            elif piece.startswith("</a"):
                in_link = max(0, in_link - 1)
        elif not in_link:
            for marker, link in links.items():
                piece = piece.replace(marker, link)
        out.append(piece)
    return mark_safe("".join(out))
