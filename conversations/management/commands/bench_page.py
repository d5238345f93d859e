"""``manage.py bench_page``: the weight and speed of a 1,000-message chat in Chromium.

Builds a chain of ``--messages`` messages for a throwaway user, starts the `make run`
server (uvicorn) on this command's database, signs in with Debian's Chromium (Playwright)
and opens the chat ``--repeat`` times at 1280 and at 390 px, each in a fresh browser
context (a cold cache: the page and its static files are all fetched). Prints one JSON
object: the HTML's bytes, everything transferred, the page's elements, and the medians
of the navigation timings (``domInteractive`` is the time to interactive: the page's
script is deferred, and the chat needs nothing else to be used), with #15's goals
(≤ 150 KB, ≤ 1.5 s). The user and the chat are deleted at the end.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import statistics
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.core.management.base import BaseCommand, CommandParser

from conversations import services
from conversations.management.liveserver import uvicorn
from conversations.models import Conversation

BENCH_USERNAME = "__arbor_bench_page__"
GOAL_BYTES = 150_000
GOAL_INTERACTIVE_MS = 1500
CHROMIUM = os.environ.get("ARBOR_CHROMIUM", "/usr/bin/chromium")
VIEWPORTS = {"1280": (1280, 900), "390": (390, 844)}

TIMINGS = """() => {
  const n = performance.getEntriesByType('navigation')[0];
  const resources = performance.getEntriesByType('resource');
  return {
    interactive_ms: n.domInteractive,
    content_loaded_ms: n.domContentLoadedEventEnd,
    load_ms: n.loadEventEnd,
    transferred_bytes: n.transferSize + resources.reduce((s, r) => s + r.transferSize, 0),
    resources: resources.length,
    elements: document.getElementsByTagName('*').length,
  };
}"""


def chat_chain(owner: User, messages: int, *, title: str = "A thousand messages") -> Any:
    """A conversation of ``messages`` alternating user and assistant messages, each a
    line of markdown with code: what a long chat's page has to carry."""
    conv = services.conversation_create(owner=owner, title=title)
    parent = None
    for start in range(0, messages, 200):
        result = services.turn_append(
            conversation=conv,
            parent_id=parent,
            expected_version=None,
            messages=[
                {
                    "role": "user" if i % 2 == 0 else "assistant",
                    "parts": [
                        {
                            "type": "text",
                            "text": f"Message {i}: " + "a line of **markdown** with `code` " * 4,
                        }
                    ],
                }
                for i in range(start, min(messages, start + 200))
            ],
        )
        parent = result.message_ids[-1]
    return conv


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 1)


class Command(BaseCommand):
    help = (
        "Open a 1,000-message chat in Chromium against the `make run` server and print "
        "its page weight and time to interactive (one JSON object)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--messages", type=int, default=1000)
        parser.add_argument("--repeat", type=int, default=5)

    def handle(self, *args: Any, **options: Any) -> None:
        if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
            self.stdout.write(json.dumps({"bench_page": f"skipped: no Chromium at {CHROMIUM}"}))
            return
        users = get_user_model().objects
        users.filter(username=BENCH_USERNAME).delete()
        password = secrets.token_urlsafe(16)
        user = users.create_user(BENCH_USERNAME, password=password)
        conv = chat_chain(user, options["messages"])
        env = dict(os.environ, ALLOWED_HOSTS="127.0.0.1", ARBOR_INPROCESS_JOBS="thread")
        try:
            with uvicorn(env) as port:
                views = self._measure(port, password, conv, options["repeat"])
        finally:
            for conversation in Conversation.objects.filter(owner=user):
                services.conversation_delete(conversation=conversation)
            user.delete()
        result = {
            "bench_page": {
                "messages": options["messages"],
                "repeat": options["repeat"],
                "goal": {"bytes": GOAL_BYTES, "interactive_ms": GOAL_INTERACTIVE_MS},
                **views,
                "met": all(
                    v["html_bytes"] <= GOAL_BYTES and v["interactive_ms"] <= GOAL_INTERACTIVE_MS
                    for v in views.values()
                ),
            }
        }
        self.stdout.write(json.dumps(result))

    def _measure(self, port: int, password: str, conv: Conversation, repeat: int) -> dict[str, Any]:
        from playwright.sync_api import sync_playwright

        base = f"http://127.0.0.1:{port}"
        views: dict[str, Any] = {}
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
            )
            # Signed in once; every measured load then starts a fresh context with the
            # session cookie only, so nothing comes from a cache.
            context = browser.new_context()
            page = context.new_page()
            page.goto(f"{base}/login/")
            page.fill("input[name=username]", BENCH_USERNAME)
            page.fill("input[name=password]", password)
            page.click("button:has-text('Sign in')")
            page.wait_for_url(f"{base}/")
            # Each as the context wants to be given it: name, value, domain and path.
            cookies: list[Any] = [
                {k: c[k] for k in ("name", "value", "domain", "path")}  # type: ignore[literal-required]
                for c in context.cookies()
            ]
            context.close()
            for name, (width, height) in VIEWPORTS.items():
                runs = []
                for _ in range(repeat):
                    fresh = browser.new_context(viewport={"width": width, "height": height})
                    fresh.add_cookies(cookies)
                    page = fresh.new_page()
                    response = page.goto(f"{base}/c/{conv.pk}/", wait_until="load")
                    assert response is not None and response.ok, response
                    runs.append({"html_bytes": len(response.body()), **page.evaluate(TIMINGS)})
                    fresh.close()
                views[name] = {
                    "html_bytes": runs[0]["html_bytes"],
                    "transferred_bytes": runs[0]["transferred_bytes"],
                    "elements": runs[0]["elements"],
                    "resources": runs[0]["resources"],
                    **{
                        key: _median([r[key] for r in runs])
                        for key in ("interactive_ms", "content_loaded_ms", "load_ms")
                    },
                }
            browser.close()
        return views
