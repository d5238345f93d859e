"""Message text to safe HTML: markdown-it-py (raw HTML off), Pygments for code, then nh3
as the last word on what may reach the page.

Images in markdown never load by themselves: a remote ``![alt](url)`` becomes a link the
user may follow (an image URL is a way to exfiltrate the conversation to a third party).
Uploaded images are separate ``image`` parts served from the blob store.
"""

from __future__ import annotations

import io
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
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

# Pygments' lexers are regexes, and most common ones are quadratic on some input (Python
# on blank lines, TypeScript on ``a.a.a.``, C# on short lines: 20 KB took 2-35 s), which a
# code block's language lets anyone choose. So each render has a CPU budget for
# highlighting: tokens are drawn from the lexer and, once the budget is spent, the block
# (and every later one) is shown plain. That bounds the lexers whose every step is one
# linear regex scan: the ones below, each measured so (60 KB of 33 adversarial texts
# rendered within the budget). In some others one step is itself quadratic or cubic
# (console, ini, ocaml, matlab, maple, zeek: 60 KB took 16-35 s in one regex call, out
# of the budget's reach), so any other language is highlighted only in a short block.
HIGHLIGHT_BUDGET_SECONDS = 0.25
HIGHLIGHT_MAX_CHARS = 100_000
HIGHLIGHT_OTHER_MAX_CHARS = 2_000
HIGHLIGHT_LEXERS = frozenset({  # each lexer's first alias
    "apacheconf", "awk", "bash", "batch", "c", "clojure", "cmake", "cobol", "coffeescript",
    "common-lisp", "cpp", "cr", "csharp", "css", "d", "dart", "diff", "django", "docker",
    "elixir", "elm", "erlang", "fortran", "fsharp", "go", "graphql", "groovy",
    "handlebars", "haskell", "html", "http", "java", "javascript", "json", "json5",
    "jsonld", "jsx", "julia", "kotlin", "less", "liquid", "lua", "make", "markdown",
    "nasm", "nginx", "nimrod", "nixos", "objective-c", "perl", "php", "powershell",
    "prolog", "properties", "protobuf", "purescript", "pycon", "pytb", "python", "python2",
    "racket", "ruby", "rust", "sass", "scala", "scheme", "scss", "solidity", "splus",
    "sql", "swift", "tcl", "terraform", "tex", "text", "toml", "tsx", "twig", "typescript",
    "verilog", "vhdl", "vim", "vue", "xml", "yaml", "zig",
})  # fmt: skip
_budget = threading.local()


class _OverBudget(Exception):
    pass


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


def _plain(code: str) -> str:
    return str(highlight(code, TextLexer(), _FORMATTER))


def _within_budget(tokens: Iterable[tuple[Any, str]], deadline: float) -> Iterator[Any]:
    for count, token in enumerate(tokens):
        if count % 16 == 0 and time.thread_time() > deadline:
            raise _OverBudget
        yield token


def _highlight(code: str, lang: str, _attrs: str) -> str:
    deadline: float = getattr(_budget, "deadline", 0.0)
    if not lang or len(code) > HIGHLIGHT_MAX_CHARS or time.thread_time() > deadline:
        return _plain(code)
    try:
        lexer = get_lexer_by_name(lang)
    except ClassNotFound:
        return _plain(code)
    if lexer.aliases[0] not in HIGHLIGHT_LEXERS and len(code) > HIGHLIGHT_OTHER_MAX_CHARS:
        return _plain(code)
    out = io.StringIO()
    try:
        _FORMATTER.format(_within_budget(lexer.get_tokens(code), deadline), out)
    except _OverBudget:
        return _plain(code)
    return out.getvalue()


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
        _budget.deadline = time.thread_time() + HIGHLIGHT_BUDGET_SECONDS
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
