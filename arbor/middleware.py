"""Errors under /api/ are JSON, even the ones Django answers before the API sees them."""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse, JsonResponse

_CODES = {404: "not_found", 405: "method_not_allowed", 400: "bad_request", 500: "server_error"}


def api_json_errors(get_response: Callable[[HttpRequest], HttpResponse]) -> Callable:
    def middleware(request: HttpRequest) -> HttpResponse:
        response = get_response(request)
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

    return middleware
