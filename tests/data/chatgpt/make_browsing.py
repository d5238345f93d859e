"""Writes browsing.json: a ChatGPT export of two browsing conversations, shaped after
real exports (the 2023 `browser` tool: `search`, `mclick`, `tether_browsing_display`,
`tether_quote`, `_cite_metadata`, `metadata.citations` with 【n†source】 markers; and
the 2024+ `web` tool's `content_references`). Run: python3 make_browsing.py"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

T0 = 1_700_000_000.0


def node(
    key: str,
    parent: str | None,
    children: list[str],
    role: str,
    content: dict[str, Any],
    *,
    name: str | None = None,
    recipient: str = "all",
    meta: dict[str, Any] | None = None,
    t: float = 0,
) -> dict[str, Any]:
    author: dict[str, Any] = {"role": role, "name": name, "metadata": {}}
    return {
        "id": key,
        "parent": parent,
        "children": children,
        "message": {
            "id": key,
            "author": author,
            "create_time": T0 + t,
            "update_time": None,
            "content": content,
            "status": "finished_successfully",
            "end_turn": None,
            "weight": 1.0,
            "metadata": meta or {},
            "recipient": recipient,
        },
    }


PAGES = [
    {
        "title": "Django documentation",
        "url": "https://docs.djangoproject.com/en/5.2/",
        "text": "Django makes it easier to build better web apps more quickly.",
    },
    {
        "title": "Flask documentation",
        "url": "https://flask.palletsprojects.com/",
        "text": "Flask is a lightweight WSGI web application framework.",
    },
    {
        "title": "FastAPI",
        "url": "https://fastapi.tiangolo.com/",
        "text": "FastAPI is a modern, fast web framework for building APIs.",
    },
    {
        "title": "Python web frameworks compared",
        "url": "https://example.org/frameworks",
        "text": "A comparison of Django, Flask and FastAPI in 2023.",
    },
]
listing = "\n".join(
    f"【{i}†{p['title']}†{p['url'].split('/')[2]}】\n{p['text']}" for i, p in enumerate(PAGES)
)
answer = (
    "Django ships an ORM, admin and auth out of the box【6†source】, while Flask stays "
    "small and lets you pick the parts【7†source】."
)
marks = [answer.index("【6†source】"), answer.index("【7†source】")]
citations = [
    {
        "start_ix": marks[0],
        "end_ix": marks[0] + len("【6†source】"),
        "citation_format_type": "tether_og",
        "metadata": {
            "type": "webpage",
            **PAGES[0],
            "pub_date": None,
            "extra": {"cited_message_idx": 6, "evidence_text": "source"},
        },
    },
    {
        "start_ix": marks[1],
        "end_ix": marks[1] + len("【7†source】"),
        "citation_format_type": "tether_og",
        "metadata": {
            "type": "webpage",
            **PAGES[3],
            "pub_date": None,
            "extra": {"cited_message_idx": 7, "evidence_text": "source"},
        },
    },
]


def quote(p: dict[str, Any]) -> dict[str, Any]:
    return {
        "content_type": "tether_quote",
        "url": p["url"],
        "domain": p["url"].split("/")[2],
        "text": p["text"] + " (full page text)",
        "title": p["title"],
        "tether_id": None,
    }


old = {
    "title": "Python web frameworks",
    "create_time": T0,
    "update_time": T0 + 60,
    "current_node": "a-final",
    "conversation_id": "browse-2023",
    "id": "browse-2023",
    "mapping": {
        "root": {"id": "root", "message": None, "parent": None, "children": ["u1"]},
        "u1": node(
            "u1",
            "root",
            ["a-search"],
            "user",
            {"content_type": "text", "parts": ["Which Python web framework should I use?"]},
        ),
        "a-search": node(
            "a-search",
            "u1",
            ["t-search"],
            "assistant",
            {
                "content_type": "code",
                "language": "unknown",
                "text": 'search("python web framework comparison 2023")',
            },
            recipient="browser",
            t=1,
            meta={"model_slug": "gpt-4-browsing"},
        ),
        "t-search": node(
            "t-search",
            "a-search",
            ["a-click"],
            "tool",
            {
                "content_type": "tether_browsing_display",
                "result": listing,
                "summary": None,
                "assets": None,
                "tether_id": None,
            },
            name="browser",
            t=2,
            meta={
                "_cite_metadata": {
                    "citation_format": {"name": "tether_og"},
                    "metadata_list": [dict(type="webpage", **p) for p in PAGES],
                    "original_query": None,
                },
                "command": "search",
                "status": "finished",
            },
        ),
        "a-click": node(
            "a-click",
            "t-search",
            ["t-q0"],
            "assistant",
            {"content_type": "code", "language": "unknown", "text": "mclick([0, 3])"},
            recipient="browser",
            t=3,
            meta={"model_slug": "gpt-4-browsing"},
        ),
        "t-q0": node(
            "t-q0",
            "a-click",
            ["t-q3"],
            "tool",
            quote(PAGES[0]),
            name="browser",
            t=4,
            meta={"command": "mclick", "args": [[0, 3]], "status": "finished"},
        ),
        "t-q3": node(
            "t-q3",
            "t-q0",
            ["a-final"],
            "tool",
            quote(PAGES[3]),
            name="browser",
            t=5,
            meta={"command": "mclick", "args": [[0, 3]], "status": "finished"},
        ),
        "a-final": node(
            "a-final",
            "t-q3",
            [],
            "assistant",
            {"content_type": "text", "parts": [answer]},
            t=6,
            meta={
                "model_slug": "gpt-4-browsing",
                "citations": citations,
                "_cite_metadata": {
                    "citation_format": {"name": "tether_og"},
                    "metadata_list": [
                        {"type": "webpage", **PAGES[0]},
                        {"type": "webpage", **PAGES[3]},
                    ],
                },
            },
        ),
    },
}
MARK = "\ue200cite\ue202turn0search0\ue201"
new_answer = f"Django 5.2 is the current LTS release {MARK}."
new = {
    "title": "Django LTS",
    "create_time": T0 + 1000,
    "update_time": T0 + 1060,
    "current_node": "n-final",
    "conversation_id": "browse-2025",
    "id": "browse-2025",
    "mapping": {
        "root": {"id": "root", "message": None, "parent": None, "children": ["n-u"]},
        "n-u": node(
            "n-u",
            "root",
            ["n-final"],
            "user",
            {"content_type": "text", "parts": ["What is the current Django LTS?"]},
            t=1000,
        ),
        "n-final": node(
            "n-final",
            "n-u",
            [],
            "assistant",
            {"content_type": "text", "parts": [new_answer]},
            t=1001,
            meta={
                "model_slug": "gpt-4o",
                "content_references": [
                    {
                        "matched_text": MARK,
                        "start_idx": new_answer.index(MARK),
                        "end_idx": new_answer.index(MARK) + len(MARK),
                        "type": "grouped_webpages",
                        "items": [
                            {
                                "title": "Django 5.2 release notes",
                                "url": "https://docs.djangoproject.com/en/5.2/releases/5.2/",
                                "attribution": "djangoproject.com",
                            }
                        ],
                    }
                ],
            },
        ),
    },
}
Path(__file__).with_name("browsing.json").write_text(
    json.dumps([old, new], ensure_ascii=False, indent=1)
)
