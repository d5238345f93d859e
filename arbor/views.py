"""Site-wide views that are not a feature's own."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views import csrf

from arbor.middleware import is_script_request


def csrf_failure(request: HttpRequest, reason: str = "") -> HttpResponse:
    """A form refused for its CSRF token. Mostly a page drawn before the user signed in
    again (in another tab, say: signing in gives the browser a new token). The chat's
    script is told so in JSON, to show beside the message it kept; a page gets Django's
    own explanation."""
    if is_script_request(request):
        return JsonResponse(
            {
                "error": "stale_page",
                "detail": "this page's security token was refused (it is older than "
                "your last sign-in, or the browser's cookies were cleared): reload it, "
                "then send again",
            },
            status=403,
        )
    return csrf.csrf_failure(request, reason)
