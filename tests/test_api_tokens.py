"""API tokens that expire, and who may read the API's schema and docs.

A token may carry an expiry (Settings offers 7 to 365 days or never; the command takes
``--days``). Past it the token is refused with a 401 that says so, on the API and on the
gateway (in the provider's error shape), while an unknown secret stays a plain 401.
The OpenAPI schema and docs follow ARBOR_API_DOCS: public, signed-in (the default with
DEBUG off) or off."""

from __future__ import annotations

import io
import re
from datetime import timedelta

from django.core.management import call_command
from django.test import TestCase, override_settings
from django.utils import timezone

from conversations import services
from conversations.errors import InvalidInput
from conversations.models import ApiToken
from tests.builders import make_user


class TokenExpiryTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user("alice")

    def expired_secret(self) -> str:
        token, secret = services.api_token_create(
            user=self.user, name="old", expires_in=timedelta(days=1)
        )
        ApiToken.objects.filter(pk=token.pk).update(
            expires_at=timezone.now() - timedelta(seconds=1)
        )
        return secret

    def test_a_live_token_works_until_its_expiry(self) -> None:
        token, secret = services.api_token_create(
            user=self.user, name="week", expires_in=timedelta(days=7)
        )
        assert token.expires_at is not None
        assert timedelta(days=6) < token.expires_at - timezone.now() <= timedelta(days=7)
        response = self.client.get("/api/conversations", HTTP_AUTHORIZATION=f"Bearer {secret}")
        assert response.status_code == 200

    def test_an_expired_token_gets_a_401_that_says_it_expired(self) -> None:
        response = self.client.get(
            "/api/conversations", HTTP_AUTHORIZATION=f"Bearer {self.expired_secret()}"
        )
        assert response.status_code == 401
        body = response.json()
        assert body["error"] == "unauthorized"
        assert "expired" in body["detail"]
        # An unknown secret is not told anything about tokens it does not hold.
        unknown = self.client.get("/api/conversations", HTTP_AUTHORIZATION="Bearer arb_nope")
        assert unknown.status_code == 401
        assert "expired" not in unknown.json()["detail"]

    def test_the_gateway_refuses_an_expired_token_in_the_providers_shape(self) -> None:
        secret = self.expired_secret()
        response = self.client.get(
            "/gateway/openai/v1/models", HTTP_AUTHORIZATION=f"Bearer {secret}"
        )
        assert response.status_code == 401
        assert "expired" in response.json()["error"]["message"]
        response = self.client.post(
            "/gateway/anthropic/v1/messages",
            data=b'{"model": "claude-sonnet-4-5", "max_tokens": 10, "messages": []}',
            content_type="application/json",
            HTTP_X_API_KEY=secret,
        )
        assert response.status_code == 401
        body = response.json()
        assert body["type"] == "error"
        assert body["error"]["type"] == "authentication_error"
        assert "expired" in body["error"]["message"]

    def test_a_token_that_never_expires_and_a_bad_duration(self) -> None:
        token, _ = services.api_token_create(user=self.user, name="forever")
        assert token.expires_at is None
        with self.assertRaises(InvalidInput):
            services.api_token_create(user=self.user, name="x", expires_in=timedelta(0))
        assert not ApiToken.objects.filter(name="x").exists()

    def test_settings_creates_a_token_with_the_chosen_expiry_and_lists_it(self) -> None:
        self.client.force_login(self.user)
        page = self.client.get("/settings/")
        assert re.search(r'<option value="90" selected>', page.content.decode())
        response = self.client.post("/settings/", {"name": "ci", "expires": "30"})
        assert response.status_code == 200
        token = ApiToken.objects.get(name="ci")
        assert token.expires_at is not None
        assert timedelta(days=29) < token.expires_at - timezone.now() <= timedelta(days=30)
        assert f"expires {token.expires_at:%Y-%m-%d}" in response.content.decode()
        self.client.post("/settings/", {"name": "script", "expires": ""})
        assert ApiToken.objects.get(name="script").expires_at is None
        bad = self.client.post("/settings/", {"name": "bad", "expires": "12"})
        assert bad.status_code == 400
        assert not ApiToken.objects.filter(name="bad").exists()
        self.expired_secret()
        listed = self.client.get("/settings/").content.decode()
        assert '<strong class="expired">expired</strong>' in listed

    def test_the_command_takes_days(self) -> None:
        out = io.StringIO()
        call_command("create_api_token", "alice", "--name", "cron", "--days", "3", stdout=out)
        token = ApiToken.objects.get(name="cron")
        assert token.expires_at is not None
        assert timedelta(days=2) < token.expires_at - timezone.now() <= timedelta(days=3)
        call_command("create_api_token", "alice", "--name", "plain", stdout=io.StringIO())
        assert ApiToken.objects.get(name="plain").expires_at is None


class ApiDocsTests(TestCase):
    @classmethod
    def setUpTestData(cls) -> None:
        cls.user = make_user("alice")
        _, cls.secret = services.api_token_create(user=cls.user, name="t")

    @override_settings(ARBOR_API_DOCS="signed-in")
    def test_signed_in_mode_needs_a_session_or_a_token(self) -> None:
        anonymous = self.client.get("/api/openapi.json")
        assert anonymous.status_code == 401
        assert anonymous.json()["error"] == "unauthorized"
        docs = self.client.get("/api/docs")
        assert docs.status_code == 302
        assert docs["Location"].startswith("/login/?next=/api/docs")
        bearer = self.client.get("/api/openapi.json", HTTP_AUTHORIZATION=f"Bearer {self.secret}")
        assert bearer.status_code == 200
        token, old = services.api_token_create(user=self.user, name="old")
        ApiToken.objects.filter(pk=token.pk).update(expires_at=timezone.now())
        expired = self.client.get("/api/openapi.json", HTTP_AUTHORIZATION=f"Bearer {old}")
        assert expired.status_code == 401  # an expired token is not signed in
        assert "/api/conversations" in bearer.json()["paths"]
        self.client.force_login(self.user)
        assert self.client.get("/api/docs").status_code == 200
        assert self.client.get("/api/openapi.json").status_code == 200

    @override_settings(ARBOR_API_DOCS="public")
    def test_public_mode_serves_anyone(self) -> None:
        assert self.client.get("/api/openapi.json").status_code == 200
        assert self.client.get("/api/docs").status_code == 200

    @override_settings(ARBOR_API_DOCS="off")
    def test_off_mode_serves_no_one(self) -> None:
        self.client.force_login(self.user)
        response = self.client.get("/api/openapi.json")
        assert response.status_code == 404
        assert "turned off" in response.json()["detail"]
        assert self.client.get("/api/docs").status_code == 404


class TokenLookupTests(TestCase):
    """``api_token_authenticate`` reads the token and its user in one query."""

    def test_one_query_the_user_and_use_recorded_once_a_minute(self) -> None:
        user = make_user("carol")
        token, secret = services.api_token_create(user=user, name="t")
        with self.assertNumQueries(2):  # the lookup, and the first use recorded
            found = services.api_token_authenticate(secret=secret)
        assert found is not None and found.pk == user.pk and found.username == "carol"
        token.refresh_from_db()
        assert token.last_used_at is not None
        with self.assertNumQueries(1):  # used within the minute: nothing written
            assert services.api_token_authenticate(secret=secret) == user
        ApiToken.objects.filter(pk=token.pk).update(
            last_used_at=timezone.now() - timedelta(minutes=5)
        )
        with self.assertNumQueries(2):
            services.api_token_authenticate(secret=secret)
        token.refresh_from_db()
        assert token.last_used_at > timezone.now() - timedelta(minutes=1)

    def test_unknown_inactive_and_not_yet_expired(self) -> None:
        user = make_user("dave")
        _, secret = services.api_token_create(user=user, name="t", expires_in=timedelta(days=1))
        assert services.api_token_authenticate(secret=secret) == user  # expires tomorrow
        assert services.api_token_authenticate(secret=secret + "x") is None
        user.is_active = False
        user.save(update_fields=["is_active"])
        assert services.api_token_authenticate(secret=secret) is None
