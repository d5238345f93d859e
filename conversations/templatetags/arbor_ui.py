"""Template filters for the browser UI."""

from __future__ import annotations

import json
from typing import Any

from django import template
from django.utils.safestring import SafeString, mark_safe

from conversations import markdown

register = template.Library()


@register.filter
def render_markdown(text: Any) -> SafeString:
    """Markdown → HTML that went through nh3 (conversations.markdown)."""
    return mark_safe(markdown.render(str(text or "")))  # sanitised by nh3


@register.filter
def pretty_json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)


@register.filter
def plain_text(parts: Any) -> str:
    """The text parts of a message, joined (what an edit starts from)."""
    if not isinstance(parts, list):
        return ""
    return "\n".join(
        p.get("text", "") for p in parts if isinstance(p, dict) and p.get("type") == "text"
    )
