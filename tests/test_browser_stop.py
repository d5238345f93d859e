"""Stop and reload mid-answer in Chromium, against the server `make run` starts
(uvicorn, ASGI: a turn runs on when its page goes away).

- Stop while an answer streams: the model's request is cut and the chat shows what had
  arrived, marked "stopped"; the question is kept once.
- Reload while an answer streams: the page shows the question and the answer so far,
  follows it, and ends on the saved answer; asking again is not needed, so no sibling.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from django.contrib.auth.hashers import PBKDF2PasswordHasher
from django.test import TransactionTestCase

from conversations.models import AttemptStatus, Message, TurnAttempt
from conversations.providers.fake import FakeLLMServer, Step
from tests.builders import make_user, new_conversation
from tests.fake_models import child_env, serve_fake_models
from tests.live_server import READY_SECONDS, uvicorn_server
from tests.test_browser_ui import (
    BROWSER_WAIT_MS,
    INIT_SCRIPT,
    SCREENSHOTS,
    _browser_available,
    start_chromium,
    stop_chromium,
)

STORY = " ".join(f"w{i}" for i in range(160))
# The words of the live answer on the page (0 when there is none).
LIVE_WORDS = (
    "((document.querySelector('#live-answer .live-text') || {}).textContent || '')"
    ".split(/\\s+/).filter(Boolean).length"
)


@pytest.mark.slow  # a browser against a live server per test
class StopAndReloadTests(TransactionTestCase):
    @classmethod
    def setUpClass(cls) -> None:
        _browser_available()
        super().setUpClass()
        cls.playwright, cls.browser = start_chromium()

    @classmethod
    def tearDownClass(cls) -> None:
        stop_chromium(cls.playwright, cls.browser)
        super().tearDownClass()

    def setUp(self) -> None:
        self.fake = FakeLLMServer()
        models = serve_fake_models(self.fake)
        models.__enter__()
        self.addCleanup(models.__exit__, None, None, None)
        # The `make run` server on this test's database (it is up once this returns).
        env = dict(child_env(), ALLOWED_HOSTS="127.0.0.1", ARBOR_INPROCESS_JOBS="thread")
        self.port = self.enterContext(uvicorn_server(env))
        self.user = make_user("reader")
        # The server keeps Django's real password hashers (the tests' fast one is not
        # among them): a PBKDF2 hash it can check, with few rounds.
        self.user.password = PBKDF2PasswordHasher().encode("pw", "saltsaltsalt", iterations=1000)
        self.user.save()
        self.conv, _ = new_conversation(self.user, "Hello>Hi there")
        self.conv.model = "openai/test"
        self.conv.save()

    def open(self, width: int, height: int) -> Any:
        context = self.browser.new_context(viewport={"width": width, "height": height})
        context.add_init_script(INIT_SCRIPT)
        self.addCleanup(context.close)
        page = context.new_page()
        page.set_default_timeout(BROWSER_WAIT_MS)
        errors: list[str] = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        self.addCleanup(lambda: self.assertEqual(errors, []))
        base = f"http://127.0.0.1:{self.port}"
        page.goto(f"{base}/login/")
        page.fill("input[name=username]", "reader")
        page.fill("input[name=password]", "pw")
        page.click("button:has-text('Sign in')")
        page.wait_for_url(f"{base}/")
        page.goto(f"{base}/c/{self.conv.pk}/")
        return page

    def live_words(self, page: Any) -> int:
        words: int = page.evaluate(f"() => {LIVE_WORDS}")
        return words

    def send(self, page: Any, prompt: str) -> None:
        page.fill("#composer textarea", prompt)
        page.click("#composer button")
        page.wait_for_function(f"() => ({LIVE_WORDS}) > 5")

    def prompts(self, text: str) -> int:
        return Message.objects.filter(
            conversation=self.conv, role="user", parts__0__text=text
        ).count()

    def check_stop(self, width: int, height: int, name: str) -> None:
        self.fake.push(Step.reply(STORY, pace=0.05))
        page = self.open(width, height)
        assert not page.is_visible(".stop-form button"), "Stop shows only while answering"
        self.send(page, f"Tell me a story ({name})")
        assert page.input_value("#composer textarea") == "", "the composer keeps the message"
        stop = page.locator(".stop-form button")
        assert stop.is_visible()
        box = stop.bounding_box()
        assert box["height"] >= 40 and box["width"] >= 40, box
        page.screenshot(path=str(SCREENSHOTS / f"stop-streaming-{name}.png"))
        # Stop names this turn (a second tab's turn in the same chat runs on).
        running = TurnAttempt.objects.get(conversation=self.conv, status=AttemptStatus.RUNNING)
        assert page.input_value(".stop-form input[name=attempt]") == str(running.pk)
        stop.click()
        page.wait_for_selector(".msg.assistant .badge.stopped")
        assert page.locator("#live-answer").count() == 0
        answer = page.locator(".msg.assistant").last.locator(".parts").inner_text().strip()
        words = answer.split()
        assert 5 <= len(words) < 160 and STORY.startswith(answer), answer
        assert self.prompts(f"Tell me a story ({name})") == 1
        # The fake notices the hang-up when it next writes to the socket.
        deadline = time.monotonic() + READY_SECONDS
        while not self.fake.requests[-1].cut:
            assert time.monotonic() < deadline, "the model's request was not cut"
            time.sleep(0.05)
        assert not page.is_visible(".stop-form button")
        page.screenshot(path=str(SCREENSHOTS / f"stop-stopped-{name}.png"), full_page=True)
        no_scroll = page.evaluate(
            "document.documentElement.scrollWidth <= document.documentElement.clientWidth"
        )
        assert no_scroll, "the page scrolls sideways"

    def test_stop_keeps_the_partial_answer_at_1280(self) -> None:
        self.check_stop(1280, 900, "1280")

    def test_stop_keeps_the_partial_answer_on_a_phone(self) -> None:
        self.check_stop(390, 844, "390")

    def test_reload_mid_answer_shows_and_follows_the_running_turn(self) -> None:
        self.fake.push(Step.reply(STORY, pace=0.04))
        page = self.open(1280, 900)
        self.send(page, "Tell me a story, then I reload")
        page.reload()
        # The question and the answer so far are on the reloaded page, and it grows.
        pending = page.locator(".msg.user.pending")
        assert pending.inner_text().strip() == "Tell me a story, then I reload"
        page.wait_for_selector("#live-answer")
        first = self.live_words(page)
        page.screenshot(path=str(SCREENSHOTS / "reload-following-1280.png"))
        page.wait_for_function(f"() => ({LIVE_WORDS}) > {first + 10}")
        assert page.is_visible(".stop-form button")
        # The end: the saved answer replaces the live one, whole.
        page.wait_for_selector("#live-answer", state="detached")
        answer = page.locator(".msg.assistant").last.locator(".parts").inner_text().strip()
        assert answer == STORY
        assert self.prompts("Tell me a story, then I reload") == 1
        assert len(self.fake.requests) == 1, "the question was not asked again"
        page.screenshot(path=str(SCREENSHOTS / "reload-done-1280.png"), full_page=True)

    def test_reload_while_regenerating_follows_the_new_answer(self) -> None:
        self.fake.push(Step.reply(STORY, pace=0.04))
        page = self.open(1280, 900)
        page.click("button.regenerate")
        page.wait_for_function(f"() => ({LIVE_WORDS}) > 5")
        page.reload()
        # The new answer branches off above the message shown last: it is followed in a
        # notice, with Stop, and the chat then shows its branch.
        page.wait_for_selector(".running-elsewhere #live-answer")
        assert page.is_visible(".stop-form button")
        page.screenshot(path=str(SCREENSHOTS / "reload-regenerating-1280.png"))
        page.wait_for_selector("#live-answer", state="detached")
        answer = page.locator(".msg.assistant").last
        assert answer.locator(".parts").inner_text().strip() == STORY
        assert answer.locator(".sib-pos").inner_text() == "2/2"
        assert len(self.fake.requests) == 1

    def test_stop_after_a_reload(self) -> None:
        self.fake.push(Step.reply(STORY, pace=0.05))
        page = self.open(1280, 900)
        self.send(page, "Stop me after a reload")
        page.reload()
        page.wait_for_selector("#live-answer")
        page.click(".stop-form button")
        page.wait_for_selector(".msg.assistant .badge.stopped")
        assert self.prompts("Stop me after a reload") == 1
        answer = page.locator(".msg.assistant").last.locator(".parts").inner_text().strip()
        assert STORY.startswith(answer) and len(answer.split()) < 160


@pytest.mark.slow  # a browser against a live server per test
class BenchPageTests(TransactionTestCase):
    """`manage.py bench_page` (run by `make bench`) prints the long chat's weight and
    timings at both widths, and leaves nothing behind."""

    def setUp(self) -> None:
        _browser_available()

    def test_it_prints_weight_and_time_to_interactive(self) -> None:
        import json
        import os
        from io import StringIO
        from unittest import mock

        from django.conf import global_settings
        from django.contrib.auth.models import User
        from django.core.management import call_command

        from conversations.management.commands.bench_page import BENCH_USERNAME

        out = StringIO()
        # The server it starts must use this test's database, and check the password
        # with Django's own hashers, as the command's user is made by a real deployment.
        with (
            mock.patch.dict(os.environ, child_env()),
            self.settings(PASSWORD_HASHERS=global_settings.PASSWORD_HASHERS),
        ):
            call_command("bench_page", "--messages", "120", "--repeat", "1", stdout=out)
        result = json.loads(out.getvalue())["bench_page"]
        for width in ("1280", "390"):
            view = result[width]
            assert 10_000 < view["html_bytes"] <= view["transferred_bytes"], view
            assert view["elements"] > 100 and view["interactive_ms"] > 0, view
        assert result["met"] is True
        assert not User.objects.filter(username=BENCH_USERNAME).exists()
