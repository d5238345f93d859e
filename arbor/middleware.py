"""Arbor's middleware, each able to run in a sync or an async chain.

Under ASGI a single sync-only middleware would make Django run the rest of the chain and
every async view (the gateway's) through thread hops and a fresh event loop per
request, so both of these take either mode.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.contrib.auth import REDIRECT_FIELD_NAME
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import resolve_url
from django.utils.decorators import sync_and_async_middleware
from django.utils.http import urlencode
from django_htmx.http import HttpResponseClientRedirect
from whitenoise.middleware import WhiteNoiseMiddleware


class StaticFiles(WhiteNoiseMiddleware):  # type: ignore[misc]  # whitenoise has no type hints
    """WhiteNoise (it serves /static/ under uvicorn too), async-capable: the lookup is
    in memory (a stat of the file in DEBUG), the file response the same in both modes."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Any = None, *args: Any, **kwargs: Any) -> None:
        super().__init__(get_response, *args, **kwargs)
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self._acall(request)
        return super().__call__(request)

    async def _acall(self, request: HttpRequest) -> Any:
        if self.autorefresh:
            static_file = self.find_file(request.path_info)
        else:
            static_file = self.files.get(request.path_info)
        if static_file is not None:
            return self.serve(static_file, request)
        return await self.get_response(request)


_CODES = {404: "not_found", 405: "method_not_allowed", 400: "bad_request", 500: "server_error"}


def _after(
    get_response: Callable[[HttpRequest], Any],
    change: Callable[[HttpRequest, HttpResponse], HttpResponse],
) -> Callable[..., Any]:
    """A middleware that changes the response, in the chain's own mode (sync or async)."""
    if iscoroutinefunction(get_response):

        async def async_middleware(request: HttpRequest) -> HttpResponse:
            return change(request, await get_response(request))

        return async_middleware

    def middleware(request: HttpRequest) -> HttpResponse:
        return change(request, get_response(request))

    return middleware


@sync_and_async_middleware
def api_json_errors(get_response: Callable[[HttpRequest], Any]) -> Callable[..., Any]:
    """Errors under /api/ are JSON, even the ones Django answers before the API sees
    them."""
    return _after(get_response, _json_error)


def _json_error(request: HttpRequest, response: HttpResponse) -> HttpResponse:
    if (
        request.path.startswith("/api/")
        and response.status_code in _CODES
        and not response.get("Content-Type", "").startswith("application/json")
    ):
        detail = {
            404: f"no such API route: {request.path}",
            405: f"{request.method} is not allowed on {request.path}",
        }.get(response.status_code, "the request could not be handled")
        replacement = JsonResponse(
            {"error": _CODES[response.status_code], "detail": detail},
            status=response.status_code,
        )
        if response.has_header("Allow"):
            replacement["Allow"] = response["Allow"]
        return replacement
    return response


@sync_and_async_middleware
def htmx_sign_in(get_response: Callable[[HttpRequest], Any]) -> Callable[..., Any]:
    """A fragment asked for after the session ended (a form opened, history loaded, a
    job polled): the whole page goes to sign in, and back to that page after it. Left to
    itself, the browser would follow the redirect and swap the sign-in page into the
    fragment's place. The page's script (a chat turn's stream, Stop) gets a 401 naming
    where to sign in instead; a form posted without JavaScript comes back to its page
    after signing in, not to the address it posted to."""
    return _after(get_response, _sign_in_page)


def _sign_in_page(request: HttpRequest, response: HttpResponse) -> HttpResponse:
    if response.status_code != 302:
        return response
    htmx = request.headers.get("HX-Request") == "true"
    script = not htmx and is_script_request(request)
    if not (htmx or script or request.method == "POST"):
        return response  # a page the browser navigated to: the redirect is right
    if request.headers.get("HX-History-Restore-Request") == "true":
        # htmx puts what a history restore gets in place of the whole page, and reads
        # no HX-Redirect there: following the redirect shows the sign-in page itself.
        return response
    login = resolve_url(settings.LOGIN_URL)
    if not response.get("Location", "").startswith(f"{login}?{REDIRECT_FIELD_NAME}="):
        return response  # not login_required's redirect (signing out, say)
    # The page the request was made from: the fragment's, or the one whose script or
    # form sent it (its Referer: the URL posted to takes only POST, and would answer
    # the way back with a 405). Only its path: never another site's address.
    address = request.headers.get("HX-Current-URL") if htmx else request.headers.get("Referer")
    current = urlsplit(address or "")
    page = current.path + (f"?{current.query}" if current.query else "") or "/"
    if not page.startswith("/") or page.startswith("//"):
        page = "/"
    sign_in = f"{login}?{urlencode({REDIRECT_FIELD_NAME: page})}"
    if htmx:
        return HttpResponseClientRedirect(sign_in)
    if not script:
        response["Location"] = sign_in
        return response
    # The chat's script (a turn's stream, Stop) would otherwise follow the redirect and
    # read the sign-in page as its answer; it keeps the unsent message and offers this.
    return JsonResponse(
        {
            "error": "not_signed_in",
            "detail": "your session has ended",
            "login": sign_in,
        },
        status=401,
    )


def is_script_request(request: HttpRequest) -> bool:
    """A request the page's own script made for a stream or JSON (the chat's fetches),
    not a page the browser navigated to (whose Accept begins with text/html)."""
    accept = request.headers.get("Accept", "")
    wanted = "text/event-stream" in accept or "application/json" in accept
    return wanted and "text/html" not in accept


@sync_and_async_middleware
def private_pages(get_response: Callable[[HttpRequest], Any]) -> Callable[..., Any]:
    """A Permissions-Policy on every response, and ``Cache-Control: no-store`` on what a
    signed-in user is shown (a shared computer's cache or a proxy keeps no copy of
    their conversations)."""
    return _after(get_response, _private)


def _private(request: HttpRequest, response: HttpResponse) -> HttpResponse:
    response.setdefault("Permissions-Policy", settings.ARBOR_PERMISSIONS_POLICY)
    # A session cookie or a credential: someone's own pages (no user lookup here, which
    # would be a database read in the gateway's async views).
    private = settings.SESSION_COOKIE_NAME in request.COOKIES or bool(
        request.headers.get("Authorization") or request.headers.get("X-Api-Key")
    )
    if private and not response.has_header("Cache-Control"):
        response["Cache-Control"] = "no-store"
    return response


@sync_and_async_middleware
def gateway_guard(get_response: Callable[[HttpRequest], Any]) -> Callable[..., Any]:
    """What the gateway's lean handler keeps of the site's security middleware: the Host
    header checked against ALLOWED_HOSTS (a 400, as the site answers) and ``nosniff`` on
    every answer (upstream error bodies are relayed with the upstream's content type)."""

    def guarded(request: HttpRequest, response: HttpResponse) -> HttpResponse:
        response.setdefault("X-Content-Type-Options", "nosniff")
        return response

    if iscoroutinefunction(get_response):

        async def async_middleware(request: HttpRequest) -> HttpResponse:
            request.get_host()  # DisallowedHost: a 400
            return guarded(request, await get_response(request))

        return async_middleware

    def middleware(request: HttpRequest) -> HttpResponse:
        request.get_host()
        return guarded(request, get_response(request))

    return middleware
