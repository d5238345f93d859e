"""API authentication: ``Authorization: Bearer <token>`` or the Django session.

Session requests that change something must carry the CSRF token; bearer requests need
none (a browser never attaches the header on its own).
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.http import HttpRequest
from ninja.errors import HttpError
from ninja.security import APIKeyCookie, HttpBearer
from ninja.utils import check_csrf

from conversations.errors import TokenExpired
from conversations.services import api_token_authenticate


class BearerToken(HttpBearer):
    def authenticate(self, request: HttpRequest, token: str) -> Any:
        try:
            user = api_token_authenticate(secret=token)
        except TokenExpired as exc:
            raise HttpError(401, exc.detail) from None
        if user is not None:
            request.user = user
        return user


class SessionWithCsrf(APIKeyCookie):
    """Django's session, with CSRF enforced on unsafe methods.

    Unlike ninja's SessionAuth, an anonymous request answers 401 (not signed in) rather
    than 403 (CSRF), so clients learn the real problem first.
    """

    param_name = settings.SESSION_COOKIE_NAME

    def _get_key(self, request: HttpRequest) -> str | None:
        if not request.user.is_authenticated:
            return None
        if self.csrf and check_csrf(request):
            raise HttpError(403, "CSRF check failed: send the X-CSRFToken header")
        return request.COOKIES.get(self.param_name)

    def authenticate(self, request: HttpRequest, key: str | None) -> Any:
        if key is not None and request.user.is_authenticated:
            return request.user
        return None


api_auth = [BearerToken(), SessionWithCsrf()]
