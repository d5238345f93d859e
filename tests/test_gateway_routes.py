"""Every path below /gateway/ answers JSON in its protocol's own shape: SDKs and
harnesses show a provider-shaped error, never a page of HTML."""

from __future__ import annotations

from django.test import TestCase


class UnknownRouteTests(TestCase):
    def test_an_unknown_anthropic_path_is_an_anthropic_404(self) -> None:
        for method in ("get", "post"):
            response = getattr(self.client, method)("/gateway/anthropic/v1/nope")
            assert response.status_code == 404
            assert response["content-type"].startswith("application/json")
            body = response.json()
            assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
            assert "/gateway/anthropic/v1/nope" in body["error"]["message"]

    def test_an_unknown_openai_path_is_an_openai_404(self) -> None:
        for path in ("/gateway/openai/v1/embeddings", "/gateway/somewhere/else", "/gateway/"):
            response = self.client.post(path, "{}", content_type="application/json")
            assert response.status_code == 404, path
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error" and error["code"] == "unknown_url"

    def test_known_routes_still_answer(self) -> None:
        assert self.client.get("/gateway/anthropic").json()["gateway"] == "arbor"
        # Without a token: the protocol's 401, not the catch-all.
        assert self.client.post("/gateway/anthropic/v1/messages").status_code == 401


class CountTokensBodyTests(TestCase):
    def test_count_tokens_refuses_what_every_other_gateway_route_refuses(self) -> None:
        from conversations import services
        from tests.builders import make_user

        _, token = services.api_token_create(user=make_user("counter"), name="t")
        headers = {"x-api-key": token}
        bodies = {
            "deep": b'{"model":"m","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            "twice": b'{"model":"a","model":"b","messages":[]}',
            "surrogate": b'{"model":"m","messages":[{"role":"user","content":"\\ud83d"}]}',
        }
        for name, raw in bodies.items():
            response = self.client.post(
                "/gateway/anthropic/v1/messages/count_tokens",
                raw,
                content_type="application/json",
                headers=headers,
            )
            assert response.status_code == 400, (name, response.content[:200])
            assert response.json()["error"]["type"] == "invalid_request_error", name
