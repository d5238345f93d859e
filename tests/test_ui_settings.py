"""The settings page's model list: the default model and the models the operator declared
in the ARBOR_MODELS file, with the window, output limit, image support and image billing
rule Arbor budgets by. Read-only; a broken file is an error on the page, not a 500."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from unittest import mock

from django.test import TestCase, override_settings
from django.utils.html import escape

from conversations.providers.registry import ASSUMED_NOTICE, FAKE_NOTICE
from tests.builders import make_user

DECLARED = {
    "openai/local-llama": {
        "base_url": "http://10.0.0.7:11434/v1",
        "model": "llama3.1:8b",
        "context_window": 8192,
        "max_output": 2048,
        "vision": False,
    },
    "anthropic/house-claude": {
        "context_window": 150000,
        "max_output": 4000,
        "vision": True,
        "image_billing": "claude",
    },
}


class ModelListTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.alice = make_user("alice")
        cls.staff = make_user("root", staff=True)

    def setUp(self) -> None:
        self.folder = Path(tempfile.mkdtemp())
        self.client.force_login(self.alice)

    def declare(self, content: str, name: str = "models.json") -> None:
        path = self.folder / name
        path.write_text(content)
        patcher = mock.patch.dict("os.environ", {"ARBOR_MODELS": str(path)})
        patcher.start()
        self.addCleanup(patcher.stop)

    def rows(self) -> dict[str, str]:
        response = self.client.get("/settings/")
        assert response.status_code == 200
        html = response.content.decode()
        return dict(re.findall(r'<tr data-model="([^"]+)"[^>]*>(.*?)</tr>', html, re.S))

    @override_settings(ARBOR_DEFAULT_MODEL="anthropic/claude-sonnet-4-5")
    def test_it_lists_the_default_first_then_the_declared_models_with_their_limits(self) -> None:
        self.declare(json.dumps({"models": DECLARED}))
        rows = self.rows()
        assert list(rows) == [
            "anthropic/claude-sonnet-4-5",
            "anthropic/house-claude",
            "openai/local-llama",
        ]
        default = rows["anthropic/claude-sonnet-4-5"]
        assert 'class="badge default"' in default
        assert "200000" in default and "64000" in default  # the built-in table's numbers
        assert "<code>claude</code>" in default
        llama = rows["openai/local-llama"]
        assert "8192" in llama and "2048" in llama and "no (text only)" in llama
        assert "badge default" not in llama
        house = rows["anthropic/house-claude"]
        assert "150000" in house and "4000" in house and "<code>claude</code>" in house
        # Where a self-hosted model lives is the operator's business, not every user's.
        assert "10.0.0.7" not in self.client.get("/settings/").content.decode()

    @override_settings(ARBOR_DEFAULT_MODEL="openai/local-llama")
    def test_a_declared_default_is_listed_once_with_its_declared_limits(self) -> None:
        self.declare(json.dumps({"models": DECLARED}))
        rows = self.rows()
        assert list(rows) == ["openai/local-llama", "anthropic/house-claude"]
        assert "badge default" in rows["openai/local-llama"]
        assert "8192" in rows["openai/local-llama"]

    @override_settings(ARBOR_DEFAULT_MODEL="fake/demo")
    def test_without_a_models_file_it_shows_the_default_and_says_what_it_is(self) -> None:
        with mock.patch.dict("os.environ", {"ARBOR_MODELS": ""}):
            rows = self.rows()
        assert list(rows) == ["fake/demo"]
        assert escape(FAKE_NOTICE) in rows["fake/demo"]

    @override_settings(ARBOR_DEFAULT_MODEL="openai/some-new-model")
    def test_guessed_limits_are_marked_as_guesses(self) -> None:
        with mock.patch.dict("os.environ", {"ARBOR_MODELS": ""}):
            rows = self.rows()
        assert escape(ASSUMED_NOTICE) in rows["openai/some-new-model"]

    @override_settings(ARBOR_DEFAULT_MODEL="openai/gpt-4o")
    def test_a_broken_models_file_is_an_error_on_the_page_with_details_for_staff(self) -> None:
        self.declare('{"models": {"openai/x": {"context_window": "big"}}}')
        response = self.client.get("/settings/")
        assert response.status_code == 200
        html = response.content.decode()
        assert 'id="models-error"' in html and "ask an operator" in html
        assert str(self.folder) not in html  # no server paths for a plain user
        self.client.force_login(self.staff)
        html = self.client.get("/settings/").content.decode()
        assert "context_window must be a int" in html

    def test_a_stranger_to_the_site_is_sent_to_sign_in(self) -> None:
        self.client.logout()
        response = self.client.get("/settings/")
        assert response.status_code == 302
        assert response["Location"].startswith("/login/")


class CalibrationHistoryTests(TestCase):
    """One odd overflow error moves a model's calibration a bounded step, never pins it
    (a 250,000-token claim for a small request), and settings shows what was learnt."""

    def test_an_absurd_overflow_moves_the_factor_a_bounded_step_and_is_shown(self) -> None:
        from compaction import services as compaction

        calibration = compaction.calibration_overflow(
            model_id="anthropic/claude-sonnet-4-5", raw_estimate=1_000, measured=250_000,
            limit=200_000,
        )  # fmt: skip
        assert 1.0 < calibration.factor <= 1.25, calibration.factor
        user = make_user("calibrated")
        self.client.force_login(user)
        page = self.client.get("/settings/").content.decode()
        assert 'id="calibration"' in page and "anthropic/claude-sonnet-4-5" in page
        assert "overflow: estimated 1000, counted 250000, window 200000" in page
        # The page's title is its title (the calibration table once leaked into it).
        assert "<title>Settings · Arbor</title>" in page
        assert page.count('id="calibration"') == 1

    def test_one_model_at_two_endpoints_keeps_two_calibrations(self) -> None:
        from compaction import services as compaction
        from conversations.providers import resolve_model

        # The endpoint is the one the provider client would use: OPENAI_BASE_URL here.
        with mock.patch.dict("os.environ", {"OPENAI_BASE_URL": "http://127.0.0.1:11434/v1"}):
            local = resolve_model("openai/gpt-4o-mini").calibration_key
        with mock.patch.dict("os.environ", {"OPENAI_BASE_URL": ""}):
            hosted = resolve_model("openai/gpt-4o-mini").calibration_key
        assert local == "openai/gpt-4o-mini @ 127.0.0.1:11434/v1"
        with mock.patch.dict("os.environ", {"OPENAI_BASE_URL": "https://u:secret@llm.internal/v1"}):
            keyed = resolve_model("openai/gpt-4o-mini").calibration_key
        assert keyed == "openai/gpt-4o-mini @ llm.internal/v1"  # no credentials shown
        assert hosted == "openai/gpt-4o-mini @ api.openai.com/v1"
        # The local server counts 1.2x what Arbor estimates; the hosted one 0.9x.
        for _ in range(10):
            compaction.calibration_observe(model_id=local, raw_estimate=20_000, measured=24_000)
            compaction.calibration_observe(model_id=hosted, raw_estimate=20_000, measured=18_000)
        local_factor = compaction.calibration_get(local)[0].factor
        hosted_factor = compaction.calibration_get(hosted)[0].factor
        assert local_factor > 1.1 and hosted_factor < 0.95, (local_factor, hosted_factor)
        self.client.force_login(make_user("ops"))
        page = self.client.get("/settings/").content.decode()
        assert "openai/gpt-4o-mini @ 127.0.0.1:11434/v1" in page
        assert "openai/gpt-4o-mini @ api.openai.com/v1" in page
