"""The NinjaAPI instance: routers, authentication and one JSON error shape for all."""

from __future__ import annotations

from typing import cast

from django.core.exceptions import RequestDataTooBig
from django.http import Http404, HttpRequest, HttpResponse
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, HttpError, ValidationError
from ninja.parser import Parser
from ninja.types import DictStrAny

from compaction.api import router as compaction_router
from conversations.api import router as tree_router
from conversations.api_imports import router as imports_router
from conversations.auth import api_auth
from conversations.errors import ArborError
from conversations.parts import NotJSON, strict_json


class StrictParser(Parser):
    """Request bodies as JSON: NaN and Infinity, which Python's json reads but JSON (and
    PostgreSQL's jsonb) does not, are refused with a 400 naming them."""

    def parse_body(self, request: HttpRequest) -> DictStrAny:
        return cast(DictStrAny, strict_json(request.body))


api = NinjaAPI(
    title="Arbor API",
    version="1.0",
    description="Conversation trees: branch, fork, checkpoint, rewind.",
    auth=api_auth,
    urls_namespace="api",
    parser=StrictParser(),
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
    code = {400: "bad_request", 403: "forbidden", 404: "not_found", 405: "method_not_allowed"}
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
