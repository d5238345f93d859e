"""The NinjaAPI instance: routers, authentication and one JSON error shape for all."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, cast

from django.conf import settings
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import RequestDataTooBig
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.parser import Parser
from ninja.types import DictStrAny

from compaction.api import router as compaction_router
from conversations.api import router as tree_router
from conversations.api_imports import router as imports_router
from conversations.auth import BearerToken, api_auth
from conversations.errors import ArborError
from conversations.parts import NotJSON, strict_json


def docs_access(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
    """The OpenAPI schema and docs, as settings.ARBOR_API_DOCS allows: "public",
    "signed-in" (a session or a bearer token; else 401, or the login page for a
    browser asking for the docs) or "off" (404)."""

    @functools.wraps(view)
    def guarded(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        mode = settings.ARBOR_API_DOCS
        if mode == "off":
            return JsonResponse(
                {"error": "not_found", "detail": "the API docs are turned off here"}, status=404
            )
        if mode == "signed-in" and not request.user.is_authenticated:
            user = None
            # The API's own bearer check; an expired token is not signed in.
            with contextlib.suppress(HttpError):
                user = BearerToken()(request)
            if user is None:
                if request.path.endswith("/docs"):
                    return redirect_to_login(request.get_full_path())
                return JsonResponse(
                    {
                        "error": "unauthorized",
                        "detail": "the API schema is for signed-in users: sign in, "
                        "or send Authorization: Bearer <token>",
                    },
                    status=401,
                )
        return view(request, *args, **kwargs)

    return guarded


class StrictParser(Parser):
    """Request bodies as JSON objects: NaN and Infinity, which Python's json reads but
    JSON (and PostgreSQL's jsonb) does not, and a body that is not an object are refused
    with a 400 naming the problem."""

    def parse_body(self, request: HttpRequest) -> DictStrAny:
        data = strict_json(request.body)
        # Every route's body is an object; ninja would read [] or 5 as "all defaults".
        if not isinstance(data, dict):
            kind = {list: "an array", str: "a string", bool: "a boolean"}.get(
                type(data), "null" if data is None else "a number"
            )
            raise NotJSON(f"the request body must be a JSON object, not {kind}")
        return cast(DictStrAny, data)


api = NinjaAPI(
    title="Arbor API",
    version="1.0",
    description="Conversation trees: branch, fork, checkpoint, rewind.",
    auth=api_auth,
    urls_namespace="api",
    parser=StrictParser(),
    docs_decorator=docs_access,
)
api.add_router("/", tree_router)
api.add_router("/", imports_router)
api.add_router("/", compaction_router)


@api.exception_handler(ArborError)
def on_arbor_error(request: HttpRequest, exc: ArborError) -> HttpResponse:
    response = api.create_response(request, exc.as_dict(), status=exc.status)
    retry_after = exc.extra.get("retry_after")
    if exc.status == 429 and isinstance(retry_after, int | float):
        response["Retry-After"] = str(max(1, round(retry_after)))
    return response


@api.exception_handler(ValidationError)
def on_validation_error(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    errors = [
        {
            "loc": ".".join(str(x) for x in e.get("loc", ())),
            "msg": str(e.get("msg", "")),
        }
        for e in exc.errors
    ]
    detail = "; ".join(f"{e['loc']}: {e['msg']}" for e in errors) or "the request is not valid"
    return api.create_response(
        request, {"error": "invalid", "detail": detail, "errors": errors}, status=422
    )


@api.exception_handler(AuthenticationError)
def on_unauthenticated(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
    return api.create_response(
        request,
        {"error": "unauthorized", "detail": "sign in, or send Authorization: Bearer <token>"},
        status=401,
    )


@api.exception_handler(HttpError)
def on_http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
    code = {
        400: "bad_request",
        401: "unauthorized",
        403: "forbidden",
        404: "not_found",
        405: "method_not_allowed",
    }
    detail = str(exc)
    if isinstance(exc.__cause__, NotJSON):  # ninja's "Cannot parse request body"
        detail = f"{detail}: {exc.__cause__}"
    return api.create_response(
        request,
        {"error": code.get(exc.status_code, "error"), "detail": detail},
        status=exc.status_code,
    )


@api.exception_handler(Http404)
def on_not_found(request: HttpRequest, exc: Http404) -> HttpResponse:
    return api.create_response(
        request, {"error": "not_found", "detail": str(exc) or "not found"}, status=404
    )


@api.exception_handler(RequestDataTooBig)
def on_too_big(request: HttpRequest, exc: RequestDataTooBig) -> HttpResponse:
    return api.create_response(
        request, {"error": "too_large", "detail": "the request body is too large"}, status=413
    )
