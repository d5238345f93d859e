"""Every main page at a phone's width (390×844, touch) and at a desktop's (1280×800):
the page never scrolls sideways (wide code and tables scroll inside their own box), the
main actions sit inside the screen and, on the phone, are big enough for a finger. Then
one whole chat flow on the phone: send, watch the answer stream, switch versions.

Same browser set-up as tests/test_browser_ui.py (skips locally without Chromium, fails
on CI). Screenshots go to var/screenshots/phone-<page>.png and desktop-<page>.png.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
from PIL import Image

from compaction.models import CompactionRecord, RecordStatus, Trigger
from conversations import services
from conversations.models import Conversation, Message
from conversations.providers.fake import Step
from tests.builders import make_user, text
from tests.test_browser_ui import SCREENSHOTS, BrowserTestCase

PHONE = {"viewport": {"width": 390, "height": 844}, "is_mobile": True, "has_touch": True}
DESKTOP = {"viewport": {"width": 1280, "height": 800}}
FINGER = 40  # px: the smallest control a thumb hits reliably (#15)

LONG_CODE = (
    "```python\n"
    "def load_quarterly_report(path: str, *, columns: list[str] | None = None, "
    "encoding: str = 'utf-8', skip_blank_lines: bool = True, on_error: str = 'raise') -> dict:\n"
    "    return {'rows': read_rows(path, encoding=encoding, skip_blank_lines=skip_blank_lines,"
    " on_error=on_error, columns=columns or DEFAULT_COLUMNS_FOR_THE_QUARTERLY_REPORT)}\n"
    "```"
)
WIDE_TABLE = (
    "| " + " | ".join(f"column_heading_{i}" for i in range(10)) + " |\n"
    "|" + "---|" * 10 + "\n"
    "| " + " | ".join(f"value-{i}-without-breaks" for i in range(10)) + " |"
)
ANSWER = (
    f"Here is the loader:\n\n{LONG_CODE}\n\nThe columns it reads:\n\n{WIDE_TABLE}\n\n"
    "A path with no spaces: `/var/reports/2024/quarterly/earnings/with/a/very/long/name.csv`."
)


def png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), "teal").save(out, "PNG")
    return out.getvalue()


class LayoutTestCase(BrowserTestCase):
    """A conversation with everything a page can show: a long code block, a wide table,
    a wide image, a tool call and its result, versions of a prompt and of an answer, a
    checkpoint, a fork and a compaction record. The user is staff, for the audit."""

    def setUp(self) -> None:
        super().setUp()
        self.user = make_user("root", staff=True)
        self.conv = services.conversation_create(
            owner=self.user, title="Quarterly report loader", model="openai/test"
        )
        blob = services.blob_store(owner=self.user, data=png(1600, 240))
        long_path = "/var/reports/2024/quarterly-earnings-" + "x" * 80
        call = {"type": "tool_call", "id": "c1", "name": "read_file",
                "arguments": {"path": long_path}}  # fmt: skip
        result = {"type": "tool_result", "call_id": "c1", "is_error": False,
                  "parts": text("date,region,revenue\n" + "2024-01-01,north," * 12)}  # fmt: skip
        image = {"type": "image", "blob": blob.pk}
        first = services.turn_append(
            conversation=self.conv,
            parent_id=None,
            expected_version=0,
            messages=[
                {"role": "user", "parts": [*text("Write the report loader"), image]},
                {"role": "assistant", "parts": [*text("Let me look at the file."), call]},
                {"role": "tool", "parts": [result]},
                {"role": "assistant", "parts": text(ANSWER)},
            ],
        ).message_ids
        self.prompt, self.answer = first[0], first[3]
        # A second answer to the tool result and a second version of the prompt.
        services.turn_append(
            conversation=self.conv, parent_id=first[2], expected_version=None,
            messages=[{"role": "assistant", "parts": text("A shorter loader.")}],
        )  # fmt: skip
        self.other_prompt = services.turn_append(
            conversation=self.conv, parent_id=None, expected_version=None,
            messages=[{"role": "user", "parts": text("Write the report loader in Rust")},
                      {"role": "assistant", "parts": text("Here it is in Rust.")}],
        ).message_ids[0]  # fmt: skip
        self.conv.refresh_from_db()
        services.tip_move(
            conversation=self.conv, message_id=self.answer, expected_version=self.conv.version
        )
        self.conv.refresh_from_db()
        services.checkpoint_create(conversation=self.conv, label="loader-ready")
        services.conversation_fork(
            message=Message.objects.get(pk=first[1]), owner=self.user, title="Loader fork"
        )
        self.record = CompactionRecord.objects.create(
            conversation=self.conv, anchor_id=self.answer, model="openai/test",
            trigger=Trigger.MANUAL, status=RecordStatus.READY, tokens_before=900,
            tokens_after=300, budget_tokens=400,
            rungs=[{"rung": "elide", "tokens_before": 900, "tokens_after": 300, "saved": 600,
                    "model_calls": 0, "replaced": [], "details": {}}],
            view=[{"id": "x", "role": "assistant", "parts": text(ANSWER)}],
            summary="They wrote a loader.", summary_model="openai/test", summary_prompt="Sum up",
        )  # fmt: skip

    def pages(self) -> list[tuple[str, str, list[str]]]:
        """(name, path, the page's main actions)."""
        chat = ["#composer textarea", "#composer button", f"#msg-{self.prompt} .sib-prev",
                f"#msg-{self.prompt} .sib-next", f"#msg-{self.prompt} details.edit > summary",
                f"#msg-{self.answer} button.regenerate", f"#msg-{self.answer} .sib-prev",
                f"#msg-{self.answer} details.fork-form > summary", ".conv-nav a"]  # fmt: skip
        c, record = self.conv.pk, self.record.pk
        compare = f"/c/{c}/compare/?m={self.prompt}&m={self.other_prompt}"
        search = ["input[name=q]", "form.search button", ".conversations a.title", ".hits a.hit",
                  "details.new-conversation > summary"]  # fmt: skip
        label = ["input[name=label]:not([type=hidden])", "button:has-text('Add checkpoint')",
                 "li.checkpoint summary"]  # fmt: skip
        upload = ["input[name=file]", "select[name=format]", "button:has-text('Import')"]
        return [
            ("list", "/?q=loader", search),
            ("chat", f"/c/{c}/", chat),
            ("tree", f"/c/{c}/tree/", [".node.is-tip .node-button", ".tree a.expand"]),
            ("compare", compare, [".compare-col button"]),
            ("checkpoints", f"/c/{c}/checkpoints/", label),
            ("context", f"/c/{c}/context/", ["#compact-now", ".conv-nav a"]),
            ("import", "/import/", upload),
            ("settings", "/settings/", ["input[name=name]", "button:has-text('Create token')"]),
            ("audit", "/audit/", ["#audit-filters button", f"#record-{record} a"]),
            ("audit-detail", f"/audit/{record}/", ["details:has(#summary-prompt) > summary"]),
        ]

    def assert_no_sideways_scroll(self, width: int, where: str) -> None:
        # A phone browser widens its layout viewport to fit content that overflows, so
        # window.innerWidth alone would hide an overflow: it must stay the device's width.
        scroll, inner = self.page.evaluate(
            "() => [document.documentElement.scrollWidth, window.innerWidth]"
        )
        assert inner == width and scroll <= inner, (where, scroll, inner)

    def assert_tappable(self, selector: str, width: int, min_height: int) -> None:
        found = self.page.locator(selector)
        assert found.count() >= 1, selector
        for i in range(min(found.count(), 4)):
            element = found.nth(i)
            element.scroll_into_view_if_needed()
            box = element.bounding_box()
            assert box is not None and element.is_visible(), selector
            assert box["x"] >= 0 and box["x"] + box["width"] <= width + 0.5, (selector, box)
            assert box["height"] >= min_height, (selector, box)
            if element.is_enabled():  # visible, still, not covered by anything else
                if min_height:
                    element.tap(trial=True, timeout=3_000)
                else:
                    element.click(trial=True, timeout=3_000)

    def check_every_page(self, options: dict[str, Any], prefix: str, min_height: int) -> None:
        self.use(options, "root")
        width = options["viewport"]["width"]
        page = self.page
        for name, path, actions in self.pages():
            response = page.goto(self.url(path))
            assert response is not None and response.status == 200, path
            self.assert_no_sideways_scroll(width, name)
            for selector in ["header nav a", "header button.link", *actions]:
                self.assert_tappable(selector, width, min_height)
            if name == "chat":
                # Code and tables keep their shape and scroll inside their own box.
                for box in (".md pre", ".md table"):
                    inside = page.locator(f"#msg-{self.answer} {box}").first
                    scroll, client = inside.evaluate("e => [e.scrollWidth, e.clientWidth]")
                    assert scroll > client, (box, scroll, client)
                image = page.locator(f"#msg-{self.prompt} img").bounding_box()
                assert image is not None and image["x"] + image["width"] <= width
                page.evaluate("document.querySelectorAll('details').forEach(d => d.open = true)")
                # Each opened Edit and Fork fetches its form in place of its link.
                page.wait_for_function("() => !document.querySelector('.lazy-form > a')")
                self.assert_no_sideways_scroll(width, "chat with everything open")
                self.assert_tappable(f"#msg-{self.prompt} button:has-text('Send edit')",
                                     width, min_height)  # fmt: skip
                self.assert_tappable(f"#msg-{self.answer} button:has-text('Fork')",
                                     width, min_height)  # fmt: skip
            elif name == "tree":
                page.locator(".tree a.expand").first.click()
                page.wait_for_selector(".tree .alternatives .branch .node")
                self.assert_no_sideways_scroll(width, "tree with a branch open")
            page.screenshot(path=str(SCREENSHOTS / f"{prefix}-{name}.png"), full_page=True)
        self.assert_clean()


@pytest.mark.slow  # every page at each size, in a browser
class PhoneLayoutTests(LayoutTestCase):
    def test_every_page_fits_a_phone_and_its_actions_take_a_finger(self) -> None:
        self.check_every_page(PHONE, "phone", FINGER)

    def test_every_page_fits_a_desktop(self) -> None:
        self.check_every_page(DESKTOP, "desktop", 0)

    def test_send_stream_and_switch_versions_on_a_phone(self) -> None:
        self.use(PHONE, "root")
        page = self.page
        page.goto(self.url(f"/c/{self.conv.pk}/"))
        self.fake.push(Step.reply("Streamed to the phone, word by word, " * 6, pace=0.02))
        page.locator("#composer textarea").tap()
        page.fill("#composer textarea", "Now add a test for it")
        page.locator("#composer button").tap()
        page.wait_for_selector("#path .msg.tip.assistant .md:has-text('Streamed to the phone')")
        live = page.evaluate("window.__live")
        assert len(live) >= 2, live  # the answer grew in steps while it streamed
        self.assert_no_sideways_scroll(390, "chat after sending")
        page.screenshot(path=str(SCREENSHOTS / "phone-chat-sent.png"))

        # ▶ on the first prompt: its other version, with the server's tip moved there.
        first = "#path > .msg:first-child"
        page.locator(f"{first} .sib-next").tap()
        page.wait_for_selector(f"{first} .sib-pos:has-text('2/2')")
        assert "Here it is in Rust." in page.inner_text("#path")
        self.conv.refresh_from_db()
        assert Message.objects.get(pk=self.conv.tip_id).parts == text("Here it is in Rust.")  # type: ignore[misc]
        # ◀ back: the newest leaf below the first version, the answer just streamed.
        page.locator(f"{first} .sib-prev").tap()
        page.wait_for_selector(f"{first} .sib-pos:has-text('1/2')")
        assert "Streamed to the phone" in page.inner_text("#path .msg.tip")
        page.reload()
        assert page.inner_text(f"{first} .sib-pos") == "1/2"
        assert Conversation.objects.get(pk=self.conv.pk).tip_id != self.answer
        page.screenshot(path=str(SCREENSHOTS / "phone-chat-versions.png"))
        self.assert_clean()
