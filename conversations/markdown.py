"""Message text to safe HTML: markdown-it-py (raw HTML off), Pygments for code, then nh3
as the last word on what may reach the page.

Images in markdown never load by themselves: a remote ``![alt](url)`` becomes a link the
user may follow (an image URL is a way to exfiltrate the conversation to a third party).
Uploaded images are separate ``image`` parts served from the blob store.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import nh3
from markdown_it import MarkdownIt
from markdown_it.common.utils import escapeHtml
from markdown_it.renderer import RendererHTML
from markdown_it.token import Token
from markdown_it.utils import EnvType, OptionsDict
from pygments import highlight
from pygments.formatters import HtmlFormatter
from pygments.lexers import TextLexer, get_lexer_by_name
from pygments.util import ClassNotFound

_FORMATTER = HtmlFormatter(nowrap=True)
_SURROGATE = re.compile("[\ud800-\udfff]")

ALLOWED_TAGS = {
    "a", "p", "br", "hr", "em", "strong", "del", "s", "code", "pre", "span", "div",
    "blockquote", "ul", "ol", "li", "h1", "h2", "h3", "h4", "h5", "h6",
    "table", "thead", "tbody", "tr", "th", "td",
}  # fmt: skip
ALLOWED_ATTRIBUTES = {
    "a": {"href", "title", "class"},
    "code": {"class"},
    "span": {"class"},
    "div": {"class"},
    "pre": {"class"},
    "ol": {"start"},
}
URL_SCHEMES = {"http", "https", "mailto"}


def _highlight(code: str, lang: str, _attrs: str) -> str:
    try:
        lexer = get_lexer_by_name(lang) if lang else TextLexer()
    except ClassNotFound:
        lexer = TextLexer()
    return str(highlight(code, lexer, _FORMATTER))


def _image_as_link(
    self: RendererHTML, tokens: Sequence[Token], idx: int, options: OptionsDict, env: EnvType
) -> str:
    token = tokens[idx]
    src = str(token.attrGet("src") or "")
    alt = self.renderInlineAsText(token.children or [], options, env) or "image"
    return f'<a href="{escapeHtml(src)}" class="remote-image">[image: {escapeHtml(alt)}]</a>'


def _parser() -> MarkdownIt:
    md = MarkdownIt("commonmark", {"html": False, "highlight": _highlight, "breaks": True})
    md.enable(["table", "strikethrough"])
    md.add_render_rule("image", _image_as_link)
    return md


_MD = _parser()


def sanitize(html: str) -> str:
    return nh3.clean(
        html,
        tags=ALLOWED_TAGS,
        attributes=ALLOWED_ATTRIBUTES,
        url_schemes=URL_SCHEMES,
        link_rel="noopener noreferrer nofollow",
    )


class _ByteBoundedCache:
    """An LRU of rendered HTML bounded by the characters it holds (keys and values), not
    by entries: a few huge messages cannot pin hundreds of MB. Texts over
    ``max_item`` are rendered every time and never kept."""

    def __init__(self, max_chars: int, max_item: int) -> None:
        self.max_chars = max_chars
        self.max_item = max_item
        self.items: OrderedDict[str, str] = OrderedDict()
        self.size = 0
        self.lock = threading.Lock()

    def get(self, key: str) -> str | None:
        with self.lock:
            value = self.items.get(key)
            if value is not None:
                self.items.move_to_end(key)
            return value

    def put(self, key: str, value: str) -> None:
        cost = len(key) + len(value)
        if cost > self.max_item:
            return
        with self.lock:
            if key in self.items:
                return
            self.items[key] = value
            self.size += cost
            while self.size > self.max_chars and self.items:
                old_key, old_value = self.items.popitem(last=False)
                self.size -= len(old_key) + len(old_value)


_CACHE = _ByteBoundedCache(max_chars=16_000_000, max_item=400_000)


def render(text: str) -> str:
    """Markdown → sanitised HTML. Cached (bounded in size): messages are immutable, so
    equal text always renders the same."""
    cached = _CACHE.get(text)
    if cached is None:
        # A lone surrogate (half an emoji, which an older Arbor stored on SQLite) is not
        # text: nh3 refuses it and no page could be encoded with it.
        cached = sanitize(_MD.render(_SURROGATE.sub("\ufffd", text)))
        _CACHE.put(text, cached)
    return cached


def pygments_css(selector: str = ".md pre") -> str:
    """The stylesheet behind static/pygments.css (regenerate it with this; a test checks
    the file is what this writes): Pygments' default colours, and GitHub's dark ones
    under ``prefers-color-scheme: dark``. The code box's own background is left to
    arbor.css (its --code-bg token), so a block and its highlighting change together."""

    def rules(style: str) -> list[str]:
        css: Any = HtmlFormatter(style=style).get_style_defs(selector)
        return [
            line
            for line in str(css).splitlines()
            if line.startswith(f"{selector} .")  # the token rules only
        ]

    light = "\n".join(rules("default"))
    dark = "\n".join(f"  {line}" for line in rules("github-dark"))
    return (
        "/* Generated by conversations.markdown.pygments_css(). */\n"
        f"{light}\n@media (prefers-color-scheme: dark) {{\n{dark}\n}}\n"
    )
